"""What reaching a rank's file through its descriptor costs (``offloadd.transfer.guarded``).

The daemon never maps a rank's shared-memory file (a truncated or sparse one would SIGBUS
it): the cpu copy engine moves each copy with ``pread`` (store) or ``pwrite`` (load) on the
file's descriptor. Baseline: ``memmove`` through a ``MAP_SHARED`` mapping of the same file,
the path the daemon took before, with the same moves.

- ``guarded_store_<page>`` / ``guarded_load_<page>``: GB/s of one job of ``TOTAL`` bytes in
  ``<page>`` pages, scattered over the file in a random order (as a job's blocks are) and
  contiguous in an arena-like buffer, one thread; merged as the engine merges them. Reps
  alternate with the baseline and each pair is compared.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import time
import uuid

from offloadd.bench._util import Context, Result, paired_ratio
from offloadd.transfer.batch import move_arrays
from offloadd.transfer.guarded import FileWindow, guarded_copy, reserve, unreserve
from offloadd.transfer.types import Direction

PAGES = {16 << 10: "16KiB", 64 << 10: "64KiB", 1 << 20: "1MiB"}
TOTAL = 128 << 20


def _moves(
    direction: Direction, rank: int, host: int, pages: list[int], size: int
) -> list[tuple[int, int, int]]:
    """The job: ``pages`` of the rank's file, in that order, to consecutive host slots."""
    pairs = [(rank + page * size, host + i * size) for i, page in enumerate(pages)]
    if direction is Direction.STORE:
        return [(r, h, size) for r, h in pairs]
    return [(h, r, size) for r, h in pairs]


def run(ctx: Context) -> list[Result]:
    """``guarded_store_<page>`` and ``guarded_load_<page>`` for each page size."""
    total = ctx.pick(TOTAL, TOTAL // 2, 8 << 20)
    reps = ctx.pick(11, 5, 2)
    wanted = [
        (direction, size, label)
        for size, label in PAGES.items()
        for direction in Direction
        if ctx.wanted(f"guarded_{direction.value}_{label}")
    ]
    if not wanted:
        return []
    path = f"/dev/shm/{ctx.scratch.shm_prefix}-guarded-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    results: list[Result] = []
    try:
        os.posix_fallocate(fd, 0, total)
        mapping = mmap.mmap(fd, total, mmap.MAP_SHARED)
        mapped = (ctypes.c_char * total).from_buffer(mapping)
        arena = (ctypes.c_char * total)()
        ctypes.memset(mapped, 0x5A, total)  # every page of both touched before timing
        ctypes.memset(arena, 0, total)
        window = FileWindow(reserve(total), total, fd)
        try:
            for direction, size, label in wanted:
                name = f"guarded_{direction.value}_{label}"
                ctx.progress(f"guarded: {total >> 20} MiB in {label} pages, {reps} reps")
                order = list(range(total // size))
                random.Random(size).shuffle(order)
                host = ctypes.addressof(arena)
                through_fd = move_arrays(
                    _moves(direction, window.address, host, order, size), direction
                )
                through_map = move_arrays(
                    _moves(direction, ctypes.addressof(mapped), host, order, size), direction
                ).triples()
                guarded: list[float] = []
                mapped_rates: list[float] = []
                for _ in range(reps):
                    started = time.perf_counter()
                    guarded_copy(through_fd, direction, [window])
                    guarded.append(total / (time.perf_counter() - started) / 1e9)
                    started = time.perf_counter()
                    for src, dst, nbytes in through_map:
                        ctypes.memmove(dst, src, nbytes)
                    mapped_rates.append(total / (time.perf_counter() - started) / 1e9)
                results.append(
                    Result(
                        name,
                        sorted(guarded)[reps // 2],
                        "GB/s",
                        sorted(mapped_rates)[reps // 2],
                        paired_ratio(guarded, mapped_rates),
                        {"page_bytes": size, "bytes": total, "reps": reps},
                    )
                )
        finally:
            unreserve(window.address, total)
            del mapped
            mapping.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return results

"""What the journal's checksums cost: ``offloadd.checksum.checksum`` (xxh3_64) over shard-sized
extents, against ``memmove`` of the same extents (what the copy that precedes it costs).

- ``checksum_<size>``: GB/s of checksumming 256 MiB of arena in ``<size>`` extents, one
  thread; baseline: GB/s of copying the same extents into a second buffer. The ratio says
  how much the seal after a store's copy adds (1.0: as much again as the copy; the daemon
  runs it on up to 4 threads, off the event loop). Reps alternate and each pair is compared.
"""

from __future__ import annotations

import ctypes
import time

from offloadd.bench._util import Context, Result, paired_ratio
from offloadd.checksum import checksum

SIZES = {64 << 10: "64KiB", 1 << 20: "1MiB", 8 << 20: "8MiB"}
TOTAL = 256 << 20  # more than the CPU caches: every extent comes from memory
SMOKE_TOTAL = 16 << 20  # --smoke: two 8 MiB extents


def run(ctx: Context) -> list[Result]:
    """``checksum_<size>`` for each size."""
    reps = ctx.pick(15, 5, 2)
    total = ctx.pick(TOTAL, TOTAL, SMOKE_TOTAL)
    source = (ctypes.c_char * total)()
    target = (ctypes.c_char * total)()
    ctypes.memset(source, 0x5A, total)  # touch every page of both before timing
    ctypes.memset(target, 0, total)
    src, dst = ctypes.addressof(source), ctypes.addressof(target)
    results = []
    for size, label in SIZES.items():
        name = f"checksum_{label}"
        if not ctx.wanted(name):
            continue
        ctx.progress(f"checksum: {total >> 20} MiB in {label} extents, {reps} reps")
        sums: list[float] = []
        copies: list[float] = []
        for _ in range(reps):
            started = time.perf_counter()
            for offset in range(0, total, size):
                checksum(src + offset, size)
            sums.append(total / (time.perf_counter() - started) / 1e9)
            started = time.perf_counter()
            for offset in range(0, total, size):
                ctypes.memmove(dst + offset, src + offset, size)
            copies.append(total / (time.perf_counter() - started) / 1e9)
        value, baseline = sorted(sums)[reps // 2], sorted(copies)[reps // 2]
        results.append(
            Result(
                name,
                value,
                "GB/s",
                baseline,
                paired_ratio(sums, copies),
                {"extent_bytes": size, "bytes": total, "reps": reps, "checksum": "xxh3_64"},
            )
        )
    return results

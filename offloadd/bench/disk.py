"""What the disk tier costs over plain file I/O of the same bytes (``offloadd.tiers.disk``).

- ``disk_write_<size>``: GB/s of ``DiskTier.put`` of N chunks of ``<size>`` (two shards
  each) from an arena in /dev/shm into a directory under /tmp; baseline: one plain file
  written sequentially with the same bytes straight from the arena (``pwritev`` of the
  shards), in the same I/O mode as the tier (O_DIRECT where the tier uses it).
- ``disk_read_<size>``: GB/s of ``DiskTier.get`` of the same chunks into other extents;
  baseline: the plain file read back sequentially (``preadv`` into the same extents).

Neither side fsyncs (the tier does not). With direct I/O both sides bypass the page cache,
so reads come from the device; without it (``params["reads_cached"]``) both read what was
just written, from the page cache. The page cache is never dropped system-wide. Reps
alternate tier and baseline and each pair is compared.
"""

from __future__ import annotations

import os
import shutil
import time

from offloadd.bench._util import Context, Result, paired_ratio, size_name
from offloadd.cache.arena import Arena
from offloadd.tiers.base import ChunkAddress
from offloadd.tiers.disk import DiskTier

CHUNK = 1 << 20
SHARDS = 2
NS = "bench"
THREADS = 4  # the tier's default: I/O threads within one put or get


def run(ctx: Context) -> list[Result]:
    """``disk_write_<size>`` and ``disk_read_<size>``."""
    label = size_name(CHUNK)
    names = [f"disk_write_{label}", f"disk_read_{label}"]
    if not any(ctx.wanted(name) for name in names):
        return []
    count = ctx.pick(256, 64, 8)
    reps = ctx.pick(7, 3, 2)
    total = count * CHUNK
    directory = os.path.join(ctx.scratch.workdir, "disk")
    arena = Arena(ctx.scratch.shm_path("disk-arena"), 2 * total)
    tier = DiskTier(os.path.join(directory, "tier"), 4 * total, threads=THREADS)
    plain = os.path.join(directory, "plain")
    try:
        arena.view(0, total)[:] = os.urandom(total)
        shard = CHUNK // SHARDS
        sources = [_chunk(i, i * CHUNK, shard) for i in range(count)]
        targets = [_chunk(i, total + i * CHUNK, shard) for i in range(count)]
        flags = os.O_DIRECT if tier.direct_io else 0
        ctx.progress(
            f"disk: {count} chunks of {label}, {'direct' if flags else 'buffered'} I/O, {reps} reps"
        )
        rates: dict[str, list[float]] = {"write": [], "read": [], "pwrite": [], "pread": []}
        for _ in range(reps):
            tier.clear(NS)
            started = time.perf_counter()
            stored = tier.put(sources, arena).stored
            rates["write"].append(total / (time.perf_counter() - started) / 1e9)
            rates["pwrite"].append(_plain(plain, arena, sources, flags, write=True))
            started = time.perf_counter()
            found = tier.get(targets, arena)
            rates["read"].append(total / (time.perf_counter() - started) / 1e9)
            rates["pread"].append(_plain(plain, arena, targets, flags, write=False))
            if not all(stored) or not all(found):
                raise RuntimeError(f"disk tier stored {sum(stored)}, found {sum(found)}")
        if arena.view(0, total) != arena.view(total, total):
            raise RuntimeError("disk tier read back other bytes than it wrote")
        params = {
            "chunks": count,
            "chunk_bytes": CHUNK,
            "shards": SHARDS,
            "reps": reps,
            "direct_io": tier.direct_io,
            "tier_threads": THREADS,
            "reads_cached": not tier.direct_io,
            "directory": directory,
        }
        results = []
        for kind, baseline in (("write", "pwrite"), ("read", "pread")):
            name = f"disk_{kind}_{label}"
            if ctx.wanted(name):
                results.append(
                    Result(
                        name,
                        sorted(rates[kind])[reps // 2],
                        "GB/s",
                        sorted(rates[baseline])[reps // 2],
                        paired_ratio(rates[kind], rates[baseline]),
                        dict(params),
                    )
                )
        return results
    finally:
        tier.close()
        arena.close()
        shutil.rmtree(directory, ignore_errors=True)


def _chunk(index: int, offset: int, shard: int) -> ChunkAddress:
    extents = tuple((offset + i * shard, shard) for i in range(SHARDS))
    return ChunkAddress(NS, index.to_bytes(8, "little"), extents)


def _plain(
    path: str, arena: Arena, chunks: list[ChunkAddress], flags: int, *, write: bool
) -> float:
    """GB/s of writing (or reading) ``chunks`` as one sequential file at ``path``."""
    mode = os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY
    started = time.perf_counter()
    fd = os.open(path, mode | flags | os.O_CLOEXEC, 0o600)
    try:
        offset = 0
        for chunk in chunks:
            views = [arena.view(o, s) for o, s in chunk.extents]
            moved = os.pwritev(fd, views, offset) if write else os.preadv(fd, views, offset)
            for view in views:
                view.release()
            if moved != chunk.nbytes:
                raise RuntimeError(f"plain file moved {moved} of {chunk.nbytes} bytes")
            offset += moved
    finally:
        os.close(fd)
    return offset / (time.perf_counter() - started) / 1e9

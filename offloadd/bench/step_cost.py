"""A scheduler's step through the cache alone, on a full arena: what the daemon's CPU per
stored chunk starts from (``daemon_cpu_per_chunk`` adds the messages, copies and journal).

- ``store_step_cost``: ns per key of a step of 100 new keys as vLLM's scheduler and its rank
  make it: ``reserve`` (evicting as many committed keys, the scheduler's mirror acknowledging
  its own removals), ``begin_store(allocate=False)``, ``finish_store``, then the mirror's
  ``ack``, on an arena of 8,192 chunks of 4 KiB kept full (the trace's geometry).
  Baseline: the same keys stored by a rank alone (``begin_store`` allocating and evicting,
  ``finish_store``, nobody mirroring) on a cache of the same size, rounds taking turns.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Sequence

from offloadd.bench._util import Context, Result, median, paired_ratio
from offloadd.cache.index import ChunkCache

NAMESPACE = "bench/step"
CHUNK = 4096
CHUNKS = 8192
STEP_KEYS = 100
SCHEDULER = "scheduler"


def _sizes(_key: bytes) -> tuple[int, ...]:
    return (CHUNK,)


def _keys(count: int, rnd: random.Random) -> list[bytes]:
    return [rnd.randbytes(32) + bytes(4) for _ in range(count)]


def _full(watched: bool, rnd: random.Random) -> ChunkCache:
    cache = ChunkCache(CHUNKS * CHUNK)
    if watched:
        cache.watch(NAMESPACE, SCHEDULER)
    for start in range(0, CHUNKS, STEP_KEYS):
        keys = _keys(min(STEP_KEYS, CHUNKS - start), rnd)
        cache.finish_store(cache.begin_store(NAMESPACE, keys, 0, _sizes).writes, ok=True)
    return cache


def _scheduler_steps(cache: ChunkCache, steps: Sequence[list[bytes]]) -> float:
    started = time.perf_counter()
    for keys in steps:
        cache.reserve(NAMESPACE, keys, SCHEDULER, _sizes, acker=SCHEDULER)
        writes = cache.begin_store(NAMESPACE, keys, 0, _sizes, allocate=False).writes
        cache.finish_store(writes, ok=True)
        cache.ack(SCHEDULER, cache.seq)
    return time.perf_counter() - started


def _rank_steps(cache: ChunkCache, steps: Sequence[list[bytes]]) -> float:
    started = time.perf_counter()
    for keys in steps:
        cache.finish_store(cache.begin_store(NAMESPACE, keys, 0, _sizes).writes, ok=True)
    return time.perf_counter() - started


def run(ctx: Context) -> list[Result]:
    """``store_step_cost``."""
    if not ctx.wanted("store_step_cost"):
        return []
    rounds = ctx.pick(15, 7, 2)
    steps_per_round = ctx.pick(50, 20, 3)
    rnd = random.Random(43)
    ctx.progress(f"index: {rounds} rounds of {steps_per_round} steps on a full arena")
    scheduler, rank = _full(True, rnd), _full(False, rnd)
    values: list[float] = []
    baselines: list[float] = []
    per_key = 1e9 / (steps_per_round * STEP_KEYS)
    gc.collect()
    gc.freeze()  # both caches are long-lived
    try:
        for index in range(rounds + 1):  # round 0 warms up
            steps = [_keys(STEP_KEYS, rnd) for _ in range(steps_per_round)]
            if index % 2:
                value, base = _scheduler_steps(scheduler, steps), _rank_steps(rank, steps)
            else:
                base, value = _rank_steps(rank, steps), _scheduler_steps(scheduler, steps)
            if index:
                values.append(value * per_key)
                baselines.append(base * per_key)
    finally:
        gc.unfreeze()
    stats = scheduler.stats()
    assert stats.committed == CHUNKS and stats.evictions > 0, stats  # full and evicting
    value, base = median(values), median(baselines)
    paired = paired_ratio(values, baselines)
    params = {
        "keys_per_step": STEP_KEYS,
        "steps_per_round": steps_per_round,
        "rounds": rounds,
        "arena_chunks": CHUNKS,
        "chunk_bytes": CHUNK,
        "baseline": "the same keys stored by a rank alone, allocating and evicting",
        "ratio": "median of per-round ratios, rounds taking turns",
    }
    ctx.progress(f"  store_step_cost: {value:.0f} vs {base:.0f} ns/key ({paired:.2f})")
    return [Result("store_step_cost", value, "ns/key", base, paired, params)]

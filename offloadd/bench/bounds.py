"""What the bounds per tenant cost the pure ``ChunkCache`` (issue 22).

- ``pinned_lookup_tenant_ns``: ns per key of a pinned ``lookup`` of 32 committed keys (the
  pins extended each time) counted towards an engine and its tenant, both bounded, the
  tenant having 8 engines of 8 pinning sessions each, vs the same lookups counted towards
  the engine alone (the per-engine bound that came before), same rounds interleaved.
- ``reserve_store_lease_ns``: ns per key of ``reserve`` + ``begin_store(allocate=False)`` +
  ``finish_store`` of 32 new keys with reservations on a lease, vs without a lease.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from offloadd.bench._util import Context, Result, median, paired_ratio
from offloadd.cache.index import ChunkCache

NAMESPACE = "bench/bounds"
SHARD = 4096
BATCH = 32
KEYS = 4096
ENGINES = 8
SESSIONS = 8  # per engine: the tenant has ENGINES * SESSIONS owners with pins


def _sizes(_key: bytes) -> tuple[int, ...]:
    return (SHARD,)


def _keys(count: int, seed: int) -> list[bytes]:
    rnd = random.Random(seed)
    return [rnd.randbytes(32) + bytes(4) for _ in range(count)]


def _pinned_cache(keys: list[bytes], *, tenant: bool) -> ChunkCache:
    capacity = (KEYS + BATCH) * SHARD * 4
    cache = ChunkCache(capacity, budget=capacity, tenant_budget=capacity if tenant else None)
    for start in range(0, len(keys), BATCH):
        res = cache.begin_store(NAMESPACE, keys[start : start + BATCH], 0, _sizes)
        cache.finish_store(res.writes, ok=True)
    rnd = random.Random(3)
    for engine in range(ENGINES):
        for session in range(SESSIONS):
            cache.lookup(
                NAMESPACE,
                rnd.sample(keys, BATCH),
                pin_owner=f"s{engine}.{session}",
                lease=600,
                account=("e", engine),
                tenant="u1000" if tenant else None,
            )
    return cache


def _time_pinned(cache: ChunkCache, batches: list[list[bytes]], tenant: str | None) -> float:
    lookup = cache.lookup
    started = time.perf_counter()
    for batch in batches:
        lookup(NAMESPACE, batch, pin_owner="s0.0", lease=600, account=("e", 0), tenant=tenant)
    return time.perf_counter() - started


def _time_reserve(cache: ChunkCache, batches: list[list[bytes]]) -> float:
    reserve, begin, finish = cache.reserve, cache.begin_store, cache.finish_store
    started = time.perf_counter()
    for batch in batches:
        reserve(NAMESPACE, batch, "sched", _sizes, account=("e", 0), tenant="u1000")
        finish(begin(NAMESPACE, batch, 0, _sizes, allocate=False).writes, ok=True)
    return time.perf_counter() - started


def _rounds(
    rounds: int, value: Callable[[int], float], baseline: Callable[[int], float]
) -> tuple[list[float], list[float]]:
    values: list[float] = []
    baselines: list[float] = []
    for index in range(rounds + 1):  # round 0 warms up
        pair = (value, baseline) if index % 2 == 0 else (baseline, value)
        first, second = pair[0](index), pair[1](index)
        if index:
            v, b = (first, second) if index % 2 == 0 else (second, first)
            values.append(v)
            baselines.append(b)
    return values, baselines


def run(ctx: Context) -> list[Result]:
    """``pinned_lookup_tenant_ns``, ``reserve_store_lease_ns``."""
    rounds = ctx.pick(15, 7, 2)
    per_round = ctx.pick(2000, 500, 100)
    results: list[Result] = []
    if ctx.wanted("pinned_lookup_tenant_ns"):
        ctx.progress(f"bounds: pinned lookups, {rounds} rounds of {per_round}")
        keys = _keys(KEYS, 1)
        both, engine_only = _pinned_cache(keys, tenant=True), _pinned_cache(keys, tenant=False)
        rnd = random.Random(5)
        batches = [rnd.sample(keys, BATCH) for _ in range(per_round)]
        scale = 1e9 / (per_round * BATCH)
        values, baselines = _rounds(
            rounds,
            lambda _i: _time_pinned(both, batches, "u1000") * scale,
            lambda _i: _time_pinned(engine_only, batches, None) * scale,
        )
        value, base = median(values), median(baselines)
        paired = paired_ratio(values, baselines)
        ctx.progress(f"  pinned_lookup_tenant_ns: {value:.0f} vs {base:.0f} ns/key ({paired:.2f})")
        params = {
            "keys_per_lookup": BATCH,
            "lookups_per_round": per_round,
            "rounds": rounds,
            "tenant_owners": ENGINES * SESSIONS,
            "baseline": "the same pinned lookups counted towards the engine only",
            "ratio": "median of per-round ratios, timed back to back",
            "goal": "ratio <= 1.5",
        }
        results.append(Result("pinned_lookup_tenant_ns", value, "ns/key", base, paired, params))
    if ctx.wanted("reserve_store_lease_ns"):
        ctx.progress(f"bounds: reserve + store, {rounds} rounds of {per_round // 5}")
        capacity = (per_round // 5 + 1) * BATCH * SHARD * (rounds + 2)
        leased = ChunkCache(capacity, reservation_lease=5.0, tenant_budget=capacity)
        plain = ChunkCache(capacity, tenant_budget=capacity)
        fresh = [
            [_keys(BATCH, (index << 20) + i) for i in range(per_round // 5)]
            for index in range(rounds + 1)
        ]
        scale = 1e9 / (per_round // 5 * BATCH)
        values, baselines = _rounds(
            rounds,
            lambda i: _time_reserve(leased, fresh[i]) * scale,
            lambda i: _time_reserve(plain, fresh[i]) * scale,
        )
        value, base = median(values), median(baselines)
        paired = paired_ratio(values, baselines)
        ctx.progress(f"  reserve_store_lease_ns: {value:.0f} vs {base:.0f} ns/key ({paired:.2f})")
        params = {
            "keys_per_reserve": BATCH,
            "reserves_per_round": per_round // 5,
            "rounds": rounds,
            "lease_seconds": 5.0,
            "baseline": "the same reservations and stores without a lease",
            "ratio": "median of per-round ratios, timed back to back",
            "goal": "ratio <= 1.2",
        }
        results.append(Result("reserve_store_lease_ns", value, "ns/key", base, paired, params))
    return results

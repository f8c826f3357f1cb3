"""How cost grows with the index: the pure ``ChunkCache`` at 10k, 100k and 1M committed keys.

- ``lookup_cost_<n>``: ns per key of ``lookup`` on batches of 32 random committed keys,
  fresh copies as decoded from a request (every key a hit, so every key is also touched in
  the LRU order). Random keys over the whole index: the worst case for CPU caches.
- ``lookup_hot_cost_<n>``: the same, with keys drawn from a fixed random set of 10k keys at
  every size: the CPU caches hold the same working set, so what grows is the structure.
- ``store_cost_<n>``: ns per key of ``begin_store`` + ``finish_store`` of 32 new keys at a
  time (no eviction: the capacity is large); the new keys are removed, untimed, after each
  round so the index stays at ``n``.
  Both have the 10k figure of the same round as their baseline; the sizes take turns.
- ``dict_probe_10k`` / ``dict_probe_1M``: the floor under ``lookup``: the ``lookup_cost`` of
  that size (value) against a plain ``dict`` probe (``get``) of the same batches of the same
  key copies, in a dict of the same keys (baseline), timed in the same round.
- ``index_bytes_per_entry``: resident memory per committed entry of a 1M-entry index built
  in a fresh subprocess (RSS delta; the key objects the index keeps are included, the
  benchmark's own list of them is not), against the raw key bytes.
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence

from offloadd.bench._util import IMPORT_ROOT, Context, Result, median, paired_ratio
from offloadd.cache.index import ChunkCache

SIZES = (10_000, 100_000, 1_000_000)
NAMES = {10_000: "10k", 100_000: "100k", 1_000_000: "1M"}
KEY_BYTES = 36  # 32-byte hash + u32 group, as vLLM's offload keys
SHARD = 64 << 10
BATCH = 32
HOT_KEYS = 10_000  # lookup_hot_cost_*: keys drawn from this many, at every index size
PROBED = (10_000, 1_000_000)  # dict_probe_*: sizes whose lookups are set against a dict
# --smoke: no 1M index (about 10 s to build here, and as long again for its memory).
SMOKE_SIZES = (10_000, 100_000)
SMOKE_ENTRIES = 100_000
NAMESPACE = "bench/model@0123456789abcdef"


def make_keys(count: int, seed: int) -> list[bytes]:
    rnd = random.Random(seed)
    return [rnd.randbytes(KEY_BYTES - 4) + bytes(4) for _ in range(count)]


def build(keys: Sequence[bytes], shards: int = 1, spare: int = 0) -> ChunkCache:
    """A cache holding ``keys`` committed, with room for ``spare`` more entries."""
    sizes = (SHARD,) * shards
    cache = ChunkCache((len(keys) + spare) * shards * SHARD)

    def shard_sizes(key: bytes) -> tuple[int, ...]:
        return sizes

    for start in range(0, len(keys), BATCH):
        batch = keys[start : start + BATCH]
        for shard in range(shards):
            reservation = cache.begin_store(NAMESPACE, batch, shard, shard_sizes)
            cache.finish_store(reservation.writes, ok=True)
    return cache


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_memory(count: int, shards: int) -> dict[str, float]:
    """Run in a fresh process: RSS per entry of an index of ``count`` committed keys."""
    gc.collect()
    before = _rss()
    keys = make_keys(count, 7)
    cache = build(keys, shards)
    gc.collect()
    after = _rss()
    own_list = sys.getsizeof(keys)  # the benchmark's list, not the index's
    assert cache.stats().committed == count
    return {"bytes_per_entry": (after - before - own_list) / count, "entries": count}


def _memory_in_subprocess(count: int, shards: int) -> dict[str, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = IMPORT_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    output = subprocess.run(
        [sys.executable, "-m", "offloadd.bench.growth", str(count), str(shards)],
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    ).stdout
    result = json.loads(output)
    assert isinstance(result, dict)
    return result


def run(ctx: Context) -> list[Result]:
    """``lookup_cost_*``, ``store_cost_*``, ``index_bytes_per_entry``."""
    results: list[Result] = []
    wanted_costs = any(
        ctx.wanted(f"{kind}_cost_{NAMES[n]}")
        for kind in ("lookup", "lookup_hot", "store")
        for n in SIZES
    ) or any(ctx.wanted(f"dict_probe_{NAMES[n]}") for n in PROBED)
    if wanted_costs:
        results += _costs(ctx)
    if ctx.wanted("index_bytes_per_entry"):
        entries = ctx.pick(1_000_000, 1_000_000, SMOKE_ENTRIES)
        ctx.progress(f"index memory: {entries:,} committed entries in a fresh process (RSS delta)")
        memory = _memory_in_subprocess(entries, 1)
        value = memory["bytes_per_entry"]
        params = {
            "entries": entries,
            "shards_per_entry": 1,
            "method": "RSS delta in a fresh process, key objects included",
            "baseline": f"raw key bytes ({KEY_BYTES})",
            "goal": "value <= 200",
        }
        results.append(
            Result("index_bytes_per_entry", value, "B", KEY_BYTES, value / KEY_BYTES, params)
        )
        ctx.progress(f"  index_bytes_per_entry: {value:.0f} B")
    return [r for r in results if ctx.wanted(r.name)]


def _costs(ctx: Context) -> list[Result]:
    sizes = ctx.pick(SIZES, SIZES, SMOKE_SIZES)
    probed = tuple(n for n in PROBED if n in sizes)
    rounds = ctx.pick(15, 7, 2)
    lookups_per_round = ctx.pick(3000, 1000, 100)
    stores_per_round = ctx.pick(300, 100, 10)
    caches: dict[int, ChunkCache] = {}
    keys: dict[int, list[bytes]] = {}
    plain: dict[int, dict[bytes, int]] = {}
    fresh: dict[int, list[list[bytes]]] = {}
    for n in sizes:
        ctx.progress(f"index: building a cache of {n:,} committed keys")
        keys[n] = make_keys(n, n)
        caches[n] = build(keys[n], spare=stores_per_round * BATCH)
        if n in probed:
            plain[n] = {key: i for i, key in enumerate(keys[n])}
        rnd = random.Random(n + 1)
        fresh[n] = [
            make_keys(stores_per_round * BATCH, rnd.randrange(1 << 30)) for _ in range(rounds + 1)
        ]
    gc.collect()
    gc.freeze()  # the caches are long-lived: keep the collector from walking them
    lookup_times: dict[int, list[float]] = {n: [] for n in sizes}
    probe_times: dict[int, list[float]] = {n: [] for n in probed}
    hot_times: dict[int, list[float]] = {n: [] for n in sizes}
    hot = {n: random.Random(n + 2).sample(keys[n], HOT_KEYS) for n in sizes}
    store_times: dict[int, list[float]] = {n: [] for n in sizes}
    ctx.progress(f"index: {rounds} rounds of lookups and stores, sizes taking turns")
    try:
        for round_index in range(rounds + 1):  # round 0 warms up
            order = sizes if round_index % 2 == 0 else tuple(reversed(sizes))
            for n in order:
                rnd = random.Random(round_index * 31 + n)
                # Copies, as keys decoded from a request are new objects (hashed afresh).
                batches = [
                    [bytes(memoryview(key)) for key in rnd.sample(keys[n], BATCH)]
                    for _ in range(lookups_per_round)
                ]
                seconds = _time_lookups(caches[n], batches)
                if round_index:
                    lookup_times[n].append(seconds * 1e9 / (lookups_per_round * BATCH))
                if n in probed:
                    seconds = _time_probes(plain[n], batches)
                    if round_index:
                        probe_times[n].append(seconds * 1e9 / (lookups_per_round * BATCH))
                batches = [
                    [bytes(memoryview(key)) for key in rnd.sample(hot[n], BATCH)]
                    for _ in range(lookups_per_round)
                ]
                seconds = _time_lookups(caches[n], batches)
                if round_index:
                    hot_times[n].append(seconds * 1e9 / (lookups_per_round * BATCH))
                new = fresh[n][round_index]
                seconds = _time_stores(caches[n], new)
                if round_index:
                    store_times[n].append(seconds * 1e9 / len(new))
    finally:
        gc.unfreeze()
    results = []
    base_n = sizes[0]
    for kind, times, unit_params in (
        (
            "lookup",
            lookup_times,
            {"keys_per_lookup": BATCH, "lookups_per_round": lookups_per_round},
        ),
        (
            "lookup_hot",
            hot_times,
            {
                "keys_per_lookup": BATCH,
                "lookups_per_round": lookups_per_round,
                "hot_keys": HOT_KEYS,
            },
        ),
        (
            "store",
            store_times,
            {"keys_per_store": BATCH, "keys_per_round": stores_per_round * BATCH},
        ),
    ):
        base = median(times[base_n])
        for n in sizes:
            value = median(times[n])
            paired = paired_ratio(times[n], times[base_n])
            params = {
                "committed_keys": n,
                "rounds": rounds,
                "policy": "lru",
                "baseline": "the 10k figure",
                "ratio": "median of per-round ratios to the 10k figure of the same round",
                **unit_params,
            }
            if n == SIZES[-1] and kind != "lookup_hot":
                params["goal"] = "ratio <= 1.5" if kind == "lookup" else "ratio <= 1.2"
            name = f"{kind}_cost_{NAMES[n]}"
            results.append(Result(name, value, "ns/key", base, paired, params))
            ctx.progress(f"  {name}: {value:.0f} ns/key ({paired:.2f} of 10k)")
    for n in probed:
        value, base = median(lookup_times[n]), median(probe_times[n])
        paired = paired_ratio(lookup_times[n], probe_times[n])
        params = {
            "committed_keys": n,
            "rounds": rounds,
            "keys_per_lookup": BATCH,
            "lookups_per_round": lookups_per_round,
            "value": f"lookup_cost_{NAMES[n]}",
            "baseline": "list(map(dict.get, batch)), same key copies, a dict of the same keys",
            "ratio": "median of per-round ratios, timed back to back",
        }
        if n == PROBED[0]:
            params["goal"] = "ratio <= 4"
        name = f"dict_probe_{NAMES[n]}"
        results.append(Result(name, value, "ns/key", base, paired, params))
        ctx.progress(f"  {name}: lookup {value:.0f} ns/key vs dict {base:.0f} ({paired:.2f})")
    return results


def _time_lookups(cache: ChunkCache, batches: Sequence[Sequence[bytes]]) -> float:
    lookup = cache.lookup
    started = time.perf_counter()
    for batch in batches:
        lookup(NAMESPACE, batch)
    return time.perf_counter() - started


def _time_probes(table: dict[bytes, int], batches: Sequence[Sequence[bytes]]) -> float:
    """A probe of each key at C speed (``map``), the fastest a Python caller can ask."""
    get = table.get
    started = time.perf_counter()
    for batch in batches:
        list(map(get, batch))
    return time.perf_counter() - started


def _time_stores(cache: ChunkCache, keys: list[bytes]) -> float:
    sizes = (SHARD,)

    def shard_sizes(key: bytes) -> tuple[int, ...]:
        return sizes

    begin = cache.begin_store
    finish = cache.finish_store
    batches = [keys[i : i + BATCH] for i in range(0, len(keys), BATCH)]
    started = time.perf_counter()
    for batch in batches:
        reservation = begin(NAMESPACE, batch, 0, shard_sizes)
        finish(reservation.writes, ok=True)
    seconds = time.perf_counter() - started
    cache.remove(NAMESPACE, keys)
    return seconds


if __name__ == "__main__":
    print(json.dumps(measure_memory(int(sys.argv[1]), int(sys.argv[2]))))

"""Two data-parallel vLLM engines sharing one arena smaller than their working set.

``shared_cache_hit_rate``: the chunk hit rate of a prefix-sharing workload (Zipf-popular
documents of 4 chunks, each request one of them plus a chunk of its own, round robin over
the two engines) through vLLM 0.33's real ``Scheduler`` and worker ``OffloadingConnector``
(the test harness in ``tests/vllm/harness.py``, as ``vllm_step``), both
engines on one daemon subprocess. Baseline: an exact shared LRU of the arena's capacity over
the same requests, computed in the same run (``shared_lru_hits``). Goal: within 10% of it.

``shared_cache_refused``: the keys the daemon refused (every reason) against the keys
offered (every chunk of every request). Goal: at most 1%.

Each request starts with the engine's GPU prefix cache reset, so every hit is an offload
hit, and every loaded page is checked against the bytes of its prefix. Params give the
refusals by reason, the evictions and the hit rate of two private LRUs of half the capacity
each (what the engines would get without sharing).

The workload and the shared LRU are also what ``tests/vllm/test_shared_cache.py`` asserts.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._harness import harness_modules
from offloadd.bench._util import Context, Result, ratio

__all__ = [
    "ARENA_CHUNKS",
    "BLOCK",
    "CHUNK_BYTES",
    "chunk_keys",
    "run",
    "shared_lru_hits",
    "workload",
]

BLOCK = 16  # tokens per block and per chunk (the harness's default block size)
CHUNK_BYTES = 4096  # one aligned extent per chunk of the harness's tiny model
ARENA_CHUNKS = 40
DOCUMENTS = 24
DOCUMENT_CHUNKS = 4
REQUESTS = 160


def workload(seed: int = 7, requests: int = REQUESTS) -> list[list[int]]:
    """Zipf-popular documents of 4 chunks, each request one of them plus 21 tokens of its
    own (one more full chunk): 24 x 4 shared chunks plus one unique chunk per request."""
    rnd = random.Random(seed)
    docs = [
        [rnd.randrange(3, 1000) for _ in range(DOCUMENT_CHUNKS * BLOCK)] for _ in range(DOCUMENTS)
    ]
    weights = [1 / (rank + 1) for rank in range(DOCUMENTS)]
    prompts = []
    for _ in range(requests):
        (doc,) = rnd.choices(docs, weights)
        prompts.append(doc + [rnd.randrange(3, 1000) for _ in range(BLOCK + 5)])
    return prompts


def chunk_keys(prompt: Sequence[int]) -> list[Hashable]:
    """A stand-in for each full chunk's key: the prefix it ends."""
    return [tuple(prompt[: (i + 1) * BLOCK]) for i in range(len(prompt) // BLOCK)]


def shared_lru_hits(requests: Sequence[Sequence[Hashable]], capacity: int) -> int:
    """Prefix hits of an exact shared LRU cache of ``capacity`` chunks over ``requests`` (each
    its chunk keys in order), as a vLLM engine drives an offload cache: the leading keys
    present hit and are touched; from the first miss on, every absent key is stored (most
    recent), evicting the least recently used; present keys after a miss are left as they
    are. Returns the hit keys."""
    cache: OrderedDict[Hashable, None] = OrderedDict()
    hits = 0
    for keys in requests:
        missed = False
        for key in keys:
            if not missed and key in cache:
                cache.move_to_end(key)
                hits += 1
                continue
            missed = True
            if key not in cache:
                cache[key] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


def run(ctx: Context) -> list[Result]:
    """``shared_cache_hit_rate`` and ``shared_cache_refused`` (see the module docstring)."""
    names = ("shared_cache_hit_rate", "shared_cache_refused")
    if not any(ctx.wanted(name) for name in names):
        return []
    try:
        (harness,) = harness_modules()
    except ImportError as exc:
        ctx.skip("shared_cache", f"{exc}; install vLLM 0.33")
        return []
    from offloadd.bench.datapath import daemon
    from offloadd.client import OffloadClient

    prompts = workload(requests=ctx.pick(REQUESTS, REQUESTS // 2, REQUESTS // 8))
    ctx.progress(f"shared_cache: {len(prompts)} requests, 2 engines, {ARENA_CHUNKS}-chunk arena")
    with daemon(ctx, ARENA_CHUNKS * CHUNK_BYTES, "shared-cache", persist=False) as (endpoint, _):
        monitor = OffloadClient(endpoint, timeout=30.0, heartbeat=0)
        try:
            hits = _drive(harness, endpoint, prompts, monitor)
            stats = monitor.stats()
        finally:
            monitor.close()
    keys = [chunk_keys(p) for p in prompts]
    offered = sum(len(k) for k in keys)
    expected = shared_lru_hits(keys, ARENA_CHUNKS)
    private = sum(shared_lru_hits(keys[i::2], ARENA_CHUNKS // 2) for i in range(2))
    refused = sum(stats.stores_refused_by_reason.values())
    params: dict[str, Any] = {
        "requests": len(prompts),
        "engines": 2,
        "arena_chunks": ARENA_CHUNKS,
        "offered_keys": offered,
        "hit_keys": hits,
        "shared_lru_hit_keys": expected,
        "private_lru_hit_rate": round(private / offered, 4),
        "refused_keys": refused,
        "refused_by_reason": dict(stats.stores_refused_by_reason),
        "evictions": stats.evictions,
    }
    return [
        Result(
            "shared_cache_hit_rate",
            hits / offered,
            "hit/key",
            expected / offered,
            ratio(hits, expected),
            {**params, "baseline": "exact shared LRU, same capacity", "goal": "ratio >= 0.9"},
        ),
        Result(
            "shared_cache_refused",
            refused,
            "keys",
            offered,
            ratio(refused, offered),
            {**params, "baseline": "keys offered", "goal": "ratio <= 0.01"},
        ),
    ]


def _drive(harness: Any, endpoint: str, prompts: list[list[int]], monitor: Any) -> int:
    """Run ``prompts`` round robin over two DP engines; returns the chunks they hit."""
    extra = {
        "spec_name": "OffloaddSpec",
        "spec_module_path": "offloadd.vllm",
        "offloadd_endpoint": endpoint,
    }
    hits = 0
    with tempfile.TemporaryDirectory(prefix="offloadd-bench-shared-") as workdir:
        engines = [
            harness.VllmHarness(Path(workdir), extra, data_parallel_size=2, data_parallel_index=i)
            for i in range(2)
        ]
        with engines[0] as h0, engines[1] as h1:
            if 2 * h0.page(0, 0, 0).numel() > CHUNK_BYTES:
                raise RuntimeError("a chunk of the harness's model outgrew CHUNK_BYTES")
            managers = [h.offloading_manager for h in (h0, h1)]
            for i, prompt in enumerate(prompts):
                h = (h0, h1)[i % 2]
                h.reset_prefix_cache()  # offload hits only, not the engine's own GPU cache
                req = h.add_request(prompt, max_tokens=1)
                h.run_until_finished()
                chunks = h.external_tokens(req) // BLOCK
                hits += chunks
                if h.assert_loaded_pages(req) != chunks * harness.NUM_LAYERS:
                    raise RuntimeError(f"request {i}: loaded pages differ from its hits")
                _settle(monitor, managers)
    return hits


def _settle(monitor: Any, managers: list[Any]) -> None:
    """Wait until the daemon's copies are done and both mirrors show every committed chunk,
    so that each request starts from the same cache state in every run."""
    deadline = time.monotonic() + 30
    while True:
        stats = monitor.stats()
        sizes = {len(m._mirror.keys) for m in managers}
        if stats.jobs_in_flight == 0 and sizes == {stats.committed_entries}:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"mirrors {sizes}, daemon {stats.committed_entries} chunks")
        time.sleep(0.005)

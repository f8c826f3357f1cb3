"""Scheduler-side cost of the vLLM plugin vs vLLM's own CPUOffloadingManager, same run.

Both managers are driven through vLLM 0.33's ``OffloadingManager`` interface exactly as its
``OffloadingConnectorScheduler`` drives them, under their ``lock``:

- ``vllm_lookup_ns``: one ``lookup`` of a cached key (ns per call) with 10k cached chunks.
- ``vllm_request_us``: one scheduled request per step (µs per request): ``on_new_request``,
  prefix ``lookup``s until the first miss, ``prepare_load`` of the hits, ``prepare_store`` of
  the rest, ``on_schedule_end``, then ``complete_load`` / ``complete_store``. For offloadd
  that includes its message to a daemon subprocess (one per step, at ``on_schedule_end``:
  the step's reservation with its holds, posted, its answer read at the next step); a rank
  stores between steps (not timed, once the step's answer is in: vLLM's ranks run the step
  first), as vLLM's workers would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from offloadd.bench._util import Context, Result, median, ratio
from offloadd.bench.control import NUM_BLOCKS, PAGE, small_config
from offloadd.bench.datapath import chunk_keys, daemon
from offloadd.client import OffloadClient
from offloadd.shm import SharedKVTensor

CACHED = 10_000
PROMPT_CHUNKS = 32  # keys per request
SHARED_CHUNKS = 16  # of which the leading ones were cached by an earlier request


def run(ctx: Context) -> list[Result]:
    """``vllm_lookup_ns`` and ``vllm_request_us`` (offloadd vs vLLM's CPU manager)."""
    try:
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except ImportError as exc:
        ctx.skip("vllm", f"{exc}; install vLLM 0.33 to measure the plugin")
        return []
    from offloadd.vllm.manager import OffloaddManager

    requests = ctx.pick(1000, 200, 20)
    lookups = ctx.pick(200_000, 50_000, 2_000)
    results: list[Result] = []
    label = "vllm"
    with daemon(ctx, 512 << 20, label) as (endpoint, _process):
        kv = SharedKVTensor.create(
            NUM_BLOCKS, PAGE, ["model.layers.0.attn"], prefix=ctx.scratch.shm_prefix
        )
        config = small_config("bench-vllm")
        try:
            with OffloadClient.connect(endpoint, config, [kv.region], mirror=True) as rank:
                ours = OffloaddManager(
                    config, endpoint=endpoint, optional=False, record_events=False
                )
                theirs = CPUOffloadingManager(num_chunks=4 * CACHED + 4 * requests * PROMPT_CHUNKS)
                try:
                    store = _rank_store(rank)
                    cached = chunk_keys(CACHED, b"cached")
                    for manager, after in ((ours, store), (theirs, None)):
                        _fill(manager, cached, after)
                    ctx.progress("vllm: lookups")
                    ns = [_lookup_ns(m, cached, lookups) for m in (ours, theirs)]
                    results.append(
                        Result(
                            "vllm_lookup_ns",
                            ns[0],
                            "ns",
                            ns[1],
                            ratio(ns[0], ns[1]),
                            {"cached_chunks": CACHED, "baseline": "CPUOffloadingManager"},
                        )
                    )
                    ctx.progress("vllm: scheduled requests")
                    us = [
                        _request_us(ours, requests, store, b"ours"),
                        _request_us(theirs, requests, None, b"theirs"),
                    ]
                    results.append(
                        Result(
                            "vllm_request_us",
                            us[0],
                            "us",
                            us[1],
                            ratio(us[0], us[1]),
                            {
                                "prompt_chunks": PROMPT_CHUNKS,
                                "cached_prefix": SHARED_CHUNKS,
                                "baseline": "CPUOffloadingManager",
                            },
                        )
                    )
                finally:
                    ours.shutdown()
        finally:
            kv.close()
    return results


def _ctx(req_id: str) -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    return ReqContext(req_id=req_id)


def _rank_store(rank: OffloadClient) -> Callable[[list[bytes]], None]:
    """Store reserved keys as a rank would (one block per key, always block 1)."""
    jobs = iter(range(1, 1 << 62))

    def store(keys: list[bytes]) -> None:
        if keys:
            job = next(jobs)
            rank.store(job, keys, [1] * len(keys), reserved=True)
            rank.wait([job])

    return store


def _answered(manager: Any) -> None:
    """Until the step's answer is in (offloadd), as it is in vLLM before its ranks store: they
    run the step's forward pass first. Not timed."""
    answered = getattr(manager, "steps_answered", None)
    if answered is None:
        return
    deadline = time.monotonic() + 10
    while True:
        with manager.lock:
            if answered():
                return
        if time.monotonic() > deadline:
            raise RuntimeError("the step's message was never answered")
        time.sleep(0.0001)


def _to_store(out: Any) -> list[bytes]:
    """The keys the ranks store: offloadd's spec skips those its daemon did not reserve."""
    skipped = getattr(out.store_spec, "skipped", ())
    return [key for i, key in enumerate(out.keys_to_store) if i not in skipped]


def _fill(manager: Any, keys: list[bytes], store: Callable[[list[bytes]], None] | None) -> None:
    from vllm.v1.kv_offload.base import ScheduleEndContext

    ctx = _ctx("fill")
    step = 512
    for start in range(0, len(keys), step):
        part = keys[start : start + step]
        with manager.lock:
            out = manager.prepare_store(part, ctx)
            manager.on_schedule_end(ScheduleEndContext((), ()))
        if store is not None:
            _answered(manager)
            store(_to_store(out))
        with manager.lock:
            manager.complete_store(out.keys_to_store, ctx)
    _settle(manager, keys)


def _settle(manager: Any, keys: list[bytes]) -> None:
    """Wait until the manager sees every key as a hit (offloadd: commits reach the mirror)."""
    from vllm.v1.kv_offload.base import LookupResult

    ctx = _ctx("settle")
    deadline = time.monotonic() + 30
    while True:
        with manager.lock:
            if all(manager.lookup(k, ctx) is LookupResult.HIT for k in keys[-64:]):
                return
        if time.monotonic() > deadline:
            raise RuntimeError("stored keys never became hits")
        time.sleep(0.01)


def _lookup_ns(manager: Any, keys: list[bytes], count: int) -> float:
    ctx = _ctx("lookup")
    probes = [keys[i % len(keys)] for i in range(count)]
    samples = []
    for _ in range(5):
        with manager.lock:
            started = time.perf_counter_ns()
            for key in probes:
                manager.lookup(key, ctx)
            samples.append((time.perf_counter_ns() - started) / count)
    return median(samples)


def _request_us(
    manager: Any, requests: int, store: Callable[[list[bytes]], None] | None, salt: bytes
) -> float:
    from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext

    # Request i shares its first SHARED_CHUNKS keys with request i - 1 (a common prefix).
    elapsed = 0.0
    for index in range(requests):
        prefix = chunk_keys(SHARED_CHUNKS, salt + b"p" + str(index // 2).encode())
        keys = prefix + chunk_keys(PROMPT_CHUNKS - SHARED_CHUNKS, salt + str(index).encode())
        ctx = _ctx(f"req-{index}")
        started = time.perf_counter()
        with manager.lock:
            manager.on_new_request(ctx)
            hits = 0
            for key in keys:
                if manager.lookup(key, ctx) is not LookupResult.HIT:
                    break
                hits += 1
            if hits:
                manager.prepare_load(keys[:hits], ctx)
            out = manager.prepare_store(keys[hits:], ctx)
            manager.on_schedule_end(ScheduleEndContext((ctx.req_id,), ()))
        elapsed += time.perf_counter() - started
        if store is not None:
            _answered(manager)
            store(_to_store(out))
        started = time.perf_counter()
        with manager.lock:
            if hits:
                manager.complete_load(keys[:hits], ctx)
            manager.complete_store(out.keys_to_store, ctx)
            manager.on_request_finished(ctx)
        elapsed += time.perf_counter() - started
    return elapsed / requests * 1e6

"""Real traffic through vLLM's real scheduler: the Mooncake conversation trace, offloadd beside
vLLM's own CPU spec on the same requests, in the same run.

``vllm_trace_1`` (one engine) and ``vllm_trace_dp2`` (two data-parallel engines sharing one
daemon; native: two engines with half the memory each): the trace's first requests (2,000;
quick 500; smoke 100), 4 arriving per step, steps back to back (no pause for the cache to
drain), the geometry of ``tests/vllm/test_trace_soak.py`` (16-token blocks, one block per
4 KiB chunk, 2,048 GPU blocks, 32 MiB of offload), through ``tests/vllm/trace.py`` and its
harness, as ``vllm_step``.

- value: the total hit (prompt tokens not computed) over an exact LRU of the same capacity
  (``tests.vllm.trace.lru_hit``); baseline: the same for vLLM's CPU spec. Goal: >= 0.97.
- params: engine steps and their ratio to native; load latency (the job scheduled, in
  ``schedule()``, to its result in the rank's ``get_finished``: what a request's first token
  waits for) and store latency, median and p99 in ms, and the store median in engine steps,
  for both sides; loads that failed (recomputed) and requests recomputed.

``daemon_cpu_per_chunk``: the daemon's CPU seconds (``/proc``) over the chunks it stored and
loaded during the one-engine run, in microseconds; baseline: the wall time of the run per
chunk (what a chunk would cost if the daemon had a core to itself for the run).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._harness import harness_modules
from offloadd.bench._util import Context, Result, median, percentile, ratio
from protocol.messages import DaemonStats

CAPACITY = 32 << 20
REQUESTS = 2000


def run(ctx: Context) -> list[Result]:
    """``vllm_trace_1``, ``vllm_trace_dp2`` and ``daemon_cpu_per_chunk``."""
    wanted = [n for n in (1, 2) if ctx.wanted(_name(n))]
    cpu_wanted = ctx.wanted("daemon_cpu_per_chunk")
    if not wanted and not cpu_wanted:
        return []
    try:
        _harness, trace = harness_modules("tests.vllm.trace")
    except ImportError as exc:
        ctx.skip("vllm_trace", f"{exc}; install vLLM 0.33")
        return []
    from offloadd.bench.datapath import daemon
    from offloadd.client import OffloadClient

    requests = trace.load_trace(ctx.pick(REQUESTS, REQUESTS // 4, REQUESTS // 20))
    chunks = CAPACITY // trace.CHUNK_BYTES
    oracle = trace.lru_hit(requests, chunks)
    results: list[Result] = []
    for count in wanted or [1]:
        ctx.progress(f"vllm_trace: {len(requests)} requests, {count} engine(s), native first")
        native = _measured(trace, trace.native_extra(CAPACITY // count), count, requests)
        with daemon(ctx, CAPACITY, f"vllm-trace-{count}") as (endpoint, process):
            cpu_before = process.cpu_seconds()
            with OffloadClient(endpoint, timeout=5.0, heartbeat=0) as client:
                before = client.stats()
            ctx.progress(f"vllm_trace: offloadd, {count} engine(s)")
            ours = _measured(trace, trace.offloadd_extra(endpoint), count, requests)
            cpu = process.cpu_seconds() - cpu_before
            with OffloadClient(endpoint, timeout=5.0, heartbeat=0) as client:
                after = client.stats()
        if count in wanted:
            results.append(_row(_name(count), ours, native, oracle, count))
        if count == 1 and cpu_wanted:
            moved = _chunks_moved(before, after, trace.CHUNK_BYTES)
            results.append(
                Result(
                    "daemon_cpu_per_chunk",
                    cpu / moved * 1e6 if moved else float("nan"),
                    "us",
                    ours["seconds"] / moved * 1e6 if moved else float("nan"),
                    ratio(cpu, ours["seconds"]),
                    {
                        "chunks_moved": moved,
                        "daemon_cpu_s": round(cpu, 3),
                        "run_s": round(ours["seconds"], 3),
                        "chunk_bytes": trace.CHUNK_BYTES,
                        "goal": "value <= 20",
                    },
                )
            )
    return results


def _name(count: int) -> str:
    return "vllm_trace_1" if count == 1 else f"vllm_trace_dp{count}"


def _chunks_moved(before: DaemonStats, after: DaemonStats, chunk_bytes: int) -> int:
    moved = (after.bytes_stored - before.bytes_stored) + (after.bytes_loaded - before.bytes_loaded)
    return moved // chunk_bytes


def _row(
    name: str, ours: dict[str, Any], native: dict[str, Any], oracle: float, count: int
) -> Result:
    mine, theirs = ours["hit"] / oracle, native["hit"] / oracle
    params: dict[str, Any] = {
        "engines": count,
        "requests": ours["requests"],
        "hit": round(ours["hit"], 4),
        "native_hit": round(native["hit"], 4),
        "lru_hit": round(oracle, 4),
        "steps": ours["steps"],
        "native_steps": native["steps"],
        "steps_ratio": round(ratio(ours["steps"], native["steps"]), 3),
        "load_failures": ours["load_failures"],
        "recomputed": ours["recomputed"],
    }
    for side, out in (("", ours), ("native_", native)):
        for what in ("load", "store"):
            values = out[f"{what}_ms"]
            params[f"{side}{what}_latency_ms"] = round(median(values), 3) if values else None
            params[f"{side}{what}_latency_ms_p99"] = (
                round(percentile(values, 99), 3) if values else None
            )
        steps = out["store_steps"]
        params[f"{side}store_latency_steps"] = median(steps) if steps else None
    for what in ("load", "store"):
        for stat in ("", "_p99"):
            key = f"{what}_latency_ms{stat}"
            if params[key] is not None and params[f"native_{key}"]:
                params[f"{key}_ratio"] = round(params[key] / params[f"native_{key}"], 2)
    params["goal"] = "value >= 0.97"
    return Result(name, mine, "hit/LRU", theirs, ratio(mine, theirs), params)


class _Timing:
    """When each job of one engine was scheduled and when its rank reported it."""

    def __init__(self, h: Any) -> None:
        self.h = h
        self.scheduled: dict[int, tuple[float, int, bool]] = {}  # job -> (time, step, load)
        self.reported: dict[int, tuple[float, int]] = {}
        schedule = h.scheduler.schedule

        def timed_schedule() -> Any:
            so = schedule()
            now = time.perf_counter()
            meta = so.kv_connector_metadata
            for job_id in meta.store_jobs:
                self.scheduled.setdefault(job_id, (now, h.step_count, False))
            for job_id in meta.load_jobs:
                self.scheduled.setdefault(job_id, (now, h.step_count, True))
            return so

        h.scheduler.schedule = timed_schedule
        worker = h.ranks[0].offloading_worker
        get_finished = worker.get_finished

        def timed_get_finished() -> Any:
            out = get_finished()
            now = time.perf_counter()
            for result in out:
                self.reported.setdefault(result.job_id, (now, h.step_count))
            return out

        worker.get_finished = timed_get_finished

    def latencies(self, load: bool) -> tuple[list[float], list[float]]:
        """(ms, steps) of the loads (or stores) reported."""
        ms, steps = [], []
        for job_id, (at, step, is_load) in self.scheduled.items():
            done = self.reported.get(job_id)
            if is_load == load and done is not None:
                ms.append((done[0] - at) * 1e3)
                steps.append(float(done[1] - step))
        return ms, steps


def _measured(trace: Any, extra: dict[str, object], count: int, requests: Any) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="offloadd-bench-trace-") as workdir,
        trace.engines(Path(workdir), extra, count) as engines,
    ):
        timings = [_Timing(h) for h in engines]
        started = time.perf_counter()
        run = trace.drive(engines, requests)
        seconds = time.perf_counter() - started
        run.check_outputs()
        out: dict[str, Any] = {"load_ms": [], "store_ms": [], "store_steps": []}
        for timing in timings:
            out["load_ms"] += timing.latencies(load=True)[0]
            ms, steps = timing.latencies(load=False)
            out["store_ms"] += ms
            out["store_steps"] += steps
        failures = [
            getattr(rank.offloading_worker, "load_failures", None)
            for h in engines
            for rank in h.ranks
        ]
        out.update(
            hit=run.hit(),
            steps=run.rounds,
            seconds=seconds,
            requests=len(requests),
            recomputed=run.recomputed(),
            load_failures=sum(f.count for f in failures if f is not None),
        )
        return out

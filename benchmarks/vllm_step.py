"""Rank-side cost of a scheduling step through vLLM's real scheduler and worker connectors.

``vllm_step_<N>``: rounds of N requests (two 16-token chunks each) prefill together, so
their N stores reach the rank in one step, through vLLM 0.33's ``Scheduler`` and worker
``OffloadingConnector`` (the test harness in ``tests/vllm/harness.py``).
Measured per rank, same run, offloadd (a daemon subprocess) beside the native in-process
spec (``tests/vllm/simple_spec.py``: torch copies in the rank, what vLLM's CPU spec does
without a GPU, as its worker cannot run on a CPU host), both over the same KV memory:
memfds (``KV_MEMORY``). Both engines are built first and stay alive, and their rounds take
turns (``_measure_together``), so a slow spell of the shared machine lands on both sides.
The harness and the native spec are test code the wheel does not carry, which is why this
group lives in ``benchmarks`` (``python -m benchmarks --only vllm_step``, from a checkout);
without vLLM its rows are skipped. The built harnesses' heap is frozen for the collector as
``EngineCore`` freezes its own (see ``_startup_heap_frozen``).

- value: worker ms per step (the time spent in the spec worker's ``submit_store``,
  ``submit_load``, ``get_finished`` and ``wait``, and offloadd's ``send_step``) in the step
  that submits the N stores, median over rounds; baseline: the same for the native spec.
- params: messages the rank sent per step (the most in any step, and in the store step);
  ``schedule()`` ms, median and p99 over the steps of the measured rounds that schedule
  tokens, for both; the scheduler's messages to the daemon sent inside ``schedule()`` (its
  own thread's, not the background thread's), the most in any step; store latency (the job
  scheduled, in ``build_connector_meta``, to its result returned by the rank's
  ``get_finished``) and load latency (the same for the loads of N later requests sharing
  those prompts, after a GPU prefix-cache reset: what a request's first token waits for)
  median in ms for both, and the ranges over rounds.
- ``vllm_step_<N>_store_latency`` and ``vllm_step_<N>_steps``: continuous traffic as an
  engine meets it (each round's loads are added as soon as its stores are submitted, steps
  back to back, nothing waits for the daemon to commit): the store latency median, and the
  engine steps to finish every measured round, against native.
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks._harness import harness_modules
from offloadd.bench._util import Context, Result, median, percentile, ratio
from offloadd.bench.datapath import daemon

BLOCK = 16
SIZES = (64, 256)
SMOKE_SIZES = (16,)  # --smoke
# The ranks' KV memory: memfds, what a CPU host should give offloadd (the daemon copies
# through a mapping; a /dev/shm file costs a pwrite per run of blocks, see
# offloadd.vllm.regions). The native spec reads the same memory.
KV_MEMORY = "memfd"


def run(ctx: Context) -> list[Result]:
    """``vllm_step_64`` and ``vllm_step_256`` (offloadd vs the native in-process spec)."""
    wanted = [n for n in ctx.pick(SIZES, SIZES, SMOKE_SIZES) if ctx.wanted(f"vllm_step_{n}")]
    if not wanted:
        return []
    try:
        harness, simple_spec = harness_modules("tests.vllm.simple_spec")
    except ImportError as exc:
        ctx.skip("vllm_step", f"{exc}; install vLLM 0.33")
        return []
    # A run is as steady as its count of rounds: this machine's slow spells last about a
    # round (0.25 s at N=64, 1 s at N=256), one round's median step swinging 0.9-1.8 ms at
    # N=64 on either side.
    rounds = ctx.pick(12, 4, 1)
    results = []
    with daemon(ctx, 256 << 20, "vllm-step") as (endpoint, _process):
        for n in wanted:
            ctx.progress(f"vllm_step: {n} requests per step")
            store = f"bench-{uuid.uuid4().hex}"
            try:
                ours, native = _measure_together(
                    harness, n, rounds, [_offloadd_extra(endpoint), _native_extra(store)]
                )
            finally:
                simple_spec.drop_namespace(store)
            results.append(
                Result(
                    f"vllm_step_{n}",
                    median(ours["worker_ms"]),
                    "ms",
                    median(native["worker_ms"]),
                    ratio(median(ours["worker_ms"]), median(native["worker_ms"])),
                    {
                        "requests_per_step": n,
                        "rounds": rounds,
                        "messages_per_rank_step_max": max(ours["messages"]),
                        "messages_in_store_step": max(ours["store_step_messages"]),
                        "scheduler_messages_in_schedule_max": max(ours["schedule_messages"]),
                        "schedule_ms": median(ours["schedule_ms"]),
                        "native_schedule_ms": median(native["schedule_ms"]),
                        "schedule_ms_p99": percentile(ours["schedule_ms"], 99),
                        "native_schedule_ms_p99": percentile(native["schedule_ms"], 99),
                        "worker_ms_range": _range(ours["worker_ms"]),
                        "native_worker_ms_range": _range(native["worker_ms"]),
                        "store_latency_ms": median(ours["latency_ms"]),
                        "native_store_latency_ms": median(native["latency_ms"]),
                        "store_latency_ms_range": _range(ours["latency_ms"]),
                        "store_latency_steps": median(ours["latency_steps"]),
                        "native_store_latency_steps": median(native["latency_steps"]),
                        "load_latency_ms": median(ours["load_latency_ms"]),
                        "native_load_latency_ms": median(native["load_latency_ms"]),
                        "load_latency_ms_range": _range(ours["load_latency_ms"]),
                        "load_latency_steps": median(ours["load_latency_steps"]),
                        "native_load_latency_steps": median(native["load_latency_steps"]),
                        "harness_step_ms": median(ours["step_ms"]),
                        "native_harness_step_ms": median(native["step_ms"]),
                        "baseline": "in-process torch copies (tests/vllm/simple_spec.py)",
                        "kv_memory": KV_MEMORY,
                    },
                )
            )
            results += _continuous_rows(n, ours, native)
    return results


def _continuous_rows(
    n: int, ours: dict[str, list[float]], native: dict[str, list[float]]
) -> list[Result]:
    """What an engine meets, steps back to back: the store latency (the job scheduled to
    its report by the rank) and the engine steps to finish every round, against native."""
    store, native_store = median(ours["latency_ms"]), median(native["latency_ms"])
    steps, native_steps = sum(ours["round_steps"]), sum(native["round_steps"])
    return [
        Result(
            f"vllm_step_{n}_store_latency",
            store,
            "ms",
            native_store,
            ratio(store, native_store),
            {
                "p99_ms": percentile(ours["latency_ms"], 99),
                "native_p99_ms": percentile(native["latency_ms"], 99),
                "steps": median(ours["latency_steps"]),
                "native_steps": median(native["latency_steps"]),
                "goal": "ratio <= 2",
            },
        ),
        Result(
            f"vllm_step_{n}_steps",
            steps,
            "steps",
            native_steps,
            ratio(steps, native_steps),
            {"rounds": len(ours["round_steps"]), "goal": "ratio <= 1.2"},
        ),
    ]


def _offloadd_extra(endpoint: str) -> dict[str, Any]:
    return {
        "spec_name": "OffloaddSpec",
        "spec_module_path": "offloadd.vllm",
        "offloadd_endpoint": endpoint,
        "block_size": BLOCK,
    }


def _native_extra(store: str) -> dict[str, Any]:
    return {
        "spec_name": "SimpleSpec",
        "spec_module_path": "tests.vllm.simple_spec",
        "simple_store": store,
        "block_size": BLOCK,
    }


def _range(values: list[float]) -> list[float]:
    return [round(min(values), 3), round(max(values), 3)]


class _CountingSocket:
    """A client's socket, counting what it sends (works with any client revision)."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.sent = 0

    def send(self, *args: Any, **kwargs: Any) -> Any:
        out = self._sock.send(*args, **kwargs)
        self.sent += 1
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _ScheduleSocket(_CountingSocket):
    """The scheduler client's socket, counting only what the thread in ``schedule()`` sends
    while it is there (the manager's background thread sends acks and keepalives too)."""

    def __init__(self, sock: Any) -> None:
        super().__init__(sock)
        self.inside: int | None = None  # the thread in schedule(), while it is there

    def send(self, *args: Any, **kwargs: Any) -> Any:
        out = self._sock.send(*args, **kwargs)
        if threading.get_ident() == self.inside:
            self.sent += 1
        return out


def _count_in_schedule(manager: Any) -> _ScheduleSocket | None:
    """Count what offloadd's scheduler sends inside ``schedule()``, on its client's socket
    and on any client it connects later (a daemon that did not answer in time)."""
    client = getattr(manager, "_client", None)
    if client is None:
        return None
    counter = _ScheduleSocket(client._sock)
    client._sock = counter
    connect = manager._connect

    def counted_connect(*args: Any, **kwargs: Any) -> Any:
        new = connect(*args, **kwargs)
        counter._sock, new._sock = new._sock, counter
        return new

    manager._connect = counted_connect
    return counter


class _Probe:
    """Times the spec worker's calls and counts its messages, per step."""

    def __init__(self, h: Any) -> None:
        self.h = h
        (state,) = h.ranks
        self.worker = state.offloading_worker
        self.seconds = 0.0
        self.stores = 0
        self.reported: dict[int, tuple[float, int]] = {}  # job -> (time, step)
        client = getattr(self.worker, "_client", None)
        self.socket = None
        if client is not None:
            self.socket = _CountingSocket(client._sock)
            client._sock = self.socket
        # send_step: offloadd's, called by its step hook (the step's message leaves there)
        for name in ("submit_store", "submit_load", "send_step", "get_finished", "wait"):
            if hasattr(self.worker, name):
                setattr(self.worker, name, self._timed(name, getattr(self.worker, name)))

    def _timed(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                out = call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
            if name == "submit_store":
                self.stores += 1
            if name == "get_finished":
                now = time.perf_counter()
                for result in out:
                    self.reported.setdefault(result.job_id, (now, self.h.step_count))
            return out

        return timed

    @property
    def sent(self) -> int:
        return self.socket.sent if self.socket is not None else 0


class _Engine:
    """One engine under measurement (a harness with its spec), round by round."""

    def __init__(self, harness: Any, n: int, rounds: int) -> None:
        self.h = harness
        self.n = n
        self.rounds = rounds
        self.out: dict[str, list[float]] = {
            "worker_ms": [],
            "messages": [],
            "store_step_messages": [],
            "schedule_ms": [],
            "schedule_messages": [0.0],
            "step_ms": [],
            "round_steps": [],
        }
        self.probe = _Probe(harness)
        self.in_schedule = _count_in_schedule(harness.offloading_manager)
        self.stores: dict[int, tuple[float, int]] = {}
        self.loads: dict[int, tuple[float, int]] = {}
        self.measuring = False
        self._schedule = harness.scheduler.schedule
        harness.scheduler.schedule = self._timed_schedule

    def _timed_schedule(self) -> Any:
        in_schedule, h = self.in_schedule, self.h
        if in_schedule is not None:
            in_schedule.sent, in_schedule.inside = 0, threading.get_ident()
        started = time.perf_counter()
        try:
            so = self._schedule()
        finally:
            now = time.perf_counter()
            if in_schedule is not None:
                in_schedule.inside = None
        if self.measuring and so.total_num_scheduled_tokens:
            # Steps that schedule work only: the empty steps an engine takes while
            # transfers finish (has_pending_work) would pull the median down.
            self.out["schedule_ms"].append((now - started) * 1e3)
            if in_schedule is not None:
                self.out["schedule_messages"].append(in_schedule.sent)
        meta = so.kv_connector_metadata
        for job_id in meta.store_jobs:
            self.stores.setdefault(job_id, (now, h.step_count))
        for job_id in meta.load_jobs:
            self.loads.setdefault(job_id, (now, h.step_count))
        return so

    def run_round(self, index: int) -> None:
        """Round ``index`` (0 warms up): N requests prefill and store together, then N
        requests sharing their prompts load them."""
        h, n, probe, out = self.h, self.n, self.probe, self.out
        self.measuring = index > 0
        prompts = [_prompt(index * n + i) for i in range(n)]
        for prompt in prompts:
            h.add_request(prompt, max_tokens=6)
        worker_ms: list[float] = []
        steps = 0
        while h.has_work():
            probe.seconds, probe.stores, sent = 0.0, 0, probe.sent
            started = time.perf_counter()
            h.step()
            steps += 1
            out["step_ms"].append((time.perf_counter() - started) * 1e3)
            messages = probe.sent - sent
            if index:
                out["messages"].append(messages)
            if probe.stores >= n:
                worker_ms.append(probe.seconds * 1e3)
                if index:
                    out["store_step_messages"].append(messages)
        if index and worker_ms:
            out["worker_ms"].append(max(worker_ms))
        # The loads, at once (no wait for the daemon to commit: an engine steps on, and a
        # key still committing answers HIT_PENDING): N requests sharing the prompts' two
        # chunks, their GPU copies gone.
        h.reset_prefix_cache(zero_kv=False)
        for i, prompt in enumerate(prompts):
            h.add_request(prompt[: 2 * BLOCK] + _prompt(1_000_000 + index * n + i)[:5], 2)
        while h.has_work():
            h.step()
            steps += 1
        if index:
            out["round_steps"].append(steps)

    def results(self) -> dict[str, list[float]]:
        out, probe = self.out, self.probe
        out["latency_ms"], out["latency_steps"] = _latencies(self.stores, probe, self.rounds)
        out["load_latency_ms"], out["load_latency_steps"] = _latencies(
            self.loads, probe, self.rounds
        )
        if not out["worker_ms"]:
            raise RuntimeError(f"no step submitted {self.n} stores")
        if not out["load_latency_ms"]:
            raise RuntimeError(f"no load reported with {self.n} requests")
        return out


def _measure_together(
    harness: Any, n: int, rounds: int, extras: list[dict[str, Any]]
) -> list[dict[str, list[float]]]:
    """Both engines built and alive, their rounds taking turns (the first to go swaps each
    round): a slow spell of this shared machine lands on both sides, not on one."""
    with contextlib.ExitStack() as stack:
        engines: list[_Engine] = []
        for extra in extras:
            workdir = tempfile.TemporaryDirectory(prefix="offloadd-bench-vllm-")
            path = Path(stack.enter_context(workdir))
            h = stack.enter_context(
                harness.VllmHarness(
                    path,
                    extra,
                    engine_id=f"bench-{len(engines)}",
                    num_blocks=4 * n + 16,
                    max_num_batched_tokens=n * (2 * BLOCK + 8),
                    max_num_seqs=n,
                    max_model_len=16 * BLOCK,
                    kv_memory=KV_MEMORY,
                )
            )
            engines.append(_Engine(h, n, rounds))
        stack.enter_context(_startup_heap_frozen())
        for index in range(rounds + 1):  # the first round warms up
            for engine in engines if index % 2 == 0 else reversed(engines):
                engine.run_round(index)
        return [engine.results() for engine in engines]


@contextlib.contextmanager
def _startup_heap_frozen() -> Iterator[None]:
    """What vLLM's ``EngineCore`` does once it is built (``freeze_gc_heap``, undone at its
    shutdown): without it a full collection walks vLLM's and torch's whole startup heap,
    0.1-0.9 s here, inside whichever step it lands in, for either spec."""
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def _latencies(
    scheduled: dict[int, tuple[float, int]], probe: _Probe, rounds: int
) -> tuple[list[float], list[float]]:
    """(ms, steps) from each job's scheduling to the rank's report, past the warm-up round."""
    pairs = [(at, probe.reported[job]) for job, at in scheduled.items() if job in probe.reported]
    pairs = pairs[len(pairs) // (rounds + 1) :]
    return [(done[0] - at[0]) * 1e3 for at, done in pairs], [
        float(done[1] - at[1]) for at, done in pairs
    ]


def _prompt(seed: int) -> list[int]:
    import random

    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(2 * BLOCK + 3)]

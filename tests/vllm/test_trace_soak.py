"""Real traffic through vLLM's real scheduler: the Mooncake conversation trace (2,000
requests, 4 arriving per step) through one engine and through two data-parallel engines
sharing one daemon, the arena a quarter of the working set or less, vLLM's own CPU spec run
on the same requests in the same test; then the same traffic with the daemon killed,
stopped, frozen past ``mirror_ack_timeout`` and the cache reset, mid-trace.

Every loaded page is checked: the simulated forward pass checks the KV of every context
token before it computes (``KVMismatchError``), and every request's sampled tokens are
checked at the end. A load the daemon cannot serve must not kill the engine: vLLM recomputes
the request (``kv_load_failure_policy="recompute"``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from offloadd.client import OffloadClient
from tests.integration.harness import ServeProcess, serve_process
from tests.vllm.harness import VllmHarness
from tests.vllm.trace import (
    CHUNK_BYTES,
    Run,
    drive,
    engines,
    load_trace,
    lru_hit,
    native_extra,
    offloadd_extra,
    working_set,
)

pytestmark = pytest.mark.timeout(600)

CAPACITY = 32 << 20  # 8,192 chunks: under a fifth of the 2,000 requests' 38,788
REQUESTS = 2000
FAULT_REQUESTS = 600  # ~150 steps; the arena is full from about step 60
FAULT_ROUND = 90
MIRROR_ACK_TIMEOUT = 1.0  # the daemon's, in the fault soaks: SIGSTOP outlasts it
# "stalls": the daemon frozen this long every STALL_EVERY steps (a daemon behind its engines:
# a loaded node). Today's main lost its loads' keys this way ("daemon behind", holds lost).
STALL_SECONDS = 0.3
STALL_EVERY = 10


def _serve(settings: str = "") -> Iterator[ServeProcess]:
    """The daemon on ``CAPACITY``, with ``settings`` (TOML) as its config file if any."""
    with serve_process(f"{CAPACITY >> 20}MiB") as daemon:
        if settings:
            config = Path(daemon.workdir) / "offloadd.toml"
            config.write_text(settings)
            daemon.config = str(config)
        yield daemon


@pytest.fixture
def serve() -> Iterator[ServeProcess]:
    """The daemon on its defaults: a CI step can outlast a 1 s mirror_ack_timeout, and a
    scheduler dropped for it misses every key until it is back (hit 0.91 of LRU, once)."""
    yield from _serve()


@pytest.fixture
def fault_serve() -> Iterator[ServeProcess]:
    yield from _serve(f"[server]\nmirror_ack_timeout = {MIRROR_ACK_TIMEOUT}\n")


def load_failures(run: Run) -> int:
    """Loads the engines' ranks reported to vLLM as failed (recomputed)."""
    return sum(rank.offloading_worker.load_failures.count for h in run.engines for rank in h.ranks)


def loads_missing(serve: ServeProcess) -> int:
    with OffloadClient(serve.endpoint, timeout=5.0, heartbeat=0) as client:
        return client.stats().loads_missing


def native_run(tmp_path: Path, requests: Any, count: int = 1) -> Run:
    """vLLM's CPU spec, ``count`` engines each with its own ``CAPACITY / count``."""
    with engines(tmp_path, native_extra(CAPACITY // count), count) as native:
        run = drive(native, requests)
        run.check_outputs()
    return run


@pytest.mark.parametrize("count", [1, 2], ids=["one_engine", "two_dp_engines"])
def test_the_trace_through_the_real_scheduler(
    tmp_path: Path, serve: ServeProcess, count: int
) -> None:
    requests = load_trace(REQUESTS)
    chunks = CAPACITY // CHUNK_BYTES
    assert working_set(requests) >= 4 * chunks  # the arena is under pressure
    oracle = lru_hit(requests, chunks)
    native = native_run(tmp_path, requests, count)
    serve.start()
    with engines(tmp_path, offloadd_extra(serve.endpoint), count) as ours:
        run = drive(ours, requests)
        run.check_outputs()
        failed = load_failures(run)
    assert failed == 0 and loads_missing(serve) == 0  # the contract held: no load failed
    assert run.recomputed() == 0
    # Both match the exact LRU (0.99-1.00 here). Two engines fell to 0.955-0.967 before their
    # schedulers touched the keys their requests use from the GPU (offloadd.vllm.prefix_use):
    # a prefix one engine kept hitting in its GPU cache aged out of the shared arena, and the
    # other engine needed it.
    ratio = run.hit() / oracle
    if count > 1:  # one shared cache serves both engines better than two private halves
        assert run.hit() > native.hit()
    assert ratio >= 0.97, (
        f"hit {run.hit():.4f} vs exact LRU {oracle:.4f} (native {native.hit():.4f}); "
        f"{run.rounds} rounds vs native {native.rounds}"
    )


def _restart(serve: ServeProcess, stop: Callable[[], object]) -> threading.Thread:
    """Stop the daemon now and start it again on its arena and journal, in the background
    (the engines keep stepping meanwhile, as an engine core does)."""
    stop()
    thread = threading.Thread(target=serve.start, name="restart", daemon=True)
    thread.start()
    return thread


def _faults(serve: ServeProcess, h: VllmHarness) -> dict[str, Callable[[], object]]:
    """Each fault, injected at ``FAULT_ROUND``."""
    assert serve.process is not None
    process = serve.process
    worker = h.ranks[0].offloading_worker
    threads: list[threading.Thread] = []

    def kill_while_loading() -> None:
        real = worker.submit_load

        def submit_load(*args: Any, **kwargs: Any) -> Any:
            worker.submit_load = real  # once: right after the rank took a load
            result = real(*args, **kwargs)
            worker.send_step()
            threads.append(_restart(serve, lambda: serve.stop(signal.SIGKILL)))
            return result

        worker.submit_load = submit_load

    def freeze(seconds: float) -> None:
        process.send_signal(signal.SIGSTOP)
        threading.Timer(seconds, process.send_signal, [signal.SIGCONT]).start()

    return {
        "sigkill_idle": lambda: threads.append(_restart(serve, lambda: serve.stop(signal.SIGKILL))),
        "sigkill_loading": kill_while_loading,
        "sigterm": lambda: threads.append(_restart(serve, serve.stop)),
        "sigstop": lambda: freeze(3 * MIRROR_ACK_TIMEOUT),
        "stalls": lambda: freeze(STALL_SECONDS),
        "reset": lambda: h.scheduler.reset_prefix_cache(reset_connector=True),
    }


@pytest.mark.parametrize(
    "fault", ["stalls", "sigkill_idle", "sigkill_loading", "sigterm", "sigstop", "reset"]
)
def test_the_trace_survives_its_daemon(
    tmp_path: Path, fault_serve: ServeProcess, fault: str
) -> None:
    """The engine finishes every request, right, whatever the daemon goes through; only
    requests whose loads failed (KV lost with the daemon, or cleared) recompute."""
    requests = load_trace(FAULT_REQUESTS)
    fault_serve.start()
    with engines(tmp_path, offloadd_extra(fault_serve.endpoint)) as ours:
        inject = _faults(fault_serve, ours[0])[fault]

        def before_round(n: int) -> None:
            if n == FAULT_ROUND or (fault == "stalls" and n and n % STALL_EVERY == 0):
                inject()

        run = drive(ours, requests, before_round=before_round)
        run.check_outputs()
        assert run.recomputed() <= load_failures(run)
    assert run.hit() > 0  # offload served hits around the fault

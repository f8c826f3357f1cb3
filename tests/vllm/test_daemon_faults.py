"""A vLLM engine outlives its daemon: a real ``offloadd serve`` process is killed (SIGKILL) and
restarted on the same arena and journal while vLLM's real scheduler and worker connectors
serve, and a cache reset lands while a store runs.

Every loaded page is checked against its prefix's bytes on every rank and layer; the engine
never raises; offload hits come back once the daemon does.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from offloadd.vllm.manager import STEP_BOUND_SECONDS, OffloaddManager
from tests.fakes import FakeCopyEngine
from tests.integration.harness import DaemonThread, ServeProcess
from tests.vllm.harness import NUM_LAYERS, VllmHarness, sampled_token
from tests.vllm.prompts import A_PROMPT, b_prompt, compute, prompt_of, settle

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def serve() -> Iterator[ServeProcess]:
    workdir = tempfile.mkdtemp(prefix="od-", dir="/tmp")
    daemon = ServeProcess(workdir, f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena")
    yield daemon
    daemon.cleanup()
    shutil.rmtree(workdir, ignore_errors=True)


def extra_for(serve: ServeProcess) -> dict[str, object]:
    return {
        "spec_name": "OffloaddSpec",
        "spec_module_path": "offloadd.vllm",
        "offloadd_endpoint": serve.endpoint,
        "offloadd_load_timeout": 60.0,
    }


def expected_output(prompt: list[int], max_tokens: int = 2) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(sampled_token(tokens))
    return tokens[len(prompt) :]


def at_first_call(
    target: Any, name: str, fault: Callable[[], None], *, before: bool = False
) -> list[int]:
    """Wrap ``target.name`` so that ``fault`` runs once, right after its first call returned
    (the daemon accepted the job: it is in flight), or right ``before`` it (the engine
    scheduled the job; the daemon dies before the rank sends it). Returns a list that
    counts the faults."""
    real = getattr(target, name)
    fired: list[int] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before and not fired:
            fired.append(1)
            fault()
        result = real(*args, **kwargs)
        if not fired:
            fired.append(1)
            fault()
        return result

    setattr(target, name, wrapped)
    return fired


def timed_steps(h: VllmHarness, until: Callable[[], bool], timeout: float = 30) -> list[float]:
    """Step while the daemon is away until ``until()``; each step's wall time (reported)."""
    times: list[float] = []
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "the engine made no progress without its daemon"
        start = time.monotonic()
        h.step()
        times.append(time.monotonic() - start)
    return times


@pytest.mark.parametrize("when", ["load", "load_accepted", "store", "idle"])
def test_daemon_killed_and_restarted_with_its_arena(
    tmp_path: Path, serve: ServeProcess, when: str
) -> None:
    serve.start()
    with VllmHarness(tmp_path, extra_for(serve)) as h:
        manager = h.offloading_manager
        assert isinstance(manager, OffloaddManager)
        worker = h.ranks[0].offloading_worker
        compute(h, A_PROMPT)
        settle(h, 6)
        h.reset_prefix_cache()

        def kill() -> None:
            serve.stop(signal.SIGKILL)

        fired: list[int] = []
        if when == "load":
            fired = at_first_call(worker, "submit_load", kill, before=True)
        elif when == "load_accepted":
            fired = at_first_call(worker, "submit_load", kill)
        elif when == "store":
            fired = at_first_call(worker, "submit_store", kill)
        else:
            kill()
            fired = [1]
        b = h.add_request(b_prompt(85), max_tokens=2)  # loads 5 chunks of A
        e_prompt = prompt_of(100, seed=5)
        e = h.add_request(e_prompt, max_tokens=2)  # stores 6 chunks
        # The engine keeps serving while the daemon is away: a request with nothing to load
        # runs to the end.
        x_prompt = prompt_of(40, seed=6)
        x = h.add_request(x_prompt, max_tokens=2)
        # Until the scheduler noticed (its next exchange, or its keepalive): the first failed
        # exchange empties the mirror, every lookup misses meanwhile.
        times = timed_steps(h, lambda: bool(fired) and x in h.finished and manager._client is None)
        assert h.outputs[x] == expected_output(x_prompt)
        assert not manager._mirror.keys
        print(f"\n{when}: {len(times)} steps while away, slowest {max(times):.2f}s, "
              f"{worker.loads_resent} loads sent again "
              f"(bound {STEP_BOUND_SECONDS:.1f}s)")  # fmt: skip

        serve.start()  # the same arena and journal: every committed chunk is restored
        h.run_until_finished(timeout=60)
        assert h.outputs[b] == expected_output(b_prompt(85))
        assert h.outputs[e] == expected_output(e_prompt)
        if h.external_tokens(b):
            assert h.assert_loaded_pages(b) == 5 * NUM_LAYERS
        if when.startswith("load"):
            assert h.external_tokens(b) == 80
        if when == "load":
            assert worker.loads_resent == 1  # waited for the daemon, then sent by key

        # Offload resumes: the scheduler has a new session and its snapshot.
        settle(h, 6)
        f_prompt = prompt_of(100, seed=9)
        compute(h, f_prompt)
        settle(h, 12)
        h.reset_prefix_cache()
        g = compute(h, f_prompt[:85] + prompt_of(7, seed=10))
        assert h.external_tokens(g) == 80
        assert h.assert_loaded_pages(g) == 5 * NUM_LAYERS


def test_reset_with_a_store_in_flight(tmp_path: Path) -> None:
    """vLLM flushes the jobs a reset finds; the store it flushed never commits, its keys miss,
    and a request with the same prompt is scheduled at once (it was deferred for good while
    those keys answered HIT_PENDING)."""
    copies = FakeCopyEngine()
    d = DaemonThread(copy_engine=copies).start()
    try:
        extra = {
            "spec_name": "OffloaddSpec",
            "spec_module_path": "offloadd.vllm",
            "offloadd_endpoint": d.endpoint,
        }
        with VllmHarness(tmp_path, extra) as h:
            worker = h.ranks[0].offloading_worker
            copies.gate.clear()  # the daemon accepts the store; its copy waits
            a = h.add_request(A_PROMPT, max_tokens=1)
            # A's blocks wait on its store, the engine does not.
            timed_steps(h, lambda: a in h.finished and bool(worker._jobs))
            assert all(not job.load for job in worker._jobs.values())
            assert h.scheduler.reset_prefix_cache(reset_connector=True)
            copies.gate.set()
            worker.wait(set(worker._jobs))  # what vLLM's flush does at the next step
            assert d.daemon is not None
            assert d.daemon.stats().committed_entries == 0  # begun before the reset
            h.zero_kv()
            b = h.add_request(A_PROMPT, max_tokens=1)
            start = h.step_count
            while not h.forward_ranges.get(b):
                assert h.step_count - start < 3, "the request was deferred"
                h.step()
            assert h.external_tokens(b) == 0
            h.run_until_finished()
            assert h.outputs[b] == expected_output(A_PROMPT, 1)
    finally:
        copies.gate.set()
        d.stop()

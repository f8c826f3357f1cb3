"""A vLLM engine outlives its daemon: a real ``offloadd serve`` process is killed (SIGKILL) and
restarted on the same arena and journal while vLLM's real scheduler and worker connectors
serve, is stopped as ``systemctl restart`` stops it (SIGTERM: the drain) and started again, is
frozen (SIGSTOP) past the plugin's timeouts and let go, and a cache reset lands while a store
runs.

Every loaded page is checked against its prefix's bytes on every rank and layer; the engine
never raises; offload hits come back once the daemon does.
"""

from __future__ import annotations

import contextlib
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

from offloadd.client import OffloadClient
from offloadd.vllm import worker as worker_module
from offloadd.vllm.manager import STEP_BOUND_SECONDS, OffloaddManager
from protocol.messages import DaemonStats
from tests.fakes import FakeCopyEngine
from tests.integration.harness import DaemonThread, ServeProcess, serve_process
from tests.vllm.harness import NUM_LAYERS, VllmHarness, sampled_token
from tests.vllm.prompts import A_PROMPT, b_prompt, compute, prompt_of, settle, why_not_stored

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def serve() -> Iterator[ServeProcess]:
    with serve_process() as daemon:
        yield daemon


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


@contextlib.contextmanager
def warm_engine(
    tmp_path: Path, serve: ServeProcess
) -> Iterator[tuple[VllmHarness, OffloaddManager, Any]]:
    """The daemon started and an engine on it (harness, scheduler, rank 0's worker) whose
    mirror shows ``A_PROMPT``'s 6 chunks."""
    serve.start()
    with VllmHarness(tmp_path, extra_for(serve)) as h:
        manager = h.offloading_manager
        assert isinstance(manager, OffloaddManager)
        compute(h, A_PROMPT)
        settle(h, 6)
        yield h, manager, h.ranks[0].offloading_worker


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
    with warm_engine(tmp_path, serve) as (h, manager, worker):
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
        print(f"\n{when}: {len(times)} steps in {sum(times):.1f}s while away, "
              f"slowest {max(times):.2f}s, "
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


def test_an_idle_engine_gets_its_cache_back_after_a_restart(
    tmp_path: Path, serve: ServeProcess
) -> None:
    """An engine without requests calls nothing of its worker: the rank's background thread
    says Hello to the restarted daemon by itself, so the engine is ready there and the
    scheduler's mirror comes back before the next request, which hits at once."""
    serve.start()
    with VllmHarness(tmp_path, extra_for(serve)) as h:
        compute(h, A_PROMPT)
        settle(h, 6)
        h.reset_prefix_cache()
        manager = h.offloading_manager
        assert isinstance(manager, OffloaddManager)
        serve.stop(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while manager._client is not None:  # its keepalive finds the daemon gone
            assert time.monotonic() < deadline, "the scheduler did not notice"
            time.sleep(0.01)
        with manager._lock:  # the background thread empties it right after
            assert not manager._mirror.keys
        serve.start()  # no step from here on until the mirror is back
        settle(h, 6)
        b = compute(h, b_prompt(85))
        assert h.external_tokens(b) == 80
        assert h.assert_loaded_pages(b) == 5 * NUM_LAYERS


def step_until(h: VllmHarness, until: Callable[[], bool], timeout: float = 30) -> None:
    """Step without pause until ``until()``, a request shorter than a block (nothing to store
    or load) always running, so that vLLM calls the ranks every step."""
    fillers = 0
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "not reached while stepping"
        if not h.has_work():
            fillers += 1
            h.add_request(prompt_of(10, seed=1000 + fillers), max_tokens=2)
        h.step()


@pytest.fixture
def away_for_an_hour(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that notes its daemon away counts it away for an hour, and its idle keepalive
    (which ends that when vLLM pauses) never runs: only the daemon coming back can end it."""
    monkeypatch.setattr(worker_module, "AWAY_SECONDS", 3600.0)
    monkeypatch.setattr(worker_module.OffloaddWorker, "_keep_idle_session", lambda self: None)


def noted_away(worker: Any) -> bool:
    return bool(worker._away_until > time.monotonic() + 60)


@pytest.mark.usefixtures("away_for_an_hour")
def test_a_rank_stores_again_once_it_reaches_the_restarted_daemon(
    tmp_path: Path, serve: ServeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that cannot reach its daemon skips its stores (they would hold vLLM's blocks
    for nothing); once its socket connects to the restarted daemon (within zmq's reconnect
    interval of the start, no backoff) it is back: it proves its session (a ping, then Hello)
    in its next step, the scheduler's mirror comes back and the next request is stored, not a
    timer later."""
    with warm_engine(tmp_path, serve) as (h, manager, worker):
        old_session = worker._client.welcome
        serve.stop(signal.SIGKILL)
        step_until(h, lambda: noted_away(worker) and manager._client is None)
        # The step in which the rank first finds itself connected, and the steps of its
        # keepalives from then on: counted where the proof is sent, not where it is answered
        # (a daemon that has just started may answer late), and seen by the rank itself (it
        # may connect and say Hello within one step).
        client = worker._client
        connected_at: list[int] = []
        proved: list[int] = []
        can_send, keepalive = client.can_send, client.keepalive

        def seen_connected() -> bool:
            up = bool(can_send())
            if up and not connected_at:
                connected_at.append(h.step_count)
            return up

        def counted(timeout: float) -> None:
            if connected_at:
                proved.append(h.step_count)
            keepalive(timeout)

        monkeypatch.setattr(client, "can_send", seen_connected)
        monkeypatch.setattr(client, "keepalive", counted)
        serve.start()
        step_until(h, lambda: client.welcome is not old_session)  # said Hello to the new daemon
        assert proved and proved[0] <= connected_at[0] + 1, "the rank did not prove it at once"
        step_until(h, lambda: manager._client is not None and len(manager._mirror.keys) == 6)
        offload_resumes(h, seed=40)


@pytest.mark.usefixtures("away_for_an_hour")
def test_a_rank_stores_again_once_its_frozen_daemon_answers(
    tmp_path: Path, serve: ServeProcess
) -> None:
    """A daemon that does not answer (SIGSTOP) is noted away by the rank, which skips its
    stores; the first message read from it after that (the late answer to the ping that
    timed out) shows it running again, and the next request is stored."""
    with warm_engine(tmp_path, serve) as (h, manager, worker):
        process = serve.process
        assert process is not None
        process.send_signal(signal.SIGSTOP)
        try:
            step_until(h, lambda: noted_away(worker))
        finally:
            process.send_signal(signal.SIGCONT)
        with worker._lock:  # it reads the rank's socket
            assert worker._client is not None and worker._client.can_send()  # connected all along
        step_until(h, lambda: not noted_away(worker))  # the daemon's first message since
        step_until(h, lambda: manager._client is not None and len(manager._mirror.keys) == 6)
        offload_resumes(h, seed=50)


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


def stats_of(serve: ServeProcess) -> DaemonStats:
    """The daemon's counters and this user's engines, asked without a session."""
    with OffloadClient(serve.endpoint, timeout=5.0, heartbeat=0) as client:
        return client.stats()


def offload_resumes(h: VllmHarness, seed: int) -> None:
    """A prompt computed now is stored, and a request sharing 80 tokens of it loads them."""
    manager = h.offloading_manager
    assert isinstance(manager, OffloaddManager)
    f_prompt = prompt_of(100, seed=seed)
    before = set(manager._mirror.keys)
    compute(h, f_prompt)
    deadline = time.monotonic() + 30  # its 6 chunks reach the mirror (a full arena evicts)
    while len(manager._mirror.keys - before) < 6:
        assert time.monotonic() < deadline, (
            f"{len(manager._mirror.keys - before)} new chunks; {why_not_stored(h)}"
        )
        time.sleep(0.01)
    h.reset_prefix_cache()
    g = compute(h, f_prompt[:85] + prompt_of(7, seed=seed + 1))
    assert h.external_tokens(g) == 80
    assert h.assert_loaded_pages(g) == 5 * NUM_LAYERS


def test_daemon_stopped_by_sigterm_while_serving_and_started_again(
    tmp_path: Path, serve: ServeProcess
) -> None:
    """What ``systemctl restart offloadd`` does: SIGTERM, then a new daemon on the same arena
    and journal. The daemon drains with a store and a load in flight (its copies wait on a
    gate file): meanwhile every mirror is told that every key misses, holds, reservations and
    new jobs are refused, and the engine keeps serving without offload (a request sharing a
    cached prefix computes it). The jobs in flight finish; the next daemon serves them."""
    gate = tmp_path / "copies-wait"
    runner = ("-m", "tests.integration.held_serve", "--copies", "gated", "--gate", str(gate))
    serve.start(runner)
    with VllmHarness(tmp_path, extra_for(serve)) as h:
        manager = h.offloading_manager
        assert isinstance(manager, OffloaddManager)
        worker = h.ranks[0].offloading_worker
        compute(h, A_PROMPT)
        settle(h, 6)
        h.reset_prefix_cache()
        gate.touch()  # copies accepted from now on wait
        b = h.add_request(b_prompt(85), max_tokens=2)  # loads 5 chunks of A
        e_prompt = prompt_of(100, seed=5)
        e = h.add_request(e_prompt, max_tokens=2)  # stores 6 chunks
        # Both jobs accepted by the daemon, their copies waiting: in flight.
        timed_steps(
            h,
            lambda: (
                {j.load for j in worker._jobs.values() if j.sent} == {True, False}
                and stats_of(serve).jobs_in_flight == 2
            ),
        )
        process = serve.process
        assert process is not None
        process.send_signal(signal.SIGTERM)
        # The drain: the scheduler hears that every key misses (its background thread applies
        # the empty snapshot), its next reservation is refused and it lets the daemon go. A
        # request sharing A's prefix is computed, not loaded.
        deadline = time.monotonic() + 30
        while manager._mirror.keys:
            assert time.monotonic() < deadline, "the drain did not empty the mirror"
            time.sleep(0.01)
        x_prompt = prompt_of(40, seed=6)
        x = h.add_request(x_prompt, max_tokens=2)
        times = timed_steps(h, lambda: x in h.finished and manager._client is None)
        c_prompt = b_prompt(85, seed=3)
        c = h.add_request(c_prompt, max_tokens=2)
        times += timed_steps(h, lambda: c in h.finished)
        assert h.external_tokens(c) == 0 and not manager._mirror.keys
        assert h.outputs[x] == expected_output(x_prompt)
        assert h.outputs[c] == expected_output(c_prompt)
        assert process.poll() is None  # still draining: its copies wait
        gate.unlink()
        assert process.wait(30) == 0  # the drain ended by itself
        print(f"\nSIGTERM: {len(times)} steps while draining, slowest {max(times):.2f}s")

        serve.start(runner)  # the same arena and journal
        h.run_until_finished(timeout=60)
        assert h.outputs[b] == expected_output(b_prompt(85))
        assert h.outputs[e] == expected_output(e_prompt)
        assert h.external_tokens(b) == 80  # its load finished in the drain
        assert h.assert_loaded_pages(b) == 5 * NUM_LAYERS
        # The store the drain finished was committed and journaled: the next daemon has it.
        settle(h, 12)
        h.reset_prefix_cache()
        e2 = compute(h, e_prompt[:85] + prompt_of(7, seed=11))
        assert h.external_tokens(e2) == 80
        assert h.assert_loaded_pages(e2) == 5 * NUM_LAYERS
        offload_resumes(h, seed=12)


def test_daemon_frozen_past_the_plugin_timeouts_keeps_only_live_sessions(tmp_path: Path) -> None:
    """SIGSTOP past the plugin's timeouts: the scheduler gives its session up and connects
    again. Once the daemon runs again it keeps the live sessions only (the new scheduler
    session replaces the old one, which would never acknowledge a removal again), and
    evictions go on in an arena smaller than the workload."""
    workdir = tempfile.mkdtemp(prefix="od-", dir="/tmp")
    arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    serve = ServeProcess(workdir, arena, capacity="160KiB")  # 40 chunks of the tiny model
    try:
        serve.start()
        with VllmHarness(tmp_path, extra_for(serve)) as h:
            manager = h.offloading_manager
            assert isinstance(manager, OffloaddManager)
            worker = h.ranks[0].offloading_worker

            def fill(seeds: range) -> None:
                for seed in seeds:
                    h.reset_prefix_cache()
                    compute(h, prompt_of(100, seed=seed))  # 6 chunks each

            fill(range(100, 108))  # 48 chunks through 40 slots
            settle(h, 1)
            before = stats_of(serve)
            assert before.evictions > 0
            welcome = manager._client.welcome if manager._client is not None else None
            process = serve.process
            assert process is not None
            process.send_signal(signal.SIGSTOP)
            try:
                y = h.add_request(prompt_of(60, seed=7), max_tokens=40)
                # The engine goes on; the scheduler's exchanges time out and it lets go.
                timed_steps(h, lambda: manager._client is None)
                h.run_until_finished(timeout=60)
                assert h.outputs[y] == expected_output(prompt_of(60, seed=7), 40)
            finally:
                process.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 30
            while True:  # the scheduler connects again; the daemon keeps live sessions only
                stats = stats_of(serve)
                (engine,) = stats.engines
                client = manager._client
                back = client is not None and client.welcome is not welcome
                # and the rank asks the daemon again: it skips stores while it thinks the daemon
                # away, and a skipped store leaves its keys reserved until the reservation
                # expires (a known gap, docs/vllm-restarts.md)
                with worker._lock:  # it reads the rank's socket
                    back = back and not worker._away()
                if back and engine.schedulers == 1 and stats.sessions == 1 + len(h.ranks):
                    break
                assert time.monotonic() < deadline, (
                    f"{stats.sessions} sessions, {engine.schedulers} schedulers"
                )
                time.sleep(0.05)
            fill(range(200, 208))
            after = stats_of(serve)
            print(f"\nSIGSTOP: evictions {before.evictions} -> {after.evictions}, refused "
                  f"{before.stores_refused_by_reason} -> {after.stores_refused_by_reason}, "
                  f"{after.sessions} sessions")  # fmt: skip
            # 48 new chunks into a full arena of 40: most of them evict one.
            assert after.evictions - before.evictions >= 40
            assert after.sessions == 1 + len(h.ranks)
            assert after.entries == after.committed_entries  # no reservation left behind
            offload_resumes(h, seed=300)
    finally:
        serve.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


def test_store_to_a_frozen_daemon_is_given_up_at_its_deadline_and_never_committed(
    tmp_path: Path, serve: ServeProcess
) -> None:
    """SIGSTOP right as the rank submits a step's stores: each is given up (done, nothing
    cached) within a step or two of its deadline (offloadd_store_timeout after its submit),
    not after offloadd_load_timeout, so the request's blocks go back to vLLM and are reused.
    After SIGCONT the daemon takes the queued stores and commits none of them: their copies
    would read blocks vLLM has since given to other requests."""
    serve.start()
    extra = extra_for(serve) | {"offloadd_store_timeout": 1.0}
    with VllmHarness(tmp_path, extra) as h:
        manager = h.offloading_manager
        assert isinstance(manager, OffloaddManager)
        worker = h.ranks[0].offloading_worker
        compute(h, A_PROMPT)
        settle(h, 6)
        client = worker._client
        assert client is not None and client.welcome is not None and client.welcome.shared_clock
        process = serve.process
        assert process is not None
        frozen_keys: list[bytes] = []
        deadlines: list[float] = []
        real_submit = worker.submit_store

        def submit_store(job_id: int, src: Any, dst: Any) -> bool:
            if not frozen_keys:
                process.send_signal(signal.SIGSTOP)  # the scheduler already reserved them
            frozen_keys.extend(dst.keys)
            result = real_submit(job_id, src, dst)
            job = worker._jobs.get(job_id)
            if job is not None:
                deadlines.append(job.deadline)
            return bool(result)

        worker.submit_store = submit_store
        prompt = prompt_of(100, seed=21)
        try:
            y = h.add_request(prompt, max_tokens=40)
            steps_past = 0  # steps begun once every frozen store's deadline had passed
            bound = time.monotonic() + 60  # a wall bound on the loop, not a timing assertion
            while not (deadlines and worker.stores_given_up >= len(deadlines)):
                assert time.monotonic() < bound, "stores to the frozen daemon never given up"
                if deadlines and time.monotonic() > max(deadlines):
                    steps_past += 1
                h.step()
            worker.submit_store = real_submit
            assert deadlines and all(deadlines)  # each store carried its deadline
            assert steps_past <= 2, f"given up {steps_past} steps after the deadline"
            h.run_until_finished(timeout=60)
            assert h.outputs[y] == expected_output(prompt, 40)
        finally:
            process.send_signal(signal.SIGCONT)
        # The daemon runs the queued StepJobs now: every frozen store is late, none commits.
        deadline = time.monotonic() + 30
        while True:
            stats = stats_of(serve)
            late = stats.stores_refused_by_reason.get("late", 0)
            with worker._lock:  # it reads the rank's socket
                away = worker._away()
            if late >= len(frozen_keys) and not away:
                break
            assert time.monotonic() < deadline, f"{late} late keys of {len(frozen_keys)}"
            time.sleep(0.05)
        settle(h, 6)
        assert not set(frozen_keys) & manager._mirror.keys
        print(f"\nfrozen: {len(deadlines)} stores ({len(frozen_keys)} keys) given up "
              f"{steps_past} steps past their deadline; late {late}")  # fmt: skip
        offload_resumes(h, seed=300)

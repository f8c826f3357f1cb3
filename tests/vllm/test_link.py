"""The plugin's liveness: one ``SessionLink`` thread per manager and per worker, and its
heartbeat keeps a session the daemon cannot watch alive while vLLM holds the lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

import offloadd.server.peers
from offloadd.vllm import link as link_module
from offloadd.vllm.manager import OffloaddManager
from tests.integration.configs import make_config
from tests.integration.harness import DaemonThread, ServeProcess, serve_process
from tests.vllm.harness import VllmHarness
from tests.vllm.prompts import A_PROMPT, compute, extra_for, settle


@pytest.fixture
def serve() -> Iterator[ServeProcess]:
    """A daemon in a process of its own: every offloadd thread in this one is the plugin's."""
    with serve_process() as daemon:
        yield daemon.start()


def offloadd_threads(besides: set[int | None]) -> list[str]:
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.ident not in besides and t.name.startswith("offloadd")
    )


def test_each_manager_and_worker_runs_one_liveness_thread(
    tmp_path: Path, serve: ServeProcess
) -> None:
    """The harness runs the scheduler and both ranks in this process: three owners, three
    threads (before the link each had its own loop and its client's heartbeat thread)."""
    before = {t.ident for t in threading.enumerate()}
    with VllmHarness(tmp_path, extra_for(serve, block_size=16), tensor_parallel_size=2) as h:
        compute(h, A_PROMPT)
        settle(h, 6)  # connected and offloading
        assert offloadd_threads(before) == [
            "offloadd-link rank 0",
            "offloadd-link rank 1",
            "offloadd-link scheduler harness",
        ]
    assert offloadd_threads(before) == []  # shutdown ends them


@pytest.mark.parametrize("heartbeat", [0.1, 3600.0], ids=["heartbeat", "none"])
def test_an_unwatched_session_outlives_a_long_held_lock_by_the_heartbeat_alone(
    monkeypatch: pytest.MonkeyPatch, heartbeat: float
) -> None:
    """A scheduler in a pid namespace the daemon cannot see into (no pidfd) is kept by
    messages only; vLLM holds the manager's lock through a long ``schedule()``, so the
    manager's own keepalive waits, and only the link's heartbeat (no lock) speaks for it."""
    monkeypatch.setattr(offloadd.server.peers, "_pidfd_of", lambda conn, pid: None)
    monkeypatch.setattr(link_module, "HEARTBEAT_SECONDS", heartbeat)
    d = DaemonThread(capacity=64 << 20, session_timeout=0.6).start()
    manager = None
    try:
        assert d.daemon is not None
        manager = OffloaddManager(
            make_config(tp=1), endpoint=d.endpoint, optional=False, record_events=False
        )
        assert d.daemon.stats().sessions == 1
        with manager.lock:  # a schedule() five session timeouts long
            held_until = time.monotonic() + 3.0
            while time.monotonic() < held_until:
                if d.daemon.stats().sessions == 0:
                    break
                time.sleep(0.05)
            kept = d.daemon.stats().sessions == 1
        assert kept is (heartbeat < 0.6)
    finally:
        if manager is not None:
            manager.shutdown()
        d.stop()

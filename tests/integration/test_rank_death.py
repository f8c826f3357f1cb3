"""A rank killed with SIGKILL mid-store or mid-load: reaped fast, nothing half-written shown."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from offloadd.client import OffloadClient
from offloadd.errors import NotReady
from tests.fakes import FakeCopyEngine
from tests.integration.harness import (
    DaemonThread,
    Rank,
    chain_keys,
    chunk_block_ids,
    make_config,
    make_rank,
)

Spawn = Callable[[str, int, int, str], subprocess.Popen[str]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    processes: list[subprocess.Popen[str]] = []

    def start(endpoint: str, rank: int, tp: int, action: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.rank_process", endpoint, str(rank),
             str(tp), action],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        if process.stdin is not None:
            process.stdin.close()
        if process.stdout is not None:
            process.stdout.close()
        for leftover in glob.glob(f"/dev/shm/od-test-{process.pid}-*"):
            os.unlink(leftover)  # a killed rank cannot clean up its own tensors


def _until(condition: Callable[[], bool], timeout: float) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, "condition not met in time"
        time.sleep(0.01)
    return time.monotonic() - started


def _sessions(client: OffloadClient) -> int:
    return client.stats().sessions


@pytest.mark.parametrize("action", ["store", "load"])
def test_rank_killed_mid_job(
    daemon_factory: Callable[..., DaemonThread], ranks: list[Rank], spawn: Spawn, action: str
) -> None:
    gated = FakeCopyEngine()
    daemon = daemon_factory(copy_engine=gated)
    survivor = make_rank(daemon.endpoint, rank=0, tp=2)
    ranks.append(survivor)
    survivor.fill(0)
    keys = chain_keys(4)
    client = survivor.client
    assert client is not None

    if action == "load":  # the chunks must exist for a load: a first rank-1 stores them
        helper = make_rank(daemon.endpoint, rank=1, tp=2)
        helper.fill(1)
        for rank_client in (client, helper.client):
            assert rank_client is not None
            rank_client.store(9, keys, chunk_block_ids(range(4), 2))
            rank_client.wait([9], 10)
        helper.close()
        _until(lambda: _sessions(client) == 1, 5)

    # An unrelated engine keeps working throughout.
    other = make_rank(daemon.endpoint, rank=0, tp=1, engine_id="other", model="other/model")
    ranks.append(other)
    other.fill(5)
    assert other.client is not None

    imports_before = client.stats().imports
    gated.gate.clear()
    victim = spawn(daemon.endpoint, 1, 2, action)
    assert victim.stdout is not None
    assert victim.stdout.readline().strip() == "accepted"
    assert gated.started.acquire(timeout=10)  # the victim's copy is in flight
    assert client.stats().jobs_in_flight == 1

    victim.send_signal(signal.SIGKILL)
    reaped_in = _until(lambda: _sessions(client) == 2, 5)  # survivor + other engine
    assert reaped_in < 1.0, f"reaped after {reaped_in:.2f}s"
    gated.gate.set()
    _until(lambda: client.stats().jobs_in_flight == 0, 5)
    # Its regions were unmapped once its copy ended.
    assert client.stats().imports == imports_before

    assert other.client is not None
    other.client.store(1, chain_keys(2, salt=b"o"), chunk_block_ids([0, 1], 2))
    other.client.wait([1], 10)
    assert other.client.lookup(chain_keys(2, salt=b"o")).hits == 2

    # The rank restarts: the engine is ready again and stores from both ranks commit.
    restarted = make_rank(daemon.endpoint, rank=1, tp=2)
    ranks.append(restarted)
    restarted.fill(1)
    assert restarted.client is not None
    assert restarted.client.wait_ready(5).ranks_present == [0, 1]
    after = client.lookup(keys)
    if action == "store":
        # The dead rank's half-written shards never became visible, not even as pending.
        assert (after.hits, after.pending) == (0, [])
    else:
        assert after.hits == 4  # the chunks it was reading are intact and evictable again
    fresh = chain_keys(2, salt=b"fresh")
    for rank_client in (client, restarted.client):
        rank_client.store(3, fresh, chunk_block_ids([10, 11], 2))
        rank_client.wait([3], 10)
    assert client.lookup(fresh).hits == 2
    restarted.client.load(4, fresh, chunk_block_ids([0, 1], 2, 150))
    restarted.client.wait([4], 10)
    for got, want in zip(
        restarted.pages(chunk_block_ids([0, 1], 2, 150)),
        restarted.pages(chunk_block_ids([10, 11], 2)),
        strict=True,
    ):
        assert torch.equal(got, want)


def test_unwatchable_rank_is_kept_by_heartbeats_and_reaped_without_them(
    daemon_factory: Callable[..., DaemonThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    import offloadd.server.peers

    # A peer in a pid namespace the daemon cannot see into (the kernel gives pid 0): no
    # pidfd to watch, only heartbeats.
    monkeypatch.setattr(offloadd.server.peers, "_pidfd_of", lambda conn, pid: None)
    daemon = daemon_factory(session_timeout=0.6)
    config = make_config(rank=0, tp=1)
    with (
        OffloadClient.connect(daemon.endpoint, config, role="scheduler", heartbeat=0.1) as alive,
        OffloadClient.connect(
            daemon.endpoint, make_config(engine_id="silent", tp=1), role="scheduler", heartbeat=0
        ) as silent,
    ):
        assert alive.stats().sessions == 2
        waited = _until(lambda: alive.stats().sessions == 1, 5)
        assert 0.4 < waited < 3.0
        assert [e.engine_id for e in alive.stats().engines] == ["engine-a"]
        # The silent one is not lost for good: its next request says Hello again (and is
        # then told what any scheduler of an engine without ranks is told).
        with pytest.raises(NotReady):
            silent.lookup(chain_keys(1))
        assert alive.stats().sessions == 2

"""A daemon restart (SIGTERM or SIGKILL) keeps committed chunks, byte-identical."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from offloadd.client import OffloadClient
from offloadd.endpoint import nobody_listens
from offloadd.errors import DaemonUnavailable, NotReady
from tests.integration.harness import (
    Rank,
    ServeProcess,
    chain_keys,
    chunk_block_ids,
    make_rank,
    serve_process,
)


@pytest.fixture
def serve() -> Iterator[ServeProcess]:
    with serve_process() as daemon:
        yield daemon


def _demo(endpoint: str, phase: str) -> dict[str, int]:
    result = subprocess.run(
        [sys.executable, "-m", "offloadd", "demo", "--endpoint", endpoint, "--phase", phase,
         "--seed", "11", "--chunks", "32", "--json", "--events", "none"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary: dict[str, int] = json.loads(result.stdout)
    return summary


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_demo_store_restart_load(serve: ServeProcess, signum: int) -> None:
    serve.start()
    assert _demo(serve.endpoint, "store")["chunks_stored"] == 32
    status = serve.stop(signum)
    assert status == (0 if signum == signal.SIGTERM else -signal.SIGKILL)
    serve.start()
    loaded = _demo(serve.endpoint, "load")
    assert loaded["hits"] == 64 and loaded["chunks_loaded"] == 64
    assert loaded["mismatches"] == 0 and loaded["bytes_verified"] > 0


def test_uncommitted_chunks_are_gone_after_a_crash(serve: ServeProcess, ranks: list[Rank]) -> None:
    serve.start()
    engine = [make_rank(serve.endpoint, rank=r, tp=2) for r in range(2)]
    ranks.extend(engine)
    for seed, rank in enumerate(engine):
        rank.fill(seed)
    rank0, rank1 = (rank.client for rank in engine)
    assert rank0 is not None and rank1 is not None
    rank0.wait_ready(5)
    keys = chain_keys(3)
    for client in (rank0, rank1):  # chunk 0 commits
        client.store(1, keys[:1], [0, 1])
        client.wait([1], 10)
    rank0.store(2, keys[1:], chunk_block_ids([1, 2], 2))  # only one shard: stays pending
    rank0.wait([2], 10)
    assert rank0.lookup(keys).hits == 1 and rank0.lookup(keys).pending == [1, 2]
    serve.stop(signal.SIGKILL)

    serve.start()
    # The ranks' clients say Hello again by themselves; the engine is whole once both did.
    with pytest.raises(NotReady):
        rank0.lookup(keys)
    assert rank1.lookup(keys).hits == 1
    result = rank0.lookup(keys)
    assert (result.hits, result.pending) == (1, [])
    stats = rank0.stats()
    assert stats.committed_entries == stats.entries == 1
    assert stats.used_bytes == 2 * 2 * 4096 * 3  # only the committed chunk's two shards
    for job, (rank, client) in enumerate(zip(engine, (rank0, rank1), strict=True), start=3):
        client.load(job, keys[:1], [200, 201])
        client.wait([job], 10)
        for got, want in zip(rank.pages([200, 201]), rank.pages([0, 1]), strict=True):
            assert torch.equal(got, want)


def test_clients_see_unavailable_then_reconnect(serve: ServeProcess, ranks: list[Rank]) -> None:
    serve.start()
    rank = make_rank(serve.endpoint, rank=0, tp=1)
    ranks.append(rank)
    rank.fill(3)
    client = rank.client
    assert client is not None
    client.timeout = 1.0
    keys = chain_keys(2)
    client.store(1, keys, chunk_block_ids([0, 1], 2))
    client.wait([1], 10)
    serve.stop(signal.SIGTERM)

    with pytest.raises(DaemonUnavailable):
        client.lookup(keys)
    serve.start()
    client.timeout = 10.0
    assert client.lookup(keys).hits == 2  # a new session, said Hello by itself
    # After a crash too: the next request says Hello again and is served.
    serve.stop(signal.SIGKILL)
    serve.start()
    assert client.lookup(keys).hits == 2


def test_a_late_answer_from_a_restarted_daemon_that_forgot_the_session_asks_for_hello(
    serve: ServeProcess, ranks: list[Rank]
) -> None:
    """A keepalive's ping that a just-restarted daemon answers after the rank gave up on it:
    the late answer ("no such session") is read later and says Hello is due at once, so
    the rank does not store into a session that no longer exists until its next keepalive."""
    serve.start()
    rank = make_rank(serve.endpoint, rank=0, tp=1)
    ranks.append(rank)
    client = rank.client
    assert client is not None
    old_session = client.welcome
    serve.stop(signal.SIGKILL)
    serve.start()
    deadline = time.monotonic() + 10
    while not client.can_send():  # connected to the new daemon
        assert time.monotonic() < deadline, "the client did not reconnect"
        time.sleep(0.01)
    assert serve.process is not None
    serve.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(DaemonUnavailable, match="no answer"):
            client.keepalive(0.2)
    finally:
        serve.process.send_signal(signal.SIGCONT)
    assert not client.session_lost
    while not client.session_lost:  # the late answer
        assert time.monotonic() < deadline + 10, "the late answer did not come"
        client.poll(0.1)
    client.keepalive(10)
    assert client.welcome is not old_session and not client.session_lost


def test_only_a_dead_daemon_is_seen_as_nobody_listening(serve: ServeProcess) -> None:
    """The plugin's reconnect keeps a one-second pause only where nobody listens: a killed
    daemon (its socket file left behind) or none yet; a frozen one still takes connections
    into its backlog, and its pause doubles (offloadd.vllm.manager)."""
    assert nobody_listens(serve.endpoint)  # not started: no socket file
    serve.start()
    assert not nobody_listens(serve.endpoint)
    assert serve.process is not None
    serve.process.send_signal(signal.SIGSTOP)
    try:
        assert not nobody_listens(serve.endpoint)
    finally:
        serve.process.send_signal(signal.SIGCONT)
    with OffloadClient(serve.endpoint, timeout=10, heartbeat=0) as client:
        assert client.stats().capacity_bytes > 0  # the probes harmed nothing
    serve.stop(signal.SIGKILL)
    assert os.path.exists(serve.endpoint.removeprefix("ipc://"))  # left by the crash
    assert nobody_listens(serve.endpoint)
    serve.start()
    assert not nobody_listens(serve.endpoint)

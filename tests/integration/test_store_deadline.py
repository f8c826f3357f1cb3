"""A Store's deadline against a real daemon: a store whose deadline passes while its copy is
held never commits (the rank may have reused the blocks); one within it commits byte-exact;
and the Hello/Welcome handshake that says whether the rank's clock is the daemon's."""

from __future__ import annotations

import time
import uuid

import pytest
import torch
import zmq

from offloadd.errors import JobError, RequestFailed
from offloadd.transfer.types import Direction
from protocol import PROTOCOL_VERSION
from protocol.errors import ErrorCode
from protocol.messages import Hello, Store, Welcome, decode_reply, encode
from tests.fakes import FakeCopyEngine
from tests.integration.harness import (
    DaemonThread,
    Rank,
    chain_keys,
    chunk_block_ids,
    make_config,
    make_rank,
    with_token,
)

BPC = 2


def _rank(daemon: DaemonThread, ranks: list[Rank]) -> Rank:
    rank = make_rank(daemon.endpoint, rank=0, tp=1)
    ranks.append(rank)
    rank.fill(7)
    assert rank.client is not None
    rank.client.wait_ready(5)
    return rank


def _past(deadline: float) -> None:
    """Wait (bounded) until this process's clock is past ``deadline``."""
    bound = time.monotonic() + 10.0
    while time.monotonic() <= deadline:
        assert time.monotonic() < bound
        time.sleep(0.01)


def test_a_store_whose_deadline_passes_mid_copy_never_commits(
    daemon_factory: object, ranks: list[Rank]
) -> None:
    gated = FakeCopyEngine(held=(Direction.STORE,))
    daemon = daemon_factory(copy_engine=gated)  # type: ignore[operator]
    rank = _rank(daemon, ranks)
    client = rank.client
    assert client is not None and client.welcome is not None and client.welcome.shared_clock
    keys = chain_keys(2)
    blocks = chunk_block_ids(range(2), BPC)

    gated.gate.clear()  # the daemon's copy stalls, as a frozen daemon's would
    deadline = time.monotonic() + 0.2
    client.store(1, keys, blocks, deadline=deadline)
    assert gated.started.acquire(timeout=10)
    _past(deadline)  # the rank may now give the blocks back: it must not see them committed
    gated.gate.set()
    (done,) = client.wait([1], 10, raise_on_failure=False)
    assert not done.ok and "deadline" in done.error and done.failed_keys == keys
    # Nothing visible (the entries stay pending, with no copy in flight: evictable, and
    # stored again by the next store of those keys).
    assert client.lookup(keys).hits == 0
    client.load(2, keys, chunk_block_ids(range(2), BPC, 100))
    with pytest.raises(JobError) as missing:
        client.wait([2], 10)
    assert missing.value.results[0].failed_keys == keys
    assert client.stats().stores_refused_by_reason.get("late") == len(keys)

    # A generous deadline: committed, and every byte comes back.
    client.store(3, keys, blocks, deadline=time.monotonic() + 60.0)
    (stored,) = client.wait([3], 10)
    assert stored.ok and client.lookup(keys).hits == 2
    destination = chunk_block_ids(range(2), BPC, 100)
    client.load(4, keys, destination)
    (loaded,) = client.wait([4], 10)
    assert loaded.ok
    for got, want in zip(rank.pages(destination), rank.pages(blocks), strict=True):
        assert torch.equal(got, want)


def test_a_store_past_its_deadline_on_arrival_is_refused(
    daemon: DaemonThread, ranks: list[Rank]
) -> None:
    client = _rank(daemon, ranks).client
    assert client is not None
    keys = chain_keys(2, salt=b"late")
    blocks = chunk_block_ids(range(2), BPC)
    with pytest.raises(RequestFailed) as refused:
        client.store(1, keys, blocks, deadline=time.monotonic() - 1.0)
    assert refused.value.code == ErrorCode.DEADLINE_PASSED
    # In a step: that job's JobDone says so, the next job of the step still runs.
    late = Store(0, 2, keys[:1], blocks[:BPC], deadline=time.monotonic() - 1.0)
    fine = Store(0, 3, keys[1:], blocks[BPC:], deadline=time.monotonic() + 60.0)
    client.post_jobs([late, fine])
    first, second = client.wait([2, 3], 10, raise_on_failure=False)
    assert (first.ok, first.code, second.ok) == (False, ErrorCode.DEADLINE_PASSED, True)
    assert client.lookup(keys[1:]).hits == 1 and client.lookup(keys).hits == 0
    assert client.stats().stores_refused_by_reason.get("late") == 3


def _welcome(endpoint: str, monotonic: float) -> Welcome:
    """A scheduler's Hello saying ``monotonic`` for its clock, answered."""
    identity = uuid.uuid4().bytes
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    try:
        sock.connect(endpoint)
        config = make_config(engine_id="engine-clock", tp=1)
        hello = Hello(1, PROTOCOL_VERSION, "scheduler", config, monotonic=monotonic)
        sock.send(encode(with_token(endpoint, identity, hello)))
        assert sock.poll(10_000), "no reply"
        reply = decode_reply(sock.recv())
    finally:
        sock.close(linger=0)
        context.term()
    assert isinstance(reply, Welcome), reply
    return reply


def test_welcome_says_whether_the_rank_reads_the_daemons_clock(
    daemon: DaemonThread, ranks: list[Rank]
) -> None:
    client = _rank(daemon, ranks).client
    assert client is not None and client.welcome is not None
    assert client.welcome.shared_clock  # a client on this node, in this time namespace
    assert _welcome(daemon.endpoint, time.monotonic()).shared_clock
    assert not _welcome(daemon.endpoint, time.monotonic() + 100.0).shared_clock
    assert not _welcome(daemon.endpoint, time.monotonic() - 100.0).shared_clock
    assert not _welcome(daemon.endpoint, 0.0).shared_clock  # an older client: not said

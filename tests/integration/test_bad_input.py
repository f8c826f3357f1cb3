"""Bad input gets a clear error and everyone else keeps being served."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq

from offloadd.client import OffloadClient
from offloadd.errors import ConfigMismatch, InvalidRequest, NotReady
from protocol import PROTOCOL_VERSION
from protocol.errors import ErrorCode
from protocol.handles import KVRegion, ShmHandle
from protocol.messages import Error, Hello, Lookup, decode_reply, encode
from tests.fakes import FakeCopyEngine
from tests.integration.harness import (
    DaemonThread,
    Rank,
    chain_keys,
    chunk_block_ids,
    make_config,
    make_rank,
)


class RawPeer:
    """A DEALER that sends arbitrary frames and reads replies, for hostile input."""

    def __init__(self, endpoint: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, *frames: bytes) -> Error:
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(5000), "the daemon did not answer"
        reply = decode_reply(self.sock.recv())
        assert isinstance(reply, Error), reply
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def peer(daemon: DaemonThread) -> Iterator[RawPeer]:
    raw = RawPeer(daemon.endpoint)
    yield raw
    raw.close()


@pytest.mark.parametrize(
    ("field", "changes", "value"),
    [
        ("model.dtype", {"dtype": "float16"}, "float16"),
        ("parallel.world_size", {"tp": 4}, "4"),
        ("cache.tokens_per_hash", {"tokens_per_hash": 8}, "8"),
        ("model.name", {"model": "another/model"}, "another/model"),
    ],
)
def test_mismatched_hello_names_field_and_engine_survives(
    daemon: DaemonThread, ranks: list[Rank], field: str, changes: dict[str, object], value: str
) -> None:
    rank0 = make_rank(daemon.endpoint, rank=0, tp=2)
    ranks.append(rank0)
    with pytest.raises(ConfigMismatch) as refused:
        ranks.append(make_rank(daemon.endpoint, rank=1, **{"tp": 2, **changes}))  # type: ignore[arg-type]
    assert field in str(refused.value)
    assert value in str(refused.value)
    # The engine registered first is untouched: a correct rank 1 completes it.
    good = make_rank(daemon.endpoint, rank=1, tp=2)
    ranks.append(good)
    assert good.client is not None
    assert good.client.wait_ready(5).ranks_present == [0, 1]


def test_mismatched_geometry_between_ranks(daemon: DaemonThread, ranks: list[Rank]) -> None:
    ranks.append(make_rank(daemon.endpoint, rank=0, tp=2, page=4096))
    with pytest.raises(ConfigMismatch) as refused:
        ranks.append(make_rank(daemon.endpoint, rank=1, tp=2, page=8192))
    assert "worker_kv_bytes_per_block" in str(refused.value)


def test_regions_disagreeing_with_config(daemon: DaemonThread, ranks: list[Rank]) -> None:
    rank = make_rank(None, connect=False, rank=0, tp=1)
    ranks.append(rank)
    config = make_config(rank=0, tp=1, bytes_per_block=999)
    with pytest.raises(InvalidRequest) as refused:
        OffloadClient.connect(daemon.endpoint, config, [kv.region for kv in rank.tensors])
    assert "worker_kv_bytes_per_block" in str(refused.value)


def test_a_file_not_in_shared_memory_is_refused(daemon: DaemonThread) -> None:
    # The client opens the file with the rank's rights (root here) and passes it; the daemon
    # takes only tmpfs files, whoever could open them.
    region = KVRegion(ShmHandle("/etc/passwd", 0, 4096), 1, 4096, 4096, ("layer.0",))
    config = make_config(rank=0, tp=1, bytes_per_block=0)
    with pytest.raises(InvalidRequest, match="not on tmpfs"):
        OffloadClient.connect(daemon.endpoint, config, [region])


def test_daemon_arena_cannot_be_registered_as_a_kv_region(daemon: DaemonThread) -> None:
    region = KVRegion(ShmHandle(daemon.arena_path, 0, 4096), 1, 4096, 4096, ("layer.0",))
    config = make_config(rank=0, tp=1, bytes_per_block=0)
    with pytest.raises(InvalidRequest, match="daemon's own files"):
        OffloadClient.connect(daemon.endpoint, config, [region])


def test_requests_before_engine_ready(daemon: DaemonThread, ranks: list[Rank]) -> None:
    rank0 = make_rank(daemon.endpoint, rank=0, tp=2)
    ranks.append(rank0)
    assert rank0.client is not None
    with pytest.raises(NotReady, match=r"\[1\]"):
        rank0.client.lookup(chain_keys(1))


def test_bad_input_interleaved_with_valid_traffic(
    daemon: DaemonThread, ranks: list[Rank], peer: RawPeer
) -> None:
    engine = [make_rank(daemon.endpoint, rank=r, tp=2) for r in range(2)]
    ranks.extend(engine)
    for seed, rank in enumerate(engine):
        rank.fill(seed)
        assert rank.client is not None
        rank.client.wait_ready(5)
    keys = chain_keys(32)
    rng = random.Random(7)
    hostile = [
        lambda: peer.ask(os.urandom(rng.randrange(1, 200))),
        lambda: peer.ask(msgspec.msgpack.encode({"type": "nonsense", "request_id": 5})),
        lambda: peer.ask(msgspec.msgpack.encode({"type": "lookup", "request_id": "x"})),
        lambda: peer.ask(encode(Lookup(11, keys[:1]))),  # before Hello
        lambda: peer.ask(b"a", b"b"),  # two frames
        lambda: peer.ask(b"\xc1"),  # never-used msgpack byte
    ]
    expected_codes = [
        {ErrorCode.MALFORMED},
        {ErrorCode.MALFORMED},
        {ErrorCode.MALFORMED},
        {ErrorCode.NOT_REGISTERED},
        {ErrorCode.MALFORMED},
        {ErrorCode.MALFORMED},
    ]
    client0, client1 = (rank.client for rank in engine)
    assert client0 is not None and client1 is not None
    for chunk in range(32):
        index = chunk % len(hostile)
        error = hostile[index]()
        assert error.code in expected_codes[index], error
        # A rank's own bad requests: block id out of range, wrong lengths, unknown group.
        with pytest.raises(InvalidRequest, match="out of range"):
            client0.store(1000 + chunk, [keys[chunk]], [0, 10_000])
        with pytest.raises(InvalidRequest, match="block ids"):
            client0.store(2000 + chunk, [keys[chunk]], [0])
        with pytest.raises(InvalidRequest, match="group"):
            client0.lookup([keys[chunk][:-4] + (9).to_bytes(4, "big")])
        # Valid traffic in between is served as if nothing happened.
        for client in (client0, client1):
            client.store(chunk, [keys[chunk]], chunk_block_ids([chunk], 2))
            client.wait([chunk], 10)
        assert client0.lookup(keys[: chunk + 1]).hits == chunk + 1

    destination = chunk_block_ids(range(32), 2, 128)
    client1.load(500, keys, destination)
    client1.wait([500], 10)
    for got, want in zip(
        engine[1].pages(destination), engine[1].pages(chunk_block_ids(range(32), 2)), strict=True
    ):
        assert torch.equal(got, want)
    assert client0.stats().protocol_errors >= 32 * 4


def test_oversized_frame_and_wrong_version(daemon: DaemonThread, peer: RawPeer) -> None:
    big = b"\x00" * (daemon.settings.server.max_frame_bytes + 1)
    assert peer.ask(big).code == ErrorCode.TOO_LARGE
    hello = Hello(
        request_id=3,
        protocol_version=PROTOCOL_VERSION + 100,
        role="scheduler",
        config=make_config(),
    )
    error = peer.ask(encode(hello))
    assert error.code == ErrorCode.UNSUPPORTED_VERSION
    assert error.request_id == 3


def test_scheduler_registers_without_tensors_and_cannot_store(
    daemon: DaemonThread, ranks: list[Rank]
) -> None:
    rank = make_rank(daemon.endpoint, rank=0, tp=1)
    ranks.append(rank)
    with OffloadClient.connect(daemon.endpoint, make_config(tp=1), role="scheduler") as scheduler:
        assert scheduler.engine is not None and scheduler.engine.schedulers == 1
        with pytest.raises(InvalidRequest, match="WRONG_ROLE"):
            scheduler.store(1, chain_keys(1), [0, 1])
        assert scheduler.lookup(chain_keys(1)).hits == 0


def test_duplicate_job_id_refused_while_in_flight(
    daemon_factory: object, ranks: list[Rank]
) -> None:
    gated = FakeCopyEngine()
    daemon = daemon_factory(copy_engine=gated)  # type: ignore[operator]
    rank = make_rank(daemon.endpoint, rank=0, tp=1)
    ranks.append(rank)
    assert rank.client is not None
    gated.gate.clear()
    keys = chain_keys(2)
    rank.client.store(1, keys[:1], [0, 1])
    with pytest.raises(InvalidRequest, match="DUPLICATE_JOB"):
        rank.client.store(1, keys[1:], [2, 3])
    gated.gate.set()
    rank.client.wait([1], 10)
    rank.client.store(1, keys[1:], [2, 3])  # finished ids may be reused
    rank.client.wait([1], 10)
    assert rank.client.lookup(keys).hits == 2

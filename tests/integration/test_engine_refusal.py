"""A copy engine that refuses to start a job, and regions of the wrong kind of memory.

When ``submit`` raises, the daemon answers the Store or Load with an Error and undoes the
booking: no job in flight, the cache reservation released, the imports' references dropped,
and a later drain finishes at once instead of waiting for a job that will never end. A cuda
daemon refuses shared-memory regions at Hello (its engine could never copy them), and a cpu
daemon refuses CUDA regions.
"""

from __future__ import annotations

import io
import logging

import msgspec
import pytest

from offloadd import status
from offloadd.client import OffloadClient
from offloadd.errors import InvalidRequest, RequestFailed
from protocol.errors import ErrorCode
from protocol.handles import CudaIpcHandle, KVRegion
from tests.fakes import FakeCopyEngine
from tests.integration.conftest import DaemonFactory
from tests.integration.harness import (
    LAYERS,
    DaemonThread,
    Rank,
    chain_keys,
    chunk_block_ids,
    make_config,
    make_rank,
)

BPC = 2


def stats_of(daemon: DaemonThread, rank: Rank) -> tuple[int, int]:
    assert rank.client is not None
    stats = rank.client.stats()
    return stats.jobs_in_flight, stats.imports


def test_a_refused_submit_is_an_error_and_leaves_nothing_in_flight(
    daemon_factory: DaemonFactory, ranks: list[Rank], caplog: pytest.LogCaptureFixture
) -> None:
    engine = FakeCopyEngine(name="refusing-cpu", held=())
    daemon = daemon_factory(copy_engine=engine)
    rank = make_rank(daemon.endpoint, rank=0, tp=1)
    ranks.append(rank)
    client = rank.client
    assert client is not None
    client.wait_ready(5)
    rank.fill(1)
    keys = chain_keys(2)
    _, imports = stats_of(daemon, rank)

    engine.refuse.set()
    with pytest.raises(RequestFailed) as refused:
        client.store(1, keys, chunk_block_ids(range(2), BPC))
    assert refused.value.code == ErrorCode.INTERNAL
    assert "refused the job" in str(refused.value)
    assert stats_of(daemon, rank) == (0, imports)
    assert client.lookup(keys).hits == 0  # nothing half-written became visible

    engine.refuse.clear()
    client.store(1, keys, chunk_block_ids(range(2), BPC))  # the job id is free again
    (done,) = client.wait([1], 10)
    assert done.ok and client.lookup(keys).hits == 2

    engine.refuse.set()
    with pytest.raises(RequestFailed, match="refused the job"):
        client.load(2, keys, chunk_block_ids(range(2), BPC, base=100))
    assert stats_of(daemon, rank) == (0, imports)
    engine.refuse.clear()
    client.load(2, keys, chunk_block_ids(range(2), BPC, base=100))  # the reads were released
    (done,) = client.wait([2], 10)
    assert done.ok

    with caplog.at_level(logging.WARNING, logger="offloadd.server"):
        daemon.stop()
    assert "still in flight" not in caplog.text  # the drain had nothing to wait for


def test_a_cuda_daemon_refuses_shared_memory_regions_at_hello() -> None:
    # No GPU here: the cuda daemon starts with an injected engine and an unpinned arena.
    daemon = DaemonThread(copy_engine=FakeCopyEngine(name="refusing-cpu", held=()))
    server = msgspec.structs.replace(daemon.settings.server, copy_engine="cuda")
    daemon.settings = msgspec.structs.replace(daemon.settings, server=server)
    daemon.start()
    try:
        with pytest.raises(InvalidRequest) as refused:
            make_rank(daemon.endpoint, rank=0, tp=1)
        assert refused.value.code == ErrorCode.HANDLE_OPEN_FAILED
        message = str(refused.value)
        assert "region 0 is host shared memory" in message and "cuda copy engine" in message
        assert daemon.daemon is not None and daemon.daemon.stats().sessions == 0
    finally:
        daemon.stop()


def test_a_cpu_daemon_refuses_cuda_regions_at_hello(daemon: DaemonThread) -> None:
    handle = CudaIpcHandle(
        "GPU-0", b"\x02c" + bytes(64), 1 << 20, 0, b"/torch_1_2", 0, b"", False, 0, 1 << 20
    )
    region = KVRegion(handle, num_blocks=256, page_size=4096, block_stride=4096, layer_names=LAYERS)
    config = make_config(tp=1, bytes_per_block=4096 * len(LAYERS))
    with pytest.raises(InvalidRequest) as refused:
        OffloadClient.connect(daemon.endpoint, config, [region])
    assert refused.value.code == ErrorCode.HANDLE_OPEN_FAILED
    assert "region 0 is CUDA memory" in str(refused.value)


class UnbatchedEngine(FakeCopyEngine):
    """Stands in for a cuda engine that fell back to one driver call per copy."""

    batched = False

    def __init__(self) -> None:
        super().__init__(name="cuda", held=())


def test_a_degraded_cuda_daemon_says_so_in_its_log_stats_and_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    daemon = DaemonThread(copy_engine=UnbatchedEngine())
    server = msgspec.structs.replace(daemon.settings.server, copy_engine="cuda")
    daemon.settings = msgspec.structs.replace(daemon.settings, server=server)
    with caplog.at_level(logging.ERROR, logger="offloadd.server"):
        daemon.start()
    try:
        assert "copy path DEGRADED: not batched, not pinned" in caplog.text
        out, err = io.StringIO(), io.StringIO()
        assert status.main(daemon.endpoint, as_json=True, out=out, err=err) == 0
        assert msgspec.json.decode(out.getvalue())["copy_path"] == {
            "batched": False,
            "pinned": False,
        }
        out = io.StringIO()
        assert status.main(daemon.endpoint, out=out, err=err) == 0
        assert "copies     cuda DEGRADED" in out.getvalue()
    finally:
        daemon.stop()

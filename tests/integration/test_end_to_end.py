"""A whole engine's life against a real daemon, with real bytes through shared memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from offloadd.client import OffloadClient
from offloadd.errors import JobError
from offloadd.settings import LimitsSettings
from tests.fakes import FakeCopyEngine
from tests.integration.harness import (
    DaemonThread,
    Rank,
    chain_keys,
    chunk_block_ids,
    make_rank,
)

BPC = 2
CHUNKS = 64


def _engine(
    endpoint: str, ranks: list[Rank], tp: int = 2, seed: int = 0, **config: Any
) -> list[Rank]:
    engine = []
    for r in range(tp):
        rank = make_rank(endpoint, rank=r, tp=tp, **config)
        ranks.append(rank)
        rank.fill(seed * 100 + r)
        engine.append(rank)
    for rank in engine:
        assert rank.client is not None
        rank.client.wait_ready(5)
    return engine


def _store_all(engine: list[Rank], keys: list[bytes], chunks: list[int], job: int = 1) -> None:
    for rank in engine:
        assert rank.client is not None
        rank.client.store(job, [keys[i] for i in chunks], chunk_block_ids(chunks, BPC))
    for rank in engine:
        assert rank.client is not None
        rank.client.wait([job], 10)


def _load_and_compare(
    rank: Rank, source: Rank, keys: list[bytes], chunks: list[int], base: int, job: int
) -> None:
    assert rank.client is not None
    destination = chunk_block_ids(chunks, BPC, base)
    rank.client.load(job, [keys[i] for i in chunks], destination)
    (done,) = rank.client.wait([job], 10)
    assert done.ok and done.nbytes > 0
    expected = source.pages(chunk_block_ids(chunks, BPC))
    for got, want in zip(rank.pages(destination), expected, strict=True):
        assert torch.equal(got, want)


def test_tp2_store_lookup_load_every_byte(daemon: DaemonThread, ranks: list[Rank]) -> None:
    engine = _engine(daemon.endpoint, ranks)
    assert not torch.equal(engine[0].tensors[0].tensor, engine[1].tensors[0].tensor)
    keys = chain_keys(CHUNKS)
    _store_all(engine, keys, list(range(CHUNKS)))

    for rank in engine:
        assert rank.client is not None
        assert rank.client.lookup(keys).hits == CHUNKS

    # Zero the destination half, load there, and compare with each rank's own source bytes.
    base = CHUNKS * BPC
    for rank in engine:
        for kv in rank.tensors:
            kv.tensor[base:].zero_()
    for job, rank in enumerate(engine, start=10):
        _load_and_compare(rank, rank, keys, list(range(CHUNKS)), base, job)

    stats = engine[0].client.stats() if engine[0].client else None
    assert stats is not None
    assert stats.committed_entries == CHUNKS
    assert stats.bytes_stored == stats.bytes_loaded == 2 * CHUNKS * BPC * 4096 * 3


def test_second_engine_shares_namespace_other_model_does_not(
    daemon: DaemonThread, ranks: list[Rank]
) -> None:
    first = _engine(daemon.endpoint, ranks, engine_id="engine-a", dp=0)
    keys = chain_keys(16)
    _store_all(first, keys, list(range(16)))

    # Same model and layout, another engine and dp index: its ranks hold zeros (new process).
    second = [
        make_rank(daemon.endpoint, rank=r, tp=2, engine_id="engine-b", dp=1) for r in range(2)
    ]
    ranks.extend(second)
    for rank in second:
        assert rank.client is not None
        rank.client.wait_ready(5)
        assert rank.client.lookup(keys).hits == 16
    for job, (rank, source) in enumerate(zip(second, first, strict=True), start=20):
        _load_and_compare(rank, source, keys, list(range(16)), 64, job)
    assert first[0].client is not None and second[0].client is not None
    engines = second[0].client.stats().engines
    assert len({engine.namespace for engine in engines}) == 1

    other = _engine(daemon.endpoint, ranks, engine_id="engine-c", model="other/model")
    assert other[0].client is not None
    assert other[0].client.lookup(keys).hits == 0


def test_key_invisible_until_every_rank_stored(daemon: DaemonThread, ranks: list[Rank]) -> None:
    engine = _engine(daemon.endpoint, ranks)
    keys = chain_keys(4)
    rank0, rank1 = (rank.client for rank in engine)
    assert rank0 is not None and rank1 is not None
    rank0.store(1, keys, chunk_block_ids(range(4), BPC))
    rank0.wait([1], 10)
    result = rank0.lookup(keys)
    assert result.hits == 0
    assert result.pending == [0, 1, 2, 3]

    # Rank 1 stores only the first two: only those become visible.
    rank1.store(1, keys[:2], chunk_block_ids(range(2), BPC))
    rank1.wait([1], 10)
    result = rank0.lookup(keys)
    assert result.hits == 2
    assert result.pending == [2, 3]


def test_session_replaced_mid_store_never_becomes_visible(
    daemon_factory: object, ranks: list[Rank]
) -> None:
    gated = FakeCopyEngine()
    daemon = daemon_factory(copy_engine=gated)  # type: ignore[operator]
    engine = _engine(daemon.endpoint, ranks)
    keys = chain_keys(2)
    rank0, rank1 = engine
    assert rank0.client is not None and rank1.client is not None
    rank0.client.store(1, keys, chunk_block_ids(range(2), BPC))
    rank0.client.wait([1], 10)

    gated.gate.clear()
    rank1.client.store(1, keys, chunk_block_ids(range(2), BPC))
    assert gated.started.acquire(timeout=10)  # rank 1's copy is in flight, held at the gate
    # Rank 1 restarts: a new process says Hello for the same rank, replacing the session.
    restarted = make_rank(daemon.endpoint, rank=1, tp=2)
    ranks.append(restarted)
    restarted.fill(1)
    gated.gate.set()
    assert restarted.client is not None
    restarted.client.wait_ready(5)
    # The old copy finishes after the replacement: the key must stay invisible.
    assert restarted.client.lookup(keys).hits == 0

    # The abandoned entries are gone whole (rank 0's shard too): both ranks store again.
    assert restarted.client.lookup(keys).pending == []
    for client in (rank0.client, restarted.client):
        client.store(2, keys, chunk_block_ids(range(2), BPC))
        client.wait([2], 10)
    assert restarted.client.lookup(keys).hits == 2
    _load_and_compare(restarted, restarted, keys, [0, 1], 100, 3)


def test_capacity_evicts_least_recent_never_pinned_or_loading(
    daemon_factory: object, ranks: list[Rank]
) -> None:
    chunk_bytes = BPC * 4096 * 3  # one rank's shard
    n = 8
    # Pinning everything is what this test is about: the engine may protect the whole arena.
    everything = LimitsSettings(protected_fraction=1.0)
    daemon = daemon_factory(capacity=n * chunk_bytes * 2, limits=everything)  # type: ignore[operator]
    engine = _engine(daemon.endpoint, ranks, num_blocks=512)
    client = engine[0].client
    assert client is not None
    keys = chain_keys(3 * n)

    # Pin the first two chunks once stored; they must survive everything that follows.
    _store_all(engine, keys, [0, 1], job=1)
    assert client.lookup(keys[:2], pin=True, lease=60).pinned == 2
    for job, start in enumerate(range(2, 3 * n, 2), start=2):
        _store_all(engine, keys, [start, start + 1], job=job)
        stats = client.stats()
        assert stats.used_bytes <= stats.capacity_bytes
    present = [i for i in range(3 * n) if client.lookup([keys[i]]).hits == 1]
    # The pinned pair plus the most recent n - 2 chunks; everything in between was evicted.
    assert present == [0, 1, *range(3 * n - (n - 2), 3 * n)]
    assert client.stats().evictions == 3 * n - n

    # Nothing evictable: every resident chunk pinned -> a new store is refused, and counted.
    client.lookup([keys[i] for i in present], pin=True, lease=60)
    extra = chain_keys(1, salt=b"extra")
    for rank in engine:
        assert rank.client is not None
        rank.client.store(99, extra, [0, 1])
    with pytest.raises(JobError) as failed:
        engine[0].client.wait([99], 10) if engine[0].client else None
    assert failed.value.results[0].failed_keys == extra
    assert client.stats().stores_refused >= 1
    assert client.lookup(extra).hits == 0


def test_loading_keys_are_not_evicted(daemon_factory: object, ranks: list[Rank]) -> None:
    gated = FakeCopyEngine()
    chunk_bytes = BPC * 4096 * 3
    daemon = daemon_factory(capacity=2 * chunk_bytes * 2, copy_engine=gated)  # type: ignore[operator]
    engine = _engine(daemon.endpoint, ranks)
    keys = chain_keys(4)
    _store_all(engine, keys, [0, 1])
    rank0 = engine[0].client
    assert rank0 is not None
    gated.gate.clear()
    rank0.load(5, keys[:2], chunk_block_ids([0, 1], BPC, 100))
    assert gated.started.acquire(timeout=10)
    # Both resident chunks are being loaded: a store that needs room is refused.
    for rank in engine:
        assert rank.client is not None
        rank.client.store(6, keys[2:], chunk_block_ids([2, 3], BPC))
    gated.gate.set()
    results = rank0.wait([5, 6], 10, raise_on_failure=False)
    by_job = {r.job_id: r for r in results}
    assert by_job[5].ok
    assert by_job[6].failed_keys == keys[2:]
    assert rank0.lookup(keys[:2]).hits == 2


def test_load_of_missing_key_fails_with_keys_listed(
    daemon: DaemonThread, ranks: list[Rank]
) -> None:
    engine = _engine(daemon.endpoint, ranks)
    keys = chain_keys(3)
    _store_all(engine, keys, [0])
    client = engine[0].client
    assert client is not None
    for kv in engine[0].tensors:
        kv.tensor[50:].fill_(7)
    client.load(9, keys, chunk_block_ids(range(3), BPC, 50))
    with pytest.raises(JobError) as failed:
        client.wait([9], 10)
    assert failed.value.results[0].failed_keys == keys[1:]
    # Nothing was written: a load that cannot be served whole touches no block.
    assert all(bool((kv.tensor[50:] == 7).all()) for kv in engine[0].tensors)


def test_load_starting_mid_chunk(daemon: DaemonThread, ranks: list[Rank]) -> None:
    engine = _engine(daemon.endpoint, ranks)
    keys = chain_keys(2)
    _store_all(engine, keys, [0, 1])
    client = engine[0].client
    assert client is not None
    # Skip the first block of chunk 0: blocks 1, 2, 3 of the source land in 200, 201, 202.
    client.load(4, keys, [200, 201, 202], skip=1)
    client.wait([4], 10)
    for got, want in zip(engine[0].pages([200, 201, 202]), engine[0].pages([1, 2, 3]), strict=True):
        assert torch.equal(got, want)


def test_sync_client_context_manager_and_stats_without_hello(daemon: DaemonThread) -> None:
    with OffloadClient(daemon.endpoint) as client:
        stats = client.stats()
        assert stats.sessions == 0
        assert stats.capacity_bytes == daemon.settings.cache.capacity
    client.close()  # idempotent


@pytest.mark.parametrize("memfd", [False, True], ids=["dev-shm-files", "sealed-memfds"])
def test_both_kinds_of_region_file_move_bytes_exactly(
    daemon: DaemonThread, ranks: list[Rank], memfd: bool
) -> None:
    # Files in /dev/shm are reached by descriptor (pread/pwrite), sealed memfds through a
    # mapping: the same bytes either way.
    engine = [make_rank(daemon.endpoint, rank=r, tp=2, memfd=memfd) for r in range(2)]
    ranks.extend(engine)
    for seed, rank in enumerate(engine):
        rank.fill(40 + seed)
    keys = chain_keys(6, salt=b"memfd" if memfd else b"file")
    _store_all(engine, keys, list(range(6)), job=1)
    for rank in engine:
        assert rank.client is not None
        rank.client.load(2, keys, chunk_block_ids(range(6), BPC, 100))
        rank.client.wait([2], 10)
        got = rank.pages(chunk_block_ids(range(6), BPC, 100))
        want = rank.pages(chunk_block_ids(range(6), BPC))
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)

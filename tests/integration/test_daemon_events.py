"""KV events from a real daemon: attribution, eviction, snapshot on join, clear."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from offloadd.settings import DiskSettings, EventSettings, LimitsSettings
from offloadd.subscriber import Received, Subscriber
from protocol.events import AllBlocksCleared, BlockRemoved, BlockStored, hash_for_wire
from tests.integration.harness import (
    DaemonThread,
    Rank,
    chain_keys,
    chunk_block_ids,
    make_rank,
)
from tests.ports import free_port_pair

BPC = 2


class Stream:
    """Everything a subscriber has received so far, with waiting helpers."""

    def __init__(self, subscriber: Subscriber) -> None:
        self.subscriber = subscriber
        self.batches: list[Received] = []

    async def pump(self) -> None:
        async for received in self.subscriber:
            self.batches.append(received)

    def events(self, topic: str, kind: type) -> list:  # type: ignore[type-arg]
        return [
            event
            for received in self.batches
            if received.topic == topic
            for event in received.batch.events
            if isinstance(event, kind)
        ]

    async def until(self, condition: object, timeout: float = 10.0) -> None:
        assert callable(condition)
        deadline = asyncio.get_running_loop().time() + timeout
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, "events did not arrive"
            await asyncio.sleep(0.01)


@pytest_asyncio.fixture
async def stream(daemon: DaemonThread) -> AsyncIterator[Stream]:
    subscriber = Subscriber(daemon.events_endpoint, daemon.replay_endpoint)
    subscriber.connect()
    collected = Stream(subscriber)
    task = asyncio.create_task(collected.pump())
    yield collected
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    subscriber.close()


def _engine(endpoint: str, ranks: list[Rank], engine_id: str, dp: int, **kw: Any) -> list[Rank]:
    engine = [
        make_rank(endpoint, rank=r, tp=2, engine_id=engine_id, dp=dp, events=True, **kw)
        for r in range(2)
    ]
    ranks.extend(engine)
    for seed, rank in enumerate(engine):
        rank.fill(seed)
    for rank in engine:
        assert rank.client is not None
        rank.client.wait_ready(5)
    return engine


def _store(engine: list[Rank], keys: list[bytes], chunks: list[int], job: int) -> None:
    for rank in engine:
        assert rank.client is not None
        rank.client.store(job, [keys[i] for i in chunks], chunk_block_ids(chunks, BPC))
    for rank in engine:
        assert rank.client is not None
        rank.client.wait([job], 10)


def _hashes(keys: list[bytes]) -> list[int | bytes]:
    return [hash_for_wire(key[:-4]) for key in keys]


TOPIC_A = f"kv@test-pod/u{os.geteuid()}@test/model"  # the tenant: this test's uid


@pytest.mark.asyncio
async def test_commit_announced_to_every_engine_of_the_namespace(
    daemon_factory: object, ranks: list[Rank]
) -> None:
    chunk = BPC * 4096 * 3
    daemon = daemon_factory(capacity=4 * chunk * 2)  # type: ignore[operator]
    subscriber = Subscriber(daemon.events_endpoint, daemon.replay_endpoint)
    subscriber.connect()
    stream = Stream(subscriber)
    task = asyncio.create_task(stream.pump())
    try:
        a = await asyncio.to_thread(_engine, daemon.endpoint, ranks, "engine-a", 0)
        await asyncio.to_thread(_engine, daemon.endpoint, ranks, "engine-b", 1)
        keys = chain_keys(6)
        await asyncio.to_thread(_store, a, keys, [0, 1], 1)

        def stored(dp: int) -> list[BlockStored]:
            return [
                e
                for r in stream.batches
                if r.batch.data_parallel_rank == dp
                for e in r.batch.events
                if isinstance(e, BlockStored)
            ]

        await stream.until(lambda: len(stored(0)) == 2 and len(stored(1)) == 2)
        for dp in (0, 1):
            assert [e.block_hashes[0] for e in stored(dp)] == _hashes(keys[:2])
            assert all(e.medium == "CPU" and e.group_idx == 0 for e in stored(dp))
            assert all(e.token_ids == [] and e.block_size == 0 for e in stored(dp))
        assert {r.topic for r in stream.batches} == {TOPIC_A}

        # The arena holds 4 chunks: storing 4 more evicts exactly the first two... and the
        # removal names exactly the evicted hashes, under both engines.
        await asyncio.to_thread(_store, a, keys, [2, 3], 2)
        await asyncio.to_thread(_store, a, keys, [4, 5], 3)

        def removed(dp: int) -> list[int | bytes]:
            return [
                h
                for r in stream.batches
                if r.batch.data_parallel_rank == dp
                for e in r.batch.events
                if isinstance(e, BlockRemoved)
                for h in e.block_hashes
            ]

        await stream.until(lambda: len(removed(0)) == 2 and len(removed(1)) == 2)
        assert removed(0) == removed(1) == _hashes(keys[:2])
        seqs = [r.seq for r in stream.batches]
        assert seqs == list(range(len(seqs)))  # one stream, every batch once, in order
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        subscriber.close()


@pytest.mark.asyncio
async def test_joining_engine_gets_snapshot_and_clear_is_announced(
    daemon: DaemonThread, ranks: list[Rank], stream: Stream
) -> None:
    a = await asyncio.to_thread(_engine, daemon.endpoint, ranks, "engine-a", 0)
    keys = chain_keys(5)
    await asyncio.to_thread(_store, a, keys, list(range(5)), 1)
    await stream.until(lambda: len(stream.events(TOPIC_A, BlockStored)) == 5)

    # An engine of the same model joins later: its dp index gets the five chunks at once.
    await asyncio.to_thread(_engine, daemon.endpoint, ranks, "engine-b", 3)

    def snapshot() -> list[int | bytes]:
        return [
            e.block_hashes[0]
            for r in stream.batches
            if r.batch.data_parallel_rank == 3
            for e in r.batch.events
            if isinstance(e, BlockStored)
        ]

    await stream.until(lambda: len(snapshot()) == 5)
    assert snapshot() == _hashes(keys)

    # Engine a's scheduler clears: a hears AllBlocksCleared, b the exact removals.
    assert a[0].client is not None
    assert await asyncio.to_thread(a[0].client.clear) == 5

    def cleared(dp: int, kind: type) -> list:  # type: ignore[type-arg]
        return [
            e
            for r in stream.batches
            if r.batch.data_parallel_rank == dp
            for e in r.batch.events
            if isinstance(e, kind)
        ]

    await stream.until(lambda: cleared(0, AllBlocksCleared) and cleared(3, BlockRemoved))
    assert [h for e in cleared(3, BlockRemoved) for h in e.block_hashes] == _hashes(keys)
    assert not cleared(3, AllBlocksCleared)
    assert a[0].client is not None
    assert a[0].client.lookup(keys).hits == 0


@pytest.mark.asyncio
async def test_the_snapshot_for_a_joining_engine_is_bounded(
    daemon_factory: object, ranks: list[Rank]
) -> None:
    daemon = daemon_factory(limits=LimitsSettings(snapshot_keys=2))  # type: ignore[operator]
    subscriber = Subscriber(daemon.events_endpoint, daemon.replay_endpoint)
    subscriber.connect()
    stream = Stream(subscriber)
    task = asyncio.create_task(stream.pump())
    try:
        a = await asyncio.to_thread(_engine, daemon.endpoint, ranks, "engine-a", 0)
        keys = chain_keys(5)
        await asyncio.to_thread(_store, a, keys, list(range(5)), 1)
        await stream.until(lambda: len(stream.events(TOPIC_A, BlockStored)) == 5)
        # Every engine that becomes ready would queue its whole namespace: only the newest
        # limits.snapshot_keys are announced (the daemon logs how many it left out).
        await asyncio.to_thread(_engine, daemon.endpoint, ranks, "engine-b", 3)
        assert a[0].client is not None
        await asyncio.to_thread(a[0].client.clear)  # after the snapshot, on the same stream

        def at_dp3(kind: type[BlockStored | BlockRemoved]) -> list[int | bytes]:
            return [
                h
                for r in stream.batches
                if r.batch.data_parallel_rank == 3
                for e in r.batch.events
                if isinstance(e, kind)
                for h in e.block_hashes
            ]

        await stream.until(lambda: len(at_dp3(BlockRemoved)) == 5)
        assert at_dp3(BlockStored) == _hashes(keys[-2:])
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        subscriber.close()


@pytest.mark.asyncio
async def test_engines_without_events_publish_nothing(
    daemon: DaemonThread, ranks: list[Rank], stream: Stream
) -> None:
    engine = [make_rank(daemon.endpoint, rank=r, tp=2) for r in range(2)]
    ranks.extend(engine)
    for rank in engine:
        assert rank.client is not None
        await asyncio.to_thread(rank.client.wait_ready, 5)
    await asyncio.to_thread(_store, engine, chain_keys(2), [0, 1], 1)
    # A later engine with events on joins: it sees the snapshot, proving the stream works,
    # and nothing was published for the first engine.
    await asyncio.to_thread(_engine, daemon.endpoint, ranks, "engine-e", 2)
    await stream.until(lambda: len(stream.batches) >= 1)
    assert all(r.batch.data_parallel_rank == 2 for r in stream.batches)


# --- where the events are: Welcome and GetStats ------------------------------------------------


def test_welcome_and_stats_say_where_the_events_are(
    daemon: DaemonThread, ranks: list[Rank]
) -> None:
    rank = make_rank(daemon.endpoint, rank=0, tp=1)
    ranks.append(rank)
    assert rank.client is not None and rank.client.welcome is not None
    welcome = rank.client.welcome
    assert (welcome.events_endpoint, welcome.events_replay_endpoint) == (
        daemon.events_endpoint,
        daemon.replay_endpoint,
    )
    stats = rank.client.stats()
    assert (stats.events_endpoint, stats.events_replay_endpoint) == (
        daemon.events_endpoint,
        daemon.replay_endpoint,
    )


def test_each_dp_index_is_told_its_own_publisher(ranks: list[Rank]) -> None:
    pub_port, replay_port = free_port_pair(), free_port_pair()
    daemon = DaemonThread()
    daemon.settings = msgspec.structs.replace(
        daemon.settings,
        events=EventSettings(
            endpoint=f"tcp://127.0.0.1:{pub_port}",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            port_per_dp=True,
        ),
    )
    daemon.start()
    try:
        rank = make_rank(daemon.endpoint, rank=0, tp=1, dp=2)
        ranks.append(rank)
        assert rank.client is not None and rank.client.welcome is not None
        welcome = rank.client.welcome
        assert welcome.events_endpoint == f"tcp://127.0.0.1:{pub_port + 2}"
        assert welcome.events_replay_endpoint == f"tcp://127.0.0.1:{replay_port + 2}"
        stats = rank.client.stats()  # dp 0's publisher
        assert stats.events_endpoint == f"tcp://127.0.0.1:{pub_port}"
    finally:
        for created in ranks:
            created.close()
        ranks.clear()
        daemon.stop()


def test_without_events_the_endpoints_are_empty(ranks: list[Rank]) -> None:
    daemon = DaemonThread()
    daemon.settings = msgspec.structs.replace(
        daemon.settings, events=EventSettings(endpoint="", replay_endpoint="")
    )
    daemon.start()
    try:
        rank = make_rank(daemon.endpoint, rank=0, tp=1, events=True)
        ranks.append(rank)
        assert rank.client is not None and rank.client.welcome is not None
        assert rank.client.welcome.events_endpoint == ""
        assert rank.client.welcome.events_replay_endpoint == ""
        assert rank.client.stats().events_endpoint == ""
        # An engine that asks for events is still served; nothing is published.
        rank.fill(1)
        keys = chain_keys(2)
        rank.client.store(1, keys, chunk_block_ids(range(2), BPC))
        assert all(done.ok for done in rank.client.wait([1], 10))
        assert rank.client.lookup(keys).hits == 2
    finally:
        for created in ranks:
            created.close()
        ranks.clear()
        daemon.stop()


@pytest.mark.asyncio
async def test_chunks_on_the_disk_tier_are_announced_as_local_storage(
    daemon_factory: object, ranks: list[Rank], tmp_path: object
) -> None:
    chunk = BPC * 4096 * 3
    # Room for 4 chunk files (two shards each, and a header), not 5.
    disk = DiskSettings(path=f"{tmp_path}/disk", capacity=4 * chunk * 2 + 3 * 4096 * 2)
    daemon = daemon_factory(capacity=8 * chunk * 2, disk=disk)  # type: ignore[operator]
    subscriber = Subscriber(daemon.events_endpoint, daemon.replay_endpoint)
    subscriber.connect()
    stream = Stream(subscriber)
    task = asyncio.create_task(stream.pump())
    try:
        a = await asyncio.to_thread(_engine, daemon.endpoint, ranks, "engine-a", 0)
        keys = chain_keys(6)
        await asyncio.to_thread(_store, a, keys, [0, 1, 2, 3], 1)

        def on(kind: type, medium: str, locality: str | None = None) -> list[int | bytes]:
            return [
                h
                for e in stream.events(TOPIC_A, kind)
                if (e.medium, e.locality) == (medium, locality)
                for h in e.block_hashes
            ]

        # Written through to the disk: the same hashes, once on CPU and once on local
        # STORAGE (vLLM 0.33's names for a tier below host memory on this node).
        local = ("STORAGE", "LOCAL")
        await stream.until(lambda: len(on(BlockStored, *local)) == 4)
        assert on(BlockStored, *local) == on(BlockStored, "CPU") == _hashes(keys[:4])
        # The disk holds 4 chunks: two more evict its two oldest, announced as removed there.
        await asyncio.to_thread(_store, a, keys, [4, 5], 2)
        await stream.until(lambda: len(on(BlockStored, *local)) == 6)
        await stream.until(lambda: len(on(BlockRemoved, *local)) == 2)
        assert on(BlockRemoved, *local) == _hashes(keys[:2])
        assert on(BlockRemoved, "CPU") == []  # the arena kept them all
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        subscriber.close()

"""The asyncio client against a real daemon, on both event loops."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import pytest_asyncio
import torch

from offloadd.client import AsyncOffloadClient
from offloadd.errors import DaemonUnavailable, JobError, NotReady
from offloadd.shm import SharedKVTensor
from protocol.messages import HoldKeys, HoldResult, KeysChanged, LookupResult, Ok, Reply, Reserved
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

PAGE = 1024
BPC = 2  # make_config's blocks_per_chunk
KEY_BYTES = len(LAYERS) * BPC * PAGE  # one key's bytes, one shard (TP=1)


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> DaemonThread:
    # A mirror is never dropped for a slow acknowledgement here (that frees its removals'
    # room too): only the scheduler's ack can.
    return daemon_factory(mirror_ack_timeout=60.0)


@pytest.fixture
def tensors() -> Iterator[list[list[SharedKVTensor]]]:
    made = [
        [SharedKVTensor.create(64, 2048, [layer], prefix="od-test") for layer in LAYERS]
        for _ in range(2)
    ]
    for seed, rank in enumerate(made):
        generator = torch.Generator().manual_seed(seed)
        for kv in rank:
            kv.tensor.copy_(
                torch.randint(0, 256, kv.tensor.shape, generator=generator, dtype=torch.uint8)
            )
    yield made
    for rank in made:
        for kv in rank:
            kv.close()


@pytest.mark.asyncio
async def test_async_round_trip(daemon: DaemonThread, tensors: list[list[SharedKVTensor]]) -> None:
    clients = []
    try:
        for rank, kvs in enumerate(tensors):
            config = make_config(rank=rank, tp=2, bytes_per_block=2048 * len(LAYERS))
            if rank == 0:
                first = await AsyncOffloadClient.connect(
                    daemon.endpoint, config, [kv.region for kv in kvs]
                )
                clients.append(first)
                with pytest.raises(NotReady):
                    await first.lookup(chain_keys(1))
            else:
                clients.append(
                    await AsyncOffloadClient.connect(
                        daemon.endpoint, config, [kv.region for kv in kvs]
                    )
                )
        for client in clients:
            state = await client.wait_ready(5)
            assert state.ranks_present == [0, 1]
        keys = chain_keys(8)
        for client in clients:
            await client.store(1, keys, list(range(16)))
        for client in clients:
            (done,) = await client.wait([1], 10)
            assert done.ok and done.nbytes == 16 * 2048 * len(LAYERS)
        lookup = await clients[0].lookup(keys, pin=True, lease=30)
        assert (lookup.hits, lookup.pinned) == (8, 8)
        assert await clients[0].release(keys) == 8
        for client in clients:
            await client.load(2, keys, list(range(32, 48)))
            await client.wait([2], 10)
        for kvs in tensors:
            for kv in kvs:
                assert torch.equal(kv.pages(range(32, 48)), kv.pages(range(16)))
        # A load of keys that are not cached fails the job and lists them.
        missing = chain_keys(2, salt=b"missing")
        await clients[1].load(3, missing, [50, 51, 52, 53])
        with pytest.raises(JobError) as failed:
            await clients[1].wait([3], 10)
        assert failed.value.results[0].failed_keys == missing
        assert (await clients[0].stats()).sessions == 2
    finally:
        for client in clients:
            await client.close()
            await client.close()  # idempotent


@pytest.mark.asyncio
async def test_async_client_reports_missing_daemon() -> None:
    client = AsyncOffloadClient("ipc:///tmp/od-nobody-here.sock", timeout=0.3)
    try:
        with pytest.raises(DaemonUnavailable):
            await client.stats()
    finally:
        await client.close()


class Step:
    """A worker rank (``AsyncOffloadClient``, shared-memory pages) and its engine's
    scheduler (``AsyncOffloadClient``, role scheduler, mirroring), TP=1."""

    def __init__(self, rank: Rank, worker: AsyncOffloadClient, sched: AsyncOffloadClient):
        self.rank, self.worker, self.sched = rank, worker, sched
        self.notices: list[KeysChanged] = []

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        """Poll ``condition`` (the reader tasks fill the clients meanwhile) up to 10 s."""
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, f"not in time: {what}"
            await asyncio.sleep(0.01)

    async def answers(self, count: int) -> dict[int, Reply]:
        """The scheduler's next ``count`` answers to posted requests, by request id."""
        got: dict[int, Reply] = {}

        def arrived() -> bool:
            got.update((getattr(a, "request_id", -1), a) for a in self.sched.take_answers())
            return len(got) >= count

        await self.until(arrived, f"{count} answers")
        assert len(got) == count
        return got

    def mirror(self) -> set[bytes]:
        """The scheduler's key mirror, as the vLLM manager applies it."""
        self.notices.extend(self.sched.take_notices())
        keys: set[bytes] = set()
        for notice in self.notices:
            if notice.reset:
                keys.clear()
            keys.update(notice.stored)
            keys.difference_update(notice.removed)
        return keys


@pytest_asyncio.fixture
async def step(daemon: DaemonThread) -> AsyncIterator[Step]:
    rank = make_rank(None, tp=1, page=PAGE, num_blocks=64, connect=False)
    clients: list[AsyncOffloadClient] = []
    try:
        rank.fill(3)
        files = {path: fd for kv in rank.tensors for path, fd in kv.files.items()}
        regions = [kv.region for kv in rank.tensors]
        clients.append(
            await AsyncOffloadClient.connect(daemon.endpoint, rank.config, regions, files=files)
        )
        clients.append(
            await AsyncOffloadClient.connect(
                daemon.endpoint, rank.config, role="scheduler", mirror=True
            )
        )
        await clients[1].wait_ready(5)
        yield Step(rank, clients[0], clients[1])
    finally:
        for client in clients:
            await client.close()
        rank.close()


@pytest.mark.asyncio
async def test_async_scheduler_posts_a_step_and_takes_its_answers_later(
    daemon: DaemonThread, step: Step
) -> None:
    """Reserve (with its probes), UpdateHolds and Ping posted by the asyncio client, each
    answered later through ``take_answers``; what the Reserve reserved is what the rank's
    reserved store writes."""
    keys = chain_keys(3, b"async-step")
    reserve_id, whole, tail = await step.sched.post_reserve(keys[:2], lookups=[keys, keys[2:]])
    answers = await step.answers(3)
    assert answers[reserve_id] == Reserved(reserve_id, [0, 1], [])
    # The probes run right after the Reserve: its keys are pending, keys[2] is nowhere.
    assert answers[whole] == LookupResult(whole, 0, [0, 1])
    assert answers[tail] == LookupResult(tail, 0, [])
    # keys[2] was never reserved: the rank's reserved store skips it.
    await step.worker.store(1, keys, chunk_block_ids([0, 1, 2], BPC), reserved=True)
    (done,) = await step.worker.wait([1], 10)
    assert done.ok and done.nbytes == 2 * KEY_BYTES
    assert (await step.worker.lookup(keys)).hits == 2
    await step.until(lambda: step.mirror() == set(keys[:2]), "the mirror shows the store")
    # Held: the committed keys; keys[2] is not cached, so it is missing.
    (hold_id, probe) = await step.sched.post_update_holds([HoldKeys("req-1", keys)], lookups=[keys])
    answers = await step.answers(2)
    assert answers[hold_id] == HoldResult(hold_id, 2, [keys[2]])
    assert answers[probe] == LookupResult(probe, 2, [])
    ping_id = await step.sched.post_ping()
    assert await step.answers(1) == {ping_id: Ok(ping_id, 1)}  # 1: the daemon knows it
    assert step.sched.take_answers() == []
    # A client that never said Hello is answered 0: no session.
    stranger = AsyncOffloadClient(daemon.endpoint)
    try:
        await stranger.stats()  # a round trip first: a post never waits for the connection
        stranger_ping = await stranger.post_ping()
        deadline = time.monotonic() + 10
        while not (got := stranger.take_answers()):
            assert time.monotonic() < deadline, "no answer to the stranger's ping"
            await asyncio.sleep(0.01)
        assert got == [Ok(stranger_ping, 0)]
    finally:
        await stranger.close()


@pytest.mark.asyncio
async def test_async_scheduler_ack_frees_the_room_of_removed_keys(
    daemon: DaemonThread, step: Step
) -> None:
    """Keys a rank cleared keep their bytes until the mirroring scheduler acknowledges
    their removal; the asyncio client's one-way ``ack`` is that acknowledgement."""
    assert daemon.daemon is not None
    stats = daemon.daemon.stats
    keys = chain_keys(2, b"async-ack")
    assert (await step.sched.reserve(keys)).reserved == [0, 1]
    await step.worker.store(1, keys, chunk_block_ids([0, 1], BPC), reserved=True)
    await step.worker.wait([1], 10)
    await step.until(lambda: step.mirror() == set(keys), "the mirror shows the store")
    used = stats().used_bytes
    assert used > 0
    assert await step.worker.clear() == 2
    await step.until(lambda: step.mirror() == set(), "the mirror shows the removal")
    assert stats().committed_entries == 0
    assert stats().used_bytes == used  # the removed keys' bytes wait for the scheduler
    await step.sched.ack(max(notice.seq for notice in step.notices))
    await step.until(lambda: stats().used_bytes == 0, "the acknowledged room is freed")
    assert stats().mirrors_dropped == 0


@pytest.mark.asyncio
async def test_async_posts_that_cannot_be_sent_raise_and_book_nothing() -> None:
    """No daemon: each one-way send raises at once, as the blocking client's does, and no
    answer is waited for."""
    client = AsyncOffloadClient("ipc:///tmp/od-nobody-here.sock", heartbeat=0)
    try:
        with pytest.raises(DaemonUnavailable):
            await client.post_reserve(chain_keys(1), lookups=[chain_keys(1)])
        with pytest.raises(DaemonUnavailable):
            await client.post_update_holds([HoldKeys("t", chain_keys(1))])
        with pytest.raises(DaemonUnavailable):
            await client.post_ping()
        with pytest.raises(DaemonUnavailable):
            await client.ack(1)
        assert client._core.awaited == set() and client._core.sent == 0
    finally:
        await client.close()

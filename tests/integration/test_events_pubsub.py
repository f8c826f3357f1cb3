"""Publisher, replay and subscriber over real ZMQ sockets (ipc:// in a temp dir, tcp loopback).

PUB/SUB needs a moment before a new subscription takes effect, so tests never assume the
first live batch arrives: ``pump`` keeps publishing small batches until the subscriber has
seen what the test waits for, and every other wait polls a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator

import msgspec
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from offloadd.endpoint import connectable, offset_endpoint_port, replay_beside
from offloadd.server import publisher as publisher_module
from offloadd.server.publisher import (
    REPLAY_WINDOW,
    EventBindError,
    EventPublisher,
    PublisherSet,
    topic_for,
)
from offloadd.settings import EventSettings
from offloadd.subscriber import Received, Subscriber, event_lines, event_records
from protocol.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from tests.ports import free_port_pair

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 10.0


def make_batch(n: int, *, tokens: int = 0, rank: int | None = 0) -> KVEventBatch:
    """A batch whose content identifies ``n`` (ts and hash)."""
    return KVEventBatch(
        ts=float(n),
        events=[
            BlockStored(
                block_hashes=[n],
                parent_block_hash=None,
                token_ids=list(range(tokens)),
                block_size=0,
                lora_id=None,
                medium="CPU",
                lora_name=None,
                group_idx=0,
            )
        ],
        data_parallel_rank=rank,
    )


async def wait_until(condition: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    """Poll ``condition`` until true; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def pump(
    publisher: EventPublisher,
    condition: Callable[[], bool],
    *,
    topic: str = "t",
    base: int = 0,
    timeout: float = TIMEOUT,
) -> None:
    """Publish one small batch per poll until ``condition`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        publisher.publish(topic, make_batch(base + publisher.next_seq + publisher.queued))
        await asyncio.sleep(0.005)


class Collector:
    """Iterates a subscriber in a task, keeping what it receives."""

    def __init__(self, subscriber: Subscriber) -> None:
        self.subscriber = subscriber
        self.items: list[Received] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Collector:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        async for received in self.subscriber:
            self.items.append(received)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, TIMEOUT)
            self._task = None

    def seqs(self, epoch: int = 0) -> list[int]:
        return [item.seq for item in self.items if item.epoch == epoch]

    def has_live(self, epoch: int = 0) -> bool:
        return any(not item.replayed and item.epoch == epoch for item in self.items)


@pytest_asyncio.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="ev-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def endpoints(workdir: str) -> tuple[str, str]:
    return f"ipc://{workdir}/pub", f"ipc://{workdir}/replay"


@pytest_asyncio.fixture
async def collectors() -> AsyncIterator[list[Collector]]:
    made: list[Collector] = []
    yield made
    for collector in made:
        await collector.stop()


# --- Replay on start, then live ------------------------------------------------------


@pytest.mark.asyncio
async def test_late_subscriber_replays_then_goes_live(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str], collectors: list[Collector]
) -> None:
    pub_ep, replay_ep = endpoints
    async with EventPublisher(pub_ep, replay_ep, ctx=ctx) as publisher:
        for n in range(5):
            assert publisher.publish("t", make_batch(n))
        await wait_until(lambda: publisher.published == 5)

        async with Subscriber(pub_ep, replay_ep, ctx=ctx) as subscriber:
            collector = Collector(subscriber).start()
            collectors.append(collector)
            await pump(publisher, collector.has_live)
            await wait_until(lambda: len(collector.items) == publisher.next_seq)
            for n in range(3):
                publisher.publish("t", make_batch(1000 + n))
            total = publisher.next_seq + publisher.queued
            await wait_until(lambda: len(collector.items) == total)

            items = collector.items
            assert [item.seq for item in items] == list(range(total))
            assert all(item.replayed for item in items[:5])
            assert [item.batch for item in items[:5]] == [make_batch(n) for n in range(5)]
            assert [item.batch.ts for item in items[-3:]] == [1000.0, 1001.0, 1002.0]
            assert not items[-1].replayed
            assert {item.epoch for item in items} == {0}
            assert {item.topic for item in items} == {"t"}
            assert subscriber.lost == 0
            await collector.stop()


@pytest.mark.asyncio
async def test_gap_is_filled_from_replay(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str], collectors: list[Collector]
) -> None:
    pub_ep, replay_ep = endpoints
    # A one-message pipe on both sides: a burst of large batches overflows it and the
    # PUB socket drops, as it does above its high-water mark in production.
    async with (
        EventPublisher(pub_ep, replay_ep, hwm=1, buffer_steps=1000, ctx=ctx) as publisher,
        Subscriber(pub_ep, replay_ep, ctx=ctx, rcvhwm=1) as subscriber,
    ):
        collector = Collector(subscriber).start()
        collectors.append(collector)
        await pump(publisher, collector.has_live)
        await collector.stop()  # nobody reads during the burst

        burst_start = publisher.next_seq + publisher.queued
        for n in range(150):
            publisher.publish("t", make_batch(burst_start + n, tokens=16384))
        await wait_until(lambda: publisher.queued == 0)

        collector.start()
        await pump(
            publisher, lambda: collector.items[-1].seq == publisher.next_seq - 1, base=10_000
        )
        seqs = [item.seq for item in collector.items]
        assert seqs == list(range(len(seqs)))
        burst = [item for item in collector.items if burst_start <= item.seq < burst_start + 150]
        assert [item.batch.ts for item in burst] == [float(burst_start + n) for n in range(150)]
        assert any(item.replayed for item in burst), "the burst should have overflowed"
        assert subscriber.lost == 0
        assert subscriber.replayed > 0


@pytest.mark.asyncio
async def test_lost_range_when_replay_buffer_is_too_short(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str], collectors: list[Collector]
) -> None:
    pub_ep, replay_ep = endpoints
    async with (
        EventPublisher(pub_ep, replay_ep, hwm=1, buffer_steps=5, ctx=ctx) as publisher,
        Subscriber(pub_ep, replay_ep, ctx=ctx, rcvhwm=1) as subscriber,
    ):
        collector = Collector(subscriber).start()
        collectors.append(collector)
        await pump(publisher, collector.has_live)
        await collector.stop()
        for n in range(100):
            publisher.publish("t", make_batch(n, tokens=16384))
        await wait_until(lambda: publisher.queued == 0)
        collector.start()
        await pump(publisher, lambda: collector.items[-1].seq == publisher.next_seq - 1)
        seqs = [item.seq for item in collector.items]
        assert seqs == sorted(set(seqs))  # in order, no duplicates
        assert subscriber.lost > 0
        assert subscriber.lost + len(seqs) == publisher.next_seq


@pytest.mark.asyncio
async def test_publisher_restart_starts_a_new_epoch(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str], collectors: list[Collector]
) -> None:
    pub_ep, replay_ep = endpoints
    async with Subscriber(pub_ep, replay_ep, ctx=ctx) as subscriber:
        collector = Collector(subscriber).start()
        collectors.append(collector)
        async with EventPublisher(pub_ep, replay_ep, ctx=ctx) as first:
            await pump(first, collector.has_live)
            # Enough old seqs that the new publisher's first one seen is lower (the wire has
            # no publisher id: a restart is only visible as seq going backwards).
            for n in range(500):
                first.publish("t", make_batch(n))
            old_count = first.next_seq + first.queued
            await wait_until(lambda: len(collector.items) == old_count)

        async with EventPublisher(pub_ep, replay_ep, ctx=ctx) as second:
            await pump(second, lambda: collector.has_live(epoch=1), base=100_000)
            await wait_until(lambda: len(collector.seqs(epoch=1)) == second.next_seq)
            assert collector.seqs(epoch=0) == list(range(old_count))
            assert collector.seqs(epoch=1) == list(range(second.next_seq))
            assert all(item.batch.ts >= 100_000 for item in collector.items if item.epoch == 1)
            assert subscriber.epoch == 1
            assert subscriber.lost == 0


@pytest.mark.asyncio
async def test_topic_filter_on_a_shared_publisher(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str], collectors: list[Collector]
) -> None:
    pub_ep, replay_ep = endpoints
    async with (
        EventPublisher(pub_ep, replay_ep, ctx=ctx) as publisher,
        Subscriber(pub_ep, replay_ep, topic="kv@a", ctx=ctx) as subscriber,
    ):
        collector = Collector(subscriber).start()
        collectors.append(collector)
        await pump(publisher, collector.has_live, topic="kv@a")
        for n in range(20):
            publisher.publish("kv@b" if n % 2 else "kv@a", make_batch(n))
        await pump(
            publisher,
            lambda: collector.items[-1].seq == publisher.next_seq - 1,
            topic="kv@a",
        )
        assert {item.topic for item in collector.items} == {"kv@a"}
        seqs = [item.seq for item in collector.items]
        assert seqs == sorted(set(seqs))
        assert subscriber.lost == 0


# --- Replay protocol at the byte level ----------------------------------------------


@pytest.mark.asyncio
async def test_replay_reply_frames_and_end_marker(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str]
) -> None:
    pub_ep, replay_ep = endpoints
    async with EventPublisher(pub_ep, replay_ep, ctx=ctx) as publisher:
        batches = [make_batch(n) for n in range(3)]
        for batch in batches:
            publisher.publish("kv@pod@model", batch)
        await wait_until(lambda: publisher.published == 3)

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay_ep)
        try:
            for start, expected in ((0, [0, 1, 2]), (1, [1, 2]), (99, [])):
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
                for seq in expected:
                    frames = await asyncio.wait_for(dealer.recv_multipart(), TIMEOUT)
                    assert frames == [
                        b"",
                        b"kv@pod@model",
                        seq.to_bytes(8, "big"),
                        encode_batch(batches[seq]),
                    ]
                end = await asyncio.wait_for(dealer.recv_multipart(), TIMEOUT)
                assert end == [b"", b"", b"\xff" * 8, b""]
                assert end[2] == END_SEQ == (-1).to_bytes(8, "big", signed=True)
        finally:
            dealer.close(linger=0)

        # vLLM's example subscriber uses REQ: it sees the first reply only.
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(replay_ep)
        try:
            await req.send((2).to_bytes(8, "big"))
            frames = await asyncio.wait_for(req.recv_multipart(), TIMEOUT)
            assert frames == [b"kv@pod@model", (2).to_bytes(8, "big"), encode_batch(batches[2])]
        finally:
            req.close(linger=0)


@pytest.mark.asyncio
async def test_the_replay_buffer_is_bounded_in_bytes(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str]
) -> None:
    pub_ep, replay_ep = endpoints
    limit = 64 << 10  # limits.event_buffer_bytes: a few big batches, not buffer_steps of them
    async with EventPublisher(pub_ep, replay_ep, buffer_bytes=limit, ctx=ctx) as publisher:
        for n in range(40):
            publisher.publish("t", make_batch(n, tokens=4096))  # about 16 KiB each
        await wait_until(lambda: publisher.published == 40)
        assert 0 < publisher.buffered_bytes <= limit
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay_ep)
        try:
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            seqs = []
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), TIMEOUT)
                if frames[2] == END_SEQ:
                    break
                seqs.append(int.from_bytes(frames[2], "big"))
        finally:
            dealer.close(linger=0)
        # The newest batches, consecutive up to the last one, within the bound.
        assert seqs and seqs == list(range(seqs[0], 40)) and len(seqs) < 10


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


@pytest.mark.asyncio
async def test_a_replay_is_streamed_and_one_nobody_reads_holds_a_window(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publisher_module, "REPLAY_STALL", 0.5)
    pub_ep, replay_ep = endpoints
    count = 6 * REPLAY_WINDOW
    async with EventPublisher(pub_ep, replay_ep, ctx=ctx) as publisher:
        for n in range(count):
            publisher.publish("t", make_batch(n, tokens=60_000))  # about 180 KiB each
        await wait_until(lambda: publisher.published == count)
        assert publisher.buffered_bytes > 60 << 20
        before = _rss()
        # A subscriber that asks again and again and reads nothing: one replay at a time, at
        # most REPLAY_WINDOW batches queued to it, none of them a copy. Before, each request
        # copied the whole buffer (here 70 MiB) into its pipe.
        idle = ctx.socket(zmq.DEALER)
        idle.setsockopt(zmq.LINGER, 0)
        idle.setsockopt(zmq.RCVHWM, 1)
        idle.connect(replay_ep)
        try:
            for _ in range(20):
                await idle.send_multipart([b"", (0).to_bytes(8, "big")])
            await wait_until(lambda: bool(publisher._replays))
            grown = _rss() - before
            await wait_until(lambda: not publisher._replays)  # cut short: nothing was read
            grown = max(grown, _rss() - before)
        finally:
            idle.close(linger=0)
        assert grown < 32 << 20, f"{grown >> 20} MiB held for a subscriber that reads nothing"
        # A subscriber that reads gets every batch through the window, then the end marker.
        reader = ctx.socket(zmq.DEALER)
        reader.setsockopt(zmq.LINGER, 0)
        reader.connect(replay_ep)
        try:
            await reader.send_multipart([b"", (0).to_bytes(8, "big")])
            seqs = []
            while True:
                frames = await asyncio.wait_for(reader.recv_multipart(), TIMEOUT)
                if frames[2] == END_SEQ:
                    break
                seqs.append(int.from_bytes(frames[2], "big"))
        finally:
            reader.close(linger=0)
        assert seqs == list(range(count))


def _random_frames(rng: random.Random) -> list[bytes]:
    def frame() -> bytes:
        size = rng.choice([0, 0, 1, 7, 8, 8, 9, rng.randrange(64)])
        return rng.randbytes(size)

    return [frame() for _ in range(rng.randrange(1, 6))]


@pytest.mark.asyncio
async def test_random_frames_never_break_the_replay_socket(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str]
) -> None:
    pub_ep, replay_ep = endpoints
    rng = random.Random(20240915)
    messages = [
        [b""],
        [b"", b""],
        [b"", b"1234567"],
        [b"", b"123456789"],
        [b"x", b"12345678"],
        [b"", b"12345678", b""],
        [b"12345678"],
        *(_random_frames(rng) for _ in range(3000)),
    ]
    # The ROUTER adds the identity: valid is exactly [b"", 8 bytes] from a DEALER.
    expected_invalid = sum(
        not (len(frames) == 2 and frames[0] == b"" and len(frames[1]) == 8) for frames in messages
    )
    assert expected_invalid > 2000
    async with EventPublisher(pub_ep, replay_ep, ctx=ctx) as publisher:
        publisher.publish("t", make_batch(0))
        await wait_until(lambda: publisher.published == 1)
        fuzzer = ctx.socket(zmq.DEALER)
        fuzzer.setsockopt(zmq.LINGER, 0)
        fuzzer.connect(replay_ep)
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(replay_ep)
        try:
            for frames in messages:
                await asyncio.wait_for(fuzzer.send_multipart(frames), TIMEOUT)
            await wait_until(lambda: publisher.invalid_replay_requests == expected_invalid)

            await client.send_multipart([b"", (0).to_bytes(8, "big")])
            first = await asyncio.wait_for(client.recv_multipart(), TIMEOUT)
            assert first[:3] == [b"", b"t", (0).to_bytes(8, "big")]
            end = await asyncio.wait_for(client.recv_multipart(), TIMEOUT)
            assert end == [b"", b"", END_SEQ, b""]
            assert publisher.publish("t", make_batch(1))
            await wait_until(lambda: publisher.published == 2)
        finally:
            fuzzer.close(linger=0)
            client.close(linger=0)


@pytest.mark.asyncio
async def test_subscriber_speaks_pre_026_replay_and_legacy_payloads(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str], collectors: list[Collector]
) -> None:
    """A hand-made old vLLM publisher: no topic frame in replies, tagged-array payloads."""
    pub_ep, replay_ep = endpoints

    def legacy_payload(n: int) -> bytes:
        stored = ["BlockStored", [n], None, [], 0, None, "GPU", None]
        return msgspec.msgpack.encode([float(n), [stored], 0])

    sent: list[tuple[int, bytes]] = [
        (0, legacy_payload(0)),
        (1, b"\xc1not msgpack"),
        (2, legacy_payload(2)),
    ]
    pub = ctx.socket(zmq.PUB)
    router = ctx.socket(zmq.ROUTER)
    for sock in (pub, router):
        sock.setsockopt(zmq.LINGER, 0)
    pub.bind(pub_ep)
    router.bind(replay_ep)

    async def serve_replay() -> None:
        while True:
            identity, _, start = await router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(sent):
                if seq >= first:
                    await router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            await router.send_multipart([identity, b"", END_SEQ, b""])

    server = asyncio.create_task(serve_replay())
    try:
        async with Subscriber(pub_ep, replay_ep, topic="old", ctx=ctx) as subscriber:
            collector = Collector(subscriber).start()
            collectors.append(collector)

            def live_sent() -> bool:
                return any(not item.replayed for item in collector.items)

            loop = asyncio.get_running_loop()
            deadline = loop.time() + TIMEOUT
            while not live_sent():
                assert loop.time() < deadline
                seq = len(sent)
                sent.append((seq, legacy_payload(seq)))
                await pub.send_multipart([b"old", seq.to_bytes(8, "big"), sent[-1][1]])
                await asyncio.sleep(0.005)
            seqs = [item.seq for item in collector.items]
            assert seqs == [0, *range(2, len(sent))]
            assert subscriber.undecodable == 1
            assert collector.items[0].batch.events == [
                BlockStored(
                    block_hashes=[0],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            ]
            assert collector.items[0].topic == "old"
            await collector.stop()
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        pub.close(linger=0)
        router.close(linger=0)


@pytest.mark.asyncio
async def test_replay_timeout_does_not_hang(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str], collectors: list[Collector]
) -> None:
    pub_ep, replay_ep = endpoints
    silent = ctx.socket(zmq.ROUTER)  # accepts requests, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(replay_ep)
    try:
        async with (
            EventPublisher(pub_ep, "", ctx=ctx) as publisher,
            Subscriber(pub_ep, replay_ep, ctx=ctx, replay_timeout=0.2) as subscriber,
        ):
            collector = Collector(subscriber).start()
            collectors.append(collector)
            await pump(publisher, lambda: len(collector.items) >= 3)
            seqs = [item.seq for item in collector.items]
            assert seqs == sorted(set(seqs))
            await collector.stop()
    finally:
        silent.close(linger=0)


# --- Back-pressure and lifecycle -------------------------------------------------------


@pytest.mark.asyncio
async def test_publish_never_blocks_when_the_queue_is_full(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str]
) -> None:
    pub_ep, replay_ep = endpoints
    publisher = EventPublisher(pub_ep, replay_ep, max_queue=2, ctx=ctx)
    loop = asyncio.get_running_loop()
    began = loop.time()
    results = [publisher.publish("t", make_batch(n)) for n in range(5)]
    assert loop.time() - began < 0.5
    assert results == [True, True, False, False, False]
    assert publisher.dropped == 3
    assert publisher.queued == 2

    publisher.start()  # bound, but no run task: close() still sends what is queued
    await publisher.close()
    assert publisher.next_seq == 2
    assert publisher.published == 2
    await publisher.close()  # idempotent
    assert not publisher.publish("t", make_batch(9))
    assert publisher.dropped == 4


@pytest.mark.asyncio
async def test_external_run_task_ends_on_close(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str]
) -> None:
    pub_ep, replay_ep = endpoints
    publisher = EventPublisher(pub_ep, replay_ep, ctx=ctx)
    publisher.start()
    task = asyncio.create_task(publisher.run())
    publisher.publish("t", make_batch(0))
    await wait_until(lambda: publisher.published == 1)
    await publisher.close()
    await asyncio.wait_for(task, TIMEOUT)


@pytest.mark.asyncio
async def test_closing_the_subscriber_ends_iteration(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str]
) -> None:
    pub_ep, _ = endpoints
    subscriber = Subscriber(pub_ep, ctx=ctx)
    subscriber.connect()
    waiter = asyncio.create_task(anext(subscriber, None))
    await asyncio.sleep(0)  # let it block in recv
    subscriber.close()
    assert await asyncio.wait_for(waiter, TIMEOUT) is None
    subscriber.close()


# --- PublisherSet, endpoints, topics ---------------------------------------------------


@pytest.mark.asyncio
async def test_publisher_set_binds_port_plus_dp(
    ctx: zmq.asyncio.Context, collectors: list[Collector]
) -> None:
    pub_port, replay_port = free_port_pair(), free_port_pair()
    settings = EventSettings(
        endpoint=f"tcp://127.0.0.1:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        port_per_dp=True,
    )
    async with PublisherSet(settings, ctx) as publishers:
        assert publishers.stats().publishers == 1  # dp 0 bound at start
        dp1 = publishers.publisher_for(1)
        assert dp1.endpoint == f"tcp://127.0.0.1:{pub_port + 1}"
        assert dp1.replay_endpoint == f"tcp://127.0.0.1:{replay_port + 1}"
        assert publishers.publisher_for(0) is not dp1

        batch = make_batch(7, rank=None)
        assert publishers.publish("kv@p@m", 1, batch)
        assert batch.data_parallel_rank is None  # the caller's batch is not modified
        async with Subscriber(
            f"tcp://127.0.0.1:{pub_port + 1}", f"tcp://127.0.0.1:{replay_port + 1}", ctx=ctx
        ) as subscriber:
            collector = Collector(subscriber).start()
            collectors.append(collector)
            await wait_until(lambda: len(collector.items) == 1)
            received = collector.items[0]
            assert received.topic == "kv@p@m"
            assert received.batch.data_parallel_rank == 1
            assert received.batch.events == batch.events
            await collector.stop()
        stats = publishers.stats()
        assert (stats.publishers, stats.published, stats.dropped) == (2, 1, 0)
    await publishers.close()  # idempotent
    assert not publishers.publish("kv@p@m", 0, batch)


@pytest.mark.asyncio
async def test_publisher_set_shared_and_disabled(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str]
) -> None:
    pub_ep, replay_ep = endpoints
    shared = PublisherSet(EventSettings(endpoint=pub_ep, replay_endpoint=replay_ep), ctx)
    shared.start()
    try:
        assert shared.publisher_for(0) is shared.publisher_for(5)
        assert shared.publish("t", 5, make_batch(1, rank=None))
        await wait_until(lambda: shared.stats().published == 1)
    finally:
        await shared.close()

    ipc_per_dp = PublisherSet(
        EventSettings(endpoint=pub_ep, replay_endpoint="", port_per_dp=True), ctx
    )
    ipc_per_dp.start()
    try:
        assert not ipc_per_dp.publish("t", 1, make_batch(1))  # ipc can't be offset: dropped
        assert ipc_per_dp.stats().dropped == 1
    finally:
        await ipc_per_dp.close()

    disabled = PublisherSet(EventSettings(enabled=False), ctx)
    disabled.start()
    assert not disabled.publish("t", 0, make_batch(1))
    assert disabled.stats().publishers == 0
    await disabled.close()


@pytest.mark.parametrize(
    ("endpoint", "k", "expected"),
    [
        ("tcp://127.0.0.1:5557", 0, "tcp://127.0.0.1:5557"),
        ("tcp://127.0.0.1:5557", 3, "tcp://127.0.0.1:5560"),
        ("tcp://*:5557", 1, "tcp://*:5558"),
        ("tcp://[::1]:5557", 2, "tcp://[::1]:5559"),
        ("inproc://cache", 0, "inproc://cache"),
        ("inproc://cache", 2, "inproc://cache_dp2"),
        ("ipc:///tmp/x", 0, "ipc:///tmp/x"),
        ("", 4, ""),
    ],
)
def test_offset_endpoint_port(endpoint: str, k: int, expected: str) -> None:
    assert offset_endpoint_port(endpoint, k) == expected


@pytest.mark.parametrize(
    ("endpoint", "k"),
    [("ipc:///tmp/x", 1), ("tcp://127.0.0.1", 1), ("tcp://host:*", 1), ("tcp://h:1", -1)],
)
def test_offset_endpoint_port_rejects(endpoint: str, k: int) -> None:
    with pytest.raises(ValueError, match="dp index"):
        offset_endpoint_port(endpoint, k)


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://*:5557", "tcp://127.0.0.1:5557"),
        ("tcp://0.0.0.0:5557", "tcp://127.0.0.1:5557"),
        ("tcp://[::]:5557", "tcp://[::1]:5557"),
        ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5557"),
        ("ipc:///run/offloadd/ev.sock", "ipc:///run/offloadd/ev.sock"),
    ],
)
def test_connectable_makes_wildcards_loopback(endpoint: str, expected: str) -> None:
    assert connectable(endpoint) == expected


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
        ("tcp://127.0.0.1:65535", ""),
        ("tcp://host:*", ""),
        ("ipc:///tmp/ev.sock", ""),
        ("ipc:///run/offloadd/offloadd.sock.events", "ipc:///run/offloadd/offloadd.sock.replay"),
    ],
)
def test_replay_beside(endpoint: str, expected: str) -> None:
    assert replay_beside(endpoint) == expected


@pytest.mark.asyncio
async def test_publisher_set_says_where_each_dp_subscribes(ctx: zmq.asyncio.Context) -> None:
    pub_port, replay_port = free_port_pair(), free_port_pair()
    settings = EventSettings(
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        port_per_dp=True,
    )
    async with PublisherSet(settings, ctx) as publishers:
        assert publishers.endpoints_for(0) == (
            f"tcp://127.0.0.1:{pub_port}",
            f"tcp://127.0.0.1:{replay_port}",
        )
        # dp 3's publisher binds on first use; where it will be is known before.
        assert publishers.stats().publishers == 1
        assert publishers.endpoints_for(3) == (
            f"tcp://127.0.0.1:{pub_port + 3}",
            f"tcp://127.0.0.1:{replay_port + 3}",
        )


@pytest.mark.asyncio
async def test_a_port_the_system_picks_is_the_one_advertised(ctx: zmq.asyncio.Context) -> None:
    settings = EventSettings(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:0")
    async with PublisherSet(settings, ctx) as publishers:
        events, replay = publishers.endpoints_for(0)
        for endpoint in (events, replay):
            host, _, port = endpoint.rpartition(":")
            assert host == "tcp://127.0.0.1" and int(port) > 0
        publishers.publish("kv@p@m", 0, make_batch(1))
        async with Subscriber(events, replay, ctx=ctx) as subscriber:
            received = await asyncio.wait_for(anext(subscriber), TIMEOUT)
        assert received.seq == 0 and received.replayed


@pytest.mark.asyncio
async def test_empty_endpoint_turns_events_off(ctx: zmq.asyncio.Context) -> None:
    off = PublisherSet(EventSettings(endpoint=""), ctx)
    off.start()
    assert not off.active
    assert off.endpoints_for(0) == ("", "")
    assert not off.publish("t", 0, make_batch(1))
    assert off.stats().publishers == 0
    await off.close()
    assert PublisherSet(EventSettings(enabled=False), ctx).endpoints_for(0) == ("", "")


@pytest.mark.asyncio
async def test_a_taken_endpoint_is_one_clear_error(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str]
) -> None:
    pub_ep, replay_ep = endpoints
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
        first = EventPublisher(taken, replay_ep, ctx=ctx)
        with pytest.raises(EventBindError, match=rf"^events.endpoint: cannot bind '{taken}'"):
            first.start()
        second = EventPublisher(pub_ep, taken, ctx=ctx)
        with pytest.raises(EventBindError, match=r"^events.replay_endpoint: cannot bind"):
            second.start()
        await first.close()
        await second.close()


def test_topic_for() -> None:
    def fill(template: str, engine_id: str = "e") -> str:
        return topic_for(template, pod="n1", tenant="u1001", model="m", engine_id=engine_id, dp=2)

    assert fill(EventSettings().topic_template) == "kv@n1/u1001@m"  # three @-parts, as vLLM's
    assert fill("kv@{pod}@{model}") == "kv@n1@m"
    assert fill("{engine_id}/{dp}", "e7") == "e7/2"
    with pytest.raises(ValueError, match="placeholders"):
        fill("kv@{node}")
    with pytest.raises(ValueError, match="placeholders"):
        fill("kv@{pod")


# --- Output formats and the CLI --------------------------------------------------------


def test_event_lines_and_records() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[0x1A2B, b"\x01" * 32],
                parent_block_hash=b"\xab",
                token_ids=[1, 2],
                block_size=1,
                lora_id=None,
                medium="CPU",
                lora_name=None,
                extra_keys=[(b"\x0f", "salt"), None],
                group_idx=0,
            ),
            BlockRemoved(block_hashes=[b"\x01" * 32], medium="CPU", group_idx=1),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    received = Received("kv@p@m", 12, batch, 0, False)
    assert list(event_lines(received)) == [
        "seq 12 [kv@p@m] dp 0  BlockStored medium=CPU group=0 hashes=2 "
        "(first 0x0000000000001a2b) tokens=2",
        "seq 12 [kv@p@m] dp 0  BlockRemoved medium=CPU group=1 hashes=1 "
        "(first 0x0101010101010101...)",
        "seq 12 [kv@p@m] dp 0  AllBlocksCleared",
    ]
    records = list(event_records(received))
    assert records[0]["block_hashes"] == [0x1A2B, "01" * 32]
    assert records[0]["parent_block_hash"] == "ab"
    assert records[0]["extra_keys"] == [["0f", "salt"], None]
    assert records[0]["session_id"] is None
    assert records[2] == {
        "seq": 12,
        "topic": "kv@p@m",
        "epoch": 0,
        "dp": 0,
        "ts": 1.5,
        "replayed": False,
        "type": "AllBlocksCleared",
    }
    json.dumps(records)


@pytest.mark.asyncio
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_cli_events_json(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str], signum: signal.Signals
) -> None:
    pub_ep, replay_ep = endpoints
    async with EventPublisher(pub_ep, replay_ep, ctx=ctx) as publisher:
        for n in range(2):
            publisher.publish("kv@pod@model", make_batch(n))
        await wait_until(lambda: publisher.published == 2)

        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "offloadd",
            "events",
            "--endpoint",
            pub_ep,
            "--replay",
            replay_ep,
            "--json",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None and process.stderr is not None
        lines: list[dict[str, object]] = []

        async def read() -> None:
            assert process.stdout is not None
            async for raw in process.stdout:
                lines.append(json.loads(raw))

        reader = asyncio.create_task(read())
        try:
            await pump(
                publisher,
                lambda: any(not line["replayed"] for line in lines),
                topic="kv@pod@model",
                base=500,
                timeout=30,
            )
            process.send_signal(signum)
            status = await asyncio.wait_for(process.wait(), TIMEOUT)
            await asyncio.wait_for(reader, TIMEOUT)
            stderr = (await process.stderr.read()).decode()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

        assert status == 0, stderr
        assert "Traceback" not in stderr
        assert [line["seq"] for line in lines] == list(range(len(lines)))
        assert lines[0] == {
            "seq": 0,
            "topic": "kv@pod@model",
            "epoch": 0,
            "dp": 0,
            "ts": 0.0,
            "replayed": True,
            "type": "BlockStored",
            "block_hashes": [0],
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": 0,
            "lora_id": None,
            "medium": "CPU",
            "lora_name": None,
            "extra_keys": None,
            "group_idx": 0,
            "kv_cache_spec_kind": None,
            "kv_cache_spec_sliding_window": None,
            "locality": None,
            "ownership": None,
            "session_id": None,
            "lookahead_token_ids": None,
        }
        assert lines[1]["replayed"] is True
        assert lines[-1]["replayed"] is False
        assert decode_batch(encode_batch(make_batch(0))) == make_batch(0)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_cli_events_whose_reader_went_away_ends_quietly(
    ctx: zmq.asyncio.Context, endpoints: tuple[str, str]
) -> None:
    pub_ep, replay_ep = endpoints
    async with EventPublisher(pub_ep, replay_ep, ctx=ctx) as publisher:
        publisher.publish("kv@pod@model", make_batch(0))
        await wait_until(lambda: publisher.published == 1)
        read, write = os.pipe()
        os.close(read)  # `offloadd events | head -1` once head has exited
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "offloadd", "events",
                "--endpoint", pub_ep, "--replay", replay_ep,
                stdout=write, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
        finally:
            os.close(write)
        try:  # the replayed batch is its first write
            _, stderr = await asyncio.wait_for(process.communicate(), 30)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert (process.returncode, stderr.decode()) == (141, "")

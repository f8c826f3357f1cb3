"""KV-cache event subscriber for vLLM's protocol (and the daemon's publisher).

``Subscriber`` is an async context manager and async iterator of ``Received`` batches:

* It subscribes a SUB socket to ``topic`` (a prefix; "" is everything) and, when a replay
  endpoint is given, first asks for replay from seq 0: every buffered batch is delivered
  once, in order, then the live stream continues without duplicates (live batches that
  arrived during the replay carry seqs already delivered and are skipped).
* Gaps: a live ``seq > last + 1`` triggers a replay from ``last + 1``; the missing batches
  are delivered (``replayed=True``) before the live one. What the publisher no longer
  buffers is logged as lost and skipped.
* Publisher restarts: a live ``seq`` that goes backwards (and is not a duplicate of a
  replayed batch) starts a new ``epoch``; tracking restarts there, and what the new
  publisher sent before it was seen is replayed. The wire has no publisher id, so a restart
  that is never observed going backwards cannot be told apart from a gap.
* Replay uses a DEALER socket (a REQ would only see the first reply): it sends
  ``[b"", start_seq]`` and reads ``[b"", topic, seq, payload]`` until the end marker
  ``[b"", b"", END_SEQ, b""]``; the pre-0.26 replies without the topic frame are accepted
  too. A replay that stalls for ``replay_timeout`` seconds is abandoned.
* Payloads in either msgpack encoding are decoded (``protocol.events.decode_batch``); an
  undecodable one is logged and skipped.

The daemon's topics name the tenant (``kv@{pod}/{tenant}@{model}`` by default): ``topic``
``"kv@node-a/u1001@"`` follows one tenant's engines, ``"kv@node-a/"`` every tenant's. With
a topic filter on a publisher that serves several topics with one seq stream (the daemon's
shared publisher), the other topics' seqs look like gaps; replay fills them with
batches that are then skipped, so nothing is lost but each such gap costs a replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from offloadd.logs import LogLimiter
from protocol.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Received:
    """One batch as delivered: its topic, seq, publisher epoch, and whether it was replayed."""

    topic: str
    seq: int
    batch: KVEventBatch
    epoch: int
    replayed: bool


class Subscriber:
    """Subscribe to KV-cache events with replay, gap filling and restart detection.

    ``async with Subscriber(endpoint, replay_endpoint) as sub: async for received in sub``.
    Counters: ``received`` (delivered batches), ``replayed``, ``duplicates``, ``lost``,
    ``undecodable``, ``epoch``.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout: float = 2.0,
        rcvhwm: int = 100_000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint or None
        self.topic = topic
        self.replay_timeout = replay_timeout
        self.epoch = 0
        self.received = 0
        self.replayed = 0
        self.duplicates = 0
        self.lost = 0
        self.undecodable = 0
        self._rcvhwm = rcvhwm
        self._own_ctx = ctx is None
        self._ctx = ctx
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._pending: deque[Received] = deque()
        self._started = False
        self._closed = False
        # The last seq accounted for in this epoch (delivered, skipped or given up as
        # lost); None until known. Live seqs only grow within an epoch.
        self._last: int | None = None
        # Payloads delivered by replay that may still arrive live: a live seq <= last is a
        # duplicate when its payload is one of these, a restart otherwise.
        self._replayed_payloads: dict[int, bytes] = {}
        self._last_topic = topic
        self._warn = LogLimiter(logger)

    async def __aenter__(self) -> Subscriber:
        self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def connect(self) -> None:
        """Connect and subscribe (done by ``async with``)."""
        if self._closed:
            raise RuntimeError("subscriber is closed")
        if self._sub is not None:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            sub.connect(self.endpoint)
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        self._sub = sub
        if self.replay_endpoint:
            self._dealer = self._new_dealer()

    def close(self) -> None:
        """Close the sockets (linger 0), and the context if this subscriber made it."""
        if self._closed:
            return
        self._closed = True
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()

    def __aiter__(self) -> Subscriber:
        return self

    async def __anext__(self) -> Received:
        try:
            while not self._pending:
                if self._closed:
                    raise StopAsyncIteration
                if not self._started:
                    if self.replay_endpoint:
                        await self._initial_replay()  # retried if cancelled midway
                    self._started = True
                    continue
                await self._next_live()
        except asyncio.CancelledError:
            # close() from another task cancels the socket's pending receive: end the
            # iteration, unless this task itself is being cancelled.
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():
                raise StopAsyncIteration from None
            raise
        return self._pending.popleft()

    async def _initial_replay(self) -> None:
        items = await self._request_replay(0)
        if items is None:
            return  # no replay server: start with the first live batch
        self._last = -1
        for topic, seq, payload in items:
            if seq > self._last:
                self._account(topic, seq, payload, replayed=True)

    async def _next_live(self) -> None:
        if self._sub is None:
            raise StopAsyncIteration
        frames = await self._sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            self._warn(logging.WARNING, "malformed live message: %d frames", len(frames))
            return
        topic = frames[0].decode(errors="replace")
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        self._last_topic = topic

        last = self._last
        if last is not None and seq <= last:
            if self._replayed_payloads.get(seq) == payload:
                self.duplicates += 1
                self._forget_replayed(seq)
                return
            self._new_epoch(seq)
            last = self._last

        if last is not None and seq > last + 1:
            await self._fill_gap(last + 1, seq)
        self._forget_replayed(seq)
        self._account(topic, seq, payload, replayed=False)

    def _new_epoch(self, seq: int) -> None:
        self.epoch += 1
        logger.info(
            "KV event publisher %s restarted (seq %d after %s): epoch %d",
            self.endpoint,
            seq,
            self._last,
            self.epoch,
        )
        self._replayed_payloads.clear()
        # The new publisher counts from 0: fill what it sent before we saw it.
        self._last = -1

    async def _fill_gap(self, start: int, stop: int) -> None:
        """Deliver replayed batches with ``start <= seq < stop``; log what can't be had."""
        items = await self._request_replay(start) if self.replay_endpoint else None
        last = start - 1
        for topic, rseq, payload in items or ():
            if last < rseq < stop:
                self._report_lost(last + 1, rseq)
                self._account(topic, rseq, payload, replayed=True)
                last = rseq
        self._report_lost(last + 1, stop)

    def _report_lost(self, start: int, stop: int) -> None:
        if start >= stop:
            return
        self.lost += stop - start
        logger.warning(
            "KV events %d..%d (epoch %d) of %s lost: not available for replay",
            start,
            stop - 1,
            self.epoch,
            self.endpoint,
        )

    def _account(self, topic: str, seq: int, payload: bytes, *, replayed: bool) -> None:
        """Mark ``seq`` accounted for and queue it for delivery if it decodes and matches."""
        self._last = seq
        if replayed:
            self._replayed_payloads[seq] = payload
            if not topic.startswith(self.topic):
                return  # another topic on a shared seq stream
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            self.undecodable += 1
            self._warn(logging.WARNING, "undecodable KV event batch seq %d: %s", seq, exc)
            return
        self.received += 1
        self.replayed += replayed
        self._pending.append(Received(topic, seq, batch, self.epoch, replayed))

    def _forget_replayed(self, seq: int) -> None:
        payloads = self._replayed_payloads
        while payloads:
            first = next(iter(payloads))
            if first > seq:
                break
            del payloads[first]

    def _new_dealer(self) -> zmq.asyncio.Socket:
        assert self.replay_endpoint and self._ctx is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # a whole replay buffer may come back at once
        try:
            dealer.connect(self.replay_endpoint)
        except zmq.ZMQError:
            dealer.close(linger=0)
            raise
        return dealer

    def _reset_dealer(self) -> None:
        """Drop a replay that went wrong, so its late replies can't mix with the next."""
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
        if not self._closed:
            self._dealer = self._new_dealer()

    async def _request_replay(self, start: int) -> list[tuple[str, int, bytes]] | None:
        """Replay from ``start``; None if the replay socket did not answer in time."""
        dealer = self._dealer
        if dealer is None:
            return None
        items: list[tuple[str, int, bytes]] = []
        try:
            await asyncio.wait_for(
                dealer.send_multipart((b"", start.to_bytes(8, "big"))), self.replay_timeout
            )
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout)
                if len(frames) == 4 and frames[0] == b"":  # vLLM >= 0.26: with the topic
                    topic_bytes, seq_bytes, payload = frames[1], frames[2], frames[3]
                    topic = topic_bytes.decode(errors="replace")
                elif len(frames) == 3 and frames[0] == b"":  # before 0.26: no topic frame
                    seq_bytes, payload = frames[1], frames[2]
                    topic = self._last_topic
                else:
                    self._warn(logging.WARNING, "malformed replay reply: %d frames", len(frames))
                    continue
                if seq_bytes == END_SEQ and not payload:
                    return items
                if len(seq_bytes) != 8:
                    self._warn(logging.WARNING, "malformed replay reply: seq frame")
                    continue
                items.append((topic, int.from_bytes(seq_bytes, "big"), payload))
        except TimeoutError:
            self._warn(
                logging.WARNING,
                "replay from %d on %s: no answer within %.1fs (%d batches received)",
                start,
                self.replay_endpoint,
                self.replay_timeout,
                len(items),
            )
            self._reset_dealer()
            return items or None
        except asyncio.CancelledError:
            if not self._closed:
                self._reset_dealer()
            raise
        except zmq.ZMQError as exc:
            self._warn(logging.WARNING, "replay from %d failed: %s", start, exc)
            with contextlib.suppress(zmq.ZMQError):
                self._reset_dealer()
            return items or None


def event_lines(received: Received) -> Iterator[str]:
    """One human-readable line per event of a batch (``offloadd events``)."""
    batch = received.batch
    head = f"seq {received.seq} [{received.topic}] dp {batch.data_parallel_rank}"
    if received.epoch:
        head += f" epoch {received.epoch}"
    tail = "  (replayed)" if received.replayed else ""
    for event in batch.events:
        match event:
            case BlockStored() | BlockRemoved():
                first = f" (first {_hex(event.block_hashes[0])})" if event.block_hashes else ""
                body = (
                    f"{type(event).__name__} medium={event.medium} group={event.group_idx} "
                    f"hashes={len(event.block_hashes)}{first}"
                )
                if isinstance(event, BlockStored) and event.token_ids:
                    body += f" tokens={len(event.token_ids)}"
            case AllBlocksCleared():
                body = "AllBlocksCleared"
        yield f"{head}  {body}{tail}"


def event_records(received: Received) -> Iterator[dict[str, Any]]:
    """One JSON-ready dict per event: seq, topic, epoch, dp, ts, replayed, type, fields.

    Bytes (hashes, extra keys) become hex strings; every field is present, None included.
    """
    batch = received.batch
    for event in batch.events:
        record: dict[str, Any] = {
            "seq": received.seq,
            "topic": received.topic,
            "epoch": received.epoch,
            "dp": batch.data_parallel_rank,
            "ts": batch.ts,
            "replayed": received.replayed,
            "type": type(event).__name__,
        }
        for name in event.__struct_fields__:
            record[name] = _jsonable(getattr(event, name))
        yield record


def _hex(block_hash: bytes | int) -> str:
    if isinstance(block_hash, int):
        return f"0x{block_hash:016x}"
    return "0x" + block_hash[:8].hex() + ("..." if len(block_hash) > 8 else "")


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    return value

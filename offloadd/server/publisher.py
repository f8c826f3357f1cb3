"""KV-cache event publisher: vLLM's ZmqEventPublisher protocol on the daemon's event loop.

``EventPublisher`` owns a PUB socket and, optionally, a replay ROUTER socket:

* ``publish(topic, batch)`` may be called any time from the event loop. It never blocks
  and never raises on back-pressure: it appends to a bounded queue and returns True, or,
  when the queue is full or the publisher closed, drops the batch, counts it in
  ``dropped`` and returns False (vLLM blocks its engine thread here instead).
* ``run()`` (a task) drains the queue in order: each batch gets the next ``seq`` (from 0,
  +1 per batch, for this publisher's lifetime), is encoded once and sent as
  ``[topic, seq (8 bytes big-endian), payload]`` without blocking. A batch the PUB socket
  refuses is counted in ``dropped`` but still kept for replay. The last ``buffer_steps``
  batches are kept as ``(topic, seq, payload)``, fewer when they would take more than
  ``buffer_bytes`` (``limits.event_buffer_bytes``; 0: no bound in bytes).
* The same task answers replay requests: ``[identity, b"", start_seq (8 bytes)]`` gets one
  ``[identity, b"", topic, seq, payload]`` per buffered batch with ``seq >= start_seq``,
  then the end marker ``[identity, b"", b"", END_SEQ, b""]`` (vLLM >= 0.26). Anything
  else is counted in ``invalid_replay_requests``, logged (rate-limited) and ignored.
  A replay is streamed, never copied whole: a subscriber's requests are answered one at a
  time, in order (at most ``REPLAY_WAITING`` wait; more are ignored), each fed at most
  ``REPLAY_WINDOW`` batches ahead of what libzmq has written to it, each batch sent without
  a copy of its payload (the buffer's own bytes); it reads the buffer as it goes (a batch
  dropped meanwhile is skipped, as a gap) and ends at the last batch buffered when it was
  asked for. One whose subscriber reads nothing for ``REPLAY_STALL`` seconds is cut short,
  and that subscriber's waiting requests dropped.
* ``close()`` sends what is still queued (bounded by a timeout), then closes the sockets
  with linger 0 and removes the ipc socket files it bound (libzmq leaves them). A
  subscriber that sees ``seq`` go backwards knows the publisher restarted; nothing else on
  the wire says so (as in vLLM).

``PublisherSet`` maps dp indexes to publishers: one per dp index on ``port + k`` when
``EventSettings.port_per_dp`` (vLLM's convention), else one shared by all. An empty
``EventSettings.endpoint`` turns events off, as ``enabled = false`` does. ``endpoints_for(dp)``
says where a subscriber connects for a dp index (the daemon tells its clients).

An ``ipc://`` endpoint is bound like the control socket: in a directory only the daemon's
user can change, with ``socket_mode`` and ``socket_group`` (who may subscribe and replay).
A ``tcp://`` endpoint off loopback is bound, and logged as a warning: whoever reaches it
reads every tenant's block hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from offloadd.endpoint import (
    bind_ipc,
    connectable,
    ipc_path,
    is_loopback,
    offset_endpoint_port,
    remove_socket_file,
    socket_file,
)
from offloadd.logs import LogLimiter
from offloadd.settings import EventSettings
from protocol.events import END_SEQ, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

# Bounds a socket's connections from before it binds (``offloadd.server.connections``).
Watch = Callable[[zmq.Socket[Any], str], None]

_YIELD_EVERY = 64  # batches sent (or replayed) between yields to the event loop
REPLAY_WINDOW = 64  # batches queued to one replaying subscriber at most (its SNDHWM)
REPLAY_STALL = 10.0  # seconds a replay waits for its subscriber to read, then ends
REPLAY_WAITING = 64  # a subscriber's replay requests waiting behind the one being sent


class EventBindError(Exception):
    """A publisher socket cannot bind its endpoint; the message names the setting."""


def topic_for(template: str, *, pod: str, tenant: str, model: str, engine_id: str, dp: int) -> str:
    """Fill a topic template such as ``kv@{pod}/{tenant}@{model}``.

    Placeholders: ``{pod}``, ``{tenant}`` (``offloadd.server.tenancy``), ``{model}``,
    ``{engine_id}``, ``{dp}``. Raises ValueError on any other placeholder or a malformed
    template.
    """
    try:
        return template.format(pod=pod, tenant=tenant, model=model, engine_id=engine_id, dp=dp)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"bad topic template {template!r} ({exc!r}); placeholders are "
            "{pod} {tenant} {model} {engine_id} {dp}"
        ) from None


class PublisherStats(msgspec.Struct, frozen=True):
    """Counters of one publisher, or summed over a PublisherSet."""

    published: int = 0
    dropped: int = 0
    invalid_replay_requests: int = 0
    publishers: int = 0


class EventPublisher:
    """PUB socket + replay ROUTER speaking vLLM's KV-event protocol (see module docstring).

    ``start()`` binds; ``run()`` is the task that sends and answers replays (the async
    context manager starts both and closes on exit). Counters: ``published``, ``dropped``,
    ``invalid_replay_requests``, ``next_seq``.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        *,
        buffer_steps: int = 10_000,
        buffer_bytes: int = 0,
        hwm: int = 100_000,
        max_queue: int = 100_000,
        ctx: zmq.asyncio.Context,
        socket_mode: str = "0660",
        socket_group: str = "",
        watch: Watch | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._buffer_bytes = buffer_bytes
        self.buffered_bytes = 0  # topic and payload bytes held for replay
        self._socket_mode = socket_mode
        self._socket_group = socket_group
        self.replay_endpoint = replay_endpoint
        self.bound_endpoint = ""  # set by start()
        self.bound_replay_endpoint = ""  # set by start() when there is a replay socket
        self.published = 0
        self.dropped = 0
        self.invalid_replay_requests = 0
        self.next_seq = 0
        self._hwm = hwm
        self._buffer_steps = buffer_steps
        self._ctx = ctx
        self._queue: asyncio.Queue[tuple[str, KVEventBatch]] = asyncio.Queue(max_queue)
        self._buffer: deque[tuple[bytes, int, bytes]] = deque()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        # The ipc socket files this publisher bound, removed when it closes (libzmq keeps them).
        self._files: list[tuple[str, tuple[int, int] | None]] = []
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = asyncio.Event()
        self._warn_full = LogLimiter(logger)
        self._warn_send = LogLimiter(logger)
        self._warn_replay = LogLimiter(logger)
        self._watch = watch
        self._replays: dict[bytes, deque[int]] = {}  # each subscriber's starts, in order
        self._replay_tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Bind the PUB socket and, when a replay endpoint is set, the replay ROUTER."""
        if self._pub is not None:
            return
        if self._closing:
            raise RuntimeError("publisher is closed")
        pub = self._ctx.socket(zmq.PUB)
        replay: zmq.asyncio.Socket | None = None
        try:
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            # vLLM binds or connects the PUB socket depending on the endpoint's shape (it
            # may push to a remote proxy); the daemon owns its endpoints, so it always binds.
            if self._watch is not None:
                self._watch(pub, "events")
            self._bind(pub, self.endpoint, "events.endpoint")
            if self.replay_endpoint:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                # A full pipe says so (EAGAIN) rather than dropping: the replay waits.
                replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                replay.setsockopt(zmq.SNDHWM, REPLAY_WINDOW)
                if self._watch is not None:
                    self._watch(replay, "replay")
                self._bind(replay, self.replay_endpoint, "events.replay_endpoint")
        except BaseException:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            self._remove_files()
            raise
        self._pub = pub
        self._replay = replay
        # What subscribers connect to: the address actually bound (a port the system chose
        # included), with a wildcard host made loopback.
        self.bound_endpoint = connectable(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        if replay is not None:
            self.bound_replay_endpoint = connectable(replay.getsockopt_string(zmq.LAST_ENDPOINT))
        logger.info(
            "KV events on %s (replay %s)", self.endpoint, self.replay_endpoint or "disabled"
        )

    def _bind(self, sock: zmq.asyncio.Socket, endpoint: str, setting: str) -> None:
        """Bind; an ipc socket gets the control socket's mode and group (who may read the
        events, and ask for replays). A bind that fails names the setting."""
        path = ipc_path(endpoint)
        if endpoint.startswith("tcp://") and not is_loopback(endpoint):
            logger.warning(
                "%s %s is reachable from other hosts: whoever reaches the port reads every "
                "tenant's block hashes and topics (an ipc:// endpoint keeps them to the socket "
                "group)",
                setting,
                endpoint,
            )
        try:
            if path is None:
                sock.bind(endpoint)
            else:

                def bind() -> None:
                    sock.bind(endpoint)
                    self._files.append((path, socket_file(path)))  # before its mode is set

                bind_ipc(bind, path, self._socket_mode, self._socket_group)
        except zmq.ZMQError as exc:
            raise EventBindError(f"{setting}: cannot bind {endpoint!r}: {exc}") from None

    def _remove_files(self) -> None:
        """Remove the ipc socket files bound (their sockets closed): none is left at exit."""
        for path, bound in self._files:
            remove_socket_file(path, bound)
        self._files.clear()

    def publish(self, topic: str, batch: KVEventBatch) -> bool:
        """Queue ``batch`` for ``topic``; False (and counted in ``dropped``) if it was dropped.

        Never blocks and never raises on back-pressure.
        """
        if self._closing:
            self.dropped += 1
            return False
        try:
            self._queue.put_nowait((topic, batch))
        except asyncio.QueueFull:
            self.dropped += 1
            self._warn_full(
                logging.WARNING,
                "KV event queue of %s full (%d batches): dropping; %d dropped so far",
                self.endpoint,
                self._queue.maxsize,
                self.dropped,
            )
            return False
        return True

    async def run(self) -> None:
        """Send queued batches and answer replay requests until the publisher closes."""
        if self._pub is None:
            raise RuntimeError("start() the publisher before run()")
        tasks = {
            asyncio.create_task(self._drain()),
            asyncio.create_task(self._closed.wait()),
        }
        if self._replay is not None:
            tasks.add(asyncio.create_task(self._serve_replay()))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc

    async def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), then close. Idempotent."""
        if self._closed.is_set():
            return
        self._closing = True
        if self._pub is not None:
            deadline = time.monotonic() + timeout
            while not self._queue.empty() and time.monotonic() < deadline:
                await self._send(*self._queue.get_nowait())
        if not self._queue.empty():
            logger.warning(
                "KV event publisher %s closed with %d batches unsent",
                self.endpoint,
                self._queue.qsize(),
            )
        self._closed.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._remove_files()

    async def __aenter__(self) -> EventPublisher:
        self.start()
        self._task = asyncio.create_task(self.run(), name=f"events {self.endpoint}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def queued(self) -> int:
        """Batches waiting to be sent."""
        return self._queue.qsize()

    def stats(self) -> PublisherStats:
        """This publisher's counters."""
        return PublisherStats(
            published=self.published,
            dropped=self.dropped,
            invalid_replay_requests=self.invalid_replay_requests,
            publishers=1,
        )

    async def _drain(self) -> None:
        for count in itertools.count(1):
            topic, batch = await self._queue.get()
            await self._send(topic, batch)
            if count % _YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a long backlog must not starve the loop

    async def _send(self, topic: str, batch: KVEventBatch) -> None:
        # Nothing below waits: seq order, the PUB stream and the replay buffer stay in step.
        assert self._pub is not None
        try:
            payload = encode_batch(batch)
        except (TypeError, ValueError, OverflowError) as exc:  # a malformed event: no seq
            self.dropped += 1
            self._warn_send(logging.ERROR, "KV event batch not encodable, dropped: %s", exc)
            return
        seq = self.next_seq
        self.next_seq += 1
        topic_bytes = topic.encode()
        self._keep(topic_bytes, seq, payload)
        frames = (topic_bytes, seq.to_bytes(8, "big"), payload)
        try:
            await self._pub.send_multipart(frames, flags=zmq.DONTWAIT)
        except zmq.Again:
            self.dropped += 1  # still in the replay buffer
            self._warn_send(logging.WARNING, "KV event PUB socket full: seq %d not sent", seq)
        except zmq.ZMQError as exc:
            self.dropped += 1
            self._warn_send(logging.ERROR, "KV event seq %d not sent: %s", seq, exc)
        else:
            self.published += 1

    def _keep(self, topic: bytes, seq: int, payload: bytes) -> None:
        """Buffer a batch for replay, dropping the oldest beyond the step and byte bounds."""
        buffer = self._buffer
        buffer.append((topic, seq, payload))
        self.buffered_bytes += len(topic) + len(payload)
        limit = self._buffer_bytes
        while buffer and (
            len(buffer) > self._buffer_steps or (limit and self.buffered_bytes > limit)
        ):
            old_topic, _, old_payload = buffer.popleft()
            self.buffered_bytes -= len(old_topic) + len(old_payload)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        replay = self._replay
        try:
            while True:
                try:
                    frames = await replay.recv_multipart()
                except zmq.ZMQError as exc:
                    self._warn_replay(logging.ERROR, "replay socket error: %s", exc)
                    await asyncio.sleep(0.1)  # back off instead of spinning on a broken socket
                    continue
                start = _parse_replay_request(frames)
                if start is None:
                    self.invalid_replay_requests += 1
                    self._warn_replay(
                        logging.WARNING,
                        "invalid replay request on %s: %d frames, sizes %s",
                        self.replay_endpoint,
                        len(frames),
                        [len(frame) for frame in frames[:8]],
                    )
                    continue
                identity = frames[0]
                waiting = self._replays.get(identity)
                if waiting is None:
                    waiting = self._replays[identity] = deque([start])
                    task = asyncio.create_task(self._serve_subscriber(replay, identity, waiting))
                    self._replay_tasks.add(task)
                    task.add_done_callback(self._replay_tasks.discard)
                elif len(waiting) <= REPLAY_WAITING:
                    waiting.append(start)
                else:
                    self._warn_replay(
                        logging.WARNING,
                        "replay request ignored: %d of that subscriber's wait already",
                        len(waiting) - 1,
                    )
        finally:
            tasks = list(self._replay_tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve_subscriber(
        self, replay: zmq.asyncio.Socket, identity: bytes, waiting: deque[int]
    ) -> None:
        """Answer one subscriber's replay requests in order, until none waits."""
        try:
            while waiting:
                if not await self._stream_replay(replay, identity, waiting[0]):
                    waiting.clear()  # it does not read: what it asked for more goes too
                    break
                waiting.popleft()
        finally:
            if self._replays.get(identity) is waiting:
                del self._replays[identity]

    async def _stream_replay(self, replay: zmq.asyncio.Socket, identity: bytes, start: int) -> bool:
        """Send the buffered batches from ``start`` as the subscriber takes them; False when
        it was cut short."""
        try:
            stop = self.next_seq  # what is buffered now; later batches go out live
            seq, sent = start, 0
            while seq < stop:
                buffer = self._buffer
                if not buffer or buffer[-1][1] < seq:
                    break
                first = buffer[0][1]
                seq = max(seq, first)  # seqs in the buffer are consecutive: index, not scan
                topic, _, payload = buffer[seq - first]
                frames = (identity, b"", topic, seq.to_bytes(8, "big"), payload)
                await self._send_replayed(replay, frames, start)
                seq += 1
                sent += 1
                if sent % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
            await self._send_replayed(replay, (identity, b"", b"", END_SEQ, b""), start)
            logger.debug("replay from %d: %d batches", start, sent)
            return True
        except _ReplayCut as cut:
            self._warn_replay(logging.WARNING, "replay from %d cut short: %s", start, cut)
        except Exception:  # replay is a courtesy: it must never take publishing down
            self._warn_replay(logging.ERROR, "replay from %d failed", start, exc_info=True)
        return False

    async def _send_replayed(
        self, replay: zmq.asyncio.Socket, frames: tuple[bytes, ...], start: int
    ) -> None:
        """Send without copying the payload, waiting (bounded) while the window is full."""
        deadline = time.monotonic() + REPLAY_STALL
        pause = 0.001
        while True:
            try:
                await replay.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
                return
            except zmq.Again:
                if time.monotonic() >= deadline:
                    raise _ReplayCut(f"nothing read for {REPLAY_STALL:.0f} s") from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.05)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the subscriber went away
                raise _ReplayCut(str(exc)) from None


class _ReplayCut(Exception):
    """A replay ended before its end marker (its subscriber left, or stopped reading)."""


def _parse_replay_request(frames: list[bytes]) -> int | None:
    """``[identity, b"", start_seq (8 bytes)]`` -> start_seq; None if malformed."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        return None
    return int.from_bytes(frames[2], "big")


class PublisherSet:
    """The daemon's publishers: one per dp index (``port_per_dp``) or one for all.

    ``publish(topic, dp, batch)`` fills the batch's ``data_parallel_rank`` with ``dp`` when
    unset and, like ``EventPublisher.publish``, never blocks and never raises. With events
    off (``enabled = false`` or an empty ``endpoint``) nothing is bound and ``publish``
    returns False.
    """

    def __init__(
        self,
        settings: EventSettings,
        ctx: zmq.asyncio.Context,
        *,
        socket_mode: str = "0660",
        socket_group: str = "",
        buffer_bytes: int = 0,
        watch: Watch | None = None,
    ) -> None:
        self.settings = settings
        self._watch = watch
        self._buffer_bytes = buffer_bytes
        self._ctx = ctx
        self._socket_mode = socket_mode
        self._socket_group = socket_group
        self._publishers: dict[int, EventPublisher] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._failed: set[int] = set()
        self._unroutable = 0
        self._closed = False

    @property
    def active(self) -> bool:
        """Whether events are published at all."""
        return self.settings.enabled and bool(self.settings.endpoint)

    def start(self) -> None:
        """Bind dp 0's publisher (the shared one without ``port_per_dp``) and start it."""
        if self.active:
            self.publisher_for(0)

    def endpoints_for(self, dp: int) -> tuple[str, str]:
        """``(events, replay)`` endpoints a subscriber on this node uses for dp index ``dp``.

        The addresses bound when that publisher runs, else the configured ones for ``dp``
        (its publisher is bound on first use); ``""`` for what is off or cannot exist.
        """
        if not self.active:
            return "", ""
        key = dp if self.settings.port_per_dp else 0
        if key in self._failed:
            return "", ""
        publisher = self._publishers.get(key)
        if publisher is not None:
            return publisher.bound_endpoint, publisher.bound_replay_endpoint
        try:
            return (
                connectable(offset_endpoint_port(self.settings.endpoint, key)),
                connectable(offset_endpoint_port(self.settings.replay_endpoint, key)),
            )
        except ValueError:  # an endpoint that cannot be offset: that publisher never binds
            return "", ""

    def publisher_for(self, dp: int) -> EventPublisher:
        """The publisher of dp index ``dp``, bound and running (created on first use)."""
        if self._closed:
            raise RuntimeError("publisher set is closed")
        key = dp if self.settings.port_per_dp else 0
        publisher = self._publishers.get(key)
        if publisher is not None:
            return publisher
        settings = self.settings
        publisher = EventPublisher(
            offset_endpoint_port(settings.endpoint, key),
            offset_endpoint_port(settings.replay_endpoint, key),
            buffer_steps=settings.buffer_steps,
            buffer_bytes=self._buffer_bytes,
            hwm=settings.hwm,
            max_queue=settings.max_queue,
            ctx=self._ctx,
            socket_mode=self._socket_mode,
            socket_group=self._socket_group,
            watch=self._watch,
        )
        publisher.start()
        self._publishers[key] = publisher
        self._tasks[key] = asyncio.create_task(publisher.run(), name=f"events dp{key}")
        return publisher

    def publish(self, topic: str, dp: int, batch: KVEventBatch) -> bool:
        """Queue ``batch`` on dp index ``dp``'s publisher; False if it was dropped."""
        if not self.active or self._closed:
            return False
        key = dp if self.settings.port_per_dp else 0
        if key in self._failed:
            self._unroutable += 1
            return False
        try:
            publisher = self.publisher_for(dp)
        except (EventBindError, ValueError) as exc:
            self._failed.add(key)
            self._unroutable += 1
            logger.error("no KV event publisher for dp %d: %s; its events are dropped", dp, exc)
            return False
        if batch.data_parallel_rank is None:
            batch = msgspec.structs.replace(batch, data_parallel_rank=dp)
        return publisher.publish(topic, batch)

    def stats(self) -> PublisherStats:
        """Counters summed over the publishers (unroutable batches count as dropped)."""
        publishers = list(self._publishers.values())
        return PublisherStats(
            published=sum(p.published for p in publishers),
            dropped=self._unroutable + sum(p.dropped for p in publishers),
            invalid_replay_requests=sum(p.invalid_replay_requests for p in publishers),
            publishers=len(publishers),
        )

    async def close(self) -> None:
        """Flush and close every publisher; cancel and await their tasks. Idempotent."""
        self._closed = True
        for publisher in self._publishers.values():
            await publisher.close()
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):
                logger.error("KV event publisher task failed: %r", result)

    async def __aenter__(self) -> PublisherSet:
        self.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

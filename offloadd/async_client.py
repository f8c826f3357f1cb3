"""``AsyncOffloadClient``: the asyncio transport over the clients' core (``client_core``).

The same methods as ``OffloadClient`` (``offloadd.client``, which also exports this class),
as coroutines. A reader task routes replies to their requests; a heartbeat task pings while
idle. One-way methods (``post_*``, ``ack``, ``post_jobs``' queueing) never wait for a reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar, cast

import zmq
import zmq.asyncio

from offloadd.client_core import (
    DEFAULT_HEARTBEAT,
    DEFAULT_TIMEOUT,
    Call,
    ClientBase,
    CurveKeys,
    configure_dealer,
)
from offloadd.errors import DaemonUnavailable, OffloaddError
from protocol.config import OffloadingConfig
from protocol.handles import KVRegion
from protocol.messages import (
    CacheListing,
    DaemonStats,
    EngineState,
    Hello,
    HoldKeys,
    HoldResult,
    JobDone,
    Load,
    LookupResult,
    Reply,
    Request,
    Reserved,
    Role,
    Segment,
    Store,
    Welcome,
    encode,
)

R = TypeVar("R")


def _expire(future: asyncio.Future[Reply]) -> None:
    """The timer of an exchange: no reply came in time."""
    if not future.done():
        future.set_exception(TimeoutError())


class AsyncOffloadClient(ClientBase):
    """asyncio client with the same methods as ``OffloadClient`` (awaitable).

    A reader task routes replies to their requests; a heartbeat task pings while idle. If
    the daemon restarts, the next request says Hello again by itself.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        heartbeat: float = DEFAULT_HEARTBEAT,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__(endpoint, timeout, heartbeat, curve)
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket = self._ctx.socket(zmq.DEALER)
        configure_dealer(self._sock, self._core.identity, curve)
        self._sock.connect(endpoint)
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read_loop())
        self._heartbeat: asyncio.Task[None] | None = None

    @classmethod
    async def connect(
        cls,
        endpoint: str,
        config: OffloadingConfig,
        regions: Sequence[KVRegion] = (),
        *,
        role: Role = "worker",
        device_uuid: str = "",
        name: str = "",
        events_topic: str = "",
        raw_hashes: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        heartbeat: float = DEFAULT_HEARTBEAT,
        curve: CurveKeys | None = None,
        mirror: bool = False,
        files: Mapping[str, int] | None = None,
    ) -> AsyncOffloadClient:
        """Connect and say Hello; raises ConfigMismatch, InvalidRequest or DaemonUnavailable.

        ``mirror`` (schedulers): receive the namespace's key changes (``take_notices``).
        ``files``: as in ``OffloadClient.connect``.
        """
        client = cls(endpoint, timeout=timeout, heartbeat=heartbeat, curve=curve)
        try:
            await client._say_hello(
                client._core.first_hello(
                    config,
                    regions,
                    files,
                    role,
                    device_uuid,
                    name,
                    events_topic,
                    raw_hashes,
                    mirror,
                )
            )
        except BaseException:
            await client.close(goodbye=False)
            raise
        if heartbeat > 0:
            client._heartbeat = asyncio.create_task(client._heartbeat_loop())
        return client

    async def __aenter__(self) -> AsyncOffloadClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_ready(self, timeout: float | None = None) -> EngineState:
        """Wait until every rank of the engine has said Hello."""
        try:
            await asyncio.wait_for(
                self._until(lambda: self._core.ready), self.timeout if timeout is None else timeout
            )
        except TimeoutError:
            raise DaemonUnavailable("engine did not become ready in time") from None
        assert self._core.engine is not None
        return self._core.engine

    async def lookup(
        self, keys: Sequence[bytes], *, pin: bool = False, lease: float = 0.0
    ) -> LookupResult:
        """How many leading keys are cached (``pin`` holds them for ``lease`` seconds)."""
        return await self._call(self._core.lookup_call(keys, pin, lease))

    async def store(
        self,
        job_id: int,
        keys: Sequence[bytes],
        block_ids: Sequence[int],
        *,
        segments: Sequence[Segment] = (),
        reserved: bool = False,
        wait_event: bytes = b"",
        deadline: float = 0.0,
        reserve: tuple[str, int] = ("", 0),
    ) -> None:
        """Start storing this rank's shard of ``keys`` (see ``OffloadClient.store``)."""
        request = self._core.store(
            job_id, keys, block_ids, segments, reserved, wait_event, deadline, reserve
        )
        await self._call(self._core.submit_call(request))

    async def load(
        self,
        job_id: int,
        keys: Sequence[bytes],
        block_ids: Sequence[int],
        *,
        skip: int = 0,
        segments: Sequence[Segment] = (),
        hold: str = "",
        wait_event: bytes = b"",
    ) -> None:
        """Start loading ``keys`` into ``block_ids`` (see ``OffloadClient.load``)."""
        request = self._core.load(job_id, keys, block_ids, skip, segments, hold, wait_event)
        await self._call(self._core.submit_call(request))

    async def reserve(
        self,
        keys: Sequence[bytes],
        *,
        holds: Sequence[HoldKeys] = (),
        release: Sequence[HoldKeys] = (),
        ack: int = 0,
    ) -> Reserved:
        """(Scheduler) Reserve room for ``keys`` (see ``OffloadClient.reserve``)."""
        return await self._call(self._core.reserve_call(keys, holds, release, ack))

    async def update_holds(
        self,
        hold: Sequence[HoldKeys] = (),
        release: Sequence[HoldKeys] = (),
        *,
        ack: int = 0,
    ) -> HoldResult:
        """(Scheduler) Hold and release committed keys per request token."""
        return await self._call(self._core.update_holds_call(hold, release, ack))

    async def post_reserve(
        self,
        keys: Sequence[bytes],
        *,
        holds: Sequence[HoldKeys] = (),
        release: Sequence[HoldKeys] = (),
        ack: int = 0,
        lookups: Sequence[Sequence[bytes]] = (),
        touch: Sequence[bytes] = (),
    ) -> list[int]:
        """(Scheduler) ``reserve`` without awaiting the reply, with a ``Lookup`` of each of
        ``lookups`` (key runs) in the same message. Returns the request ids whose replies the
        reader task keeps for ``take_answers`` (the ``Reserved`` first, then one per lookup).
        Never suspends: raises DaemonUnavailable when the frame cannot be queued at once
        (nothing is sent then), as ``OffloadClient.post_reserve``."""
        return self._post_awaited(
            self._core.reserve(keys, holds, release, ack, lookups, posted=True, touch=touch)
        )

    async def post_update_holds(
        self,
        hold: Sequence[HoldKeys] = (),
        release: Sequence[HoldKeys] = (),
        *,
        ack: int = 0,
        lookups: Sequence[Sequence[bytes]] = (),
        touch: Sequence[bytes] = (),
    ) -> list[int]:
        """(Scheduler) ``update_holds`` without awaiting the reply; as ``post_reserve``."""
        return self._post_awaited(self._core.update_holds(hold, release, ack, lookups, touch))

    async def post_ping(self) -> int:
        """Prove the session without awaiting the reply: its ``Ok`` (count 0: the daemon no
        longer knows this session) arrives with ``take_answers``. Raises DaemonUnavailable
        as ``post_reserve``."""
        return self._post_awaited(self._core.ping())[0]

    async def ack(self, seq: int) -> None:
        """(Scheduler) Acknowledge key changes up to ``seq``, without awaiting the reply (the
        reader task drops it); raises DaemonUnavailable as ``post_reserve``."""
        self._post(self._core.ack(seq))

    async def post_jobs(self, jobs: Sequence[Store | Load]) -> None:
        """Send a step's Stores and Loads as one StepJobs (see ``OffloadClient.post_jobs``);
        waits only for the frames to be queued."""
        self._check_open()
        if not jobs:
            return
        frames = self._core.step_frames(jobs)
        for index, (_, frame) in enumerate(frames):
            try:
                async with asyncio.timeout(self.timeout):
                    await self._sock.send(frame)
            except TimeoutError:
                self._core.steps_unsent(frames[index:])
                raise self._unreachable() from None
            self._core.sent += 1

    async def wait(
        self,
        job_ids: Sequence[int],
        timeout: float | None = None,
        *,
        raise_on_failure: bool = True,
    ) -> list[JobDone]:
        """Wait until the jobs are done; JobError if one failed or time ran out."""
        ids = list(job_ids)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self._until(lambda: self._core.all_finished(ids)),
                self.timeout if timeout is None else timeout,
            )
        return self._core.jobs_done(ids, raise_on_failure)

    async def release(self, keys: Sequence[bytes]) -> int:
        """Drop this session's pins on ``keys``."""
        return await self._call(self._core.release_call(keys))

    async def clear(self) -> int:
        """Drop every chunk of this engine's namespace (a cache reset); returns how many."""
        return await self._call(self._core.clear_call())

    async def stats(self) -> DaemonStats:
        """The daemon's counters (see ``OffloadClient.stats``)."""
        return await self._call(self._core.stats_call(await self._admin_token()))

    async def list_cache(self) -> CacheListing:
        """See ``OffloadClient.list_cache``."""
        return await self._call(self._core.list_cache_call(await self._admin_token()))

    async def clear_cache(
        self, *, all: bool = False, namespace: str = "", engine_id: str = ""
    ) -> int:
        """See ``OffloadClient.clear_cache``."""
        token = await self._admin_token()
        call = self._core.clear_cache_call(token, all=all, namespace=namespace, engine_id=engine_id)
        return await self._call(call)

    async def _admin_token(self) -> bytes:
        if self._core.welcome is not None:
            return b""
        return await asyncio.to_thread(self._core.registered, self.endpoint, self.timeout)

    async def close(self, *, goodbye: bool = True) -> None:
        """Say goodbye (best effort), stop the tasks, close the socket. Idempotent."""
        if self._closed:
            return
        tasks = [t for t in (self._heartbeat, self._reader) if t is not None]
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if goodbye and self._core.welcome is not None:
            with contextlib.suppress(OffloaddError):
                await self._exchange(self._core.bye(), min(self.timeout, 1.0))
        self._closed = True
        self._reader.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._sock.close(linger=0)
        self._ctx.term()
        self._core.close_files()

    async def _call(self, call: Call[R]) -> R:
        return call.answer(await self._request(call.request))

    async def _say_hello(self, hello: Hello, timeout: float | None = None) -> None:
        """Register (off the loop) and send ``hello``; raises unless the daemon welcomes it.
        Wakes the waiters: jobs of a lost session were just marked failed."""
        token = await asyncio.to_thread(self._core.registered, self.endpoint, self.timeout)
        reply = await self._exchange(self._core.with_token(hello, token), timeout)
        self._core.expect(reply, Welcome)
        self._changed.set()

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            self._changed.clear()
            await self._changed.wait()

    async def _request(self, request: Request, timeout: float | None = None) -> Reply:
        """Send and wait for the reply; says Hello again once if the session was lost."""
        reply = await self._exchange(request, timeout)
        hello = self._core.hello_again(reply)
        if hello is not None:
            await self._say_hello(hello, timeout)
            reply = await self._exchange(request, timeout)
        return reply

    async def _exchange(self, request: Request, timeout: float | None = None) -> Reply:
        self._check_open()
        timeout = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Reply] = loop.create_future()
        request_id = request.request_id
        self._pending[request_id] = future
        frame = encode(request)
        try:
            # The usual case: the frame is queued at once and only the reply is waited for,
            # under a plain timer rather than a timeout scope.
            sent = cast("asyncio.Future[object]", self._sock.send(frame, zmq.DONTWAIT))
            if sent.done() and sent.exception() is None:
                expiry = loop.call_later(timeout, _expire, future)
                try:
                    return await future
                finally:
                    expiry.cancel()
            if not sent.done():
                sent.cancel()
            # Refused for now (its exception retrieved above): sent again, waiting for room.
            async with asyncio.timeout(timeout):
                await self._sock.send(frame)
                return await future
        except TimeoutError:
            raise DaemonUnavailable(
                f"no answer from {self.endpoint} within {timeout:.1f}s"
            ) from None
        finally:
            self._pending.pop(request_id, None)

    def _post(self, request: Request) -> None:
        """Queue ``request`` now, without awaiting its reply; DaemonUnavailable if it would
        have to wait for room (nothing is queued then)."""
        self._check_open()
        sent = cast("asyncio.Future[object]", self._sock.send(encode(request), zmq.DONTWAIT))
        if not sent.done():
            sent.cancel()  # queued behind a send that waits for room: it would wait too
        elif (error := sent.exception()) is None:
            self._core.sent += 1
            return
        elif not isinstance(error, zmq.Again):
            raise error
        raise self._unreachable()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            if time.monotonic() - self._core.last_request < self.heartbeat:
                continue  # recent traffic already proves the session alive
            with contextlib.suppress(OffloaddError):
                reply = await self._exchange(self._core.ping(), self.heartbeat)
                hello = self._core.forgotten(reply)
                if hello is not None:
                    # The daemon does not know us (it restarted): say Hello again now, so
                    # the engine is whole again before the next request.
                    await self._say_hello(hello)

    async def _read_loop(self) -> None:
        while True:
            frame = await self._sock.recv()
            reply = self._core.decode(frame)
            if reply is None:
                continue
            request_id = getattr(reply, "request_id", None)
            if request_id is not None:
                future = self._pending.get(request_id)
                if future is not None and not future.done():
                    future.set_result(reply)
            self._changed.set()

"""Rank-side client: ``OffloadClient`` (blocking) and ``AsyncOffloadClient`` over one core.

Both speak to the daemon over a DEALER socket and have the same methods::

    with OffloadClient.connect(endpoint, config, regions) as client:
        client.wait_ready()
        hits = client.lookup(keys).hits
        client.store(job_id, keys, block_ids)
        client.wait([job_id])              # before reusing those GPU blocks

``_ClientCore`` holds everything that is not I/O: request ids, message construction, the
record of finished jobs and engine readiness, and the mapping from Error replies to
exceptions. The two clients only move frames. Replies that arrive unasked (``JobDone``,
``EngineReady``) are recorded by the core whenever either client reads the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import msgspec
import zmq
import zmq.asyncio

from offloadd.errors import DaemonUnavailable, JobError, OffloaddError, error_from_reply
from protocol import PROTOCOL_VERSION
from protocol.config import OffloadingConfig
from protocol.handles import KVRegion
from protocol.messages import (
    Bye,
    Clear,
    DaemonStats,
    EngineReady,
    EngineState,
    Error,
    GetStats,
    Hello,
    JobAccepted,
    JobDone,
    Load,
    Lookup,
    LookupResult,
    Ok,
    Release,
    Reply,
    Request,
    Role,
    StatsResult,
    Store,
    Wait,
    WaitResult,
    Welcome,
    decode_reply,
    encode,
)

DEFAULT_TIMEOUT = 10.0
_REMEMBERED_JOBS = 65536

R = TypeVar("R")


class _ClientCore:
    """State and message logic shared by the sync and async clients."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.identity = uuid.uuid4().bytes
        self.welcome: Welcome | None = None
        self.engine: EngineState | None = None
        self.finished: OrderedDict[int, JobDone] = OrderedDict()

    def next_id(self) -> int:
        return next(self._ids)

    def hello(
        self,
        config: OffloadingConfig,
        regions: Sequence[KVRegion],
        role: Role,
        device_uuid: str,
        name: str,
    ) -> Hello:
        return Hello(
            request_id=self.next_id(),
            protocol_version=PROTOCOL_VERSION,
            role=role,
            config=config,
            regions=tuple(regions),
            device_uuid=device_uuid,
            pid=os.getpid(),
            client_name=name,
        )

    def decode(self, frame: bytes) -> Reply | None:
        """Decode a frame; record unasked messages; None for garbage (ignored)."""
        try:
            reply = decode_reply(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        match reply:
            case JobDone():
                self.finished[reply.job_id] = reply
                while len(self.finished) > _REMEMBERED_JOBS:
                    self.finished.popitem(last=False)
            case EngineReady():
                self.engine = reply.engine
            case Welcome():
                self.welcome = reply
                self.engine = reply.engine
        return reply

    @staticmethod
    def expect(reply: Reply, kind: type[R]) -> R:
        """``reply`` as ``kind``, or the exception its Error names."""
        if isinstance(reply, Error):
            raise error_from_reply(reply)
        if not isinstance(reply, kind):
            raise OffloaddError(f"expected {kind.__name__}, daemon sent {type(reply).__name__}")
        return reply

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready

    def take_finished(self, job_ids: Iterable[int]) -> tuple[list[JobDone], list[int]]:
        """Results already received for ``job_ids``, and the ids still missing."""
        done, missing = [], []
        for job_id in job_ids:
            result = self.finished.get(job_id)
            if result is None:
                missing.append(job_id)
            else:
                done.append(result)
        return done, missing

    @staticmethod
    def check_jobs(done: list[JobDone], pending: list[int], raise_on_failure: bool) -> None:
        if pending:
            raise JobError(f"jobs {pending[:10]} did not finish in time", done)
        failed = [d for d in done if not d.ok]
        if failed and raise_on_failure:
            first = failed[0]
            raise JobError(
                f"job {first.job_id} failed: {first.error or 'keys not stored/loaded'} "
                f"({len(first.failed_keys)} keys)",
                done,
            )


def _configure_dealer(sock: zmq.Socket[bytes] | zmq.asyncio.Socket, identity: bytes) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity)


class OffloadClient:
    """Blocking client; not thread-safe (one per rank thread)."""

    def __init__(self, endpoint: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._core = _ClientCore()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        _configure_dealer(self._sock, self._core.identity)
        self._sock.connect(endpoint)
        self._closed = False

    @classmethod
    def connect(
        cls,
        endpoint: str,
        config: OffloadingConfig,
        regions: Sequence[KVRegion] = (),
        *,
        role: Role = "worker",
        device_uuid: str = "",
        name: str = "",
        timeout: float = DEFAULT_TIMEOUT,
    ) -> OffloadClient:
        """Connect and say Hello; raises ConfigMismatch, InvalidRequest or DaemonUnavailable."""
        client = cls(endpoint, timeout=timeout)
        try:
            hello = client._core.hello(config, regions, role, device_uuid, name)
            client._core.expect(client._request(hello), Welcome)
        except BaseException:
            client.close(goodbye=False)
            raise
        return client

    def __enter__(self) -> OffloadClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def engine(self) -> EngineState | None:
        """The engine as last reported by the daemon."""
        return self._core.engine

    @property
    def finished(self) -> OrderedDict[int, JobDone]:
        """Job results received so far (most recent jobs)."""
        return self._core.finished

    def wait_ready(self, timeout: float | None = None) -> EngineState:
        """Block until every rank of the engine has said Hello."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not self._core.ready:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DaemonUnavailable("engine did not become ready in time")
            self._read_one(remaining)
        assert self._core.engine is not None
        return self._core.engine

    def lookup(
        self, keys: Sequence[bytes], *, pin: bool = False, lease: float = 0.0
    ) -> LookupResult:
        """How many leading keys are cached (``pin`` holds them for ``lease`` seconds)."""
        request = Lookup(self._core.next_id(), list(keys), pin, lease)
        return self._core.expect(self._request(request), LookupResult)

    def store(self, job_id: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Start storing this rank's shard of ``keys`` from ``block_ids``."""
        request = Store(self._core.next_id(), job_id, list(keys), list(block_ids))
        self._core.finished.pop(job_id, None)  # a reused id must not see the old result
        self._core.expect(self._request(request), JobAccepted)

    def load(
        self, job_id: int, keys: Sequence[bytes], block_ids: Sequence[int], *, skip: int = 0
    ) -> None:
        """Start loading ``keys`` into ``block_ids`` (``skip`` leading blocks of chunk 0)."""
        request = Load(self._core.next_id(), job_id, list(keys), list(block_ids), skip)
        self._core.finished.pop(job_id, None)
        self._core.expect(self._request(request), JobAccepted)

    def wait(
        self, job_ids: Sequence[int], timeout: float | None = None, *, raise_on_failure: bool = True
    ) -> list[JobDone]:
        """Block until the jobs are done; JobError if one failed or time ran out."""
        timeout = self.timeout if timeout is None else timeout
        done, missing = self._core.take_finished(job_ids)
        if missing:
            request = Wait(self._core.next_id(), missing, timeout)
            result = self._core.expect(self._request(request, timeout + self.timeout), WaitResult)
            done += result.done
            self._core.check_jobs(done, result.pending, raise_on_failure)
        self._core.check_jobs(done, [], raise_on_failure)
        return done

    def release(self, keys: Sequence[bytes]) -> int:
        """Drop this session's pins on ``keys``."""
        reply = self._request(Release(self._core.next_id(), list(keys)))
        return self._core.expect(reply, Ok).count

    def clear(self) -> int:
        """Drop every chunk of this engine's namespace (a cache reset); returns how many."""
        return self._core.expect(self._request(Clear(self._core.next_id())), Ok).count

    def stats(self) -> DaemonStats:
        """The daemon's counters (works without Hello)."""
        return self._core.expect(self._request(GetStats(self._core.next_id())), StatsResult).stats

    def close(self, *, goodbye: bool = True) -> None:
        """Say goodbye (best effort) and close the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if goodbye and self._core.welcome is not None:
            with contextlib.suppress(OffloaddError):
                self._request(Bye(self._core.next_id()), min(self.timeout, 1.0))
        self._sock.close(linger=0)
        self._ctx.term()

    def _request(self, request: Request, timeout: float | None = None) -> Reply:
        if self._closed:
            raise OffloaddError("client is closed")
        self._sock.send(encode(request))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DaemonUnavailable(
                    f"no answer from {self.endpoint} within {timeout or self.timeout:.1f}s"
                )
            reply = self._read_one(remaining)
            if reply is not None and getattr(reply, "request_id", None) == request.request_id:
                return reply

    def _read_one(self, timeout: float) -> Reply | None:
        if not self._sock.poll(max(1, int(timeout * 1000))):
            return None
        return self._core.decode(self._sock.recv())


class AsyncOffloadClient:
    """asyncio client with the same methods as ``OffloadClient`` (awaitable)."""

    def __init__(self, endpoint: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._core = _ClientCore()
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket = self._ctx.socket(zmq.DEALER)
        _configure_dealer(self._sock, self._core.identity)
        self._sock.connect(endpoint)
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read_loop())
        self._closed = False

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
        timeout: float = DEFAULT_TIMEOUT,
    ) -> AsyncOffloadClient:
        """Connect and say Hello; raises ConfigMismatch, InvalidRequest or DaemonUnavailable."""
        client = cls(endpoint, timeout=timeout)
        try:
            hello = client._core.hello(config, regions, role, device_uuid, name)
            client._core.expect(await client._request(hello), Welcome)
        except BaseException:
            await client.close(goodbye=False)
            raise
        return client

    async def __aenter__(self) -> AsyncOffloadClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def engine(self) -> EngineState | None:
        """The engine as last reported by the daemon."""
        return self._core.engine

    @property
    def finished(self) -> OrderedDict[int, JobDone]:
        """Job results received so far (most recent jobs)."""
        return self._core.finished

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
        request = Lookup(self._core.next_id(), list(keys), pin, lease)
        return self._core.expect(await self._request(request), LookupResult)

    async def store(self, job_id: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Start storing this rank's shard of ``keys`` from ``block_ids``."""
        request = Store(self._core.next_id(), job_id, list(keys), list(block_ids))
        self._core.finished.pop(job_id, None)  # a reused id must not see the old result
        self._core.expect(await self._request(request), JobAccepted)

    async def load(
        self, job_id: int, keys: Sequence[bytes], block_ids: Sequence[int], *, skip: int = 0
    ) -> None:
        """Start loading ``keys`` into ``block_ids`` (``skip`` leading blocks of chunk 0)."""
        request = Load(self._core.next_id(), job_id, list(keys), list(block_ids), skip)
        self._core.finished.pop(job_id, None)
        self._core.expect(await self._request(request), JobAccepted)

    async def wait(
        self, job_ids: Sequence[int], timeout: float | None = None, *, raise_on_failure: bool = True
    ) -> list[JobDone]:
        """Wait until the jobs are done; JobError if one failed or time ran out."""
        timeout = self.timeout if timeout is None else timeout
        ids = list(job_ids)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self._until(lambda: not self._core.take_finished(ids)[1]), timeout
            )
        done, missing = self._core.take_finished(ids)
        self._core.check_jobs(done, missing, raise_on_failure)
        return done

    async def release(self, keys: Sequence[bytes]) -> int:
        """Drop this session's pins on ``keys``."""
        reply = await self._request(Release(self._core.next_id(), list(keys)))
        return self._core.expect(reply, Ok).count

    async def clear(self) -> int:
        """Drop every chunk of this engine's namespace (a cache reset); returns how many."""
        return self._core.expect(await self._request(Clear(self._core.next_id())), Ok).count

    async def stats(self) -> DaemonStats:
        """The daemon's counters (works without Hello)."""
        reply = await self._request(GetStats(self._core.next_id()))
        return self._core.expect(reply, StatsResult).stats

    async def close(self, *, goodbye: bool = True) -> None:
        """Say goodbye (best effort), stop the reader, close the socket. Idempotent."""
        if self._closed:
            return
        if goodbye and self._core.welcome is not None:
            with contextlib.suppress(OffloaddError):
                await self._request(Bye(self._core.next_id()), min(self.timeout, 1.0))
        self._closed = True
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._sock.close(linger=0)
        self._ctx.term()

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            self._changed.clear()
            await self._changed.wait()

    async def _request(self, request: Request, timeout: float | None = None) -> Reply:
        if self._closed:
            raise OffloaddError("client is closed")
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = future
        try:
            await self._sock.send(encode(request))
            return await asyncio.wait_for(future, self.timeout if timeout is None else timeout)
        except TimeoutError:
            raise DaemonUnavailable(
                f"no answer from {self.endpoint} within {timeout or self.timeout:.1f}s"
            ) from None
        finally:
            self._pending.pop(request.request_id, None)

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

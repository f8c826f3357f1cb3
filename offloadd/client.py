"""Rank-side client: ``OffloadClient`` (blocking) and ``AsyncOffloadClient`` over one core.

Both speak to the daemon over a DEALER socket and have the same methods::

    with OffloadClient.connect(endpoint, config, regions) as client:
        client.wait_ready()
        hits = client.lookup(keys).hits
        client.store(job_id, keys, block_ids)
        client.wait([job_id])              # before reusing those GPU blocks

``_ClientCore`` (``offloadd.client_core``) holds everything that is not I/O: request ids,
message construction, what each reply means, the record of finished jobs and engine
readiness, and the mapping from Error replies to exceptions. The two clients only move
frames: ``OffloadClient`` here, ``AsyncOffloadClient`` in ``offloadd.async_client`` (both
importable from this module). Replies that arrive unasked (``JobDone``, ``EngineReady``)
are recorded by the core whenever either client reads the socket.

Every Hello is preceded by a registration (``offloadd.peer``): on an ``ipc://`` endpoint the
client opens its shared-memory regions' files itself (or duplicates the descriptors given in
``files``), passes the descriptors over the daemon's registration socket, where the kernel
tells the daemon the rank's uid, gid and pid, and sends the one-time token it gets back in
the Hello. A Hello said again (after a daemon restart or a reap) registers again. ``stats``
without a session registers too, so the daemon shows the engines this user may see.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TypeVar

import zmq

from offloadd.async_client import AsyncOffloadClient
from offloadd.client_core import (
    DEFAULT_HEARTBEAT,
    DEFAULT_TIMEOUT,
    MAX_STEP_FRAME,
    SESSION_LOST,
    Call,
    ClientBase,
    CurveKeys,
    _ClientCore,
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
    Ping,
    Reply,
    Request,
    Reserved,
    Role,
    Segment,
    Store,
    Welcome,
    encode,
)

__all__ = [
    "DEFAULT_HEARTBEAT",
    "DEFAULT_TIMEOUT",
    "MAX_STEP_FRAME",
    "SESSION_LOST",
    "AsyncOffloadClient",
    "CurveKeys",
    "Heartbeat",
    "OffloadClient",
    "_ClientCore",
]

R = TypeVar("R")


class OffloadClient(ClientBase):
    """Blocking client; not thread-safe (one per rank thread).

    A small background thread sends heartbeats on its own socket while the client is
    connected, so an idle rank is not reaped (``heartbeat=0``: none; the vLLM plugin's
    ``SessionLink`` sends them from its own thread). If the daemon restarts, the next request
    says Hello again by itself (jobs of the lost session are reported failed).
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
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        configure_dealer(self._sock, self._core.identity, curve)
        self._sock.connect(endpoint)
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

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
        events_topic: str = "",
        raw_hashes: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        heartbeat: float = DEFAULT_HEARTBEAT,
        curve: CurveKeys | None = None,
        mirror: bool = False,
        files: Mapping[str, int] | None = None,
    ) -> OffloadClient:
        """Connect and say Hello; raises ConfigMismatch, InvalidRequest or DaemonUnavailable.

        ``mirror`` (schedulers): receive the namespace's key changes (``take_notices``).
        ``files``: descriptors of shared-memory region files by ``ShmHandle.path`` (the
        client duplicates them); a file not given is opened here, with the rank's rights.
        """
        client = cls(endpoint, timeout=timeout, heartbeat=heartbeat, curve=curve)
        try:
            client._say_hello(
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
                ),
                timeout,
            )
        except BaseException:
            client.close(goodbye=False)
            raise
        client._start_heartbeat()
        return client

    def __enter__(self) -> OffloadClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        return self._call(self._core.lookup_call(keys, pin, lease))

    def store(
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
        """Start storing this rank's shard of ``keys`` from ``block_ids``.

        ``segments`` for chunks that are not full (see ``Segment``); ``reserved``: write only
        keys a scheduler reserved, and ``reserve``: that scheduler's session id and the
        request id of its ``Reserve`` (the daemon waits for it if it reads this first);
        ``wait_event``: a CUDA IPC event handle recorded after the compute that wrote these
        blocks (else synchronize before calling); ``deadline``: the ``time.monotonic()``
        after which the daemon neither starts nor commits it (0: none; meaningful only when
        ``welcome.shared_clock``).
        """
        request = self._core.store(
            job_id, keys, block_ids, segments, reserved, wait_event, deadline, reserve
        )
        self._call(self._core.submit_call(request))

    def load(
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
        """Start loading ``keys`` into ``block_ids`` (``skip`` leading blocks of chunk 0).

        ``hold``: the keys a scheduler holds under that token; ``wait_event``: a CUDA IPC event
        handle recorded after the rank's last use of these blocks (else synchronize first).
        """
        request = self._core.load(job_id, keys, block_ids, skip, segments, hold, wait_event)
        self._call(self._core.submit_call(request))

    def reserve(
        self,
        keys: Sequence[bytes],
        *,
        holds: Sequence[HoldKeys] = (),
        release: Sequence[HoldKeys] = (),
        ack: int = 0,
    ) -> Reserved:
        """(Scheduler) Reserve room for ``keys``: ``reserved``, the indices of the keys that
        got it; ``missing``, the held keys that were not held."""
        return self._call(self._core.reserve_call(keys, holds, release, ack))

    def update_holds(
        self,
        hold: Sequence[HoldKeys] = (),
        release: Sequence[HoldKeys] = (),
        *,
        ack: int = 0,
    ) -> HoldResult:
        """(Scheduler) Hold and release committed keys per request token."""
        return self._call(self._core.update_holds_call(hold, release, ack))

    def post_reserve(
        self,
        keys: Sequence[bytes],
        *,
        holds: Sequence[HoldKeys] = (),
        release: Sequence[HoldKeys] = (),
        ack: int = 0,
        lookups: Sequence[Sequence[bytes]] = (),
        touch: Sequence[bytes] = (),
    ) -> list[int]:
        """(Scheduler) ``reserve`` without waiting, with a ``Lookup`` of each of ``lookups``
        (key runs) in the same message, and the committed keys in ``touch`` marked recently
        used. Returns the request ids whose replies arrive with ``take_answers`` (the
        ``Reserved`` first, then one per lookup). Raises DaemonUnavailable when it cannot be
        sent now (nothing is sent then)."""
        return self._post_awaited(
            self._core.reserve(keys, holds, release, ack, lookups, posted=True, touch=touch)
        )

    def post_update_holds(
        self,
        hold: Sequence[HoldKeys] = (),
        release: Sequence[HoldKeys] = (),
        *,
        ack: int = 0,
        lookups: Sequence[Sequence[bytes]] = (),
        touch: Sequence[bytes] = (),
    ) -> list[int]:
        """(Scheduler) ``update_holds`` without waiting; as ``post_reserve``."""
        return self._post_awaited(self._core.update_holds(hold, release, ack, lookups, touch))

    def post_ping(self) -> int:
        """Prove the session without waiting: its ``Ok`` (count 0: the daemon no longer knows
        this session) arrives with ``take_answers``. Raises DaemonUnavailable as
        ``post_reserve``."""
        return self._post_awaited(self._core.ping())[0]

    def keepalive(self, timeout: float) -> None:
        """Prove the session within ``timeout``; say Hello again if the daemon forgot it
        (it restarted). Raises DaemonUnavailable when nothing answers in time."""
        ping = self._core.ping()
        try:
            reply = self._exchange(ping, timeout)
        except DaemonUnavailable:
            self._core.late_ping = ping.request_id  # its answer may still come (``decode``)
            raise
        hello = self._core.forgotten(reply)
        if hello is not None:
            self._say_hello(hello, timeout)

    def ack(self, seq: int) -> None:
        """(Scheduler) Acknowledge key changes up to ``seq``, without waiting for the reply."""
        self._post(self._core.ack(seq))

    def poll(self, timeout: float = 0.0) -> int:
        """Read every message that arrives within ``timeout`` (0: only those already here);
        JobDone and KeysChanged are recorded. Returns how many were read."""
        count, wait_ms = 0, int(timeout * 1000)
        while self._sock.poll(wait_ms):
            self._core.decode(self._sock.recv())
            count, wait_ms = count + 1, 0
        return count

    def post_jobs(self, jobs: Sequence[Store | Load]) -> None:
        """Send a step's Stores and Loads as one StepJobs, without waiting for anything.

        Their ``JobDone`` (a refused job's too, its ``code`` set) arrive with ``poll`` or
        ``wait``; a StepJobs refused whole (the session lost: ``session_lost``) records each
        of its jobs failed. The jobs' ``request_id`` is not read. Raises DaemonUnavailable
        when no daemon is connected (nothing is sent then).
        """
        self._check_open()
        if not jobs:
            return
        frames = self._core.step_frames(jobs)
        for index, (_, frame) in enumerate(frames):
            try:
                self._send_frame(frame)
            except DaemonUnavailable:
                self._core.steps_unsent(frames[index:])
                raise

    def can_send(self) -> bool:
        """Connected to a daemon: a send goes out now (sends wait for a live connection)."""
        return not self._closed and bool(self._sock.poll(0, zmq.POLLOUT))

    def wait(
        self,
        job_ids: Sequence[int],
        timeout: float | None = None,
        *,
        raise_on_failure: bool = True,
    ) -> list[JobDone]:
        """Block until the jobs are done; JobError if one failed or time ran out."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not self._core.all_finished(job_ids):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._read_one(remaining)
        return self._core.jobs_done(job_ids, raise_on_failure)

    def release(self, keys: Sequence[bytes]) -> int:
        """Drop this session's pins on ``keys``."""
        return self._call(self._core.release_call(keys))

    def clear(self) -> int:
        """Drop every chunk of this engine's namespace (a cache reset); returns how many."""
        return self._call(self._core.clear_call())

    def stats(self) -> DaemonStats:
        """The daemon's counters (works without Hello: then registers, so the engines listed
        are those this user may see)."""
        return self._call(self._core.stats_call(self._admin_token()))

    def list_cache(self) -> CacheListing:
        """What the cache holds per namespace and engine (``offloadd cache ls``); root and
        the daemon's user only (else ``NotPermitted``). Works without Hello, as ``stats``."""
        return self._call(self._core.list_cache_call(self._admin_token()))

    def clear_cache(self, *, all: bool = False, namespace: str = "", engine_id: str = "") -> int:
        """Drop every chunk (``all``), a namespace's or an engine's (``protocol.messages.
        ClearCache``); returns how many. Who may: as ``list_cache``."""
        call = self._core.clear_cache_call(
            self._admin_token(), all=all, namespace=namespace, engine_id=engine_id
        )
        return self._call(call)

    def _admin_token(self) -> bytes:
        """A registration token, when no session says who this client is."""
        if self._core.welcome is not None:
            return b""
        return self._core.registered(self.endpoint, self.timeout)

    def close(self, *, goodbye: bool = True) -> None:
        """Say goodbye (best effort) and close the sockets. Idempotent."""
        if self._closed:
            return
        self._stop_heartbeat.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join()
        if goodbye and self._core.welcome is not None:
            with contextlib.suppress(OffloaddError):
                self._exchange(self._core.bye(), min(self.timeout, 1.0))
        self._closed = True
        self._sock.close(linger=0)
        self._ctx.term()
        self._core.close_files()

    def _call(self, call: Call[R]) -> R:
        return call.answer(self._request(call.request))

    def _say_hello(self, hello: Hello, timeout: float | None) -> None:
        """Register and send ``hello``; raises unless the daemon welcomes it."""
        token = self._core.registered(self.endpoint, self.timeout)
        self._core.expect(self._exchange(self._core.with_token(hello, token), timeout), Welcome)

    def _request(self, request: Request, timeout: float | None = None) -> Reply:
        """Send and wait for the reply; says Hello again once if the session was lost."""
        reply = self._exchange(request, timeout)
        hello = self._core.hello_again(reply)
        if hello is not None:
            self._say_hello(hello, timeout)
            reply = self._exchange(request, timeout)
        return reply

    def _exchange(self, request: Request, timeout: float | None = None) -> Reply:
        self._check_open()
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        frame = encode(request)
        while True:
            try:
                self._sock.send(frame, zmq.NOBLOCK)
                self._core.sent += 1
                break
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._sock.poll(int(remaining * 1000), zmq.POLLOUT):
                    raise self._unreachable() from None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DaemonUnavailable(f"no answer from {self.endpoint} within {timeout:.1f}s")
            reply = self._read_one(remaining)
            if reply is not None and getattr(reply, "request_id", None) == request.request_id:
                return reply

    def _read_one(self, timeout: float) -> Reply | None:
        if not self._sock.poll(max(1, int(timeout * 1000))):
            return None
        return self._core.decode(self._sock.recv())

    def _post(self, request: Request) -> None:
        """Send without waiting for the reply (it is read and dropped later)."""
        self._check_open()
        self._send_frame(encode(request))

    def _send_frame(self, frame: bytes) -> None:
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            raise self._unreachable() from None
        self._core.sent += 1

    def _start_heartbeat(self) -> None:
        if self.heartbeat <= 0:
            return
        session = self._core.identity.hex()
        thread = threading.Thread(
            target=self._heartbeat_loop, args=(session,), name="offloadd-heartbeat", daemon=True
        )
        self._heartbeat_thread = thread
        thread.start()

    def _heartbeat_loop(self, session: str) -> None:
        heartbeat = Heartbeat(self._ctx, self.endpoint, self.curve)  # this thread's alone
        try:
            while not self._stop_heartbeat.wait(self.heartbeat):
                heartbeat.ping(session)
        finally:
            heartbeat.close()


class Heartbeat:
    """Pings that vouch for a session from a DEALER of their own: the session's socket is
    its owner's to use (and may be busy in a long call), and a zmq socket is one thread's,
    so only the thread that created a ``Heartbeat`` may use it. ``close`` before the
    context is terminated."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        curve: CurveKeys | None = None,
    ) -> None:
        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        configure_dealer(self._sock, uuid.uuid4().bytes, curve)
        self._sock.connect(endpoint)

    def ping(self, session: str) -> None:
        """Vouch for ``session`` (its id); nothing is sent while the daemon is away."""
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send(encode(Ping(0, session)), zmq.NOBLOCK)
        while self._sock.poll(0):  # replies only matter to the daemon's bookkeeping
            self._sock.recv()

    def close(self) -> None:
        self._sock.close(linger=0)

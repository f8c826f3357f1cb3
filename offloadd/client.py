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

Every Hello is preceded by a registration (``offloadd.peer``): on an ``ipc://`` endpoint the
client opens its shared-memory regions' files itself (or duplicates the descriptors given in
``files``), passes the descriptors over the daemon's registration socket, where the kernel
tells the daemon the rank's uid, gid and pid, and sends the one-time token it gets back in
the Hello. A Hello said again (after a daemon restart or a reap) registers again. ``stats``
without a session registers too, so the daemon shows the engines this user may see.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import msgspec
import zmq
import zmq.asyncio

from offloadd.errors import DaemonUnavailable, JobError, OffloaddError, error_from_reply
from offloadd.peer import RegionFiles, register
from protocol import PROTOCOL_VERSION
from protocol.config import OffloadingConfig
from protocol.errors import ErrorCode
from protocol.handles import KVRegion
from protocol.messages import (
    Ack,
    Bye,
    CacheListing,
    Clear,
    ClearCache,
    DaemonStats,
    EngineReady,
    EngineState,
    Error,
    GetStats,
    Hello,
    HoldKeys,
    HoldResult,
    JobAccepted,
    JobDone,
    JobsDone,
    KeysChanged,
    ListCache,
    Load,
    Lookup,
    LookupResult,
    Ok,
    Ping,
    Release,
    Reply,
    Request,
    Reserve,
    Reserved,
    Role,
    Segment,
    StatsResult,
    StepJobs,
    Store,
    UpdateHolds,
    Welcome,
    decode_reply,
    encode,
)

DEFAULT_TIMEOUT = 10.0
DEFAULT_HEARTBEAT = 5.0
_REMEMBERED_JOBS = 65536
# A StepJobs frame larger than this is split (the daemon refuses frames over its
# server.max_frame_bytes, 16 MiB by default, with no request id to tell which jobs they were).
MAX_STEP_FRAME = 4 << 20

R = TypeVar("R")


# JobDone.error of a job whose session the daemon no longer knows: it never ran to the end.
SESSION_LOST = "session lost (daemon restarted or reaped)"


class _ClientCore:
    """State and message logic shared by the sync and async clients."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.identity = uuid.uuid4().bytes
        self.welcome: Welcome | None = None
        self.engine: EngineState | None = None
        self.finished: OrderedDict[int, JobDone] = OrderedDict()
        self.submitted: set[int] = set()  # accepted jobs whose JobDone has not arrived
        self.notices: list[KeysChanged] = []  # key-mirror changes not yet taken, in order
        self._hello: Hello | None = None
        self.files: RegionFiles | None = None
        self.last_request = time.monotonic()
        # StepJobs sent and not yet answered: request id -> (when sent, its job ids).
        self.steps: dict[int, tuple[float, list[int]]] = {}
        self.answered_at = 0.0  # monotonic time of the latest StepJobs answer
        self.heard_at = 0.0  # monotonic time of the latest message from the daemon
        # A StepJobs came back NOT_REGISTERED, or a timed-out ping's late answer said the
        # daemon does not know the session: say Hello again.
        self.session_lost = False
        # The latest keepalive ping that timed out: its late answer may say the session is gone.
        self.late_ping: int | None = None
        self.sent = 0  # messages sent on the client's socket (the heartbeat's excepted)
        # Posted requests (nothing waits for them) whose replies are kept for ``take_answers``.
        self.awaited: set[int] = set()
        self.answers: list[Reply] = []

    def next_id(self) -> int:
        self.last_request = time.monotonic()
        return next(self._ids)

    def hello(
        self,
        config: OffloadingConfig,
        regions: Sequence[KVRegion],
        role: Role,
        device_uuid: str,
        name: str,
        events_topic: str = "",
        raw_hashes: bool = False,
        mirror: bool = False,
    ) -> Hello:
        """The Hello to send; remembered so that a lost session can say it again."""
        self._hello = Hello(
            request_id=self.next_id(),
            protocol_version=PROTOCOL_VERSION,
            role=role,
            config=config,
            regions=tuple(regions),
            device_uuid=device_uuid,
            pid=os.getpid(),
            client_name=name,
            kv_events_topic=events_topic,
            kv_events_raw_hashes=raw_hashes,
            pid_namespace=_pid_namespace(),
            mirror=mirror,
        )
        return self._hello

    def open_files(
        self, regions: Sequence[KVRegion], files: Mapping[str, int] | None
    ) -> tuple[KVRegion, ...]:
        """Open the regions' shared-memory files (kept until ``close_files``); the regions as
        the Hello names them (their descriptors numbered)."""
        try:
            self.files = RegionFiles.open(regions, files)
        except OSError as exc:
            raise OffloaddError(f"cannot hand a KV region to the daemon: {exc}") from None
        return self.files.regions

    def close_files(self) -> None:
        if self.files is not None:
            self.files.close()

    def registered(self, endpoint: str, timeout: float) -> bytes:
        """A fresh registration token for this client's identity and files (b"" where the
        endpoint has no registration socket)."""
        fds = self.files.fds if self.files is not None else []
        registered = register(endpoint, self.identity, fds, timeout)
        return registered.token if registered is not None else b""

    def hello_again(self, reply: Reply) -> Hello | None:
        """The Hello to resend when ``reply`` says the daemon no longer knows this session.

        That happens after a daemon restart or a reap. Jobs accepted by the lost session
        will never complete: they are recorded as failed so that ``wait`` returns at once.
        """
        if not (isinstance(reply, Error) and reply.code == ErrorCode.NOT_REGISTERED):
            return None
        return self.lost_session()

    def lost_session(self) -> Hello | None:
        """Record the session's unfinished jobs as failed; the Hello that starts a new one."""
        if self._hello is None:
            return None
        for job_id in sorted(self.submitted):
            self.record(JobDone(job_id, False, [], 0, 0.0, SESSION_LOST))
        self.steps.clear()
        self.awaited.clear()
        self.answers.clear()
        self._hello = msgspec.structs.replace(self._hello, request_id=self.next_id())
        return self._hello

    def step_frames(self, jobs: Sequence[Store | Load]) -> list[tuple[int, bytes]]:
        """The StepJobs (request id, frame) carrying ``jobs`` (one unless larger than
        MAX_STEP_FRAME), their jobs booked as submitted and awaited (``step_unsent`` undoes
        a frame that could not be sent)."""
        message = StepJobs(self.next_id(), list(jobs))
        frame = encode(message)
        if len(frame) > MAX_STEP_FRAME and len(jobs) > 1:
            half = len(jobs) // 2
            return self.step_frames(jobs[:half]) + self.step_frames(jobs[half:])
        job_ids = [job.job_id for job in jobs]
        for job_id in job_ids:
            self.finished.pop(job_id, None)  # a reused id must not see the old result
            self.submitted.add(job_id)
        self.steps[message.request_id] = (time.monotonic(), job_ids)
        return [(message.request_id, frame)]

    def step_unsent(self, request_id: int) -> None:
        """Forget a StepJobs frame that was never sent (its jobs are not submitted)."""
        _, job_ids = self.steps.pop(request_id)
        self.submitted.difference_update(job_ids)

    def step_answered(self, reply: Ok | Error) -> None:
        """A StepJobs answer: Ok (its jobs' JobDone follow), or Error for all its jobs."""
        _, job_ids = self.steps.pop(reply.request_id)
        self.answered_at = time.monotonic()
        if isinstance(reply, Ok):
            return
        lost = reply.code == ErrorCode.NOT_REGISTERED
        self.session_lost = self.session_lost or lost
        for job_id in job_ids:
            if job_id in self.submitted:
                error = SESSION_LOST if lost else reply.message
                self.record(JobDone(job_id, False, [], 0, 0.0, error, int(reply.code)))

    @property
    def unanswered_since(self) -> float | None:
        """When the oldest StepJobs still unanswered was sent (None: all answered)."""
        return min((sent for sent, _ in self.steps.values()), default=None)

    def accepted(self, job_id: int) -> None:
        self.submitted.add(job_id)

    def record(self, done: JobDone) -> None:
        self.submitted.discard(done.job_id)
        self.finished[done.job_id] = done
        while len(self.finished) > _REMEMBERED_JOBS:
            self.finished.popitem(last=False)

    def ping(self, session: str = "") -> Ping:
        return Ping(self.next_id(), session)

    def decode(self, frame: bytes) -> Reply | None:
        """Decode a frame; record unasked messages; None for garbage (ignored)."""
        try:
            reply = decode_reply(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        self.heard_at = time.monotonic()
        request_id = getattr(reply, "request_id", None)
        if request_id in self.awaited:
            self.awaited.discard(request_id)
            self.answers.append(reply)
            return reply
        match reply:
            case JobDone():
                self.record(reply)
            case JobsDone():
                for done in reply.dones:
                    self.record(done)
            case Ok() | Error() if reply.request_id in self.steps:
                self.step_answered(reply)
            case Ok() if reply.request_id == self.late_ping:
                self.late_ping = None
                # Late, from a daemon that does not know the session (it restarted): the
                # next keepalive says Hello at once, not a keepalive interval later.
                self.session_lost = self.session_lost or reply.count == 0
            case EngineReady():
                self.engine = reply.engine
            case Welcome():
                self.welcome = reply
                self.engine = reply.engine
                self.session_lost = False
            case KeysChanged():
                self.notices.append(reply)
        return reply

    def take_notices(self) -> list[KeysChanged]:
        """Key-mirror changes received so far, oldest first; they are not returned again."""
        notices, self.notices = self.notices, []
        return notices

    def store(
        self,
        job_id: int,
        keys: Sequence[bytes],
        block_ids: Sequence[int],
        segments: Sequence[Segment],
        reserved: bool,
        wait_event: bytes,
        deadline: float = 0.0,
        reserve: tuple[str, int] = ("", 0),
    ) -> Store:
        return Store(
            self.next_id(),
            job_id,
            list(keys),
            list(block_ids),
            wait_event,
            list(segments),
            reserved,
            deadline,
            *reserve,
        )

    def load(
        self,
        job_id: int,
        keys: Sequence[bytes],
        block_ids: Sequence[int],
        skip: int,
        segments: Sequence[Segment],
        hold: str,
        wait_event: bytes,
    ) -> Load:
        return Load(
            self.next_id(),
            job_id,
            list(keys),
            list(block_ids),
            skip,
            wait_event,
            list(segments),
            hold,
        )

    def reserve(
        self,
        keys: Sequence[bytes],
        holds: Sequence[HoldKeys],
        release: Sequence[HoldKeys],
        ack: int,
        lookups: Sequence[Sequence[bytes]],
        *,
        posted: bool = False,
        touch: Sequence[bytes] = (),
    ) -> Reserve:
        """A Reserve with a ``Lookup`` per key run of ``lookups`` (numbered after it)."""
        request_id = self.next_id()
        return Reserve(
            request_id,
            list(keys),
            list(holds),
            ack,
            list(release),
            self.lookups(lookups),
            posted,
            list(touch),
        )

    def update_holds(
        self,
        hold: Sequence[HoldKeys],
        release: Sequence[HoldKeys],
        ack: int,
        lookups: Sequence[Sequence[bytes]],
        touch: Sequence[bytes] = (),
    ) -> UpdateHolds:
        """An UpdateHolds with its lookups, as ``reserve``."""
        request_id = self.next_id()
        return UpdateHolds(
            request_id, list(hold), list(release), ack, self.lookups(lookups), list(touch)
        )

    def posted(self, request: Reserve | UpdateHolds | Ping) -> list[int]:
        """Book ``request``'s reply (and its lookups') for ``take_answers``; their ids."""
        ids = [request.request_id]
        if not isinstance(request, Ping):
            ids += [lookup.request_id for lookup in request.lookups]
        self.awaited.update(ids)
        return ids

    def lookups(self, probes: Sequence[Sequence[bytes]]) -> list[Lookup]:
        return [Lookup(self.next_id(), list(keys)) for keys in probes]

    def take_answers(self) -> list[Reply]:
        """Replies to posted requests received so far, in arrival order; taken once."""
        answers, self.answers = self.answers, []
        return answers

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


@dataclass(frozen=True)
class CurveKeys:
    """CURVE keys (z85 bytes) for a tcp:// control endpoint: the daemon's public key and
    this client's key pair (whose public half is in the daemon's ``curve_clients_dir``)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, server_public_file: str, client_secret_file: str) -> CurveKeys:
        """From zmq.auth certificate files (``server.key``, ``client.key_secret``)."""
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(server_public_file)
        public, secret = zmq.auth.load_certificate(client_secret_file)
        if secret is None:
            raise ValueError(f"{client_secret_file} holds no secret key")
        return cls(server_public, public, secret)


def _configure_dealer(
    sock: zmq.Socket[bytes] | zmq.asyncio.Socket, identity: bytes, curve: CurveKeys | None
) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    if curve is not None:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
    # Never queue a request while the daemon is away: delivered late (after a restart) a
    # Store would copy GPU blocks the rank has reused since. Sends wait for a live pipe.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    # Tried every 100 ms while nobody listens, no backoff: a restarted daemon hears every
    # rank within 100 ms of its start (a node-local connect costs a syscall; a frozen
    # daemon's backlog keeps the connection, so it is not retried meanwhile).
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 0)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class OffloadClient:
    """Blocking client; not thread-safe (one per rank thread).

    A small background thread sends heartbeats on its own socket while the client is
    connected, so an idle rank is not reaped. If the daemon restarts, the next request
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
        self.endpoint = endpoint
        self.curve = curve
        self.timeout = timeout
        self.heartbeat = heartbeat
        self._core = _ClientCore()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        _configure_dealer(self._sock, self._core.identity, curve)
        self._sock.connect(endpoint)
        self._closed = False
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
            named = client._core.open_files(regions, files)
            hello = client._core.hello(
                config, named, role, device_uuid, name, events_topic, raw_hashes, mirror
            )
            client._core.expect(client._exchange(client._registered(hello), timeout), Welcome)
        except BaseException:
            client.close(goodbye=False)
            raise
        client._start_heartbeat()
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
    def welcome(self) -> Welcome | None:
        """The daemon's answer to this session's latest Hello (where its events are, too)."""
        return self._core.welcome

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
        self._submit(request)

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
        self._submit(self._core.load(job_id, keys, block_ids, skip, segments, hold, wait_event))

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
        request = Reserve(self._core.next_id(), list(keys), list(holds), ack, list(release))
        return self._core.expect(self._request(request), Reserved)

    def update_holds(
        self,
        hold: Sequence[HoldKeys] = (),
        release: Sequence[HoldKeys] = (),
        *,
        ack: int = 0,
    ) -> HoldResult:
        """(Scheduler) Hold and release committed keys per request token."""
        request = UpdateHolds(self._core.next_id(), list(hold), list(release), ack)
        return self._core.expect(self._request(request), HoldResult)

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

    def take_answers(self) -> list[Reply]:
        """Replies to posted requests received so far, in arrival order; taken once."""
        return self._core.take_answers()

    def keepalive(self, timeout: float) -> None:
        """Prove the session within ``timeout``; say Hello again if the daemon forgot it
        (it restarted). Raises DaemonUnavailable when nothing answers in time."""
        ping = self._core.ping()
        try:
            reply = self._exchange(ping, timeout)
        except DaemonUnavailable:
            self._core.late_ping = ping.request_id  # its answer may still come (``decode``)
            raise
        if isinstance(reply, Ok) and reply.count == 0:
            hello = self._core.lost_session()
            if hello is not None:
                self._core.expect(self._exchange(self._registered(hello), timeout), Welcome)

    def ack(self, seq: int) -> None:
        """(Scheduler) Acknowledge key changes up to ``seq``, without waiting for the reply."""
        self._post(Ack(self._core.next_id(), seq))

    def poll(self, timeout: float = 0.0) -> int:
        """Read every message that arrives within ``timeout`` (0: only those already here);
        JobDone and KeysChanged are recorded. Returns how many were read."""
        count, wait_ms = 0, int(timeout * 1000)
        while self._sock.poll(wait_ms):
            self._core.decode(self._sock.recv())
            count, wait_ms = count + 1, 0
        return count

    def take_notices(self) -> list[KeysChanged]:
        """(Scheduler) Key changes received since the last call, oldest first."""
        return self._core.take_notices()

    def _submit(self, request: Store | Load) -> None:
        self._core.finished.pop(request.job_id, None)  # a reused id must not see the old result
        self._core.expect(self._request(request), JobAccepted)
        self._core.accepted(request.job_id)

    def post_jobs(self, jobs: Sequence[Store | Load]) -> None:
        """Send a step's Stores and Loads as one StepJobs, without waiting for anything.

        Their ``JobDone`` (a refused job's too, its ``code`` set) arrive with ``poll`` or
        ``wait``; a StepJobs refused whole (the session lost: ``session_lost``) records each
        of its jobs failed. The jobs' ``request_id`` is not read. Raises DaemonUnavailable
        when no daemon is connected (nothing is sent then).
        """
        if self._closed:
            raise OffloaddError("client is closed")
        if not jobs:
            return
        frames = self._core.step_frames(jobs)
        for index, (_, frame) in enumerate(frames):
            try:
                self._send_frame(frame)
            except DaemonUnavailable:
                for request_id, _ in frames[index:]:
                    self._core.step_unsent(request_id)
                raise

    def can_send(self) -> bool:
        """Connected to a daemon: a send goes out now (sends wait for a live connection)."""
        return not self._closed and bool(self._sock.poll(0, zmq.POLLOUT))

    @property
    def session_lost(self) -> bool:
        """The daemon forgot this session: a StepJobs came back NOT_REGISTERED, or the late
        answer to a keepalive's ping that timed out said so (``keepalive`` says Hello again)."""
        return self._core.session_lost

    @property
    def answered_at(self) -> float:
        """``time.monotonic()`` of the latest StepJobs answer (0: none yet)."""
        return self._core.answered_at

    @property
    def heard_at(self) -> float:
        """``time.monotonic()`` of the latest message read from the daemon (0: none yet)."""
        return self._core.heard_at

    @property
    def unanswered_since(self) -> float | None:
        """When the oldest unanswered StepJobs was sent (None: none waits)."""
        return self._core.unanswered_since

    @property
    def sent(self) -> int:
        """Messages this client sent on its socket (its heartbeat thread's excepted)."""
        return self._core.sent

    def wait(
        self,
        job_ids: Sequence[int],
        timeout: float | None = None,
        *,
        raise_on_failure: bool = True,
    ) -> list[JobDone]:
        """Block until the jobs are done; JobError if one failed or time ran out."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        done, missing = self._core.take_finished(job_ids)
        while missing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._read_one(remaining)
            done, missing = self._core.take_finished(job_ids)
        self._core.check_jobs(done, missing, raise_on_failure)
        return done

    def release(self, keys: Sequence[bytes]) -> int:
        """Drop this session's pins on ``keys``."""
        reply = self._request(Release(self._core.next_id(), list(keys)))
        return self._core.expect(reply, Ok).count

    def clear(self) -> int:
        """Drop every chunk of this engine's namespace (a cache reset); returns how many."""
        return self._core.expect(self._request(Clear(self._core.next_id())), Ok).count

    def stats(self) -> DaemonStats:
        """The daemon's counters (works without Hello: then registers, so the engines listed
        are those this user may see)."""
        token = (
            b""
            if self._core.welcome is not None
            else self._core.registered(self.endpoint, self.timeout)
        )
        request = GetStats(self._core.next_id(), token)
        return self._core.expect(self._request(request), StatsResult).stats

    def list_cache(self) -> CacheListing:
        """What the cache holds per namespace and engine (``offloadd cache ls``); root and
        the daemon's user only (else ``NotPermitted``). Works without Hello, as ``stats``."""
        request = ListCache(self._core.next_id(), self._admin_token())
        return self._core.expect(self._request(request), CacheListing)

    def clear_cache(self, *, all: bool = False, namespace: str = "", engine_id: str = "") -> int:
        """Drop every chunk (``all``), a namespace's or an engine's (``protocol.messages.
        ClearCache``); returns how many. Who may: as ``list_cache``."""
        request = ClearCache(self._core.next_id(), self._admin_token(), all, namespace, engine_id)
        return self._core.expect(self._request(request), Ok).count

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
                self._exchange(Bye(self._core.next_id()), min(self.timeout, 1.0))
        self._closed = True
        self._sock.close(linger=0)
        self._ctx.term()
        self._core.close_files()

    def _registered(self, hello: Hello) -> Hello:
        """``hello`` with a fresh registration token."""
        token = self._core.registered(self.endpoint, self.timeout)
        return msgspec.structs.replace(hello, token=token, monotonic=time.monotonic())

    def _request(self, request: Request, timeout: float | None = None) -> Reply:
        """Send and wait for the reply; says Hello again once if the session was lost."""
        reply = self._exchange(request, timeout)
        hello = self._core.hello_again(reply)
        if hello is not None:
            self._core.expect(self._exchange(self._registered(hello), timeout), Welcome)
            reply = self._exchange(request, timeout)
        return reply

    def _exchange(self, request: Request, timeout: float | None = None) -> Reply:
        if self._closed:
            raise OffloaddError("client is closed")
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
                    raise DaemonUnavailable(f"cannot reach {self.endpoint}") from None
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
        if self._closed:
            raise OffloaddError("client is closed")
        self._send_frame(encode(request))

    def _post_awaited(self, request: Reserve | UpdateHolds | Ping) -> list[int]:
        self._post(request)  # raises before anything is booked
        return self._core.posted(request)

    def _send_frame(self, frame: bytes) -> None:
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            raise DaemonUnavailable(f"cannot reach {self.endpoint}") from None
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
        # Its own socket: zmq sockets must not be shared between threads.
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        _configure_dealer(sock, uuid.uuid4().bytes, self.curve)
        sock.connect(self.endpoint)
        try:
            while not self._stop_heartbeat.wait(self.heartbeat):
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(encode(Ping(0, session)), zmq.NOBLOCK)
                while sock.poll(0):  # replies only matter to the daemon's bookkeeping
                    sock.recv()
        finally:
            sock.close(linger=0)


def _expire(future: asyncio.Future[Reply]) -> None:
    """The timer of an exchange: no reply came in time."""
    if not future.done():
        future.set_exception(TimeoutError())


class AsyncOffloadClient:
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
        self.endpoint = endpoint
        self.curve = curve
        self.timeout = timeout
        self.heartbeat = heartbeat
        self._core = _ClientCore()
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket = self._ctx.socket(zmq.DEALER)
        _configure_dealer(self._sock, self._core.identity, curve)
        self._sock.connect(endpoint)
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read_loop())
        self._heartbeat: asyncio.Task[None] | None = None
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
            named = client._core.open_files(regions, files)
            hello = client._core.hello(
                config, named, role, device_uuid, name, events_topic, raw_hashes, mirror
            )
            client._core.expect(await client._exchange(await client._registered(hello)), Welcome)
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

    @property
    def engine(self) -> EngineState | None:
        """The engine as last reported by the daemon."""
        return self._core.engine

    @property
    def welcome(self) -> Welcome | None:
        """The daemon's answer to this session's latest Hello (where its events are, too)."""
        return self._core.welcome

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
        await self._submit(request)

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
        await self._submit(request)

    async def reserve(
        self,
        keys: Sequence[bytes],
        *,
        holds: Sequence[HoldKeys] = (),
        release: Sequence[HoldKeys] = (),
        ack: int = 0,
    ) -> Reserved:
        """(Scheduler) Reserve room for ``keys`` (see ``OffloadClient.reserve``)."""
        request = Reserve(self._core.next_id(), list(keys), list(holds), ack, list(release))
        return self._core.expect(await self._request(request), Reserved)

    async def update_holds(
        self,
        hold: Sequence[HoldKeys] = (),
        release: Sequence[HoldKeys] = (),
        *,
        ack: int = 0,
    ) -> HoldResult:
        """(Scheduler) Hold and release committed keys per request token."""
        request = UpdateHolds(self._core.next_id(), list(hold), list(release), ack)
        return self._core.expect(await self._request(request), HoldResult)

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

    def take_answers(self) -> list[Reply]:
        """Replies to posted requests the reader task received so far, in arrival order;
        taken once."""
        return self._core.take_answers()

    async def ack(self, seq: int) -> None:
        """(Scheduler) Acknowledge key changes up to ``seq``, without awaiting the reply (the
        reader task drops it); raises DaemonUnavailable as ``post_reserve``."""
        self._post(Ack(self._core.next_id(), seq))

    def take_notices(self) -> list[KeysChanged]:
        """(Scheduler) Key changes received since the last call, oldest first."""
        return self._core.take_notices()

    async def _submit(self, request: Store | Load) -> None:
        self._core.finished.pop(request.job_id, None)  # a reused id must not see the old result
        self._core.expect(await self._request(request), JobAccepted)
        self._core.accepted(request.job_id)

    async def post_jobs(self, jobs: Sequence[Store | Load]) -> None:
        """Send a step's Stores and Loads as one StepJobs (see ``OffloadClient.post_jobs``);
        waits only for the frames to be queued."""
        if self._closed:
            raise OffloaddError("client is closed")
        if not jobs:
            return
        frames = self._core.step_frames(jobs)
        for index, (_, frame) in enumerate(frames):
            try:
                async with asyncio.timeout(self.timeout):
                    await self._sock.send(frame)
            except TimeoutError:
                for request_id, _ in frames[index:]:
                    self._core.step_unsent(request_id)
                raise DaemonUnavailable(f"cannot reach {self.endpoint}") from None
            self._core.sent += 1

    async def wait(
        self,
        job_ids: Sequence[int],
        timeout: float | None = None,
        *,
        raise_on_failure: bool = True,
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
        """The daemon's counters (see ``OffloadClient.stats``)."""
        token = b""
        if self._core.welcome is None:
            token = await asyncio.to_thread(self._core.registered, self.endpoint, self.timeout)
        reply = await self._request(GetStats(self._core.next_id(), token))
        return self._core.expect(reply, StatsResult).stats

    async def list_cache(self) -> CacheListing:
        """See ``OffloadClient.list_cache``."""
        request = ListCache(self._core.next_id(), await self._admin_token())
        return self._core.expect(await self._request(request), CacheListing)

    async def clear_cache(
        self, *, all: bool = False, namespace: str = "", engine_id: str = ""
    ) -> int:
        """See ``OffloadClient.clear_cache``."""
        token = await self._admin_token()
        request = ClearCache(self._core.next_id(), token, all, namespace, engine_id)
        return self._core.expect(await self._request(request), Ok).count

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
                await self._exchange(Bye(self._core.next_id()), min(self.timeout, 1.0))
        self._closed = True
        self._reader.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._sock.close(linger=0)
        self._ctx.term()
        self._core.close_files()

    async def _registered(self, hello: Hello) -> Hello:
        """``hello`` with a fresh registration token (registering off the loop)."""
        token = await asyncio.to_thread(self._core.registered, self.endpoint, self.timeout)
        return msgspec.structs.replace(hello, token=token, monotonic=time.monotonic())

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            self._changed.clear()
            await self._changed.wait()

    async def _request(self, request: Request, timeout: float | None = None) -> Reply:
        """Send and wait for the reply; says Hello again once if the session was lost."""
        reply = await self._exchange(request, timeout)
        hello = self._core.hello_again(reply)
        if hello is not None:
            hello = await self._registered(hello)
            self._core.expect(await self._exchange(hello, timeout), Welcome)
            self._changed.set()  # jobs of the lost session were just marked failed
            reply = await self._exchange(request, timeout)
        return reply

    async def _exchange(self, request: Request, timeout: float | None = None) -> Reply:
        if self._closed:
            raise OffloaddError("client is closed")
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
        if self._closed:
            raise OffloaddError("client is closed")
        sent = cast("asyncio.Future[object]", self._sock.send(encode(request), zmq.DONTWAIT))
        if not sent.done():
            sent.cancel()  # queued behind a send that waits for room: it would wait too
        elif (error := sent.exception()) is None:
            self._core.sent += 1
            return
        elif not isinstance(error, zmq.Again):
            raise error
        raise DaemonUnavailable(f"cannot reach {self.endpoint}")

    def _post_awaited(self, request: Reserve | UpdateHolds | Ping) -> list[int]:
        # Booked right after the send, before the reader task can run and see the reply.
        self._post(request)
        return self._core.posted(request)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            if time.monotonic() - self._core.last_request < self.heartbeat:
                continue  # recent traffic already proves the session alive
            with contextlib.suppress(OffloaddError):
                reply = await self._exchange(self._core.ping(), self.heartbeat)
                unknown = isinstance(reply, Ok) and reply.count == 0
                hello = self._core.lost_session() if unknown else None
                if hello is not None:
                    # The daemon does not know us (it restarted): say Hello again now, so
                    # the engine is whole again before the next request.
                    hello = await self._registered(hello)
                    self._core.expect(await self._exchange(hello), Welcome)
                    self._changed.set()

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

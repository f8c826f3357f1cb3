"""The clients' shared core: everything ``OffloadClient`` and ``AsyncOffloadClient`` do
that is not moving frames.

``_ClientCore`` is I/O-free. It numbers requests and builds every message; it keeps the
record of accepted and finished jobs, of StepJobs not yet answered, of posted requests'
answers, of engine readiness and of key-mirror notices; and it maps Error replies to
exceptions. ``decode`` is its one entry for frames read from the daemon, whichever client
read them, and records what arrives unasked (``JobDone``, ``EngineReady``, ``KeysChanged``).

A request a client waits for is built as a ``Call``: the message, and ``answer``, what its
reply means (the value the client method returns, or the exception). A client method is
then only its transport: build the Call, send it and read the reply (blocking, or awaited),
hand the reply to ``answer``. ``ClientBase`` holds what both clients expose without I/O.
A core belongs to one client and is used from that client's thread (or loop) only.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

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


@dataclass(frozen=True, slots=True)
class Call(Generic[R]):
    """A request a client waits for, and what its reply means: ``answer(reply)`` is the
    value the client method returns, or raises the exception an Error reply names."""

    request: Request
    answer: Callable[[Reply], R]


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

    def first_hello(
        self,
        config: OffloadingConfig,
        regions: Sequence[KVRegion],
        files: Mapping[str, int] | None,
        role: Role,
        device_uuid: str,
        name: str,
        events_topic: str,
        raw_hashes: bool,
        mirror: bool,
    ) -> Hello:
        """A connecting client's Hello, its regions' files opened (``open_files``)."""
        named = self.open_files(regions, files)
        return self.hello(config, named, role, device_uuid, name, events_topic, raw_hashes, mirror)

    @staticmethod
    def with_token(hello: Hello, token: bytes) -> Hello:
        """``hello`` as sent now: with its registration token and the sender's clock."""
        return msgspec.structs.replace(hello, token=token, monotonic=time.monotonic())

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

    def forgotten(self, reply: Reply) -> Hello | None:
        """The Hello to say again when a keepalive ping's ``reply`` says the daemon no longer
        knows this session (Ok, count 0: it restarted), as ``lost_session``."""
        return self.lost_session() if isinstance(reply, Ok) and reply.count == 0 else None

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

    def steps_unsent(self, frames: Iterable[tuple[int, bytes]]) -> None:
        """Forget the ``step_frames`` that a failed send left unsent."""
        for request_id, _ in frames:
            self.step_unsent(request_id)

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

    def ack(self, seq: int) -> Ack:
        return Ack(self.next_id(), seq)

    def bye(self) -> Bye:
        return Bye(self.next_id())

    def lookup_call(self, keys: Sequence[bytes], pin: bool, lease: float) -> Call[LookupResult]:
        return Call(Lookup(self.next_id(), list(keys), pin, lease), self._answer(LookupResult))

    def submit_call(self, request: Store | Load) -> Call[None]:
        """A Store or Load waited for until accepted; its JobDone comes later."""
        self.finished.pop(request.job_id, None)  # a reused id must not see the old result

        def accepted(reply: Reply) -> None:
            self.expect(reply, JobAccepted)
            self.accepted(request.job_id)

        return Call(request, accepted)

    def reserve_call(
        self,
        keys: Sequence[bytes],
        holds: Sequence[HoldKeys],
        release: Sequence[HoldKeys],
        ack: int,
    ) -> Call[Reserved]:
        return Call(self.reserve(keys, holds, release, ack, ()), self._answer(Reserved))

    def update_holds_call(
        self, hold: Sequence[HoldKeys], release: Sequence[HoldKeys], ack: int
    ) -> Call[HoldResult]:
        return Call(self.update_holds(hold, release, ack, ()), self._answer(HoldResult))

    def release_call(self, keys: Sequence[bytes]) -> Call[int]:
        return Call(Release(self.next_id(), list(keys)), self._count)

    def clear_call(self) -> Call[int]:
        return Call(Clear(self.next_id()), self._count)

    def stats_call(self, token: bytes) -> Call[DaemonStats]:
        """``token``: a registration's, when the client has no session (b"" otherwise)."""
        return Call(GetStats(self.next_id(), token), self._stats)

    def list_cache_call(self, token: bytes) -> Call[CacheListing]:
        """``offloadd cache ls``; ``token`` as in ``stats_call``."""
        return Call(ListCache(self.next_id(), token), self._answer(CacheListing))

    def clear_cache_call(
        self, token: bytes, *, all: bool, namespace: str, engine_id: str
    ) -> Call[int]:
        """``offloadd cache clear``; ``token`` as in ``stats_call``."""
        return Call(ClearCache(self.next_id(), token, all, namespace, engine_id), self._count)

    def _answer(self, kind: type[R]) -> Callable[[Reply], R]:
        return lambda reply: self.expect(reply, kind)

    def _count(self, reply: Reply) -> int:
        return self.expect(reply, Ok).count

    def _stats(self, reply: Reply) -> DaemonStats:
        return self.expect(reply, StatsResult).stats

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

    def all_finished(self, job_ids: Iterable[int]) -> bool:
        return all(job_id in self.finished for job_id in job_ids)

    def jobs_done(self, job_ids: Iterable[int], raise_on_failure: bool) -> list[JobDone]:
        """The results of ``job_ids`` once waited for; JobError if one is missing (time ran
        out) or, with ``raise_on_failure``, failed."""
        done, missing = self.take_finished(job_ids)
        self.check_jobs(done, missing, raise_on_failure)
        return done

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


def configure_dealer(
    sock: zmq.Socket[bytes] | zmq.asyncio.Socket, identity: bytes, curve: CurveKeys | None
) -> None:
    """Set up a client's DEALER (either client's, or a heartbeat's) before it connects."""
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


class ClientBase:
    """What ``OffloadClient`` and ``AsyncOffloadClient`` expose without I/O: their settings,
    and views of the core's records."""

    def __init__(
        self, endpoint: str, timeout: float, heartbeat: float, curve: CurveKeys | None
    ) -> None:
        self.endpoint = endpoint
        self.curve = curve
        self.timeout = timeout
        self.heartbeat = heartbeat
        self._core = _ClientCore()
        self._closed = False

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

    @property
    def session_lost(self) -> bool:
        """The daemon forgot this session: a StepJobs came back NOT_REGISTERED, or the late
        answer to a ping that timed out said so (the next request or ``keepalive`` says
        Hello again)."""
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
        """Messages this client sent on its socket (a heartbeat of its own excepted)."""
        return self._core.sent

    def take_answers(self) -> list[Reply]:
        """Replies to posted requests received so far, in arrival order; taken once."""
        return self._core.take_answers()

    def take_notices(self) -> list[KeysChanged]:
        """(Scheduler) Key changes received since the last call, oldest first."""
        return self._core.take_notices()

    def _check_open(self) -> None:
        if self._closed:
            raise OffloaddError("client is closed")

    def _unreachable(self) -> DaemonUnavailable:
        return DaemonUnavailable(f"cannot reach {self.endpoint}")

    def _post(self, request: Request) -> None:
        """Queue ``request`` now without waiting for its reply; DaemonUnavailable when it
        cannot be (nothing is sent then). The transport's."""
        raise NotImplementedError

    def _post_awaited(self, request: Reserve | UpdateHolds | Ping) -> list[int]:
        # Booked right after the send: before anything reads the socket and sees the reply.
        self._post(request)  # raises before anything is booked
        return self._core.posted(request)

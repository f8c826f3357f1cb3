"""The daemon's composition root: control socket, registry, cache, copies, lifecycle.

Everything runs on one asyncio loop (uvloop when available) except byte copies, which the
copy engine runs on its own threads. Each request is handled to completion without awaiting,
so handlers never interleave; a store or load replies ``JobAccepted`` at once and its
``JobDone`` is sent when the copy engine's future resolves. One exception: a cuda daemon
imports a Hello's CUDA IPC handles (and closes imports) on an import thread, since each
import blocks; that peer's later requests are held (``offloadd.gate``) until its Hello is
answered, so every peer still sees its requests handled in order. Any request that fails
validation, and any bug inside a handler, is answered with an ``Error`` and the daemon goes
on serving everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import msgspec
import zmq
import zmq.asyncio

from offloadd.attribution import in_batches, removed_events, stored_events
from offloadd.cache.arena import Arena
from offloadd.cache.index import ChunkCache, Entry, LoadReservation, ShardWrite
from offloadd.cache.journal import Journal, discard
from offloadd.endpoint import EndpointClaim, check_tcp_security, ipc_path, restrict_socket
from offloadd.events import PublisherSet, topic_for
from offloadd.gate import RequestGate
from offloadd.metrics import Metrics
from offloadd.mirrors import Mirrors
from offloadd.registry import (
    Engine,
    Namespace,
    RegistrationError,
    Registry,
    Session,
    group_of_key,
)
from offloadd.safety import engine_id_problem, printable
from offloadd.settings import Settings
from offloadd.systemd import Notifier
from offloadd.transfer.copies import Copies
from offloadd.transfer.engine import CopyEngine, CpuCopyEngine, Direction, Triple
from offloadd.transfer.handles import HandleError, HandleTable, Import
from offloadd.transfer.pinning import DEFAULT_PIECE as PIN_PIECE
from offloadd.transfer.plan import (
    Span,
    block_id_problem,
    chunk_copies,
    chunk_ranges,
    group_spans,
)
from protocol import PROTOCOL_VERSION
from protocol.errors import ErrorCode
from protocol.events import AllBlocksCleared, KVEvent, KVEventBatch
from protocol.handles import CudaIpcHandle
from protocol.messages import (
    Ack,
    Bye,
    Clear,
    DaemonStats,
    EngineReady,
    Error,
    GetStats,
    Hello,
    HoldKeys,
    HoldResult,
    JobAccepted,
    JobDone,
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
    Segment,
    StatsResult,
    Store,
    UpdateHolds,
    Wait,
    WaitResult,
    Welcome,
    decode_request,
    encode,
    peek_request_id,
)

if TYPE_CHECKING:
    from zmq.auth.asyncio import AsyncioAuthenticator

logger = logging.getLogger(__name__)

_MAX_KEYS_PER_REQUEST = 1 << 16
_YIELD_EVERY = 32  # requests handled back to back before the loop runs other callbacks


class _Refused(Exception):
    """A request that gets an Error reply; raised inside handlers."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class _Job:
    job_id: int
    state: _SessionState
    direction: Direction
    keys: list[bytes]
    failed_keys: list[bytes]
    nbytes: int
    writes: list[ShardWrite] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    abandoned: bool = False


@dataclass(eq=False)
class _Waiter:
    request_id: int
    job_ids: list[int]
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _SessionState:
    """The daemon's runtime view of one registry session."""

    identity: bytes
    session: Session
    imports: list[Import]
    jobs: dict[int, _Job] = field(default_factory=dict)
    done: OrderedDict[int, JobDone] = field(default_factory=OrderedDict)
    waiters: list[_Waiter] = field(default_factory=list)
    alive: bool = True
    last_seen: float = field(default_factory=time.monotonic)
    spans: dict[int, tuple[Span, ...]] = field(default_factory=dict)  # by group, built lazily
    pidfd: int | None = None  # watched with the loop: readable once the process exited


@dataclass
class _Counters:
    protocol_errors: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    jobs_failed: int = 0


class Daemon:
    """One offloadd instance. Use ``async with Daemon(settings) as d: await d.serve(stop)``."""

    def __init__(
        self,
        settings: Settings,
        *,
        copy_engine: CopyEngine | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.settings = settings
        self._notify = notifier or Notifier()
        self.endpoint = settings.endpoint()
        self._copy = copy_engine
        self._claim: EndpointClaim | None = None
        self._arena: Arena | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._handles: HandleTable | None = None
        # cuda only: CUDA IPC imports and closes run here, off the loop (see _hello).
        self._importer: ThreadPoolExecutor | None = None
        self._gate = RequestGate()
        self._cache: ChunkCache | None = None
        self._mirrors: Mirrors | None = None
        self._journal: Journal | None = None
        self._events: PublisherSet | None = None
        self._auth: AsyncioAuthenticator | None = None  # CURVE authentication, when used
        self.registry = Registry()
        self._states: dict[str, _SessionState] = {}
        self._jobs_in_flight = 0
        self._idle = asyncio.Event()
        self._draining = False
        self._started = time.monotonic()
        self.counters = _Counters()
        self.metrics = Metrics(self.stats, pending_jobs=lambda: self._jobs_in_flight)

    # ----------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Daemon:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Claim the endpoint, create the arena, bind the sockets. Ready when it returns."""
        settings = self.settings
        check_tcp_security(
            self.endpoint, settings.server.curve_secret_key_file, settings.server.curve_clients_dir
        )
        self._claim = EndpointClaim(self.endpoint)
        cuda = settings.server.copy_engine == "cuda"
        try:
            self._notify.status("preparing the arena")
            self._arena = Arena(
                settings.arena_path(),
                settings.cache.capacity,
                progress=self._prefault_progress,
                unlink_on_close=not settings.cache.persist,
                pin=self._pin_arena if cuda else None,
            )
            self._cache = ChunkCache(
                settings.cache.capacity,
                policy=settings.cache.policy,
                # One DMA may not span two of the arena's cudaHostRegister pieces.
                boundary=PIN_PIECE if cuda else 0,
            )
            self._mirrors = Mirrors(self._cache, self.registry, self._send_to_session)
            if settings.cache.persist:
                self._restore()
            else:
                with contextlib.suppress(OSError):  # it names chunks of an arena not kept
                    discard(settings.journal_path())
            opener = None
            if cuda:
                from offloadd.cuda_ipc import CudaIpcOpener

                opener = CudaIpcOpener()
                self._importer = ThreadPoolExecutor(1, thread_name_prefix="offloadd-ipc")
            self._handles = HandleTable(
                settings.server.shm_dirs,
                forbidden=[self._arena.path],
                cuda=opener,
                closer=self._close_import if cuda else None,
            )
            if self._copy is None:
                if cuda:
                    from offloadd.transfer.batch import HostPieces
                    from offloadd.transfer.cuda import make_engine

                    pieces = HostPieces(self._arena.address, PIN_PIECE)
                    self._copy = make_engine(host_pieces=pieces)
                else:
                    self._copy = CpuCopyEngine()
            self._ctx = zmq.asyncio.Context()
            self._sock = self._bind_control(self._ctx)
            if settings.events.enabled:
                self._events = PublisherSet(
                    settings.events,
                    self._ctx,
                    socket_mode=settings.server.socket_mode,
                    socket_group=settings.server.socket_group,
                )
                self._events.start()
            if settings.metrics.address:
                self.metrics.start(
                    settings.metrics.address,
                    socket_mode=settings.server.socket_mode,
                    socket_group=settings.server.socket_group,
                )
        except BaseException:
            await self._close_events()
            self._release_resources()
            raise
        path = self._copy_path()
        if not all(path.values()):
            logger.error(
                "copy path DEGRADED: %s; see the warnings above (offloadd status shows it too)",
                ", ".join(f"not {feature}" for feature, ok in path.items() if not ok),
            )
        self._notify.ready(f"serving on {self.endpoint}; no engines yet")
        logger.info(
            "offloadd serving on %s (arena %s, %d MiB, %s eviction, %s copies)",
            self.endpoint,
            self._arena.path,
            settings.cache.capacity >> 20,
            settings.cache.policy,
            self._copy.name,
        )

    def _bind_control(self, ctx: zmq.asyncio.Context) -> zmq.asyncio.Socket:
        server = self.settings.server
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # Hard cap far above any sane request; oversized-but-plausible frames get an Error.
            sock.setsockopt(zmq.MAXMSGSIZE, server.max_frame_bytes * 4)
            if server.curve_secret_key_file:
                self._start_curve(ctx, sock)
            path = ipc_path(self.endpoint)
            # Created with no access for others from the first instant, then set as configured.
            previous = os.umask(0o177) if path else None
            try:
                sock.bind(self.endpoint)
            finally:
                if previous is not None:
                    os.umask(previous)
            if path:
                restrict_socket(path, server.socket_mode, server.socket_group)
        except BaseException:
            # Not ours to keep: an open socket would hold the context's term() forever.
            sock.close(linger=0)
            raise
        return sock

    def _start_curve(self, ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket) -> None:
        import zmq.auth
        from zmq.auth.asyncio import AsyncioAuthenticator

        server = self.settings.server
        public, secret = zmq.auth.load_certificate(server.curve_secret_key_file)
        if secret is None:
            raise ValueError(f"{server.curve_secret_key_file} holds no secret key")
        self._auth = AsyncioAuthenticator(ctx)
        self._auth.start()
        if server.curve_clients_dir:
            self._auth.configure_curve(domain="*", location=server.curve_clients_dir)
        else:
            logger.warning("CURVE without server.curve_clients_dir: any client key is accepted")
            self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def _pin_arena(self, address: int, size: int) -> object:
        from offloadd.transfer.pinning import register_host_memory

        def progress(fraction: float) -> None:
            self._notify.status(f"registering the arena as pinned memory: {fraction:.0%}")
            self._notify.extend_timeout(60)

        return register_host_memory(address, size, piece=PIN_PIECE, progress=progress)

    def _restore(self) -> None:
        """Find the chunks a previous daemon committed in this arena (warm restart)."""
        arena, cache = self._require_arena(), self._require_cache()

        def progress(fraction: float) -> None:
            self._notify.status(f"verifying the chunks of the previous run: {fraction:.0%}")
            self._notify.extend_timeout(30)

        journal, chunks = Journal.open(
            self.settings.journal_path(),
            arena,
            shm_dirs=self.settings.server.shm_dirs,
            progress=progress,
        )
        self._journal = journal
        kept = cache.restore(chunks)  # checksums verified: only their bounds are left to check
        if kept != len(chunks):
            logger.warning("journal: %d damaged chunk records skipped", len(chunks) - kept)
        # Always: the file must name exactly what the cache holds before extents get reused.
        journal.compact(cache.committed_chunks())
        if kept:
            logger.info("warm start: %d committed chunks from the previous run", kept)

    async def serve(self, shutdown: asyncio.Event) -> None:
        """Answer requests until ``shutdown`` is set, then drain in-flight copies."""
        receiver = asyncio.create_task(self._receive_loop())
        stopper = asyncio.create_task(shutdown.wait())
        background = [receiver, stopper, asyncio.create_task(self._reap_silent_sessions())]
        if self._notify.watchdog_seconds:
            background.append(asyncio.create_task(self._watchdog(self._notify.watchdog_seconds)))
        try:
            done, _ = await asyncio.wait({receiver, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if receiver in done:
                receiver.result()  # a crash of the receive loop is a bug: surface it
            self._draining = True
            self._notify.stopping(f"draining {self._jobs_in_flight} jobs")
            logger.info("stopping: no new jobs, draining copies in flight")
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _watchdog(self, interval: float) -> None:
        # Pinged from the event loop itself, so a wedged loop stops the pings and systemd
        # restarts the daemon.
        while True:
            self._notify.watchdog()
            await asyncio.sleep(interval / 2)

    def _prefault_progress(self, fraction: float) -> None:
        self._notify.status(f"pre-faulting the arena: {fraction:.0%}")
        self._notify.extend_timeout(30)

    def _report_status(self) -> None:
        engines = self.registry.engines()
        ready = sum(engine.ready for engine in engines)
        self._notify.status(
            f"serving on {self.endpoint}; {len(engines)} engines ({ready} ready), "
            f"{len(self._states)} sessions"
        )

    async def _drain(self) -> None:
        if self._jobs_in_flight == 0:
            return
        grace = self.settings.server.drain_seconds
        logger.info("draining %d in-flight jobs (up to %.0fs)", self._jobs_in_flight, grace)
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            logger.warning("%d jobs still in flight after %.0fs", self._jobs_in_flight, grace)

    async def close(self) -> None:
        """Publish the last events, then release everything; idempotent."""
        for state in list(self._states.values()):
            self._unwatch_process(state)
        await self._close_events()
        self._release_resources()

    async def _close_events(self) -> None:
        if self._events is not None:
            events, self._events = self._events, None
            await events.close()

    def _release_resources(self) -> None:
        self.metrics.close()
        if self._copy is not None:
            self._copy.close()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._importer is not None:
            self._importer.shutdown(wait=True)  # imports in progress finish first
        if self._handles is not None:
            self._handles.close()
            self._handles = None
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        if self._claim is not None:
            self._claim.release()
            self._claim = None
        self._notify.close()

    # ----------------------------------------------------------------- socket

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        handled = 0
        while True:
            frames = await sock.recv_multipart()
            handled += 1
            if handled % _YIELD_EVERY == 0:
                # pyzmq completes a recv without yielding while frames are queued: under a
                # flood, let copy completions, events and timers run in between.
                await asyncio.sleep(0)
            identity = frames[0]
            if not self._gate.hold(identity, frames[1:]):
                self._handle_frames(identity, frames[1:])

    def _handle_frames(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            self._on_frames(identity, frames)
        except Exception:
            # A bug must not take the daemon down; the peer still gets an answer.
            logger.exception("internal error while handling a request")
            request_id = peek_request_id(frames[-1]) if frames else 0
            self.metrics.protocol_error(ErrorCode.INTERNAL.name)
            self._send(
                identity,
                Error(request_id, ErrorCode.INTERNAL, "internal error; see daemon log"),
            )

    def _send(self, identity: bytes, message: Reply) -> None:
        """Send without ever blocking the loop: a peer that is gone or not reading loses it."""
        if self._sock is None:
            return
        # With DONTWAIT pyzmq tries the send at once and hands back a finished future.
        future = cast(
            "asyncio.Future[object]",
            self._sock.send_multipart([identity, encode(message)], flags=zmq.DONTWAIT),
        )
        if future.done() and future.exception() is not None:
            logger.debug("dropped a reply to a peer that is gone or not reading")

    def _on_frames(self, identity: bytes, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self._protocol_error(identity, 0, ErrorCode.MALFORMED, "expected exactly one frame")
            return
        frame = frames[0]
        if len(frame) > self.settings.server.max_frame_bytes:
            self._protocol_error(
                identity,
                0,
                ErrorCode.TOO_LARGE,
                f"frame of {len(frame)} bytes exceeds {self.settings.server.max_frame_bytes}",
            )
            return
        try:
            request = decode_request(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._protocol_error(identity, peek_request_id(frame), ErrorCode.MALFORMED, str(exc))
            return
        try:
            reply = self._dispatch(identity, request)
        except _Refused as refused:
            self._protocol_error(identity, request.request_id, refused.code, str(refused))
            return
        if reply is not None:
            self._send(identity, reply)

    def _protocol_error(
        self, identity: bytes, request_id: int, code: ErrorCode, message: str
    ) -> None:
        self.counters.protocol_errors += 1
        self.metrics.protocol_error(code.name)
        logger.debug("refused request %d: %s %s", request_id, code.name, printable(message))
        self._send(identity, Error(request_id, code, message))

    # ----------------------------------------------------------------- dispatch

    def _dispatch(self, identity: bytes, request: Request) -> Reply | None:
        if isinstance(request, Hello):
            return self._hello(identity, request)
        if isinstance(request, GetStats):
            return StatsResult(request.request_id, self.stats())
        state = self._states.get(identity.hex())
        if isinstance(request, Ping):
            vouched = self._states.get(request.session) if request.session else state
            if vouched is not None:
                vouched.last_seen = time.monotonic()
            return Ok(request.request_id, int(vouched is not None))
        if state is None:
            raise _Refused(ErrorCode.NOT_REGISTERED, "say Hello first")
        state.last_seen = time.monotonic()
        match request:
            case Lookup():
                return self._lookup(state, request)
            case Store():
                return self._store(state, request)
            case Load():
                return self._load(state, request)
            case Release():
                _engine, namespace = self._ready_engine(state)
                cache = self._require_cache()
                count = cache.release(namespace.name, request.keys, state.session.session_id)
                return Ok(request.request_id, count)
            case Wait():
                return self._wait(state, request)
            case Clear():
                return self._clear(state, request)
            case Reserve():
                return self._reserve(state, request)
            case UpdateHolds():
                return self._update_holds(state, request)
            case Ack():
                self._require_cache().ack(state.session.session_id, request.seq)
                return Ok(request.request_id)
            case Bye():
                self._end_session(state, "said goodbye")
                return Ok(request.request_id)
        raise _Refused(ErrorCode.MALFORMED, f"unexpected message {type(request).__name__}")

    # ----------------------------------------------------------------- hello

    def _hello(self, identity: bytes, hello: Hello) -> Reply | None:
        if hello.protocol_version != PROTOCOL_VERSION:
            raise _Refused(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol_version {hello.protocol_version} is not {PROTOCOL_VERSION}",
            )
        if self._draining:
            raise _Refused(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        problem = engine_id_problem(hello.config.engine_id)  # it names logs, labels, topics
        if problem:
            raise _Refused(ErrorCode.BAD_REQUEST, problem)
        if self._importer is not None and hello.regions:
            # CUDA imports block (open, wait for the producer's event): run them on the
            # import thread and hold this peer's later requests until the Hello is done.
            loop = asyncio.get_running_loop()

            def imported(future: Future[list[Import]]) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nothing to answer
                    loop.call_soon_threadsafe(self._hello_imported, identity, hello, future)

            self._importer.submit(self._open_regions, hello).add_done_callback(imported)
            self._gate.close(identity)  # before _hello_imported can run: it runs on this loop
            return None
        return self._register(identity, hello, self._open_regions(hello))

    def _hello_imported(self, identity: bytes, hello: Hello, future: Future[list[Import]]) -> None:
        """Finish a Hello whose regions were imported off the loop, then its held requests."""
        try:
            if self._handles is None:
                return  # closed meanwhile; the table's close unmapped everything
            try:
                reply = self._register(identity, hello, future.result())
            except _Refused as refused:
                self._protocol_error(identity, hello.request_id, refused.code, str(refused))
            except Exception:
                logger.exception("internal error while handling a Hello")
                self.metrics.protocol_error(ErrorCode.INTERNAL.name)
                self._send(
                    identity,
                    Error(hello.request_id, ErrorCode.INTERNAL, "internal error; see daemon log"),
                )
            else:
                if reply is not None:
                    self._send(identity, reply)
        finally:
            self._gate.open(identity)
            while (frames := self._gate.next(identity)) is not None:
                if self._sock is not None:  # else the daemon is closing: nobody to answer
                    self._handle_frames(identity, frames)

    def _close_import(self, close: Callable[[], None]) -> None:
        """Run a CUDA import's close (it syncs a stream) on the import thread."""

        def run() -> None:
            try:
                close()
            except Exception:
                logger.exception("closing a CUDA IPC import failed")

        try:
            assert self._importer is not None
            self._importer.submit(run)
        except RuntimeError:  # shut down: the daemon is exiting, close here
            run()

    def _register(self, identity: bytes, hello: Hello, imports: list[Import]) -> Reply | None:
        """The rest of a Hello once its regions are imported: register, answer Welcome."""
        session_id = identity.hex()
        try:
            outcome = self.registry.hello(session_id, hello)
        except RegistrationError as exc:
            self._release_imports(imports)
            raise _Refused(exc.code, str(exc)) from None
        except BaseException:
            self._release_imports(imports)  # a bug below must not leak the mappings
            raise
        for old in outcome.replaced:
            old_state = self._states.get(old.session_id)
            if old_state is not None:
                self._drop_state(old_state, "replaced by a new Hello")
        state = _SessionState(identity, outcome.session, imports)
        self._states[session_id] = state
        self._watch_process(state, hello)
        engine = outcome.engine
        logger.info(
            "%s connected (pid %d, %d regions, client %r, events topic %r); engine %s",
            outcome.session.describe(),
            hello.pid,
            len(hello.regions),
            hello.client_name,  # %r: a client's string never forges or splits a log line
            hello.kv_events_topic,
            "ready" if engine.ready else f"waiting for ranks {engine.missing_ranks()}",
        )
        dp = hello.config.parallel.data_parallel_index
        events = self._events.endpoints_for(dp) if self._events is not None else ("", "")
        self._send(
            identity,
            Welcome(hello.request_id, PROTOCOL_VERSION, session_id, engine.state(), *events),
        )
        if outcome.became_ready:
            self._engine_became_ready(engine)
        else:
            self._require_mirrors().start(outcome.session)
        self._report_status()
        return None

    def _watch_process(self, state: _SessionState, hello: Hello) -> None:
        """Reap the session the moment its process exits, when its pid is ours to watch."""
        if hello.pid <= 0 or hello.pid_namespace != _own_pid_namespace():
            return
        try:
            pidfd = os.pidfd_open(hello.pid)
        except (OSError, OverflowError):
            # Gone, not visible, or no pid at all (above a C int): heartbeats cover it.
            return
        state.pidfd = pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._process_exited, state)

    def _process_exited(self, state: _SessionState) -> None:
        if state.alive:
            self._end_session(state, "its process exited")

    def _unwatch_process(self, state: _SessionState) -> None:
        if state.pidfd is not None:
            asyncio.get_running_loop().remove_reader(state.pidfd)
            os.close(state.pidfd)
            state.pidfd = None

    async def _reap_silent_sessions(self) -> None:
        """End sessions that neither a pidfd watches nor a heartbeat keeps alive."""
        timeout = self.settings.server.session_timeout
        while True:
            await asyncio.sleep(max(0.05, timeout / 4))
            deadline = time.monotonic() - timeout
            for state in list(self._states.values()):
                if state.pidfd is None and state.last_seen < deadline and state.alive:
                    self._end_session(state, f"silent for {timeout:.0f}s")

    def _open_regions(self, hello: Hello) -> list[Import]:
        handles = self._require_handles()
        # Each engine moves one kind of memory: refuse the other kind here, not per job.
        cuda = self.settings.server.copy_engine == "cuda"
        for index, region in enumerate(hello.regions):
            if isinstance(region.handle, CudaIpcHandle) != cuda:
                raise _Refused(ErrorCode.HANDLE_OPEN_FAILED, _wrong_memory(index, cuda=cuda))
        imports: list[Import] = []
        for index, region in enumerate(hello.regions):
            try:
                imports.append(handles.open(region.handle))
            except HandleError as exc:
                self._release_imports(imports)
                raise _Refused(ErrorCode.HANDLE_OPEN_FAILED, f"region {index}: {exc}") from None
        # One rank, one GPU: a job's copies run on that device's streams.
        if len({imported.device for imported in imports}) > 1:
            self._release_imports(imports)
            raise _Refused(ErrorCode.BAD_GEOMETRY, "a rank's regions must all be on one device")
        return imports

    def _release_imports(self, imports: Sequence[Import]) -> None:
        if self._handles is None:
            return
        for imported in imports:
            self._handles.release(imported)

    def _engine_became_ready(self, engine: Engine) -> None:
        assert engine.namespace is not None
        logger.info(
            "engine %s dp %d ready: %d ranks, namespace %s",
            engine.key[0],
            engine.key[1],
            engine.world_size,
            engine.namespace.name,
        )
        # Routers learn at once what this node already holds for the engine.
        snapshot = self._require_cache().keys_in(engine.namespace.name)
        if snapshot:
            self._publish_to(engine, stored_events(snapshot, raw_hashes=self._raw_hashes(engine)))
        message = EngineReady(engine.state())
        for session in engine.sessions():
            state = self._states.get(session.session_id)
            if state is not None:
                self._send(state.identity, message)
        for session in engine.schedulers.values():
            self._require_mirrors().start(session)

    def _end_session(self, state: _SessionState, reason: str) -> None:
        outcome = self.registry.remove(state.session.session_id)
        self._drop_state(state, reason)
        self._report_status()
        if outcome is not None and outcome.was_ready and not outcome.engine.ready:
            # Its mirrors would go stale: they are sent a new snapshot when it is ready again.
            self._require_mirrors().stop_engine(list(outcome.engine.schedulers.values()))
        if outcome is not None and outcome.was_ready and not outcome.engine_dropped:
            logger.info(
                "engine %s dp %d waiting for ranks %s",
                outcome.engine.key[0],
                outcome.engine.key[1],
                outcome.engine.missing_ranks(),
            )

    def _drop_state(self, state: _SessionState, reason: str) -> None:
        """Fail the session's jobs so nothing half-written becomes visible; free its pins."""
        if not state.alive:
            return
        state.alive = False
        self._unwatch_process(state)
        if self._states.get(state.session.session_id) is state:
            del self._states[state.session.session_id]
        cache = self._require_cache()
        for job in state.jobs.values():
            job.abandoned = True
            if job.direction is Direction.STORE:
                cache.abandon(job.writes)
        session_id = state.session.session_id
        cache.release_owner(session_id)
        self._require_mirrors().stop(session_id)
        cache.release_holds(session_id)
        cache.release_reservations(session_id)
        for waiter in state.waiters:
            if waiter.timer is not None:
                waiter.timer.cancel()
            # Every request is answered: a peer that said Hello again (or Bye) on this socket
            # still gets its Wait's reply, the abandoned jobs listed as pending.
            self._send(state.identity, self._wait_result(state, waiter))
        state.waiters.clear()
        self._release_imports(state.imports)  # in-flight jobs hold their own references
        state.imports = []
        logger.info(
            "%s left (%s); %d jobs abandoned", state.session.describe(), reason, len(state.jobs)
        )

    # ----------------------------------------------------------------- requests

    def _ready_engine(self, state: _SessionState) -> tuple[Engine, Namespace]:
        engine = self.registry.engine(state.session.engine_key)
        if engine is None or engine.namespace is None:
            missing = engine.missing_ranks() if engine else []
            raise _Refused(ErrorCode.ENGINE_NOT_READY, f"engine waits for ranks {missing}")
        return engine, engine.namespace

    def _check_keys(self, keys: list[bytes], engine: Engine) -> None:
        if len(keys) > _MAX_KEYS_PER_REQUEST:
            raise _Refused(ErrorCode.TOO_LARGE, f"more than {_MAX_KEYS_PER_REQUEST} keys")
        groups = engine.group_positions
        for key in keys:
            if len(key) < 5:
                raise _Refused(
                    ErrorCode.BAD_REQUEST, f"key {key.hex()} is shorter than hash + 4-byte group"
                )
            group = group_of_key(key)
            if group not in groups:
                raise _Refused(
                    ErrorCode.BAD_REQUEST,
                    f"key {key.hex()} names group {group}, the engine has groups {sorted(groups)}",
                )

    def _lookup(self, state: _SessionState, request: Lookup) -> Reply:
        started = time.perf_counter()
        engine, namespace = self._ready_engine(state)
        self._check_keys(request.keys, engine)
        lease = request.lease_seconds or self.settings.cache.pin_lease_seconds
        outcome = self._require_cache().lookup(
            namespace.name,
            request.keys,
            pin_owner=state.session.session_id if request.pin else None,
            lease=lease if request.pin else 0.0,
        )
        self.metrics.lookup_finished(time.perf_counter() - started)
        return LookupResult(request.request_id, outcome.hits, outcome.pending, outcome.pinned)

    def _worker_job_checks(
        self, state: _SessionState, job_id: int, keys: list[bytes]
    ) -> tuple[Engine, Namespace]:
        if self._draining:
            raise _Refused(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        if state.session.role != "worker":
            raise _Refused(ErrorCode.WRONG_ROLE, "only worker ranks store and load")
        engine, namespace = self._ready_engine(state)
        if job_id in state.jobs:
            raise _Refused(ErrorCode.DUPLICATE_JOB, f"job {job_id} is still running")
        self._check_keys(keys, engine)
        state.done.pop(job_id, None)  # a reused id: Wait must report the new job, not the old
        return engine, namespace

    def _store(self, state: _SessionState, request: Store) -> Reply | None:
        _engine, namespace = self._worker_job_checks(state, request.job_id, request.keys)
        bpc = namespace.blocks_per_chunk
        if not request.segments and len(request.block_ids) != len(request.keys) * bpc:
            raise _Refused(
                ErrorCode.BAD_REQUEST,
                f"{len(request.keys)} keys need {len(request.keys) * bpc} block ids "
                f"({bpc} per chunk), got {len(request.block_ids)}",
            )
        ranges = self._chunk_ranges(request.keys, request.block_ids, bpc, request.segments)
        self._check_block_ids(state, request.block_ids)
        for key in request.keys:
            if 0 in namespace.shard_sizes_for_key(key):
                raise _Refused(
                    ErrorCode.BAD_REQUEST,
                    f"group {group_of_key(key)} has no layers on some rank: it is not offloaded",
                )
        session = state.session
        job = _Job(request.job_id, state, Direction.STORE, request.keys, [], 0)
        if namespace.replicated and session.rank != 0:
            # Replicated layout: rank 0's shard is every rank's; the others ack at once.
            return self._accept_without_copy(state, request.request_id, job)
        shard = 0 if namespace.replicated else session.rank
        cache = self._require_cache()
        reservation = cache.begin_store(
            namespace.name,
            request.keys,
            shard,
            namespace.shard_sizes_for_key,
            allocate=not request.reserved,
        )
        self._chunks_removed(reservation.evicted)
        job.failed_keys = [request.keys[i] for i in reservation.refused]
        job.writes = reservation.writes
        if job.failed_keys:
            logger.debug("%s: %d keys refused (no room)", session.describe(), len(job.failed_keys))
        arena_address = self._require_arena().address
        moves = Copies()  # planned as arrays: the cuda engine takes them as they are
        keys, block_ids = request.keys, request.block_ids
        firsts = _block_offsets(ranges)
        for write in reservation.writes:
            position = namespace.group_positions[group_of_key(keys[write.index])]
            spans, shard_bytes = self._spans(state, position, bpc)
            if shard_bytes > write.size:
                raise AssertionError("shard plan exceeds its slot")
            sub_block, count = ranges[write.index]
            start = firsts[write.index]
            job.nbytes += chunk_copies(
                spans,
                block_ids[start : start + count],
                arena_address + write.offset,
                moves,
                first_sub_block=sub_block,
            )
        return self._submit(state, request.request_id, job, moves, request.wait_event)

    def _load(self, state: _SessionState, request: Load) -> Reply | None:
        engine, namespace = self._worker_job_checks(state, request.job_id, request.keys)
        bpc = namespace.blocks_per_chunk
        skip = request.skip
        expected = len(request.keys) * bpc - skip
        if not request.keys or (
            not request.segments and (not 0 <= skip < bpc or len(request.block_ids) != expected)
        ):
            raise _Refused(
                ErrorCode.BAD_REQUEST,
                f"{len(request.keys)} keys with skip={skip} need {expected} block ids "
                f"({bpc} per chunk, 0 <= skip < {bpc}), got {len(request.block_ids)}",
            )
        ranges = self._chunk_ranges(
            request.keys, request.block_ids, bpc, request.segments, skip=skip
        )
        self._check_block_ids(state, request.block_ids)
        session = state.session
        job = _Job(request.job_id, state, Direction.LOAD, request.keys, [], 0)
        cache = self._require_cache()
        if request.hold:
            reservation = self._begin_held_load(engine, request.hold, request.keys)
        else:
            reservation = cache.begin_load(namespace.name, request.keys)
        if reservation.missing:
            job.failed_keys = list(reservation.missing)
            return self._accept_without_copy(state, request.request_id, job, "keys not in cache")
        job.entries = reservation.entries
        shard = 0 if namespace.replicated else session.rank
        arena_address = self._require_arena().address
        moves = Copies()  # planned as arrays: the cuda engine takes them as they are
        block_ids = request.block_ids
        position = 0
        for entry, (sub_block, count) in zip(reservation.entries, ranges, strict=True):
            group = namespace.group_positions[group_of_key(entry.key)]
            spans, shard_bytes = self._spans(state, group, bpc)
            if shard_bytes > entry.sizes[shard]:
                raise AssertionError("shard plan exceeds its slot")
            job.nbytes += chunk_copies(
                spans,
                block_ids[position : position + count],
                arena_address + entry.offsets[shard],
                moves,
                first_sub_block=sub_block,
                load=True,
            )
            position += count
        return self._submit(state, request.request_id, job, moves, request.wait_event)

    def _begin_held_load(self, engine: Engine, token: str, keys: list[bytes]) -> LoadReservation:
        """Read the entries a scheduler of ``engine`` holds under ``token``."""
        cache = self._require_cache()
        reservation = LoadReservation([], list(keys))
        for scheduler in engine.schedulers.values():
            reservation = cache.begin_load_held(scheduler.session_id, token, keys)
            if not reservation.missing:
                break
        return reservation

    @staticmethod
    def _chunk_ranges(
        keys: list[bytes],
        block_ids: list[int],
        bpc: int,
        segments: Sequence[Segment],
        *,
        skip: int = 0,
    ) -> list[tuple[int, int]]:
        try:
            return chunk_ranges(
                len(keys),
                len(block_ids),
                bpc,
                [(s.keys, s.skip, s.blocks) for s in segments],
                skip=skip,
            )
        except ValueError as exc:
            raise _Refused(ErrorCode.BAD_REQUEST, str(exc)) from None

    def _check_block_ids(self, state: _SessionState, block_ids: list[int]) -> None:
        problem = block_id_problem(block_ids, state.session.num_blocks)
        if problem:
            raise _Refused(ErrorCode.BAD_REQUEST, problem)

    def _spans(self, state: _SessionState, group: int, bpc: int) -> tuple[tuple[Span, ...], int]:
        """The session's resolved spans of ``group`` (built once) and its shard bytes.

        Building them checks every region's geometry against what the daemon really mapped,
        so block ids validated against ``num_blocks`` can never address outside a region.
        """
        layout = state.session.layouts[group]
        spans = state.spans.get(group)
        if spans is None:
            mappings = [(imported.address, imported.size) for imported in state.imports]
            spans = group_spans(layout, state.session.regions, mappings, blocks_per_chunk=bpc)
            state.spans[group] = spans
        return spans, layout.shard_bytes(bpc)

    def _accept_without_copy(
        self, state: _SessionState, request_id: int, job: _Job, error: str = ""
    ) -> Reply | None:
        self._send(state.identity, JobAccepted(request_id, job.job_id))
        self._complete(job, ok=not job.failed_keys, seconds=0.0, error=error)
        return None

    def _submit(
        self,
        state: _SessionState,
        request_id: int,
        job: _Job,
        moves: Sequence[Triple],
        wait_event: bytes = b"",
    ) -> Reply | None:
        if not moves:
            if job.direction is Direction.STORE:
                self._require_cache().finish_store(job.writes, ok=True)
            return self._accept_without_copy(state, request_id, job)
        assert self._copy is not None and self._handles is not None
        for imported in state.imports:
            self._handles.retain(imported)
        imports = list(state.imports)
        state.jobs[job.job_id] = job
        self._jobs_in_flight += 1
        loop = asyncio.get_running_loop()
        try:
            future = self._copy.submit(
                job.direction,
                moves,
                device=state.imports[0].device if state.imports else -1,
                wait_event=wait_event or None,
            )
        except Exception as exc:
            # Nothing was queued: undo the booking, or the job would stay in flight forever
            # (Wait never answered, drain never finished).
            self._unbook(job, imports)
            logger.error("%s: job %d not started: %s", state.session.describe(), job.job_id, exc)
            raise _Refused(ErrorCode.INTERNAL, f"the copy engine refused the job: {exc}") from None

        journal = self._journal if job.direction is Direction.STORE else None

        def on_done(done: Future[float]) -> None:
            if journal is not None and not done.cancelled() and done.exception() is None:
                # Checksummed (and on a disk, synced) off the loop before it can commit.
                journal.submit_seal(
                    job.writes,
                    lambda: loop.call_soon_threadsafe(self._copy_finished, job, imports, done),
                )
                return
            loop.call_soon_threadsafe(self._copy_finished, job, imports, done)

        future.add_done_callback(on_done)
        return JobAccepted(request_id, job.job_id)

    def _unbook(self, job: _Job, imports: list[Import]) -> None:
        """Undo ``_submit``'s booking of a job the copy engine refused to start."""
        job.state.jobs.pop(job.job_id, None)
        self._jobs_in_flight -= 1
        self._release_imports(imports)
        cache = self._require_cache()
        if job.direction is Direction.STORE:
            cache.finish_store(job.writes, ok=False)
        else:
            cache.finish_load(job.entries)
        if self._jobs_in_flight == 0:
            self._idle.set()

    def _copy_finished(self, job: _Job, imports: list[Import], future: Future[float]) -> None:
        self._jobs_in_flight -= 1
        try:
            seconds = future.result()
            error = ""
        except Exception as exc:
            logger.error(
                "%s: job %d copy failed: %s", job.state.session.describe(), job.job_id, exc
            )
            seconds, error = 0.0, f"copy failed: {exc}"
        cache = self._require_cache()
        copied = not error
        if job.direction is Direction.STORE:
            committed = cache.finish_store(job.writes, ok=copied and not job.abandoned)
            lost = self._journal_commits(committed)
            if lost:
                committed = [entry for entry in committed if not entry.dead]
                job.failed_keys = job.failed_keys + [entry.key for entry in lost]
                error = error or f"not committed: {self._journal_failure()}"
            engine = self.registry.engine(job.state.session.engine_key)
            if engine is not None and engine.namespace is not None:
                self._chunks_committed(engine.namespace, committed)
            if copied:
                self.counters.bytes_stored += job.nbytes
        else:
            cache.finish_load(job.entries)
            if copied:
                self.counters.bytes_loaded += job.nbytes
        self._release_imports(imports)
        if not copied:
            job.failed_keys = list(job.keys)
        self._complete(job, ok=copied and not job.failed_keys, seconds=seconds, error=error)
        if self._jobs_in_flight == 0:
            self._idle.set()

    def _complete(self, job: _Job, *, ok: bool, seconds: float, error: str) -> None:
        state = job.state
        state.jobs.pop(job.job_id, None)
        engine_id, dp = state.session.engine_key
        self.metrics.job_finished(
            job.direction.value,
            engine_id,
            dp,
            nbytes=0 if error else job.nbytes,
            seconds=seconds,
            ok=ok,
        )
        if not ok:
            self.counters.jobs_failed += 1
        if job.abandoned or not state.alive:
            return
        done = JobDone(job.job_id, ok, job.failed_keys, job.nbytes, seconds, error)
        state.done[job.job_id] = done
        while len(state.done) > self.settings.server.recent_jobs:
            state.done.popitem(last=False)
        self._send(state.identity, done)
        self._wake_waiters(state)

    # ----------------------------------------------------------------- schedulers

    def _scheduler_checks(self, state: _SessionState) -> tuple[Engine, Namespace]:
        if state.session.role != "scheduler":
            raise _Refused(ErrorCode.WRONG_ROLE, "only schedulers reserve and hold keys")
        engine, namespace = self._ready_engine(state)
        return engine, namespace

    def _acker(self, state: _SessionState) -> str | None:
        """The requester, when its mirror applies this request's removals before any lookup
        (FIFO on its socket) and it holds everything it has looked up: see ``Reserve``."""
        session_id = state.session.session_id
        return session_id if self._require_mirrors().watching(session_id) else None

    def _reserve(self, state: _SessionState, request: Reserve) -> Reply:
        engine, namespace = self._scheduler_checks(state)
        self._check_keys(request.keys, engine)
        for key in request.keys:
            if 0 in namespace.shard_sizes_for_key(key):
                raise _Refused(
                    ErrorCode.BAD_REQUEST,
                    f"group {group_of_key(key)} has no layers on some rank: it is not offloaded",
                )
        self._apply_holds(state, engine, namespace, request.holds, request.release, request.ack)
        cache = self._require_cache()
        reservation = cache.reserve(
            namespace.name,
            request.keys,
            state.session.session_id,
            namespace.shard_sizes_for_key,
            acker=self._acker(state),
        )
        self._chunks_removed(reservation.evicted)
        return Reserved(request.request_id, reservation.reserved)

    def _update_holds(self, state: _SessionState, request: UpdateHolds) -> Reply:
        engine, namespace = self._scheduler_checks(state)
        held, missing = self._apply_holds(
            state, engine, namespace, request.hold, request.release, request.ack
        )
        return HoldResult(request.request_id, held, missing)

    def _apply_holds(
        self,
        state: _SessionState,
        engine: Engine,
        namespace: Namespace,
        hold: list[HoldKeys],
        release: list[HoldKeys],
        ack: int,
    ) -> tuple[int, list[bytes]]:
        cache = self._require_cache()
        owner = state.session.session_id
        for item in (*hold, *release):
            self._check_keys(item.keys, engine)
        for item in release:
            cache.release_hold(owner, item.token, item.keys)
        held, missing = 0, []
        for item in hold:
            lost = cache.hold(namespace.name, owner, item.token, item.keys)
            held += len(item.keys) - len(lost)
            missing.extend(lost)
        if missing:
            logger.warning(
                "%s: %d held keys were not in the cache", state.session.describe(), len(missing)
            )
        if ack:
            cache.ack(owner, ack)
        return held, missing

    # ----------------------------------------------------------------- wait

    def _wait(self, state: _SessionState, request: Wait) -> Reply | None:
        if math.isnan(request.timeout):  # uvloop's call_later raises on NaN
            raise _Refused(ErrorCode.BAD_REQUEST, "Wait timeout is NaN")
        unknown = [j for j in request.job_ids if j not in state.jobs and j not in state.done]
        if unknown:
            raise _Refused(ErrorCode.BAD_REQUEST, f"unknown job ids {unknown[:10]}")
        waiter = _Waiter(request.request_id, list(request.job_ids))
        if not any(j in state.jobs for j in waiter.job_ids) or request.timeout <= 0:
            return self._wait_result(state, waiter)
        loop = asyncio.get_running_loop()
        waiter.timer = loop.call_later(request.timeout, self._wait_timed_out, state, waiter)
        state.waiters.append(waiter)
        return None

    def _wait_result(self, state: _SessionState, waiter: _Waiter) -> WaitResult:
        done = [state.done[j] for j in waiter.job_ids if j in state.done]
        pending = [j for j in waiter.job_ids if j in state.jobs]
        return WaitResult(waiter.request_id, done, pending)

    def _wake_waiters(self, state: _SessionState) -> None:
        for waiter in list(state.waiters):
            if not any(j in state.jobs for j in waiter.job_ids):
                state.waiters.remove(waiter)
                if waiter.timer is not None:
                    waiter.timer.cancel()
                self._send(state.identity, self._wait_result(state, waiter))

    def _wait_timed_out(self, state: _SessionState, waiter: _Waiter) -> None:
        if waiter in state.waiters and state.alive:
            state.waiters.remove(waiter)
            self._send(state.identity, self._wait_result(state, waiter))

    # ----------------------------------------------------------------- events

    def _clear(self, state: _SessionState, request: Clear) -> Reply:
        engine, namespace = self._ready_engine(state)
        removed = self._require_cache().clear_namespace(namespace.name, acker=self._acker(state))
        if self._journal is not None:
            self._journal.removed(removed)
        keys = [entry.key for entry in removed if entry.committed]
        logger.info(
            "%s cleared namespace %s: %d chunks",
            state.session.describe(),
            namespace.name,
            len(keys),
        )
        self._require_mirrors().changed(namespace.name, [], keys)
        self._publish_to(engine, [AllBlocksCleared()])
        for other in self._event_engines(namespace):
            if other is not engine:
                self._publish_to(other, removed_events(keys, raw_hashes=self._raw_hashes(other)))
        return Ok(request.request_id, len(keys))

    def _journal_commits(self, entries: list[Entry]) -> list[Entry]:
        """Journal chunks that just became visible; those it cannot journal are taken back at
        once (never announced, extents freed) and returned."""
        if not entries or self._journal is None:
            return []
        cache = self._require_cache()
        lost = self._journal.committed(entries, cache.committed_chunks)
        for entry in lost:
            cache.remove(entry.namespace, [entry.key])
        self._maybe_compact()
        return lost

    def _journal_failure(self) -> str:
        failure = self._journal.failed if self._journal is not None else ""
        return failure or "its bytes could not be checksummed"

    def _chunks_committed(self, namespace: Namespace, entries: list[Entry]) -> None:
        """Chunks that just became visible (and journaled): every engine of the namespace
        hears of them."""
        if not entries:
            return
        keys = [entry.key for entry in entries]
        self._require_mirrors().changed(namespace.name, keys, [])
        if self._events is None:
            return
        for engine in self._event_engines(namespace):
            self._publish_to(engine, stored_events(keys, raw_hashes=self._raw_hashes(engine)))

    def _chunks_removed(self, entries: list[Entry]) -> None:
        """Chunks evicted or removed: journaled before their extents can be reused, and
        announced in their own namespace (never-committed entries were never announced, so
        their removal is not either)."""
        if self._journal is not None:
            self._journal.removed(entries)
        by_namespace: dict[str, list[bytes]] = {}
        for entry in entries:
            if entry.committed:
                by_namespace.setdefault(entry.namespace, []).append(entry.key)
        for name, keys in by_namespace.items():
            self._require_mirrors().changed(name, [], keys)
        if self._events is None:
            return
        for name, keys in by_namespace.items():
            namespace = self.registry.namespace(name)
            if namespace is None:
                continue  # no engine of that namespace is connected: nobody to tell
            for engine in self._event_engines(namespace):
                self._publish_to(engine, removed_events(keys, raw_hashes=self._raw_hashes(engine)))

    def _maybe_compact(self) -> None:
        if self._journal is not None and self._journal.should_compact():
            self._journal.compact(self._require_cache().committed_chunks())

    def _event_engines(self, namespace: Namespace) -> list[Engine]:
        engines = (self.registry.engine(key) for key in sorted(namespace.engines))
        return [
            e
            for e in engines
            if e is not None and e.config.enable_kv_cache_events and not e.mirrored
        ]

    def _raw_hashes(self, engine: Engine) -> bool:
        first = engine.workers.get(0)
        return first is not None and first.kv_events_raw_hashes

    def _topic(self, engine: Engine) -> str:
        first = engine.workers.get(0)
        if first is not None and first.kv_events_topic:
            return first.kv_events_topic
        settings = self.settings.events
        return topic_for(
            settings.topic_template,
            pod=settings.pod_name(),
            model=engine.config.model.name,
            engine_id=engine.key[0],
            dp=engine.key[1],
        )

    def _publish_to(self, engine: Engine, events: list[KVEvent]) -> None:
        """Queue ``events`` under the engine's topic and dp index; never blocks."""
        if (
            self._events is None
            or not events
            or not engine.config.enable_kv_cache_events
            or engine.mirrored  # its scheduler publishes the engine's events itself
        ):
            return
        topic, dp = self._topic(engine), engine.key[1]
        for chunk in in_batches(events):
            self._events.publish(topic, dp, KVEventBatch(time.time(), chunk, dp))

    # ----------------------------------------------------------------- stats

    def stats(self) -> DaemonStats:
        """Counters for GetStats."""
        cache = self._require_cache().stats()
        events = self._events.endpoints_for(0) if self._events is not None else ("", "")
        return DaemonStats(
            uptime_seconds=time.monotonic() - self._started,
            capacity_bytes=cache.capacity,
            used_bytes=cache.used_bytes,
            entries=cache.entries,
            committed_entries=cache.committed,
            lookups=cache.lookups,
            hits=cache.hit_keys,
            misses=cache.miss_keys,
            stores_refused=cache.stores_refused,
            evictions=cache.evictions,
            bytes_stored=self.counters.bytes_stored,
            bytes_loaded=self.counters.bytes_loaded,
            protocol_errors=self.counters.protocol_errors,
            sessions=len(self._states),
            engines=[engine.state() for engine in self.registry.engines()],
            imports=len(self._handles) if self._handles is not None else 0,
            jobs_in_flight=self._jobs_in_flight,
            events_endpoint=events[0],
            events_replay_endpoint=events[1],
            copy_path=self._copy_path(),
        )

    def _copy_path(self) -> dict[str, bool]:
        """Whether the cuda engine runs its fast path (empty for engines without one)."""
        batched = getattr(self._copy, "batched", None)
        if batched is None:
            return {}
        pinned = self._arena is not None and self._arena.pinned is not None
        return {"batched": bool(batched), "pinned": pinned}

    def _require_cache(self) -> ChunkCache:
        assert self._cache is not None, "daemon not started"
        return self._cache

    def _require_mirrors(self) -> Mirrors:
        assert self._mirrors is not None, "daemon not started"
        return self._mirrors

    def _send_to_session(self, session_id: str, message: Reply) -> None:
        state = self._states.get(session_id)
        if state is not None:
            self._send(state.identity, message)

    def _require_arena(self) -> Arena:
        assert self._arena is not None, "daemon not started"
        return self._arena

    def _require_handles(self) -> HandleTable:
        assert self._handles is not None, "daemon not started"
        return self._handles


async def serve(settings: Settings, *, shutdown: asyncio.Event | None = None) -> None:
    """Run a daemon until ``shutdown`` is set, or until SIGTERM/SIGINT when none is given."""
    stop = shutdown or asyncio.Event()
    if shutdown is None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
    async with Daemon(settings) as daemon:
        await daemon.serve(stop)
    logger.info("offloadd stopped")


def _block_offsets(ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Index of each key's first block id, given each key's ``(sub_block, count)``."""
    offsets, total = [], 0
    for _, count in ranges:
        offsets.append(total)
        total += count
    return offsets


def _wrong_memory(index: int, *, cuda: bool) -> str:
    if cuda:
        return (
            f"region {index} is host shared memory, but this daemon runs the cuda copy "
            'engine (server.copy_engine = "cuda"), which moves GPU memory: register CUDA '
            "tensors (offloadd.cuda_ipc.kv_region_from_tensor), or use a daemon with "
            'copy_engine = "cpu"'
        )
    return (
        f"region {index} is CUDA memory, but this daemon runs the cpu copy engine: use a "
        'daemon with server.copy_engine = "cuda" on a GPU node, or shared-memory regions'
    )


def _own_pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return -1


def run(settings: Settings) -> None:
    """Blocking entry point for ``offloadd serve``: uvloop when installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but keep serving without
        asyncio.run(serve(settings))
        return
    uvloop.run(serve(settings))

"""Sessions and their liveness: Hello, the per-session state, and how a session ends.

A session is one peer (a rank or a scheduler) that said Hello; it is keyed by its socket
identity in hex, which is also its registry session id.

Contract of ``Sessions`` (the event loop's thread only):
- ``hello(identity, hello)``: take the registration its token names (``offloadd.peer``: who
  the kernel says the peer is, the descriptors it passed; used up by any Hello bringing it),
  check the Hello against the limits and the tenancy, open its regions from those
  descriptors, register the session under the peer's tenant and uid (replacing any earlier
  session of the same peer or engine rank, of the same uid), answer ``Welcome``, and send
  ``EngineReady`` to the whole engine when its last rank arrived. ``Welcome.shared_clock``
  says whether the Hello's ``monotonic`` was the daemon's clock at receipt (``shared_clock``).
  On a cuda daemon the CUDA IPC imports block, so they run on the import thread: the peer's
  later requests are held in the ``RequestGate`` until the Hello is answered, then handled in
  arrival order. Every import opened is released, and the registration closed, on every path.
- A session ends when the process that registered exits (its pidfd, taken when it
  registered, watched on the loop), when it is silent for ``server.session_timeout`` and no
  pidfd watches it
  (``reap_silent_sessions``; the decision is ``silent_sessions``), on ``Bye``
  (``end_session``), or when a new Hello replaces it. Ending abandons its jobs (nothing it
  half-wrote becomes visible), answers its waiters, drops its pins, holds, reservations and
  mirror, and releases its imports (copies in flight hold their own references).
- A scheduler whose key mirror owes the acknowledgement of a removal for
  ``server.mirror_ack_timeout`` seconds of the daemon's running time is ended the same way
  (``reap_silent_sessions``; the decision is ``Mirrors.overdue``): the removals it owed stop
  waiting for it, so evictions go on for everyone. A live scheduler hears ``NOT_REGISTERED``
  at its next request and says Hello again (a fresh snapshot). ``mirrors_dropped`` counts them.
- A scheduler that says Hello again from the same process (the kernel's pid, the same uid)
  for the same engine replaces its old session (``Registry.hello``), as a rank does.
- ``begin_drain()``: the daemon stops: no new Hellos, jobs, reservations or holds
  (``SHUTTING_DOWN``), and every mirror is told that every key misses (``Mirrors.drain``).
- ``tenant_of(identity)``: the tenant a peer's requests are served under (the control
  socket's lanes): its session's, else its registration's (``PeerListener.peer_of``), else "".
- ``unwatch_all()`` and ``handles_closed()``: the daemon is closing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from offloadd.cache.index import ChunkCache
from offloadd.logs import PerUidLog
from offloadd.safety import engine_id_problem
from offloadd.server.announce import Announcer
from offloadd.server.checks import Refused
from offloadd.server.control import ControlSocket
from offloadd.server.gate import RequestGate
from offloadd.server.jobs import Jobs
from offloadd.server.limits import Limits, file_problem
from offloadd.server.metrics import Metrics
from offloadd.server.mirrors import Mirrors
from offloadd.server.peers import REMOTE, PeerListener, Registration
from offloadd.server.registry import Engine, EngineOwners, RegistrationError, Registry
from offloadd.server.state import SessionState, silent_sessions
from offloadd.server.systemd import Notifier
from offloadd.server.tenancy import Tenancy
from offloadd.settings import Settings
from offloadd.transfer.handles import HandleError, HandleTable, Import
from protocol import PROTOCOL_VERSION
from protocol.errors import ErrorCode
from protocol.handles import CudaIpcHandle, ShmHandle
from protocol.messages import Bye, EngineReady, Hello, Ok, Ping, Reply, Welcome
from protocol.peer import peer_socket_path

__all__ = ["SHARED_CLOCK_SECONDS", "Sessions", "close_on", "shared_clock"]

logger = logging.getLogger(__name__)

SHARED_CLOCK_SECONDS = 1.0  # a Hello's clock this close to the daemon's is the same clock


class Sessions:
    """The live sessions of the daemon; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        cache: ChunkCache,
        mirrors: Mirrors,
        handles: HandleTable,
        jobs: Jobs,
        announce: Announcer,
        control: ControlSocket,
        *,
        importer: ThreadPoolExecutor | None,
        gate: RequestGate,
        notify: Notifier,
        metrics: Metrics,
        peers: PeerListener | None,
        tenancy: Tenancy,
        limits: Limits,
        tier_names: Sequence[str] = (),
    ) -> None:
        self.settings = settings
        self._tier_names = list(tier_names)  # the tiers that opened, told in every Welcome
        self.registry = registry
        self._cache = cache
        self._mirrors = mirrors
        self._handles: HandleTable | None = handles
        self._jobs = jobs
        self._announce = announce
        self._importer = importer
        self._gate = gate
        self._notify = notify
        self.endpoint = control.endpoint
        self.metrics = metrics
        self._send = control.send
        self._protocol_error = control.protocol_error
        self._log = PerUidLog(logger)  # lifecycle lines a client's Hellos and exits cause
        self._internal_error = control.internal_error
        self._handle_frames = control.handle_frames
        self._peers = peers
        self._tenancy = tenancy
        self._limits = limits
        self._announce_topic = announce.derived_topic
        self._states: dict[str, SessionState] = {}
        self.mirrors_dropped = 0  # schedulers ended for not acknowledging removals in time
        # Which tenant each engine id belongs to, across restarts (with the journal only).
        self._owners = (
            EngineOwners(settings.journal_path() + ".engines") if settings.cache.persist else None
        )
        if peers is not None:  # limits.descriptors_per_uid counts what live sessions keep
            peers.live_descriptors = self._descriptors_of

    def _descriptors_of(self, uid: int) -> int:
        """Descriptors ``uid``'s live sessions make the daemon hold: its pidfds and the
        duplicates the handle table keeps of unsealed region files."""
        return sum(
            len(st.windows) + (st.pidfd is not None)
            for st in self._states.values()
            if st.peer.uid == uid
        )

    def __len__(self) -> int:
        """Live sessions."""
        return len(self._states)

    def get(self, session_id: str) -> SessionState | None:
        """The live session ``session_id`` (its identity in hex), if any."""
        return self._states.get(session_id)

    def tenant_of(self, identity: bytes) -> str:
        """The tenant of the peer ``identity``: its session's, else its registration's (a Hello
        on its way), else "" (a peer the daemon knows nothing of)."""
        state = self._states.get(identity.hex())
        if state is not None:
            return state.session.tenant
        peer = self._peers.peer_of(identity) if self._peers is not None else None
        return self._tenancy.tenant_of(peer) if peer is not None else ""

    def handles_closed(self) -> None:
        """Register nothing more (the daemon closed the handle table)."""
        self._handles = None

    def unwatch_all(self) -> None:
        """Stop watching every session's process (the daemon is closing)."""
        for state in list(self._states.values()):
            self._unwatch_process(state)

    def begin_drain(self) -> None:
        """The daemon stops: refuse what starts work, tell every mirror that every key misses."""
        self._jobs.draining = True
        self._mirrors.drain()

    def ping(self, state: SessionState | None, request: Ping) -> Reply:
        """A heartbeat for ``request.session``, else for the sender's own session."""
        vouched = self._states.get(request.session) if request.session else state
        if vouched is not None:
            vouched.last_seen = time.monotonic()
        return Ok(request.request_id, int(vouched is not None))

    # ----------------------------------------------------------------- hello

    def bye(self, state: SessionState, request: Bye) -> Reply:
        """End the sender's session at its request."""
        self.end_session(state, "said goodbye")
        return Ok(request.request_id)

    def hello(self, identity: bytes, hello: Hello) -> None:
        """Register the sender and answer it (OFF_LOOP: ``offloadd.server.dispatch``)."""
        # The token is used up by any Hello that brings it, refused or not.
        shared = shared_clock(hello.monotonic)  # at receipt, before any import's wait
        peers = self._peers
        taken = peers.take(hello.token, identity) if peers is not None else None
        try:
            registration = self._admit(identity, hello, taken)
        except BaseException:
            if taken is not None:
                taken.close()
            raise
        if self._importer is not None and hello.regions:
            # CUDA imports block (open, wait for the producer's event): run them on the
            # import thread and hold this peer's later requests until the Hello is done.
            loop = asyncio.get_running_loop()

            def imported(future: Future[list[Import]]) -> None:
                try:
                    loop.call_soon_threadsafe(
                        self._hello_imported, identity, hello, registration, future, shared
                    )
                except RuntimeError:  # the loop is gone: nothing to answer
                    registration.close()

            try:
                submitted = self._importer.submit(self._open_regions, hello, registration)
            except BaseException:
                registration.close()
                raise
            submitted.add_done_callback(imported)
            self._gate.close(identity)  # before _hello_imported can run: it runs on this loop
            return
        try:
            imports = self._open_regions(hello, registration)
            self._register(identity, hello, imports, registration, shared)
        finally:
            registration.close()  # the table keeps its own descriptors; the session its pidfd

    def _admit(
        self, identity: bytes, hello: Hello, registration: Registration | None
    ) -> Registration:
        """The checks of a Hello before its regions are opened. Returns the registration
        behind it: who the kernel says the peer is, and the descriptors it passed."""
        if hello.protocol_version != PROTOCOL_VERSION:
            raise Refused(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol_version {hello.protocol_version} is not {PROTOCOL_VERSION}",
            )
        if self._jobs.draining:
            raise Refused(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        problem = engine_id_problem(hello.config.engine_id)  # it names logs, labels, topics
        if problem:
            raise Refused(ErrorCode.BAD_REQUEST, problem)
        if self._peers is None:
            # tcp:// (CURVE) and inproc://: no kernel identity. Such peers form one tenant of
            # their own and bring no memory (docs/security.md).
            if hello.regions:
                raise Refused(
                    ErrorCode.NOT_PERMITTED,
                    f"{self.endpoint} is not an ipc:// endpoint: it carries no KV regions "
                    "(no kernel identity); connect ranks over ipc://",
                )
            registration = Registration(b"", identity, REMOTE, [], None, 0.0)
        if registration is None:
            raise Refused(
                ErrorCode.UNAUTHENTICATED,
                "Hello without a valid registration token: register on "
                f"{peer_socket_path(self.endpoint)} first (offloadd.client does); a token is "
                "good for one Hello from the ZeroMQ identity it was made for, within "
                f"{self.settings.limits.token_seconds:g}s",
            )
        if registration.exited():
            raise Refused(ErrorCode.UNAUTHENTICATED, "the process that registered has exited")
        problem = self._tenancy.hello_problem(registration.peer)
        if problem:
            raise Refused(ErrorCode.NOT_PERMITTED, problem)
        uid, own = registration.peer.uid, identity.hex()
        sessions = sum(1 for sid, st in self._states.items() if st.peer.uid == uid and sid != own)
        # Both O(regions + runs): a canonical page's fragments are counted before they are
        # walked (1-byte fragments once stalled the loop for 48 s).
        problem = self._limits.session_problem(
            len(hello.regions), sessions
        ) or self._limits.fragments_problem(hello.regions)
        if problem:
            raise Refused(ErrorCode.TOO_LARGE, problem)
        config = hello.config
        owner = self._owners.owner(config.engine_id) if self._owners is not None else None
        tenant = self._tenancy.tenant_of(registration.peer)
        if owner is not None and owner != tenant:
            raise Refused(
                ErrorCode.NOT_PERMITTED,
                f"engine {config.engine_id} belongs to another user (engine ids are per node "
                "and kept across restarts: pick another)",
            )
        derived = self._announce_topic(
            config.model.name, config.engine_id, config.parallel.data_parallel_index, tenant
        )
        problem = self._tenancy.topic_problem(hello.kv_events_topic, derived)
        if problem:
            raise Refused(ErrorCode.NOT_PERMITTED, problem)
        return registration

    def _hello_imported(
        self,
        identity: bytes,
        hello: Hello,
        registration: Registration,
        future: Future[list[Import]],
        shared: bool,
    ) -> None:
        """Finish a Hello whose regions were imported off the loop, then its held requests."""
        try:
            if self._handles is None:
                return  # closed meanwhile; the table's close unmapped everything
            try:
                self._register(identity, hello, future.result(), registration, shared)
            except Refused as refused:
                self._protocol_error(identity, hello.request_id, refused.code, str(refused))
            except Exception:
                logger.exception("internal error while handling a Hello")
                self._internal_error(identity, hello.request_id)
        finally:
            registration.close()
            self._gate.open(identity)
            while (frames := self._gate.next(identity)) is not None:
                if self._handles is not None:  # else the daemon is closing: nobody to answer
                    self._handle_frames(identity, frames)

    def _register(
        self,
        identity: bytes,
        hello: Hello,
        imports: list[Import],
        registration: Registration,
        shared: bool,
    ) -> None:
        """The rest of a Hello once its regions are imported: register, answer Welcome."""
        session_id = identity.hex()
        peer = registration.peer
        try:
            outcome = self.registry.hello(
                session_id, hello, tenant=self._tenancy.tenant_of(peer), uid=peer.uid, pid=peer.pid
            )
        except RegistrationError as exc:
            self._jobs.release_imports(imports)
            raise Refused(exc.code, str(exc)) from None
        except BaseException:
            self._jobs.release_imports(imports)  # a bug below must not leak the mappings
            raise
        if self._owners is not None:
            self._owners.bind(hello.config.engine_id, outcome.session.tenant)
        for old in outcome.replaced:
            old_state = self._states.get(old.session_id)
            if old_state is not None:
                self._drop_state(old_state, "replaced by a new Hello")
        windows = [imported.window for imported in imports if imported.window is not None]
        unsealed = [i.window for i in imports if i.window is not None and not i.sealed]
        state = SessionState(
            identity,
            outcome.session,
            imports,
            peer=peer,
            windows=tuple(dict.fromkeys(windows)),
            unsealed=tuple(dict.fromkeys(unsealed)),
        )
        self._states[session_id] = state
        self._watch_process(state, registration)
        engine = outcome.engine
        self._log(
            peer.uid,
            logging.INFO,
            "%s connected (uid %d, pid %d, %d regions, client %r, events topic %r); engine %s",
            outcome.session.describe(),
            peer.uid,
            peer.pid,
            len(hello.regions),
            hello.client_name,  # %r: a client's string never forges or splits a log line
            hello.kv_events_topic,
            "ready" if engine.ready else f"waiting for ranks {engine.missing_ranks()}",
        )
        dp = hello.config.parallel.data_parallel_index
        events = self._announce.endpoints_for(dp)
        self._send(
            identity,
            Welcome(
                hello.request_id,
                PROTOCOL_VERSION,
                session_id,
                engine.state(),
                *events,
                tiers=self._tier_names,
                shared_clock=shared,
            ),
        )
        if outcome.became_ready:
            self._engine_became_ready(engine, peer.uid)
        else:
            self._mirrors.start(outcome.session)
        self.report_status()

    def _open_regions(self, hello: Hello, registration: Registration) -> list[Import]:
        handles = self._handles
        assert handles is not None, "daemon not started"
        # Each engine moves one kind of memory: refuse the other kind here, not per job.
        cuda = self.settings.server.copy_engine == "cuda"
        for index, region in enumerate(hello.regions):
            if isinstance(region.handle, CudaIpcHandle) != cuda:
                raise Refused(ErrorCode.HANDLE_OPEN_FAILED, _wrong_memory(index, cuda=cuda))
        imports: list[Import] = []
        try:
            for index, region in enumerate(hello.regions):
                handle, fd = region.handle, None
                if isinstance(handle, ShmHandle) and 0 <= handle.fd < len(registration.fds):
                    fd = registration.fds[handle.fd]
                try:
                    imports.append(handles.open(handle, fd))
                except HandleError as exc:
                    raise Refused(ErrorCode.HANDLE_OPEN_FAILED, f"region {index}: {exc}") from None
            # After the opens (their refusals say more); a refusal here unmaps at once.
            problem = _region_files_problem(hello, registration) or self._mapped_problem(
                registration, imports
            )
            if problem:
                raise Refused(ErrorCode.TOO_LARGE, problem)
            # One rank, one GPU: a job's copies run on that device's streams.
            if len({imported.device for imported in imports}) > 1:
                raise Refused(ErrorCode.BAD_GEOMETRY, "a rank's regions must all be on one device")
        except BaseException:
            self._jobs.release_imports(imports)  # whatever failed (a mapping, a bug): leak nothing
            raise
        return imports

    def _mapped_problem(self, registration: Registration, imports: list[Import]) -> str:
        """Why the host region files of the uid's live sessions and these ``imports`` are
        too many bytes to map (``limits.mapped_bytes_per_uid``); a file counts once."""
        if all(imported.device >= 0 for imported in imports):
            return ""  # GPU memory (on the import thread: the sessions are the loop's)
        uid, own = registration.peer.uid, registration.identity.hex()
        extents = dict(imported.extent for imported in imports if imported.device < 0)
        for session_id, state in self._states.items():
            if state.peer.uid == uid and session_id != own:
                extents.update(i.extent for i in state.imports if i.device < 0)
        return self._limits.mapped_problem(sum(extents.values()))

    def _engine_became_ready(self, engine: Engine, uid: int) -> None:
        assert engine.namespace is not None
        self._log(
            uid,
            logging.INFO,
            "engine %s dp %d ready: %d ranks, namespace %s",
            engine.key[0],
            engine.key[1],
            engine.world_size,
            engine.namespace.name,
        )
        self._announce.engine_ready(engine)
        message = EngineReady(engine.state())
        for session in engine.sessions():
            state = self._states.get(session.session_id)
            if state is not None:
                self._send(state.identity, message)
        for session in engine.schedulers.values():
            self._mirrors.start(session)

    def report_status(self) -> None:
        """Tell systemd how many engines and sessions the daemon serves."""
        engines = self.registry.engines()
        ready = sum(engine.ready for engine in engines)
        self._notify.status(
            f"serving on {self.endpoint}; {len(engines)} engines ({ready} ready), "
            f"{len(self._states)} sessions"
        )

    # ----------------------------------------------------------------- liveness

    def _watch_process(self, state: SessionState, registration: Registration) -> None:
        """Reap the session the moment the process that registered exits (the kernel's pid,
        never the Hello's; a pidfd taken when it registered, so a reused pid is no alias)."""
        pidfd = registration.take_pidfd()
        if pidfd is None:
            return  # not visible from the daemon's pid namespace, or remote: heartbeats
        state.pidfd = pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._process_exited, state)

    def _process_exited(self, state: SessionState) -> None:
        if state.alive:
            self.end_session(state, "its process exited")

    def _unwatch_process(self, state: SessionState) -> None:
        if state.pidfd is not None:
            asyncio.get_running_loop().remove_reader(state.pidfd)
            os.close(state.pidfd)
            state.pidfd = None

    async def reap_silent_sessions(self) -> None:
        """End sessions that neither a pidfd watches nor a heartbeat keeps alive, and
        schedulers whose mirror does not acknowledge removals in time."""
        timeout = self.settings.server.session_timeout
        ack_timeout = self.settings.server.mirror_ack_timeout
        period = max(0.05, min(timeout, ack_timeout) / 4)
        ack_ticks = math.ceil(ack_timeout / period)
        while True:
            await asyncio.sleep(period)
            silent = silent_sessions(self._states.values(), now=time.monotonic(), timeout=timeout)
            for state in silent:
                if state.alive:  # still, when its turn comes
                    self.end_session(state, f"silent for {timeout:.0f}s")
            for session_id in self._mirrors.overdue(ack_ticks):
                late = self._states.get(session_id)
                if late is not None and late.alive:
                    self._log(
                        late.session.uid,
                        logging.WARNING,
                        "%s: its key mirror did not acknowledge removals within %gs",
                        late.session.describe(),
                        ack_timeout,
                    )
                    self.mirrors_dropped += 1
                    self.end_session(late, "its mirror stopped acknowledging")

    def end_session(self, state: SessionState, reason: str) -> None:
        """Forget the session (Bye, process exit, silence); its engine waits for it again."""
        outcome = self.registry.remove(state.session.session_id)
        self._drop_state(state, reason)
        self.report_status()
        if outcome is not None and outcome.was_ready and not outcome.engine.ready:
            # Its mirrors would go stale: they are sent a new snapshot when it is ready again.
            self._mirrors.stop_engine(list(outcome.engine.schedulers.values()))
        if outcome is not None and outcome.engine_dropped:
            self.metrics.forget_engine(*outcome.engine.key)
        if outcome is not None and outcome.was_ready and not outcome.engine_dropped:
            self._log(
                state.session.uid,
                logging.INFO,
                "engine %s dp %d waiting for ranks %s",
                outcome.engine.key[0],
                outcome.engine.key[1],
                outcome.engine.missing_ranks(),
            )

    def _drop_state(self, state: SessionState, reason: str) -> None:
        """Fail the session's jobs so nothing half-written becomes visible; free its pins."""
        if not state.alive:
            return
        state.alive = False
        self._unwatch_process(state)
        if self._states.get(state.session.session_id) is state:
            del self._states[state.session.session_id]
        cache = self._cache
        self._jobs.abandon(state)  # also answers its waiters
        session_id = state.session.session_id
        cache.release_owner(session_id)
        self._mirrors.stop(session_id)
        cache.release_holds(session_id)
        cache.release_reservations(session_id)
        self._jobs.release_imports(state.imports)  # in-flight jobs hold their own references
        state.imports = []
        self._log(
            state.session.uid,
            logging.INFO,
            "%s left (%s); %d jobs abandoned",
            state.session.describe(),
            reason,
            len(state.jobs),
        )


def close_on(importer: ThreadPoolExecutor) -> Callable[[Callable[[], None]], None]:
    """A ``HandleTable`` closer that runs a CUDA import's close (it syncs a stream) on the
    import thread, or at once when that thread is shut down (the daemon is exiting)."""

    def close_import(close: Callable[[], None]) -> None:
        def run() -> None:
            try:
                close()
            except Exception:
                logger.exception("closing a CUDA IPC import failed")

        try:
            importer.submit(run)
        except RuntimeError:  # shut down: the daemon is exiting, close here
            run()

    return close_import


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


def shared_clock(monotonic: float) -> bool:
    """A Hello's ``monotonic`` was read on this daemon's CLOCK_MONOTONIC: within 1 s of it now
    (the clock is system-wide on Linux but for time namespaces, whose offsets are set by hand;
    the margin is the Hello's time in flight). 0: the sender did not say."""
    return monotonic > 0.0 and abs(time.monotonic() - monotonic) < SHARED_CLOCK_SECONDS


def _region_files_problem(hello: Hello, registration: Registration) -> str:
    """Why a file the Hello's regions use is refused: larger than its furthest region's end
    (rounded up to a page), over all the regions that use it (``limits.file_problem``)."""
    furthest: dict[tuple[int, int], tuple[int, int, str]] = {}
    for region in hello.regions:
        handle = region.handle
        if not isinstance(handle, ShmHandle) or not 0 <= handle.fd < len(registration.fds):
            continue  # refused when it is opened
        try:
            info = os.fstat(registration.fds[handle.fd])
        except OSError:
            continue  # refused when it is opened
        key = (info.st_dev, info.st_ino)
        end = max(handle.offset, 0) + max(handle.size, 0)
        _, known, _ = furthest.get(key, (0, 0, ""))
        furthest[key] = (info.st_size, max(known, end), handle.path[:200])
    for size, end, name in furthest.values():
        problem = file_problem(size, end)
        if problem:
            return f"{name!r}: {problem}"
    return ""

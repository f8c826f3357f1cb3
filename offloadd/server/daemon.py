"""The daemon's composition root: it builds the resources in order, wires the parts over
them, serves, and closes them in the reverse order.

Everything runs on one asyncio loop (uvloop if there) except byte copies (the copy engine's
threads) and a cuda daemon's CUDA IPC imports (a thread). How each request is answered, and on
which thread, is declared once, in ``offloadd.server.dispatch``. The parts, one module each, get
what they use in their constructors, never reaching for each other: ``sessions`` (Hello,
liveness), ``requests`` (Lookup, Store, Load, Release, Clear), ``jobs`` (copies in flight, Wait,
the drain), ``schedulers`` (Reserve, UpdateHolds, Ack), ``announce`` (journal, key mirrors, KV
events), ``stats`` (GetStats, metrics), ``admin`` (ListCache, ClearCache), ``tiers`` (below the
arena, drained before it is unmapped), ``commit`` (a chunk's commit, where rank stores and
promotions end). ``Daemon`` owns the resources (endpoint claim, arena, journal, handle table,
copy engine, sockets, publishers, metrics) and the order they start and close in.

Shutdown (``serve``, ``offloadd.server.shutdown``): the first SIGTERM or SIGINT stops new
jobs and drains the copies in flight for up to ``server.drain_seconds``; a second one during
the drain forces the exit: the drain is cancelled, nothing waits for copies still running
(their imports and the arena stay mapped until the process ends), and ``serve`` returns
128 + that signal's number for ``offloadd serve`` to exit with at once. SIGHUP reloads the
settings it can (``offloadd.server.reload``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq.asyncio

from offloadd.cache.arena import Arena
from offloadd.cache.index import ChunkCache
from offloadd.cache.journal import Journal
from offloadd.endpoint import EndpointClaim, check_tcp_security
from offloadd.server.admin import CacheAdmin
from offloadd.server.announce import Announcer
from offloadd.server.commit import Committer
from offloadd.server.connections import ConnectionGate, open_connection_gate
from offloadd.server.control import ControlSocket
from offloadd.server.dispatch import Dispatcher, handlers
from offloadd.server.gate import RequestGate
from offloadd.server.jobs import Jobs
from offloadd.server.limits import Limits, cache_bounds
from offloadd.server.metrics import Counters, Metrics
from offloadd.server.mirrors import Mirrors
from offloadd.server.peers import PeerListener, listen_beside
from offloadd.server.preflight import raise_on_failure
from offloadd.server.publisher import PublisherSet
from offloadd.server.registry import Registry
from offloadd.server.reload import Reloader
from offloadd.server.requests import CacheRequests
from offloadd.server.schedulers import Schedulers
from offloadd.server.sessions import Sessions, close_on
from offloadd.server.shutdown import Shutdown, unless_forced
from offloadd.server.stats import Stats, copy_path, warn_if_degraded
from offloadd.server.storage import (
    PIN_PIECE,
    open_arena,
    open_copy_engine,
    open_journal,
    tier_slots,
    with_copy_engine_chosen,
)
from offloadd.server.systemd import Notifier
from offloadd.server.tenancy import Tenancy
from offloadd.server.tiers import Tiers, TierSlot
from offloadd.settings import Settings
from offloadd.transfer.engine import CopyEngine
from offloadd.transfer.handles import HandleTable
from protocol.messages import DaemonStats, Reply

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Parts:
    """The request handling, wired by ``Daemon.start`` once the resources exist."""

    announce: Announcer
    commit: Committer
    jobs: Jobs
    sessions: Sessions
    requests: CacheRequests
    schedulers: Schedulers
    tiers: Tiers | None
    stats: Stats
    dispatch: Dispatcher


class Daemon:
    """One offloadd instance. Use ``async with Daemon(settings) as d: await d.serve(stop)``."""

    def __init__(
        self,
        settings: Settings,
        *,
        copy_engine: CopyEngine | None = None,
        notifier: Notifier | None = None,
        tiers: Sequence[TierSlot] | None = None,
    ) -> None:
        settings = with_copy_engine_chosen(settings.exposed())  # "auto" sockets placed
        self.settings = settings
        self._tier_slots = list(tiers) if tiers is not None else None
        self._tiers: Tiers | None = None
        self._tiers_closed = True  # False while tier threads may still use the arena
        self.forced = False  # a second signal cut the drain short: wait for no copy thread
        self._notify = notifier or Notifier()
        self.endpoint = settings.endpoint()
        self._copy = copy_engine
        self._claim: EndpointClaim | None = None
        self._arena: Arena | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._handles: HandleTable | None = None
        # cuda only: CUDA IPC imports and closes run here, off the loop (see Sessions.hello).
        self._importer: ThreadPoolExecutor | None = None
        self._gate = RequestGate()
        self._cache: ChunkCache | None = None
        self._mirrors: Mirrors | None = None
        self._journal: Journal | None = None
        self._events: PublisherSet | None = None
        self._parts: _Parts | None = None
        self._peers: PeerListener | None = None  # the registration socket (ipc:// only)
        self._connections: ConnectionGate | None = None  # bounds the ZeroMQ sockets' peers
        self.tenancy = Tenancy(settings.tenancy)
        self.limits = Limits(settings.limits)
        self.registry = Registry(cluster_tenants=settings.mooncake.cluster_tenants())
        self._started = time.monotonic()
        self.counters = Counters()
        self.metrics = Metrics(
            self.stats,
            pending_jobs=lambda: self._parts.jobs.in_flight if self._parts else 0,
            ready=lambda: self._parts.stats.not_ready() if self._parts else "starting",
            copy_engine=settings.server.copy_engine,
        )
        self._control = ControlSocket(
            settings,
            self.endpoint,
            self._gate,
            dispatch=lambda identity, request: self._require_parts().dispatch(identity, request),
            unregistered=lambda p, f: self._require_parts().dispatch.unregistered(p, f),
            metrics=self.metrics,
            counters=self.counters,
            tenant_of=lambda peer: self._parts.sessions.tenant_of(peer) if self._parts else "",
        )

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
            # What the machine must offer (ports, directories, room), before the arena is
            # pre-faulted (minutes for a large one); the claim holds the control endpoint.
            raise_on_failure(settings, claimed=True, copy_engine=self._copy is None)
            self._arena = open_arena(settings, self._notify, cuda=cuda)
            self._cache = ChunkCache(
                settings.cache.capacity,
                policy=settings.cache.policy,
                # One DMA may not span two of the arena's cudaHostRegister pieces.
                boundary=PIN_PIECE if cuda else 0,
                # What engines and tenants may keep from eviction, how long reservations last.
                **cache_bounds(settings.cache.capacity, settings.limits),
            )
            self._mirrors = Mirrors(self._cache, self.registry, self._send_to_session)
            self._journal = open_journal(settings, self._arena, self._cache, self._notify)
            opener = None
            if cuda:
                from offloadd.transfer.cuda_import import CudaIpcOpener

                opener = CudaIpcOpener()
                self._importer = ThreadPoolExecutor(1, thread_name_prefix="offloadd-ipc")
            journal = settings.journal_path()
            self._handles = HandleTable(
                # A rank may never make these a region (compared by device and inode).
                forbidden=[self._arena.path, journal, journal + ".key"],
                cuda=opener,
                closer=close_on(self._importer) if self._importer is not None else None,
            )
            self._copy = self._copy or open_copy_engine(self._arena, cuda=cuda)
            self._ctx = zmq.asyncio.Context()
            self._connections = open_connection_gate(
                self._ctx,
                settings.limits,
                3 if settings.events.enabled else 1,
                settings.limits.metrics_connections if settings.metrics.address else 0,
            )
            self._control.bind(self._ctx, self._connections.watch)
            self._peers = listen_beside(self.endpoint, settings, asyncio.get_running_loop())
            if settings.events.enabled:
                self._events = PublisherSet(
                    settings.events,
                    self._ctx,
                    socket_mode=settings.events.socket_mode,
                    socket_group=settings.events.socket_group,
                    buffer_bytes=settings.limits.event_buffer_bytes,
                    watch=self._connections.watch,
                )
                self._events.start()
            self._parts = self._wire()
            if settings.metrics.address:
                self.metrics.start(
                    settings.metrics.address,
                    socket_mode=settings.metrics.socket_mode,
                    socket_group=settings.metrics.socket_group,
                    connections=settings.limits.metrics_connections,
                )
        except BaseException:
            await self._drain_tiers()
            await self._close_events()
            self._release_resources(failed=True)
            raise
        warn_if_degraded(copy_path(self._copy, self._arena))
        self._notify.ready(f"serving on {self.endpoint}; no engines yet")
        logger.info(
            "offloadd serving on %s (arena %s, %d MiB, %s eviction, %s copies)",
            self.endpoint,
            self._arena.path,
            settings.cache.capacity >> 20,
            settings.cache.policy,
            self._copy.name,
        )

    def _wire(self) -> _Parts:
        """Build the request handling over the resources ``start`` created."""
        settings, registry, copy = self.settings, self.registry, self._copy
        cache, arena, mirrors, handles = self._cache, self._arena, self._mirrors, self._handles
        assert cache is not None and arena is not None and mirrors is not None
        assert handles is not None and copy is not None
        announce = Announcer(
            settings.events, registry, cache, mirrors, events=self._events,
            client_topics=settings.tenancy.client_topics,
            snapshot_keys=settings.limits.snapshot_keys,
        )  # fmt: skip
        commit = Committer(cache, announce, journal=self._journal)
        slots = self._tier_slots
        if slots is None:  # none given (tests): those the settings turn on
            slots = tier_slots(settings, arena, tenant_of=registry.tenant_of_namespace)
        tiers = None
        if slots:
            tiers = Tiers(slots, cache, arena, announce, commit, capacity=settings.cache.capacity)
            self._tiers, self._tiers_closed = tiers, False
            announce.attach_tiers(tiers)
            logger.info("tiers below the arena: %s", ", ".join(tiers.names))
        jobs = Jobs(
            settings.server,
            registry,
            cache,
            copy,
            handles,
            commit,
            metrics=self.metrics,
            counters=self.counters,
            send=self._control.send,
            bulk=self._control.run_bulk,
        )
        sessions = Sessions(
            settings,
            registry,
            cache,
            mirrors,
            handles,
            jobs,
            announce,
            self._control,
            importer=self._importer,
            gate=self._gate,
            notify=self._notify,
            metrics=self.metrics,
            peers=self._peers,
            tenancy=self.tenancy,
            limits=self.limits,
            tier_names=list(tiers.names) if tiers is not None else [],
        )
        requests = CacheRequests(
            settings, registry, cache, arena, mirrors, jobs, commit,
            metrics=self.metrics, limits=self.limits, tiers=tiers,
        )  # fmt: skip
        schedulers = Schedulers(registry, cache, mirrors, jobs, limits=self.limits)
        schedulers.on_reserve_read(requests.waiting.wake)
        stats = Stats(
            cache, registry, self.counters, self.tenancy,
            sessions=sessions, jobs=jobs, handles=handles, events=self._events,
            peers=self._peers, tiers=tiers, copy_path=copy_path(copy, arena),
            started=self._started, arena=arena.path,
            copy_engine=settings.server.copy_engine,
        )  # fmt: skip
        admin = CacheAdmin(cache, registry, commit, self.tenancy, requests.usage, self._peers)
        table = handlers(sessions, requests, jobs, schedulers, stats, admin)
        dispatch = Dispatcher(
            table, self._control, session_of=sessions.get, bounds=self.limits.message_problem
        )
        return _Parts(
            announce, commit, jobs, sessions, requests, schedulers, tiers, stats, dispatch
        )

    async def serve(self, shutdown: asyncio.Event, *, force: asyncio.Event | None = None) -> None:
        """Answer requests until ``shutdown`` is set, then drain in-flight copies; ``force``,
        set during the drain, cancels it (see the module docstring)."""
        parts = self._require_parts()
        receiver = asyncio.create_task(self._control.receive_loop())
        stopper = asyncio.create_task(shutdown.wait())
        reaper = asyncio.create_task(parts.sessions.reap_silent_sessions())
        background = [receiver, stopper, reaper]
        if self._notify.watchdog_seconds:
            background.append(
                asyncio.create_task(self._notify.keep_alive(self._notify.watchdog_seconds))
            )
        try:
            done, _ = await asyncio.wait({receiver, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if receiver in done:
                receiver.result()  # a crash of the receive loop is a bug: surface it
            parts.sessions.begin_drain()  # no new jobs, holds or Hellos; every mirror misses
            self._notify.stopping(f"draining {parts.jobs.in_flight} jobs")
            logger.info("stopping: no new jobs, draining copies in flight")
            if not await unless_forced(self._drain(parts.jobs), force or asyncio.Event()):
                self.forced = True
                logger.warning(
                    "forced exit: drain cancelled with %d jobs in flight", parts.jobs.in_flight
                )
        finally:
            for task in background:
                task.cancel()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _drain(self, jobs: Jobs) -> None:
        await jobs.drain()
        await self._drain_tiers()

    async def close(self) -> None:
        """Publish the last events, then release everything; idempotent."""
        if self._parts is not None:
            self._parts.sessions.unwatch_all()
        await self._drain_tiers()
        await self._close_events()
        self._release_resources()

    async def _drain_tiers(self) -> None:
        """Let the tiers finish their calls (bounded), then close them; not once forced."""
        if self._tiers is not None and not self._tiers_closed and not self.forced:
            self._tiers_closed = await self._tiers.drain(self.settings.server.drain_seconds)

    async def _close_events(self) -> None:
        if self._events is not None:
            events, self._events = self._events, None
            if self._parts is not None:
                self._parts.announce.events_closed()
            await events.close()

    def _release_resources(self, *, failed: bool = False) -> None:
        """Close what ``start`` opened; after a failed start, also the arena it created."""
        self.metrics.close()
        forced = self.forced
        if self._copy is not None and not forced:
            self._copy.close()  # waits for the copies queued
        self._control.close()
        if self._peers is not None:
            self._peers.close()
            self._peers = None
        if self._connections is not None:
            self._connections.close()  # its monitors before the context's term()
            self._connections = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._importer is not None:
            self._importer.shutdown(wait=not forced)  # imports in progress finish first
        if self._handles is not None:
            if self._parts is not None:  # copies and imports that end later release nothing
                self._parts.sessions.handles_closed()
                self._parts.jobs.handles_closed()
            if not forced:  # else a copy may still use the imports: the exit unmaps them
                self._handles.close()
            self._handles = None
        if self._journal is not None:
            if self._parts is not None:
                self._parts.commit.journal_closed()
            self._journal.close()
            self._journal = None
        if self._arena is not None:
            if self._tiers_closed and not forced:
                # A first start that failed leaves no arena (nor its pre-faulted pages).
                self._arena.close(remove=failed and self._arena.created)
            else:
                # A tier's thread may still read or write it: unmapping would crash it.
                logger.warning("copies or tiers did not stop: the arena stays mapped until exit")
            self._arena = None
        if self._claim is not None:
            self._claim.release()
            self._claim = None
        self._notify.close()

    def stats(self) -> DaemonStats:
        """Every counter and engine (metrics, admins); GetStats filters it per sender."""
        return self._require_parts().stats.all()

    def _require_parts(self) -> _Parts:
        assert self._parts is not None, "daemon not started"
        return self._parts

    def _send_to_session(self, session_id: str, message: Reply) -> None:
        state = self._parts.sessions.get(session_id) if self._parts is not None else None
        if state is not None:
            self._control.send(state.identity, message)


async def serve(
    settings: Settings,
    *,
    shutdown: asyncio.Event | None = None,
    force: asyncio.Event | None = None,
    ready: Callable[[], None] | None = None,
    reload: Callable[[], Settings] | None = None,
    source: str = "",
) -> int:
    """Run a daemon until ``shutdown`` is set, or until SIGTERM/SIGINT when none is given; a
    second signal, or ``force``, during the drain forces the exit. Returns the exit status
    (``offloadd.server.shutdown``). ``ready()``: once the daemon is built, before it serves.
    With signals, SIGHUP runs ``reload()`` (the file ``source``): ``offloadd.server.reload``."""
    stopping = Shutdown(shutdown, force)
    if shutdown is None:  # SIGHUP taken from the start: one during the pre-fault waits for it
        stopping.install(asyncio.get_running_loop())
        Reloader(settings, reload, source=source).install()
    async with Daemon(settings) as daemon:
        if ready is not None:
            ready()
        await daemon.serve(stopping.stop, force=stopping.force)
    logger.info("offloadd stopped%s", " without finishing its drain" if daemon.forced else "")
    return stopping.exit_status(daemon.forced)

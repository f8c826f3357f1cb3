"""The daemon's composition root: it builds the parts, wires them, and dispatches requests.

Everything runs on one asyncio loop (uvloop when available) except byte copies, which the
copy engine runs on its own threads. Each request is handled to completion without awaiting,
so handlers never interleave; a store or load replies ``JobAccepted`` at once and its
``JobDone`` is sent when the copy engine's future resolves. One exception: a cuda daemon
imports a Hello's CUDA IPC handles (and closes imports) on an import thread, since each
import blocks; that peer's later requests are held (``offloadd.server.gate``) until its Hello is
answered, so every peer still sees its requests handled in order. Any request that fails
validation, and any bug inside a handler, is answered with an ``Error`` and the daemon goes
on serving everyone else.

``Daemon`` owns the resources (endpoint claim, arena, journal, handle table, copy engine,
sockets, event publishers, metrics) and their order of start and close. The request
handling lives in the parts it wires in ``start``, one module each, none reaching for
another but through what it was given:

- ``offloadd.server.sessions``: Hello, the per-session state, liveness (pidfd, heartbeats), ends.
- ``offloadd.server.requests``: Lookup, Store, Load, Release, Clear.
- ``offloadd.server.jobs``: the copies in flight, their completion, Wait, the drain.
- ``offloadd.server.schedulers``: Reserve, UpdateHolds, Ack.
- ``offloadd.server.announce``: the journal, the key mirrors and the KV events of each cache change.
- ``offloadd.server.commit``: a chunk's commit (sealed, visible, journaled, announced), the
  one pipeline rank stores (jobs) and promotions (tiers) both end in.
- ``offloadd.server.tiers``: the tiers below the arena (``[disk]``, ``[mooncake]``;
  built by ``tier_slots``), fed by the announcer, probed by lookups; drained before the
  arena is unmapped.

Who a peer is comes from the kernel, through the registration socket beside an ipc control
socket (``offloadd.peer``); what it may see and share from ``offloadd.server.tenancy``; how much it
may use from ``offloadd.server.limits``. The daemon builds those and hands them to the parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import zmq.asyncio

from offloadd import __version__
from offloadd.cache.arena import Arena
from offloadd.cache.index import ChunkCache
from offloadd.cache.journal import Journal
from offloadd.endpoint import EndpointClaim, check_tcp_security
from offloadd.server.announce import Announcer
from offloadd.server.checks import Refused
from offloadd.server.commit import Committer
from offloadd.server.control import ControlSocket
from offloadd.server.gate import RequestGate
from offloadd.server.jobs import Jobs
from offloadd.server.limits import Limits
from offloadd.server.metrics import Counters, Metrics
from offloadd.server.mirrors import Mirrors
from offloadd.server.peers import PeerListener
from offloadd.server.preflight import raise_on_failure
from offloadd.server.publisher import PublisherSet
from offloadd.server.registry import Registry
from offloadd.server.requests import CacheRequests
from offloadd.server.schedulers import Schedulers
from offloadd.server.sessions import Sessions, close_on
from offloadd.server.state import SessionState
from offloadd.server.storage import PIN_PIECE, open_arena, open_journal
from offloadd.server.systemd import Notifier
from offloadd.server.tenancy import Tenancy, Viewer
from offloadd.server.tiers import Tiers, TierSlot
from offloadd.settings import Settings
from offloadd.tiers.base import Tier
from offloadd.transfer.choice import choose_copy_engine
from offloadd.transfer.engine import CopyEngine, CpuCopyEngine
from offloadd.transfer.handles import HandleTable
from protocol.errors import ErrorCode
from protocol.events import MEDIUM_DISK
from protocol.messages import (
    Ack,
    Bye,
    Clear,
    DaemonStats,
    EngineState,
    GetStats,
    Hello,
    Load,
    Lookup,
    Ok,
    Ping,
    Release,
    Reply,
    Request,
    Reserve,
    StatsResult,
    StepJobs,
    Store,
    UpdateHolds,
    Wait,
)
from protocol.peer import peer_socket_path

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


def tier_slots(settings: Settings, arena: Arena) -> list[TierSlot]:
    """The tiers the settings turn on, in order: disk, then the cluster (none by default)."""
    slots: list[TierSlot] = []
    if settings.disk.path:
        from offloadd.tiers.disk import DiskTier

        disk = DiskTier.from_settings(settings.disk)
        # Its index is in memory: a lookup asks it on the loop.
        slots.append(TierSlot(disk, settings.disk.queue_bytes, inline=True, medium=MEDIUM_DISK))
    if settings.mooncake.master:
        cluster = _open_cluster(settings, arena)
        if cluster is not None:
            timeout = settings.mooncake.lookup_timeout
            slots.append(TierSlot(cluster, settings.mooncake.queue_bytes, lookup_timeout=timeout))
    return slots


def _open_cluster(settings: Settings, arena: Arena) -> Tier | None:
    """The cluster tier, or None (logged) when it cannot open: a node whose master is down,
    or that lacks the ``mooncake`` extra, still serves its host memory and disk."""
    try:
        from offloadd.tiers.mooncake import MooncakeTier

        tier: Tier = MooncakeTier(settings.mooncake, arena)
    except Exception as exc:
        logger.error(
            "cluster tier OFF: cannot open Mooncake Store at %s: %s (restart to retry)",
            settings.mooncake.master,
            exc,
        )
        return None
    return tier


def with_copy_engine_chosen(settings: Settings) -> Settings:
    """``settings`` with ``server.copy_engine = "auto"`` replaced by the engine it picks."""
    engine, why = choose_copy_engine(settings.server.copy_engine)
    if not why:
        return settings
    logger.info("copy engine: %s (auto: %s)", engine, why)
    server = msgspec.structs.replace(settings.server, copy_engine=engine)
    return msgspec.structs.replace(settings, server=server)


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
        settings = with_copy_engine_chosen(settings)
        self.settings = settings
        # Tiers given here (tests) replace those the settings turn on (``tier_slots``).
        self._tier_slots = list(tiers) if tiers is not None else None
        self._tiers: Tiers | None = None
        self._tiers_closed = True  # False while tier threads may still use the arena
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
        self.tenancy = Tenancy(settings.tenancy)
        self.limits = Limits(settings.limits)
        self.registry = Registry()
        self._started = time.monotonic()
        self.counters = Counters()
        self.metrics = Metrics(
            self.stats,
            pending_jobs=lambda: self._parts.jobs.in_flight if self._parts else 0,
            ready=self._not_ready,
            copy_engine=settings.server.copy_engine,
        )
        self._control = ControlSocket(
            settings,
            self.endpoint,
            self._gate,
            dispatch=self._dispatch,
            metrics=self.metrics,
            counters=self.counters,
        )

    def _not_ready(self) -> str:
        """What keeps the daemon from serving, for ``/readyz`` ("" when ready)."""
        if self._parts is None or self._arena is None:
            return "starting: the arena and the sockets are not up yet"
        down = [tier.name for tier in self.stats().tiers if not tier.healthy]
        return f"tier {', '.join(down)} unhealthy" if down else ""

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
            # What the machine must offer (ports, directories, room), before the arena is
            # pre-faulted, which takes minutes for a large one; the claim holds the control
            # endpoint already.
            raise_on_failure(settings, claimed=True, copy_engine=self._copy is None)
            self._arena = open_arena(settings, self._notify, cuda=cuda)
            self._cache = ChunkCache(
                settings.cache.capacity,
                policy=settings.cache.policy,
                # One DMA may not span two of the arena's cudaHostRegister pieces.
                boundary=PIN_PIECE if cuda else 0,
                # What each engine may keep from eviction (pins, holds, reservations).
                budget=int(settings.cache.capacity * settings.limits.protected_fraction),
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
            if self._copy is None:
                if cuda:
                    from offloadd.transfer.batch import HostPieces
                    from offloadd.transfer.cuda import make_engine

                    pieces = HostPieces(self._arena.address, PIN_PIECE)
                    self._copy = make_engine(host_pieces=pieces)
                else:
                    self._copy = CpuCopyEngine()
            self._ctx = zmq.asyncio.Context()
            self._control.bind(self._ctx)
            self._peers = self._start_peers()
            if settings.events.enabled:
                self._events = PublisherSet(
                    settings.events,
                    self._ctx,
                    socket_mode=settings.server.socket_mode,
                    socket_group=settings.server.socket_group,
                    buffer_bytes=settings.limits.event_buffer_bytes,
                )
                self._events.start()
            self._parts = self._wire()
            if settings.metrics.address:
                self.metrics.start(
                    settings.metrics.address,
                    socket_mode=settings.server.socket_mode,
                    socket_group=settings.server.socket_group,
                )
        except BaseException:
            await self._drain_tiers()
            await self._close_events()
            created = self._arena.path if self._arena is not None and self._arena.created else ""
            self._release_resources()
            if created:  # a first start that failed leaves no arena (nor its pre-faulted pages)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(created)
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

    def _start_peers(self) -> PeerListener | None:
        """The registration socket beside an ipc control socket (``offloadd.peer``)."""
        path = peer_socket_path(self.endpoint)
        if path is None:
            return None  # tcp:// and inproc://: no kernel identity, no regions (Sessions)
        server, limits = self.settings.server, self.settings.limits
        peers = PeerListener(
            path,
            socket_mode=server.socket_mode,
            socket_group=server.socket_group,
            max_descriptors=limits.regions_per_session,
            per_uid=limits.registrations_per_uid,
            token_seconds=limits.token_seconds,
        )
        peers.start(asyncio.get_running_loop())
        return peers

    def _wire(self) -> _Parts:
        """Build the request handling over the resources ``start`` created."""
        settings, registry = self.settings, self.registry
        cache, arena = self._require_cache(), self._require_arena()
        mirrors, handles, copy = self._mirrors, self._handles, self._copy
        assert mirrors is not None and handles is not None and copy is not None
        announce = Announcer(
            settings.events,
            registry,
            cache,
            mirrors,
            journal=self._journal,
            events=self._events,
            client_topics=settings.tenancy.client_topics,
            snapshot_keys=settings.limits.snapshot_keys,
        )
        commit = Committer(cache, announce, journal=self._journal)
        slots = self._tier_slots if self._tier_slots is not None else tier_slots(settings, arena)
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
            settings,
            registry,
            cache,
            arena,
            mirrors,
            jobs,
            announce,
            metrics=self.metrics,
            limits=self.limits,
            tiers=tiers,
            send=self._control.send,
        )
        schedulers = Schedulers(registry, cache, mirrors, announce, limits=self.limits)
        return _Parts(announce, commit, jobs, sessions, requests, schedulers, tiers)

    async def serve(self, shutdown: asyncio.Event) -> None:
        """Answer requests until ``shutdown`` is set, then drain in-flight copies."""
        parts = self._require_parts()
        receiver = asyncio.create_task(self._control.receive_loop())
        stopper = asyncio.create_task(shutdown.wait())
        reaper = asyncio.create_task(parts.sessions.reap_silent_sessions())
        background = [receiver, stopper, reaper]
        if self._notify.watchdog_seconds:
            background.append(asyncio.create_task(self._watchdog(self._notify.watchdog_seconds)))
        try:
            done, _ = await asyncio.wait({receiver, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if receiver in done:
                receiver.result()  # a crash of the receive loop is a bug: surface it
            parts.jobs.draining = True
            self._notify.stopping(f"draining {parts.jobs.in_flight} jobs")
            logger.info("stopping: no new jobs, draining copies in flight")
            await parts.jobs.drain()
            await self._drain_tiers()
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

    async def close(self) -> None:
        """Publish the last events, then release everything; idempotent."""
        if self._parts is not None:
            self._parts.sessions.unwatch_all()
        await self._drain_tiers()
        await self._close_events()
        self._release_resources()

    async def _drain_tiers(self) -> None:
        """Let the tiers finish their calls (bounded), then close them."""
        if self._tiers is not None and not self._tiers_closed:
            self._tiers_closed = await self._tiers.drain(self.settings.server.drain_seconds)

    async def _close_events(self) -> None:
        if self._events is not None:
            events, self._events = self._events, None
            if self._parts is not None:
                self._parts.announce.events_closed()
            await events.close()

    def _release_resources(self) -> None:
        self.metrics.close()
        if self._copy is not None:
            self._copy.close()
        self._control.close()
        if self._peers is not None:
            self._peers.close()
            self._peers = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._importer is not None:
            self._importer.shutdown(wait=True)  # imports in progress finish first
        if self._handles is not None:
            if self._parts is not None:  # copies and imports that end later release nothing
                self._parts.sessions.handles_closed()
                self._parts.jobs.handles_closed()
            self._handles.close()
            self._handles = None
        if self._journal is not None:
            if self._parts is not None:
                self._parts.announce.journal_closed()
                self._parts.commit.journal_closed()
            self._journal.close()
            self._journal = None
        if self._arena is not None:
            if self._tiers_closed:
                self._arena.close()
            else:
                # A tier's thread may still read or write it: unmapping would crash it.
                logger.warning("tiers did not stop: the arena stays mapped until exit")
            self._arena = None
        if self._claim is not None:
            self._claim.release()
            self._claim = None
        self._notify.close()

    # ----------------------------------------------------------------- dispatch

    def _dispatch(self, identity: bytes, request: Request) -> Reply | None:
        parts = self._require_parts()
        sessions, requests, schedulers = parts.sessions, parts.requests, parts.schedulers
        if isinstance(request, Hello):
            return sessions.hello(identity, request)
        state = sessions.get(identity.hex())
        if isinstance(request, GetStats):
            return StatsResult(request.request_id, self._visible_stats(identity, request, state))
        if isinstance(request, Ping):
            return sessions.ping(state, request)
        if state is None:
            raise Refused(ErrorCode.NOT_REGISTERED, "say Hello first")
        state.last_seen = time.monotonic()
        match request:
            case Lookup():
                return requests.lookup(state, request)
            case Store():
                return requests.store(state, request)
            case Load():
                return requests.load(state, request)
            case StepJobs():
                return requests.step_jobs(state, request)
            case Release():
                return requests.release(state, request)
            case Wait():
                return parts.jobs.wait(state, request)
            case Clear():
                return requests.clear(state, request)
            case Reserve():
                return schedulers.reserve(state, request)
            case UpdateHolds():
                return schedulers.update_holds(state, request)
            case Ack():
                return schedulers.ack(state, request)
            case Bye():
                sessions.end_session(state, "said goodbye")
                return Ok(request.request_id)
        raise Refused(ErrorCode.MALFORMED, f"unexpected message {type(request).__name__}")

    # ----------------------------------------------------------------- stats

    def _visible_stats(
        self, identity: bytes, request: GetStats, state: SessionState | None
    ) -> DaemonStats:
        """The stats as this sender may see them (``offloadd.server.tenancy``): its session's or its
        registration's user decides; an unknown sender sees aggregate counters only."""
        viewer: Viewer | None = None
        if state is not None:
            viewer = self.tenancy.viewer(state.peer)
        elif request.token and self._peers is not None:
            registration = self._peers.take(request.token, identity)
            if registration is not None:
                viewer = self.tenancy.viewer(registration.peer)
                registration.close()

        def tenant_of(engine: EngineState) -> str:
            found = self.registry.engine((engine.engine_id, engine.data_parallel_index))
            return found.tenant if found is not None else ""

        return self.tenancy.visible_stats(self.stats(), viewer, tenant_of)

    def stats(self) -> DaemonStats:
        """Every counter and engine (metrics, admins); GetStats filters it per sender."""
        cache = self._require_cache().stats()
        events = self._events.endpoints_for(0) if self._events is not None else ("", "")
        parts = self._parts
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
            sessions=len(parts.sessions) if parts is not None else 0,
            engines=[engine.state() for engine in self.registry.engines()],
            imports=len(self._handles) if self._handles is not None else 0,
            jobs_in_flight=parts.jobs.in_flight if parts is not None else 0,
            events_endpoint=events[0],
            events_replay_endpoint=events[1],
            copy_path=self._copy_path(),
            tiers=parts.tiers.stats() if parts is not None and parts.tiers is not None else [],
            version=__version__,
            pid=os.getpid(),
            arena=self.settings.arena_path(),
            copy_engine=self.settings.server.copy_engine,
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

    def _require_parts(self) -> _Parts:
        assert self._parts is not None, "daemon not started"
        return self._parts

    def _send_to_session(self, session_id: str, message: Reply) -> None:
        state = self._parts.sessions.get(session_id) if self._parts is not None else None
        if state is not None:
            self._control.send(state.identity, message)

    def _require_arena(self) -> Arena:
        assert self._arena is not None, "daemon not started"
        return self._arena


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


def run(settings: Settings) -> None:
    """Blocking entry point for ``offloadd serve``: uvloop when installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but keep serving without
        asyncio.run(serve(settings))
        return
    uvloop.run(serve(settings))

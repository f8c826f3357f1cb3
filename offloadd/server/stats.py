"""The daemon's stats: ``DaemonStats`` assembled from the parts, and what GetStats shows whom.

Contract of ``Stats`` (the event loop's thread only, once the daemon is wired):
- ``all()``: every counter and engine (metrics, admins).
- ``get_stats(identity, state, request)``: the GetStats handler (NOW, no session needed):
  ``all()`` as this sender may see it (``offloadd.server.tenancy``): its session's or its
  registration's user decides which engines it sees; only root and the daemon's user see
  the node-wide counters; a sender with neither sees what is no tenant's (version, capacity,
  where events are) and no engine. A token brought here is used up.
"""

from __future__ import annotations

import logging
import os
import time

from offloadd import __version__
from offloadd.cache.arena import Arena
from offloadd.cache.index import ChunkCache
from offloadd.server.jobs import Jobs
from offloadd.server.metrics import Counters
from offloadd.server.peers import PeerListener
from offloadd.server.publisher import PublisherSet
from offloadd.server.registry import Registry
from offloadd.server.sessions import Sessions
from offloadd.server.state import SessionState
from offloadd.server.tenancy import Tenancy, Viewer
from offloadd.server.tiers import Tiers
from offloadd.transfer.engine import CopyEngine
from offloadd.transfer.handles import HandleTable
from protocol.messages import DaemonStats, EngineState, GetStats, Reply, StatsResult

__all__ = ["Stats", "copy_path", "warn_if_degraded"]

logger = logging.getLogger(__name__)


def copy_path(copy: CopyEngine | None, arena: Arena | None) -> dict[str, bool]:
    """Whether the cuda engine runs its fast path (empty for engines without one)."""
    batched = getattr(copy, "batched", None)
    if batched is None:
        return {}
    pinned = arena is not None and arena.pinned is not None
    return {"batched": bool(batched), "pinned": pinned}


def warn_if_degraded(path: dict[str, bool]) -> None:
    """Log once, at start, that the cuda engine runs without part of its fast path."""
    if not all(path.values()):
        logger.error(
            "copy path DEGRADED: %s; see the warnings above (offloadd status shows it too)",
            ", ".join(f"not {feature}" for feature, ok in path.items() if not ok),
        )


class Stats:
    """Assembles ``DaemonStats``; see the module docstring."""

    def __init__(
        self,
        cache: ChunkCache,
        registry: Registry,
        counters: Counters,
        tenancy: Tenancy,
        *,
        sessions: Sessions,
        jobs: Jobs,
        handles: HandleTable,
        events: PublisherSet | None,
        peers: PeerListener | None,
        tiers: Tiers | None,
        copy_path: dict[str, bool],
        started: float,
        arena: str = "",
        copy_engine: str = "",
    ) -> None:
        self._arena_path = arena
        self._copy_engine = copy_engine
        self._cache = cache
        self._registry = registry
        self._counters = counters
        self._tenancy = tenancy
        self._sessions = sessions
        self._jobs = jobs
        self._handles = handles
        self._events = events
        self._peers = peers
        self._tiers = tiers
        self._copy_path = copy_path
        self._started = started

    def get_stats(self, identity: bytes, state: SessionState | None, request: GetStats) -> Reply:
        """``StatsResult`` with what this sender may see."""
        viewer: Viewer | None = None
        if state is not None:
            viewer = self._tenancy.viewer(state.peer)
        elif request.token and self._peers is not None:
            registration = self._peers.take(request.token, identity)
            if registration is not None:
                viewer = self._tenancy.viewer(registration.peer)
                registration.close()

        def tenant_of(engine: EngineState) -> str:
            found = self._registry.engine((engine.engine_id, engine.data_parallel_index))
            return found.tenant if found is not None else ""

        visible = self._tenancy.visible_stats(self.all(), viewer, tenant_of)
        return StatsResult(request.request_id, visible)

    def not_ready(self) -> str:
        """What keeps the daemon from serving, for ``/readyz`` ("" when ready)."""
        down = (
            [tier.name for tier in self._tiers.stats() if not tier.healthy] if self._tiers else []
        )
        return f"tier {', '.join(down)} unhealthy" if down else ""

    def all(self) -> DaemonStats:
        """Every counter and engine; GetStats filters it per sender."""
        cache = self._cache.stats()
        events = self._events.endpoints_for(0) if self._events is not None else ("", "")
        counters = self._counters
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
            bytes_stored=counters.bytes_stored,
            bytes_loaded=counters.bytes_loaded,
            protocol_errors=counters.protocol_errors,
            sessions=len(self._sessions),
            engines=[engine.state() for engine in self._registry.engines()],
            imports=len(self._handles),
            jobs_in_flight=self._jobs.in_flight,
            events_endpoint=events[0],
            events_replay_endpoint=events[1],
            copy_path=dict(self._copy_path),
            tiers=self._tiers.stats() if self._tiers is not None else [],
            version=__version__,
            pid=os.getpid(),
            arena=self._arena_path,
            copy_engine=self._copy_engine,
            stores_refused_by_reason=_sum_counts(cache.refused, counters.refused),
            mirrors_dropped=self._sessions.mirrors_dropped,
            stores_waiting=self._jobs.parked,
            loads_missing=counters.loads_missing,
        )


def _sum_counts(*counts: dict[str, int]) -> dict[str, int]:
    """Counts by reason added up."""
    total: dict[str, int] = {}
    for each in counts:
        for reason, count in each.items():
            total[reason] = total.get(reason, 0) + count
    return total

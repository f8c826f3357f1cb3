"""Who a peer is and what it may touch: identities from the kernel, tenants from settings.

Pure logic, no I/O (group names are resolved once, when ``Tenancy`` is built). Contract:

- ``offloadd.peer.Peer`` is what the kernel says about a local peer when it registers
  (``SO_PEERCRED``: uid, gid, pid in the daemon's pid namespace). ``REMOTE`` stands for a
  peer on a ``tcp://`` control endpoint, which has no kernel identity (CURVE authenticates
  its key, not a user): such peers form one tenant of their own and register no regions.
- ``Tenancy.tenant_of(peer)`` names the peer's tenant: the name of the
  ``tenancy.uid_ranges`` range its uid lies in (first, whatever else is set), else ``*`` for
  every local peer with ``tenancy.share_across_uids``, ``g<gid>`` when its primary group is
  one of ``tenancy.shared_groups``, ``u<uid>`` by default; ``remote`` for ``REMOTE``. Engines,
  namespaces and what GetStats lists are per tenant (the registry hashes the tenant into
  the namespace, see ``offloadd.server.registry.namespace_of``); a session is only ever replaced
  by a peer of the same uid.
- ``is_admin(peer)``: root and the daemon's own user see every engine in GetStats.
- ``hello_problem(peer)``: why ``peer`` may not say Hello ("" when it may): with
  ``tenancy.uid_ranges_only``, a uid in no range (root and the daemon's user included).
- ``topic_problem(asked, derived)``: why a Hello's ``kv_events_topic`` is refused ("" when
  it is fine): with ``tenancy.client_topics = false`` only the daemon's own topic (or none).
- ``visible_stats(stats, viewer)``: ``DaemonStats`` as ``viewer`` may see it: everything
  for an admin; for anyone else what is no tenant's (version, pid, uptime, capacity, arena,
  copy engine and path, where events are, tiers' names, capacities and health) with the
  node-wide counters at 0 (``counters = False``: they add up every tenant's work), plus the
  engines of its tenant for a known peer (none for an unknown one).
"""

from __future__ import annotations

import bisect
import grp
import os
from collections.abc import Callable
from dataclasses import dataclass

from offloadd.server.peers import REMOTE, Peer
from offloadd.settings import TenancySettings
from protocol.messages import DaemonStats, EngineState, TierState

__all__ = ["REMOTE", "Peer", "Tenancy"]


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who asks for stats: their tenant, and whether they may see everything."""

    tenant: str
    admin: bool = False


class Tenancy:
    """Tenants from ``TenancySettings``; see the module docstring."""

    def __init__(
        self,
        settings: TenancySettings,
        *,
        daemon_uid: int | None = None,
        gid_of: Callable[[str], int] | None = None,
    ) -> None:
        self.settings = settings
        self._daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid
        lookup = gid_of or (lambda name: grp.getgrnam(name).gr_gid)
        self._shared_gids = frozenset(lookup(name) for name in settings.shared_groups)
        self._ranges = settings.uid_range_table()  # sorted, disjoint (settings check)
        self._firsts = [first for first, _last, _name in self._ranges]

    def range_of(self, uid: int) -> str:
        """The ``tenancy.uid_ranges`` tenant ``uid`` lies in, or ""."""
        index = bisect.bisect_right(self._firsts, uid) - 1
        if index >= 0 and uid <= self._ranges[index][1]:
            return self._ranges[index][2]
        return ""

    def tenant_of(self, peer: Peer) -> str:
        """The tenant ``peer`` belongs to."""
        if peer.remote:
            return "remote"
        ranged = self.range_of(peer.uid)
        if ranged:
            return ranged
        if self.settings.share_across_uids:
            return "*"
        if peer.gid in self._shared_gids:
            return f"g{peer.gid}"
        return f"u{peer.uid}"

    @property
    def daemon_uid(self) -> int:
        """The daemon's own user (effective uid)."""
        return self._daemon_uid

    def is_admin(self, peer: Peer) -> bool:
        """Root or the daemon's user: may see every engine."""
        return not peer.remote and peer.uid in (0, self._daemon_uid)

    def hello_problem(self, peer: Peer) -> str:
        """Why ``peer`` may not open a session ("" if it may); see the module docstring."""
        if peer.remote or not self.settings.uid_ranges_only or self.range_of(peer.uid):
            return ""
        who = (
            " (root)"
            if peer.uid == 0
            else " (the daemon's own user)"
            if peer.uid == self._daemon_uid
            else ""
        )
        return (
            f"uid {peer.uid}{who} is in none of tenancy.uid_ranges, and uid_ranges_only "
            "admits only their engines: run the engine as a uid of its tenant's range"
        )

    def viewer(self, peer: Peer) -> Viewer:
        """``peer`` as a reader of stats."""
        return Viewer(self.tenant_of(peer), self.is_admin(peer))

    def topic_problem(self, asked: str, derived: str) -> str:
        """Why a Hello may not publish its engine's events under ``asked`` ("" if it may)."""
        if not asked or asked == derived or self.settings.client_topics:
            return ""
        return (
            f"kv_events_topic {asked[:64]!r}: the daemon publishes under its own topics "
            f"(events.topic_template gives {derived!r}); tenancy.client_topics = true lets "
            "ranks choose"
        )

    @staticmethod
    def visible_stats(
        stats: DaemonStats, viewer: Viewer | None, tenant_of_engine: Callable[[EngineState], str]
    ) -> DaemonStats:
        """``stats`` as ``viewer`` may see it (see the module docstring)."""
        if viewer is not None and viewer.admin:
            return stats
        engines = (
            [engine for engine in stats.engines if tenant_of_engine(engine) == viewer.tenant]
            if viewer is not None
            else []
        )
        return DaemonStats(
            uptime_seconds=stats.uptime_seconds,
            capacity_bytes=stats.capacity_bytes,
            used_bytes=0,
            entries=0,
            committed_entries=0,
            lookups=0,
            hits=0,
            misses=0,
            stores_refused=0,
            evictions=0,
            bytes_stored=0,
            bytes_loaded=0,
            protocol_errors=0,
            sessions=0,
            engines=engines,
            events_endpoint=stats.events_endpoint,
            events_replay_endpoint=stats.events_replay_endpoint,
            copy_path=stats.copy_path,
            tiers=[TierState(t.name, t.capacity, 0, 0, t.healthy) for t in stats.tiers],
            version=stats.version,
            pid=stats.pid,
            arena=stats.arena,
            copy_engine=stats.copy_engine,
            counters=False,
        )

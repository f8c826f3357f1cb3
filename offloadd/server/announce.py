"""Who hears of a cache change: the schedulers' key mirrors, the KV events, the tiers.

The committer (``offloadd.server.commit``: for commits, and for removals as the cache's
listener) calls these on its loop right after the cache changed and the journal recorded
it, before anything else is sent, so that the journal, the mirrors' ``seq`` and the event
stream agree on the order.

Contract of ``Announcer`` (it tells of changes; the committer makes chunks visible and is
the journal's one writer):
- ``chunks_committed(namespace, entries, source=)``: committed (and journaled) chunks: the
  mirrors of the namespace and every engine of it that wants events hear of them, and the
  tiers below the arena (``attach_tiers``) get a copy, all but ``source`` (the tier a
  promoted chunk came from).
- ``removed(entries)``: evicted or removed chunks (journaled already), told to the mirrors
  and engines of their own namespace (entries that never committed were never announced,
  so their removal is not either).
- ``cleared(engine, namespace, removed)``: a Clear: ``AllBlocksCleared`` to the clearing
  engine, ``BlockRemoved`` to the others, the tiers drop the namespace too; returns the
  committed keys dropped. ``dropped(name, removed)``: an operator's clear (``ClearCache``):
  ``BlockRemoved`` to every engine of the namespace (their GPU caches are untouched).
- ``tier_stored(namespace, keys, medium, locality)`` / ``tier_removed(...)``: chunks a tier
  below the arena now holds or dropped, as events with that tier's medium and locality
  (``"STORAGE"``, ``"LOCAL"`` or ``"REMOTE"``) to the engines of the namespace that want
  events.
- ``engine_ready(engine)``: routers learn at once what the node already holds for it (at
  most ``snapshot_keys`` chunks, the most recently used; a warning says how many not).
- ``derived_topic(model, engine_id, dp, tenant)``: the topic ``events.topic_template`` gives
  an engine of ``tenant`` (the default template names it, so no tenant's events carry
  another's topic); an engine publishes under it (under its Hello's topic only with
  ``client_topics``).
- ``publish_to(engine, events)``: queue events under the engine's topic and dp index; never
  blocks. Engines without ``enable_kv_cache_events``, and engines whose scheduler mirrors
  their keys (it publishes their events itself), get none.
- ``events_closed()``: the daemon is closing the publishers; copies that finish later
  publish nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

from offloadd.cache.index import ChunkCache, Entry
from offloadd.server.attribution import in_batches, removed_events, stored_events
from offloadd.server.mirrors import Mirrors
from offloadd.server.publisher import PublisherSet, topic_for
from offloadd.server.registry import Engine, Namespace, Registry
from offloadd.settings import EventSettings
from protocol.events import AllBlocksCleared, KVEvent, KVEventBatch

__all__ = ["Announcer", "TierListener"]

logger = logging.getLogger(__name__)


class TierListener(Protocol):
    """What the tiers below the arena hear (``offloadd.server.tiers.Tiers``)."""

    def committed(self, namespace: str, entries: list[Entry], source: str) -> None: ...

    def cleared(self, namespace: str) -> None: ...


def topic_warnings(template: str, *, client_topics: bool) -> list[str]:
    """Why events published under these topics could be attributed to the wrong tenant."""
    warnings = []
    if "{tenant}" not in template and "{engine_id}" not in template:
        warnings.append(
            f"events.topic_template {template!r} names neither {{tenant}} nor {{engine_id}}: "
            "engines of different tenants serving one model share a topic, so one tenant "
            "can publish events a router attributes to another"
        )
    if client_topics:
        warnings.append(
            "tenancy.client_topics = true: ranks choose their KV-event topics, so one tenant "
            "can publish under another's"
        )
    return warnings


class Announcer:
    """Mirrors, KV events and tiers for each cache change; see the module docstring."""

    def __init__(
        self,
        settings: EventSettings,
        registry: Registry,
        cache: ChunkCache,
        mirrors: Mirrors,
        *,
        events: PublisherSet | None,
        client_topics: bool = False,
        snapshot_keys: int = 1 << 16,
    ) -> None:
        self.settings = settings
        self._client_topics = client_topics
        self._snapshot_keys = snapshot_keys
        self.registry = registry
        self._cache = cache
        self._mirrors = mirrors
        self._events = events
        self._tiers: TierListener | None = None
        if events is not None:
            for warning in topic_warnings(settings.topic_template, client_topics=client_topics):
                logger.warning("%s", warning)

    def attach_tiers(self, tiers: TierListener | None) -> None:
        """Commits and clears reach ``tiers`` from now on (None: no more)."""
        self._tiers = tiers

    def events_closed(self) -> None:
        """Publish nothing more (the daemon is closing the publishers)."""
        self._events = None

    def endpoints_for(self, dp: int) -> tuple[str, str]:
        """Where dp index ``dp``'s KV events are published (``("", "")`` when off)."""
        return self._events.endpoints_for(dp) if self._events is not None else ("", "")

    def chunks_committed(
        self, namespace: Namespace, entries: list[Entry], *, source: str = ""
    ) -> None:
        """Chunks that just became visible (and journaled): every engine of the namespace
        hears of them, and every tier but ``source`` gets a copy."""
        if not entries:
            return
        keys = [entry.key for entry in entries]
        self._mirrors.changed(namespace.name, keys, [])
        if self._tiers is not None:
            self._tiers.committed(namespace.name, entries, source)
        if self._events is None:
            return
        for engine in self._event_engines(namespace):
            self.publish_to(engine, stored_events(keys, raw_hashes=self._raw_hashes(engine)))

    def tier_stored(
        self, namespace: str, keys: list[bytes], medium: str, locality: str | None
    ) -> None:
        """Chunks a tier below the arena now holds, announced with its medium and locality."""
        self._tier_events(namespace, keys, medium, locality, stored=True)

    def tier_removed(
        self, namespace: str, keys: list[bytes], medium: str, locality: str | None
    ) -> None:
        """Chunks a tier below the arena dropped, announced with its medium and locality."""
        self._tier_events(namespace, keys, medium, locality, stored=False)

    def _tier_events(
        self, name: str, keys: list[bytes], medium: str, locality: str | None, *, stored: bool
    ) -> None:
        if self._events is None or not keys:
            return
        namespace = self.registry.namespace(name)
        if namespace is None:
            return  # no engine of that namespace is connected: nobody to tell
        make = stored_events if stored else removed_events
        for engine in self._event_engines(namespace):
            events = make(
                keys, raw_hashes=self._raw_hashes(engine), medium=medium, locality=locality
            )
            self.publish_to(engine, events)

    def removed(self, entries: Sequence[Entry]) -> None:
        """Chunks evicted or removed, announced in their own namespace (never-committed
        entries were never announced, so their removal is not either)."""
        by_namespace: dict[str, list[bytes]] = {}
        for entry in entries:
            if entry.committed:
                by_namespace.setdefault(entry.namespace, []).append(entry.key)
        for name, keys in by_namespace.items():
            self._mirrors.changed(name, [], keys)
        if self._events is None:
            return
        for name, keys in by_namespace.items():
            namespace = self.registry.namespace(name)
            if namespace is None:
                continue  # no engine of that namespace is connected: nobody to tell
            for engine in self._event_engines(namespace):
                self.publish_to(engine, removed_events(keys, raw_hashes=self._raw_hashes(engine)))

    def cleared(self, engine: Engine, namespace: Namespace, removed: list[Entry]) -> list[bytes]:
        """``engine`` cleared ``namespace``, dropping ``removed``; returns the committed keys."""
        keys = self._dropped(namespace.name, removed)
        self.publish_to(engine, [AllBlocksCleared()])
        for other in self._event_engines(namespace):
            if other is not engine:
                self.publish_to(other, removed_events(keys, raw_hashes=self._raw_hashes(other)))
        return keys

    def dropped(self, name: str, removed: list[Entry]) -> list[bytes]:
        """An operator cleared namespace ``name`` (``ClearCache``), dropping ``removed``: its
        engines' GPU caches are untouched, so each hears the removals, never
        ``AllBlocksCleared``; returns the committed keys."""
        keys = self._dropped(name, removed)
        namespace = self.registry.namespace(name)
        if namespace is not None and keys:
            for engine in self._event_engines(namespace):
                self.publish_to(engine, removed_events(keys, raw_hashes=self._raw_hashes(engine)))
        return keys

    def _dropped(self, name: str, removed: list[Entry]) -> list[bytes]:
        """Mirrors and tiers forget a cleared namespace's ``removed`` entries."""
        keys = [entry.key for entry in removed if entry.committed]
        self._mirrors.changed(name, [], keys)
        if self._tiers is not None:
            self._tiers.cleared(name)
        return keys

    def engine_ready(self, engine: Engine) -> None:
        """Routers learn at once what this node already holds for the engine (a bounded part:
        every engine that becomes ready would queue the whole namespace again otherwise)."""
        assert engine.namespace is not None
        snapshot = self._cache.keys_in(engine.namespace.name)
        most = self._snapshot_keys
        if len(snapshot) > most:
            logger.warning(
                "engine %s dp %d: announcing %d of the %d chunks cached in its namespace "
                "(limits.snapshot_keys)",
                engine.key[0],
                engine.key[1],
                most,
                len(snapshot),
            )
            snapshot = snapshot[-most:] if most else []
        if snapshot:
            self.publish_to(engine, stored_events(snapshot, raw_hashes=self._raw_hashes(engine)))

    def _event_engines(self, namespace: Namespace) -> list[Engine]:
        engines = (self.registry.engine(key) for key in sorted(namespace.engines))
        return [
            e
            for e in engines
            if e is not None and e.config.enable_kv_cache_events and not e.mirrored
        ]

    @staticmethod
    def _raw_hashes(engine: Engine) -> bool:
        first = engine.workers.get(0)
        return first is not None and first.kv_events_raw_hashes

    def _topic(self, engine: Engine) -> str:
        first = engine.workers.get(0)
        if first is not None and first.kv_events_topic and self._client_topics:
            return first.kv_events_topic
        return self.derived_topic(
            engine.config.model.name, engine.key[0], engine.key[1], engine.tenant
        )

    def derived_topic(self, model: str, engine_id: str, dp: int, tenant: str) -> str:
        """The topic the daemon's template gives an engine of ``tenant``."""
        settings = self.settings
        return topic_for(
            settings.topic_template,
            pod=settings.pod_name(),
            tenant=tenant,
            model=model,
            engine_id=engine_id,
            dp=dp,
        )

    def publish_to(self, engine: Engine, events: list[KVEvent]) -> None:
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

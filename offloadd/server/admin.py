"""The operator's requests on the cache: ListCache and ClearCache (``offloadd cache``).

Contract of ``CacheAdmin`` (the event loop's thread; handlers of the OPTIONAL session rule,
``offloadd.server.dispatch``):
- Both are for root and the daemon's user only (``Tenancy.is_admin``): the sender's session,
  or the registration its ``token`` names (used up), says who it is; anyone else is refused
  ``NOT_PERMITTED`` with a message that says who may.
- ``list_cache``: every namespace holding committed chunks or remembered by ``Usage``, with
  its chunks, bytes, tenant, hits, misses, last use and engines; every connected or
  remembered engine with its own.
- ``clear_cache``: exactly one of ``all``, ``namespace``, ``engine_id`` (the namespaces its dp
  indexes use now, or used last); each namespace is dropped as a scheduler's Clear drops it
  (``ChunkCache.clear_namespace``: entries being copied die when their copy ends, so a
  running job never fails for it) and announced by ``Announcer.dropped``. Engines keep their
  sessions and see misses. Answered ``Ok(committed chunks dropped)``.
"""

from __future__ import annotations

import logging

from offloadd.cache.index import ChunkCache
from offloadd.server.checks import Refused
from offloadd.server.commit import Committer
from offloadd.server.peers import Peer, PeerListener
from offloadd.server.registry import Registry
from offloadd.server.state import SessionState
from offloadd.server.tenancy import Tenancy
from offloadd.server.usage import Usage
from protocol.errors import ErrorCode
from protocol.messages import (
    CacheListing,
    ClearCache,
    EngineUsage,
    ListCache,
    NamespaceUsage,
    Ok,
    Reply,
)

__all__ = ["CacheAdmin"]

logger = logging.getLogger(__name__)


class CacheAdmin:
    """ListCache and ClearCache; see the module docstring."""

    def __init__(
        self,
        cache: ChunkCache,
        registry: Registry,
        commit: Committer,
        tenancy: Tenancy,
        usage: Usage,
        peers: PeerListener | None,
    ) -> None:
        self._cache = cache
        self._registry = registry
        self._commit = commit
        self._tenancy = tenancy
        self._usage = usage
        self._peers = peers

    def list_cache(self, identity: bytes, state: SessionState | None, request: ListCache) -> Reply:
        """``CacheListing`` of every namespace and engine."""
        self._admit(identity, state, request.token, "list")
        registry, usage = self._registry, self._usage
        sizes = self._cache.namespace_sizes()
        connected = {engine.key: engine for engine in registry.engines()}
        names = set(sizes)
        engines: list[EngineUsage] = []
        for key in sorted(set(connected) | set(usage.engines())):
            engine, use = connected.get(key), usage.engine(key)
            now = engine.namespace.name if engine is not None and engine.namespace else ""
            namespace = now or (use.namespace if use is not None else "")
            names.add(namespace)
            engines.append(
                EngineUsage(
                    key[0],
                    key[1],
                    namespace,
                    engine is not None,
                    use.hits if use else 0,
                    use.misses if use else 0,
                    use.last_use if use else 0.0,
                )
            )
        namespaces: list[NamespaceUsage] = []
        for name in sorted(names - {""}):
            chunks, nbytes = sizes.get(name, (0, 0))
            use = usage.namespace(name)
            members = [
                f"{e.engine_id}/{e.data_parallel_index}" for e in engines if e.namespace == name
            ]
            namespaces.append(
                NamespaceUsage(
                    name,
                    registry.tenant_of_namespace(name) or "",
                    chunks,
                    nbytes,
                    use.hits if use else 0,
                    use.misses if use else 0,
                    use.last_use if use else 0.0,
                    members,
                )
            )
        return CacheListing(request.request_id, namespaces, engines)

    def clear_cache(
        self, identity: bytes, state: SessionState | None, request: ClearCache
    ) -> Reply:
        """Drop the chunks the request names; ``Ok(chunks dropped)``."""
        peer = self._admit(identity, state, request.token, "clear")
        chosen = sum((request.all, bool(request.namespace), bool(request.engine_id)))
        if chosen != 1:
            raise Refused(
                ErrorCode.BAD_REQUEST, "name exactly one of: all, a namespace, an engine id"
            )
        names = self._names(request)
        dropped = 0
        for name in sorted(names):
            removed = self._cache.clear_namespace(name)
            dropped += len(self._commit.dropped(name, removed))
        logger.info(
            "uid %d cleared %s: %d chunks in %d namespaces (%s)",
            peer.uid,
            "everything"
            if request.all
            else f"namespace {request.namespace}"
            if request.namespace
            else f"engine {request.engine_id}",
            dropped,
            len(names),
            ", ".join(sorted(names)) or "none",
        )
        return Ok(request.request_id, dropped)

    def _names(self, request: ClearCache) -> set[str]:
        """The namespaces a ClearCache names."""
        if request.all:
            return set(self._cache.namespace_sizes()) | {
                namespace.name for namespace in self._registry.namespaces()
            }
        if request.namespace:
            return {request.namespace}
        names = set(self._usage.engine_keys(request.engine_id).values())
        for engine in self._registry.engines():
            if engine.key[0] == request.engine_id and engine.namespace is not None:
                names.add(engine.namespace.name)
        if not names:
            raise Refused(
                ErrorCode.BAD_REQUEST,
                f"no engine {request.engine_id[:64]!r} is connected or has used the cache "
                "since the daemon started (offloadd cache ls lists them)",
            )
        return names

    def _admit(self, identity: bytes, state: SessionState | None, token: bytes, what: str) -> Peer:
        """The sender, when it is root or the daemon's user; else ``Refused``."""
        peer: Peer | None = state.peer if state is not None else None
        if peer is None and token and self._peers is not None:
            registration = self._peers.take(token, identity)
            if registration is not None:
                peer = registration.peer
                registration.close()
        if peer is None:
            raise Refused(
                ErrorCode.NOT_PERMITTED,
                f"cache {what}: the daemon does not know who asks (no valid registration)",
            )
        if not self._tenancy.is_admin(peer):
            raise Refused(
                ErrorCode.NOT_PERMITTED,
                f"cache {what}: only root and the daemon's user "
                f"(uid {self._tenancy.daemon_uid}) may {what} the cache; you are uid {peer.uid}"
                + ("" if peer.remote else " (the socket's group lets ranks in, nothing more)"),
            )
        return peer

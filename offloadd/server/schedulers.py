"""The scheduler-facing requests: Reserve, UpdateHolds and Ack.

A scheduler (role ``scheduler``, vLLM's offloading manager) decides what its ranks store
and load: it reserves room before its ranks store (``prepare_store``), holds the keys of a
request it will load under that request's token so they cannot be evicted (a worker's
``Load(hold=token)`` reads them), and, when it mirrors its namespace's keys
(``offloadd.server.mirrors``), acknowledges the changes its mirror applied so that the bytes of
removed keys may be reused.

Contract of ``Schedulers`` (the event loop's thread only; ``Refused`` for an Error reply):
- ``reserve``: apply the request's hold changes and ack, then reserve the new keys' shards
  (evicting if needed, the evictions announced), answer ``Reserved``. Only the leading keys
  that fit the engine's share of the capacity (``limits.protected_fraction``, counted by
  ``offloadd.server.limits.Protection`` with pins and holds) are reserved; the rest are not (the
  ranks skip them: those chunks are simply not cached).
- ``update_holds``: hold and release keys under tokens, ack; answer ``HoldResult`` (how many
  keys are held, which were not: not in the cache, or beyond the engine's share).
- ``ack``: the scheduler's mirror applied every change up to ``seq``.
- ``acker(mirrors, state)``: the requester, when its mirror applies this request's removals
  before any lookup (FIFO on its socket) and it holds everything it has looked up.
"""

from __future__ import annotations

import logging

from offloadd.cache.index import ChunkCache
from offloadd.server.announce import Announcer
from offloadd.server.checks import Refused, check_keys, check_offloaded, ready_engine
from offloadd.server.limits import Limits, Protection
from offloadd.server.mirrors import Mirrors
from offloadd.server.registry import Engine, Namespace, Registry
from offloadd.server.state import SessionState
from protocol.errors import ErrorCode
from protocol.messages import (
    Ack,
    HoldKeys,
    HoldResult,
    Ok,
    Reply,
    Reserve,
    Reserved,
    UpdateHolds,
)

__all__ = ["Schedulers", "acker"]

logger = logging.getLogger(__name__)


def acker(mirrors: Mirrors, state: SessionState) -> str | None:
    """The requester, when its mirror applies this request's removals before any lookup
    (FIFO on its socket) and it holds everything it has looked up: see ``Reserve``."""
    session_id = state.session.session_id
    return session_id if mirrors.watching(session_id) else None


class Schedulers:
    """Reserve, UpdateHolds and Ack; see the module docstring."""

    def __init__(
        self,
        registry: Registry,
        cache: ChunkCache,
        mirrors: Mirrors,
        announce: Announcer,
        *,
        limits: Limits,
        protection: Protection,
    ) -> None:
        self.registry = registry
        self._cache = cache
        self._mirrors = mirrors
        self._announce = announce
        self._limits = limits
        self._protection = protection

    def _scheduler_checks(self, state: SessionState) -> tuple[Engine, Namespace]:
        if state.session.role != "scheduler":
            raise Refused(ErrorCode.WRONG_ROLE, "only schedulers reserve and hold keys")
        engine, namespace = ready_engine(self.registry, state.session)
        return engine, namespace

    def reserve(self, state: SessionState, request: Reserve) -> Reply:
        """Reserve room for the keys' shards before the ranks store them."""
        engine, namespace = self._scheduler_checks(state)
        check_keys(request.keys, engine, self._limits)
        check_offloaded(request.keys, namespace)
        self._apply_holds(state, engine, namespace, request.holds, request.release, request.ack)
        cache = self._cache
        owner = state.session.session_id
        keys = self._within_budget(engine, namespace, request.keys)
        reservation = cache.reserve(
            namespace.name,
            keys,
            owner,
            namespace.shard_sizes_for_key,
            acker=acker(self._mirrors, state),
        )
        self._announce.chunks_removed(reservation.evicted)
        reserved = [keys[i] for i in reservation.reserved]
        self._protection.reserved(
            engine.key, owner, namespace.name, reserved, namespace.chunk_bytes(reserved)
        )
        return Reserved(request.request_id, reservation.reserved)

    def _within_budget(
        self, engine: Engine, namespace: Namespace, keys: list[bytes]
    ) -> list[bytes]:
        """The leading ``keys`` whose reservation fits the engine's protected bytes."""
        protection = self._protection
        room = protection.room(engine.key)
        sizes = namespace.chunk_bytes(keys)
        if sum(sizes) > room:
            cache = self._cache

            def reserved(name: str, key: bytes) -> bool:
                entry = cache.get(name, key)
                return entry is not None and not entry.committed

            protection.prune(engine.key, reserved)  # reservations the cache ended by itself
            room = protection.room(engine.key)
        fitted = 0
        for size in sizes:
            if size > room:
                break
            room -= size
            fitted += 1
        return keys[:fitted]

    def update_holds(self, state: SessionState, request: UpdateHolds) -> Reply:
        """Hold and release keys under tokens."""
        engine, namespace = self._scheduler_checks(state)
        held, missing = self._apply_holds(
            state, engine, namespace, request.hold, request.release, request.ack
        )
        return HoldResult(request.request_id, held, missing)

    def ack(self, state: SessionState, request: Ack) -> Reply:
        """The session's mirror applied every change up to ``request.seq``."""
        self._cache.ack(state.session.session_id, request.seq)
        return Ok(request.request_id)

    def _apply_holds(
        self,
        state: SessionState,
        engine: Engine,
        namespace: Namespace,
        hold: list[HoldKeys],
        release: list[HoldKeys],
        ack: int,
    ) -> tuple[int, list[bytes]]:
        cache = self._cache
        owner = state.session.session_id
        for item in (*hold, *release):
            check_keys(item.keys, engine, self._limits)
        for item in release:
            cache.release_hold(owner, item.token, item.keys)
            self._protection.release_holds(owner, item.token, namespace.name, item.keys)
        held, missing = 0, []
        for item in hold:
            lost = cache.hold(namespace.name, owner, item.token, item.keys)
            absent = set(lost)
            taken = [key for key in item.keys if key not in absent]
            # Holds beyond the engine's budget (limits.protected_fraction) are given back.
            over = self._protection.take_holds(
                engine.key, owner, item.token, namespace.name, taken, namespace.chunk_bytes(taken)
            )
            if over:
                cache.release_hold(owner, item.token, over)
                lost = lost + over
            held += len(item.keys) - len(lost)
            missing.extend(lost)
        if missing:
            logger.warning(
                "%s: %d held keys were not in the cache", state.session.describe(), len(missing)
            )
        if ack:
            cache.ack(owner, ack)
        return held, missing

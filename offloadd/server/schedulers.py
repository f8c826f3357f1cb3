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
  that fit the engine's share of the capacity (``limits.protected_fraction``, counted by the
  cache with pins and holds, the engine as their account) and its tenant's
  (``limits.tenant_protected_fraction``, all the tenant's engines together) are reserved; the
  rest are not (the ranks skip them: those chunks are simply not cached). A reservation the
  ranks do not store within ``limits.reservation_seconds`` is dropped by the cache. The held
  keys that were not held come back in ``missing``. Read (answered or refused), it is the
  session's ``reserves_read``, and the ``on_reserve_read`` callback wakes the rank stores
  that wait for it.
- ``update_holds``: hold and release keys under tokens, ack; answer ``HoldResult`` (how many
  keys are held, which were not: not in the cache, or beyond the engine's share).
- ``ack``: the scheduler's mirror applied every change up to ``seq``.
- While the daemon stops (``Jobs.draining``), ``reserve`` and ``update_holds`` are refused
  (``SHUTTING_DOWN``; a Reserve's keys counted refused, reason ``draining``): its mirrors were
  told that every key misses (``Mirrors.drain``), and a scheduler treats the refusal as the
  daemon being away. ``ack`` is still taken.
- ``acker(mirrors, state)``: the requester, when its mirror applies this request's removals
  before any lookup (FIFO on its socket) and it holds everything it is loading: no key it
  asked to hold went unheld (``SessionState.unheld``: beyond its share, or in a refused
  message) and was not released since. Otherwise the Reserve's evictions wait for its
  acknowledgement, which its mirror holds back while such a key's load runs
  (``offloadd.vllm.mirror``): a key its mirror answered as a hit stays readable by key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from offloadd.cache.index import ChunkCache
from offloadd.server.announce import Announcer
from offloadd.server.checks import (
    Refused,
    check_keys,
    check_offloaded,
    keys_pass_together,
    ready_engine,
)
from offloadd.server.jobs import Jobs
from offloadd.server.limits import Limits
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


# Tokens a session's ``unheld`` remembers at most: beyond, the oldest are forgotten (only
# that scheduler's own loads can then miss: its engine recomputes them).
MAX_UNHELD_TOKENS = 4096


def acker(mirrors: Mirrors, state: SessionState) -> str | None:
    """The requester, when its mirror applies this request's removals before any lookup
    (FIFO on its socket) and it holds everything it is loading: see the module docstring."""
    session_id = state.session.session_id
    return session_id if mirrors.watching(session_id) and not state.unheld else None


def note_unheld(state: SessionState, token: str, keys: Iterable[bytes]) -> None:
    """Keys ``token``'s load reads that the session asked to hold and does not."""
    unheld = state.unheld
    unheld.setdefault(token, set()).update(keys)
    while len(unheld) > MAX_UNHELD_TOKENS:
        del unheld[next(iter(unheld))]


def note_released(state: SessionState, release: Sequence[HoldKeys]) -> None:
    """Released keys are no longer loading (their load completed)."""
    unheld = state.unheld
    for item in release:
        keys = unheld.get(item.token)
        if keys is not None:
            keys.difference_update(item.keys)
            if not keys:
                del unheld[item.token]


class Schedulers:
    """Reserve, UpdateHolds and Ack; see the module docstring."""

    def __init__(
        self,
        registry: Registry,
        cache: ChunkCache,
        mirrors: Mirrors,
        announce: Announcer,
        jobs: Jobs,
        *,
        limits: Limits,
    ) -> None:
        self.registry = registry
        self._reserve_read: Callable[[], None] = lambda: None
        self._jobs = jobs
        self._cache = cache
        self._mirrors = mirrors
        self._announce = announce
        self._limits = limits

    def on_reserve_read(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` as each Reserve is read (the rank stores waiting for it)."""
        self._reserve_read = callback

    def _scheduler_checks(self, state: SessionState) -> tuple[Engine, Namespace]:
        if state.session.role != "scheduler":
            raise Refused(ErrorCode.WRONG_ROLE, "only schedulers reserve and hold keys")
        engine, namespace = ready_engine(self.registry, state.session)
        return engine, namespace

    def reserve(self, state: SessionState, request: Reserve) -> Reply:
        """Reserve room for the keys' shards before the ranks store them."""
        # Answered or refused, the ranks' stores that name it wait no longer (they run after
        # this handler: ``WaitingStores``).
        state.session.reserves_read = request.request_id
        self._reserve_read()
        try:
            engine, namespace = self._scheduler_checks(state)
            check_keys(request.keys, engine, self._limits)
            self._jobs.refuse_while_draining(len(request.keys))
            check_offloaded(request.keys, namespace)
        except Refused:
            _refused_holds(state, request.holds)
            raise
        _held, missing = self._apply_holds(
            state, engine, namespace, request.holds, request.release, request.ack
        )
        cache = self._cache
        owner = state.session.session_id
        reservation = cache.reserve(
            namespace.name,
            request.keys,
            owner,
            namespace.shard_sizes_for_key,
            acker=acker(self._mirrors, state),
            account=engine.key,  # the leading keys within the engine's budget only,
            tenant=engine.tenant,  # and its tenant's (all its engines together)
        )
        self._announce.chunks_removed(reservation.evicted)
        return Reserved(request.request_id, reservation.reserved, missing)

    def update_holds(self, state: SessionState, request: UpdateHolds) -> Reply:
        """Hold and release keys under tokens."""
        try:
            engine, namespace = self._scheduler_checks(state)
            self._jobs.refuse_while_draining()
        except Refused:
            _refused_holds(state, request.hold)
            raise
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
        items = (*hold, *release)
        if not keys_pass_together([item.keys for item in items], engine, self._limits):
            try:
                for item in items:  # one of them fails: its own refusal
                    check_keys(item.keys, engine, self._limits)
            except Refused:
                _refused_holds(state, hold)
                raise
        cache.release_hold_tokens(owner, [(item.token, item.keys) for item in release])
        note_released(state, release)
        # Missing keys, then those beyond the engine's or its tenant's budget.
        missing = cache.hold_tokens(
            namespace.name,
            owner,
            [(item.token, item.keys) for item in hold],
            account=engine.key,
            tenant=engine.tenant,
        )
        held = sum(len(item.keys) for item in hold) - len(missing)
        if missing:
            not_held = set(missing)
            for item in hold:
                keys = not_held.intersection(item.keys)
                if keys:
                    note_unheld(state, item.token, keys)
            logger.info(
                "%s: %d keys not held (not in the cache, or beyond the engine's share)",
                state.session.describe(),
                len(missing),
            )
        if ack:
            cache.ack(owner, ack)
        return held, missing


def _refused_holds(state: SessionState, hold: Sequence[HoldKeys]) -> None:
    """A refused message took none of its holds (nor applied its releases)."""
    for item in hold:
        if item.keys:
            note_unheld(state, item.token, item.keys)

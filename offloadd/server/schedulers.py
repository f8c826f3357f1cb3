"""The scheduler-facing requests: Reserve, UpdateHolds and Ack.

A scheduler (role ``scheduler``, vLLM's offloading manager) decides what its ranks store
and load: it reserves room before its ranks store (``prepare_store``), holds the keys of a
request it will load under that request's token so they cannot be evicted (a worker's
``Load(hold=token)`` reads them), and, when it mirrors its namespace's keys
(``offloadd.server.mirrors``), acknowledges the changes its mirror applied so that the bytes of
removed keys may be reused.

Contract of ``Schedulers`` (the event loop's thread only; ``Refused`` for an Error reply):
- ``reserve``: apply the request's hold changes and ack, then reserve the new keys' shards
  (evicting if needed: the cache's listener announces it), answer ``Reserved``. Only the
  leading keys that fit the engine's share of the capacity (``limits.protected_fraction``,
  counted by the cache with pins and holds, the engine as their account) and its tenant's
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
  before any lookup (FIFO on its socket) and it holds everything it has looked up: a
  requester that waits for the reply. A posted Reserve (``Reserve.posted``: the vLLM plugin's
  step message) gets none: its scheduler looks keys up in its next step before it reads the
  reply, so its evictions wait for its acknowledgement like anyone's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from offloadd.cache.index import ChunkCache
from offloadd.logs import PerUidLog
from offloadd.server.admission import Admission
from offloadd.server.checks import (
    check_keys,
    keys_pass_together,
)
from offloadd.server.jobs import Jobs
from offloadd.server.limits import Limits
from offloadd.server.mirrors import Mirrors
from offloadd.server.registry import Engine, Namespace, Registry
from offloadd.server.state import SessionState
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
        jobs: Jobs,
        *,
        limits: Limits,
    ) -> None:
        self.registry = registry
        self._reserve_read: Callable[[], None] = lambda: None
        self._cache = cache
        self._mirrors = mirrors
        self._limits = limits
        self._admit = Admission(registry, jobs, limits)  # each kind's, once
        self._log = PerUidLog(logger)  # one line per step message at most: limited per uid

    def on_reserve_read(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` as each Reserve is read (the rank stores waiting for it)."""
        self._reserve_read = callback

    def reserve(self, state: SessionState, request: Reserve) -> Reply:
        """Reserve room for the keys' shards before the ranks store them."""
        # Answered or refused, the ranks' stores that name it wait no longer (they run after
        # this handler: ``WaitingStores``).
        state.session.reserves_read = request.request_id
        self._reserve_read()
        engine, namespace = self._admit.reserve(state, request)
        _held, missing = self._apply_holds(
            state, engine, namespace, request.holds, request.release, request.ack, request.touch
        )
        cache = self._cache
        owner = state.session.session_id
        reservation = cache.reserve(
            namespace.name,
            request.keys,
            owner,
            namespace.shard_sizes_for_key,
            # A posted Reserve's requester may look its evicted keys up before it reads their
            # removal: they wait for its acknowledgement (and a load promised meanwhile finds
            # their bytes; offloadd.vllm.mirror holds that acknowledgement back).
            acker=None if request.posted else acker(self._mirrors, state),
            account=engine.key,  # the leading keys within the engine's budget only,
            tenant=engine.tenant,  # and its tenant's (all its engines together)
        )
        return Reserved(request.request_id, reservation.reserved, missing)

    def update_holds(self, state: SessionState, request: UpdateHolds) -> Reply:
        """Hold and release keys under tokens."""
        engine, namespace = self._admit.update_holds(state)
        held, missing = self._apply_holds(
            state, engine, namespace, request.hold, request.release, request.ack, request.touch
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
        touch: list[bytes],
    ) -> tuple[int, list[bytes]]:
        cache = self._cache
        owner = state.session.session_id
        items = (*hold, *release)
        if not keys_pass_together([item.keys for item in items], engine, self._limits):
            for item in items:  # one of them fails: its own refusal
                check_keys(item.keys, engine, self._limits)
        if touch:  # before this step's evictions: what its requests used stays
            check_keys(touch, engine, self._limits)
            cache.touch(namespace.name, touch)
        cache.release_hold_tokens(owner, [(item.token, item.keys) for item in release])
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
            self._log(
                state.session.uid,
                logging.INFO,
                "%s: %d keys not held (not in the cache, or beyond the engine's share)",
                state.session.describe(),
                len(missing),
            )
        if ack:
            cache.ack(owner, ack)
        return held, missing

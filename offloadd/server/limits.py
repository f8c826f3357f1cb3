"""Bounds per session, per engine and per user (``[limits]``): no client exhausts the daemon.

Pure logic, no I/O; time is injected. Contract:

- ``Limits.keys_problem(keys)``: why a request's keys are refused ("" when they are fine):
  more than ``keys_per_request``, or a key longer than ``key_bytes`` (keys live in the
  index and the journal, so their size is what a client could grow them by).
- ``Limits.session_problem(regions, sessions)``: why a Hello is refused: more regions than
  ``regions_per_session``, or its user has ``sessions_per_uid`` sessions already.
- ``Limits.lease(asked, default)``: the pin lease a Lookup gets: ``asked`` (``0``: the
  default) cut to ``max_lease_seconds``; ``None`` for NaN or a negative lease.
- ``Protection``: the bytes each engine keeps from eviction, counted from its sessions'
  requests: lookup pins (until their lease ends, they are released or the session ends),
  scheduler holds (until released or the session ends) and reservations (until the key
  commits, the namespace is cleared or the session ends). ``take_pins`` and ``take_holds``
  admit what fits in the engine's budget (``protected_fraction`` of the capacity) and return
  what does not, which the daemon then gives back to the cache; reservations are made only
  within ``room``. So an engine never keeps more than its budget from eviction. Keys an
  owner protects already cost nothing more. The count errs on the high side only (an entry
  the cache dropped on its own, e.g. an abandoned reservation, is counted until ``prune`` or
  the session's end), so the bound always holds.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from offloadd.settings import LimitsSettings

__all__ = ["Limits", "Protection"]

EngineKey = tuple[str, int]
_Key = tuple[str, bytes]  # (namespace, key)


class Limits:
    """The ``[limits]`` settings' checks that need no state."""

    def __init__(self, settings: LimitsSettings) -> None:
        self.settings = settings

    def keys_problem(self, keys: Sequence[bytes]) -> str:
        """Why ``keys`` are refused ("" when they are fine)."""
        most = self.settings.keys_per_request
        if len(keys) > most:
            return f"{len(keys)} keys: more than limits.keys_per_request = {most}"
        longest = self.settings.key_bytes
        for key in keys:
            if len(key) > longest:
                return (
                    f"a key of {len(key)} bytes ({key[:16].hex()}...): more than "
                    f"limits.key_bytes = {longest}"
                )
        return ""

    def session_problem(self, regions: int, sessions: int) -> str:
        """Why a Hello with ``regions`` from a user with ``sessions`` others is refused."""
        settings = self.settings
        if regions > settings.regions_per_session:
            return (
                f"{regions} regions: limits.regions_per_session is {settings.regions_per_session}"
            )
        if sessions >= settings.sessions_per_uid:
            return f"this user has {sessions} sessions already (limits.sessions_per_uid)"
        return ""

    def lease(self, asked: float, default: float) -> float | None:
        """The lease a pin gets, or None for a lease that is no number of seconds."""
        if math.isnan(asked) or asked < 0:
            return None
        return min(asked or default, self.settings.max_lease_seconds)


@dataclass(eq=False)
class _Owner:
    """What one session protects."""

    engine: EngineKey
    pins: dict[_Key, tuple[int, float]] = field(default_factory=dict)  # -> (bytes, expiry)
    expiries: list[tuple[float, _Key]] = field(default_factory=list)  # heap, may hold stale
    holds: dict[tuple[str, _Key], list[int]] = field(default_factory=dict)  # -> [bytes, count]
    reserved: dict[_Key, int] = field(default_factory=dict)  # -> bytes
    total: int = 0


class Protection:
    """Bytes kept from eviction per engine; see the module docstring."""

    def __init__(self, budget: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self._clock = clock
        self._owners: dict[str, _Owner] = {}
        self._by_engine: dict[EngineKey, set[str]] = {}
        self._reserver: dict[_Key, str] = {}

    # -- reading --------------------------------------------------------------------------

    def used(self, engine: EngineKey) -> int:
        """Bytes the engine's sessions protect now (expired pins dropped first)."""
        now = self._clock()
        total = 0
        for owner in self._by_engine.get(engine, ()):
            record = self._owners[owner]
            self._expire(record, now)
            total += record.total
        return total

    def protected_by(self, owner: str) -> int:
        """Bytes ``owner`` protects (pins possibly expired)."""
        record = self._owners.get(owner)
        return record.total if record is not None else 0

    # -- pins -----------------------------------------------------------------------------

    def take_pins(
        self,
        engine: EngineKey,
        owner: str,
        namespace: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        lease: float,
    ) -> list[bytes]:
        """Count ``owner``'s new pins on ``keys``; returns the keys beyond the budget (their
        pins must be released), none of which this owner pinned before."""
        record = self._record(owner, engine)
        expiry = self._clock() + lease
        room = self.budget - self.used(engine)
        refused: list[bytes] = []
        for key, nbytes in zip(keys, sizes, strict=True):
            name = (namespace, key)
            old = record.pins.get(name)
            if old is None:
                if nbytes > room:
                    refused.append(key)
                    continue
                room -= nbytes
                record.total += nbytes
            elif old[1] >= expiry:
                continue
            record.pins[name] = (nbytes, expiry)
            heapq.heappush(record.expiries, (expiry, name))
        if len(record.expiries) > 2 * len(record.pins) + 64:  # released pins leave stale items
            record.expiries = [(expiry, name) for name, (_, expiry) in record.pins.items()]
            heapq.heapify(record.expiries)
        return refused

    def release_pins(self, owner: str, namespace: str, keys: Sequence[bytes]) -> None:
        """``owner`` released its pins on ``keys``."""
        record = self._owners.get(owner)
        if record is None:
            return
        for key in keys:
            found = record.pins.pop((namespace, key), None)
            if found is not None:
                record.total -= found[0]

    # -- holds ----------------------------------------------------------------------------

    def take_holds(
        self,
        engine: EngineKey,
        owner: str,
        token: str,
        namespace: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
    ) -> list[bytes]:
        """Count holds of ``(owner, token)`` on ``keys`` (one per occurrence, as the cache
        counts them); returns the occurrences beyond the budget, to release again."""
        record = self._record(owner, engine)
        room = self.budget - self.used(engine)
        refused: list[bytes] = []
        for key, nbytes in zip(keys, sizes, strict=True):
            name = (token, (namespace, key))
            held = record.holds.get(name)
            if held is not None:
                held[1] += 1
                continue
            if nbytes > room:
                refused.append(key)
                continue
            room -= nbytes
            record.total += nbytes
            record.holds[name] = [nbytes, 1]
        return refused

    def release_holds(self, owner: str, token: str, namespace: str, keys: Sequence[bytes]) -> None:
        """One hold of ``(owner, token)`` on each of ``keys`` was released."""
        record = self._owners.get(owner)
        if record is None:
            return
        for key in keys:
            name = (token, (namespace, key))
            held = record.holds.get(name)
            if held is None:
                continue
            held[1] -= 1
            if held[1] <= 0:
                del record.holds[name]
                record.total -= held[0]

    # -- reservations ---------------------------------------------------------------------

    def room(self, engine: EngineKey) -> int:
        """Bytes the engine may still protect."""
        return max(0, self.budget - self.used(engine))

    def reserved(
        self,
        engine: EngineKey,
        owner: str,
        namespace: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
    ) -> None:
        """The cache reserved ``keys`` for ``owner`` (within ``room``, which the caller
        checked first)."""
        record = self._record(owner, engine)
        for key, nbytes in zip(keys, sizes, strict=True):
            name = (namespace, key)
            if name in record.reserved:
                continue
            record.reserved[name] = nbytes
            record.total += nbytes
            self._reserver[name] = owner

    def committed(self, namespace: str, keys: Sequence[bytes]) -> None:
        """``keys`` committed: their reservations are over."""
        for key in keys:
            self._end_reservation((namespace, key))

    def cleared(self, namespace: str) -> None:
        """Every entry of ``namespace`` was removed: its pins and reservations are gone."""
        for record in self._owners.values():
            for name in [name for name in record.pins if name[0] == namespace]:
                record.total -= record.pins.pop(name)[0]
            for name in [name for name in record.reserved if name[0] == namespace]:
                self._end_reservation(name)

    def prune(self, engine: EngineKey, reserved: Callable[[str, bytes], bool]) -> None:
        """Drop reservations of the engine that the cache no longer holds as reserved."""
        for owner in self._by_engine.get(engine, ()):
            record = self._owners[owner]
            for name in [name for name in record.reserved if not reserved(*name)]:
                self._end_reservation(name)

    # -- sessions -------------------------------------------------------------------------

    def forget(self, owner: str) -> None:
        """The session ended: the cache dropped its pins, holds and reservations."""
        record = self._owners.pop(owner, None)
        if record is None:
            return
        for name in record.reserved:
            self._reserver.pop(name, None)
        owners = self._by_engine.get(record.engine)
        if owners is not None:
            owners.discard(owner)
            if not owners:
                del self._by_engine[record.engine]

    # -- internals ------------------------------------------------------------------------

    def _record(self, owner: str, engine: EngineKey) -> _Owner:
        record = self._owners.get(owner)
        if record is None:
            record = self._owners[owner] = _Owner(engine)
            self._by_engine.setdefault(engine, set()).add(owner)
        return record

    def _end_reservation(self, name: _Key) -> None:
        owner = self._reserver.pop(name, None)
        if owner is None:
            return
        record = self._owners[owner]
        record.total -= record.reserved.pop(name)

    @staticmethod
    def _expire(record: _Owner, now: float) -> None:
        heap = record.expiries
        while heap and heap[0][0] <= now:
            expiry, name = heapq.heappop(heap)
            found = record.pins.get(name)
            if found is not None and found[1] <= expiry:
                del record.pins[name]
                record.total -= found[0]

"""Keys the scheduler's mirror lacks, asked of a daemon with tiers below its arena.

Pure logic (no vLLM, no sockets). The mirror holds only the arena's committed keys; a chunk
on the daemon's disk or cluster tier is found by asking the daemon, which then promotes it
into the arena. vLLM calls ``lookup`` once per key while it schedules, so nothing is asked
there: ``lookup`` queues the key and answers ``RETRY`` (vLLM keeps scanning the request's
later keys, which queue too, and retries the request on a later step), and ``take_queued``
hands the step's keys to the manager, which sends one ``Lookup`` per request inside the
step's one message at ``on_schedule_end`` (nothing waits for the answers) and reports each
answer with ``answered`` when it arrives, on a later step or the background thread.

Contract of ``TierProbes``:
- ``lookup(req_id, key)``: ``PENDING`` while the daemon said the key is being promoted (or
  stored) and ``recheck`` seconds have not passed; ``MISS`` while it said the key is in no
  tier and ``miss_ttl`` seconds have not passed; otherwise ``RETRY`` and the key is queued.
  A key whose promotion failed (a corrupted copy) never reaches the mirror: after
  ``recheck`` it is asked again, and the daemon's miss ends it.
- ``take_queued``: the keys to ask about, one run per request; each is asked from now on:
  it answers ``RETRY`` without being queued again until its answer or ``recheck`` seconds.
- ``unanswered(keys)``: the ask was not sent, or refused: the keys are asked again.
- ``answered(keys, hits, pending)``: the daemon's ``LookupResult`` for ``keys`` as asked:
  ``hits`` leading keys are committed (the mirror has them already), ``pending`` indices are
  on their way, and the first key after the hits that is not pending is a miss (the daemon
  stops looking there, so later keys are left unknown).
- ``forget(keys)``: drops what was said about keys (one that left the arena may be in a
  tier now, so an earlier miss is stale).
- ``forget_expired``: drops answers past their time, so the memory stays bounded by what
  a few seconds of lookups asked.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence

__all__ = ["Probe", "TierProbes"]

RECHECK_SECONDS = 0.5  # a pending key not in the mirror by then is asked again
MISS_TTL_SECONDS = 1.0  # a miss is believed this long (another node may publish the key)


class Probe(enum.Enum):
    PENDING = "pending"
    MISS = "miss"
    RETRY = "retry"


class TierProbes:
    """What the daemon said about keys missing from the mirror; see the module docstring."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        recheck: float = RECHECK_SECONDS,
        miss_ttl: float = MISS_TTL_SECONDS,
    ) -> None:
        self._clock = clock
        self._recheck = recheck
        self._miss_ttl = miss_ttl
        self._pending: dict[bytes, float] = {}  # key -> when to ask again
        self._missing: dict[bytes, float] = {}  # key -> when the miss expires
        self._asked: dict[bytes, float] = {}  # key -> when to ask again if no answer came
        self._queued: dict[str, dict[bytes, None]] = {}  # request -> keys in lookup order

    def lookup(self, req_id: str, key: bytes) -> Probe:
        now = self._clock()
        if self._pending.get(key, 0.0) > now:
            return Probe.PENDING
        if self._missing.get(key, 0.0) > now:
            return Probe.MISS
        if self._asked.get(key, 0.0) > now:
            return Probe.RETRY  # its answer is on its way
        self._queued.setdefault(req_id, {})[key] = None
        return Probe.RETRY

    @property
    def has_queued(self) -> bool:
        """Some key waits to be asked about in the step's message."""
        return bool(self._queued)

    @property
    def awaiting(self) -> bool:
        """Some key was asked about and its answer has not come (one whose wait ran out
        counts until ``forget_expired``)."""
        return bool(self._asked)

    def take_queued(self) -> list[list[bytes]]:
        """The keys to ask about, one list per request in lookup order; taken once."""
        queued, self._queued = self._queued, {}
        until = self._clock() + self._recheck
        for keys in queued.values():
            for key in keys:
                self._asked[key] = until
        return [list(keys) for keys in queued.values()]

    def unanswered(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._asked.pop(key, None)

    def answered(self, keys: Sequence[bytes], hits: int, pending: Sequence[int]) -> None:
        now = self._clock()
        on_the_way = set(pending)
        for key in keys:
            self._asked.pop(key, None)
        for index in range(hits, len(keys)):
            key = keys[index]
            if index in on_the_way:
                self._pending[key] = now + self._recheck
                self._missing.pop(key, None)
            else:
                self._missing[key] = now + self._miss_ttl
                self._pending.pop(key, None)
                break
        for key in keys[:hits]:
            self._pending.pop(key, None)
            self._missing.pop(key, None)

    def forget(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._pending.pop(key, None)
            self._missing.pop(key, None)
            self._asked.pop(key, None)

    def forget_expired(self) -> None:
        now = self._clock()
        for table in (self._pending, self._missing, self._asked):
            for key in [key for key, until in table.items() if until <= now]:
                del table[key]

    def __len__(self) -> int:
        return len(self._pending) + len(self._missing) + len(self._asked)

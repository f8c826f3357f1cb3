"""The lifecycle of a cache entry: its states and the legal moves between them, in one table.

``ChunkCache`` keeps an entry's state as one byte per row (``offloadd.cache.columns``) and
changes it only through ``step``, so ``PHASES`` and ``MARKS`` below are the whole statement
of what an entry may go through (compare h11's ``_state.py``).

A state is a *phase* and a set of *marks*. Phases, one at a time:

- ``FREE``: no entry (the row is unused). ``ALLOCATE`` makes it ``PENDING``.
- ``PENDING``: in the index, not visible; its shards are being stored. ``COMMIT`` (the last
  shard written) makes it ``COMMITTED``; ``UNLINK`` (removed, evicted, abandoned, its
  reservation released) makes it ``DEAD``.
- ``COMMITTED``: visible (lookups hit it). ``UNLINK`` makes it ``REMOVED``, or ``LEAVING``
  (``UNLINK_WATCHED``) when a watcher may still show it.
- ``LEAVING``: removed, its bytes kept until every watcher acknowledged; ``ACK``: ``REMOVED``.
- ``DEAD`` / ``REMOVED``: out of the index, never visible again (``REMOVED`` was visible);
  ``RELEASE`` frees the row and its extents once no mark is left.

Marks, each taken in some phases and kept only in some (a move whose target phase does not
keep a mark the entry has is illegal: the cache drops it first):

- ``RESERVED``: a scheduler reserved the pending entry (``RESERVE`` / ``UNRESERVE``).
- ``WRITING``: shards are being written (``START_WRITE`` / ``STOP_WRITE``); kept when the
  pending entry dies, until its copies end.
- ``READING``: loads in flight (``START_READ`` / ``STOP_READ``).
- ``HELD``: a scheduler's request holds it (``HOLD`` / ``UNHOLD``).
- ``PINNED``: a lookup's lease pins it (``PIN`` / ``UNPIN``); only while committed.

A mark's count lives in the cache's side dicts; taking a mark already taken leaves the state
as it is, and the cache drops a mark when its count falls to zero.

Contract: ``step(state, event)`` returns the next state byte or raises ``IllegalTransition``
(the cache has a bug; nothing was changed); ``step_all`` does the same for an array of
states. Both are one lookup in tables compiled from ``PHASES`` and ``MARKS`` at import.
``allowed(event)`` tells, per state byte, whether ``event`` is legal (``RELEASE``'s is the
cache's test of whether a row may be freed). ``record()`` makes ``step`` and ``step_all`` log
every move, for tests that check the moves a real cache makes; callers must look both up
on this module when they call them, not bind them at import.

A free row's byte is 0, as is a new pending entry's: a free row is one without a key.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "COMMITTED",
    "DEAD",
    "HELD",
    "LEAVING",
    "MARKS",
    "PHASES",
    "PINNED",
    "READING",
    "RESERVED",
    "WRITING",
    "Event",
    "IllegalTransition",
    "Mark",
    "Phase",
    "allowed",
    "decode",
    "describe",
    "record",
    "step",
    "step_all",
]

# The state byte's bits. Phase bits:
COMMITTED = 1
DEAD = 2  # out of the index; its extents wait for what still uses them
LEAVING = 128  # removed, waiting for watchers to acknowledge (offloadd.cache.watchers)
# Mark bits (a bit is set exactly when the row has an entry in the cache's matching dict):
WRITING = 4
READING = 8
HELD = 16
PINNED = 32
RESERVED = 64


class Phase(enum.Enum):
    """Where an entry is in its life; see the module docstring."""

    FREE = "free"
    PENDING = "pending"
    COMMITTED = "committed"
    LEAVING = "leaving"
    DEAD = "dead"
    REMOVED = "removed"


class Mark(enum.IntFlag):
    """What keeps an entry busy besides its phase; see the module docstring."""

    WRITING = WRITING
    READING = READING
    HELD = HELD
    PINNED = PINNED
    RESERVED = RESERVED


class Event(enum.IntEnum):
    """What the cache does to an entry; the integers index the compiled tables."""

    ALLOCATE = 0
    COMMIT = 1
    UNLINK = 2
    UNLINK_WATCHED = 3
    ACK = 4
    RELEASE = 5
    RESERVE = 6
    UNRESERVE = 7
    START_WRITE = 8
    STOP_WRITE = 9
    START_READ = 10
    STOP_READ = 11
    HOLD = 12
    UNHOLD = 13
    PIN = 14
    UNPIN = 15


P, E = Phase, Event

# phase -> event -> next phase.
PHASES: dict[Phase, dict[Event, Phase]] = {
    P.FREE: {E.ALLOCATE: P.PENDING},
    P.PENDING: {E.COMMIT: P.COMMITTED, E.UNLINK: P.DEAD},
    P.COMMITTED: {E.UNLINK: P.REMOVED, E.UNLINK_WATCHED: P.LEAVING},
    P.LEAVING: {E.ACK: P.REMOVED},
    P.DEAD: {E.RELEASE: P.FREE},
    P.REMOVED: {E.RELEASE: P.FREE},
}

_LOADABLE = frozenset({P.COMMITTED, P.LEAVING, P.REMOVED})
# mark -> (take, drop, phases it may be taken in, phases that keep it).
MARKS: dict[Mark, tuple[Event, Event, frozenset[Phase], frozenset[Phase]]] = {
    Mark.RESERVED: (E.RESERVE, E.UNRESERVE, frozenset({P.PENDING}), frozenset({P.PENDING})),
    Mark.WRITING: (
        E.START_WRITE,
        E.STOP_WRITE,
        frozenset({P.PENDING}),
        frozenset({P.PENDING, P.DEAD}),
    ),
    # Held entries are read even after their removal (begin_reads_held).
    Mark.READING: (E.START_READ, E.STOP_READ, _LOADABLE, _LOADABLE),
    # A removed entry a watcher may still show can be held (hold finds it while leaving).
    Mark.HELD: (E.HOLD, E.UNHOLD, frozenset({P.COMMITTED, P.LEAVING}), _LOADABLE),
    Mark.PINNED: (E.PIN, E.UNPIN, frozenset({P.COMMITTED}), frozenset({P.COMMITTED})),
}

del P, E

_PHASE_BITS: dict[Phase, int] = {
    Phase.FREE: 0,
    Phase.PENDING: 0,
    Phase.COMMITTED: COMMITTED,
    Phase.LEAVING: COMMITTED | DEAD | LEAVING,
    Phase.DEAD: DEAD,
    Phase.REMOVED: COMMITTED | DEAD,
}
_PHASE_MASK = COMMITTED | DEAD | LEAVING
_BY_BITS = {bits: phase for phase, bits in _PHASE_BITS.items() if phase is not Phase.FREE}
_ILLEGAL = 0xFF  # never a legal state (DEAD with PINNED and RESERVED)


def decode(state: int) -> tuple[Phase, Mark] | None:
    """The phase and marks of a state byte (``PENDING`` for 0); None for no legal state."""
    phase = _BY_BITS.get(state & _PHASE_MASK)
    marks = Mark(state & ~_PHASE_MASK & 0xFF)
    if phase is None or any(mark in marks and phase not in MARKS[mark][3] for mark in MARKS):
        return None
    return phase, marks


def describe(state: int) -> str:
    """``state`` in words, e.g. ``COMMITTED+HELD+READING``."""
    decoded = decode(state)
    if decoded is None:
        return f"no legal state ({state:#010b})"
    phase, marks = decoded
    return "+".join([phase.name, *(mark.name or "" for mark in Mark if mark in marks)])


def _compile() -> list[bytes]:
    tables = [bytearray([_ILLEGAL]) * 256 for _ in Event]
    for state in range(256):
        decoded = decode(state)
        if decoded is None:
            continue
        phase, marks = decoded
        sources = [phase, Phase.FREE] if state == 0 else [phase]
        for source in sources:
            for event, target in PHASES[source].items():
                if all(target in MARKS[mark][3] for mark in Mark if mark in marks):
                    tables[event][state] = _PHASE_BITS[target] | marks
        for mark, (take, drop, taken_in, _kept_in) in MARKS.items():
            if phase in taken_in:
                tables[take][state] = state | mark
            if mark in marks:
                tables[drop][state] = (
                    state & ~int(mark) & 0xFF
                )  # int: ~ on a Mark complements within Mark
    return [bytes(table) for table in tables]


_NEXT = _compile()
_NEXT_ARRAYS: list[npt.NDArray[np.uint8]] = [np.frombuffer(table, np.uint8) for table in _NEXT]


class IllegalTransition(RuntimeError):
    """The cache tried a move the lifecycle table does not allow (a bug in the cache)."""

    def __init__(self, state: int, event: int) -> None:
        self.state = state
        self.event = Event(event)
        super().__init__(f"illegal lifecycle move: {self.event.name} from {describe(state)}")


def allowed(event: Event) -> bytes:
    """Per state byte, 1 where ``event`` is legal, else 0."""
    return bytes(int(nxt != _ILLEGAL) for nxt in _NEXT[event])


def _step(state: int, event: int) -> int:
    nxt = _NEXT[event][state]
    if nxt == _ILLEGAL:
        raise IllegalTransition(state, event)
    return nxt


def _step_all(states: npt.NDArray[Any], event: int) -> npt.NDArray[np.uint8]:
    nxt: npt.NDArray[np.uint8] = _NEXT_ARRAYS[event][states]
    bad = np.flatnonzero(nxt == _ILLEGAL)
    if len(bad):
        raise IllegalTransition(int(states[bad[0]]), event)
    return nxt


step: Callable[[int, int], int] = _step
"""The state after ``event`` from ``state``; raises ``IllegalTransition`` if not allowed."""

step_all: Callable[[npt.NDArray[Any], int], npt.NDArray[np.uint8]] = _step_all
"""``step`` over an array of states (all legal, or ``IllegalTransition`` and no result)."""


@contextmanager
def record() -> Iterator[list[tuple[int, Event, int]]]:
    """Log every move ``step`` and ``step_all`` make, as ``(state, event, next)``."""
    global step, step_all
    moves: list[tuple[int, Event, int]] = []

    def recording(state: int, event: int) -> int:
        nxt = _step(state, event)
        moves.append((state, Event(event), nxt))
        return nxt

    def recording_all(states: npt.NDArray[Any], event: int) -> npt.NDArray[np.uint8]:
        nxt = _step_all(states, event)
        moves.extend(zip(map(int, states), [Event(event)] * len(nxt), map(int, nxt), strict=True))
        return nxt

    step, step_all = recording, recording_all
    try:
        yield moves
    finally:
        step, step_all = _step, _step_all

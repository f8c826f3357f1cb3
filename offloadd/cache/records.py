"""What the cache hands its callers: entry handles and the results of its calls (pure).

``Entry`` is a handle on one row (``offloadd.cache.rows``): a light object that reads its
row's state when asked. ``Handles`` gives them out: while a handle is alive, the cache hands
out that same object for its row, so handles compare and hash by identity as entries always
did. When the row is finally released (dead and nothing uses its extents), its handle keeps
the last state: ``dead``, ``offsets == []``, and ``committed`` as it was.

The rest are plain results: ``LookupOutcome`` (``lookup``), ``ShardWrite`` and
``StoreReservation`` (``begin_store``), ``Reservation`` (``reserve``), ``Reads``
(``begin_reads``), ``RestoredChunk`` (``restore``) and
``CacheStats``, whose ``refused`` counts keys by the ``REFUSED_*`` reason.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from offloadd.cache.lifecycle import COMMITTED, DEAD

if TYPE_CHECKING:
    from offloadd.cache.protections import Protections
    from offloadd.cache.rows import Rows

__all__ = [
    "REFUSED_ACK",
    "REFUSED_BUDGET",
    "REFUSED_EXPIRED",
    "REFUSED_FULL",
    "REFUSED_TENANT",
    "CacheStats",
    "Entry",
    "Handles",
    "LookupOutcome",
    "Reads",
    "Reservation",
    "RestoredChunk",
    "ShardWrite",
    "StoreReservation",
]

# Why keys were refused (``CacheStats.refused``): nothing evictable made room; beyond the
# account's room (``budget``); reserved, but the acknowledgement its room waited for had not
# come when the ranks stored it.
REFUSED_FULL = "full"
REFUSED_BUDGET = "budget"
REFUSED_ACK = "ack"
# Beyond its tenant's room (``tenant_budget``: all the tenant's engines together); reserved,
# but not stored within ``reservation_lease`` (the reservation was dropped).
REFUSED_TENANT = "tenant"
REFUSED_EXPIRED = "expired"

_SWEEP_MIN = 4096


class Entry:
    """A handle on one cached chunk (a row of the cache); see the module docstring.

    ``offsets[i]`` / ``sizes[i]`` locate shard ``i`` (``offsets`` is empty once the extents
    are freed). ``written`` and ``writing`` are bitmasks over shards; ``pins`` maps an owner
    to its lease expiry (None: no pins). ``committed`` stays True after removal so that a
    caller handed a removed entry can tell whether it was ever announced; ``dead`` means
    removed from the index.
    """

    # One reference to what it reads (its Handles), not two: a million live handles.
    __slots__ = ("__weakref__", "_final", "_of", "_row", "key", "namespace", "sizes")

    def __init__(
        self, of: Handles, row: int, namespace: str, key: bytes, sizes: tuple[int, ...]
    ) -> None:
        self._of = of
        self._row = row  # -1 once the row was released
        self._final = (False, 0)  # (committed, written) when released
        self.namespace = namespace
        self.key = key
        self.sizes = sizes

    @property
    def committed(self) -> bool:
        """Every shard was written (stays True after removal)."""
        row = self._row
        return self._final[0] if row < 0 else bool(self._of.rows.state.v[row] & COMMITTED)

    @property
    def dead(self) -> bool:
        """Removed from the index: never visible again."""
        return self._row < 0 or bool(self._of.rows.state.v[self._row] & DEAD)

    @property
    def offsets(self) -> list[int]:
        """Arena offset of each shard; empty once the extents are freed."""
        row = self._row
        if row < 0:
            return []
        return self._of.rows.offsets_of(row)

    def offset(self, shard: int) -> int:
        """``offsets[shard]``, without building the list (a load's plan reads one per key)."""
        row = self._row
        if row < 0:
            raise IndexError(f"{self!r}: its extents are freed")
        return self._of.rows.shard_offset(row, shard)

    @property
    def written(self) -> int:
        """Bitmask of the shards written."""
        row = self._row
        if row < 0:
            return self._final[1]
        return self._of.rows.written_mask(row)

    @property
    def writing(self) -> int:
        """Bitmask of the shards being written."""
        return self._of.rows.writing.get(self._row, 0) if self._row >= 0 else 0

    @property
    def readers(self) -> int:
        """Loads in flight."""
        return self._of.rows.readers.get(self._row, 0) if self._row >= 0 else 0

    @property
    def holds(self) -> int:
        """Scheduler holds on it."""
        return self._of.guards.row_holds.get(self._row, 0) if self._row >= 0 else 0

    @property
    def pins(self) -> dict[str, float] | None:
        """Owner -> lease expiry, or None."""
        return self._of.guards.pins.get(self._row) if self._row >= 0 else None

    @property
    def nbytes(self) -> int:
        """Payload bytes over all shards (before alignment)."""
        return sum(self.sizes)

    def __repr__(self) -> str:
        state = "dead" if self.dead else "committed" if self.committed else "pending"
        return (
            f"Entry({self.namespace!r}, {self.key.hex()}, {state}, sizes={self.sizes}, "
            f"written={self.written:#b}, writing={self.writing:#b}, readers={self.readers})"
        )


class Handles:
    """The ``Entry`` handles given out, one per row while it is alive (see the module
    docstring). References of handles that died are swept out now and then."""

    __slots__ = ("_refs", "_sweep_at", "guards", "rows")

    def __init__(self, rows: Rows, guards: Protections) -> None:
        self.rows = rows
        self.guards = guards
        self._refs: dict[int, weakref.ref[Entry]] = {}
        self._sweep_at = _SWEEP_MIN

    def __len__(self) -> int:
        return len(self._refs)

    def get(self, row: int) -> Entry:
        """The row's handle: the one given out before if it is still alive."""
        ref = self._refs.get(row)
        if ref is not None:
            entry = ref()
            if entry is not None:
                return entry
        rows = self.rows
        key = rows.keys[row]
        assert key is not None
        shape = rows.shape.v[row]
        entry = Entry(self, row, rows.namespaces[rows.ns.v[row]], key, rows.shapes[shape])
        refs = self._refs
        refs[row] = weakref.ref(entry)
        if len(refs) >= self._sweep_at:
            for dead in [row for row, ref in refs.items() if ref() is None]:
                del refs[dead]
            self._sweep_at = max(_SWEEP_MIN, 2 * len(refs))
        return entry

    def release(self, row: int) -> None:
        """The row is about to be freed: its handle, if alive, keeps its last state."""
        ref = self._refs.pop(row, None)
        entry = ref() if ref is not None else None
        if entry is not None:
            rows = self.rows
            entry._final = (bool(rows.state.v[row] & COMMITTED), rows.written_mask(row))
            entry._row = -1


@dataclass(frozen=True, slots=True)
class LookupOutcome:
    """``hits``: leading committed keys; ``pending``: indices of existing uncommitted keys;
    ``pinned``: hits pinned by this lookup."""

    hits: int
    pending: list[int]
    pinned: int


@dataclass(frozen=True, slots=True)
class RestoredChunk:
    """A committed chunk found again after a restart (see ``ChunkCache.restore``)."""

    namespace: str
    key: bytes
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ShardWrite:
    """One shard copy to perform: ``keys[index]``'s ``shard`` goes to ``[offset, offset+size)``.

    ``part`` is the writer's bit among the entry's writes: the shard itself, or for a shard
    several writers fill together (``begin_store(writers=...)``), this writer's index.
    """

    index: int
    entry: Entry
    shard: int
    offset: int
    size: int
    part: int = -1

    @property
    def bit(self) -> int:
        """This write's bit in the entry's written and writing masks."""
        return 1 << (self.shard if self.part < 0 else self.part)


@dataclass(slots=True)
class StoreReservation:
    """What ``begin_store`` reserved; indices refer to the ``keys`` passed in.

    ``writes`` are the copies to perform (then ``finish_store``), ``skipped`` needs no copy,
    ``refused`` found no room, ``evicted`` are entries evicted to make room (the caller
    announces the committed ones as removed).
    """

    writes: list[ShardWrite]
    skipped: list[int]
    refused: list[int]
    evicted: list[Entry]


@dataclass(slots=True)
class Reservation:
    """What ``reserve`` did with the ``keys`` passed in (indices): ``reserved`` got room,
    ``refused`` did not, the rest were committed or already being stored."""

    reserved: list[int]
    refused: list[int]
    evicted: list[Entry]


@dataclass(slots=True, eq=False)
class Reads:
    """Chunks held for reading (``begin_reads``, then ``finish_reads``), by index row: a
    step's loads read hundreds of chunks, and an ``Entry`` costs ~1.7 us to make and free,
    so handles are made only when asked for (``entries``). A row being read is never
    released, so ``rows`` stay valid until the reads end. Empty, with the ``missing`` keys,
    when nothing was taken."""

    rows: list[int]
    missing: list[bytes]
    handles: Handles | None = field(default=None, repr=False)

    @property
    def entries(self) -> list[Entry]:
        """The chunks read, as handles (made now: the hot path reads ``rows``)."""
        handles = self.handles
        return [] if handles is None else [handles.get(row) for row in self.rows]


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters and gauges of a ``ChunkCache``; ``*_keys`` and ``stores_refused`` count keys."""

    capacity: int
    used_bytes: int
    entries: int
    committed: int
    pending: int
    lookups: int
    hit_keys: int
    miss_keys: int
    stores_refused: int
    evictions: int
    committed_bytes: int
    held: int = 0  # entries held by scheduler requests
    leaving: int = 0  # removed entries whose space waits for a mirror's acknowledgement
    # Refused keys by reason (REFUSED_*): they add up to ``stores_refused`` and the keys
    # beyond an account's room, which ``stores_refused`` leaves out.
    refused: dict[str, int] = field(default_factory=dict)
    unplaced: int = 0  # reserved entries waiting for their room (a mirror's acknowledgement)

"""Host chunk cache index: entries, two-phase stores, loads, pins and eviction.

The pure core of the cache (``docs/design.md``, section 4): no I/O, no threads, no torch.
The daemon calls it from its one asyncio thread and copies the bytes itself between a
``begin_*`` and its ``finish_*``. Time is injected (``clock``) so that pin leases are testable.

Contract of ``ChunkCache`` (the names mirror vLLM's ``OffloadingManager``):

- Entries are keyed by ``(namespace, key)``; a key is only looked up inside its namespace. An
  entry holds one shard per rank (a replicated layout has one shard), each in its own arena
  extent; in vLLM's canonical layout one shard that every rank fills with its fragments
  (``begin_store(writers=...)``). An entry is *pending* until every shard (every writer) is
  written, then *committed* (visible).
- ``lookup``: how many leading keys are committed (the prefix hit), which keys are pending;
  touches the hits and, with ``pin_owner`` and a lease, pins them until ``clock() + lease``.
- ``begin_store`` (vLLM's prepare_store) reserves this rank's shard of each key: committed keys
  and shards already written or in flight are skipped; a pending key is joined; a new key gets
  all its shards allocated, evicting if needed. ``finish_store`` (complete_store) ends those
  copies; an entry commits when its last shard is written and is returned once, so the caller
  announces it. ``finish_store(ok=False)`` makes nothing visible; the shard may be stored again.
- ``abandon``: the session owning in-flight writes went away; their pending entries are dropped
  at once and can never become visible. The ``finish_store`` of those writes must still follow.
- ``begin_load`` (prepare_load) takes every key or none: all committed (or removed and still
  kept for a mirror's acknowledgement) -> each is held against eviction until ``finish_load``
  (complete_load); otherwise nothing is taken and the missing keys are returned.
- Never evicted: entries being loaded, being written, pinned by an unexpired lease, or keyed
  by any key of the store that needs the room. A pending entry with no copy in flight *is*
  evictable, so a rank that never stores its shard cannot leak space. Eviction runs only if
  enough evictable bytes exist (a dry run first). A key that cannot be placed is refused, and
  so is every later key of that request (a prefix gains nothing from later chunks alone).
- ``remove`` / ``clear_namespace`` drop entries at once; an entry with a copy in flight is
  *dead* (gone from the index, never visible) and its extents are freed when that copy ends.
- Schedulers (vLLM's manager) work ahead of their ranks: ``reserve`` allocates new keys for a
  later ``begin_store(..., allocate=False)`` and protects them from eviction until they commit
  or ``release_reservations``; ``hold`` protects committed keys for one request until
  ``release_hold`` (and ``begin_load_held`` reads them, even if removed meanwhile);
  ``hold_tokens`` holds for several requests in one call.
- Protected bytes have one ledger (``offloadd.cache.ledger``), kept here as pins, holds and
  reservations are taken and dropped: ``protected_bytes(owner)``. With ``budget`` (per
  engine) or ``tenant_budget`` (per tenant, all its engines together) and an ``account`` and
  ``tenant`` on ``lookup``, ``hold`` or ``reserve``, a new protection is taken only within
  ``room(account, tenant)``, the smaller of the two; what does not fit is never taken (not
  pinned, returned as not held, neither reserved nor refused; counted as ``budget`` or
  ``tenant`` in ``CacheStats.refused`` for reservations).
- With ``reservation_lease``, a reservation lasts that many seconds: one whose entry has not
  committed by then ends: with no copy writing it right then it is dropped and freed at once,
  counted as ``expired``; one being written is left a plain pending entry (its store has
  begun; eviction may take it once the copy ends).
  Lapsed reservations are dropped whenever the cache counts a room, reserves, allocates a
  store or reports ``stats``.
- A scheduler that mirrors a namespace's keys (``watch``) may still show a removed key as
  present: a removed committed entry of a watched namespace keeps its extents until every
  watcher acknowledged the removal (``ack``; see ``offloadd.cache.watchers``). ``acker`` on a
  call names the watcher that applies that call's removals before anything else (it asked).
- A key ``reserve`` found room for only once other watchers acknowledge is reserved *unplaced*
  (no extents yet); it is placed, in reservation order, when an acknowledgement or a freed
  hold or read makes the room, and ``on_placed``'s callback is then called (with nothing,
  after the cache's state is whole; it must not call back into the cache synchronously).
  ``unplaced(namespace, keys)`` places what fits now and counts the keys still waiting, so a
  rank's store can wait for them instead of meeting them in ``begin_store``, which drops a
  key still unplaced (refused, reason ``ack``).
- ``used_bytes <= capacity`` always; extents of live and dead-but-busy entries never overlap.
- Misuse that can only be a caller bug (a write finished twice, a load finished without its
  begin, a shard index outside the key's layout) raises ValueError and changes nothing.

Layout (what keeps a million entries small and a lookup cheap): an entry is a *row*, an
index into numpy columns (``offloadd.cache.columns``): its state bits (changed only through
``offloadd.cache.lifecycle.step``, whose table is the entry lifecycle), its namespace and
shard sizes (as small ids of interned values), and where its shard offsets begin in a pool
column. The only per-entry Python objects are its key (the bytes the request brought) and
the row number a per-namespace ``dict`` maps the key to. What only a few entries have at a
time (shards being written, readers, pins, holds, reservations) lives in small dicts keyed by
row, with a state bit saying whether to look. The eviction order is a ``RowPolicy`` over rows
(``offloadd.cache.policy``), and the allocator keeps no object per extent either.

Callers get ``Entry`` handles (``ShardWrite.entry``, ``LoadReservation.entries``, the lists
of evicted, removed and committed entries, ``get``): light objects that read their row's
state when asked. While a handle is alive, the cache hands out that same object for its row,
so handles compare and hash by identity as entries always did. When the row is finally
released (dead and nothing uses its extents), its handles keep the last state: ``dead``,
``offsets == []``, and ``committed`` as it was.
"""

from __future__ import annotations

import heapq
import time
import weakref
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice, pairwise
from operator import itemgetter
from typing import cast

import numpy as np

from offloadd.cache import lifecycle
from offloadd.cache.allocator import ExtentAllocator
from offloadd.cache.columns import Column
from offloadd.cache.ledger import TENANT, Ledger
from offloadd.cache.lifecycle import Event
from offloadd.cache.policy import RowPolicy, make_row_policy
from offloadd.cache.watchers import Watchers

__all__ = [
    "REFUSED_ACK",
    "REFUSED_BUDGET",
    "REFUSED_EXPIRED",
    "REFUSED_FULL",
    "REFUSED_TENANT",
    "CacheStats",
    "ChunkCache",
    "Entry",
    "LoadReservation",
    "LookupOutcome",
    "Reservation",
    "RestoredChunk",
    "ShardWrite",
    "StoreReservation",
]

# State bits of a row (offloadd.cache.lifecycle); each state change is a lifecycle.step. A
# mark's bit is set exactly when the row has an entry in the matching dict: _writing (shards
# being written), _readers (loads in flight), _row_holds, _pins, _reserved_by.
_COMMITTED = lifecycle.COMMITTED
_DEAD = lifecycle.DEAD
_WRITING = lifecycle.WRITING
_READING = lifecycle.READING
_HELD = lifecycle.HELD
_PINNED = lifecycle.PINNED
_RESERVED = lifecycle.RESERVED
_LEAVING = lifecycle.LEAVING
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
_BUSY = _WRITING | _READING | _HELD | _RESERVED  # never evicted (pins are checked apart)
# Per state byte: whether the row may be freed (dead, and no copy, hold or watcher uses it).
_RELEASABLE = lifecycle.allowed(Event.RELEASE)
# Events as plain ints, for the hot paths.
_ALLOCATE = int(Event.ALLOCATE)
_COMMIT = int(Event.COMMIT)
_UNLINK = int(Event.UNLINK)
_UNLINK_WATCHED = int(Event.UNLINK_WATCHED)
_ACK = int(Event.ACK)
_RELEASE = int(Event.RELEASE)
_RESERVE = int(Event.RESERVE)
_UNRESERVE = int(Event.UNRESERVE)
_START_WRITE = int(Event.START_WRITE)
_STOP_WRITE = int(Event.STOP_WRITE)
_START_READ = int(Event.START_READ)
_STOP_READ = int(Event.STOP_READ)
_HOLD = int(Event.HOLD)
_UNHOLD = int(Event.UNHOLD)
_PIN = int(Event.PIN)
_UNPIN = int(Event.UNPIN)


class Entry:
    """A handle on one cached chunk (a row of the cache); see the module docstring.

    ``offsets[i]`` / ``sizes[i]`` locate shard ``i`` (``offsets`` is empty once the extents
    are freed). ``written`` and ``writing`` are bitmasks over shards; ``pins`` maps an owner
    to its lease expiry (None: no pins). ``committed`` stays True after removal so that a
    caller handed a removed entry can tell whether it was ever announced; ``dead`` means
    removed from the index.
    """

    __slots__ = ("__weakref__", "_cache", "_final", "_row", "key", "namespace", "sizes")

    def __init__(
        self, cache: ChunkCache, row: int, namespace: str, key: bytes, sizes: tuple[int, ...]
    ) -> None:
        self._cache = cache
        self._row = row  # -1 once the row was released
        self._final = (False, 0)  # (committed, written) when released
        self.namespace = namespace
        self.key = key
        self.sizes = sizes

    @property
    def committed(self) -> bool:
        """Every shard was written (stays True after removal)."""
        row = self._row
        return self._final[0] if row < 0 else bool(self._cache._state.v[row] & _COMMITTED)

    @property
    def dead(self) -> bool:
        """Removed from the index: never visible again."""
        return self._row < 0 or bool(self._cache._state.v[self._row] & _DEAD)

    @property
    def offsets(self) -> list[int]:
        """Arena offset of each shard; empty once the extents are freed."""
        row = self._row
        if row < 0:
            return []
        return self._cache._row_offsets(row)

    def offset(self, shard: int) -> int:
        """``offsets[shard]``, without building the list (a load's plan reads one per key)."""
        row = self._row
        if row < 0:
            raise IndexError(f"{self!r}: its extents are freed")
        return self._cache._shard_offset(row, shard)

    @property
    def written(self) -> int:
        """Bitmask of the shards written."""
        row = self._row
        if row < 0:
            return self._final[1]
        return self._cache._written_mask(row)

    @property
    def writing(self) -> int:
        """Bitmask of the shards being written."""
        return self._cache._writing.get(self._row, 0) if self._row >= 0 else 0

    @property
    def readers(self) -> int:
        """Loads in flight."""
        return self._cache._readers.get(self._row, 0) if self._row >= 0 else 0

    @property
    def holds(self) -> int:
        """Scheduler holds on it."""
        return self._cache._row_holds.get(self._row, 0) if self._row >= 0 else 0

    @property
    def pins(self) -> dict[str, float] | None:
        """Owner -> lease expiry, or None."""
        return self._cache._pins.get(self._row) if self._row >= 0 else None

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


def _overlaps(taken: list[tuple[int, int]], start: int, end: int) -> bool:
    i = bisect_left(taken, (start, start))
    if i > 0 and taken[i - 1][1] > start:
        return True
    return i < len(taken) and taken[i][0] < end


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


@dataclass(slots=True)
class LoadReservation:
    """``entries`` held for reading (then ``finish_load``), or the ``missing`` keys and none."""

    entries: list[Entry]
    missing: list[bytes]


@dataclass(slots=True, eq=False)
class Reads:
    """What a ``LoadReservation`` holds, by index row rather than by handle (``begin_reads``,
    then ``finish_reads``): a step's loads read hundreds of chunks, and an ``Entry`` cost
    ~1.7 us to make and free each. A row being read is never released, so ``rows`` stay
    valid until the reads end. Empty, with the ``missing`` keys, when nothing was taken."""

    rows: list[int]
    missing: list[bytes]


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


_NO_ROWS: dict[bytes, int] = {}
_NO_PINS: dict[str, float] = {}
# bytes.translate table: a state byte -> 1 if committed, else 0.
_COMMITTED_BYTE = bytes(int(bool(state & _COMMITTED)) for state in range(256))
_SWEEP_MIN = 4096


class ChunkCache:
    """The host chunk cache index over one arena of ``capacity`` bytes.

    See the module docstring for the contract. Methods:

    - ``lookup(namespace, keys, *, pin_owner=None, lease=0.0) -> LookupOutcome``
    - ``begin_store(namespace, keys, shard, shard_sizes) -> StoreReservation``, then
      ``finish_store(writes, ok) -> list[Entry]`` (newly committed) exactly once per write;
      ``abandon(writes)`` in between if the writing session goes away.
    - ``begin_load(namespace, keys) -> LoadReservation``, then ``finish_load(entries)``.
    - ``release(namespace, keys, owner) -> int`` / ``release_owner(owner) -> int``: drop pins.
    - ``remove(namespace, keys)`` / ``clear_namespace(namespace) -> list[Entry]``: the removed
      committed entries (to announce).
    - ``keys_in(namespace)``, ``get(namespace, key)``, ``stats()``.

    ``shard_sizes(key)`` gives the byte size of each shard of a new key (one size per rank, or a
    single size for a replicated layout); it is only called when a key is first allocated.
    """

    def __init__(
        self,
        capacity: int,
        *,
        policy: str = "lru",
        align: int = 4096,
        boundary: int = 0,
        clock: Callable[[], float] = time.monotonic,
        budget: int | None = None,
        tenant_budget: int | None = None,
        reservation_lease: float | None = None,
    ) -> None:
        # ``boundary``: no shard extent straddles a multiple of it (see ExtentAllocator).
        self._alloc = ExtentAllocator(capacity, align, boundary=boundary)
        self._policy: RowPolicy = make_row_policy(policy)
        self._clock = clock
        self._tables: dict[str, dict[bytes, int]] = {}  # namespace -> key -> row
        # Rows: columns, the keys, and the rows free for reuse.
        self._state = Column(np.uint8)
        self._ns = Column(np.int32)  # namespace id: _namespaces[id]
        self._shape = Column(np.int32)  # shard sizes id: _shapes[id]
        self._base = Column(np.int32)  # first of the row's shard offsets in _offsets
        self._keys: list[bytes | None] = []  # None: a free row
        self._free_rows: list[int] = []
        # The shard offset pool, in units of ``align`` (4 bytes each while that reaches).
        self._align = self._alloc.align
        wide = self._alloc.capacity // self._align >= 1 << 32
        self._offsets = Column(np.int64 if wide else np.uint32)
        self._pool_top = 0
        self._free_runs: dict[int, list[int]] = {}  # shard count -> free pool runs
        self._namespaces: list[str] = []
        self._namespace_ids: dict[str, int] = {}
        self._shapes: list[tuple[int, ...]] = []
        self._shape_ids: dict[tuple[int, ...], int] = {}
        self._needs: list[tuple[int, ...]] = []  # each shape's sizes as allocated (aligned)
        self._footprints: list[int] = []  # arena bytes of each shape
        self._fits: list[bool] = []  # whether each shape could ever fit the arena
        self._nbytes: list[int] = []  # payload bytes of each shape (what protection costs)
        # What few rows have at a time; a state bit says whether a row is in each.
        self._written: dict[int, int] = {}  # pending rows: shards (or writers) written
        # Pending rows whose one shard several writers fill (begin_store(writers=...)).
        self._writers: dict[int, int] = {}
        self._writing: dict[int, int] = {}
        self._readers: dict[int, int] = {}
        self._row_holds: dict[int, int] = {}
        self._pins: dict[int, dict[str, float]] = {}
        self._reserved_by: dict[int, str] = {}
        # The bytes each owner protects by those three, per engine against ``budget`` and per
        # tenant against ``tenant_budget``.
        self._ledger = Ledger(budget, tenant_budget)
        # Reservations end by this time (``reservation_lease``): row -> deadline, and the
        # rows of each reserve call with their deadline, oldest first (the lease is one for
        # all, the clock never goes back); rows whose deadline differs or is gone are stale.
        self._lease = reservation_lease
        self._reserved_until: dict[int, float] = {}
        self._deadlines: deque[tuple[float, list[int]]] = deque()
        # Handles given out, so that a row's handle is always the same object while it lives.
        # References of handles that died are swept out now and then (_handle).
        self._handles: dict[int, weakref.ref[Entry]] = {}
        self._sweep_at = _SWEEP_MIN
        # owner -> rows it pins, so that a session's end does not scan the whole index.
        self._owners: dict[str, set[int]] = {}
        self._entries = 0
        self._committed = 0
        self._committed_bytes = 0
        self._lookups = 0
        self._hit_keys = 0
        self._miss_keys = 0
        self._stores_refused = 0
        self._refused: dict[str, int] = {}
        self._evictions = 0
        # Reserved rows whose extents wait for room on its way (removals other watchers must
        # acknowledge), in reservation order; their extents are placed when it comes.
        self._unplaced: dict[int, None] = {}
        self._unplaced_bytes = 0
        self._on_placed: Callable[[], None] | None = None
        self._watchers = Watchers()
        self._leaving_bytes = 0
        # (owner, token) -> key -> (row, count): holds of a scheduler's requests.
        self._holds: dict[tuple[str, str], dict[bytes, tuple[int, int]]] = {}
        self._hold_tokens: dict[str, set[str]] = {}
        self._reservations: dict[str, set[int]] = {}

    # -- restart ----------------------------------------------------------------------------

    def restore(self, chunks: Iterable[RestoredChunk]) -> int:
        """Rebuild committed entries after a restart (only into an empty cache).

        ``chunks`` come in the order they were committed, which seeds the eviction order.
        A chunk whose extents are unaligned, outside the arena, overlap an earlier chunk's or
        each other is skipped (a damaged record must never alias live bytes), and so is one
        whose extent straddles the allocator's boundary (written by a daemon that did not cut
        the arena). Returns how many were kept.
        """
        if self._entries:
            raise ValueError("restore needs an empty cache")
        align, capacity = self._alloc.align, self._alloc.capacity
        straddles = self._alloc.straddles
        kept: list[RestoredChunk] = []
        taken: list[tuple[int, int]] = []  # (start, end) of accepted extents, kept sorted
        for chunk in chunks:
            spans = [
                (offset, offset + self._alloc.alloc_size(size))
                for offset, size in zip(chunk.offsets, chunk.sizes, strict=True)
            ]
            if any(start % align or end > capacity or start < 0 for start, end in spans):
                continue
            if any(straddles(start, end - start) for start, end in spans):
                continue
            if any(_overlaps(taken, start, end) for start, end in spans):
                continue
            ordered = sorted(spans)
            if any(end > start for (_, end), (start, _) in pairwise(ordered)):
                continue  # its own shards overlap
            for span in spans:
                insort(taken, span)
            kept.append(chunk)
        self._alloc = ExtentAllocator.with_allocated(
            self._alloc.capacity,
            [(o, z) for c in kept for o, z in zip(c.offsets, c.sizes, strict=True)],
            align,
            boundary=self._alloc.boundary,
        )
        rows = []
        for chunk in kept:
            shape = self._shape_id(tuple(chunk.sizes))
            rows.append(self._new_row(chunk.namespace, chunk.key, shape, list(chunk.offsets)))
            self._committed += 1
            self._committed_bytes += sum(chunk.sizes)
        state = self._state.a
        state[rows] = lifecycle.step_all(state[rows], Event.COMMIT)
        return len(kept)

    def committed_chunks(self) -> list[RestoredChunk]:
        """Every committed entry, least recently used first (to journal a compact state)."""
        state, namespace_of, shape_of = self._state.v, self._ns.v, self._shape.v
        chunks = []
        for row in self._policy.candidates():
            if state[row] & _COMMITTED:
                key = self._keys[row]
                assert key is not None
                chunks.append(
                    RestoredChunk(
                        self._namespaces[namespace_of[row]],
                        key,
                        tuple(self._row_offsets(row)),
                        self._shapes[shape_of[row]],
                    )
                )
        return chunks

    # -- lookup -----------------------------------------------------------------------------

    def lookup(
        self,
        namespace: str,
        keys: Sequence[bytes],
        *,
        pin_owner: str | None = None,
        lease: float = 0.0,
        account: Hashable | None = None,
        tenant: Hashable | None = None,
    ) -> LookupOutcome:
        """Prefix hit and pending keys; touches the hits and pins them if asked.

        With an ``account`` (and ``tenant``), ``pin_owner``'s new pins count towards them, and
        a hit whose pin would exceed their room is not pinned (pins the owner holds already
        cost nothing and are extended).
        """
        # Every key probed at C speed (map), then the state bytes of the rows up to the first
        # missing key read at C speed too (itemgetter, translate): a hit costs no bytecode.
        get = self._tables.get(namespace, _NO_ROWS).get
        rows: list[int | None] = list(map(get, keys))
        try:
            found = rows.index(None)
        except ValueError:
            found = len(rows)
        hits = 0
        if found:
            state = self._state.v
            if found == 1:
                states = bytes((state[rows[0]],))  # type: ignore[index]
            else:
                states = bytes(itemgetter(*rows[:found])(state))
            hits = states.translate(_COMMITTED_BYTE).find(0)
            if hits < 0:
                hits = found
        pending: list[int] = []
        if hits < len(keys):
            state = self._state.v
            for i in range(hits, len(keys)):
                row = rows[i]
                if row is not None and not state[row] & _COMMITTED:
                    pending.append(i)
        if hits < len(rows):
            del rows[hits:]
        hit_rows = cast("list[int]", rows)
        self._lookups += 1
        self._hit_keys += hits
        self._miss_keys += len(keys) - hits
        pinned = 0
        if hits:
            self._policy.touch(hit_rows)
            if pin_owner is not None and lease > 0:
                now = self._clock()
                expiry = now + lease
                room = self._room(account, tenant, now)
                if room == float("inf"):
                    for row in hit_rows:
                        self._pin(row, pin_owner, expiry, account, tenant)
                    pinned = hits
                else:
                    pins, nbytes, shape_of = self._pins, self._nbytes, self._shape.v
                    for row in hit_rows:
                        if pin_owner not in pins.get(row, _NO_PINS):
                            cost = nbytes[shape_of[row]]
                            if cost > room:
                                continue
                            room -= cost
                        self._pin(row, pin_owner, expiry, account, tenant)
                        pinned += 1
        return LookupOutcome(hits, pending, pinned)

    # -- store ------------------------------------------------------------------------------

    def begin_store(
        self,
        namespace: str,
        keys: Sequence[bytes],
        shard: int,
        shard_sizes: Callable[[bytes], tuple[int, ...]],
        *,
        allocate: bool = True,
        acker: str | None = None,
        writers: int = 0,
    ) -> StoreReservation:
        """Reserve ``shard`` of each key for writing, allocating and evicting as needed.

        With ``allocate=False`` only keys that already have a pending entry (a scheduler's
        ``reserve``) are written; the others are skipped, never refused. With ``writers``
        the chunk is one shard that ``writers`` writers fill together (disjoint bytes of one
        extent: vLLM's canonical layout) and ``shard`` is this writer's index; the entry
        commits when every one of them has written. A pending entry that writers of another
        count are filling is skipped (they finish it).
        """
        if shard < 0:
            raise ValueError(f"shard must not be negative, got {shard}")
        if writers and shard >= writers:
            raise ValueError(f"writer {shard} out of range for {writers} writers")
        bit = 1 << shard
        self._expire(self._clock())
        part = shard if writers else -1
        res = StoreReservation([], [], [], [])
        table = self._tables.get(namespace, _NO_ROWS)
        protected: frozenset[bytes] | None = None
        checked: tuple[int, ...] | None = None  # the last new key's sizes, checked (see reserve)
        shape = -1
        for i, key in enumerate(keys):
            row = table.get(key)
            if row is not None and row in self._unplaced and not self._place_unplaced(row):
                # Its room still waits for another mirror: too late for this store.
                self._unlink(row, evicted=False)
                self._free_if_idle(row)
                self._refuse(REFUSED_ACK, 1)
                res.skipped.append(i)
                continue
            if row is not None:
                active = self._written.get(row, 0) | self._writing.get(row, 0)
                if self._state.v[row] & _COMMITTED or active & bit:
                    res.skipped.append(i)
                    continue
                sizes = self._shapes[self._shape.v[row]]
                if writers:
                    if len(sizes) != 1 or (active and self._writers.get(row, 1) != writers):
                        res.skipped.append(i)  # another layout's writers fill it
                        continue
                    self._set_writers(row, writers)
                    self._start_writing(row, bit)
                    offset = self._offsets.v[self._base.v[row]] * self._align
                    res.writes.append(ShardWrite(i, self._handle(row), 0, offset, sizes[0], part))
                    continue
                if shard >= len(sizes):
                    self._cancel(res.writes)
                    raise ValueError(
                        f"shard {shard} out of range for {len(sizes)} shards of "
                        f"{key.hex()} in namespace {namespace!r}"
                    )
                self._start_writing(row, bit)
                offset = self._offsets.v[self._base.v[row] + shard] * self._align
                res.writes.append(ShardWrite(i, self._handle(row), shard, offset, sizes[shard]))
                continue
            if not allocate:
                res.skipped.append(i)
                continue
            sizes = shard_sizes(key)
            if sizes is not checked:
                sizes = tuple(sizes)
                bad = len(sizes) != 1 if writers else shard >= len(sizes)
                if not sizes or bad or min(sizes) <= 0:
                    self._cancel(res.writes)
                    raise ValueError(f"bad shard sizes {sizes} for shard {shard} of {key.hex()}")
                shape, checked = self._shape_id(sizes), sizes
            if protected is None:
                protected = frozenset(keys)
            row = self._new_entry(namespace, key, shape, protected, res.evicted, acker)
            if row is None:
                res.refused.extend(range(i, len(keys)))
                self._stores_refused += len(keys) - i
                self._refuse(REFUSED_FULL, len(keys) - i)
                break
            self._start_writing(row, bit)
            table = self._tables[namespace]
            if writers:
                self._set_writers(row, writers)
                offset = self._offsets.v[self._base.v[row]] * self._align
                res.writes.append(ShardWrite(i, self._handle(row), 0, offset, sizes[0], part))
                continue
            offset = self._offsets.v[self._base.v[row] + shard] * self._align
            res.writes.append(ShardWrite(i, self._handle(row), shard, offset, sizes[shard]))
        return res

    def _set_writers(self, row: int, writers: int) -> None:
        if writers == 1:
            self._writers.pop(row, None)
        else:
            self._writers[row] = writers

    def reserve(
        self,
        namespace: str,
        keys: Sequence[bytes],
        owner: str,
        shard_sizes: Callable[[bytes], tuple[int, ...]],
        *,
        acker: str | None = None,
        account: Hashable | None = None,
        tenant: Hashable | None = None,
    ) -> Reservation:
        """Allocate every shard of each new key for a later ``begin_store(allocate=False)``.

        Committed and pending keys are left out. A key that finds no room is refused, and so is
        every later key (as in ``begin_store``). Reserved entries are not evictable until they
        commit, ``release_reservations(owner)`` or their lease ends. With an ``account`` (and
        ``tenant``), only the leading keys whose bytes (all of them, reserved or not) fit their
        room are looked at; the others are neither reserved nor refused.
        """
        res = Reservation([], [], [])
        now = self._clock()
        self._expire(now)
        if account is not None or tenant is not None:
            within = self._within_room(keys, shard_sizes, self._room(account, tenant, now))
            if len(within) < len(keys):
                known = self._tables.get(namespace, _NO_ROWS)
                beyond = sum(key not in known for key in keys[len(within) :])
                tenants = self._ledger.binding(account, tenant) == TENANT
                self._refuse(REFUSED_TENANT if tenants else REFUSED_BUDGET, beyond)
                keys = within
        table = self._tables.get(namespace, _NO_ROWS)
        protected = frozenset(keys)
        reserved_by = self._reserved_by
        mine: set[int] | None = None  # the owner's reserved rows
        # Keys of one group get the same sizes tuple: checked and interned once, not per key.
        checked: tuple[int, ...] | None = None
        shape = -1
        new: list[tuple[int, bytes, int]] = []
        leased: list[int] = []  # the rows reserved, for their lease
        seen: set[bytes] = set()  # a key named twice is reserved once
        for i, key in enumerate(keys):
            if key in table or key in seen:
                continue
            seen.add(key)
            sizes = shard_sizes(key)
            if sizes is not checked:
                sizes = tuple(sizes)
                if not sizes or min(sizes) <= 0:
                    raise ValueError(f"bad shard sizes {sizes} for {key.hex()}")
                shape, checked = self._shape_id(sizes), sizes
            new.append((i, key, shape))
        if new:
            need = sum(self._footprints[shape] for _i, _key, shape in new)
            self._make_room(namespace, need, protected, res.evicted, acker)
        alloc, footprints = self._alloc, self._footprints
        for i, key, shape in new:
            row: int | None = None
            footprint = footprints[shape]
            on_its_way = self._leaving_bytes - self._unplaced_bytes
            if alloc.free_bytes >= footprint or on_its_way < footprint:
                row = self._new_entry(namespace, key, shape, protected, res.evicted, acker)
            if (
                row is None
                and self._fits[shape]
                and self._leaving_bytes - self._unplaced_bytes >= footprint
            ):
                row = self._new_unplaced(namespace, key, shape)
            if row is None:
                res.refused.extend(range(i, len(keys)))
                self._stores_refused += len(keys) - i
                self._refuse(REFUSED_FULL, len(keys) - i)
                break
            table = self._tables[namespace]
            reserved_by[row] = owner
            self._state.v[row] = lifecycle.step(self._state.v[row], _RESERVE)
            self._ledger.charge(owner, self._nbytes[shape], account, tenant)
            if mine is None:
                mine = self._reservations.setdefault(owner, set())
            mine.add(row)
            res.reserved.append(i)
            leased.append(row)
        if self._lease is not None and leased:
            deadline = now + self._lease
            self._reserved_until.update(dict.fromkeys(leased, deadline))
            self._deadlines.append((deadline, leased))
        return res

    def _expire(self, now: float) -> None:
        """Drop the reservations whose lease ended by ``now`` (see the module docstring)."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            deadline, rows = deadlines.popleft()
            for row in rows:
                if self._reserved_until.get(row) != deadline:
                    continue  # committed, released or re-reserved since
                self._end_reservation(row)
                if row not in self._writing:  # else its store has begun: plain pending
                    self._refuse(REFUSED_EXPIRED, 1)
                    self._unlink(row, evicted=False)
                    self._free_if_idle(row)

    def _refuse(self, reason: str, count: int) -> None:
        if count:
            self._refused[reason] = self._refused.get(reason, 0) + count

    def _make_room(
        self,
        namespace: str,
        need: int,
        protected: frozenset[bytes],
        evicted: list[Entry],
        acker: str | None,
    ) -> None:
        """Evict for a whole reservation of ``need`` bytes at once, in policy order.

        Room that other watchers must acknowledge first comes a moment later: then one more
        reservation's worth is evicted ahead (at most an eighth of the arena), so that the
        next reservation finds its room already free instead of waiting. Nothing is evicted
        unless the evictable bytes cover ``need`` (a dry run first).
        """
        alloc = self._alloc
        found_now = alloc.free_bytes
        found_later = self._leaving_bytes - self._unplaced_bytes
        target = need
        if not self._watchers.only(namespace, acker):
            target += min(need, alloc.capacity // 8)
        if found_now >= need and found_now + found_later >= target:
            return
        victims: list[int] = []
        for row in self._evictable(namespace, protected, self._clock()):
            if self._frees_at_once(row, acker):
                victims.append(row)
                found_now += self._footprint(row)
            elif found_now + found_later < target:
                victims.append(row)
                found_later += self._footprint(row)
            if found_now + found_later >= target:
                break
        if found_now + found_later < need:
            return  # not enough: each key tries on its own (_place), the rest are refused
        for row in victims:
            self._evict(row, evicted, acker)

    def _new_unplaced(self, namespace: str, key: bytes, shape: int) -> int:
        """A pending row whose extents are placed once its room is acknowledged."""
        row = self._new_row(namespace, key, shape, [0] * len(self._needs[shape]))
        self._unplaced[row] = None
        self._unplaced_bytes += self._footprints[shape]
        return row

    def _place_unplaced(self, row: int) -> bool:
        """Give the unplaced ``row`` its extents if they fit now."""
        shape = self._shape.v[row]
        offsets = self._try_alloc(shape)
        if offsets is None:
            return False
        del self._unplaced[row]
        self._unplaced_bytes -= self._footprints[shape]
        pool, align, base = self._offsets.v, self._align, self._base.v[row]
        for slot, offset in enumerate(offsets, base):
            pool[slot] = offset // align
        return True

    def _place_waiting(self) -> None:
        """Place the unplaced rows, in reservation order, as far as the free room goes."""
        placed = False
        for row in list(self._unplaced):
            if not self._place_unplaced(row):
                break
            placed = True
        if placed and self._on_placed is not None:
            self._on_placed()

    def on_placed(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` whenever waiting unplaced keys got their extents."""
        self._on_placed = callback

    def unplaced(self, namespace: str, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` are reserved unplaced still, placing those that fit now."""
        if not self._unplaced:
            return 0
        table = self._tables.get(namespace, _NO_ROWS)
        waiting = 0
        for key in keys:
            row = table.get(key)
            if row is not None and row in self._unplaced and not self._place_unplaced(row):
                waiting += 1
        return waiting

    @staticmethod
    def _within_room(
        keys: Sequence[bytes], shard_sizes: Callable[[bytes], tuple[int, ...]], room: float
    ) -> Sequence[bytes]:
        """The leading ``keys`` whose bytes fit ``room``."""
        if room == float("inf"):
            return keys
        for i, key in enumerate(keys):
            cost = sum(shard_sizes(key))
            if cost > room:
                return keys[:i]
            room -= cost
        return keys

    def release_reservations(self, owner: str) -> int:
        """Drop ``owner``'s reserved entries that have not committed (its scheduler left).

        Shards being written keep their extents until their ``finish_store``; nothing of a
        dropped entry ever becomes visible. Returns how many entries were dropped.
        """
        rows = self._reservations.pop(owner, set())
        refund, nbytes, shape_of = self._ledger.refund, self._nbytes, self._shape.v
        until = self._reserved_until
        for row in rows:
            del self._reserved_by[row]
            until.pop(row, None)
            self._state.v[row] = lifecycle.step(self._state.v[row], _UNRESERVE)
            refund(owner, nbytes[shape_of[row]])
            self._unlink(row, evicted=False)
            self._free_if_idle(row)
        if rows and self._unplaced:
            self._place_waiting()
        return len(rows)

    def _new_entry(
        self,
        namespace: str,
        key: bytes,
        shape: int,
        protected: frozenset[bytes],
        evicted: list[Entry],
        acker: str | None,
    ) -> int | None:
        needs = self._needs[shape]
        offsets: list[int] | None = None
        if len(needs) == 1 and self._fits[shape]:
            # The usual case, first as _place would try it: one shard, room without evicting.
            # A failed try changes nothing, so _place may try again.
            offset = self._alloc.take(needs[0])
            if offset is not None:
                offsets = [offset]
        if offsets is None:
            offsets = self._place(namespace, shape, protected, evicted, acker)
            if offsets is None:
                return None
        return self._new_row(namespace, key, shape, offsets)

    def finish_store(self, writes: Sequence[ShardWrite], ok: bool) -> list[Entry]:
        """End the copies of ``writes``; returns the entries that became committed."""
        seen: set[tuple[int, int]] = set()
        for w in writes:
            row = w.entry._row
            token = (row, w.bit)
            if row < 0 or token in seen or not self._writing.get(row, 0) & w.bit:
                raise ValueError(f"shard {w.shard} of {w.entry!r} is not being written")
            seen.add(token)
        committed: list[Entry] = []
        state = self._state.v
        freed = False
        for w in writes:
            entry = w.entry
            row = entry._row
            bit = w.bit
            self._stop_writing(row, bit)
            if state[row] & _DEAD:
                self._free_if_idle(row)
                freed = True
                continue
            if ok:
                written = self._written.get(row, 0) | bit
                if written == (1 << self._writers.get(row, len(entry.sizes))) - 1:
                    self._written.pop(row, None)
                    self._writers.pop(row, None)
                    self._end_reservation(row)  # a reservation never outlives the pending entry
                    state[row] = lifecycle.step(state[row], _COMMIT)
                    self._committed += 1
                    self._committed_bytes += entry.nbytes
                    committed.append(entry)
                else:
                    self._written[row] = written
        if freed and self._unplaced:
            self._place_waiting()
        return committed

    def _end_reservation(self, row: int) -> None:
        owner = self._reserved_by.pop(row, None)
        if owner is not None:
            self._reserved_until.pop(row, None)
            self._state.v[row] = lifecycle.step(self._state.v[row], _UNRESERVE)
            self._ledger.refund(owner, self._nbytes[self._shape.v[row]])
            reserved = self._reservations[owner]
            reserved.discard(row)
            if not reserved:
                del self._reservations[owner]

    def abandon(self, writes: Sequence[ShardWrite]) -> None:
        """Drop the pending entries of in-flight ``writes`` whose session went away.

        They leave the index now and never become visible; their extents are freed by the
        ``finish_store`` of their last copy in flight. Committed entries and writes already
        finished are left alone.
        """
        state = self._state.v
        for w in writes:
            row = w.entry._row
            if row < 0 or state[row] & (_DEAD | _COMMITTED):
                continue
            if self._writing.get(row, 0) & w.bit:
                self._unlink(row, evicted=False)

    # -- load -------------------------------------------------------------------------------

    def begin_load(self, namespace: str, keys: Sequence[bytes]) -> LoadReservation:
        """Hold every key for reading if all are committed; otherwise take nothing."""
        return self._with_handles(self.begin_reads(namespace, keys))

    def begin_reads(self, namespace: str, keys: Sequence[bytes]) -> Reads:
        """``begin_load`` as ``Reads``. A key removed but not yet acknowledged by every
        mirror is read from its kept bytes: a mirror may still answer it as a hit, and its
        scheduler does not acknowledge the removal of a key it is loading."""
        table = self._tables.get(namespace, _NO_ROWS)
        state = self._state.v
        rows: list[int] = []
        touched: list[int] = []
        missing: list[bytes] = []
        for key in keys:
            row = table.get(key)
            if row is not None and state[row] & _COMMITTED:
                touched.append(row)
            else:
                row = self._watchers.find(namespace, key)
                if row is None:
                    missing.append(key)
                    continue
            rows.append(row)
        if missing:
            return Reads([], missing)
        self._add_readers(rows)
        self._policy.touch(touched)
        return Reads(rows, [])

    def _with_handles(self, reads: Reads) -> LoadReservation:
        return LoadReservation([self._handle(row) for row in reads.rows], reads.missing)

    def read_extents(self, rows: Sequence[int], shard: int) -> list[tuple[int, int]]:
        """Arena offset and size of shard ``shard`` of each chunk read at ``rows`` (a
        ``Reads``' rows, or several's end to end)."""
        pool, base, shape_of, shapes = self._offsets.v, self._base.v, self._shape.v, self._shapes
        align = self._align
        extents = []
        for row in rows:  # a step's loads read hundreds: no call per row
            sizes = shapes[shape_of[row]]
            if not 0 <= shard < len(sizes):
                raise IndexError(f"row {row} has no shard {shard}")
            extents.append((pool[base[row] + shard] * align, sizes[shard]))
        return extents

    def finish_load(self, entries: Sequence[Entry]) -> None:
        """End the reads ``begin_load`` started on ``entries``."""
        self._end_reads([entry._row for entry in entries], lambda index: repr(entries[index]))

    def finish_reads(self, reads: Iterable[Reads]) -> None:
        """End ``reads`` (each ``begin_reads``' or ``begin_reads_held``'), as one call."""
        rows = [row for one in reads for row in one.rows]
        self._end_reads(rows, lambda index: f"row {rows[index]}")

    def _end_reads(self, rows: list[int], name: Callable[[int], str]) -> None:
        counts: dict[int, int] = {}
        for index, row in enumerate(rows):
            n = counts[row] = counts.get(row, 0) + 1
            if row < 0 or n > self._readers.get(row, 0):
                raise ValueError(f"{name(index)} is not being read")
        state = self._state.v
        for row in rows:
            readers = self._readers[row] - 1
            if readers:
                self._readers[row] = readers
            else:
                del self._readers[row]
                state[row] = lifecycle.step(state[row], _STOP_READ)
                if state[row] & _DEAD:
                    self._free_if_idle(row)
        if self._unplaced:
            self._place_waiting()

    def begin_load_held(self, owner: str, token: str, keys: Sequence[bytes]) -> LoadReservation:
        """Like ``begin_load``, for keys held under ``(owner, token)`` (removed ones too)."""
        return self._with_handles(self.begin_reads_held(owner, [(token, keys)])[0])

    def begin_reads_held(
        self, owner: str, loads: Sequence[tuple[str, Sequence[bytes]]]
    ) -> list[Reads]:
        """``begin_load_held`` of each ``(token, keys)`` as ``Reads``, in one call."""
        holds = self._holds
        no_hold: dict[bytes, tuple[int, int]] = {}
        reads = []
        rows: list[int] = []
        for token, keys in loads:
            held = holds.get((owner, token), no_hold)
            try:
                mine = [held[key][0] for key in keys]
            except KeyError:
                reads.append(Reads([], [key for key in keys if key not in held]))
                continue
            rows += mine
            reads.append(Reads(mine, []))
        self._add_readers(rows)
        return reads

    def _add_readers(self, rows: Sequence[int]) -> None:
        readers, state, step = self._readers, self._state.v, lifecycle.step
        for row in rows:  # one call for a load's rows: a step's loads read thousands
            readers[row] = readers.get(row, 0) + 1
            state[row] = step(state[row], _START_READ)

    # -- holds ------------------------------------------------------------------------------

    def touch(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Mark the committed ``keys`` recently used, as a load does; returns how many were.
        A scheduler's requests used them without loading them (its GPU prefix cache had
        them), and another engine sharing the cache may need them next."""
        table = self._tables.get(namespace, _NO_ROWS)
        state = self._state.v
        rows = [row for key in keys if (row := table.get(key)) is not None]
        rows = [row for row in rows if state[row] & _COMMITTED]
        if rows:
            self._policy.touch(rows)
        return len(rows)

    def hold(
        self,
        namespace: str,
        owner: str,
        token: str,
        keys: Sequence[bytes],
        *,
        account: Hashable | None = None,
        tenant: Hashable | None = None,
    ) -> list[bytes]:
        """Hold each committed key for ``(owner, token)``; returns the keys that are not.

        A key removed while a watcher may still show it (see ``watch``) can be held too: its
        bytes are intact. Holding a key twice for one token needs two releases. With an
        ``account`` (and ``tenant``), a key the token does not hold yet is held only within
        their room; the keys (occurrences) beyond it come last in the list returned.
        """
        return self.hold_tokens(namespace, owner, [(token, keys)], account=account, tenant=tenant)

    def hold_tokens(
        self,
        namespace: str,
        owner: str,
        holds: Sequence[tuple[str, Sequence[bytes]]],
        *,
        account: Hashable | None = None,
        tenant: Hashable | None = None,
    ) -> list[bytes]:
        """``hold`` for each ``(token, keys)`` in turn, as one call: the room is worked out
        once and the policy touched once (a step holds for hundreds of requests). Returns
        every token's missing keys, then every token's keys beyond the room."""
        if not holds:
            return []  # an UpdateHolds that only releases: no room to work out
        table = self._tables.get(namespace, _NO_ROWS)
        state = self._state.v
        missing: list[bytes] = []
        over: list[bytes] = []
        touched: list[int] = []
        room = self._room(account, tenant, self._clock())
        nbytes, shape_of = self._nbytes, self._shape.v
        row_holds, watchers = self._row_holds, self._watchers
        charged = refunded = 0  # settled with the ledger once, at the end
        replaced: list[tuple[int, int]] = []  # (row, holds) of keys re-held on a new row
        for token, keys in holds:
            held = self._holds.get((owner, token))
            for key in keys:
                row = table.get(key)
                if row is not None and state[row] & _COMMITTED:
                    touched.append(row)
                else:
                    row = watchers.find(namespace, key)
                    if row is None:
                        missing.append(key)
                        continue
                previous = held.get(key) if held is not None else None
                cost = nbytes[shape_of[row]]
                if previous is None:
                    if cost > room:
                        over.append(key)
                        continue
                    room -= cost
                    charged += cost
                elif previous[0] != row:
                    charged += cost
                    refunded += nbytes[shape_of[previous[0]]]
                    replaced.append(previous)  # re-held after a re-store: the newest
                    previous = (row, 0)
                if held is None:
                    held = self._holds[(owner, token)] = {}
                    self._hold_tokens.setdefault(owner, set()).add(token)
                held[key] = (row, 1 if previous is None else previous[1] + 1)
                row_holds[row] = row_holds.get(row, 0) + 1
                state[row] = lifecycle.step(state[row], _HOLD)
        if charged:
            self._ledger.charge(owner, charged, account, tenant)
        if refunded:
            self._ledger.refund(owner, refunded)
        for row, count in replaced:
            self._unhold(row, count)
        if touched:
            self._policy.touch(touched)
        return missing + over if over else missing

    def release_hold(self, owner: str, token: str, keys: Sequence[bytes]) -> int:
        """Drop one hold of ``(owner, token)`` on each key; returns how many were dropped."""
        return self.release_hold_tokens(owner, [(token, keys)])

    def release_hold_tokens(
        self, owner: str, releases: Sequence[tuple[str, Sequence[bytes]]]
    ) -> int:
        """``release_hold`` for each ``(token, keys)`` in turn, as one call (a step releases
        for hundreds of requests); returns how many holds were dropped."""
        refunded = 0
        unheld: list[int] = []
        nbytes, shape_of = self._nbytes, self._shape.v
        for token, keys in releases:
            held = self._holds.get((owner, token))
            if held is None:
                continue
            for key in keys:
                found = held.get(key)
                if found is None:
                    continue
                row, count = found
                if count > 1:
                    held[key] = (row, count - 1)
                else:
                    del held[key]
                    refunded += nbytes[shape_of[row]]
                unheld.append(row)
            if not held:
                del self._holds[(owner, token)]
                tokens = self._hold_tokens[owner]
                tokens.discard(token)
                if not tokens:
                    del self._hold_tokens[owner]
        if refunded:  # before the rows are let go: what they free is counted as free
            self._ledger.refund(owner, refunded)
        for row in unheld:
            self._unhold(row, 1)
        return len(unheld)

    def release_holds(self, owner: str) -> int:
        """Drop every hold of ``owner`` (its scheduler left); returns how many keys."""
        dropped = 0
        refund, nbytes, shape_of = self._ledger.refund, self._nbytes, self._shape.v
        for token in self._hold_tokens.pop(owner, set()):
            for row, count in self._holds.pop((owner, token)).values():
                refund(owner, nbytes[shape_of[row]])
                self._unhold(row, count)
                dropped += 1
        return dropped

    def _unhold(self, row: int, count: int) -> None:
        holds = self._row_holds[row] - count
        if holds:
            self._row_holds[row] = holds
            return
        del self._row_holds[row]
        state = self._state.v
        state[row] = lifecycle.step(state[row], _UNHOLD)
        if state[row] & _DEAD:
            self._free_if_idle(row)
            if self._unplaced:
                self._place_waiting()

    # -- mirrors ----------------------------------------------------------------------------

    @property
    def seq(self) -> int:
        """The sequence number of the last removal a watcher must acknowledge."""
        return self._watchers.seq

    def watch(self, namespace: str, watcher: str) -> None:
        """``watcher`` mirrors ``namespace``'s committed keys from now on."""
        self._watchers.watch(namespace, watcher)

    def unwatch(self, watcher: str) -> None:
        """``watcher`` is gone; removed entries stop waiting for it."""
        self._release_leaving(self._watchers.unwatch(watcher))

    def ack(self, watcher: str, seq: int) -> None:
        """``watcher`` applied every removal up to ``seq``."""
        self._release_leaving(self._watchers.ack(watcher, seq))

    def acked(self, watcher: str) -> int | None:
        """The last removal ``watcher`` acknowledged (None: it watches nothing)."""
        return self._watchers.acked(watcher)

    def _release_leaving(self, rows: list[int]) -> None:
        state = self._state.v
        for row in rows:
            state[row] = lifecycle.step(state[row], _ACK)
            self._leaving_bytes -= self._footprints[self._shape.v[row]]
            self._free_if_idle(row)
        if rows and self._unplaced:
            self._place_waiting()

    # -- pins -------------------------------------------------------------------------------

    def release(self, namespace: str, keys: Sequence[bytes], owner: str) -> int:
        """Drop ``owner``'s pins on ``keys``; returns how many pins were dropped."""
        table = self._tables.get(namespace, _NO_ROWS)
        owned = self._owners.get(owner)
        if owned is None:
            return 0
        dropped = 0
        for key in keys:
            row = table.get(key)
            pins = self._pins.get(row) if row is not None else None
            if pins is None or owner not in pins:
                continue
            assert row is not None
            del pins[owner]
            if not pins:
                self._unpin(row)
            owned.discard(row)
            self._ledger.refund(owner, self._nbytes[self._shape.v[row]])
            dropped += 1
        if not owned:
            del self._owners[owner]
        return dropped

    def release_owner(self, owner: str) -> int:
        """Drop every pin of ``owner`` (its session ended); returns how many were dropped."""
        owned = self._owners.pop(owner, None)
        if owned is None:
            return 0
        refund, nbytes, shape_of = self._ledger.refund, self._nbytes, self._shape.v
        for row in owned:
            pins = self._pins[row]
            del pins[owner]
            if not pins:
                self._unpin(row)
            refund(owner, nbytes[shape_of[row]])
        return len(owned)

    # -- removal ----------------------------------------------------------------------------

    def remove(self, namespace: str, keys: Sequence[bytes]) -> list[Entry]:
        """Drop ``keys`` (committed or pending); returns the removed committed entries."""
        table = self._tables.get(namespace)
        if table is None:
            return []
        removed: list[Entry] = []
        for key in keys:
            row = table.get(key)
            if row is not None:
                self._drop(row, removed)
        return removed

    def clear_namespace(self, namespace: str, *, acker: str | None = None) -> list[Entry]:
        """Drop every entry of ``namespace``; returns the removed committed entries."""
        table = self._tables.get(namespace)
        if table is None:
            return []
        removed: list[Entry] = []
        for row in list(table.values()):
            self._drop(row, removed)
        del self._tables[namespace]
        if acker is not None:
            self.ack(acker, self.seq)
        return removed

    # -- inspection -------------------------------------------------------------------------

    def protected_bytes(self, owner: str) -> int:
        """Bytes ``owner``'s pins (possibly expired), holds and reservations keep."""
        return self._ledger.owned(owner)

    def room(self, account: Hashable | None, tenant: Hashable | None = None) -> float:
        """Bytes ``account`` (within ``tenant``) may still protect (``math.inf`` with no
        budget); expired pins and lapsed reservations are dropped first."""
        return self._room(account, tenant, self._clock())

    def keys_in(self, namespace: str) -> list[bytes]:
        """Committed keys of ``namespace``, e.g. to announce a warm cache to a new engine."""
        state = self._state.v
        table = self._tables.get(namespace, _NO_ROWS)
        return [key for key, row in table.items() if state[row] & _COMMITTED]

    def namespace_sizes(self) -> dict[str, tuple[int, int]]:
        """Committed chunks and their bytes (all shards) of each namespace holding any."""
        nbytes = np.asarray(self._nbytes, dtype=np.int64)
        sizes: dict[str, tuple[int, int]] = {}
        for name, table in self._tables.items():
            rows = np.fromiter(table.values(), np.int64, len(table))
            rows = rows[(self._state.a[rows] & _COMMITTED) != 0]
            if len(rows):
                sizes[name] = (len(rows), int(nbytes[self._shape.a[rows]].sum()))
        return sizes

    def get(self, namespace: str, key: bytes) -> Entry | None:
        """The live entry (committed or pending) for ``key``, if any."""
        row = self._tables.get(namespace, _NO_ROWS).get(key)
        return None if row is None else self._handle(row)

    def stats(self) -> CacheStats:
        """A snapshot of the counters (lapsed reservations dropped first)."""
        self._expire(self._clock())
        return CacheStats(
            capacity=self._alloc.capacity,
            used_bytes=self._alloc.used_bytes,
            entries=self._entries,
            committed=self._committed,
            pending=self._entries - self._committed,
            lookups=self._lookups,
            hit_keys=self._hit_keys,
            miss_keys=self._miss_keys,
            stores_refused=self._stores_refused,
            evictions=self._evictions,
            committed_bytes=self._committed_bytes,
            held=sum(len(held) for held in self._holds.values()),
            leaving=self._watchers.waiting(),
            refused=dict(self._refused),
            unplaced=len(self._unplaced),
        )

    # -- rows -------------------------------------------------------------------------------

    def _shape_id(self, sizes: tuple[int, ...]) -> int:
        shape = self._shape_ids.get(sizes)
        if shape is None:
            shape = self._shape_ids[sizes] = len(self._shapes)
            alloc = self._alloc
            needs = tuple(alloc.alloc_size(size) for size in sizes)
            need = sum(needs)
            self._shapes.append(sizes)
            self._needs.append(needs)
            self._footprints.append(need)
            self._nbytes.append(sum(sizes))
            self._fits.append(
                need <= alloc.capacity
                and all(alloc.alloc_size(size) <= alloc.max_alloc for size in sizes)
            )
        return shape

    def _new_row(self, namespace: str, key: bytes, shape: int, offsets: list[int]) -> int:
        """A new live, pending row in the index and the policy, its extents at ``offsets``."""
        state = self._state
        if self._free_rows:
            row = self._free_rows.pop()
            self._keys[row] = key
        else:
            row = len(self._keys)
            self._keys.append(key)
            if row >= len(state.a):
                for column in (state, self._ns, self._shape, self._base):
                    column.grow(row + 1)
                self._policy.grow(len(state.a))
        namespace_id = self._namespace_ids.get(namespace)
        if namespace_id is None:
            namespace_id = self._namespace_ids[namespace] = len(self._namespaces)
            self._namespaces.append(namespace)
        count = len(offsets)
        runs = self._free_runs.get(count)
        if runs:
            base = runs.pop()
        else:
            base = self._pool_top
            self._pool_top = top = base + count
            if top > len(self._offsets.a):
                self._offsets.grow(top)
        pool, align = self._offsets.v, self._align
        for slot, offset in enumerate(offsets, base):
            pool[slot] = offset // align
        state.v[row] = lifecycle.step(state.v[row], _ALLOCATE)
        self._ns.v[row] = namespace_id
        self._shape.v[row] = shape
        self._base.v[row] = base
        table = self._tables.get(namespace)
        if table is None:
            table = self._tables[namespace] = {}
        table[key] = row
        self._entries += 1
        self._policy.insert(row, namespace_id, key)
        return row

    def _row_offsets(self, row: int) -> list[int]:
        base = self._base.v[row]
        count = len(self._shapes[self._shape.v[row]])
        pool, align = self._offsets.v, self._align
        return [pool[slot] * align for slot in range(base, base + count)]

    def _shard_offset(self, row: int, shard: int) -> int:
        if not 0 <= shard < len(self._shapes[self._shape.v[row]]):
            raise IndexError(f"row {row} has no shard {shard}")
        return self._offsets.v[self._base.v[row] + shard] * self._align

    def _written_mask(self, row: int) -> int:
        if self._state.v[row] & _COMMITTED:
            return (1 << len(self._shapes[self._shape.v[row]])) - 1
        return self._written.get(row, 0)

    def _handle(self, row: int) -> Entry:
        """The row's handle: the one given out before if it is still alive."""
        ref = self._handles.get(row)
        if ref is not None:
            entry = ref()
            if entry is not None:
                return entry
        key = self._keys[row]
        assert key is not None
        entry = Entry(
            self, row, self._namespaces[self._ns.v[row]], key, self._shapes[self._shape.v[row]]
        )
        handles = self._handles
        handles[row] = weakref.ref(entry)
        if len(handles) >= self._sweep_at:
            for dead in [row for row, ref in handles.items() if ref() is None]:
                del handles[dead]
            self._sweep_at = max(_SWEEP_MIN, 2 * len(handles))
        return entry

    def _release_row(self, row: int) -> None:
        """Free a dead, idle row's extents and the row itself; its handle keeps the end."""
        sizes = self._shapes[self._shape.v[row]]
        base = self._base.v[row]
        if row in self._unplaced:  # it never had extents
            del self._unplaced[row]
            self._unplaced_bytes -= self._footprints[self._shape.v[row]]
        else:
            pool, align, free = self._offsets.v, self._align, self._alloc.free
            for slot, size in enumerate(sizes, base):
                free(pool[slot] * align, size)
        runs = self._free_runs.get(len(sizes))
        if runs is None:
            runs = self._free_runs[len(sizes)] = []
        runs.append(base)
        ref = self._handles.pop(row, None)
        entry = ref() if ref is not None else None
        if entry is not None:
            entry._final = (bool(self._state.v[row] & _COMMITTED), self._written_mask(row))
            entry._row = -1
        self._written.pop(row, None)
        self._writers.pop(row, None)
        self._keys[row] = None
        self._state.v[row] = lifecycle.step(self._state.v[row], _RELEASE)
        self._free_rows.append(row)

    def _start_writing(self, row: int, bit: int) -> None:
        self._writing[row] = self._writing.get(row, 0) | bit
        self._state.v[row] = lifecycle.step(self._state.v[row], _START_WRITE)

    def _stop_writing(self, row: int, bit: int) -> None:
        writing = self._writing[row] & ~bit
        if writing:
            self._writing[row] = writing
        else:
            del self._writing[row]
            self._state.v[row] = lifecycle.step(self._state.v[row], _STOP_WRITE)

    def _cancel(self, writes: list[ShardWrite]) -> None:
        """Undo the writing bits of a ``begin_store`` that is about to raise."""
        for w in writes:
            self._stop_writing(w.entry._row, w.bit)

    # -- internals --------------------------------------------------------------------------

    def _pin(
        self,
        row: int,
        owner: str,
        expiry: float,
        account: Hashable | None,
        tenant: Hashable | None = None,
    ) -> None:
        pins = self._pins.get(row)
        if pins is None:
            pins = self._pins[row] = {}
            self._state.v[row] = lifecycle.step(self._state.v[row], _PIN)
        old = pins.get(owner)
        if old is not None and expiry <= old:
            return
        pins[owner] = expiry
        ledger = self._ledger
        if old is None:
            ledger.charge(owner, self._nbytes[self._shape.v[row]], account, tenant)
            self._owners.setdefault(owner, set()).add(row)
        if ledger.bounded(owner):
            heap = ledger.expiries(owner)
            heapq.heappush(heap, (expiry, row))
            owned = self._owners[owner]
            if len(heap) > 2 * len(owned) + 64:  # released pins leave stale items
                heap = [(self._pins[pinned][owner], pinned) for pinned in owned]
                heapq.heapify(heap)
                ledger.set_expiries(owner, heap)

    def _room(self, account: Hashable | None, tenant: Hashable | None, now: float) -> float:
        """The bytes ``account`` within ``tenant`` may still protect (no bound without
        either); their expired pins and lapsed reservations are dropped first, as they
        protect nothing."""
        self._expire(now)
        ledger = self._ledger
        if ledger.room(account, tenant) == float("inf"):
            return float("inf")
        for member in ledger.members(account, tenant):
            heap = ledger.expiries(member)
            while heap and heap[0][0] <= now:
                expiry, row = heapq.heappop(heap)
                pins = self._pins.get(row)
                if pins is not None and pins.get(member, float("inf")) <= expiry:
                    self._drop_pin(row, member)
                    if not ledger.bounded(member):
                        break  # its last bytes went: forgotten, heap and all
        return ledger.room(account, tenant)

    def _drop_pin(self, row: int, owner: str) -> None:
        """Drop ``owner``'s pin on ``row`` (it has one)."""
        pins = self._pins[row]
        del pins[owner]
        if not pins:
            self._unpin(row)
        owned = self._owners[owner]
        owned.discard(row)
        if not owned:
            del self._owners[owner]
        self._ledger.refund(owner, self._nbytes[self._shape.v[row]])

    def _unpin(self, row: int) -> None:
        del self._pins[row]
        self._state.v[row] = lifecycle.step(self._state.v[row], _UNPIN)

    def _pinned(self, row: int, now: float) -> bool:
        """Whether an unexpired pin holds ``row``; drops the pins if all have expired."""
        pins = self._pins[row]
        if any(expiry > now for expiry in pins.values()):
            return True
        self._drop_pins(row)
        return False

    def _drop_pins(self, row: int) -> None:
        cost = self._nbytes[self._shape.v[row]]
        for owner in self._pins[row]:
            owned = self._owners[owner]
            owned.discard(row)
            if not owned:
                del self._owners[owner]
            self._ledger.refund(owner, cost)
        self._unpin(row)

    def _try_alloc(self, shape: int) -> list[int] | None:
        """All shards' extents, or None (and nothing held) if one does not fit."""
        take = self._alloc.take
        needs = self._needs[shape]
        if len(needs) == 1:  # the usual case: one shard per key (a rank's, or replicated)
            offset = take(needs[0])
            return None if offset is None else [offset]
        offsets: list[int] = []
        for need in needs:
            offset = take(need)
            if offset is None:
                for held, held_size in zip(offsets, self._shapes[shape], strict=False):
                    self._alloc.free(held, held_size)
                return None
            offsets.append(offset)
        return offsets

    def _evictable(self, namespace: str, protected: frozenset[bytes], now: float) -> Iterator[int]:
        """Evictable rows in policy order; must be dropped before the policy changes."""
        state, namespace_of, keys = self._state.v, self._ns.v, self._keys
        namespace_id = self._namespace_ids.get(namespace, -1)
        for row in self._policy.candidates():
            if namespace_of[row] == namespace_id and keys[row] in protected:
                continue
            bits = state[row]
            if bits & _BUSY or (bits & _PINNED and self._pinned(row, now)):
                continue
            yield row

    def _place(
        self,
        namespace: str,
        shape: int,
        protected: frozenset[bytes],
        evicted: list[Entry],
        acker: str | None,
    ) -> list[int] | None:
        """Extents for a new entry's shards, evicting in policy order if needed.

        A victim that a watcher other than ``acker`` may still show frees its space only once
        acknowledged. When only such space (with what is already on its way) would make room,
        the victims are evicted but the entry is refused now: the room comes a moment later.
        """
        alloc = self._alloc
        if not self._fits[shape]:
            return None
        need = self._footprints[shape]
        if alloc.free_bytes >= need:
            offsets = self._try_alloc(shape)
            if offsets is not None:
                return offsets
        now = self._clock()
        victims: list[int] = []
        found_now = alloc.free_bytes
        if found_now < need:
            # Dry run: evict nothing unless enough evictable bytes exist.
            found_later = self._leaving_bytes
            for row in self._evictable(namespace, protected, now):
                if self._frees_at_once(row, acker):
                    victims.append(row)
                    found_now += self._footprint(row)
                elif found_now + found_later < need:  # else: the room is already on its way
                    victims.append(row)
                    found_later += self._footprint(row)
                if found_now + found_later >= need:
                    break
            else:
                return None
            for row in victims:
                self._evict(row, evicted, acker)
            if found_now < need:
                return None
            offsets = self._try_alloc(shape)
            if offsets is not None:
                return offsets
        # Enough bytes are free but no extent fits (mixed sizes fragment the arena): keep
        # evicting one victim at a time. Batches double so skipped entries are rescanned rarely.
        batch = max(8, len(victims))
        while True:
            more = [
                row
                for row in islice(self._evictable(namespace, protected, now), batch)
                if self._frees_at_once(row, acker)
            ]
            if not more:
                return None
            for row in more:
                self._evict(row, evicted, acker)
                offsets = self._try_alloc(shape)
                if offsets is not None:
                    return offsets
            batch *= 2

    def _footprint(self, row: int) -> int:
        return self._footprints[self._shape.v[row]]

    def _frees_at_once(self, row: int, acker: str | None) -> bool:
        """Whether evicting ``row`` frees its extents now (no other watcher must ack)."""
        return not self._state.v[row] & _COMMITTED or self._watchers.only(
            self._namespaces[self._ns.v[row]], acker
        )

    def _unlink(self, row: int, *, evicted: bool) -> None:
        """Take ``row`` out of the index, the policy and the pin map; mark it dead."""
        namespace_id = self._ns.v[row]
        namespace = self._namespaces[namespace_id]
        key = self._keys[row]
        assert key is not None
        del self._tables[namespace][key]
        if evicted:
            self._policy.evicted(row, namespace_id, key)
        else:
            self._policy.remove(row)
        state = self._state.v
        if state[row] & _PINNED:
            self._drop_pins(row)
        self._entries -= 1
        event = _UNLINK
        if state[row] & _COMMITTED:
            self._committed -= 1
            self._committed_bytes -= sum(self._shapes[self._shape.v[row]])
            if self._watchers.leave(namespace, key, row):
                event = _UNLINK_WATCHED
                self._leaving_bytes += self._footprint(row)
        else:
            self._end_reservation(row)
        state[row] = lifecycle.step(state[row], event)

    def _evict(self, row: int, evicted: list[Entry], acker: str | None) -> None:
        self._unlink(row, evicted=True)
        entry = self._handle(row)
        if acker is not None and self._state.v[row] & _LEAVING:
            self.ack(acker, self.seq)
        self._free_if_idle(row)
        self._evictions += 1
        evicted.append(entry)

    def _drop(self, row: int, removed: list[Entry]) -> None:
        self._unlink(row, evicted=False)
        entry = self._handle(row) if self._state.v[row] & _COMMITTED else None
        self._free_if_idle(row)
        if entry is not None:
            removed.append(entry)

    def _free_if_idle(self, row: int) -> None:
        """Release a dead row (and its extents) once no copy, hold or watcher uses them."""
        if _RELEASABLE[self._state.v[row]] and self._keys[row] is not None:
            self._release_row(row)

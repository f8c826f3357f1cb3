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
- ``begin_reads`` (prepare_load), the one read API, takes every key or none: all committed (or
  removed and still kept for a mirror's acknowledgement) -> each is held against eviction until
  ``finish_reads`` (complete_load); otherwise nothing is taken and the missing keys are
  returned. ``Reads`` holds rows (``read_extents`` plans from them); handles only on demand.
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
  ``release_hold`` (and ``begin_reads_held`` reads them, even if removed meanwhile);
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
  store or reports ``stats``. With ``reservation_renewals``, a key is reserved at most that
  many times more until stored (``Protections.renewable``; beyond, counted as ``expired``).
- A scheduler that mirrors a namespace's keys (``watch``) may still show a removed key as
  present: a removed committed entry of a watched namespace keeps its extents until every
  watcher acknowledged the removal (``ack``; see ``offloadd.cache.watchers``). ``acker`` on a
  call names the watcher that applies that call's removals before anything else (it asked).
- A key ``reserve`` found room for only once other watchers acknowledge is reserved *unplaced*
  (no extents yet); it is placed, in reservation order, when an acknowledgement or a freed
  hold or read makes the room, and the listeners then hear ``placed()``.
  ``unplaced(namespace, keys)`` places what fits now and counts the keys still waiting, so a
  rank's store can wait for them instead of meeting them in ``begin_store``, which drops a
  key still unplaced (refused, reason ``ack``).
- Listeners (``listen``, ``offloadd.cache.listeners``) hear what a ``begin_store`` or
  ``reserve`` evicted before it returns; ``remove`` and ``clear_namespace`` return theirs.
- ``used_bytes <= capacity`` always; extents of live and dead-but-busy entries never overlap.
- Misuse that can only be a caller bug (a write finished twice, a load finished without its
  begin, a shard index outside the key's layout) raises ValueError and changes nothing.

Parts, each in its own module: ``rows`` (the numpy columns, key tables and free rows an
entry lives in), ``protections`` (pins, holds, reservations and their ledger), ``placement``
(room, eviction, rows leaving and their watchers), ``records`` (the ``Entry`` handles and
the result types) and ``listeners``. This class states the contract and sequences the parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from operator import itemgetter
from typing import cast

import numpy as np

from offloadd.cache.allocator import ExtentAllocator
from offloadd.cache.lifecycle import COMMITTED
from offloadd.cache.listeners import CacheListener
from offloadd.cache.placement import Placement
from offloadd.cache.policy import make_row_policy
from offloadd.cache.protections import Protections
from offloadd.cache.records import (
    REFUSED_ACK,
    REFUSED_BUDGET,
    REFUSED_EXPIRED,
    REFUSED_FULL,
    REFUSED_TENANT,
    CacheStats,
    Entry,
    Handles,
    LookupOutcome,
    Reads,
    Reservation,
    RestoredChunk,
    ShardWrite,
    StoreReservation,
)
from offloadd.cache.rows import NO_ROWS, Rows
from offloadd.cache.stores import Stores
from offloadd.cache.watchers import Watchers

__all__ = [
    "REFUSED_ACK",
    "REFUSED_BUDGET",
    "REFUSED_EXPIRED",
    "REFUSED_FULL",
    "REFUSED_TENANT",
    "CacheListener",
    "CacheStats",
    "ChunkCache",
    "Entry",
    "LookupOutcome",
    "Reads",
    "Reservation",
    "RestoredChunk",
    "ShardWrite",
    "StoreReservation",
]

# bytes.translate table: a state byte -> 1 if committed, else 0.
_COMMITTED_BYTE = bytes(int(bool(state & COMMITTED)) for state in range(256))


class ChunkCache:
    """The host chunk cache index over one arena of ``capacity`` bytes; the module docstring
    states its contract, each method its part.

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
        reservation_renewals: int | None = None,
    ) -> None:
        # ``boundary``: no shard extent straddles a multiple of it (see ExtentAllocator).
        alloc = ExtentAllocator(capacity, align, boundary=boundary)
        self._rows = rows = Rows(alloc, make_row_policy(policy))
        self._clock = clock
        self._watchers = Watchers()
        self._guards = Protections(
            rows,
            self._watchers,
            budget=budget,
            tenant_budget=tenant_budget,
            reservation_lease=reservation_lease,
            reservation_renewals=reservation_renewals,
        )
        self._handles = Handles(rows, self._guards)
        self._placement = Placement(rows, self._guards, self._watchers, self._handles, clock)
        self._stores = Stores(rows, self._guards, self._placement, self._handles, clock)
        # The columns and tables the hot paths read (stable objects; a column's array is
        # not: read ``.v`` at each call).
        self._state = rows.state
        self._tables = rows.tables
        self._lookups = 0
        self._hit_keys = 0
        self._miss_keys = 0

    # -- restart ----------------------------------------------------------------------------

    def restore(self, chunks: Iterable[RestoredChunk]) -> int:
        """Rebuild committed entries after a restart (only into an empty cache).

        ``chunks`` come in the order they were committed, which seeds the eviction order.
        A chunk whose extents are unaligned, outside the arena, overlap an earlier chunk's or
        each other is skipped (a damaged record must never alias live bytes), and so is one
        whose extent straddles the allocator's boundary (written by a daemon that did not cut
        the arena). Returns how many were kept.
        """
        if self._rows.entries:
            raise ValueError("restore needs an empty cache")
        return self._placement.restore(chunks)

    def committed_chunks(self) -> list[RestoredChunk]:
        """Every committed entry, least recently used first (to journal a compact state)."""
        return self._placement.committed_chunks()

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
        get = self._tables.get(namespace, NO_ROWS).get
        rows: list[int | None] = list(map(get, keys))
        try:
            found = rows.index(None)
        except ValueError:
            found = len(rows)
        hits = 0
        state = self._state.v
        if found:
            if found == 1:
                states = bytes((state[rows[0]],))  # type: ignore[index]
            else:
                states = bytes(itemgetter(*rows[:found])(state))
            hits = states.translate(_COMMITTED_BYTE).find(0)
            if hits < 0:
                hits = found
        pending: list[int] = []
        for i in range(hits, len(keys)):
            row = rows[i]
            if row is not None and not state[row] & COMMITTED:
                pending.append(i)
        if hits < len(rows):
            del rows[hits:]
        self._lookups += 1
        self._hit_keys += hits
        self._miss_keys += len(keys) - hits
        pinned = 0
        if hits:
            hit_rows = cast("list[int]", rows)
            self._rows.policy.touch(hit_rows)
            if pin_owner is not None and lease > 0:
                now = self._clock()
                room = self._room(account, tenant, now)
                pinned = self._guards.pin_hits(
                    hit_rows, pin_owner, now + lease, room, account, tenant
                )
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
        return self._stores.begin(namespace, keys, shard, shard_sizes, allocate, acker, writers)

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
        return self._stores.reserve(namespace, keys, owner, shard_sizes, acker, account, tenant)

    def listen(self, listener: CacheListener) -> None:
        """``listener`` hears this cache's evictions and placements from now on."""
        self._placement.heard.add(listener)

    def on_placed(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` whenever waiting unplaced keys got their extents."""
        self._placement.heard.on_placed(callback)

    def unplaced(self, namespace: str, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` are reserved unplaced still, placing those that fit now."""
        return self._placement.count_unplaced(namespace, keys)

    def release_reservations(self, owner: str) -> int:
        """Drop ``owner``'s reserved entries that have not committed (its scheduler left).

        Shards being written keep their extents until their ``finish_store``; nothing of a
        dropped entry ever becomes visible. Returns how many entries were dropped.
        """
        return self._stores.release_reservations(owner)

    def finish_store(self, writes: Sequence[ShardWrite], ok: bool) -> list[Entry]:
        """End the copies of ``writes``; returns the entries that became committed."""
        return self._stores.finish(writes, ok)

    def abandon(self, writes: Sequence[ShardWrite]) -> None:
        """Drop the pending entries of in-flight ``writes`` whose session went away.

        They leave the index now and never become visible; their extents are freed by the
        ``finish_store`` of their last copy in flight. Committed entries and writes already
        finished are left alone.
        """
        self._stores.abandon(writes)

    # -- load -------------------------------------------------------------------------------

    def begin_reads(self, namespace: str, keys: Sequence[bytes]) -> Reads:
        """Hold every key for reading if all are committed; otherwise take nothing (the
        ``missing`` keys). A key removed but not yet acknowledged by every mirror is read
        from its kept bytes: a mirror may still answer it as a hit, and its scheduler does
        not acknowledge the removal of a key it is loading."""
        table = self._tables.get(namespace, NO_ROWS)
        state = self._state.v
        rows: list[int] = []
        touched: list[int] = []
        missing: list[bytes] = []
        for key in keys:
            row = table.get(key)
            if row is not None and state[row] & COMMITTED:
                touched.append(row)
            else:
                row = self._watchers.find(namespace, key)
                if row is None:
                    missing.append(key)
                    continue
            rows.append(row)
        if missing:
            return Reads([], missing)
        self._rows.add_readers(rows)
        self._rows.policy.touch(touched)
        return Reads(rows, [], self._handles)

    def read_extents(self, rows: Sequence[int], shard: int) -> list[tuple[int, int]]:
        """Arena offset and size of shard ``shard`` of each chunk read at ``rows`` (a
        ``Reads``' rows, or several's end to end)."""
        return self._rows.read_extents(rows, shard)

    def finish_reads(self, reads: Iterable[Reads]) -> None:
        """End ``reads`` (each ``begin_reads``' or ``begin_reads_held``'), as one call."""
        rows = [row for one in reads for row in one.rows]
        bad = self._rows.check_reads(rows)
        if bad >= 0:
            row = rows[bad]
            live = row >= 0 and self._rows.keys[row] is not None
            entry = f"{self._handles.get(row)!r} at " if live else ""
            raise ValueError(f"{entry}row {row} is not being read")
        place = self._placement
        for row in self._rows.stop_reads(rows):
            place.free_if_idle(row)
        if place.unplaced:
            place.place_waiting()

    def begin_reads_held(
        self, owner: str, loads: Sequence[tuple[str, Sequence[bytes]]]
    ) -> list[Reads]:
        """``begin_reads`` of each ``(token, keys)``, for keys held under ``(owner, token)``
        (removed ones too), in one call."""
        handles = self._handles
        reads = [
            Reads(rows, missing, handles) for rows, missing in self._guards.held_rows(owner, loads)
        ]
        self._rows.add_readers([row for one in reads for row in one.rows])
        return reads

    # -- holds ------------------------------------------------------------------------------

    def touch(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Mark the committed ``keys`` recently used, as a load does; returns how many were.
        A scheduler's requests used them without loading them (its GPU prefix cache had
        them), and another engine sharing the cache may need them next."""
        table = self._tables.get(namespace, NO_ROWS)
        state = self._state.v
        rows = [row for key in keys if (row := table.get(key)) is not None]
        rows = [row for row in rows if state[row] & COMMITTED]
        if rows:
            self._rows.policy.touch(rows)
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
        room = self._room(account, tenant, self._clock())
        missing, touched, dead = self._guards.hold_tokens(
            namespace, owner, holds, room, account, tenant
        )
        self._placement.settle(dead)
        if touched:
            self._rows.policy.touch(touched)
        return missing

    def release_hold(self, owner: str, token: str, keys: Sequence[bytes]) -> int:
        """Drop one hold of ``(owner, token)`` on each key; returns how many were dropped."""
        return self.release_hold_tokens(owner, [(token, keys)])

    def release_hold_tokens(
        self, owner: str, releases: Sequence[tuple[str, Sequence[bytes]]]
    ) -> int:
        """``release_hold`` for each ``(token, keys)`` in turn, as one call (a step releases
        for hundreds of requests); returns how many holds were dropped."""
        dropped, dead = self._guards.release_hold_tokens(owner, releases)
        self._placement.settle(dead)
        return dropped

    def release_holds(self, owner: str) -> int:
        """Drop every hold of ``owner`` (its scheduler left); returns how many keys."""
        dropped, dead = self._guards.release_holds(owner)
        self._placement.settle(dead)
        return dropped

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
        self._placement.release_leaving(self._watchers.unwatch(watcher))

    def ack(self, watcher: str, seq: int) -> None:
        """``watcher`` applied every removal up to ``seq``."""
        self._placement.ack(watcher, seq)

    def acked(self, watcher: str) -> int | None:
        """The last removal ``watcher`` acknowledged (None: it watches nothing)."""
        return self._watchers.acked(watcher)

    # -- pins -------------------------------------------------------------------------------

    def release(self, namespace: str, keys: Sequence[bytes], owner: str) -> int:
        """Drop ``owner``'s pins on ``keys``; returns how many pins were dropped."""
        return self._guards.unpin_keys(self._tables.get(namespace, NO_ROWS), keys, owner)

    def release_owner(self, owner: str) -> int:
        """Drop every pin of ``owner`` (its session ended); returns how many were dropped."""
        return self._guards.release_owner(owner)

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
                self._placement.drop(row, removed)
        return removed

    def clear_namespace(self, namespace: str, *, acker: str | None = None) -> list[Entry]:
        """Drop every entry of ``namespace``; returns the removed committed entries."""
        table = self._tables.get(namespace)
        if table is None:
            return []
        removed: list[Entry] = []
        for row in list(table.values()):
            self._placement.drop(row, removed)
        del self._tables[namespace]
        if acker is not None:
            self.ack(acker, self.seq)
        return removed

    # -- inspection -------------------------------------------------------------------------

    def protected_bytes(self, owner: str) -> int:
        """Bytes ``owner``'s pins (possibly expired), holds and reservations keep."""
        return self._guards.owned(owner)

    def room(self, account: Hashable | None, tenant: Hashable | None = None) -> float:
        """Bytes ``account`` (within ``tenant``) may still protect (``math.inf`` with no
        budget); expired pins and lapsed reservations are dropped first."""
        return self._room(account, tenant, self._clock())

    def _room(self, account: Hashable | None, tenant: Hashable | None, now: float) -> float:
        self._placement.expire(now)  # lapsed reservations protect nothing
        return self._guards.room(account, tenant, now)

    def keys_in(self, namespace: str) -> list[bytes]:
        """Committed keys of ``namespace``, e.g. to announce a warm cache to a new engine."""
        state = self._state.v
        table = self._tables.get(namespace, NO_ROWS)
        return [key for key, row in table.items() if state[row] & COMMITTED]

    def namespace_sizes(self) -> dict[str, tuple[int, int]]:
        """Committed chunks and their bytes (all shards) of each namespace holding any."""
        columns = self._rows
        nbytes = np.asarray(columns.nbytes, dtype=np.int64)
        sizes: dict[str, tuple[int, int]] = {}
        for name, table in self._tables.items():
            rows = np.fromiter(table.values(), np.int64, len(table))
            rows = rows[(self._state.a[rows] & COMMITTED) != 0]
            if len(rows):
                sizes[name] = (len(rows), int(nbytes[columns.shape.a[rows]].sum()))
        return sizes

    def get(self, namespace: str, key: bytes) -> Entry | None:
        """The live entry (committed or pending) for ``key``, if any."""
        row = self._tables.get(namespace, NO_ROWS).get(key)
        return None if row is None else self._handles.get(row)

    def stats(self) -> CacheStats:
        """A snapshot of the counters (lapsed reservations dropped first)."""
        place, rows = self._placement, self._rows
        place.expire(self._clock())
        return CacheStats(
            capacity=rows.alloc.capacity,
            used_bytes=rows.alloc.used_bytes,
            entries=rows.entries,
            committed=rows.committed,
            pending=rows.entries - rows.committed,
            lookups=self._lookups,
            hit_keys=self._hit_keys,
            miss_keys=self._miss_keys,
            stores_refused=place.stores_refused,
            evictions=place.evictions,
            committed_bytes=rows.committed_bytes,
            held=self._guards.held(),
            leaving=self._watchers.waiting(),
            refused=dict(place.refused),
            unplaced=len(place.unplaced),
        )

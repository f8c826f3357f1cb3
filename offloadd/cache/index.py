"""Host chunk cache index: entries, two-phase stores, loads, pins and eviction.

The pure core of the cache (``docs/design.md``, section 4): no I/O, no threads, no torch.
The daemon calls it from its one asyncio thread and copies the bytes itself between a
``begin_*`` and its ``finish_*``. Time is injected (``clock``) so that pin leases are testable.

Contract of ``ChunkCache`` (the names mirror vLLM's ``OffloadingManager``):

- Entries are keyed by ``(namespace, key)``; a key is only looked up inside its namespace. An
  entry holds one shard per rank (a replicated layout has one shard), each in its own arena
  extent. An entry is *pending* until every shard is written, then *committed* (visible).
- ``lookup``: how many leading keys are committed (the prefix hit), which keys are pending;
  touches the hits and, with ``pin_owner`` and a lease, pins them until ``clock() + lease``.
- ``begin_store`` (vLLM's prepare_store) reserves this rank's shard of each key: committed keys
  and shards already written or in flight are skipped; a pending key is joined; a new key gets
  all its shards allocated, evicting if needed. ``finish_store`` (complete_store) ends those
  copies; an entry commits when its last shard is written and is returned once, so the caller
  announces it. ``finish_store(ok=False)`` makes nothing visible; the shard may be stored again.
- ``abandon``: the session owning in-flight writes went away; their pending entries are dropped
  at once and can never become visible. The ``finish_store`` of those writes must still follow.
- ``begin_load`` (prepare_load) takes every key or none: all committed -> each is held against
  eviction until ``finish_load`` (complete_load); otherwise nothing is taken and the missing
  keys are returned.
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
  ``release_hold`` (and ``begin_load_held`` reads them, even if removed meanwhile).
- A scheduler that mirrors a namespace's keys (``watch``) may still show a removed key as
  present: a removed committed entry of a watched namespace keeps its extents until every
  watcher acknowledged the removal (``ack``; see ``offloadd.cache.watchers``). ``acker`` on a
  call names the watcher that applies that call's removals before anything else (it asked).
- ``used_bytes <= capacity`` always; extents of live and dead-but-busy entries never overlap.
- Misuse that can only be a caller bug (a write finished twice, a load finished without its
  begin, a shard index outside the key's layout) raises ValueError and changes nothing.
"""

from __future__ import annotations

import time
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, pairwise
from types import MappingProxyType

from offloadd.cache.allocator import ExtentAllocator
from offloadd.cache.policy import EvictionPolicy, make_policy
from offloadd.cache.watchers import Watchers

__all__ = [
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

_PolicyKey = tuple[str, bytes]
_NO_ENTRIES: Mapping[bytes, Entry] = MappingProxyType({})


class Entry:
    """One cached chunk: a key's shards in the arena and the state that guards them.

    ``offsets[i]`` / ``sizes[i]`` locate shard ``i`` (``offsets`` is emptied once the extents
    are freed). ``written`` and ``writing`` are bitmasks over shards. ``pins`` maps an owner to
    its lease expiry. ``committed`` stays True after removal so that a caller handed a removed
    entry can tell whether it was ever announced; ``dead`` means removed from the index.
    """

    __slots__ = (
        "committed",
        "dead",
        "holds",
        "key",
        "leave_seq",
        "namespace",
        "offsets",
        "pins",
        "readers",
        "reserved_by",
        "sizes",
        "writing",
        "written",
    )

    def __init__(
        self, namespace: str, key: bytes, offsets: list[int], sizes: tuple[int, ...]
    ) -> None:
        self.namespace = namespace
        self.key = key
        self.offsets = offsets
        self.sizes = sizes
        self.written = 0
        self.writing = 0
        self.readers = 0
        self.pins: dict[str, float] | None = None
        self.committed = False
        self.dead = False
        self.holds = 0  # references by scheduler holds: no eviction, no freeing
        self.reserved_by: str | None = None  # a scheduler's reservation, until committed
        self.leave_seq = 0  # removed, waiting for watchers to acknowledge this sequence number

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
    """One shard copy to perform: ``keys[index]``'s ``shard`` goes to ``[offset, offset+size)``."""

    index: int
    entry: Entry
    shard: int
    offset: int
    size: int


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
    ) -> None:
        # ``boundary``: no shard extent straddles a multiple of it (see ExtentAllocator).
        self._alloc = ExtentAllocator(capacity, align, boundary=boundary)
        self._policy: EvictionPolicy[_PolicyKey] = make_policy(policy)
        self._clock = clock
        self._tables: dict[str, dict[bytes, Entry]] = {}
        # owner -> entries it pins, so that a session's end does not scan the whole index.
        self._owners: dict[str, set[Entry]] = {}
        self._entries = 0
        self._committed = 0
        self._committed_bytes = 0
        self._lookups = 0
        self._hit_keys = 0
        self._miss_keys = 0
        self._stores_refused = 0
        self._evictions = 0
        self._watchers = Watchers()
        self._leaving_bytes = 0
        # (owner, token) -> key -> (entry, count): holds of a scheduler's requests.
        self._holds: dict[tuple[str, str], dict[bytes, tuple[Entry, int]]] = {}
        self._hold_tokens: dict[str, set[str]] = {}
        self._reservations: dict[str, set[Entry]] = {}

    # -- restart ----------------------------------------------------------------------------

    def restore(self, chunks: Iterable[RestoredChunk]) -> int:
        """Rebuild committed entries after a restart (only into an empty cache).

        ``chunks`` come in the order they were committed, which seeds the eviction order.
        A chunk whose extents are unaligned, outside the arena, overlap an earlier chunk's or
        each other is skipped (a damaged record must never alias live bytes), and so is one
        whose extent straddles the allocator's boundary (written by a daemon that did not cut
        the arena).
        Returns how many were kept.
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
        for chunk in kept:
            entry = Entry(chunk.namespace, chunk.key, list(chunk.offsets), tuple(chunk.sizes))
            entry.written = (1 << len(entry.sizes)) - 1
            entry.committed = True
            self._tables.setdefault(chunk.namespace, {})[chunk.key] = entry
            self._policy.insert((chunk.namespace, chunk.key))
            self._entries += 1
            self._committed += 1
            self._committed_bytes += entry.nbytes
        return len(kept)

    def committed_chunks(self) -> list[RestoredChunk]:
        """Every committed entry, least recently used first (to journal a compact state)."""
        chunks = []
        for namespace, key in self._policy.candidates():
            entry = self._tables[namespace][key]
            if entry.committed and not entry.dead:
                chunks.append(
                    RestoredChunk(namespace, key, tuple(entry.offsets), tuple(entry.sizes))
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
    ) -> LookupOutcome:
        """Prefix hit and pending keys; touches the hits and pins them if asked."""
        table = self._tables.get(namespace, _NO_ENTRIES)
        hits = 0
        leading = True
        pending: list[int] = []
        for i, key in enumerate(keys):
            entry = table.get(key)
            if entry is None:
                leading = False
            elif entry.committed:
                if leading:
                    hits += 1
            else:
                leading = False
                pending.append(i)
        self._lookups += 1
        self._hit_keys += hits
        self._miss_keys += len(keys) - hits
        pinned = 0
        if hits:
            hit_keys = keys[:hits]
            self._policy.touch([(namespace, key) for key in hit_keys])
            if pin_owner is not None and lease > 0:
                expiry = self._clock() + lease
                for key in hit_keys:
                    self._pin(table[key], pin_owner, expiry)
                pinned = hits
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
    ) -> StoreReservation:
        """Reserve ``shard`` of each key for writing, allocating and evicting as needed.

        With ``allocate=False`` only keys that already have a pending entry (a scheduler's
        ``reserve``) are written; the others are skipped, never refused.
        """
        if shard < 0:
            raise ValueError(f"shard must not be negative, got {shard}")
        bit = 1 << shard
        res = StoreReservation([], [], [], [])
        table = self._tables.get(namespace)
        protected: frozenset[bytes] | None = None
        for i, key in enumerate(keys):
            entry = table.get(key) if table is not None else None
            if entry is not None:
                if entry.committed or (entry.written | entry.writing) & bit:
                    res.skipped.append(i)
                    continue
                if shard >= len(entry.sizes):
                    self._cancel(res.writes)
                    raise ValueError(
                        f"shard {shard} out of range for {len(entry.sizes)} shards of "
                        f"{key.hex()} in namespace {namespace!r}"
                    )
                entry.writing |= bit
                res.writes.append(
                    ShardWrite(i, entry, shard, entry.offsets[shard], entry.sizes[shard])
                )
                continue
            if not allocate:
                res.skipped.append(i)
                continue
            sizes = tuple(shard_sizes(key))
            if not sizes or shard >= len(sizes) or min(sizes) <= 0:
                self._cancel(res.writes)
                raise ValueError(f"bad shard sizes {sizes} for shard {shard} of {key.hex()}")
            if protected is None:
                protected = frozenset(keys)
            entry = self._new_entry(namespace, key, sizes, protected, res.evicted, acker)
            if entry is None:
                res.refused.extend(range(i, len(keys)))
                self._stores_refused += len(keys) - i
                break
            entry.writing = bit
            table = self._tables[namespace]
            res.writes.append(ShardWrite(i, entry, shard, entry.offsets[shard], sizes[shard]))
        return res

    def reserve(
        self,
        namespace: str,
        keys: Sequence[bytes],
        owner: str,
        shard_sizes: Callable[[bytes], tuple[int, ...]],
        *,
        acker: str | None = None,
    ) -> Reservation:
        """Allocate every shard of each new key for a later ``begin_store(allocate=False)``.

        Committed and pending keys are left out. A key that finds no room is refused, and so is
        every later key (as in ``begin_store``). Reserved entries are not evictable until they
        commit or ``release_reservations(owner)``.
        """
        res = Reservation([], [], [])
        table = self._tables.get(namespace, _NO_ENTRIES)
        protected = frozenset(keys)
        for i, key in enumerate(keys):
            if key in table:
                continue
            sizes = tuple(shard_sizes(key))
            if not sizes or min(sizes) <= 0:
                raise ValueError(f"bad shard sizes {sizes} for {key.hex()}")
            entry = self._new_entry(namespace, key, sizes, protected, res.evicted, acker)
            if entry is None:
                res.refused.extend(range(i, len(keys)))
                self._stores_refused += len(keys) - i
                break
            table = self._tables[namespace]
            entry.reserved_by = owner
            self._reservations.setdefault(owner, set()).add(entry)
            res.reserved.append(i)
        return res

    def release_reservations(self, owner: str) -> int:
        """Drop ``owner``'s reserved entries that have not committed (its scheduler left).

        Shards being written keep their extents until their ``finish_store``; nothing of a
        dropped entry ever becomes visible. Returns how many entries were dropped.
        """
        entries = self._reservations.pop(owner, set())
        for entry in entries:
            entry.reserved_by = None
            if not entry.dead:
                self._unlink(entry, evicted=False)
                self._free_if_idle(entry)
        return len(entries)

    def _new_entry(
        self,
        namespace: str,
        key: bytes,
        sizes: tuple[int, ...],
        protected: frozenset[bytes],
        evicted: list[Entry],
        acker: str | None,
    ) -> Entry | None:
        offsets = self._place(namespace, sizes, protected, evicted, acker)
        if offsets is None:
            return None
        entry = Entry(namespace, key, offsets, sizes)
        self._tables.setdefault(namespace, {})[key] = entry
        self._entries += 1
        self._policy.insert((namespace, key))
        return entry

    def finish_store(self, writes: Sequence[ShardWrite], ok: bool) -> list[Entry]:
        """End the copies of ``writes``; returns the entries that became committed."""
        seen: set[tuple[int, int]] = set()
        for w in writes:
            token = (id(w.entry), w.shard)
            if token in seen or not w.entry.writing & (1 << w.shard):
                raise ValueError(f"shard {w.shard} of {w.entry!r} is not being written")
            seen.add(token)
        committed: list[Entry] = []
        for w in writes:
            entry = w.entry
            bit = 1 << w.shard
            entry.writing &= ~bit
            if entry.dead:
                self._free_if_idle(entry)
                continue
            if ok:
                entry.written |= bit
                if entry.written == (1 << len(entry.sizes)) - 1:
                    entry.committed = True
                    self._committed += 1
                    self._committed_bytes += entry.nbytes
                    self._end_reservation(entry)
                    committed.append(entry)
        return committed

    def _end_reservation(self, entry: Entry) -> None:
        owner = entry.reserved_by
        if owner is not None:
            entry.reserved_by = None
            reserved = self._reservations[owner]
            reserved.discard(entry)
            if not reserved:
                del self._reservations[owner]

    def abandon(self, writes: Sequence[ShardWrite]) -> None:
        """Drop the pending entries of in-flight ``writes`` whose session went away.

        They leave the index now and never become visible; their extents are freed by the
        ``finish_store`` of their last copy in flight. Committed entries and writes already
        finished are left alone.
        """
        for w in writes:
            entry = w.entry
            if entry.dead or entry.committed or not entry.writing & (1 << w.shard):
                continue
            self._unlink(entry, evicted=False)

    # -- load -------------------------------------------------------------------------------

    def begin_load(self, namespace: str, keys: Sequence[bytes]) -> LoadReservation:
        """Hold every key for reading if all are committed; otherwise take nothing."""
        table = self._tables.get(namespace, _NO_ENTRIES)
        entries: list[Entry] = []
        missing: list[bytes] = []
        for key in keys:
            entry = table.get(key)
            if entry is None or not entry.committed:
                missing.append(key)
            else:
                entries.append(entry)
        if missing:
            return LoadReservation([], missing)
        for entry in entries:
            entry.readers += 1
        self._policy.touch([(namespace, key) for key in keys])
        return LoadReservation(entries, [])

    def finish_load(self, entries: Sequence[Entry]) -> None:
        """End the reads ``begin_load`` started on ``entries``."""
        counts: dict[int, int] = {}
        for entry in entries:
            n = counts[id(entry)] = counts.get(id(entry), 0) + 1
            if n > entry.readers:
                raise ValueError(f"{entry!r} is not being read")
        for entry in entries:
            entry.readers -= 1
            if entry.dead:
                self._free_if_idle(entry)

    def begin_load_held(self, owner: str, token: str, keys: Sequence[bytes]) -> LoadReservation:
        """Like ``begin_load``, for keys held under ``(owner, token)`` (removed ones too)."""
        held = self._holds.get((owner, token), {})
        missing = [key for key in keys if key not in held]
        if missing:
            return LoadReservation([], missing)
        entries = [held[key][0] for key in keys]
        for entry in entries:
            entry.readers += 1
        return LoadReservation(entries, [])

    # -- holds ------------------------------------------------------------------------------

    def hold(self, namespace: str, owner: str, token: str, keys: Sequence[bytes]) -> list[bytes]:
        """Hold each committed key for ``(owner, token)``; returns the keys that are not.

        A key removed while a watcher may still show it (see ``watch``) can be held too: its
        bytes are intact. Holding a key twice for one token needs two releases.
        """
        table = self._tables.get(namespace, _NO_ENTRIES)
        held = self._holds.get((owner, token))
        missing: list[bytes] = []
        touched: list[_PolicyKey] = []
        for key in keys:
            entry = table.get(key)
            if entry is not None and entry.committed:
                touched.append((namespace, key))
            else:
                entry = self._watchers.find(namespace, key)
                if entry is None:
                    missing.append(key)
                    continue
            if held is None:
                held = self._holds[(owner, token)] = {}
                self._hold_tokens.setdefault(owner, set()).add(token)
            previous = held.get(key)
            if previous is not None and previous[0] is not entry:
                self._unhold(previous[0], previous[1])  # re-held after a re-store: keep newest
                previous = None
            held[key] = (entry, 1 if previous is None else previous[1] + 1)
            entry.holds += 1
        if touched:
            self._policy.touch(touched)
        return missing

    def release_hold(self, owner: str, token: str, keys: Sequence[bytes]) -> int:
        """Drop one hold of ``(owner, token)`` on each key; returns how many were dropped."""
        held = self._holds.get((owner, token))
        if held is None:
            return 0
        dropped = 0
        for key in keys:
            found = held.get(key)
            if found is None:
                continue
            entry, count = found
            if count > 1:
                held[key] = (entry, count - 1)
            else:
                del held[key]
            self._unhold(entry, 1)
            dropped += 1
        if not held:
            del self._holds[(owner, token)]
            tokens = self._hold_tokens[owner]
            tokens.discard(token)
            if not tokens:
                del self._hold_tokens[owner]
        return dropped

    def release_holds(self, owner: str) -> int:
        """Drop every hold of ``owner`` (its scheduler left); returns how many keys."""
        dropped = 0
        for token in self._hold_tokens.pop(owner, set()):
            for entry, count in self._holds.pop((owner, token)).values():
                self._unhold(entry, count)
                dropped += 1
        return dropped

    def _unhold(self, entry: Entry, count: int) -> None:
        entry.holds -= count
        if entry.dead:
            self._free_if_idle(entry)

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

    def _release_leaving(self, entries: list[Entry]) -> None:
        for entry in entries:
            self._leaving_bytes -= self._footprint(entry)
            self._free_if_idle(entry)

    # -- pins -------------------------------------------------------------------------------

    def release(self, namespace: str, keys: Sequence[bytes], owner: str) -> int:
        """Drop ``owner``'s pins on ``keys``; returns how many pins were dropped."""
        table = self._tables.get(namespace, _NO_ENTRIES)
        owned = self._owners.get(owner)
        if owned is None:
            return 0
        dropped = 0
        for key in keys:
            entry = table.get(key)
            if entry is None or entry.pins is None or owner not in entry.pins:
                continue
            del entry.pins[owner]
            if not entry.pins:
                entry.pins = None
            owned.discard(entry)
            dropped += 1
        if not owned:
            del self._owners[owner]
        return dropped

    def release_owner(self, owner: str) -> int:
        """Drop every pin of ``owner`` (its session ended); returns how many were dropped."""
        owned = self._owners.pop(owner, None)
        if owned is None:
            return 0
        for entry in owned:
            pins = entry.pins
            assert pins is not None
            del pins[owner]
            if not pins:
                entry.pins = None
        return len(owned)

    # -- removal ----------------------------------------------------------------------------

    def remove(self, namespace: str, keys: Sequence[bytes]) -> list[Entry]:
        """Drop ``keys`` (committed or pending); returns the removed committed entries."""
        table = self._tables.get(namespace)
        if table is None:
            return []
        removed: list[Entry] = []
        for key in keys:
            entry = table.get(key)
            if entry is not None:
                self._drop(entry, removed)
        return removed

    def clear_namespace(self, namespace: str, *, acker: str | None = None) -> list[Entry]:
        """Drop every entry of ``namespace``; returns the removed committed entries."""
        table = self._tables.get(namespace)
        if table is None:
            return []
        removed: list[Entry] = []
        for entry in list(table.values()):
            self._drop(entry, removed)
        del self._tables[namespace]
        if acker is not None:
            self.ack(acker, self.seq)
        return removed

    # -- inspection -------------------------------------------------------------------------

    def keys_in(self, namespace: str) -> list[bytes]:
        """Committed keys of ``namespace``, e.g. to announce a warm cache to a new engine."""
        table = self._tables.get(namespace, _NO_ENTRIES)
        return [key for key, entry in table.items() if entry.committed]

    def get(self, namespace: str, key: bytes) -> Entry | None:
        """The live entry (committed or pending) for ``key``, if any."""
        return self._tables.get(namespace, _NO_ENTRIES).get(key)

    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
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
        )

    # -- internals --------------------------------------------------------------------------

    def _pin(self, entry: Entry, owner: str, expiry: float) -> None:
        pins = entry.pins
        if pins is None:
            pins = entry.pins = {}
        old = pins.get(owner)
        if old is None or expiry > old:
            pins[owner] = expiry
        self._owners.setdefault(owner, set()).add(entry)

    def _pinned(self, entry: Entry, now: float) -> bool:
        """Whether an unexpired pin holds ``entry``; drops the pins if all have expired."""
        pins = entry.pins
        if pins is None:
            return False
        if any(expiry > now for expiry in pins.values()):
            return True
        self._drop_pins(entry)
        return False

    def _drop_pins(self, entry: Entry) -> None:
        assert entry.pins is not None
        for owner in entry.pins:
            owned = self._owners[owner]
            owned.discard(entry)
            if not owned:
                del self._owners[owner]
        entry.pins = None

    def _footprint(self, entry: Entry) -> int:
        return sum(self._alloc.alloc_size(size) for size in entry.sizes)

    def _try_alloc(self, sizes: tuple[int, ...]) -> list[int] | None:
        """All shards' extents, or None (and nothing held) if one does not fit."""
        offsets: list[int] = []
        for size in sizes:
            offset = self._alloc.alloc(size)
            if offset is None:
                for held, held_size in zip(offsets, sizes, strict=False):
                    self._alloc.free(held, held_size)
                return None
            offsets.append(offset)
        return offsets

    def _evictable(
        self, namespace: str, protected: frozenset[bytes], now: float
    ) -> Iterator[Entry]:
        """Evictable entries in policy order; must be dropped before the policy changes."""
        tables = self._tables
        for ns, key in self._policy.candidates():
            if ns == namespace and key in protected:
                continue
            entry = tables[ns][key]
            if (
                entry.readers
                or entry.writing
                or entry.holds
                or entry.reserved_by is not None
                or self._pinned(entry, now)
            ):
                continue
            yield entry

    def _place(
        self,
        namespace: str,
        sizes: tuple[int, ...],
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
        need = sum(alloc.alloc_size(size) for size in sizes)
        if need > alloc.capacity or any(alloc.alloc_size(s) > alloc.max_alloc for s in sizes):
            return None
        if alloc.free_bytes >= need:
            offsets = self._try_alloc(sizes)
            if offsets is not None:
                return offsets
        now = self._clock()
        victims: list[Entry] = []
        found_now = alloc.free_bytes
        if found_now < need:
            # Dry run: evict nothing unless enough evictable bytes exist.
            found_later = self._leaving_bytes
            for entry in self._evictable(namespace, protected, now):
                if self._frees_at_once(entry, acker):
                    victims.append(entry)
                    found_now += self._footprint(entry)
                elif found_now + found_later < need:  # else: the room is already on its way
                    victims.append(entry)
                    found_later += self._footprint(entry)
                if found_now + found_later >= need:
                    break
            else:
                return None
            for entry in victims:
                self._evict(entry, evicted, acker)
            if found_now < need:
                return None
            offsets = self._try_alloc(sizes)
            if offsets is not None:
                return offsets
        # Enough bytes are free but no extent fits (mixed sizes fragment the arena): keep
        # evicting one victim at a time. Batches double so skipped entries are rescanned rarely.
        batch = max(8, len(victims))
        while True:
            more = [
                entry
                for entry in islice(self._evictable(namespace, protected, now), batch)
                if self._frees_at_once(entry, acker)
            ]
            if not more:
                return None
            for entry in more:
                self._evict(entry, evicted, acker)
                offsets = self._try_alloc(sizes)
                if offsets is not None:
                    return offsets
            batch *= 2

    def _frees_at_once(self, entry: Entry, acker: str | None) -> bool:
        """Whether evicting ``entry`` frees its extents now (no other watcher must ack)."""
        return not entry.committed or self._watchers.only(entry.namespace, acker)

    def _unlink(self, entry: Entry, *, evicted: bool) -> None:
        """Take ``entry`` out of the index, the policy and the pin map; mark it dead."""
        del self._tables[entry.namespace][entry.key]
        policy_key = (entry.namespace, entry.key)
        if evicted:
            self._policy.evicted(policy_key)
        else:
            self._policy.remove(policy_key)
        if entry.pins is not None:
            self._drop_pins(entry)
        self._entries -= 1
        if entry.committed:
            self._committed -= 1
            self._committed_bytes -= entry.nbytes
            if self._watchers.leave(entry):
                self._leaving_bytes += self._footprint(entry)
        else:
            self._end_reservation(entry)
        entry.dead = True

    def _evict(self, entry: Entry, evicted: list[Entry], acker: str | None) -> None:
        self._unlink(entry, evicted=True)
        if acker is not None and entry.leave_seq:
            self.ack(acker, self.seq)
        self._free_if_idle(entry)
        self._evictions += 1
        evicted.append(entry)

    def _drop(self, entry: Entry, removed: list[Entry]) -> None:
        self._unlink(entry, evicted=False)
        self._free_if_idle(entry)
        if entry.committed:
            removed.append(entry)

    def _free_if_idle(self, entry: Entry) -> None:
        """Free a dead entry's extents once no copy references them."""
        if (
            entry.offsets
            and not entry.readers
            and not entry.writing
            and not entry.holds
            and not entry.leave_seq
        ):
            for offset, size in zip(entry.offsets, entry.sizes, strict=True):
                self._alloc.free(offset, size)
            entry.offsets = []

    def _cancel(self, writes: list[ShardWrite]) -> None:
        """Undo the writing bits of a ``begin_store`` that is about to raise."""
        for w in writes:
            w.entry.writing &= ~(1 << w.shard)

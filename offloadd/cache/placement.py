"""Where new entries go and how old ones leave: room, eviction, removal (pure, no I/O).

Contract of ``Placement`` (the rules themselves are ``ChunkCache``'s, in its docstring):

- ``new_entry`` places a new key's shards, evicting in policy order if needed, or returns
  None (nothing evicted unless enough evictable bytes exist: a dry run first);
  ``make_room`` evicts ahead for a whole reservation at once.
- A removed committed entry of a watched namespace leaves through the ``Watchers``: its
  extents stay until every watcher acknowledged (``release_leaving``), and the room it will
  free is *on its way*. A reserved key that only such room fits is *unplaced*
  (``new_unplaced``): ``place_waiting`` gives unplaced rows their extents, in reservation
  order, when room was freed, and then tells ``heard`` (``placed()``; the stores tell it
  what they evicted, ``offloadd.cache.listeners``).
- ``unlink`` takes a row out of the index, the policy and its protections and marks it dead;
  ``free_if_idle`` releases a dead row once no copy, hold or watcher uses it, ``settle``
  does so for rows a protection let go. Every row leaves through these two.
- ``expire`` drops the reservations whose lease ended (``Protections.lapsed``).
- ``restore`` rebuilds the committed entries whose extents are sound after a restart, and
  the allocator around them; ``committed_chunks`` lists them for the journal.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice, pairwise

from offloadd.cache import lifecycle
from offloadd.cache.allocator import ExtentAllocator
from offloadd.cache.lifecycle import COMMITTED, LEAVING, PINNED, Event
from offloadd.cache.listeners import Listeners
from offloadd.cache.protections import Protections
from offloadd.cache.records import (
    REFUSED_ACK,
    REFUSED_EXPIRED,
    REFUSED_FULL,
    Entry,
    Handles,
    RestoredChunk,
)
from offloadd.cache.rows import NO_ROWS, Rows
from offloadd.cache.watchers import Watchers

__all__ = ["Placement"]

# Never evicted (pins are checked apart).
_BUSY = lifecycle.WRITING | lifecycle.READING | lifecycle.HELD | lifecycle.RESERVED
# Per state byte: whether the row may be freed (dead, and no copy, hold or watcher uses it).
_RELEASABLE = lifecycle.allowed(Event.RELEASE)
_UNLINK = int(Event.UNLINK)
_UNLINK_WATCHED = int(Event.UNLINK_WATCHED)
_ACK = int(Event.ACK)


class Placement:
    """Room, eviction and rows leaving; see the module docstring."""

    def __init__(
        self,
        rows: Rows,
        guards: Protections,
        watchers: Watchers,
        handles: Handles,
        clock: Callable[[], float],
    ) -> None:
        self._rows = rows
        self._guards = guards
        self._watchers = watchers
        self._handles = handles
        self._clock = clock
        # Reserved rows whose extents wait for room on its way (removals other watchers must
        # acknowledge), in reservation order; their extents are placed when it comes.
        self.unplaced: dict[int, None] = {}
        self._unplaced_bytes = 0
        self.heard = Listeners()
        self._leaving_bytes = 0
        self.evictions = 0
        self.stores_refused = 0
        self.refused: dict[str, int] = {}

    def refuse(self, reason: str, count: int) -> None:
        """Count ``count`` keys refused for ``reason``."""
        if count:
            self.refused[reason] = self.refused.get(reason, 0) + count

    def refuse_full(self, count: int) -> None:
        """Count ``count`` keys refused for want of room."""
        self.stores_refused += count
        self.refuse(REFUSED_FULL, count)

    def expire(self, now: float) -> None:
        """Drop the reservations whose lease ended by ``now`` (the unwritten ones' rows)."""
        for row in self._guards.lapsed(now):
            self.refuse(REFUSED_EXPIRED, 1)
            self.unlink(row, evicted=False)
            self.free_if_idle(row)

    # -- room -------------------------------------------------------------------------------

    def on_its_way(self) -> int:
        """Bytes that acknowledgements will free and no unplaced row has claimed yet."""
        return self._leaving_bytes - self._unplaced_bytes

    def make_room(
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
        alloc = self._rows.alloc
        found_now = alloc.free_bytes
        found_later = self.on_its_way()
        target = need
        if not self._watchers.only(namespace, acker):
            target += min(need, alloc.capacity // 8)
        if found_now >= need and found_now + found_later >= target:
            return
        victims: list[int] = []
        footprint = self._rows.footprint
        for row in self._evictable(namespace, protected, self._clock()):
            if self._frees_at_once(row, acker):
                victims.append(row)
                found_now += footprint(row)
            elif found_now + found_later < target:
                victims.append(row)
                found_later += footprint(row)
            if found_now + found_later >= target:
                break
        if found_now + found_later < need:
            return  # not enough: each key tries on its own (_place), the rest are refused
        self._evict(victims, evicted, acker)

    def reserve_room(
        self,
        namespace: str,
        key: bytes,
        shape: int,
        protected: frozenset[bytes],
        evicted: list[Entry],
        acker: str | None,
    ) -> int | None:
        """A row for a key being reserved: placed, unplaced (its room is on its way), or
        None (refused)."""
        footprint = self._rows.footprints[shape]
        row: int | None = None
        if self._rows.alloc.free_bytes >= footprint or self.on_its_way() < footprint:
            row = self.new_entry(namespace, key, shape, protected, evicted, acker)
        if row is None and self._rows.fits[shape] and self.on_its_way() >= footprint:
            row = self._rows.new_row(namespace, key, shape, [0] * len(self._rows.needs[shape]))
            self.unplaced[row] = None
            self._unplaced_bytes += footprint
        return row

    def reserve_rows(
        self,
        namespace: str,
        new: Sequence[tuple[int, bytes, int]],
        protected: frozenset[bytes],
        evicted: list[Entry],
        acker: str | None,
    ) -> list[int]:
        """``reserve_room`` of each ``(index, key, shape)`` of ``new`` in order, until one is
        refused; the rows. Keys of a one-shard shape whose extents are free already (room
        made by ``make_room``) get them, and their rows, in one batch."""
        rows = self._rows
        made: list[int] = []
        start = 0
        while start < len(new):
            shape = new[start][2]
            needs = rows.needs[shape]
            if len(needs) == 1 and rows.fits[shape]:
                end = start + 1
                while end < len(new) and new[end][2] == shape:
                    end += 1
                offsets = rows.alloc.take_many(needs[0], end - start)
                if offsets:
                    keys = [key for _index, key, _shape in new[start : start + len(offsets)]]
                    made += rows.new_rows(namespace, keys, shape, offsets)
                    start += len(offsets)
                    continue
            _index, key, shape = new[start]  # no extent free: evict or wait, as one key does
            row = self.reserve_room(namespace, key, shape, protected, evicted, acker)
            if row is None:
                break
            made.append(row)
            start += 1
        return made

    def place_unplaced(self, row: int) -> bool:
        """Give the unplaced ``row`` its extents if they fit now."""
        shape = self._rows.shape.v[row]
        offsets = self._try_alloc(shape)
        if offsets is None:
            return False
        del self.unplaced[row]
        self._unplaced_bytes -= self._rows.footprints[shape]
        self._rows.place(row, offsets)
        return True

    def drop_unplaced(self, row: int) -> None:
        """The ranks store the unplaced ``row`` before its room came: it is refused."""
        self.unlink(row, evicted=False)
        self.free_if_idle(row)
        self.refuse(REFUSED_ACK, 1)

    def place_waiting(self) -> None:
        """Place the unplaced rows, in reservation order, as far as the free room goes."""
        placed = False
        for row in list(self.unplaced):
            if not self.place_unplaced(row):
                break
            placed = True
        if placed:
            self.heard.placed()

    def count_unplaced(self, namespace: str, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` are reserved unplaced still, placing those that fit now."""
        if not self.unplaced:
            return 0
        table = self._rows.tables.get(namespace, NO_ROWS)
        waiting = 0
        for key in keys:
            row = table.get(key)
            if row is not None and row in self.unplaced and not self.place_unplaced(row):
                waiting += 1
        return waiting

    def new_entry(
        self,
        namespace: str,
        key: bytes,
        shape: int,
        protected: frozenset[bytes],
        evicted: list[Entry],
        acker: str | None,
    ) -> int | None:
        """A new pending row for ``key`` with its extents placed, or None (no room)."""
        rows = self._rows
        needs = rows.needs[shape]
        offsets: list[int] | None = None
        if len(needs) == 1 and rows.fits[shape]:
            # The usual case, first as _place would try it: one shard, room without evicting.
            # A failed try changes nothing, so _place may try again.
            offset = rows.alloc.take(needs[0])
            if offset is not None:
                offsets = [offset]
        if offsets is None:
            offsets = self._place(namespace, shape, protected, evicted, acker)
            if offsets is None:
                return None
        return rows.new_row(namespace, key, shape, offsets)

    def _try_alloc(self, shape: int) -> list[int] | None:
        """All shards' extents, or None (and nothing held) if one does not fit."""
        alloc = self._rows.alloc
        take = alloc.take
        needs = self._rows.needs[shape]
        if len(needs) == 1:  # the usual case: one shard per key (a rank's, or replicated)
            offset = take(needs[0])
            return None if offset is None else [offset]
        offsets: list[int] = []
        for need in needs:
            offset = take(need)
            if offset is None:
                for held, held_size in zip(offsets, self._rows.shapes[shape], strict=False):
                    alloc.free(held, held_size)
                return None
            offsets.append(offset)
        return offsets

    def _evictable(self, namespace: str, protected: frozenset[bytes], now: float) -> Iterator[int]:
        """Evictable rows in policy order; must be dropped before the policy changes."""
        rows = self._rows
        state, namespace_of, keys = rows.state.v, rows.ns.v, rows.keys
        namespace_id = rows.namespace_ids.get(namespace, -1)
        pinned = self._guards.pinned
        for row in rows.policy.candidates():
            if namespace_of[row] == namespace_id and keys[row] in protected:
                continue
            bits = state[row]
            if bits & _BUSY or (bits & PINNED and pinned(row, now)):
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
        rows = self._rows
        alloc = rows.alloc
        if not rows.fits[shape]:
            return None
        need = rows.footprints[shape]
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
                    found_now += rows.footprint(row)
                elif found_now + found_later < need:  # else: the room is already on its way
                    victims.append(row)
                    found_later += rows.footprint(row)
                if found_now + found_later >= need:
                    break
            else:
                return None
            self._evict(victims, evicted, acker)
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
                self._evict([row], evicted, acker)
                offsets = self._try_alloc(shape)
                if offsets is not None:
                    return offsets
            batch *= 2

    def _frees_at_once(self, row: int, acker: str | None) -> bool:
        """Whether evicting ``row`` frees its extents now (no other watcher must ack)."""
        rows = self._rows
        return not rows.state.v[row] & COMMITTED or self._watchers.only(
            rows.namespaces[rows.ns.v[row]], acker
        )

    # -- leaving ----------------------------------------------------------------------------

    def unlink(self, row: int, *, evicted: bool) -> None:
        """Take ``row`` out of the index, the policy and the pin map; mark it dead."""
        rows = self._rows
        namespace_id = rows.ns.v[row]
        namespace = rows.namespaces[namespace_id]
        key = rows.keys[row]
        assert key is not None
        del rows.tables[namespace][key]
        if evicted:
            rows.policy.evicted(row, namespace_id, key)
        else:
            rows.policy.remove(row)
        state = rows.state.v
        if state[row] & PINNED:
            self._guards.drop_pins(row)
        rows.entries -= 1
        event = _UNLINK
        if state[row] & COMMITTED:
            rows.committed -= 1
            rows.committed_bytes -= rows.nbytes[rows.shape.v[row]]
            if self._watchers.leave(namespace, key, row):
                event = _UNLINK_WATCHED
                self._leaving_bytes += rows.footprint(row)
        else:
            self._guards.end_reservation(row)
        state[row] = lifecycle.step(state[row], event)

    def _evict(self, victims: Sequence[int], evicted: list[Entry], acker: str | None) -> None:
        """Evict ``victims`` (their handles to ``evicted``); the acker acknowledges its own
        removals of them at once, in one call, so the room they leave is free now."""
        handle, state = self._handles.get, self._rows.state.v
        leaving = False
        for row in victims:
            self.unlink(row, evicted=True)
            evicted.append(handle(row))
            leaving = leaving or bool(state[row] & LEAVING)
        if acker is not None and leaving:
            self.ack(acker, self._watchers.seq)
        for row in victims:
            self.free_if_idle(row)
        self.evictions += len(victims)

    def drop(self, row: int, removed: list[Entry]) -> None:
        """Remove ``row``; a committed one's handle goes to ``removed``."""
        self.unlink(row, evicted=False)
        entry = self._handles.get(row) if self._rows.state.v[row] & COMMITTED else None
        self.free_if_idle(row)
        if entry is not None:
            removed.append(entry)

    def free_if_idle(self, row: int) -> None:
        """Release a dead row (and its extents) once no copy, hold or watcher uses them."""
        rows = self._rows
        if _RELEASABLE[rows.state.v[row]] and rows.keys[row] is not None:
            self._handles.release(row)
            placed = row not in self.unplaced
            if not placed:  # it never had extents
                del self.unplaced[row]
                self._unplaced_bytes -= rows.footprint(row)
            rows.release(row, extents=placed)

    def settle(self, dead: Sequence[int]) -> None:
        """Release the dead ``rows`` a protection or a copy let go, and place what waits."""
        for row in dead:
            self.free_if_idle(row)
        if dead and self.unplaced:
            self.place_waiting()

    def ack(self, watcher: str, seq: int) -> None:
        """``watcher`` applied every removal up to ``seq``."""
        self.release_leaving(self._watchers.ack(watcher, seq))

    def release_leaving(self, leaving: list[int]) -> None:
        """The removed ``leaving`` rows were acknowledged by every watcher."""
        rows = self._rows
        state = rows.state.v
        for row in leaving:
            state[row] = lifecycle.step(state[row], _ACK)
            self._leaving_bytes -= rows.footprint(row)
            self.free_if_idle(row)
        if leaving and self.unplaced:
            self.place_waiting()

    # -- restart ----------------------------------------------------------------------------

    def restore(self, chunks: Iterable[RestoredChunk]) -> int:
        """Rebuild the committed entries of ``chunks`` whose extents are sound (see
        ``ChunkCache.restore``), the allocator with them; returns how many."""
        rows = self._rows
        alloc = rows.alloc
        align, capacity, straddles = alloc.align, alloc.capacity, alloc.straddles
        kept: list[RestoredChunk] = []
        taken: list[tuple[int, int]] = []  # (start, end) of accepted extents, kept sorted
        for chunk in chunks:
            spans = [
                (offset, offset + alloc.alloc_size(size))
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
        rows.alloc = ExtentAllocator.with_allocated(
            capacity,
            [(o, z) for c in kept for o, z in zip(c.offsets, c.sizes, strict=True)],
            align,
            boundary=alloc.boundary,
        )
        new = []
        for chunk in kept:
            shape = rows.shape_id(tuple(chunk.sizes))
            new.append(rows.new_row(chunk.namespace, chunk.key, shape, list(chunk.offsets)))
            rows.committed += 1
            rows.committed_bytes += sum(chunk.sizes)
        state = rows.state.a
        state[new] = lifecycle.step_all(state[new], Event.COMMIT)
        return len(kept)

    def committed_chunks(self) -> list[RestoredChunk]:
        """Every committed entry, least recently used first."""
        rows = self._rows
        state, namespace_of, shape_of = rows.state.v, rows.ns.v, rows.shape.v
        chunks = []
        for row in rows.policy.candidates():
            if state[row] & COMMITTED:
                key = rows.keys[row]
                assert key is not None
                chunks.append(
                    RestoredChunk(
                        rows.namespaces[namespace_of[row]],
                        key,
                        tuple(rows.offsets_of(row)),
                        rows.shapes[shape_of[row]],
                    )
                )
        return chunks


def _overlaps(taken: list[tuple[int, int]], start: int, end: int) -> bool:
    i = bisect_left(taken, (start, start))
    if i > 0 and taken[i - 1][1] > start:
        return True
    return i < len(taken) and taken[i][0] < end

"""New chunks: scheduler reservations and the two-phase store (pure, no I/O).

The write path of ``ChunkCache`` (its docstring states the rules): ``begin`` reserves one
rank's shard of each key, allocating and evicting through ``Placement``; ``finish`` ends
those copies and commits an entry when its last shard (or writer) is written; ``abandon``
drops the pending entries of a session that went away. ``reserve`` allocates new keys ahead
of their ranks for a scheduler and marks them as its own in ``Protections``;
``release_reservations`` drops what a scheduler reserved and never stored. What ``begin``
and ``reserve`` evicted is told to the cache's listeners (``Placement.heard``) before they
return, even when ``begin`` raises.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from offloadd.cache import lifecycle
from offloadd.cache.lifecycle import COMMITTED, DEAD, Event
from offloadd.cache.placement import Placement
from offloadd.cache.protections import Protections
from offloadd.cache.records import (
    REFUSED_BUDGET,
    REFUSED_EXPIRED,
    REFUSED_TENANT,
    Entry,
    Handles,
    Reservation,
    ShardWrite,
    StoreReservation,
)
from offloadd.cache.rows import NO_ROWS, Rows

__all__ = ["Stores"]

_COMMIT = int(Event.COMMIT)
_INF = float("inf")


class Stores:
    """Reservations and two-phase stores of new chunks; see the module docstring."""

    def __init__(
        self,
        rows: Rows,
        guards: Protections,
        placement: Placement,
        handles: Handles,
        clock: Callable[[], float],
    ) -> None:
        self._rows = rows
        self._guards = guards
        self._placement = placement
        self._handles = handles
        self._clock = clock

    def begin(
        self,
        namespace: str,
        keys: Sequence[bytes],
        shard: int,
        shard_sizes: Callable[[bytes], tuple[int, ...]],
        allocate: bool,
        acker: str | None,
        writers: int,
    ) -> StoreReservation:
        """``ChunkCache.begin_store``."""
        if shard < 0:
            raise ValueError(f"shard must not be negative, got {shard}")
        if writers and shard >= writers:
            raise ValueError(f"writer {shard} out of range for {writers} writers")
        bit = 1 << shard
        rows, place, handle = self._rows, self._placement, self._handles.get
        place.expire(self._clock())
        part = shard if writers else -1
        res = StoreReservation([], [], [], [])
        table = rows.tables.get(namespace, NO_ROWS)
        unplaced = place.unplaced
        protected: frozenset[bytes] | None = None
        checked: tuple[int, ...] | None = None  # the last new key's sizes, checked (see reserve)
        shape = -1
        for i, key in enumerate(keys):
            row = table.get(key)
            if row is not None and row in unplaced and not place.place_unplaced(row):
                place.drop_unplaced(row)  # its room still waits for another mirror: too late
                res.skipped.append(i)
                continue
            if row is not None:
                active = rows.written.get(row, 0) | rows.writing.get(row, 0)
                if rows.state.v[row] & COMMITTED or active & bit:
                    res.skipped.append(i)
                    continue
                sizes = rows.shapes[rows.shape.v[row]]
                if writers:
                    if len(sizes) != 1 or (active and rows.writers.get(row, 1) != writers):
                        res.skipped.append(i)  # another layout's writers fill it
                        continue
                    rows.set_writers(row, writers)
                elif shard >= len(sizes):
                    self._cancel(res)
                    raise ValueError(
                        f"shard {shard} out of range for {len(sizes)} shards of "
                        f"{key.hex()} in namespace {namespace!r}"
                    )
            elif not allocate:
                res.skipped.append(i)
                continue
            else:
                sizes = shard_sizes(key)
                if sizes is not checked:
                    sizes = tuple(sizes)
                    bad = len(sizes) != 1 if writers else shard >= len(sizes)
                    if not sizes or bad or min(sizes) <= 0:
                        self._cancel(res)
                        raise ValueError(
                            f"bad shard sizes {sizes} for shard {shard} of {key.hex()}"
                        )
                    shape, checked = rows.shape_id(sizes), sizes
                if protected is None:
                    protected = frozenset(keys)
                row = place.new_entry(namespace, key, shape, protected, res.evicted, acker)
                if row is None:
                    res.refused.extend(range(i, len(keys)))
                    place.refuse_full(len(keys) - i)
                    break
                table = rows.tables[namespace]
                if writers:
                    rows.set_writers(row, writers)
            rows.start_writing(row, bit)
            one = 0 if writers else shard
            offset = rows.offsets.v[rows.base.v[row] + one] * rows.align
            res.writes.append(ShardWrite(i, handle(row), one, offset, sizes[one], part))
        place.heard.removed(res.evicted)
        return res

    def _cancel(self, res: StoreReservation) -> None:
        """Undo the writing bits of a ``begin`` that is about to raise; what it evicted
        already is gone all the same, and told."""
        for w in res.writes:
            self._rows.stop_writing(w.entry._row, w.bit)
        self._placement.heard.removed(res.evicted)

    def finish(self, writes: Sequence[ShardWrite], ok: bool) -> list[Entry]:
        """``ChunkCache.finish_store``."""
        rows = self._rows
        seen: set[tuple[int, int]] = set()
        for w in writes:
            row = w.entry._row
            token = (row, w.bit)
            if row < 0 or token in seen or not rows.writing.get(row, 0) & w.bit:
                raise ValueError(f"shard {w.shard} of {w.entry!r} is not being written")
            seen.add(token)
        committed: list[Entry] = []
        committing: list[int] = []  # their rows
        dead: list[int] = []
        state = rows.state.v
        for w in writes:
            entry = w.entry
            row = entry._row
            bit = w.bit
            rows.stop_writing(row, bit)
            if state[row] & DEAD:
                dead.append(row)
                continue
            if ok:
                written = rows.written.get(row, 0) | bit
                if written == (1 << rows.writers.get(row, len(entry.sizes))) - 1:
                    rows.written.pop(row, None)
                    rows.writers.pop(row, None)
                    committing.append(row)
                    committed.append(entry)
                else:
                    rows.written[row] = written
        # Their reservations end (never outliving the pending entry) before they commit.
        self._guards.committed(committing)
        for row, entry in zip(committing, committed, strict=True):
            state[row] = lifecycle.step(state[row], _COMMIT)
            rows.committed_bytes += entry.nbytes
        rows.committed += len(committing)
        self._placement.settle(dead)
        return committed

    def abandon(self, writes: Sequence[ShardWrite]) -> None:
        """``ChunkCache.abandon``."""
        state, writing = self._rows.state.v, self._rows.writing
        for w in writes:
            row = w.entry._row
            if row < 0 or state[row] & (DEAD | COMMITTED):
                continue
            if writing.get(row, 0) & w.bit:
                self._placement.unlink(row, evicted=False)

    def reserve(
        self,
        namespace: str,
        keys: Sequence[bytes],
        owner: str,
        shard_sizes: Callable[[bytes], tuple[int, ...]],
        acker: str | None,
        account: Hashable | None,
        tenant: Hashable | None,
    ) -> Reservation:
        """``ChunkCache.reserve``."""
        res = Reservation([], [], [])
        rows, place, guards = self._rows, self._placement, self._guards
        now = self._clock()
        place.expire(now)
        if account is not None or tenant is not None:
            within = _within_room(keys, shard_sizes, guards.room(account, tenant, now))
            if len(within) < len(keys):
                known = rows.tables.get(namespace, NO_ROWS)
                beyond = sum(key not in known for key in keys[len(within) :])
                tenants = guards.tenant_binds(account, tenant)
                place.refuse(REFUSED_TENANT if tenants else REFUSED_BUDGET, beyond)
                keys = within
        table = rows.tables.get(namespace, NO_ROWS)
        protected = frozenset(keys)
        # Keys of one group get the same sizes tuple: checked and interned once, not per key.
        checked: tuple[int, ...] | None = None
        shape = -1
        new: list[tuple[int, bytes, int]] = []
        seen: set[bytes] = set()  # a key named twice is reserved once
        for i, key in enumerate(keys):
            if key in table or key in seen:
                continue
            seen.add(key)
            if not guards.renewable(namespace, key):
                place.refuse(REFUSED_EXPIRED, 1)  # reserved too often, never stored
                continue
            sizes = shard_sizes(key)
            if sizes is not checked:
                sizes = tuple(sizes)
                if not sizes or min(sizes) <= 0:
                    raise ValueError(f"bad shard sizes {sizes} for {key.hex()}")
                shape, checked = rows.shape_id(sizes), sizes
            new.append((i, key, shape))
        if new:
            need = sum(rows.footprints[shape] for _i, _key, shape in new)
            place.make_room(namespace, need, protected, res.evicted, acker)
        # The rows made so far cannot be evicted for the later ones: their keys are
        # ``protected``.
        leased = place.reserve_rows(namespace, new, protected, res.evicted, acker)
        res.reserved = [i for i, _key, _shape in new[: len(leased)]]
        if len(leased) < len(new):
            first = new[len(leased)][0]
            res.refused.extend(range(first, len(keys)))
            place.refuse_full(len(keys) - first)
        guards.reserve(leased, owner, account, tenant)
        guards.lease(leased, now)
        place.heard.removed(res.evicted)
        return res

    def release_reservations(self, owner: str) -> int:
        """``ChunkCache.release_reservations``."""
        rows = self._guards.release_reservations(owner)
        place = self._placement
        for row in rows:
            place.unlink(row, evicted=False)
            place.free_if_idle(row)
        if rows and place.unplaced:
            place.place_waiting()
        return len(rows)


def _within_room(
    keys: Sequence[bytes], shard_sizes: Callable[[bytes], tuple[int, ...]], room: float
) -> Sequence[bytes]:
    """The leading ``keys`` whose bytes fit ``room``."""
    if room == _INF:
        return keys
    for i, key in enumerate(keys):
        cost = sum(shard_sizes(key))
        if cost > room:
            return keys[:i]
        room -= cost
    return keys

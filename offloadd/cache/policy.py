"""Eviction order for the host chunk cache, over the cache's row numbers.

A policy only *orders* live rows; whether a row may be evicted right now (being loaded, pinned,
being written, part of the store that needs the room) is the cache's decision. ``RowLru`` is
vLLM's LRU and ``RowArc`` vLLM's ARC (its offloading ``cpu/policies``), adapted to a cache whose
capacity is in bytes, not slots: the adaptive target and the ghost lists are bounded by the
number of live rows instead of a slot count. ``ChunkCache`` makes one with
``make_row_policy``. Contract of ``RowPolicy``:

- ``grow(n)``: make room for rows ``< n``, before any of them is used.
- ``insert(row, namespace, key)``: a new live row (the cache just allocated it), holding
  ``key`` of namespace id ``namespace``. Inserting a live row counts as a touch.
- ``touch(rows)``: the live rows were used (a lookup hit, a load). They are walked in reverse,
  as vLLM does, so that the earlier rows of a prefix end up most recent: a prefix is only
  useful from its start, so its head should outlive its tail.
- ``candidates()``: the live rows in eviction order, first = evict first. The caller may stop
  early and skips rows it cannot evict; it never mutates the policy while iterating (it
  collects victims, drops the iterator, then reports each with ``evicted``).
- ``evicted(row, namespace, key)``: the cache evicted a live row to make room (ARC remembers
  its ``(namespace id, key)`` as a ghost, since the row itself will be reused).
- ``remove(row)``: the live row left for another reason (explicit removal, abandoned store);
  no history is kept.
- ``len(policy)``: live rows.

The reference oracles, the same two orders over keys with one ordered dict per list, live in
``tests/oracles.py``; the unit tests run each row policy side by side with its oracle.

How they do it without links: each list is an ``_Order``, a log of row numbers in an int
array, appended to on every insert or touch. A row's valid entry is its latest one (``pos``)
in the list it is in (``where``); stale entries are skipped and, once they outnumber the
members, compacted away in one vectorised pass. A touch is one append (``pos`` is set in
bulk before the order is read), where a doubly linked list needs eight reads and writes,
most of them cache misses in a large index.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from offloadd.cache.columns import Column

__all__ = [
    "RowArc",
    "RowLru",
    "RowPolicy",
    "make_row_policy",
]


_MIN_LOG = 1024


class _Order:
    """Members (row numbers) in the order they were last pushed; see the module docstring.

    ``where[row] == tag`` says the row is a member; orders sharing ``where`` and ``pos`` (the
    lists of one ARC) give each row to at most one of them, and the caller discards a row
    from one before pushing it onto another. ``pos`` is brought up to date lazily (``_sync``,
    before the order is read or compacted), for this order's members only.
    """

    __slots__ = ("_head", "_limit", "_log", "_pos", "_synced", "_tag", "_where", "count")

    def __init__(self, where: Column, pos: Column, tag: int) -> None:
        self._where = where
        self._pos = pos
        self._tag = tag
        self._log = array("i")
        self._head = 0  # entries before it are all stale
        self._synced = 0  # pos is up to date for the entries before it
        self._limit = _MIN_LOG  # compact when the log is this long
        self.count = 0

    def push(self, row: int) -> None:
        """Make ``row`` a member, or move it to the recent end if it is one."""
        where = self._where.v
        if where[row] != self._tag:
            where[row] = self._tag
            self.count += 1
        log = self._log
        end = len(log)
        self._pos.v[row] = end  # at once: one entry costs one write
        if self._synced == end:
            self._synced = end + 1
        log.append(row)
        if end + 1 >= self._limit:
            self._compact()

    def extend(self, rows: Iterable[int]) -> None:
        """Move ``rows`` to the recent end, one after the other; rows that are not members
        are not made ones (their entries are stale from the start)."""
        self._log.extend(rows)
        if len(self._log) >= self._limit:
            self._compact()

    def discard(self, row: int) -> bool:
        """Take ``row`` out; whether it was a member."""
        where = self._where.v
        if where[row] != self._tag:
            return False
        where[row] = 0
        self.count -= 1
        return True

    def popleft(self) -> int:
        """Take the oldest member out and return it (there must be one)."""
        for row in self:
            self.discard(row)
            return row
        raise IndexError("pop from an empty order")

    def __iter__(self) -> Iterator[int]:
        """Members, oldest first. Nothing may be pushed or discarded while iterating."""
        self._sync()
        log, pos, where, tag = self._log, self._pos.v, self._where.v, self._tag
        end = len(log)
        index = self._head
        leading = True
        while index < end:
            row = log[index]
            if where[row] == tag and pos[row] == index:
                leading = False
                yield row
            elif leading:
                self._head = index + 1  # a stale entry at the front: never read again
            index += 1

    def _sync(self) -> None:
        """Set ``pos`` of each member appended since the last sync to its latest entry."""
        end, start = len(self._log), self._synced
        if start == end:
            return
        log = np.frombuffer(self._log, np.int32)
        rows = log[start:end]
        mine = self._where.a[rows] == self._tag
        rows = rows[mine]
        positions = np.arange(start, end, dtype=np.int32)[mine]
        del log  # the array cannot grow while a view of it exists
        pos = self._pos.a
        pos[rows] = -1
        np.maximum.at(pos, rows, positions)  # the latest entry wins, whatever the order
        self._synced = end

    def _compact(self) -> None:
        """Drop every stale entry; later pushes may fill the log up to twice the members."""
        if len(self._log) - self._head == self.count:
            # Nothing is stale (each member has one entry): only make room, copying nothing.
            self._limit = max(_MIN_LOG, 2 * self.count)
            return
        self._sync()
        end = len(self._log)
        log = np.frombuffer(self._log, np.int32)
        tail = log[self._head : end]
        valid = (self._where.a[tail] == self._tag) & (
            self._pos.a[tail] == np.arange(self._head, end, dtype=np.int64)
        )
        kept = tail[valid]
        del log, tail  # the array cannot be replaced while a view of it exists
        self._log = _int_array(kept)
        self._pos.a[kept] = np.arange(len(kept), dtype=np.int32)
        self._head = 0
        self._synced = len(kept)
        self._limit = max(_MIN_LOG, 2 * len(kept))


def _int_array(values: np.ndarray[Any, Any]) -> array[int]:
    out = array("i")
    out.frombytes(values.astype(np.int32, copy=False).tobytes())
    return out


class RowPolicy(Protocol):
    """An eviction order over the cache's row numbers; see the module docstring."""

    def grow(self, rows: int) -> None:
        """Make room for rows ``< rows``."""
        ...

    def insert(self, row: int, namespace: int, key: bytes) -> None:
        """Add a new live row, which holds ``key`` of namespace id ``namespace``."""
        ...

    def touch(self, rows: Sequence[int]) -> None:
        """Record a use of live ``rows``; earlier rows end up more recent than later ones."""
        ...

    def remove(self, row: int) -> None:
        """Forget live ``row`` (not an eviction: no history is kept)."""
        ...

    def evicted(self, row: int, namespace: int, key: bytes) -> None:
        """Live ``row`` (holding ``key`` of ``namespace``) was evicted to make room."""
        ...

    def candidates(self) -> Iterator[int]:
        """Live rows, first = evict first. The policy must not be mutated while iterating."""
        ...

    def __len__(self) -> int: ...


class RowLru:
    """Least recently used first: one ``_Order``."""

    __slots__ = ("_order", "_pos", "_where")

    def __init__(self) -> None:
        self._where = Column(np.uint8)
        self._pos = Column(np.int32)
        self._order = _Order(self._where, self._pos, 1)

    def grow(self, rows: int) -> None:
        """Make room for rows ``< rows``."""
        self._where.grow(rows)
        self._pos.grow(rows)

    def insert(self, row: int, namespace: int, key: bytes) -> None:
        """Add ``row`` as the most recent row."""
        self._order.push(row)

    def touch(self, rows: Sequence[int]) -> None:
        """Move ``rows`` to the most recent end, ``rows[0]`` last (most recent)."""
        self._order.extend(reversed(rows))

    def remove(self, row: int) -> None:
        """Forget ``row``."""
        self._order.discard(row)

    def evicted(self, row: int, namespace: int, key: bytes) -> None:
        """Same as ``remove``: LRU keeps no history."""
        self._order.discard(row)

    def candidates(self) -> Iterator[int]:
        """Least recently used first."""
        return iter(self._order)

    def __len__(self) -> int:
        return self._order.count


class RowArc:
    """Adaptive replacement: T1 (seen once), T2 (seen again), ghosts B1/B2, a target for |T1|.

    T1 and T2 order rows; B1 and B2 order ghost slots, each of which remembers the
    ``(namespace id, key)`` of an evicted row.

    - ``insert`` puts a row in T1, except a ghost's key: a B1 ghost raises the target by
      ``max(1, |B2|/|B1|)``, a B2 ghost lowers it by ``max(1, |B1|/|B2|)``, and the row goes
      straight to T2 (its key was wanted again after being evicted).
    - ``touch`` moves a T1 row to T2, or refreshes a T2 row.
    - ``candidates`` yields T1 (oldest first) while the T1 rows not yet yielded are at least
      the target, then T2, then the rest of T1; this is ARC's replace rule applied victim by
      victim, assuming each yielded row is taken.
    - ``evicted`` moves the row's key to B1 or B2; each ghost list is trimmed to the number of
      live rows, oldest ghost first. ``remove`` keeps no ghost.
    """

    __slots__ = (
        "_b1",
        "_b2",
        "_free_slots",
        "_ghost_keys",
        "_ghost_namespaces",
        "_ghosts",
        "_gpos",
        "_gwhere",
        "_pos",
        "_t1",
        "_t2",
        "_target",
        "_where",
    )

    def __init__(self) -> None:
        self._where = Column(np.uint8)
        self._pos = Column(np.int32)
        self._t1 = _Order(self._where, self._pos, 1)
        self._t2 = _Order(self._where, self._pos, 2)
        self._gwhere = Column(np.uint8)
        self._gpos = Column(np.int32)
        self._b1 = _Order(self._gwhere, self._gpos, 1)
        self._b2 = _Order(self._gwhere, self._gpos, 2)
        self._ghosts: dict[int, dict[bytes, int]] = {}  # namespace -> key -> slot
        self._ghost_namespaces: list[int] = []
        self._ghost_keys: list[bytes | None] = []
        self._free_slots: list[int] = []
        self._target = 0.0

    @property
    def target(self) -> float:
        """The adaptive target size of T1 (in rows)."""
        return self._target

    def grow(self, rows: int) -> None:
        """Make room for rows ``< rows``."""
        self._where.grow(rows)
        self._pos.grow(rows)

    def insert(self, row: int, namespace: int, key: bytes) -> None:
        """Add ``row``: to T1, or to T2 after adapting the target if its key is a ghost."""
        if self._where.v[row]:
            self.touch((row,))
            return
        slot = self._ghosts.get(namespace, {}).get(key)
        if slot is None:
            self._t1.push(row)
            return
        b1, b2 = self._b1.count, self._b2.count
        if self._gwhere.v[slot] == 1:
            delta = max(1.0, b2 / b1)
            self._target = min(self._target + delta, float(len(self) + 1))
        else:
            delta = max(1.0, b1 / b2)
            self._target = max(self._target - delta, 0.0)
        if not self._b1.discard(slot):
            self._b2.discard(slot)
        self._forget(slot)
        self._t2.push(row)

    def touch(self, rows: Sequence[int]) -> None:
        """Promote ``rows`` to the most recent end of T2, ``rows[0]`` last."""
        where = self._where.v
        t1, t2 = self._t1, self._t2
        for row in reversed(rows):
            if where[row] == 1:
                t1.discard(row)
                t2.push(row)
            elif where[row] == 2:
                t2.push(row)

    def remove(self, row: int) -> None:
        """Forget ``row``; no ghost."""
        if not self._t1.discard(row):
            self._t2.discard(row)
        self._trim_ghosts()

    def evicted(self, row: int, namespace: int, key: bytes) -> None:
        """Turn ``row`` into a ghost of its key (T1 -> B1, T2 -> B2)."""
        if self._t1.discard(row):
            ghosts = self._b1
        elif self._t2.discard(row):
            ghosts = self._b2
        else:
            return
        slot = self._free_slots.pop() if self._free_slots else self._new_slot()
        self._ghost_namespaces[slot] = namespace
        self._ghost_keys[slot] = key
        self._ghosts.setdefault(namespace, {})[key] = slot
        ghosts.push(slot)
        self._trim_ghosts()

    def candidates(self) -> Iterator[int]:
        """T1 while its remaining size is at least the target, then T2, then the rest of T1."""
        t1_rows = iter(self._t1)
        remaining = self._t1.count
        while remaining and remaining >= self._target:
            yield next(t1_rows)
            remaining -= 1
        yield from self._t2
        yield from t1_rows

    def __len__(self) -> int:
        return self._t1.count + self._t2.count

    def is_ghost(self, namespace: int, key: bytes) -> bool:
        """Whether ``key`` of ``namespace`` is remembered in B1 or B2."""
        return key in self._ghosts.get(namespace, {})

    def _new_slot(self) -> int:
        slot = len(self._ghost_keys)
        self._ghost_keys.append(None)
        self._ghost_namespaces.append(0)
        self._gwhere.grow(slot + 1)
        self._gpos.grow(slot + 1)
        return slot

    def _forget(self, slot: int) -> None:
        namespace = self._ghost_namespaces[slot]
        key = self._ghost_keys[slot]
        assert key is not None
        ghosts = self._ghosts[namespace]
        del ghosts[key]
        if not ghosts:
            del self._ghosts[namespace]
        self._ghost_keys[slot] = None
        self._free_slots.append(slot)

    def _trim_ghosts(self) -> None:
        live = len(self)
        for ghosts in (self._b1, self._b2):
            while ghosts.count > live:
                self._forget(ghosts.popleft())


_ROW_POLICIES: dict[str, type[RowLru] | type[RowArc]] = {"lru": RowLru, "arc": RowArc}


def make_row_policy(name: str) -> RowPolicy:
    """A new, empty row policy by name: ``"lru"`` or ``"arc"``."""
    try:
        cls = _ROW_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; expected one of {', '.join(sorted(_ROW_POLICIES))}"
        ) from None
    return cls()

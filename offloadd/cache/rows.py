"""The cache's rows: numpy columns, key tables, shard offsets and free rows (pure, no I/O).

What keeps a million entries small and a lookup cheap: an entry is a *row*, an index into
numpy columns (``offloadd.cache.columns``): its state bits (changed only through
``offloadd.cache.lifecycle.step``, whose table is the entry lifecycle), its namespace and
shard sizes (as small ids of interned values), and where its shard offsets begin in a pool
column. The only per-entry Python objects are its key (the bytes the request brought) and
the row number a per-namespace ``dict`` maps the key to. What only a few entries have at a
time lives in small dicts keyed by row, with a state bit saying whether to look: here the
copies in flight (``writing``, ``readers``); pins, holds and reservations live with their
owners in ``offloadd.cache.protections``. The eviction order is a ``RowPolicy`` over rows
(``offloadd.cache.policy``), kept here because it grows and learns of new rows with them;
the allocator keeps no object per extent either.

Contract of ``Rows``:

- ``shape_id(sizes)``: the interned id of a shard-size tuple, with what its extents take
  (``needs``, ``footprints``), whether it could ever fit (``fits``) and its payload
  (``nbytes``).
- ``new_row(namespace, key, shape, offsets)``: a live, pending row in ``tables`` and the
  policy, its extents at ``offsets`` (already taken from ``alloc``); ``place(row, offsets)``
  gives a row made with placeholder offsets its real ones.
- ``start_writing`` / ``stop_writing``, ``add_readers`` / ``stop_reads``: the copies in flight
  and their marks; ``stop_reads`` returns the rows left dead and unread.
- ``release(row, extents=...)``: a dead row that nothing uses any more becomes free, its
  extents given back to ``alloc`` unless it never had any. It must already be out of
  ``tables`` and the policy.
- ``entries``, ``committed`` and ``committed_bytes`` count live rows; the caller keeps them
  as rows commit and leave.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from offloadd.cache import lifecycle
from offloadd.cache.allocator import ExtentAllocator
from offloadd.cache.columns import Column
from offloadd.cache.lifecycle import COMMITTED, Event
from offloadd.cache.policy import RowPolicy

__all__ = ["NO_ROWS", "Rows"]

NO_ROWS: dict[bytes, int] = {}  # the table of a namespace without entries

_ALLOCATE = int(Event.ALLOCATE)
_RELEASE = int(Event.RELEASE)
_START_WRITE = int(Event.START_WRITE)
_STOP_WRITE = int(Event.STOP_WRITE)
_START_READ = int(Event.START_READ)
_STOP_READ = int(Event.STOP_READ)


class Rows:
    """The cache's rows and what they hold; see the module docstring."""

    def __init__(self, alloc: ExtentAllocator, policy: RowPolicy) -> None:
        self.alloc = alloc  # replaced whole by a restore
        self.policy = policy
        self.tables: dict[str, dict[bytes, int]] = {}  # namespace -> key -> row
        self.state = Column(np.uint8)
        self.ns = Column(np.int32)  # namespace id: namespaces[id]
        self.shape = Column(np.int32)  # shard sizes id: shapes[id]
        self.base = Column(np.int32)  # first of the row's shard offsets in offsets
        self.keys: list[bytes | None] = []  # None: a free row
        self._free_rows: list[int] = []
        # The shard offset pool, in units of ``align`` (4 bytes each while that reaches).
        self.align = alloc.align
        wide = alloc.capacity // self.align >= 1 << 32
        self.offsets = Column(np.int64 if wide else np.uint32)
        self._pool_top = 0
        self._free_runs: dict[int, list[int]] = {}  # shard count -> free pool runs
        self.namespaces: list[str] = []
        self.namespace_ids: dict[str, int] = {}
        self.shapes: list[tuple[int, ...]] = []
        self._shape_ids: dict[tuple[int, ...], int] = {}
        self.needs: list[tuple[int, ...]] = []  # each shape's sizes as allocated (aligned)
        self.footprints: list[int] = []  # arena bytes of each shape
        self.fits: list[bool] = []  # whether each shape could ever fit the arena
        self.nbytes: list[int] = []  # payload bytes of each shape (what protection costs)
        self.written: dict[int, int] = {}  # pending rows: shards (or writers) written
        # Pending rows whose one shard several writers fill (begin_store(writers=...)).
        self.writers: dict[int, int] = {}
        self.writing: dict[int, int] = {}
        self.readers: dict[int, int] = {}
        self.entries = 0
        self.committed = 0
        self.committed_bytes = 0

    def shape_id(self, sizes: tuple[int, ...]) -> int:
        """The id of the shard sizes ``sizes``, interned on first use."""
        shape = self._shape_ids.get(sizes)
        if shape is None:
            shape = self._shape_ids[sizes] = len(self.shapes)
            alloc = self.alloc
            needs = tuple(alloc.alloc_size(size) for size in sizes)
            need = sum(needs)
            self.shapes.append(sizes)
            self.needs.append(needs)
            self.footprints.append(need)
            self.nbytes.append(sum(sizes))
            self.fits.append(
                need <= alloc.capacity
                and all(alloc.alloc_size(size) <= alloc.max_alloc for size in sizes)
            )
        return shape

    def new_row(self, namespace: str, key: bytes, shape: int, offsets: list[int]) -> int:
        """A new live, pending row in the index and the policy, its extents at ``offsets``."""
        state = self.state
        if self._free_rows:
            row = self._free_rows.pop()
            self.keys[row] = key
        else:
            row = len(self.keys)
            self.keys.append(key)
            if row >= len(state.a):
                for column in (state, self.ns, self.shape, self.base):
                    column.grow(row + 1)
                self.policy.grow(len(state.a))
        namespace_id = self.namespace_ids.get(namespace)
        if namespace_id is None:
            namespace_id = self.namespace_ids[namespace] = len(self.namespaces)
            self.namespaces.append(namespace)
        count = len(offsets)
        runs = self._free_runs.get(count)
        if runs:
            base = runs.pop()
        else:
            base = self._pool_top
            self._pool_top = top = base + count
            if top > len(self.offsets.a):
                self.offsets.grow(top)
        pool, align = self.offsets.v, self.align
        for slot, offset in enumerate(offsets, base):
            pool[slot] = offset // align
        state.v[row] = lifecycle.step(state.v[row], _ALLOCATE)
        self.ns.v[row] = namespace_id
        self.shape.v[row] = shape
        self.base.v[row] = base
        table = self.tables.get(namespace)
        if table is None:
            table = self.tables[namespace] = {}
        table[key] = row
        self.entries += 1
        self.policy.insert(row, namespace_id, key)
        return row

    def new_rows(
        self, namespace: str, keys: Sequence[bytes], shape: int, offsets: list[int]
    ) -> list[int]:
        """``new_row`` of each of ``keys`` for a one-shard ``shape``, its extent at the same
        place in ``offsets``: a step's reservation, its columns written as arrays."""
        count = len(keys)
        free = self._free_rows
        reused = min(count, len(free))
        made = free[len(free) - reused :][::-1]  # as ``new_row`` pops them
        del free[len(free) - reused :]
        table_keys = self.keys
        for row, key in zip(made, keys, strict=False):
            table_keys[row] = key
        if reused < count:
            first = len(table_keys)
            table_keys.extend(keys[reused:])
            made.extend(range(first, len(table_keys)))
            if len(table_keys) > len(self.state.a):
                for column in (self.state, self.ns, self.shape, self.base):
                    column.grow(len(table_keys))
                self.policy.grow(len(self.state.a))
        namespace_id = self.namespace_ids.get(namespace)
        if namespace_id is None:
            namespace_id = self.namespace_ids[namespace] = len(self.namespaces)
            self.namespaces.append(namespace)
        slots = self._free_runs.get(1, [])
        bases = slots[len(slots) - min(count, len(slots)) :][::-1]
        del slots[len(slots) - len(bases) :]
        if len(bases) < count:
            top = self._pool_top
            self._pool_top = top + count - len(bases)
            bases.extend(range(top, self._pool_top))
            if self._pool_top > len(self.offsets.a):
                self.offsets.grow(self._pool_top)
        at = np.array(made, dtype=np.int64)
        state = self.state.a
        state[at] = lifecycle.step_all(state[at], _ALLOCATE)
        self.ns.a[at] = namespace_id
        self.shape.a[at] = shape
        self.base.a[at] = bases
        self.offsets.a[bases] = np.array(offsets, dtype=np.int64) // self.align
        table = self.tables.get(namespace)
        if table is None:
            table = self.tables[namespace] = {}
        table.update(zip(keys, made, strict=True))
        self.entries += count
        insert = self.policy.insert
        for row, key in zip(made, keys, strict=True):
            insert(row, namespace_id, key)
        return made

    def place(self, row: int, offsets: list[int]) -> None:
        """Give ``row`` its extents at ``offsets``."""
        pool, align = self.offsets.v, self.align
        for slot, offset in enumerate(offsets, self.base.v[row]):
            pool[slot] = offset // align

    def offsets_of(self, row: int) -> list[int]:
        """Arena offset of each of the row's shards."""
        base = self.base.v[row]
        count = len(self.shapes[self.shape.v[row]])
        pool, align = self.offsets.v, self.align
        return [pool[slot] * align for slot in range(base, base + count)]

    def shard_offset(self, row: int, shard: int) -> int:
        """Arena offset of the row's shard ``shard``."""
        if not 0 <= shard < len(self.shapes[self.shape.v[row]]):
            raise IndexError(f"row {row} has no shard {shard}")
        return self.offsets.v[self.base.v[row] + shard] * self.align

    def read_extents(self, rows: Sequence[int], shard: int) -> list[tuple[int, int]]:
        """Arena offset and size of shard ``shard`` of each of ``rows``."""
        pool, base, shape_of, shapes = self.offsets.v, self.base.v, self.shape.v, self.shapes
        align = self.align
        extents = []
        for row in rows:  # a step's loads read hundreds: no call per row
            sizes = shapes[shape_of[row]]
            if not 0 <= shard < len(sizes):
                raise IndexError(f"row {row} has no shard {shard}")
            extents.append((pool[base[row] + shard] * align, sizes[shard]))
        return extents

    def written_mask(self, row: int) -> int:
        """Bitmask of the row's shards (or writers) written."""
        if self.state.v[row] & COMMITTED:
            return (1 << len(self.shapes[self.shape.v[row]])) - 1
        return self.written.get(row, 0)

    def footprint(self, row: int) -> int:
        """Arena bytes the row's extents take."""
        return self.footprints[self.shape.v[row]]

    def set_writers(self, row: int, writers: int) -> None:
        """The row's one shard is filled by ``writers`` writers."""
        if writers == 1:
            self.writers.pop(row, None)
        else:
            self.writers[row] = writers

    def start_writing(self, row: int, bit: int) -> None:
        """The write of ``bit`` (a shard, or a writer's part) began."""
        self.writing[row] = self.writing.get(row, 0) | bit
        self.state.v[row] = lifecycle.step(self.state.v[row], _START_WRITE)

    def stop_writing(self, row: int, bit: int) -> None:
        """The write of ``bit`` ended."""
        writing = self.writing[row] & ~bit
        if writing:
            self.writing[row] = writing
        else:
            del self.writing[row]
            self.state.v[row] = lifecycle.step(self.state.v[row], _STOP_WRITE)

    def add_readers(self, rows: Sequence[int]) -> None:
        """A load of each of ``rows`` began."""
        readers, state, step = self.readers, self.state.v, lifecycle.step
        for row in rows:  # one call for a load's rows: a step's loads read thousands
            readers[row] = readers.get(row, 0) + 1
            state[row] = step(state[row], _START_READ)

    def check_reads(self, rows: Sequence[int]) -> int:
        """The index of the first of ``rows`` not being read (counting repeats), or -1."""
        counts: dict[int, int] = {}
        for index, row in enumerate(rows):
            n = counts[row] = counts.get(row, 0) + 1
            if row < 0 or n > self.readers.get(row, 0):
                return index
        return -1

    def stop_reads(self, rows: Sequence[int]) -> list[int]:
        """The loads of ``rows`` ended (``check_reads`` first); returns the rows left dead
        and unread."""
        state, readers = self.state.v, self.readers
        dead: list[int] = []
        for row in rows:
            left = readers[row] - 1
            if left:
                readers[row] = left
            else:
                del readers[row]
                state[row] = lifecycle.step(state[row], _STOP_READ)
                if state[row] & lifecycle.DEAD:
                    dead.append(row)
        return dead

    def release(self, row: int, *, extents: bool = True) -> None:
        """Free a dead, idle row (and its extents, if it had any)."""
        sizes = self.shapes[self.shape.v[row]]
        base = self.base.v[row]
        if extents:
            pool, align, free = self.offsets.v, self.align, self.alloc.free
            for slot, size in enumerate(sizes, base):
                free(pool[slot] * align, size)
        runs = self._free_runs.get(len(sizes))
        if runs is None:
            runs = self._free_runs[len(sizes)] = []
        runs.append(base)
        self.written.pop(row, None)
        self.writers.pop(row, None)
        self.keys[row] = None
        self.state.v[row] = lifecycle.step(self.state.v[row], _RELEASE)
        self._free_rows.append(row)

"""Byte-range allocator over the cache arena.

Contract:
- The arena is ``[0, capacity)``, with ``capacity`` rounded down to a multiple of ``align``.
- ``alloc(size)`` returns the offset of an extent of ``alloc_size(size)`` bytes (``size`` rounded
  up to ``align``), or None when no free extent is large enough. Offsets are multiples of
  ``align``. Best fit: a free extent of exactly that size if there is one, else the smallest
  larger one, split. ``take(need)`` is the same for a size already rounded.
- ``free(offset, size)`` takes back an extent, with ``size`` as passed to ``alloc``, and merges it
  with free neighbours, so freeing everything always leaves one extent of ``capacity`` bytes
  (one per piece, see ``boundary``). Freeing something that is not allocated (or freeing
  twice) is a bug and raises ValueError.
- Allocated extents never overlap and ``used_bytes <= capacity`` always holds.
- ``boundary`` (0: none) cuts the arena into pieces at every multiple of it, and no extent
  ever straddles a cut: free extents are never merged across one, so an allocation always
  lies inside one piece, and ``alloc_size(size) > boundary`` never fits. The daemon passes
  the size of the arena's ``cudaHostRegister`` pieces: one DMA may not span two
  registrations (``offloadd.transfer.pinning``).

Pure Python: no I/O and no locks (the daemon calls it from one thread). Free extents live in
three maps (start -> size, end -> start, size -> starts) plus a sorted list of distinct free
sizes, so an exact fit is O(1), a best fit is a bisect, and coalescing is two dict lookups.
Allocated extents cost no Python object: two bitmaps, one bit per ``align`` unit of the
arena, mark where each begins and where it ends (``numpy`` memory that costs nothing until
touched), which is all that telling a good ``free``
from a bad one takes (its start is marked, and the first end marked from there is its last
unit). A million extents of an arena of 64 KiB ones cost two 2 MiB bitmaps, where a dict of
offsets cost some 70 MB.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence

import numpy as np

from offloadd.cache.columns import zeros

__all__ = ["ExtentAllocator"]


class ExtentAllocator:
    """Best-fit extent allocator with coalescing; see the module docstring for the contract."""

    __slots__ = (
        "_align",
        "_boundary",
        "_by_size",
        "_capacity",
        "_ends",
        "_free_end",
        "_free_start",
        "_sizes",
        "_starts",
        "_used",
    )

    def __init__(self, capacity: int, align: int = 4096, *, boundary: int = 0) -> None:
        if align <= 0:
            raise ValueError(f"align must be positive, got {align}")
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        if boundary < 0 or boundary % align:
            raise ValueError(f"boundary must be 0 or a multiple of align, got {boundary}")
        self._align = align
        self._boundary = boundary
        self._capacity = capacity - capacity % align
        self._used = 0
        self._free_start: dict[int, int] = {}
        self._free_end: dict[int, int] = {}
        self._by_size: dict[int, set[int]] = {}
        self._sizes: list[int] = []
        # Bit u: an allocated extent starts at unit u / ends with unit u. What makes a bad or
        # double free detectable. numpy.zeros: pages never marked are never touched.
        units = self._capacity // align
        self._starts = zeros((units + 7) // 8, np.uint8).data
        self._ends = zeros((units + 7) // 8, np.uint8).data
        if self._capacity:
            self._add_free_pieces(0, self._capacity)

    @classmethod
    def with_allocated(
        cls,
        capacity: int,
        extents: Sequence[tuple[int, int]],
        align: int = 4096,
        *,
        boundary: int = 0,
    ) -> ExtentAllocator:
        """An allocator whose ``extents`` (offset, size as passed to alloc) are in use.

        Used to rebuild the arena's state after a restart in O(n log n). Raises ValueError
        for an extent that is unaligned, outside the arena, overlaps another or straddles
        a ``boundary``.
        """
        allocator = cls(capacity, align, boundary=boundary)
        if not extents:
            return allocator
        allocator._free_start.clear()
        allocator._free_end.clear()
        allocator._by_size.clear()
        allocator._sizes.clear()
        cursor = 0
        for offset, size in sorted(extents):
            need = allocator.alloc_size(size)
            if offset % align or offset < cursor or offset + need > allocator._capacity:
                raise ValueError(f"extent ({offset}, {size}) is unaligned, overlaps or is outside")
            if allocator.straddles(offset, need):
                raise ValueError(f"extent ({offset}, {size}) straddles a {boundary}-byte boundary")
            if offset > cursor:
                allocator._add_free_pieces(cursor, offset - cursor)
            allocator._mark(offset, need)
            allocator._used += need
            cursor = offset + need
        if cursor < allocator._capacity:
            allocator._add_free_pieces(cursor, allocator._capacity - cursor)
        return allocator

    @property
    def capacity(self) -> int:
        """Usable arena bytes (the requested capacity rounded down to ``align``)."""
        return self._capacity

    @property
    def align(self) -> int:
        """Granularity of offsets and sizes."""
        return self._align

    @property
    def boundary(self) -> int:
        """No extent straddles a multiple of this (0: no such cuts)."""
        return self._boundary

    @property
    def max_alloc(self) -> int:
        """The largest ``alloc_size`` that could ever fit (a piece, or the whole arena)."""
        return min(self._boundary, self._capacity) if self._boundary else self._capacity

    def straddles(self, offset: int, size: int) -> bool:
        """Whether ``[offset, offset + size)`` crosses a boundary (never for an extent here)."""
        boundary = self._boundary
        return bool(boundary) and size > 0 and offset // boundary != (offset + size - 1) // boundary

    @property
    def used_bytes(self) -> int:
        """Bytes in allocated extents (rounded sizes)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated, however fragmented."""
        return self._capacity - self._used

    @property
    def largest_free(self) -> int:
        """Size of the largest free extent: the biggest ``alloc_size`` that can succeed now."""
        return self._sizes[-1] if self._sizes else 0

    def alloc_size(self, size: int) -> int:
        """Bytes an ``alloc(size)`` takes from the arena."""
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        return -(-size // self._align) * self._align

    def alloc(self, size: int) -> int | None:
        """Offset of a new extent of ``alloc_size(size)`` bytes, or None if nothing fits."""
        return self.take(self.alloc_size(size))

    def take_many(self, need: int, count: int) -> list[int]:
        """``take(need)`` up to ``count`` times, stopping at the first that finds nothing;
        free extents of exactly ``need`` bytes (what evictions of a step's size leave) are
        taken in one pass."""
        taken: list[int] = []
        bucket = self._by_size.get(need)
        if bucket is not None:
            free_start, free_end = self._free_start, self._free_end
            starts, ends, align = self._starts, self._ends, self._align
            last_unit = need // align - 1
            for _ in range(min(count, len(bucket))):
                start = bucket.pop()
                del free_start[start]
                del free_end[start + need]
                first = start // align  # marked as ``take`` marks it
                last = first + last_unit
                starts[first >> 3] |= 1 << (first & 7)
                ends[last >> 3] |= 1 << (last & 7)
                taken.append(start)
            if not bucket:
                del self._by_size[need]
                del self._sizes[bisect_left(self._sizes, need)]
            self._used += need * len(taken)
        take = self.take
        while len(taken) < count:
            more = take(need)
            if more is None:
                break
            taken.append(more)
        return taken

    def take(self, need: int) -> int | None:
        """``alloc`` of a size that is ``alloc_size``'s already (a positive multiple of
        ``align``): what a caller that rounded its sizes once calls per extent."""
        by_size, sizes = self._by_size, self._sizes
        bucket = by_size.get(need)
        split = False  # the one extent of its size, split in place
        if bucket is None:
            i = bisect_right(sizes, need)
            if i == len(sizes):
                return None
            have = sizes[i]
            bucket = by_size[have]
            rest = have - need
            split = len(bucket) == 1 and (i == 0 or sizes[i - 1] < rest)
        else:
            have = need
        start = bucket.pop()
        if split:
            # The usual split (a fresh arena's tail): the rest keeps the extent's place among
            # the sizes and its end, so it is updated where it is (as _add_free would leave it).
            del by_size[have]
            sizes[i] = rest
            del self._free_start[start]
            self._free_start[start + need] = rest
            self._free_end[start + have] = start + need
            bucket.add(start + need)
            by_size[rest] = bucket
        else:
            if not bucket:
                del by_size[have]
                del sizes[bisect_left(sizes, have)]
            del self._free_start[start]
            del self._free_end[start + have]
            if have > need:
                self._add_free(start + need, have - need)
        first = start // self._align  # mark it: see _mark
        last = first + need // self._align - 1
        self._starts[first >> 3] |= 1 << (first & 7)
        self._ends[last >> 3] |= 1 << (last & 7)
        self._used += need
        return start

    def free(self, offset: int, size: int) -> None:
        """Return the extent ``alloc`` gave at ``offset`` for ``size``; merges free neighbours."""
        need = self.alloc_size(size)
        if not self._is_allocated(offset, need):
            raise ValueError(f"extent ({offset}, {size}) is not allocated")
        first = offset // self._align  # unmark it: see _mark
        last = first + need // self._align - 1
        self._starts[first >> 3] &= ~(1 << (first & 7)) & 0xFF
        self._ends[last >> 3] &= ~(1 << (last & 7)) & 0xFF
        self._used -= need
        start, end = offset, offset + need
        boundary = self._boundary
        left = self._free_end.get(start) if not boundary or start % boundary else None
        if left is not None:
            self._remove_free(left, start - left)
            start = left
        right_size = self._free_start.get(end) if not boundary or end % boundary else None
        if right_size is not None:
            self._remove_free(end, right_size)
            end += right_size
        self._add_free(start, end - start)

    def free_extents(self) -> list[tuple[int, int]]:
        """Free extents as sorted ``(offset, size)`` pairs (diagnostics and tests; O(n log n))."""
        return sorted(self._free_start.items())

    def __repr__(self) -> str:
        return (
            f"ExtentAllocator(capacity={self._capacity}, boundary={self._boundary}, "
            f"used={self._used}, "
            f"free_extents={len(self._free_start)}, largest_free={self.largest_free})"
        )

    def _mark(self, offset: int, need: int) -> None:
        first = offset // self._align
        last = first + need // self._align - 1
        self._starts[first >> 3] |= 1 << (first & 7)
        self._ends[last >> 3] |= 1 << (last & 7)

    def _is_allocated(self, offset: int, need: int) -> bool:
        """Whether an allocated extent is exactly ``[offset, offset + need)``: one starts at
        ``offset``, and the first end marked from there is the last unit of ``need``."""
        if offset < 0 or offset % self._align or offset + need > self._capacity:
            return False
        first = offset // self._align
        last = first + need // self._align - 1
        if not (self._starts[first >> 3] >> (first & 7)) & 1:
            return False
        if not (self._ends[last >> 3] >> (last & 7)) & 1:
            return False
        if last == first:
            return True
        # No end marked in [first, last): read those bits as one integer.
        bits = int.from_bytes(self._ends[first >> 3 : ((last - 1) >> 3) + 1], "little")
        return not (bits >> (first & 7)) & ((1 << (last - first)) - 1)

    def _add_free_pieces(self, start: int, size: int) -> None:
        """Free ``[start, start + size)``, cut at every boundary inside it."""
        end = start + size
        boundary = self._boundary
        while start < end:
            cut = min(end, (start // boundary + 1) * boundary) if boundary else end
            self._add_free(start, cut - start)
            start = cut

    def _add_free(self, start: int, size: int) -> None:
        self._free_start[start] = size
        self._free_end[start + size] = start
        bucket = self._by_size.get(size)
        if bucket is None:
            self._by_size[size] = {start}
            insort(self._sizes, size)
        else:
            bucket.add(start)

    def _remove_free(self, start: int, size: int) -> None:
        del self._free_start[start]
        del self._free_end[start + size]
        bucket = self._by_size[size]
        bucket.remove(start)
        if not bucket:
            del self._by_size[size]
            del self._sizes[bisect_left(self._sizes, size)]

"""Growable numpy columns for the cache's struct-of-arrays state (pure, no I/O).

A ``Column`` holds one numpy array and a ``memoryview`` on it: numpy for whole-column work
(sorting out a log, counting), the memoryview for one element at a time, which costs about
as much as a list access where numpy's own scalar indexing costs several times more.

Contract: ``grow(size)`` makes room for indices ``< size``, doubling, with new elements
zero; it replaces ``a`` and ``v``, so a caller must not keep either across a call that may
grow the column. Resident memory follows what is used, not the capacity: a large column is
an anonymous ``mmap`` of its own, whose pages the system zeroes when first touched and takes
back whole when the column grows (from the heap, a freed column would stay resident, and a
new one would be zeroed, and so touched, in full).
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Column"]

_MIN = 1024
_MMAP_BYTES = 1 << 20  # from this size on, a column is an mmap of its own


def zeros(size: int, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """A zeroed array whose untouched pages cost no memory, and which returns its pages to
    the system when dropped."""
    kind = np.dtype(dtype)
    nbytes = size * kind.itemsize
    if nbytes < _MMAP_BYTES:
        return np.zeros(size, kind)
    return np.frombuffer(mmap.mmap(-1, nbytes), kind)


class Column:
    """One growable numpy array and a memoryview on it; see the module docstring."""

    __slots__ = ("a", "v")

    def __init__(self, dtype: npt.DTypeLike, size: int = 0) -> None:
        self.a: npt.NDArray[Any] = zeros(size, dtype)
        self.v = self.a.data

    def __len__(self) -> int:
        return len(self.a)

    def grow(self, size: int) -> None:
        """Room for indices ``< size`` (at least twice the old room when it grows)."""
        old = len(self.a)
        if size <= old:
            return
        new = zeros(max(size, 2 * old, _MIN), self.a.dtype)
        new[:old] = self.a
        self.a = new
        self.v = new.data

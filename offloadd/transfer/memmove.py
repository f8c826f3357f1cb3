"""Many host-to-host copies between mapped memory in a few numpy calls, not one ctypes call each.

``memmove_many(srcs, dsts, sizes)`` copies ``sizes[i]`` bytes from address ``srcs[i]`` to
``dsts[i]`` for every i (uint64 arrays of equal length). Copies of one size are done together:
each side's addresses are read as rows of a byte view laid over the span they cover
(``[lowest, highest + size)``, row i starting at byte i), and one fancy-indexed assignment moves
every row; numpy copies a row with one ``memcpy`` in C. The view only names that span: no byte
of it is touched but the rows copied, so gaps between mappings inside it are never read.

Why: a step's loads are hundreds of short copies (256 requests' two 16-token blocks were 1,024
copies of 2 KiB), and ``ctypes.memmove`` costs about a microsecond of Python per call, more
than the copy itself. Sizes seen fewer than ``_FEW`` times, and views numpy cannot describe
(a span of more than ``_MAX_VIEW_BYTES`` rows times bytes), go one ``memmove`` each.

The caller guarantees what ``memmove`` would need: every range mapped and writable, and no
copy's destination overlapping another copy's source (the daemon copies between the arena and
a rank's memory, never within one of them). Two copies to the same destination land in either
order.
"""

from __future__ import annotations

import ctypes
from itertools import pairwise

import numpy as np
import numpy.typing as npt

__all__ = ["memmove_many"]

_FEW = 8  # below this many copies of one size, the per-call loop is as cheap
_MAX_VIEW_BYTES = 1 << 62  # rows x row bytes numpy's size arithmetic must not overflow

Addresses = npt.NDArray[np.uint64]


def memmove_many(srcs: Addresses, dsts: Addresses, sizes: Addresses) -> None:
    """Copy ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for each i; see the module
    docstring."""
    count = len(sizes)
    if not count:
        return
    if count < _FEW:
        _one_by_one(srcs, dsts, sizes)
        return
    by_size = np.argsort(sizes, kind="stable")
    ordered = sizes[by_size]
    edges = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), count]
    for first, end in pairwise(edges):
        which = by_size[first:end]
        size = int(ordered[first])
        if end - first < _FEW or not _rows_copied(srcs[which], dsts[which], size):
            _one_by_one(srcs[which], dsts[which], sizes[which])


def _rows_copied(srcs: Addresses, dsts: Addresses, size: int) -> bool:
    """Copy ``size`` bytes from each of ``srcs`` to the matching ``dsts`` as rows of two byte
    views; False (nothing copied) where a view would be too large for numpy."""
    if size == 0:
        return True
    source, source_low = _rows(srcs, size)
    target, target_low = _rows(dsts, size)
    if source is None or target is None:
        return False
    target[(dsts - target_low).astype(np.intp)] = source[(srcs - source_low).astype(np.intp)]
    return True


def _rows(addresses: Addresses, size: int) -> tuple[npt.NDArray[np.uint8] | None, int]:
    """A view whose row i is the ``size`` bytes at ``low + i``, over the span of
    ``addresses``, and ``low``; (None, 0) if the span is too large to describe."""
    low = int(addresses.min())
    span = int(addresses.max()) - low + size
    rows = span - size + 1
    if rows * size >= _MAX_VIEW_BYTES:
        return None, 0
    return np.asarray(_Span(low, rows, size)), low


class _Span:
    """Rows of ``size`` bytes starting at each byte from ``low`` on, as numpy reads an array
    interface (a ctypes array type per span would be cached by ctypes for ever)."""

    def __init__(self, low: int, rows: int, size: int) -> None:
        self.__array_interface__ = {
            "data": (low, False),
            "shape": (rows, size),
            "strides": (1, 1),
            "typestr": "|u1",
            "version": 3,
        }


def _one_by_one(srcs: Addresses, dsts: Addresses, sizes: Addresses) -> None:
    memmove = ctypes.memmove
    for src, dst, nbytes in zip(srcs.tolist(), dsts.tolist(), sizes.tolist(), strict=True):
        memmove(dst, src, nbytes)  # releases the GIL while it copies

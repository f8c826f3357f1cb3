"""The types every part of ``offloadd.transfer`` shares, below all of them (no import loops).

``Direction`` and a copy ``Triple`` (src, dst, size) are what engines take; ``FileWindow`` is a
rank's shared-memory file in a plan's address space; ``Span`` one region's part of a group's
shard; ``MoveArrays`` a job's merged copies as three arrays.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

Triple = tuple[int, int, int]
Table = npt.NDArray[np.int64]
Addresses = npt.NDArray[np.uint64]


class Direction(enum.Enum):
    """STORE moves rank memory to the host cache; LOAD moves the cache back to the rank."""

    STORE = "store"
    LOAD = "load"


class FileWindow(NamedTuple):
    """Plan addresses ``[address, address + size)`` are the file's bytes ``[0, size)``."""

    address: int
    size: int
    fd: int


class Span(NamedTuple):
    """One region's part of a group's shard, resolved for one session: ``base`` is the
    address of block 0 in the daemon's mapping, ``part`` the part's offset in the shard.
    Sub-block ``j`` of the chunk lies at ``part + j * step`` (``step`` 0: ``page``, pages
    back to back); a canonical layout's fragments are spans with the canonical page as step."""

    base: int
    stride: int
    page: int
    part: int
    step: int = 0


class MoveArrays(NamedTuple):
    """A job's merged copies: three contiguous uint64 arrays of equal length."""

    srcs: Addresses
    dsts: Addresses
    sizes: Addresses

    def __len__(self) -> int:
        return len(self.sizes)

    def triples(self) -> list[Triple]:
        """The copies as Python triples (the per-copy path and tests)."""
        return list(zip(self.srcs.tolist(), self.dsts.tolist(), self.sizes.tolist(), strict=True))

"""One job's copies as address arrays, merged once, issued as ONE batched driver call.

Contract:
- ``move_arrays(moves, direction, pieces=None) -> MoveArrays`` turns a job's absolute
  ``(src, dst, nbytes)`` triples (a ``Copies`` as planned by the daemon, taken as it is, or
  any sequence of tuples) into three contiguous 64-bit arrays in one numpy pass:
  empty moves are dropped and neighbours contiguous on both sides are merged. A merge never
  joins two moves at a multiple of ``pieces.size`` from ``pieces.origin`` on the host side
  (the destination of a store, the source of a load): those are the cuts between the
  arena's ``cudaHostRegister`` pieces, and one copy touching two registrations fails with
  an invalid-argument error. Raises ValueError for a negative size.
- ``BatchCopier`` issues the arrays as one ``cuMemcpyBatchAsync`` through ctypes, passing the
  arrays' addresses: no Python object is built per copy. ``BatchCopier.resolve(lib)`` finds
  the entry point in the driver library and its ABI, or returns None on drivers older than
  CUDA 12.8 (the caller then copies one ``cuMemcpyAsync`` at a time, and says so loudly):
    * ``cuMemcpyBatchAsync_v2`` (CUDA 13 drivers): no ``failIdx`` argument;
    * ``cuMemcpyBatchAsync`` (CUDA 12.8+ drivers, kept by 13.x): ``size_t *failIdx`` before
      the stream.
  Calling the driver directly (not NVIDIA's Python bindings) means the call matches the
  installed driver by construction: 13.x bindings on a CUDA 12 driver cannot break it.
- Source access order: STREAM for stores (device memory the stream waited for), ANY for loads
  (the arena slot, committed before any load may read it; no work on the stream touches it).
- The declarations below mirror cuda.h; tests hold them against the cuda-bindings package's
  own declarations (``cydriver.pxd``) and marshal real arrays through the prototype.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from offloadd.transfer.copies import Copies
from offloadd.transfer.types import Direction, MoveArrays, Triple

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3
CUDA_ERROR_NOT_SUPPORTED = 801
SIZE_MAX = (1 << 64) - 1


class MemLocation(ctypes.Structure):
    """``CUmemLocation``: ``{CUmemLocationType type; int id;}`` (type 0: no hint)."""

    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (CUDA 12.8 and 13.x agree)."""

    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    )


@dataclass(frozen=True)
class BatchAbi:
    """One exported form of the batch copy: its symbol and whether it takes ``failIdx``."""

    symbol: str
    fail_index: bool

    def prototype(self) -> type[Any]:
        """The C signature: ``(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs,
        [failIdx,] stream) -> CUresult``, the three arrays passed as raw addresses."""
        arguments: list[type[ctypes._CData]] = [
            ctypes.c_void_p,  # CUdeviceptr *dsts
            ctypes.c_void_p,  # CUdeviceptr *srcs
            ctypes.c_void_p,  # size_t *sizes
            ctypes.c_size_t,  # size_t count
            ctypes.POINTER(MemcpyAttributes),  # CUmemcpyAttributes *attrs
            ctypes.POINTER(ctypes.c_size_t),  # size_t *attrsIdxs
            ctypes.c_size_t,  # size_t numAttrs
        ]
        if self.fail_index:
            arguments.append(ctypes.POINTER(ctypes.c_size_t))  # size_t *failIdx
        arguments.append(ctypes.c_void_p)  # CUstream hStream
        return ctypes.CFUNCTYPE(ctypes.c_int, *arguments)


# Preferred first: a CUDA 13 driver exports both, and the v2 form is its native one.
ABIS = (
    BatchAbi("cuMemcpyBatchAsync_v2", fail_index=False),
    BatchAbi("cuMemcpyBatchAsync", fail_index=True),
)


class HostPieces(NamedTuple):
    """The arena's pinned pieces: cut every ``size`` bytes from ``origin``."""

    origin: int
    size: int


def _empty() -> MoveArrays:
    return MoveArrays(*(np.zeros(0, np.uint64) for _ in range(3)))


def move_arrays(
    moves: Sequence[Triple], direction: Direction, pieces: HostPieces | None = None
) -> MoveArrays:
    """The job's copies as arrays, merged once; see the module docstring."""
    count = len(moves)
    if not count:
        return _empty()
    if isinstance(moves, Copies):
        src, dst, size = moves.columns()
    else:
        table = np.fromiter(chain.from_iterable(moves), np.int64, 3 * count).reshape(count, 3)
        src, dst, size = table[:, 0], table[:, 1], table[:, 2]
    smallest = size.min()
    if smallest <= 0:
        if smallest < 0:
            raise ValueError(f"negative copy size {int(smallest)}")
        keep = size > 0
        src, dst, size = src[keep], dst[keep], size[keep]
        if not len(size):
            return _empty()
    end = size[:-1]
    join = (src[:-1] + end == src[1:]) & (dst[:-1] + end == dst[1:])
    if pieces is not None and pieces.size:
        host = dst if direction is Direction.STORE else src
        join &= (host[1:] - pieces.origin) % pieces.size != 0
    if join.any():
        starts = np.flatnonzero(np.concatenate(([True], ~join)))
        src, dst, size = src[starts], dst[starts], np.add.reduceat(size, starts)
    return MoveArrays(
        np.ascontiguousarray(src).view(np.uint64),
        np.ascontiguousarray(dst).view(np.uint64),
        np.ascontiguousarray(size).view(np.uint64),
    )


def src_access_order(direction: Direction) -> int:
    """``CUmemcpySrcAccessOrder`` per direction (see the module docstring)."""
    if direction is Direction.STORE:
        return CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    return CU_MEMCPY_SRC_ACCESS_ORDER_ANY


class BatchCopier:
    """``cuMemcpyBatchAsync`` through ctypes: one call per job, any thread with a context."""

    def __init__(self, function: Callable[..., int], abi: BatchAbi) -> None:
        self.abi = abi
        self._function = function
        self._attrs = {
            direction: ctypes.pointer(MemcpyAttributes(srcAccessOrder=src_access_order(direction)))
            for direction in Direction
        }
        self._attr_index = ctypes.pointer(ctypes.c_size_t(0))  # every copy uses attrs[0]

    @classmethod
    def resolve(cls, lib: object) -> BatchCopier | None:
        """The driver's batch copy, or None where the driver has none (before CUDA 12.8).

        ``lib`` is the driver's ``ctypes.CDLL`` (or, in tests, anything whose attributes
        named like the symbols are ctypes function pointers).
        """
        for abi in ABIS:
            entry = getattr(lib, abi.symbol, None)
            if entry is None:
                continue
            address = ctypes.cast(entry, ctypes.c_void_p).value
            return cls(abi.prototype()(address), abi)
        return None

    @property
    def name(self) -> str:
        """The driver entry point, for logs and status."""
        return self.abi.symbol

    def copy(self, stream: int, direction: Direction, arrays: MoveArrays) -> tuple[int, int | None]:
        """Enqueue every copy on ``stream``: ``(CUresult, index of the failed copy or None)``."""
        count = len(arrays)
        dsts, srcs, sizes = (
            arrays.dsts.ctypes.data,
            arrays.srcs.ctypes.data,
            arrays.sizes.ctypes.data,
        )
        attrs = self._attrs[direction]
        if not self.abi.fail_index:
            code = self._function(dsts, srcs, sizes, count, attrs, self._attr_index, 1, stream)
            return int(code), None
        failed = ctypes.c_size_t(SIZE_MAX)
        code = self._function(
            dsts, srcs, sizes, count, attrs, self._attr_index, 1, ctypes.byref(failed), stream
        )
        return int(code), None if failed.value == SIZE_MAX else int(failed.value)

"""A rank's shared-memory file, reached through its descriptor and never through a mapping.

Why: a rank controls its own file. Through a mapping, a copy faults with SIGBUS, which kills
the daemon, when the rank truncates the file under it, or when a load writes into a hole of
a full tmpfs (a sparse file, or one whose pages the rank punched out). ``pread``/``pwrite``
on the descriptor return an error instead, and the job fails. The daemon therefore never
maps such a file (only memfds sealed against shrinking, which cannot fault: see
``offloadd.transfer.handles``): it reserves address space for it instead (``reserve``,
``PROT_NONE``, so any access by mistake faults at once in tests rather than silently), plans
copies with those addresses like any other, and the cpu copy engine turns the copies touching
such a window into ``preadv`` (store) or ``pwritev`` (load) calls at the matching file
offsets, one per run of copies whose file sides follow each other, in whatever order the
job lists them (``guarded_copy``). ``offloadd bench --only guarded`` measures it against
``memmove`` through a mapping.

Contract:
- ``region_file_problem(fd)``: why a descriptor a peer passed cannot hold KV regions ("" when
  it can): a regular file on tmpfs (files in ``/dev/shm``, memfds), opened read-write.
- ``reserve(size)`` / ``unreserve(address, size)``: address space no byte ever lives in.
- ``FileWindow(address, size, fd)``: bytes ``[address, address + size)`` of the plan are
  bytes ``[0, size)`` of the file behind ``fd``.
- ``guarded_copy(arrays, direction, windows)``: performs a job's merged copies. A copy whose
  rank side (the source of a store, the destination of a load) starts in a window goes
  through that file's descriptor and must end inside it; any other is a plain memmove (the
  rank's memory is mapped: a sealed memfd, see ``offloadd.transfer.handles``). Raises
  ``OSError`` naming the file problem (a file that shrank: a short read; no space left:
  ENOSPC) after copying what it could; the caller fails the job and commits nothing of it.
- ``shrunk(windows)``: a window whose file is now shorter than when it was registered (the
  daemon refuses a job then, before reserving anything; sealed memfds cannot shrink).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from offloadd.transfer.types import Direction, FileWindow, MoveArrays

TMPFS_MAGIC = 0x01021994
_PROT_NONE = 0
_MAP_PRIVATE = 0x02
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)


def _file_call(name: str, count: type[ctypes.c_size_t | ctypes.c_int]) -> Any:
    """libc's ``name(fd, buffer or iovecs, count, offset) -> ssize_t``."""
    call = _libc[name]
    call.argtypes = (ctypes.c_int, ctypes.c_void_p, count, ctypes.c_int64)
    call.restype = ctypes.c_ssize_t
    return call


_pread = _file_call("pread64", ctypes.c_size_t)
_pwrite = _file_call("pwrite64", ctypes.c_size_t)
_preadv = _file_call("preadv64", ctypes.c_int)  # count: of iovecs
_pwritev = _file_call("pwritev64", ctypes.c_int)
_IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers per preadv/pwritev (1024 on Linux)
_mmap = _libc.mmap
_mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int64,
)
_mmap.restype = ctypes.c_void_p
_munmap = _libc.munmap
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_munmap.restype = ctypes.c_int
_fstatfs = _libc.fstatfs
_fstatfs.argtypes = (ctypes.c_int, ctypes.c_void_p)
_fstatfs.restype = ctypes.c_int


def filesystem_type(fd: int) -> int:
    """``f_type`` of ``fstatfs(fd)`` (the first field of ``struct statfs`` on Linux)."""
    buffer = ctypes.create_string_buffer(256)  # larger than struct statfs on every ABI
    if _fstatfs(fd, buffer) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


def region_file_problem(fd: int, info: os.stat_result | None = None) -> str:
    """Why the descriptor ``fd`` cannot hold KV regions ("" when it can)."""
    try:
        info = info or os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return "is not a regular file"
        if filesystem_type(fd) != TMPFS_MAGIC:
            return (
                "is not on tmpfs: KV regions are shared-memory files (in /dev/shm, or memfds); "
                "hugetlbfs and disk files are not supported"
            )
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
            return "was not opened read-write (loads write into it)"
    except OSError as exc:
        return f"cannot be inspected: {exc.strerror}"
    return ""


def sealed_against_shrinking(fd: int) -> bool:
    """Whether ``fd`` is a memfd sealed with ``F_SEAL_SHRINK`` (adding the seal if it can)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if not seals & fcntl.F_SEAL_SHRINK and not seals & fcntl.F_SEAL_SEAL:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return bool(seals & fcntl.F_SEAL_SHRINK)


def reserve(size: int) -> int:
    """``size`` bytes of address space with no access at all; raises OSError."""
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
    address = _mmap(None, size, _PROT_NONE, flags, -1, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot reserve {size} bytes of address space: {os.strerror(code)}")
    return int(address)


def unreserve(address: int, size: int) -> None:
    """Give back what ``reserve`` returned."""
    _munmap(address, size)


def shrunk(windows: Sequence[FileWindow]) -> str:
    """Why a window's file cannot be copied now ("" when every one is whole)."""
    for window in windows:
        try:
            size = os.fstat(window.fd).st_size
        except OSError as exc:
            return f"a region file cannot be inspected: {exc.strerror}"
        if size < window.size:
            return (
                f"a region file shrank from {window.size} to {size} bytes since it was "
                "registered: say Hello again with a whole file"
            )
    return ""


def guarded_copy(arrays: MoveArrays, direction: Direction, windows: Sequence[FileWindow]) -> None:
    """Perform ``arrays``: copies whose rank side lies in a window with pread/pwrite on its
    file, the others (mapped memory) with memmove; see the module docstring."""
    count = len(arrays)
    if not count:
        return
    store = direction is Direction.STORE
    ordered = sorted(windows)
    bases = np.array([w.address for w in ordered], np.uint64)
    ends = np.array([w.address + w.size for w in ordered], np.uint64)
    client = arrays.srcs if store else arrays.dsts
    host = arrays.dsts if store else arrays.srcs
    which = np.searchsorted(bases, client, side="right").astype(np.int64) - 1
    inside = which >= 0
    inside[inside] = client[inside] < ends[which[inside]]
    if (client[inside] + arrays.sizes[inside] > ends[which[inside]]).any():
        raise ValueError("a copy reaches outside the rank's registered file")
    memmove = ctypes.memmove
    mapped = np.flatnonzero(~inside)
    for address, rank_side, nbytes in zip(
        host[mapped].tolist(), client[mapped].tolist(), arrays.sizes[mapped].tolist(), strict=True
    ):
        if store:
            memmove(address, rank_side, nbytes)
        else:
            memmove(rank_side, address, nbytes)
    through_files = np.flatnonzero(inside)
    if not len(through_files):
        return
    # By file and offset: copies whose rank sides follow each other in one file are one
    # preadv/pwritev (a step's loads scatter over the rank's blocks, many of them neighbours:
    # a 256-load step's 1024 copies of 2 KiB were 404 runs). Bytes copied twice, by jobs
    # whose blocks overlap, may land in either order: both are the rank's own.
    by_offset = through_files[np.lexsort((client[through_files], which[through_files]))]
    files = which[by_offset]
    offsets = client[by_offset].astype(np.int64) - bases[files].astype(np.int64)
    sizes = arrays.sizes[by_offset].astype(np.int64)
    breaks = (files[1:] != files[:-1]) | (offsets[1:] != offsets[:-1] + sizes[:-1])
    edges = [0, *(np.flatnonzero(breaks) + 1).tolist(), len(by_offset)]
    iovecs = np.empty((len(by_offset), 2), np.uint64)  # struct iovec: base, length
    iovecs[:, 0] = host[by_offset]
    iovecs[:, 1] = sizes
    fds = [w.fd for w in ordered]
    firsts = edges[:-1]
    for first, end, window, offset in zip(
        firsts, edges[1:], files[firsts].tolist(), offsets[firsts].tolist(), strict=True
    ):
        fd = fds[window]
        for piece in range(first, end, _IOV_MAX):
            part = iovecs[piece : min(piece + _IOV_MAX, end)]
            offset += _vector_copy(store, fd, part, offset)


def _vector_copy(store: bool, fd: int, iovecs: npt.NDArray[np.uint64], offset: int) -> int:
    """Copy the file's bytes from ``offset`` on to or from the buffers ``iovecs`` in one
    call; after a short or failed call (a signal, a file that shrank, no space) each buffer
    goes again alone, which names the problem (bytes copied twice are the same bytes). The
    bytes copied."""
    total = int(iovecs[:, 1].sum())
    if (_preadv if store else _pwritev)(fd, iovecs.ctypes.data, len(iovecs), offset) == total:
        return total
    for address, nbytes in iovecs.tolist():
        _copy_one(store, fd, address, nbytes, offset)
        offset += nbytes
    return total


def _copy_one(store: bool, fd: int, address: int, nbytes: int, offset: int) -> None:
    call = _pread if store else _pwrite
    done = 0
    while done < nbytes:
        moved = call(fd, address + done, nbytes - done, offset + done)
        if moved > 0:
            done += moved
            continue
        if moved == 0:
            raise OSError(
                errno.EIO,
                f"a region file ended at byte {offset + done}: it shrank under the copy",
            )
        code = ctypes.get_errno()
        if code != errno.EINTR:
            raise OSError(code, f"region file: {os.strerror(code)}")

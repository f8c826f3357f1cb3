"""Opening memory handles: one refcounted table of imports per process.

``HandleTable.open(handle, fd)`` imports the memory a handle names and returns an ``Import``
whose ``address`` is the first byte of the region. Opening the same underlying object twice
(the same shm file, the same CUDA allocation) reuses the existing import; it is closed when
the last user calls ``release``. Copies hold a reference while they run, so an import never
goes away under an in-flight copy.

Shared-memory regions come as the descriptor ``fd`` the rank passed over the registration
socket (``offloadd.peer``); the table never opens a path, so a rank cannot make the daemon
reach a file with the daemon's rights, only files the rank opened read-write itself. The
file must be a regular file on tmpfs (``offloadd.transfer.guarded.region_file_problem``) and
not one of the daemon's own (``forbidden``: the arena, the journal and its key, compared by
device and inode when a region is opened, so a link or a rename does not hide them).

A file the rank could shrink, or leave holes in on a full tmpfs, would SIGBUS the daemon
through a mapping. So the table maps only memfds sealed against shrinking (it adds the seal
when the memfd allows it): they live on the kernel's own tmpfs, which has no size limit, so a
fault in them is always served. Any other file is never mapped: the table keeps a duplicate
of its descriptor and reserves address space for it (``Import.window``), and the cpu copy
engine reaches its bytes with pread/pwrite (``offloadd.transfer.guarded``), so a rank that
truncates it or leaves holes in a full tmpfs fails its own jobs, not the daemon.

CUDA IPC handles are opened through the ``cuda`` opener the table is built with (see
``CudaOpener``; ``offloadd.transfer.cuda_import.CudaIpcOpener`` in the daemon, a fake in tests). One
mapping per exported storage: ``(device UUID, handle bytes, storage offset)``, the key torch
itself uses for its IPC cache; a handle that finds its storage mapped already is passed to
the opener's ``duplicate`` (each export holds a reference of its own on the exporter, as
torch's rebuild knows). A mapping is closed when the last reference goes, so releasing a
reaped rank's imports unmaps its GPU memory at once. ``Import.device`` is the local device
ordinal of a CUDA import (-1 for host memory), which the cuda copy engine needs per job.
Without a cuda opener, CUDA handles are refused with a clear message.

Threads: the table may be used from several threads (the daemon opens CUDA handles on an
import thread while its loop retains and releases); its bookkeeping is locked, and openers
run outside the lock. ``closer``, when given, runs each mapping's close (for a CUDA import,
torch syncs a stream and closes the IPC mapping): the daemon hands them to its import thread,
off the event loop. Without it, closes run in the releasing thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from offloadd.transfer.guarded import (
    region_file_problem,
    reserve,
    sealed_against_shrinking,
    unreserve,
)
from offloadd.transfer.types import FileWindow
from protocol.handles import CudaIpcHandle, MemoryHandle, ShmHandle, normalize_uuid


class HandleError(Exception):
    """A handle that cannot be opened; the message says why."""


class CudaOpener(Protocol):
    """Imports CUDA IPC handles for ``HandleTable`` (torch in the daemon, fakes in tests)."""

    def device_index(self, handle: CudaIpcHandle) -> int:
        """The local device ordinal of the handle's GPU; raises if it is not visible."""
        ...

    def open(self, handle: CudaIpcHandle) -> tuple[int, int, Callable[[], None]]:
        """Import the object ``handle`` names: ``(address, size, close)``.

        ``address`` and ``size`` describe the whole imported object (the table adds
        ``handle.offset`` and checks ``handle.size`` against it); ``close`` drops the import.
        """
        ...

    def duplicate(self, handle: CudaIpcHandle) -> None:
        """``handle`` names an object the table maps already (another export of it): drop
        whatever this export holds for the exporter (torch's per-export reference)."""
        ...


@dataclass(eq=False)
class _Mapping:
    key: tuple[object, ...]
    size: int
    base: int
    refs: int
    close: object  # zero-argument callable that unmaps
    device: int = -1
    window: FileWindow | None = None  # a shared-memory file, reached through its descriptor
    sealed: bool = False  # a memfd that cannot shrink


@dataclass(eq=False)
class Import:
    """An opened region: ``address`` .. ``address + size`` is the region's memory."""

    handle: MemoryHandle
    address: int
    size: int
    _mapping: _Mapping = field(repr=False)
    device: int = -1  # local CUDA device ordinal of a CUDA import; -1 for host memory

    @property
    def window(self) -> FileWindow | None:
        """The shared-memory file behind a host region (its bytes are never mapped)."""
        return self._mapping.window

    @property
    def extent(self) -> tuple[tuple[object, ...], int]:
        """The whole mapping behind it, as ``(key, bytes)``: imports of one file share it."""
        return self._mapping.key, self._mapping.size

    @property
    def sealed(self) -> bool:
        """A memfd sealed against shrinking: no need to check its size before a job."""
        return self._mapping.sealed


class HandleTable:
    """Process-wide refcounted imports; see the module docstring."""

    def __init__(
        self,
        forbidden: Sequence[str] = (),
        *,
        cuda: CudaOpener | None = None,
        closer: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._forbidden = tuple(forbidden)
        self._cuda = cuda
        self._closer = closer
        self._mappings: dict[tuple[object, ...], _Mapping] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Mappings currently open."""
        with self._lock:
            return len(self._mappings)

    def open(self, handle: MemoryHandle, fd: int | None = None) -> Import:
        """Import ``handle`` (or reuse its import); raises HandleError.

        ``fd``: the descriptor of a ``ShmHandle``'s file, as the rank passed it (the table
        keeps a duplicate; the caller still closes its own).
        """
        # Handles are opened before the registry checks geometry: never hand out an address
        # before the mapping.
        if handle.offset < 0 or handle.size < 0:
            raise HandleError(
                f"region offset {handle.offset} and size {handle.size} must not be negative"
            )
        match handle:
            case ShmHandle():
                mapping = self._open_shm(handle, fd)
            case CudaIpcHandle():
                mapping = self._open_cuda(handle)
        if handle.offset + handle.size > mapping.size:
            self._unref(mapping)
            raise HandleError(
                f"region [{handle.offset}, {handle.offset + handle.size}) lies outside the "
                f"{mapping.size}-byte object it names"
            )
        return Import(
            handle, mapping.base + handle.offset, handle.size, mapping, device=mapping.device
        )

    def release(self, imported: Import) -> None:
        """Drop one reference taken by ``open``."""
        self._unref(imported._mapping)

    def retain(self, imported: Import) -> None:
        """Take one more reference (e.g. for a copy in flight)."""
        with self._lock:
            imported._mapping.refs += 1

    def close(self) -> None:
        """Unmap everything (at daemon exit, after copies drained)."""
        with self._lock:
            mappings = list(self._mappings.values())
            for mapping in mappings:
                mapping.refs = 1
        for mapping in mappings:
            self._unref(mapping)

    def _open_shm(self, handle: ShmHandle, fd: int | None) -> _Mapping:
        name = repr(handle.path[:200])
        if fd is None:
            raise HandleError(
                f"{name}: shared-memory regions reach the daemon as file descriptors over its "
                "registration socket (offloadd.client passes them); the daemon opens no path"
            )
        try:
            info = os.fstat(fd)
        except OSError as exc:
            raise HandleError(f"{name}: bad descriptor: {exc.strerror}") from None
        problem = region_file_problem(fd, info)
        if problem:
            raise HandleError(f"{name} {problem}")
        if (info.st_dev, info.st_ino) in self._daemon_files():
            raise HandleError(f"{name} is one of the daemon's own files (its arena or journal)")
        if info.st_size == 0:
            raise HandleError(f"{name} is empty")
        key = ("shm", info.st_dev, info.st_ino)
        with self._lock:
            existing = self._mappings.get(key)
            if existing is not None:
                existing.refs += 1
                return existing
        if sealed_against_shrinking(fd):
            mapping = self._map_sealed(fd, name, key)
        else:
            mapping = self._reserve_window(fd, name, key)
        return mapping

    def _map_sealed(self, fd: int, name: str, key: tuple[object, ...]) -> _Mapping:
        """A memfd that cannot shrink, on the kernel's own unlimited tmpfs: a fault in its
        mapping can always be served (never SIGBUS), so copies go through the mapping."""
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
        except OSError as exc:
            raise HandleError(f"{name}: {exc.strerror or exc}") from None
        # A ctypes view gives the mapping's address; it must be dropped before unmapping.
        view = (ctypes.c_char * size).from_buffer(mm)
        holder = [view]

        def unmap() -> None:
            holder.clear()
            mm.close()

        mapping = _Mapping(key, size, ctypes.addressof(view), 1, unmap, sealed=True)
        mapping = self._insert(mapping)
        if mapping.close is not unmap:  # imported meanwhile by another thread: keep that one
            unmap()
        return mapping

    def _reserve_window(self, fd: int, name: str, key: tuple[object, ...]) -> _Mapping:
        """Any other tmpfs file: address space only; its bytes are reached by descriptor."""
        kept = os.dup(fd)  # the rank's descriptor is closed when its registration ends
        try:
            size = os.fstat(kept).st_size
            base = reserve(size)
        except BaseException as exc:
            os.close(kept)
            if isinstance(exc, OSError):
                raise HandleError(f"{name}: {exc.strerror or exc}") from None
            raise

        def close() -> None:
            unreserve(base, size)
            with contextlib.suppress(OSError):
                os.close(kept)

        window = FileWindow(base, size, kept)
        mapping = self._insert(_Mapping(key, size, base, 1, close, window=window))
        if mapping.close is not close:  # imported meanwhile by another thread: keep that one
            close()
        return mapping

    def _daemon_files(self) -> set[tuple[int, int]]:
        """(device, inode) of the daemon's own files now (a compacted journal is a new one)."""
        found = set()
        for path in self._forbidden:
            with contextlib.suppress(OSError):
                info = os.stat(path)
                found.add((info.st_dev, info.st_ino))
        return found

    def _open_cuda(self, handle: CudaIpcHandle) -> _Mapping:
        if self._cuda is None:
            raise HandleError(
                "CUDA IPC handles need the cuda copy engine, which this daemon does not run"
            )
        key = ("cuda", normalize_uuid(handle.device_uuid), handle.handle, handle.storage_offset)
        with self._lock:
            existing = self._mappings.get(key)
            if existing is not None:
                existing.refs += 1
        if existing is not None:
            self._duplicate(existing, handle)
            return existing
        try:
            device = self._cuda.device_index(handle)
            base, size, close = self._cuda.open(handle)
        except HandleError:
            raise
        except Exception as exc:
            raise HandleError(
                f"cannot open the CUDA IPC handle of GPU {handle.device_uuid}: {exc}"
            ) from exc
        mapping = self._insert(_Mapping(key, size, base, 1, close, device))
        if mapping.close is not close:  # opened meanwhile by another thread: keep that one
            self._run_close(close)
            self._duplicate(mapping, handle)
        return mapping

    def _duplicate(self, mapping: _Mapping, handle: CudaIpcHandle) -> None:
        assert self._cuda is not None
        try:
            self._cuda.duplicate(handle)
        except Exception as exc:
            self._unref(mapping)
            raise HandleError(
                f"cannot release the extra reference of a CUDA IPC handle: {exc}"
            ) from exc

    def _insert(self, mapping: _Mapping) -> _Mapping:
        """Add a new mapping, or take a reference on one another thread added first."""
        with self._lock:
            existing = self._mappings.get(mapping.key)
            if existing is not None:
                existing.refs += 1
                return existing
            self._mappings[mapping.key] = mapping
            return mapping

    def _unref(self, mapping: _Mapping) -> None:
        with self._lock:
            mapping.refs -= 1
            if mapping.refs:
                return
            del self._mappings[mapping.key]
        close = mapping.close
        assert callable(close)
        self._run_close(close)

    def _run_close(self, close: Callable[[], None]) -> None:
        if self._closer is None:
            close()
        else:
            self._closer(close)

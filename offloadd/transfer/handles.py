"""Opening memory handles: one refcounted table of imports per process.

``HandleTable.open(handle)`` maps the memory a handle names and returns an ``Import`` whose
``address`` is the first byte of the region. Opening the same underlying object twice (the
same shm file, the same CUDA allocation) reuses the existing mapping; it is unmapped when
the last user calls ``release``. Copies hold a reference while they run, so a mapping never
goes away under an in-flight copy.

Shared-memory handles are confined to ``allowed_dirs`` (a rank must not make the daemon map,
and later write, an arbitrary file) and may never name the daemon's own arena.

CUDA IPC handles are opened through the ``cuda`` opener the table is built with (see
``CudaOpener``; ``offloadd.cuda_ipc.CudaIpcOpener`` in the daemon, a fake in tests). One
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

import ctypes
import mmap
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from offloadd.cuda_ipc import normalize_uuid
from protocol.handles import CudaIpcHandle, MemoryHandle, ShmHandle


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


@dataclass(eq=False)
class Import:
    """An opened region: ``address`` .. ``address + size`` is the region's memory."""

    handle: MemoryHandle
    address: int
    size: int
    _mapping: _Mapping = field(repr=False)
    device: int = -1  # local CUDA device ordinal of a CUDA import; -1 for host memory


class HandleTable:
    """Process-wide refcounted imports; see the module docstring."""

    def __init__(
        self,
        allowed_dirs: Sequence[str] = ("/dev/shm",),
        forbidden: Sequence[str] = (),
        *,
        cuda: CudaOpener | None = None,
        closer: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._allowed = [os.path.realpath(d) for d in allowed_dirs]
        self._forbidden = {_file_id(p) for p in forbidden if os.path.exists(p)}
        self._cuda = cuda
        self._closer = closer
        self._mappings: dict[tuple[object, ...], _Mapping] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Mappings currently open."""
        with self._lock:
            return len(self._mappings)

    def open(self, handle: MemoryHandle) -> Import:
        """Map ``handle`` (or reuse its mapping); raises HandleError."""
        # Handles are opened before the registry checks geometry: never hand out an address
        # before the mapping.
        if handle.offset < 0 or handle.size < 0:
            raise HandleError(
                f"region offset {handle.offset} and size {handle.size} must not be negative"
            )
        match handle:
            case ShmHandle():
                mapping = self._open_shm(handle)
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

    def _open_shm(self, handle: ShmHandle) -> _Mapping:
        if "\x00" in handle.path:
            raise HandleError("the path contains a NUL byte")
        path = os.path.realpath(handle.path)
        if not any(
            os.path.dirname(path) == d or path.startswith(d + os.sep) for d in self._allowed
        ):
            raise HandleError(f"{handle.path} is outside the shared-memory dirs {self._allowed}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise HandleError(f"cannot open {handle.path}: {exc.strerror}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise HandleError(f"{handle.path} is not a regular file")
            key = ("shm", info.st_dev, info.st_ino)
            if (info.st_dev, info.st_ino) in self._forbidden:
                raise HandleError(f"{handle.path} is the daemon's own arena")
            with self._lock:
                existing = self._mappings.get(key)
                if existing is not None:
                    existing.refs += 1
                    return existing
            if info.st_size == 0:
                raise HandleError(f"{handle.path} is empty")
            mm = mmap.mmap(fd, info.st_size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        # A ctypes view gives the mapping's address; it must be dropped before unmapping.
        view = (ctypes.c_char * info.st_size).from_buffer(mm)
        holder = [view]

        def unmap() -> None:
            holder.clear()
            mm.close()

        mapping = self._insert(_Mapping(key, info.st_size, ctypes.addressof(view), 1, unmap))
        if mapping.close is not unmap:  # mapped meanwhile by another thread: keep that one
            unmap()
        return mapping

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


def _file_id(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino

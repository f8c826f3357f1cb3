"""The arena: one shared-memory file, sized at start, that holds every cached shard.

The file is locked (``flock``) for as long as a daemon uses it, so two daemons can never
share one arena by accident. It is pre-faulted at start (``MADV_POPULATE_WRITE``, else one
write per page), because first-touch faults would otherwise run at a fraction of memcpy
speed inside the first copies.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_PREFAULT_STEP = 256 << 20


class ArenaError(Exception):
    """The arena cannot be created or locked; the message says why and what to do."""


class Arena:
    """A locked, mapped, pre-faulted shared-memory file of ``size`` bytes."""

    def __init__(
        self,
        path: str,
        size: int,
        *,
        progress: Callable[[float], None] | None = None,
        unlink_on_close: bool = True,
    ) -> None:
        if size <= 0:
            raise ArenaError(f"arena size must be positive, got {size}")
        self.path = path
        self.size = size
        self._unlink_on_close = unlink_on_close
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise ArenaError(f"arena directory {directory} does not exist")
        created = not os.path.exists(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise ArenaError(f"arena {path} is in use by another daemon") from exc
                raise
            current = os.fstat(fd).st_size
            if current != size:
                free = _free_bytes(directory) + current
                if size > free:
                    raise ArenaError(
                        f"arena of {size} bytes does not fit in {directory} "
                        f"({free} bytes free); lower the capacity or grow {directory}"
                    )
                os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            if created:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        self._fd = fd
        self._view: ctypes.Array[ctypes.c_char] | None = (ctypes.c_char * size).from_buffer(
            self._mmap
        )
        self.address = ctypes.addressof(self._view)
        self._prefault(progress)

    def _prefault(self, progress: Callable[[float], None] | None) -> None:
        started = time.perf_counter()
        for start in range(0, self.size, _PREFAULT_STEP):
            length = min(_PREFAULT_STEP, self.size - start)
            try:
                self._mmap.madvise(_MADV_POPULATE_WRITE, start, length)
            except OSError:
                # Older kernels: touch one byte per page (writing what is there keeps data).
                for page in range(start, start + length, mmap.PAGESIZE):
                    self._mmap[page] = self._mmap[page]
            if progress is not None:
                progress((start + length) / self.size)
        logger.info(
            "arena %s: %d MiB pre-faulted in %.2fs",
            self.path,
            self.size >> 20,
            time.perf_counter() - started,
        )

    def view(self, offset: int, size: int) -> memoryview:
        """A memoryview of ``size`` bytes at ``offset`` (for tests and verification)."""
        if offset < 0 or offset + size > self.size:
            raise ValueError("range outside the arena")
        return memoryview(self._mmap)[offset : offset + size]

    def close(self) -> None:
        """Unmap, unlock, and (by default) remove the file. Idempotent."""
        if self._view is None:
            return
        self._view = None
        try:
            self._mmap.close()
        except BufferError:
            # Someone still holds a view: the pages stay mapped until it goes, but the file
            # and the lock are released now.
            logger.warning("arena %s still has views open at close", self.path)
        if self._unlink_on_close:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self._fd)


def _free_bytes(directory: str) -> int:
    info = os.statvfs(directory)
    return info.f_bavail * info.f_frsize

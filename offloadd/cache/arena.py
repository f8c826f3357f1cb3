"""The arena: one shared-memory file, sized at start, that holds every cached shard.

The file is locked (``flock``) for as long as a daemon uses it, so two daemons can never
share one arena by accident. Nobody else may have placed it or be able to swap it: it is
created with ``O_EXCL|O_NOFOLLOW`` in a directory only the daemon's user can change (or a
sticky one such as ``/dev/shm``, where nobody can rename or remove another user's file), and
an existing file is reused only when ``fstat`` says it is the daemon's own regular file, with
one link and no group or other access bits (``ArenaError`` names the path and its owner).
It is pre-faulted at start (``MADV_POPULATE_WRITE``, else one write per page), because
first-touch faults would otherwise run at a fraction of memcpy speed inside the first copies.
A large arena is pre-faulted by a few threads on disjoint ranges (``madvise`` through ctypes,
which releases the GIL; Python's ``mmap.madvise`` does not), with progress reported from the
constructing thread.

``memory_backed`` says whether the file lives in memory (tmpfs, hugetlbfs, ramfs: gone at a
reboot) or on a disk; on a disk, ``sync(offset, size)`` (``msync``) makes a range durable
before the journal names it.

An optional ``pin(address, size)`` hook runs after pre-faulting (on GPU hosts:
``offloadd.transfer.pinning.register_host_memory``); whatever it returns is kept and, if it
has a ``close()``, closed before the arena is unmapped.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

from offloadd.safety import owner_name, private_dir_problem

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_PREFAULT_STEP = 256 << 20
_PREFAULT_THREADS = 8

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_msync = _libc.msync
_msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_msync.restype = ctypes.c_int
_MS_SYNC = 4
_statfs = _libc.statfs
_statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
_statfs.restype = ctypes.c_int
# statfs(2) f_type of file systems that keep their files in memory only.
_MEMORY_FILESYSTEMS = frozenset({0x01021994, 0x958458F6, 0x858458F6})  # tmpfs, hugetlbfs, ramfs


def memory_backed(path: str) -> bool:
    """Whether ``path`` lives on a file system that keeps files in memory (lost at reboot)."""
    buffer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _statfs(os.fsencode(path), buffer) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error), path)
    # f_type is the first field, a signed long; the magic numbers are compared unsigned.
    f_type = ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF
    return f_type in _MEMORY_FILESYSTEMS


def _populate(address: int, length: int) -> bool:
    """MADV_POPULATE_WRITE one range; False when the kernel cannot (then touch pages)."""
    result: int = _madvise(address, length, _MADV_POPULATE_WRITE)
    return result == 0


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
        pin: Callable[[int, int], object] | None = None,
    ) -> None:
        if size <= 0:
            raise ArenaError(f"arena size must be positive, got {size}")
        self.path = path
        self.size = size
        self._unlink_on_close = unlink_on_close
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise ArenaError(f"arena directory {directory} does not exist")
        _check_directory(directory, path)
        fd, created = _open_own_file(path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise ArenaError(f"arena {path} is in use by another daemon") from exc
                raise
            info = os.fstat(fd)
            current = info.st_size
            # Same file, same size: its bytes are the previous daemon's chunks (see journal).
            self.reused = current == size
            self.identity = (info.st_dev, info.st_ino, size)
            if current != size:
                free = _free_bytes(directory) + current
                if size > free:
                    raise ArenaError(
                        f"arena of {size} bytes does not fit in {directory} "
                        f"({free} bytes free); lower the capacity or grow {directory}"
                    )
                os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED)
            self.memory_backed = memory_backed(path)
        except BaseException:
            os.close(fd)
            if created:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        self._fd = fd
        self.created = created  # this daemon made the file (a failed first start removes it)
        self._view: ctypes.Array[ctypes.c_char] | None = (ctypes.c_char * size).from_buffer(
            self._mmap
        )
        self.address = ctypes.addressof(self._view)
        self._pinned: object = None
        try:
            self._prefault(progress)
            if pin is not None:
                self._pinned = pin(self.address, size)
        except BaseException:
            self._view = None
            self._mmap.close()
            os.close(fd)
            if created:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise

    def _prefault(self, progress: Callable[[float], None] | None) -> None:
        started = time.perf_counter()
        ranges = [
            (start, min(_PREFAULT_STEP, self.size - start))
            for start in range(0, self.size, _PREFAULT_STEP)
        ]
        threads = min(_PREFAULT_THREADS, os.cpu_count() or 1, len(ranges))
        done = 0
        untouched: list[tuple[int, int]] = []

        def advance(length: int) -> None:
            nonlocal done
            done += length
            if progress is not None:
                progress(done / self.size)

        if threads <= 1:
            for start, length in ranges:
                if not _populate(self.address + start, length):
                    self._touch(start, length)
                advance(length)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="offloadd-prefault") as pool:
                futures = {
                    pool.submit(_populate, self.address + start, length): (start, length)
                    for start, length in ranges
                }
                for future in as_completed(futures):
                    start, length = futures[future]
                    if future.result():
                        advance(length)
                    else:
                        untouched.append((start, length))
            for start, length in sorted(untouched):
                self._touch(start, length)
                advance(length)
        logger.info(
            "arena %s: %d MiB pre-faulted in %.2fs",
            self.path,
            self.size >> 20,
            time.perf_counter() - started,
        )

    def _touch(self, start: int, length: int) -> None:
        # Older kernels: touch one byte per page (writing what is there keeps data).
        for page in range(start, start + length, mmap.PAGESIZE):
            self._mmap[page] = self._mmap[page]

    @property
    def pinned(self) -> object:
        """What the ``pin`` hook returned (None without a hook, or when pinning failed)."""
        return self._pinned

    def sync(self, offset: int, size: int) -> None:
        """Write ``[offset, offset + size)`` through to the file (msync); raises OSError.

        Only meaningful on a disk (``memory_backed`` is False). Any thread may call it.
        """
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError("range outside the arena")
        start = offset - offset % mmap.PAGESIZE
        if _msync(self.address + start, offset + size - start, _MS_SYNC) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"msync of the arena: {os.strerror(error)}", self.path)

    def view(self, offset: int, size: int) -> memoryview:
        """A memoryview of ``size`` bytes at ``offset`` (for tests and verification)."""
        if offset < 0 or offset + size > self.size:
            raise ValueError("range outside the arena")
        return memoryview(self._mmap)[offset : offset + size]

    def close(self, *, remove: bool = False) -> None:
        """Unmap, unlock, and remove the file (by default, or with ``remove``). Idempotent."""
        if self._view is None:
            return
        self._view = None
        pinned, self._pinned = self._pinned, None
        close_pin = getattr(pinned, "close", None)
        if callable(close_pin):
            try:
                close_pin()
            except Exception:
                logger.exception("arena %s: releasing the pinned registration failed", self.path)
        try:
            self._mmap.close()
        except BufferError:
            # Someone still holds a view: the pages stay mapped until it goes, but the file
            # and the lock are released now.
            logger.warning("arena %s still has views open at close", self.path)
        if self._unlink_on_close or remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self._fd)


def _check_directory(directory: str, path: str) -> None:
    """Refuse a directory where another user could rename, remove or replace the arena."""
    problem = private_dir_problem(directory)
    if not problem:
        return
    info = os.stat(directory)
    if info.st_mode & stat.S_ISVTX and not os.path.islink(directory):
        return  # sticky (/dev/shm, /tmp): only the file's owner can rename or remove it
    raise ArenaError(f"arena {path}: {problem}")


def _open_own_file(path: str) -> tuple[int, bool]:
    """A descriptor of the daemon's own arena file at ``path``, and whether it was created.

    New files are made with O_EXCL|O_NOFOLLOW; an existing one must pass ``fstat``: a regular
    file of the daemon's user, one link, no access for group or others.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
    except FileExistsError:
        pass
    try:
        fd = os.open(path, flags | os.O_NONBLOCK)  # a fifo planted there must not block us
    except OSError as exc:
        raise ArenaError(_foreign_arena(path, f"cannot be opened ({exc.strerror})")) from exc
    info = os.fstat(fd)
    problem = ""
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif info.st_uid != os.geteuid():
        problem = "is not the daemon's file"
    elif info.st_nlink != 1:
        problem = f"has {info.st_nlink} names (hard links)"
    elif stat.S_IMODE(info.st_mode) & 0o077:
        problem = f"is open to group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    if problem:
        os.close(fd)
        raise ArenaError(_foreign_arena(path, problem))
    return fd, False


def _foreign_arena(path: str, problem: str) -> str:
    try:
        uid = os.lstat(path).st_uid
        owner = f"owned by {owner_name(uid)}"
    except OSError:
        owner = "gone"
    return (
        f"arena {path} ({owner}) {problem}: another user may have placed it to read or change "
        f"the cache; the daemon (uid {os.geteuid()}) refuses it. Remove it or set cache.arena "
        "to a path in a directory only the daemon's user can write"
    )


def _free_bytes(directory: str) -> int:
    info = os.statvfs(directory)
    return info.f_bavail * info.f_frsize

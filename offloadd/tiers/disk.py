"""The disk tier: one checksummed file per chunk under a directory (``[disk]``).

A ``Tier`` (see ``offloadd.tiers.base`` for the contract); what this one adds:

- Files: ``<path>/<xx>/<hash>`` in the format of ``offloadd.tiers.chunkfile``. ``put``
  writes ``<hash>.tmp`` and renames it into place, so a chunk file exists only once whole.
  No fsync: a file torn by a power loss fails its checksum and is dropped by ``get``.
- Direct I/O (``direct_io``): files are opened with O_DIRECT, so demotions do not fill the
  page cache. Page-aligned extents move straight between the arena and the file (only the
  header passes through a page-aligned bounce buffer); others go through the bounce buffer.
  Where the file system refuses O_DIRECT (EINVAL), buffered I/O is used, straight from and
  into the arena.
- Capacity: the sum of file sizes stays within ``capacity`` (0: half the file system's
  free space at open) by deleting the least recently used files; ``put`` and ``get`` hits
  make a chunk recent (and set its file's mtime, so the order survives a restart).
- Restart: at open the index is rebuilt from the headers (payloads are checked by ``get``),
  recency from the files' mtimes; temporary files of a killed run and files with bad headers
  are deleted, and the oldest files beyond a (smaller) capacity too.
- Threads: ``put``, ``get``, ``remove``, ``clear`` and ``close`` come from the tier's
  worker thread, one at a time. ``contains`` and ``stats`` may be called from any thread
  (the event loop's too) at the same time: they read only the in-memory index, under a lock.
  Within one ``put`` or ``get`` the chunks' files are moved by ``threads`` I/O threads (a
  disk serves several requests at once far faster than one; checksums run on them too).
  Room is made before the writes start, in chunk order, so evictions are deterministic.
- Trust: the directory and its fan-out directories must be the daemon's and writable by
  nobody else, not symlinks (``UnsafePath`` at open otherwise), and are then reached only
  through descriptors opened at start. Temporary files are made with
  ``O_CREAT|O_EXCL|O_NOFOLLOW`` (a planted ``.tmp`` link is never followed), chunk files are
  opened with ``O_NOFOLLOW`` and served only when ``fstat`` says they are the daemon's regular
  files (one of another user's is a bad file: counted, deleted, a miss).
- Faults: an OSError (ENOSPC, EIO, ...) or a bad file is counted in ``stats().errors``,
  logged once per kind, and answered False; it never raises.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from offloadd.cache.arena import Arena
from offloadd.checksum import checksum_of, checksum_views
from offloadd.safety import UnsafePath, private_dir_problem
from offloadd.settings import DiskSettings
from offloadd.tiers import chunkfile
from offloadd.tiers.base import ChunkAddress, Tier, TierCounters, TierStats, TierWrite

__all__ = ["DiskTier"]

logger = logging.getLogger(__name__)

_SCAN_PROGRESS_SECONDS = 5.0  # a progress line at most this often while scanning at open

Name = tuple[str, bytes]
_T = TypeVar("_T")


@dataclass(slots=True)
class _File:
    """One chunk file the index knows: its path relative to the directory and its size."""

    name: str
    size: int


class _Corrupt(Exception):
    """A chunk file that exists but must not be served (the message says why)."""


class DiskTier(Tier):
    """Chunks as files under one directory; see the module docstring."""

    name = "disk"

    def __init__(
        self, path: str, capacity: int = 0, *, direct_io: bool = True, threads: int = 4
    ) -> None:
        self.path = os.path.abspath(path)
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        self._dirs: dict[str, int] = {}  # fan-out directory -> its descriptor
        try:
            self._check_dir(self.path)
            for index in range(256):
                name = f"{index:02x}"
                directory = os.path.join(self.path, name)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(directory, 0o700)
                self._dirs[name] = self._check_dir(directory)
        except BaseException:
            self._close_dirs()
            raise
        if capacity <= 0:
            info = os.statvfs(self.path)
            capacity = info.f_bavail * info.f_frsize // 2
        self.capacity = capacity
        self.direct_io = direct_io and _direct_io_works(self.path)
        self._lock = threading.Lock()  # the index and the counters (contains, stats)
        self._files: OrderedDict[Name, _File] = OrderedDict()  # least recently used first
        self._used = 0
        self._counts = TierCounters()
        self._logged: set[str] = set()
        self._local = threading.local()  # each thread's bounce buffer
        self._bounces: list[mmap.mmap] = []
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="offloadd-disk") if threads > 1 else None
        )
        self._closed = False
        self._scan()

    @staticmethod
    def _check_dir(directory: str) -> int:
        """A descriptor of ``directory`` once it is the daemon's own; UnsafePath if not."""
        problem = private_dir_problem(directory)
        if problem:
            raise UnsafePath(f"disk.path: {problem}")
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        info = os.fstat(fd)  # the one opened, not one swapped in after the check
        if info.st_uid not in (os.geteuid(), 0) or info.st_mode & 0o022:
            os.close(fd)
            raise UnsafePath(f"disk.path: {directory} changed while it was checked")
        return fd

    def _close_dirs(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()

    def _split(self, relative: str) -> tuple[int, str]:
        """The fan-out directory's descriptor and the file's name in it."""
        directory, name = relative.split("/", 1)
        return self._dirs[directory], name

    @classmethod
    def from_settings(cls, settings: DiskSettings) -> DiskTier:
        """The tier ``[disk]`` describes (``path`` must be set)."""
        return cls(settings.path, settings.capacity, direct_io=settings.direct_io)

    # -- Tier -------------------------------------------------------------------------

    def put(self, chunks: Sequence[ChunkAddress], arena: Arena) -> TierWrite:
        # Room is made in chunk order here (so what is evicted does not depend on thread
        # timing); the files are then written by the pool.
        result = TierWrite(stored=[False] * len(chunks))
        planned: dict[Name, tuple[int, ChunkAddress, int]] = {}
        pending = 0
        for index, chunk in enumerate(chunks):
            name = (chunk.namespace, chunk.key)
            with self._lock:
                known = self._files.get(name)
                if known is not None:
                    self._files.move_to_end(name)
            if known is not None:
                self._touch(known.name)
                result.stored[index] = True
            elif name not in planned:
                size = chunkfile.header_size(chunk.namespace, chunk.key, len(chunk.extents))
                size += chunkfile.aligned(chunk.nbytes)
                room = self._reserve(size, pending)
                if room is not None:
                    result.evicted += room
                    planned[name] = (index, chunk, size)
                    pending += size
        writes = list(planned.values())
        started = time.perf_counter()
        done = self._map(lambda w: self._write_one(w[1], w[2], arena), writes)
        with self._lock:
            self._counts.write_seconds += time.perf_counter() - started if writes else 0.0
            for name in planned:  # recency in chunk order, not in the order writes finished
                if name in self._files:
                    self._files.move_to_end(name)
        for (index, _, _), stored in zip(writes, done, strict=True):
            result.stored[index] = stored
        for index, chunk in enumerate(chunks):  # a name twice in one batch: as its first
            first = planned.get((chunk.namespace, chunk.key))
            if first is not None:
                result.stored[index] = result.stored[first[0]]
        return result

    def get(self, chunks: Sequence[ChunkAddress], arena: Arena) -> list[bool]:
        started = time.perf_counter()
        found = self._map(lambda chunk: self._read_one(chunk, arena), chunks)
        if any(found):
            with self._lock:  # wall time of the batch: its reads overlap
                self._counts.read_seconds += time.perf_counter() - started
                for chunk, hit in zip(chunks, found, strict=True):  # recency in chunk order
                    name = (chunk.namespace, chunk.key)
                    if hit and name in self._files:
                        self._files.move_to_end(name)
        return found

    def contains(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        """From the in-memory index, under the lock: safe from any thread, no I/O."""
        with self._lock:
            return [(namespace, key) in self._files for key in keys]

    def remove(self, namespace: str, keys: Sequence[bytes]) -> None:
        self._forget([(namespace, key) for key in keys])

    def clear(self, namespace: str) -> None:
        with self._lock:
            names = [name for name in self._files if name[0] == namespace]
        self._forget(names)

    def stats(self) -> TierStats:
        with self._lock:
            return self._counts.stats(self.name, self.capacity, self._used, len(self._files))

    def close(self) -> None:
        """Stop the I/O threads and free their buffers; the files stay. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._lock:
            bounces, self._bounces = self._bounces, []
        for bounce in bounces:
            bounce.close()
        self._close_dirs()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- files ------------------------------------------------------------------------

    def _map(self, work: Callable[[_T], bool], items: Sequence[_T]) -> list[bool]:
        """``work`` of every item, on the pool when there are several."""
        if len(items) <= 1 or self._pool is None:
            return [work(item) for item in items]
        return list(self._pool.map(work, items))

    def _reserve(self, size: int, pending: int) -> list[Name] | None:
        """Count ``size`` bytes as used, evicting LRU files first; None: no room.

        ``pending``: bytes reserved by this batch's earlier chunks, not yet files; what
        they hold cannot be evicted, so when it leaves no room nothing is evicted.
        """
        if pending + size > self.capacity:
            return None
        victims: list[tuple[Name, _File]] = []
        with self._lock:
            while self._files and self._used + size > self.capacity:
                name, known = self._files.popitem(last=False)
                self._used -= known.size
                victims.append((name, known))
            self._used += size
        for _, known in victims:
            self._unlink(known.name)
        return [name for name, _ in victims]

    def _write_one(self, chunk: ChunkAddress, size: int, arena: Arena) -> bool:
        """Write one chunk whose ``size`` is reserved; index it once it is in place."""
        name = (chunk.namespace, chunk.key)
        relative = chunkfile.file_name(*name)
        try:
            self._write(chunk, arena, relative)
        except OSError as exc:
            self._fault(f"write:{errno.errorcode.get(exc.errno or 0, exc.errno)}", exc)
            with self._lock:
                self._used -= size
                self._counts.healthy = False
            return False
        with self._lock:
            self._files[name] = _File(relative, size)
            self._counts.healthy = True
            self._counts.bytes_written += chunk.nbytes
        return True

    def _read_one(self, chunk: ChunkAddress, arena: Arena) -> bool:
        """Fill one chunk's extents; a bad or unreadable file is counted and dropped."""
        name = (chunk.namespace, chunk.key)
        with self._lock:
            known = self._files.get(name)
        if known is None:
            return False
        try:
            self._read(chunk, arena, known)
        except (OSError, _Corrupt) as exc:
            self._fault("read:corrupt" if isinstance(exc, _Corrupt) else "read:os", exc)
            self._forget([name])
            return False
        with self._lock:
            self._counts.bytes_read += chunk.nbytes
        self._touch(known.name)
        return True

    def _write(self, chunk: ChunkAddress, arena: Arena, relative: str) -> None:
        """Write the chunk to ``relative`` + TEMP_SUFFIX, then rename it into place."""
        directory, final = self._split(relative)
        temp = final + chunkfile.TEMP_SUFFIX
        sizes = [size for _, size in chunk.extents]
        # Never an existing name: a .tmp planted there (a link to the arena, say) is not
        # followed, opened or truncated; the write fails and counts as a fault instead.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            with _views(arena, chunk.extents) as views:
                header = chunkfile.pack_header(
                    chunk.namespace, chunk.key, sizes, checksum_views(views)
                )
                direct = os.O_DIRECT if self.direct_io else 0
                fd = os.open(temp, flags | direct, 0o600, dir_fd=directory)
                try:
                    if self.direct_io and _page_aligned(arena, chunk.extents):
                        # The arena's pages go to the device as they are; only the header
                        # passes through the (aligned) bounce buffer.
                        bounce = self._bounce_of(len(header))
                        bounce[: len(header)] = header
                        with memoryview(bounce) as whole, whole[: len(header)] as head:
                            _write_fully(fd, [head, *views])
                    elif self.direct_io:
                        # O_DIRECT: one aligned buffer of aligned length (the tail is padding).
                        length = len(header) + chunkfile.aligned(chunk.nbytes)
                        bounce = self._bounce_of(length)
                        bounce[: len(header)] = header
                        offset = len(header)
                        for view in views:
                            bounce[offset : offset + len(view)] = view
                            offset += len(view)
                        bounce[offset:length] = bytes(length - offset)
                        with memoryview(bounce) as whole, whole[:length] as region:
                            _write_fully(fd, [region])
                    else:
                        padding = bytes(chunkfile.aligned(chunk.nbytes) - chunk.nbytes)
                        _write_fully(fd, [header, *views, padding])
                finally:
                    os.close(fd)
            # By path: the directories are the daemon's and nobody else can write them.
            placed = os.path.join(self.path, relative)
            os.rename(placed + chunkfile.TEMP_SUFFIX, placed)
        except FileExistsError:
            raise  # someone else's name: not ours to remove
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=directory)
            raise

    def _read(self, chunk: ChunkAddress, arena: Arena, known: _File) -> None:
        """Fill the chunk's extents from ``known``; _Corrupt or OSError when it cannot."""
        directory, name = self._split(known.name)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0)
        try:
            fd = os.open(name, flags, dir_fd=directory)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _Corrupt("a symbolic link, not a chunk file") from None
            raise
        try:
            problem = _foreign(os.fstat(fd))
            if problem:
                raise _Corrupt(problem)
            with _views(arena, chunk.extents) as views:
                if self.direct_io and _page_aligned(arena, chunk.extents):
                    # Straight into the arena; only the header lands in the bounce buffer.
                    length = chunkfile.header_size(chunk.namespace, chunk.key, len(views))
                    bounce = self._bounce_of(length)
                    with memoryview(bounce) as whole, whole[:length] as head:
                        got = os.preadv(fd, [head, *views], 0)
                        header = self._check_header(chunk, head, got)
                    if header.length != length:  # unreachable when the sizes match; cheap
                        raise _Corrupt("header length differs from the chunk's")
                    if checksum_views(views) != header.payload_sum:
                        raise _Corrupt("payload checksum mismatch")
                elif self.direct_io:
                    length = chunkfile.aligned(known.size)
                    bounce = self._bounce_of(length)
                    # Every slice of the bounce buffer is released explicitly: one kept
                    # alive by a traceback would stop the buffer from being closed.
                    with memoryview(bounce) as whole, whole[:length] as region:
                        got = os.preadv(fd, [region], 0)
                        with region[:got] as data:
                            header = self._check_header(chunk, data, got)
                        end = header.length + header.payload_length
                        with region[header.length : end] as payload:
                            if checksum_of(payload) != header.payload_sum:
                                raise _Corrupt("payload checksum mismatch")
                            offset = 0
                            for view in views:
                                view[:] = payload[offset : offset + len(view)]
                                offset += len(view)
                else:
                    first = os.pread(fd, chunkfile.ALIGN, 0)
                    try:
                        length = chunkfile.header_length(first)
                    except chunkfile.ChunkFileError as exc:
                        raise _Corrupt(str(exc)) from None
                    block = first if length == len(first) else os.pread(fd, length, 0)
                    header = self._check_header(chunk, block, os.fstat(fd).st_size)
                    got = os.preadv(fd, views, header.length) if views else 0
                    if got != header.payload_length:
                        raise _Corrupt("truncated payload")
                    if checksum_views(views) != header.payload_sum:
                        raise _Corrupt("payload checksum mismatch")
        finally:
            os.close(fd)

    @staticmethod
    def _check_header(
        chunk: ChunkAddress, data: bytes | memoryview, file_size: int
    ) -> chunkfile.Header:
        try:
            header = chunkfile.unpack_header(data)
        except chunkfile.ChunkFileError as exc:
            raise _Corrupt(str(exc)) from None
        if (header.namespace, header.key) != (chunk.namespace, chunk.key):
            raise _Corrupt("the header names another chunk")
        if header.shard_sizes != tuple(size for _, size in chunk.extents):
            raise _Corrupt("shard sizes differ from the chunk's")
        if file_size < header.length + header.payload_length:
            raise _Corrupt("truncated payload")
        return header

    def _bounce_of(self, length: int) -> mmap.mmap:
        """This thread's page-aligned bounce buffer, grown to at least ``length`` bytes."""
        bounce: mmap.mmap | None = getattr(self._local, "bounce", None)
        if bounce is None or len(bounce) < length:
            grown = mmap.mmap(-1, chunkfile.aligned(length))
            with self._lock:
                if bounce is not None:
                    self._bounces.remove(bounce)
                    bounce.close()
                self._bounces.append(grown)
            self._local.bounce = bounce = grown
        return bounce

    def _touch(self, relative: str) -> None:
        # The mtime is the recency the next open starts from; losing one is harmless.
        with contextlib.suppress(OSError):
            directory, name = self._split(relative)
            os.utime(name, dir_fd=directory, follow_symlinks=False)

    def _evict(self, limit: int) -> list[Name]:
        """Delete least recently used files until at most ``limit`` bytes are used."""
        victims: list[tuple[Name, _File]] = []
        with self._lock:
            while self._files and self._used > limit:
                name, known = self._files.popitem(last=False)
                self._used -= known.size
                victims.append((name, known))
        for _, known in victims:
            self._unlink(known.name)
        return [name for name, _ in victims]

    def _forget(self, names: Sequence[Name]) -> None:
        """Drop ``names`` from the index and delete their files."""
        dropped: list[_File] = []
        with self._lock:
            for name in names:
                known = self._files.pop(name, None)
                if known is not None:
                    self._used -= known.size
                    dropped.append(known)
        for known in dropped:
            self._unlink(known.name)

    def _unlink(self, relative: str) -> None:
        try:
            directory, name = self._split(relative)
            os.unlink(name, dir_fd=directory)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._fault("unlink", exc)

    def _fault(self, kind: str, exc: BaseException) -> None:
        """Count an error; log the first of each kind as a warning, later ones at debug.

        The message is logged, not the exception: a record that kept its traceback alive
        would keep views of the bounce buffer and the arena alive with it.
        """
        with self._lock:
            self._counts.errors += 1
            first = kind not in self._logged
            self._logged.add(kind)
        log = logger.warning if first else logger.debug
        log("disk tier %s: %s failed: %s (further ones at debug)", self.path, kind, str(exc))

    # -- open -------------------------------------------------------------------------

    def _scan(self) -> None:
        """Rebuild the index from the files' headers; delete temp and bad files."""
        started = time.monotonic()
        last_report = started
        found: list[tuple[float, Name, _File]] = []
        removed = 0
        directories = [f"{index:02x}" for index in range(256)]
        # One directory per task: a full disk holds up to millions of headers to read.
        scans = self._pool.map(self._scan_directory, directories) if self._pool else None
        for index, directory in enumerate(directories):
            kept, dropped = next(scans) if scans else self._scan_directory(directory)
            found += kept
            removed += dropped
            now = time.monotonic()
            if now - last_report >= _SCAN_PROGRESS_SECONDS:
                last_report = now
                logger.info(
                    "disk tier %s: scanning, %d/256 directories, %d chunks so far",
                    self.path,
                    index + 1,
                    len(found),
                )
        found.sort(key=lambda item: item[0])
        for _, name, known in found:
            self._files[name] = known
            self._used += known.size
        evicted = self._evict(self.capacity)
        logger.info(
            "disk tier %s: %d chunks, %d of %d MiB, %s I/O; removed %d temporary or bad "
            "files and %d over capacity in %.2fs",
            self.path,
            len(self._files),
            self._used >> 20,
            self.capacity >> 20,
            "direct" if self.direct_io else "buffered",
            removed,
            len(evicted),
            time.monotonic() - started,
        )

    def _scan_directory(self, directory: str) -> tuple[list[tuple[float, Name, _File]], int]:
        """The intact chunk files of one fan-out directory; the others are deleted."""
        kept = []
        dropped = 0
        with os.scandir(os.path.join(self.path, directory)) as entries:
            for entry in entries:
                relative = f"{directory}/{entry.name}"
                read = _read_entry(entry, relative, self._dirs[directory])
                if read is None:
                    self._unlink(relative)
                    dropped += 1
                else:
                    kept.append(read)
        return kept, dropped


def _foreign(info: os.stat_result) -> str:
    """Why a chunk file must not be served for not being the daemon's ("" when it is)."""
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_uid != os.geteuid():
        return f"a file of uid {info.st_uid}, not the daemon's"
    return ""


def _read_entry(
    entry: os.DirEntry[str], relative: str, directory: int
) -> tuple[float, Name, _File] | None:
    """(mtime, name, file) of a chunk file whose header is intact; None: delete it."""
    if entry.name.endswith(chunkfile.TEMP_SUFFIX) or not entry.is_file(follow_symlinks=False):
        return None
    try:
        info = entry.stat(follow_symlinks=False)
        if _foreign(info):
            return None
        fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
        with open(fd, "rb") as handle:
            first = handle.read(chunkfile.ALIGN)
            length = chunkfile.header_length(first)
            data = first if length == len(first) else first + handle.read(length - len(first))
        header = chunkfile.unpack_header(data)
    except (OSError, chunkfile.ChunkFileError):
        return None
    if chunkfile.file_name(header.namespace, header.key) != relative:
        return None
    if info.st_size < header.length + header.payload_length:
        return None
    return info.st_mtime, (header.namespace, header.key), _File(relative, info.st_size)


def _direct_io_works(directory: str) -> bool:
    """Whether files in ``directory`` open with O_DIRECT (tmpfs before Linux 6.6 refuses)."""
    # One fixed name: a probe left by a killed run is reused, not piled up.
    probe = os.path.join(directory, f".direct-probe{chunkfile.TEMP_SUFFIX}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            logger.info("disk tier %s: no O_DIRECT on this file system, buffered I/O", directory)
            return False
        # Not an answer about O_DIRECT (a full disk, say): keep it; writes count the fault.
        logger.warning("disk tier %s: cannot probe for O_DIRECT: %s", directory, exc.strerror)
        return True
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return True


def _page_aligned(arena: Arena, extents: Sequence[tuple[int, int]]) -> bool:
    """Whether O_DIRECT can move ``extents`` in place (aligned addresses and sizes)."""
    align = chunkfile.ALIGN
    return all(
        (arena.address + offset) % align == 0 and size % align == 0 for offset, size in extents
    )


@contextlib.contextmanager
def _views(arena: Arena, extents: Sequence[tuple[int, int]]) -> Iterator[list[memoryview]]:
    """The arena's views of ``extents``, released on exit (the arena can then unmap)."""
    views = [arena.view(offset, size) for offset, size in extents]
    try:
        yield views
    finally:
        for view in views:
            view.release()


def _write_fully(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    """writev ``parts``; a short write (a file system filling up) counts as a failed one."""
    total = sum(len(part) for part in parts)
    written = os.writev(fd, parts)
    if written != total:
        raise OSError(errno.ENOSPC, f"short write ({written} of {total} bytes)")

"""The commit journal: what lets a restarted daemon find its committed chunks again.

The arena is a named shared-memory file, so its bytes outlive the daemon (SIGTERM, SIGKILL,
a crash). The journal beside it records which extents hold which committed chunk:

- ``committed(chunks)`` appends one record per chunk once every shard of it is written;
- ``removed(chunks)`` appends a tombstone when a committed chunk is evicted or removed, and
  the daemon calls it *before* any copy may reuse the chunk's extents.

Each record is ``[u32 length][u32 crc32][msgpack payload]`` written with one ``write(2)``:
once the call returns the record is in the kernel's page cache and survives the process. A
record cut short by a crash fails its length or checksum and ends the replay there (the
chunks it would have named are simply not found again). The header names the arena file
(device, inode, size): a journal that belongs to another arena is discarded. Replay keeps
what is still committed, in commit order, and rewrites the file compactly; the daemon asks
for another compaction when tombstones pile up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from collections.abc import Iterable
from typing import Any

import msgspec

from offloadd.cache.index import Entry, RestoredChunk

logger = logging.getLogger(__name__)

_MAGIC = b"offloadd-journal-1\n"
_HEADER = struct.Struct(">QQQ")  # arena st_dev, st_ino, size
_RECORD = struct.Struct(">II")  # payload length, crc32
_MAX_RECORD = 1 << 24

ArenaIdentity = tuple[int, int, int]


class Journal:
    """Append-only commit journal of one arena; see the module docstring."""

    def __init__(self, path: str, fd: int, size: int, live: int) -> None:
        self.path = path
        self._fd: int | None = fd
        self._size = size
        self._live = live
        self._encoder = msgspec.msgpack.Encoder()

    @classmethod
    def open(cls, path: str, arena: ArenaIdentity) -> tuple[Journal, list[RestoredChunk]]:
        """Replay the journal at ``path`` if it belongs to ``arena``, then compact it."""
        chunks = _replay(path, arena)
        fd, size = _rewrite(path, arena, chunks)
        return cls(path, fd, size, len(chunks)), chunks

    @property
    def size(self) -> int:
        """Bytes in the journal file."""
        return self._size

    def should_compact(self) -> bool:
        """Tombstones and superseded records dominate the file."""
        return self._size > max(64 << 20, 4 * 96 * max(self._live, 1))

    def committed(self, entries: Iterable[Entry]) -> None:
        """Record chunks that just became visible."""
        records = [
            self._encoder.encode(("+", e.namespace, e.key, list(e.offsets), list(e.sizes)))
            for e in entries
        ]
        self._live += len(records)
        self._append(records)

    def removed(self, entries: Iterable[Entry]) -> None:
        """Record committed chunks that are gone (call before their extents are reused)."""
        records = [self._encoder.encode(("-", e.namespace, e.key)) for e in entries if e.committed]
        self._live -= len(records)
        self._append(records)

    def compact(self, arena: ArenaIdentity, chunks: list[RestoredChunk]) -> None:
        """Rewrite the journal with exactly ``chunks`` (the cache's committed entries)."""
        self.close()
        self._fd, self._size = _rewrite(self.path, arena, chunks)
        self._live = len(chunks)

    def close(self) -> None:
        """Close the file (it stays for the next start). Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        """Close and delete the journal (the arena is going away too)."""
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _append(self, payloads: list[bytes]) -> None:
        if not payloads or self._fd is None:
            return
        data = b"".join(_frame(payload) for payload in payloads)
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self._size += len(data)


def _frame(payload: bytes) -> bytes:
    return _RECORD.pack(len(payload), zlib.crc32(payload)) + payload


def _replay(path: str, arena: ArenaIdentity) -> list[RestoredChunk]:
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return []
    start = len(_MAGIC) + _HEADER.size
    if data[: len(_MAGIC)] != _MAGIC or len(data) < start:
        logger.warning("journal %s is not an offloadd journal; starting empty", path)
        return []
    if _HEADER.unpack_from(data, len(_MAGIC)) != arena:
        logger.info("journal %s belongs to another arena; starting empty", path)
        return []
    live: dict[tuple[str, bytes], RestoredChunk] = {}
    offset, records = start, 0
    while offset + _RECORD.size <= len(data):
        length, crc = _RECORD.unpack_from(data, offset)
        payload = data[offset + _RECORD.size : offset + _RECORD.size + length]
        if length > _MAX_RECORD or len(payload) != length or zlib.crc32(payload) != crc:
            logger.warning("journal %s: torn record at byte %d; replay stops there", path, offset)
            break
        _apply(live, msgspec.msgpack.decode(payload))
        offset += _RECORD.size + length
        records += 1
    logger.info("journal %s: %d records, %d committed chunks", path, records, len(live))
    return list(live.values())


def _apply(live: dict[tuple[str, bytes], RestoredChunk], record: Any) -> None:
    match record:
        case ["+", str(namespace), bytes(key), list(offsets), list(sizes)]:
            live.pop((namespace, key), None)  # re-commit moves it to the recent end
            live[(namespace, key)] = RestoredChunk(namespace, key, tuple(offsets), tuple(sizes))
        case ["-", str(namespace), bytes(key)]:
            live.pop((namespace, key), None)
        case _:
            logger.warning("journal: skipping an unknown record")


def _rewrite(path: str, arena: ArenaIdentity, chunks: list[RestoredChunk]) -> tuple[int, int]:
    encoder = msgspec.msgpack.Encoder()
    parts = [_MAGIC, _HEADER.pack(*arena)]
    parts += [
        _frame(encoder.encode(("+", c.namespace, c.key, list(c.offsets), list(c.sizes))))
        for c in chunks
    ]
    data = b"".join(parts)
    temporary = path + ".tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.replace(temporary, path)  # atomic: a crash leaves the old journal or the new one
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    return fd, len(data)

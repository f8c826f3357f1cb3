"""The commit journal: what lets a restarted daemon find its committed chunks again, and
never anything else.

The arena is a file, so its bytes outlive the daemon (SIGTERM, SIGKILL, a crash). The journal
records which extents hold which committed chunk, and a checksum of each shard's bytes
(``offloadd.checksum``: xxh3_64).

Contract (the daemon calls everything from its event loop, except ``seal``):

- ``Journal.open(path, arena)`` replays the journal if it belongs to this arena file (same
  device, inode and size, and for an arena in memory the same boot), keeps what is still
  committed, in commit order, and returns the chunks whose bytes still match their checksums
  (a chunk that does not is dropped: it is never served). The caller restores them into its
  cache and then calls ``compact`` with what it kept, which rewrites the file to say exactly
  that (until then the file may still name chunks the cache did not take).
- ``seal(writes)`` runs on a worker thread (``submit_seal``) after a store's copy and before
  the daemon hears of it: on a disk-backed arena it ``msync``\\ s each shard's range, then
  checksums it. A chunk commits only with the checksum of every shard.
- ``committed(entries, chunks)`` appends one record per chunk that just became visible and
  returns the entries it could *not* journal: the caller must take those back at once (they
  were never announced; their extents are freed). After a failed append, commits are refused
  until a compaction succeeds; one is tried on a later commit at most every
  ``retry_seconds`` (``chunks()`` gives the cache's committed chunks to write).
- ``removed(entries)`` appends a tombstone for each journaled chunk that is evicted or
  removed; the daemon calls it *before* any copy may reuse the chunk's extents. If that
  append fails the file is emptied (truncated to its header), so it can never name an extent
  that is about to be reused.

Format: a header (magic, arena identity, boot id) and records ``[u32 length][16-byte MAC]
[msgpack payload]``; a payload is one commit or tombstone, or a batch of them (one append
writes one batch: a step's chunks cost one MAC, not one each). MACs are HMAC-SHA256,
truncated, under a key that only the daemon's user can read (``<journal>.key``, created 0600
at first start); each record's MAC covers the previous one's, so records cannot be forged,
reordered or spliced in from another journal.
Replay stops at the first record that is short, fails its MAC or does not decode (a torn
tail, or tampering) and truncates the file there; it never raises. Every append is one
``write(2)``; when it fails (ENOSPC, EIO) the file is truncated back to the last good record,
so nothing after a torn record is ever lost. On a disk-backed arena each append is
``fsync``\\ ed. Any file or record the journal cannot read costs warm-restart hits, never
correctness: the checksums verified at start catch whatever the journal got wrong.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Protocol

import msgspec

from offloadd.cache.index import Entry, RestoredChunk, ShardWrite
from offloadd.checksum import checksum
from offloadd.safety import private_dir_problem, read_secret, write_secret

logger = logging.getLogger(__name__)

_MAGIC = b"offloadd-journal-3\n"
_LEGACY_MAGIC = b"offloadd-journal-1\n"  # unauthenticated, kept beside the arena
# Journals of earlier versions: discarded at open (a cold start, logged at INFO). Version 2
# recorded crc32s, which no shard checksum equals any more.
_EARLIER_MAGICS = (_LEGACY_MAGIC, b"offloadd-journal-2\n")
_HEADER = struct.Struct(">QQQ16s")  # arena st_dev, st_ino, size; boot id (zeros on a disk)
_MAC_SIZE = 16
_LENGTH = struct.Struct(">I")
_HEAD_SIZE = len(_MAGIC) + _HEADER.size + _MAC_SIZE
_MAX_RECORD = 1 << 24
KEY_SIZE = 32
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_VERIFY_BATCH = 1024

_Offset = Annotated[int, msgspec.Meta(ge=0)]
_Size = Annotated[int, msgspec.Meta(gt=0)]
# A shard's xxh3_64: msgpack holds no integer above 2**64 - 1, so ge=0 is the whole bound
# (msgspec accepts no bound beyond int64's).
_Sum = Annotated[int, msgspec.Meta(ge=0)]


class _Commit(msgspec.Struct, array_like=True, frozen=True, tag="+"):
    namespace: str
    key: bytes
    offsets: list[_Offset]
    sizes: list[_Size]
    sums: list[_Sum]


class _Remove(msgspec.Struct, array_like=True, frozen=True, tag="-"):
    namespace: str
    key: bytes


class _Batch(msgspec.Struct, array_like=True, frozen=True, tag="*"):
    """The records of one append, in order, under one MAC."""

    records: list[_Commit | _Remove]


_Record = _Commit | _Remove
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Commit | _Remove | _Batch)
# Records per frame at most (a frame's payload is at most _MAX_RECORD: 4,096 commits of
# 8 shards with long names are about 2.5 MiB).
_FRAME_RECORDS = 4096


def shm_dirs_problem(path: str, shm_dirs: Sequence[str]) -> str:
    """Why the journal may not be at ``path`` ("" when it may): not where ranks name files."""
    for shm_dir in shm_dirs:
        if _within(path, shm_dir):
            return (
                f"it is inside server.shm_dirs ({shm_dir}), where the ranks keep their KV "
                "files: keep it elsewhere"
            )
    return ""


class JournalError(Exception):
    """The journal cannot be used as configured (at start), or an append failed."""


class ArenaLike(Protocol):
    """What the journal needs of the arena (``offloadd.cache.arena.Arena``)."""

    path: str
    size: int
    address: int
    identity: tuple[int, int, int]
    reused: bool
    memory_backed: bool

    def sync(self, offset: int, size: int) -> None:
        """msync ``[offset, offset + size)``."""
        ...


class JournalIO:
    """The system calls the journal makes on its files (tests substitute failures)."""

    def write(self, fd: int, data: memoryview) -> int:
        """``write(2)``: how many bytes were written."""
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        """``fsync(2)``."""
        os.fsync(fd)

    def truncate(self, fd: int, size: int) -> None:
        """``ftruncate(2)``."""
        os.ftruncate(fd, size)


_SYSTEM_IO = JournalIO()


def boot_id() -> bytes:
    """This boot's id (16 bytes), zeros when the kernel does not say."""
    try:
        with open(_BOOT_ID) as handle:
            return uuid.UUID(handle.read().strip()).bytes
    except (OSError, ValueError):
        return bytes(16)


def load_key(path: str) -> bytes:
    """The journal key at ``path``, created (0600, random) when there is none.

    Refuses (JournalError) a key that group or others can read, or of the wrong size.
    """
    try:
        key = read_secret(path, KEY_SIZE)
    except FileNotFoundError:
        key = os.urandom(KEY_SIZE)
        try:
            write_secret(path, key)
        except FileExistsError:
            key = read_secret(path, KEY_SIZE)  # another process made one meanwhile: use that
        else:
            logger.info("journal key %s created", path)
    if isinstance(key, str):
        raise JournalError(
            f"journal key: {key}; remove it (and the journal) to start with a new one (the "
            "cache then starts cold)"
        )
    return key


def discard(path: str) -> None:
    """Remove the journal at ``path`` (its arena is not kept); the key stays."""
    for leftover in (path, path + ".tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)


class Journal:
    """Append-only, authenticated commit journal of one arena; see the module docstring."""

    def __init__(
        self,
        path: str,
        arena: ArenaLike,
        key: bytes,
        *,
        io: JournalIO = _SYSTEM_IO,
        retry_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        threads: int | None = None,
    ) -> None:
        self.path = path
        self._arena = arena
        self._key = key
        self._io = io
        self._retry_seconds = retry_seconds
        self._clock = clock
        self.durable = not arena.memory_backed
        boot = bytes(16) if self.durable else boot_id()  # a disk-backed arena survives boots
        head = _MAGIC + _HEADER.pack(*arena.identity, boot)
        self._head_mac = self._mac(b"", head)
        self._head = head + self._head_mac
        self._fd: int | None = None
        self._size = 0  # bytes of the file up to the end of its last good record
        self._chain = self._head_mac  # MAC of the last good record
        # Chunks journaled and still committed, with their shards' checksums.
        self._sums: dict[tuple[str, bytes], tuple[int, ...]] = {}
        # Checksums of shards written but not committed yet, set by seal() on any thread.
        self._pending: dict[tuple[Entry, int], int] = {}
        # A shard several writers fill (vLLM's canonical layout) is checksummed whole by each
        # writer's seal; the one that started last is the one that saw every writer's bytes
        # (each seal starts after its own copy ended), so only a later start may replace it.
        self._seal_order: dict[tuple[Entry, int], int] = {}
        self._seals_started = 0
        self._pending_lock = threading.Lock()
        self._pending_mark = 1024
        self._exact = False  # the file names no chunk outside _sums
        self._empty = False  # the file holds no record at all
        self._failed = ""  # why commits are refused ("" = they are not)
        self._retry_at = 0.0
        # Chunks the file named at start whose bytes did not match: 0 unless something
        # outside the journal's control (tampering, a lost disk write) changed them.
        self.mismatched = 0
        self._pool = ThreadPoolExecutor(
            threads or min(4, os.cpu_count() or 1), thread_name_prefix="offloadd-seal"
        )

    # ------------------------------------------------------------------ start

    @classmethod
    def open(
        cls,
        path: str,
        arena: ArenaLike,
        *,
        key_path: str = "",
        shm_dirs: Sequence[str] = (),
        io: JournalIO = _SYSTEM_IO,
        retry_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        threads: int | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> tuple[Journal, list[RestoredChunk]]:
        """Replay ``path`` for ``arena`` and verify the chunks' bytes; see the module docstring.

        Raises JournalError when the journal's directory or key is unsafe or unusable, or
        when it lies inside ``shm_dirs`` (where the ranks keep their KV files).
        """
        problem = shm_dirs_problem(path, shm_dirs)
        if problem:
            raise JournalError(f"cache.journal {path}: {problem}")
        directory = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(directory, 0o700, exist_ok=True)
        except OSError as exc:
            raise JournalError(f"cannot create the journal directory: {exc}") from None
        problem = private_dir_problem(directory)
        if problem:
            raise JournalError(f"journal directory: {problem}")
        key = load_key(key_path or path + ".key")
        _discard_legacy(arena.path + ".journal", path)
        journal = cls(
            path, arena, key, io=io, retry_seconds=retry_seconds, clock=clock, threads=threads
        )
        try:
            chunks = journal._replay()
            if not arena.reused:
                chunks = []  # a new arena file: whatever the journal says is not in it
            chunks = journal._verify(chunks, progress)
        except BaseException:
            journal.close()
            raise
        return journal, chunks

    def _replay(self) -> list[RestoredChunk]:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._unusable(f"cannot open it ({exc.strerror})")
            return []
        try:
            info = os.fstat(fd)
            with open(fd, "rb", closefd=False) as handle:
                data = handle.read() if stat.S_ISREG(info.st_mode) else b""
        except OSError as exc:
            os.close(fd)
            self._unusable(f"cannot read it ({exc.strerror})")
            return []
        if not stat.S_ISREG(info.st_mode) or info.st_uid not in (os.geteuid(), 0):
            os.close(fd)
            self._unusable("not a regular file of the daemon's user")
            return []
        if data[: _HEAD_SIZE - _MAC_SIZE] != self._head[: _HEAD_SIZE - _MAC_SIZE]:
            os.close(fd)
            if data.startswith(_EARLIER_MAGICS):
                self._unusable("a journal of an earlier version", warn=False)
            elif data.startswith(_MAGIC):
                self._unusable("belongs to another arena or boot", warn=False)
            else:
                self._unusable("unknown")
            return []
        if not hmac.compare_digest(data[_HEAD_SIZE - _MAC_SIZE : _HEAD_SIZE], self._head_mac):
            os.close(fd)
            self._unusable("its header fails authentication (another key?)")
            return []
        self._fd = fd
        live: dict[tuple[str, bytes], RestoredChunk] = {}
        offset, chain, records = _HEAD_SIZE, self._head_mac, 0
        while offset < len(data):
            batch, end, mac = self._record_at(data, offset, chain)
            if batch is None:
                logger.warning(
                    "journal %s: record at byte %d is torn, forged or unreadable; replay stops "
                    "there and the %d bytes from it on are dropped",
                    self.path,
                    offset,
                    len(data) - offset,
                )
                break
            for record in batch:
                self._apply(live, record)
            offset, chain = end, mac
            records += len(batch)
        self._size, self._chain = offset, chain
        if offset < len(data):
            try:
                self._io.truncate(fd, offset)
                if self.durable:
                    self._io.fsync(fd)
            except OSError as exc:
                logger.error("journal %s: cannot truncate the torn tail: %s", self.path, exc)
                self._invalidate()
        logger.info("journal %s: %d records, %d committed chunks", self.path, records, len(live))
        return list(live.values())

    def _unusable(self, why: str, *, warn: bool = True) -> None:
        """The file at ``path`` is not this arena's journal: remove it (a new one follows)."""
        (logger.warning if warn else logger.info)(
            "journal %s: %s; starting without it", self.path, why
        )
        try:
            discard(self.path)
        except OSError as exc:
            logger.error("journal %s cannot be removed: %s", self.path, exc)

    def _record_at(
        self, data: bytes, offset: int, chain: bytes
    ) -> tuple[list[_Record] | None, int, bytes]:
        """The authenticated records of the frame at ``offset``, its end and MAC; None when
        there is none."""
        body = offset + _LENGTH.size + _MAC_SIZE
        if body > len(data):
            return None, offset, chain
        (length,) = _LENGTH.unpack_from(data, offset)
        end = body + length
        if length > _MAX_RECORD or end > len(data):
            return None, offset, chain
        payload = data[body:end]
        mac = self._mac(chain, data[offset : offset + _LENGTH.size] + payload)
        if not hmac.compare_digest(mac, data[offset + _LENGTH.size : body]):
            return None, offset, chain
        try:
            decoded = _DECODER.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None, offset, chain
        records = decoded.records if isinstance(decoded, _Batch) else [decoded]
        for record in records:
            if isinstance(record, _Commit) and not (
                len(record.offsets) == len(record.sizes) == len(record.sums) > 0
            ):
                return None, offset, chain
        return records, end, mac

    def _apply(self, live: dict[tuple[str, bytes], RestoredChunk], record: _Record) -> None:
        name = (record.namespace, record.key)
        live.pop(name, None)  # a re-commit moves it to the recent end
        if isinstance(record, _Commit):
            live[name] = RestoredChunk(
                record.namespace, record.key, tuple(record.offsets), tuple(record.sizes)
            )
            self._sums[name] = tuple(record.sums)
        else:
            self._sums.pop(name, None)

    def _verify(
        self, chunks: list[RestoredChunk], progress: Callable[[float], None] | None
    ) -> list[RestoredChunk]:
        """The chunks whose every shard still has the bytes it was committed with."""
        arena = self._arena

        def intact(chunk: RestoredChunk) -> bool:
            sums = self._sums.get((chunk.namespace, chunk.key), ())
            if len(sums) != len(chunk.offsets):
                return False
            for offset, size, expected in zip(chunk.offsets, chunk.sizes, sums, strict=True):
                if offset + size > arena.size:
                    return False
                if checksum(arena.address + offset, size) != expected:
                    return False
            return True

        kept: list[RestoredChunk] = []
        for start in range(0, len(chunks), _VERIFY_BATCH):
            batch = chunks[start : start + _VERIFY_BATCH]
            kept += [c for c, ok in zip(batch, self._pool.map(intact, batch), strict=True) if ok]
            if progress is not None:
                progress((start + len(batch)) / len(chunks))
        self.mismatched = len(chunks) - len(kept)
        if self.mismatched:
            logger.warning(
                "journal %s: %d of %d chunks no longer hold the bytes they were committed with; "
                "dropped",
                self.path,
                len(chunks) - len(kept),
                len(chunks),
            )
        return kept

    # ------------------------------------------------------------------ stores

    def seal(self, writes: Sequence[ShardWrite]) -> None:
        """Make the shards ``writes`` copied durable (on a disk) and checksum them.

        Any thread, after the copy and before ``committed``. A shard that cannot be synced
        gets no checksum, so its chunk will not commit.
        """
        arena = self._arena
        with self._pending_lock:  # the writes' seals all start now, in this order
            first = self._seals_started + 1
            self._seals_started += len(writes)
        sealed: list[tuple[ShardWrite, int]] = []
        for write in writes:
            try:
                if self.durable:
                    arena.sync(write.offset, write.size)
                sealed.append((write, checksum(arena.address + write.offset, write.size)))
            except OSError as exc:
                logger.error("arena %s: %s; that chunk is not committed", arena.path, exc)
        with self._pending_lock:
            for started, (write, value) in enumerate(sealed, first):
                token = (write.entry, write.shard)
                if write.part >= 0:
                    if self._seal_order.get(token, -1) > started:
                        continue
                    self._seal_order[token] = started
                self._pending[token] = value

    def submit_seal(self, writes: Sequence[ShardWrite], then: Callable[[], object]) -> None:
        """``seal(writes)`` on the journal's threads, then ``then()`` on that thread."""

        def run() -> None:
            try:
                self.seal(writes)
            finally:
                then()

        try:
            self._pool.submit(run)
        except RuntimeError:  # closing: the pool takes no more work
            run()

    @property
    def failed(self) -> str:
        """Why commits are refused now ("" when they are not)."""
        return self._failed

    def committed(
        self, entries: Sequence[Entry], chunks: Callable[[], list[RestoredChunk]]
    ) -> list[Entry]:
        """Journal chunks that just became visible; returns those it could not journal."""
        if not entries:
            return []
        ready, unsealed = self._take(entries)
        self._prune()
        if not ready:
            return unsealed
        if self._failed and not self._recover(chunks):
            return list(entries)
        records: list[_Record] = [
            _Commit(entry.namespace, entry.key, entry.offsets, list(entry.sizes), list(sums))
            for entry, sums in ready
        ]
        try:
            self._append(records)
        except JournalError:
            return list(entries)
        for entry, sums in ready:
            self._sums[(entry.namespace, entry.key)] = sums
        return unsealed

    def _take(
        self, entries: Sequence[Entry]
    ) -> tuple[list[tuple[Entry, tuple[int, ...]]], list[Entry]]:
        """The entries whose every shard was sealed, with their checksums (taken), and those
        with a shard that was not."""
        ready: list[tuple[Entry, tuple[int, ...]]] = []
        unsealed: list[Entry] = []
        pending, order = self._pending, self._seal_order
        with self._pending_lock:  # once for all of them: seal() takes it per shard
            for entry in entries:
                found = []
                for shard in range(len(entry.sizes)):
                    found.append(pending.pop((entry, shard), None))
                    order.pop((entry, shard), None)
                if None in found:
                    unsealed.append(entry)
                else:
                    ready.append((entry, tuple(found)))  # type: ignore[arg-type]
        return ready, unsealed

    def _prune(self) -> None:
        """Forget the checksums of shards whose chunk was dropped before it committed."""
        if len(self._pending) < self._pending_mark:
            return
        with self._pending_lock:
            for token in [token for token in self._pending if token[0].dead]:
                del self._pending[token]
                self._seal_order.pop(token, None)
            self._pending_mark = max(1024, 2 * len(self._pending))

    def _recover(self, chunks: Callable[[], list[RestoredChunk]]) -> bool:
        if self._clock() < self._retry_at:
            return False
        if self.compact(chunks()):
            logger.warning("journal %s: written again; chunks commit again", self.path)
            return True
        return False

    def removed(self, entries: Iterable[Entry]) -> None:
        """Record that journaled chunks are gone, before their extents are reused."""
        self._prune()
        records: list[_Record] = [
            _Remove(entry.namespace, entry.key)
            for entry in entries
            if entry.committed and self._sums.pop((entry.namespace, entry.key), None) is not None
        ]
        if not records or self._empty or self._fd is None:
            return
        try:
            self._append(records)
        except JournalError:
            # The file still names these chunks and their extents are about to be reused.
            self._invalidate()

    # ------------------------------------------------------------------ compaction

    def should_compact(self) -> bool:
        """Tombstones and superseded records dominate the file."""
        return (
            not self._failed
            and self._size > max(64 << 20, 4 * 96 * max(len(self._sums), 1))
            and self._clock() >= self._retry_at
        )

    def compact(self, chunks: list[RestoredChunk]) -> bool:
        """Rewrite the journal with exactly ``chunks`` (the cache's committed entries).

        Chunks the journal has no checksums for are left out. Returns whether it worked; a
        failure leaves the old file (emptied if it might name chunks outside ``chunks``).
        """
        sums = {}
        for chunk in chunks:
            name = (chunk.namespace, chunk.key)
            shard_sums = self._sums.get(name)
            if shard_sums is not None and len(shard_sums) == len(chunk.offsets):
                sums[name] = (chunk, shard_sums)
        try:
            fd, size, chain = self._rewrite(list(sums.values()))
        except OSError as exc:
            logger.error("journal %s: rewriting it failed: %s", self.path, exc)
            self._retry_at = self._clock() + self._retry_seconds
            if not self._exact:
                self._fail(f"the journal could not be rewritten: {exc}")
                self._invalidate()
            return False
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._size, self._chain = fd, size, chain
        self._sums = {name: shard_sums for name, (_chunk, shard_sums) in sums.items()}
        self._exact, self._empty, self._failed = True, False, ""
        return True

    def _rewrite(
        self, chunks: list[tuple[RestoredChunk, tuple[int, ...]]]
    ) -> tuple[int, int, bytes]:
        parts = [self._head]
        chain = self._head_mac
        records: list[_Record] = [
            _Commit(chunk.namespace, chunk.key, list(chunk.offsets), list(chunk.sizes),
                    list(sums))
            for chunk, sums in chunks
        ]  # fmt: skip
        frames, chain = self._frames(chain, records)
        data = b"".join(parts + frames)
        temporary = self.path + ".tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temporary, flags, 0o600)
        try:
            try:
                self._write_all(fd, data)
                if self.durable:
                    self._io.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, self.path)  # atomic: a crash leaves the old file or the new
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        if self.durable:
            _fsync_directory(os.path.dirname(os.path.abspath(self.path)))
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        return fd, len(data), chain

    # ------------------------------------------------------------------ files

    def _mac(self, chain: bytes, data: bytes) -> bytes:
        return hmac.digest(self._key, chain + data, "sha256")[:_MAC_SIZE]

    def _frames(self, chain: bytes, records: list[_Record]) -> tuple[list[bytes], bytes]:
        """Frames holding ``records``, up to ``_FRAME_RECORDS`` each (a lone record bare, as
        earlier versions wrote it), and the last one's MAC."""
        frames = []
        for start in range(0, len(records), _FRAME_RECORDS):
            batch = records[start : start + _FRAME_RECORDS]
            payload = _ENCODER.encode(batch[0] if len(batch) == 1 else _Batch(batch))
            length = _LENGTH.pack(len(payload))
            chain = self._mac(chain, length + payload)
            frames.append(length + chain + payload)
        return frames, chain

    def _write_all(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[self._io.write(fd, view) :]

    def _append(self, records: list[_Record]) -> None:
        """Append records as one frame with one write; on failure truncate back and raise
        JournalError."""
        if self._fd is None:
            raise JournalError(self._failed or "the journal has no file")
        frames, chain = self._frames(self._chain, records)
        data = b"".join(frames)
        try:
            self._write_all(self._fd, data)
            if self.durable:
                self._io.fsync(self._fd)
        except OSError as exc:
            self._fail(f"appending to the journal failed: {exc}")
            try:
                self._io.truncate(self._fd, self._size)
                if self.durable:
                    self._io.fsync(self._fd)
            except OSError as again:
                logger.error("journal %s: cannot truncate a failed append: %s", self.path, again)
                self._invalidate()
            raise JournalError(self._failed) from exc
        self._size += len(data)
        self._chain = chain

    def _fail(self, reason: str) -> None:
        if not self._failed:
            logger.error(
                "journal %s: %s; stores are refused until it can be rewritten", self.path, reason
            )
        self._failed = reason
        self._retry_at = self._clock() + self._retry_seconds

    def _invalidate(self) -> None:
        """Make the file name no chunk at all: truncate it to its header, else remove it."""
        self._empty = True
        self._exact = True
        if not self._failed:
            self._fail("the journal had to be emptied")
        if self._fd is not None:
            try:
                self._io.truncate(self._fd, _HEAD_SIZE)
                if self.durable:
                    self._io.fsync(self._fd)
                self._size, self._chain = _HEAD_SIZE, self._head_mac
                return
            except OSError as exc:
                logger.error("journal %s: cannot empty it: %s", self.path, exc)
                os.close(self._fd)
                self._fd = None
        try:
            discard(self.path)
        except OSError as exc:
            logger.critical(
                "journal %s can be neither emptied nor removed (%s): remove it before the next "
                "start",
                self.path,
                exc,
            )

    @property
    def size(self) -> int:
        """Bytes in the journal file."""
        return self._size

    def close(self) -> None:
        """Finish the seals in flight and close the file (it stays for the next start)."""
        self._pool.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _discard_legacy(legacy: str, path: str) -> None:
    """Remove the unauthenticated journal earlier versions kept beside the arena."""
    if os.path.abspath(legacy) == os.path.abspath(path):
        return
    try:
        with open(legacy, "rb") as handle:
            old = handle.read(len(_LEGACY_MAGIC)) == _LEGACY_MAGIC
        if old:
            os.unlink(legacy)
            logger.info("removed %s, a journal of an earlier version", legacy)
    except OSError:
        pass


def _within(path: str, directory: str) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(directory)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

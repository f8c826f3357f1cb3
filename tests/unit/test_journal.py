"""The commit journal with a real arena file: replay, checksums, MACs, and every failure.

``Mirror`` makes the daemon's calls into the cache and the journal in the daemon's order
(tombstones before extents are reused, a seal after each copy, commits taken back when the
journal refuses them), without sockets. After a simulated crash (files closed, nothing
compacted), every chunk the journal restores must hold exactly the bytes stored under its key.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import xxhash

from offloadd.cache.arena import Arena
from offloadd.cache.index import ChunkCache, RestoredChunk
from offloadd.cache.journal import KEY_SIZE, Journal, JournalError, load_key
from tests.fakes import Clock
from tests.journal_faults import FaultyIO

NS = "ns"
SHARDS = 2
SHARD = 8192
CAPACITY = 8 * SHARDS * SHARD  # room for 8 chunks: later stores evict
ARENA_SIZE = CAPACITY


@pytest.fixture
def workdir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="od-journal-", dir="/tmp")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def arena_path() -> Iterator[str]:
    path = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    yield path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def key_of(n: int) -> bytes:
    return hashlib.sha256(n.to_bytes(4, "big")).digest() + bytes(4)


def shard_bytes(key: bytes, shard: int) -> bytes:
    seed = hashlib.sha256(key + bytes([shard])).digest()
    return (seed * (SHARD // len(seed) + 1))[:SHARD]


@dataclass
class Mirror:
    """The daemon's cache and journal calls for stores, evictions and removals."""

    arena: Arena
    journal: Journal
    cache: ChunkCache = field(default_factory=lambda: ChunkCache(CAPACITY))
    refused: int = 0

    def store(self, n: int) -> bool:
        """Store chunk ``n`` shard by shard; whether it ended up committed."""
        key = key_of(n)
        for shard in range(SHARDS):
            reservation = self.cache.begin_store(NS, [key], shard, lambda _key: (SHARD,) * SHARDS)
            self.journal.removed(reservation.evicted)  # before the extents are reused
            for write in reservation.writes:
                self.arena.view(write.offset, write.size)[:] = shard_bytes(key, shard)
            self.journal.seal(reservation.writes)
            committed = self.cache.finish_store(reservation.writes, ok=True)
            lost = self.journal.committed(committed, self.cache.committed_chunks)
            self.refused += len(lost)
            for entry in lost:
                self.cache.remove(entry.namespace, [entry.key])
        found = self.cache.get(NS, key)
        return found is not None and found.committed

    def remove(self, n: int) -> None:
        self.journal.removed(self.cache.remove(NS, [key_of(n)]))

    def committed_keys(self) -> set[bytes]:
        return {chunk.key for chunk in self.cache.committed_chunks()}


@dataclass
class Node:
    """An arena file and a journal path that outlive one ``Mirror`` (a daemon run)."""

    arena_path: str
    journal_path: str
    arena: Arena | None = None
    journal: Journal | None = None

    def start(self, **options: object) -> tuple[Mirror, list[RestoredChunk]]:
        self.arena = Arena(self.arena_path, ARENA_SIZE, unlink_on_close=False)
        journal, chunks = Journal.open(self.journal_path, self.arena, **options)  # type: ignore[arg-type]
        self.journal = journal
        mirror = Mirror(self.arena, journal)
        mirror.cache.restore(chunks)
        journal.compact(mirror.cache.committed_chunks())
        return mirror, chunks

    def crash(self) -> None:
        """Stop without compacting or cleaning up: the files stay as they are."""
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def replay(self, mismatched: int | None = 0) -> list[RestoredChunk]:
        """Start again and check every restored chunk's bytes; the restored chunks.

        ``mismatched``: how many chunks the journal may name whose bytes changed (None: any).
        Only a test that changed bytes or cut the file expects any: the journal itself must
        never name a wrong extent, whatever fails.
        """
        mirror, chunks = self.start()
        assert mismatched is None or mirror.journal.mismatched == mismatched
        for chunk in chunks:
            for shard, offset in enumerate(chunk.offsets):
                got = bytes(mirror.arena.view(offset, SHARD))
                assert got == shard_bytes(chunk.key, shard), f"wrong bytes for {chunk.key.hex()}"
        self.crash()
        return chunks


@pytest.fixture
def node(arena_path: str, workdir: str) -> Iterator[Node]:
    node = Node(arena_path, os.path.join(workdir, "state", "a.journal"))
    yield node
    node.crash()


def test_committed_chunks_come_back_in_commit_order(node: Node) -> None:
    mirror, chunks = node.start()
    assert chunks == []
    for n in range(5):
        assert mirror.store(n)
    mirror.remove(2)
    expected = [c for c in mirror.cache.committed_chunks()]
    node.crash()
    restored = node.replay()
    assert [c.key for c in restored] == [key_of(n) for n in (0, 1, 3, 4)]
    assert restored == expected


def test_evicted_chunks_stay_gone_and_reused_extents_hold_the_new_keys(node: Node) -> None:
    mirror, _ = node.start()
    for n in range(30):  # 8 fit: most are evicted, their extents reused
        assert mirror.store(n)
    live = mirror.committed_keys()
    node.crash()
    assert {c.key for c in node.replay()} == live


def test_journal_and_key_are_private(node: Node) -> None:
    node.start()
    node.crash()
    directory = os.path.dirname(node.journal_path)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(node.journal_path).st_mode) == 0o600
    key = node.journal_path + ".key"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert os.path.getsize(key) == KEY_SIZE
    assert load_key(key) == load_key(key)  # created once, then read


def test_a_key_others_can_read_is_refused(workdir: str) -> None:
    path = os.path.join(workdir, "j.key")
    load_key(path)
    os.chmod(path, 0o640)
    with pytest.raises(JournalError, match="chmod 600"):
        load_key(path)
    os.chmod(path, 0o600)
    with open(path, "ab") as handle:
        handle.write(b"x")
    with pytest.raises(JournalError, match="32-byte key"):
        load_key(path)


def test_a_journal_dir_others_can_write_is_refused(arena_path: str, workdir: str) -> None:
    directory = os.path.join(workdir, "open")
    os.mkdir(directory)
    os.chmod(directory, 0o777)
    arena = Arena(arena_path, ARENA_SIZE)
    try:
        with pytest.raises(JournalError, match="writable"):
            Journal.open(os.path.join(directory, "j"), arena)
    finally:
        arena.close()


def test_a_journal_inside_the_shm_dirs_is_refused(arena_path: str) -> None:
    arena = Arena(arena_path, ARENA_SIZE)
    try:
        with pytest.raises(JournalError, match="shm_dirs"):
            Journal.open(arena_path + ".journal", arena, shm_dirs=["/dev/shm"])
    finally:
        arena.close()
    assert not os.path.exists(arena_path + ".journal")


def _records(path: str) -> list[int]:
    """Byte offsets where each record ends (header end first), read from a healthy file."""
    data = Path(path).read_bytes()
    ends = [len(b"offloadd-journal-3\n") + 8 * 3 + 16 + 16]
    while ends[-1] < len(data):
        length = int.from_bytes(data[ends[-1] : ends[-1] + 4], "big")
        ends.append(ends[-1] + 4 + 16 + length)
    assert ends[-1] == len(data)
    return ends


def test_a_torn_tail_at_every_byte_is_dropped_and_truncated(node: Node, workdir: str) -> None:
    mirror, _ = node.start()
    for n in range(12):
        mirror.store(n)
    mirror.remove(9)
    node.crash()
    original = Path(node.journal_path).read_bytes()
    ends = _records(node.journal_path)
    for cut in range(ends[0], len(original)):
        Path(node.journal_path).write_bytes(original[:cut])
        # A cut file has lost tombstones: it names reused extents, which the checksums catch.
        node.replay(mismatched=None)
        good = max(end for end in ends if end <= cut)
        # Replay truncated the tail; the start-up compaction then rewrote the file.
        assert os.path.getsize(node.journal_path) <= good


def _append_raw(path: str, frame: bytes) -> None:
    with open(path, "ab") as handle:
        handle.write(frame)


def _forged_commit(victim: RestoredChunk, key: bytes, mac: bytes) -> bytes:
    payload = msgspec.msgpack.encode(
        ["+", victim.namespace, key, list(victim.offsets), list(victim.sizes), [0, 0]]
    )
    return len(payload).to_bytes(4, "big") + mac + payload


def test_a_forged_record_is_never_believed(node: Node) -> None:
    mirror, _ = node.start()
    for n in range(4):
        mirror.store(n)
    chunks = mirror.cache.committed_chunks()
    node.crash()
    # Name chunk 0's extents as key 99's: without the key no MAC can be right.
    _append_raw(node.journal_path, _forged_commit(chunks[0], key_of(99), bytes(16)))
    size_before = os.path.getsize(node.journal_path)
    restored = node.replay()
    assert key_of(99) not in {c.key for c in restored}
    assert len(restored) == 4
    assert os.path.getsize(node.journal_path) < size_before


def test_a_forged_record_in_the_middle_stops_replay_and_nothing_wrong_is_served(
    node: Node,
) -> None:
    mirror, _ = node.start()
    for n in range(6):
        mirror.store(n)
    node.crash()
    data = bytearray(Path(node.journal_path).read_bytes())
    ends = _records(node.journal_path)
    data[ends[3] + 10] ^= 0xFF  # the 4th record's MAC
    Path(node.journal_path).write_bytes(bytes(data))
    assert [c.key for c in node.replay()] == [key_of(n) for n in range(3)]


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode(["?", "ns", b"k"]),  # no such record
        msgspec.msgpack.encode(["+", "ns", b"k", [0], [4096, 4096], [3]]),  # shard counts differ
        msgspec.msgpack.encode(["+", "ns", b"k", [-4096], [4096], [3]]),  # negative offset
        msgspec.msgpack.encode(["+", "ns", b"k", [0], [4096], [-1]]),  # not a checksum
        msgspec.msgpack.encode(["-", 7, b"k"]),  # wrong types
    ],
)
def test_an_authenticated_record_that_does_not_decode_is_a_torn_tail(
    node: Node, garbage: bytes
) -> None:
    mirror, _ = node.start()
    mirror.store(0)
    journal = node.journal
    assert journal is not None
    # Written with the journal's own key and chain: it authenticates but is no record.
    length = len(garbage).to_bytes(4, "big")
    mac = journal._mac(journal._chain, length + garbage)
    assert journal._fd is not None
    os.write(journal._fd, length + mac + garbage)
    journal._size += len(length + mac + garbage)
    journal._chain = mac
    mirror.store(1)  # after the bad record: not found again
    node.crash()
    assert [c.key for c in node.replay()] == [key_of(0)]


def test_changed_bytes_drop_their_chunk(node: Node) -> None:
    mirror, _ = node.start()
    for n in range(3):
        mirror.store(n)
    victim = mirror.cache.get(NS, key_of(1))
    assert victim is not None
    node.crash()
    with open(node.arena_path, "r+b") as arena:
        arena.seek(victim.offsets[1] + 100)
        byte = arena.read(1)
        arena.seek(victim.offsets[1] + 100)
        arena.write(bytes([byte[0] ^ 1]))
    assert [c.key for c in node.replay(mismatched=1)] == [key_of(0), key_of(2)]


def test_a_new_arena_file_restores_nothing(node: Node) -> None:
    mirror, _ = node.start()
    mirror.store(0)
    node.crash()
    os.unlink(node.arena_path)
    assert node.replay() == []
    assert node.replay() == []  # and the journal was rewritten to say so


def test_a_journal_of_another_arena_is_replaced(node: Node, workdir: str) -> None:
    mirror, _ = node.start()
    mirror.store(0)
    node.crash()
    other = Node(node.arena_path + "-other", node.journal_path)
    try:
        assert other.replay() == []
    finally:
        other.crash()
        os.unlink(other.arena_path)
    assert node.replay() == []  # the journal now belongs to the other arena


@pytest.mark.parametrize("version", [1, 2])
def test_a_journal_of_an_earlier_version_is_discarded_quietly(
    node: Node, version: int, caplog: pytest.LogCaptureFixture
) -> None:
    mirror, _ = node.start()
    mirror.store(0)
    node.crash()
    data = Path(node.journal_path).read_bytes()
    assert data.startswith(b"offloadd-journal-3\n")
    # The same file as that version wrote it, but for its magic (v2 recorded crc32s).
    Path(node.journal_path).write_bytes(f"offloadd-journal-{version}\n".encode() + data[19:])
    with caplog.at_level("INFO", logger="offloadd.cache.journal"):
        assert node.replay() == []  # a cold start, never a wrong chunk
    assert any("earlier version" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert Path(node.journal_path).read_bytes().startswith(b"offloadd-journal-3\n")


def test_shard_sums_are_xxh3_64(node: Node) -> None:
    mirror, _ = node.start()
    assert mirror.store(0)
    sums = mirror.journal._sums[(NS, key_of(0))]
    assert sums == tuple(xxhash.xxh3_64_intdigest(shard_bytes(key_of(0), s)) for s in range(SHARDS))
    assert any(value >= 1 << 32 for value in sums)  # recorded, and replayed, with all 64 bits
    node.crash()
    assert [c.key for c in node.replay()] == [key_of(0)]


def test_a_journal_under_a_new_key_is_replaced(node: Node) -> None:
    mirror, _ = node.start()
    mirror.store(0)
    node.crash()
    os.unlink(node.journal_path + ".key")
    assert node.replay() == []


def _scenario(node: Node, io: FaultyIO, clock: Clock) -> Mirror:
    """Stores with evictions and removals; the clock moves so that recovery is tried."""
    mirror, _ = node.start(io=io, clock=clock, retry_seconds=1.0)
    for n in range(40):
        mirror.store(n)
        if n % 7 == 3:
            mirror.remove(n - 1)
        clock.now += 0.5
    return mirror


def _count_writes(node: Node) -> int:
    io = FaultyIO()
    _scenario(node, io, Clock(0.0))
    node.crash()
    for path in (node.journal_path, node.arena_path):
        os.unlink(path)
    return io.writes


@pytest.mark.parametrize("partial", [0, 3, 30])
def test_enospc_at_every_write_never_serves_a_wrong_byte(node: Node, partial: int) -> None:
    writes = _count_writes(node)
    assert writes > 40
    for position in range(1, writes + 1):
        io = FaultyIO([position], partial=partial)
        mirror = _scenario(node, io, Clock(0.0))
        live = mirror.committed_keys()
        node.crash()
        restored = {c.key for c in node.replay()}  # byte-exact, or it raises
        assert restored <= live, f"write {position}: restored a chunk the cache no longer had"
        if mirror.journal.failed == "":
            assert restored == live, f"write {position}: a healthy journal lost chunks"
        for path in (node.journal_path, node.arena_path):
            os.unlink(path)


def test_a_failed_append_refuses_commits_until_the_journal_is_rewritten(node: Node) -> None:
    full = [False]
    io = FaultyIO(full=lambda: full[0])
    clock = Clock(0.0)
    mirror, _ = node.start(io=io, clock=clock, retry_seconds=5.0)
    assert mirror.store(0)
    size = os.path.getsize(node.journal_path)
    full[0] = True
    assert not mirror.store(1)  # its commit append failed: taken back, extents freed
    assert os.path.getsize(node.journal_path) == size  # the torn bytes were truncated
    assert "No space left" in mirror.journal.failed
    used = mirror.cache.stats().used_bytes
    assert used == SHARDS * SHARD
    full[0] = False
    assert not mirror.store(2)  # space is back, but no rewrite was tried yet
    clock.now += 5
    assert mirror.store(3)  # the retry rewrote the journal; commits go on
    assert mirror.journal.failed == ""
    live = mirror.committed_keys()
    assert live == {key_of(0), key_of(3)}
    node.crash()
    assert {c.key for c in node.replay()} == live


def test_a_failed_tombstone_empties_the_journal(node: Node) -> None:
    full = [False]
    mirror, _ = node.start(io=FaultyIO(full=lambda: full[0]), clock=Clock(0.0))
    for n in range(8):  # the arena is full now
        assert mirror.store(n)
    full[0] = True
    mirror.store(8)  # evicts chunk 0: its tombstone cannot be written
    node.crash()
    assert node.replay() == []  # nothing, rather than chunk 0 over chunk 8's bytes


def test_a_failed_truncate_after_a_failed_append_removes_the_journal(node: Node) -> None:
    io = FaultyIO(fail_truncates=True)
    mirror, _ = node.start(io=io, clock=Clock(0.0))
    assert mirror.store(0)
    io.fail_writes = {io.writes + 1}
    assert not mirror.store(1)
    assert not os.path.exists(node.journal_path)
    node.crash()
    assert node.replay() == []


def test_a_failed_rewrite_at_start_leaves_no_stale_record(node: Node) -> None:
    mirror, _ = node.start()
    for n in range(3):
        mirror.store(n)
    node.crash()
    with open(node.arena_path, "r+b") as arena:  # chunk 0 no longer verifies
        arena.write(b"\xff" * 16)
    arena_obj = Arena(node.arena_path, ARENA_SIZE, unlink_on_close=False)
    try:
        full = FaultyIO(full=lambda: True)
        journal, chunks = Journal.open(node.journal_path, arena_obj, io=full)
        assert [c.key for c in chunks] == [key_of(1), key_of(2)]
        cache = ChunkCache(CAPACITY)
        cache.restore(chunks)
        assert not journal.compact(cache.committed_chunks())
        assert journal.failed
        journal.close()
    finally:
        arena_obj.close()
    assert node.replay() == []  # emptied: it could no longer be trusted to match the cache


def test_a_disk_backed_arena_is_synced_before_its_records(workdir: str) -> None:
    node = Node(os.path.join(workdir, "disk.arena"), os.path.join(workdir, "state", "d.journal"))
    io = FaultyIO()
    try:
        mirror, _ = node.start(io=io)
        assert node.arena is not None and not node.arena.memory_backed
        assert mirror.journal.durable
        synced: list[tuple[int, int]] = []
        real_sync = node.arena.sync

        def spy(offset: int, size: int) -> None:
            synced.append((offset, size))
            real_sync(offset, size)

        node.arena.sync = spy  # type: ignore[method-assign]
        fsyncs = io.fsyncs
        assert mirror.store(0)
        entry = mirror.cache.get(NS, key_of(0))
        assert entry is not None
        assert sorted(synced) == sorted(zip(entry.offsets, entry.sizes, strict=True))
        assert io.fsyncs > fsyncs
        node.crash()
        assert [c.key for c in node.replay()] == [key_of(0)]
    finally:
        node.crash()


def test_the_old_journal_beside_the_arena_is_removed(node: Node) -> None:
    legacy = node.arena_path + ".journal"
    Path(legacy).write_bytes(b"offloadd-journal-1\n" + bytes(24))
    try:
        assert node.replay() == []
        assert not os.path.exists(legacy)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(legacy)


def test_checksums_of_chunks_that_never_commit_are_forgotten(node: Node) -> None:
    mirror, _ = node.start()
    for n in range(3000):  # shard 0 only: each pending chunk is evicted by a later one
        reservation = mirror.cache.begin_store(NS, [key_of(n)], 0, lambda _k: (SHARD,) * SHARDS)
        mirror.journal.removed(reservation.evicted)
        mirror.journal.seal(reservation.writes)
        mirror.cache.finish_store(reservation.writes, ok=True)
    assert len(mirror.journal._pending) <= 1024 + 8
    assert mirror.cache.stats().committed == 0


def test_a_steps_commits_are_one_record_and_a_torn_one_drops_them_all(node: Node) -> None:
    mirror, _ = node.start()
    assert mirror.store(0)
    sizes = (SHARD,) * SHARDS
    keys = [key_of(n) for n in range(1, 7)]  # six chunks stored together, as one step's
    writes = []
    for shard in range(SHARDS):
        reservation = mirror.cache.begin_store(NS, keys, shard, lambda _key: sizes)
        assert not reservation.evicted and len(reservation.writes) == len(keys)
        for write in reservation.writes:
            mirror.arena.view(write.offset, write.size)[:] = shard_bytes(keys[write.index], shard)
        mirror.journal.seal(reservation.writes)
        writes += reservation.writes
    before = _records(node.journal_path)
    committed = mirror.cache.finish_store(writes, ok=True)
    assert len(committed) == len(keys)
    assert mirror.journal.committed(committed, mirror.cache.committed_chunks) == []
    ends = _records(node.journal_path)
    assert len(ends) == len(before) + 1  # one frame, one MAC, for the six
    node.crash()
    written = Path(node.journal_path).read_bytes()
    assert [c.key for c in node.replay()] == [key_of(0), *keys]
    # Torn inside that frame: none of the six comes back, the chunk before it does.
    Path(node.journal_path).write_bytes(written[: ends[-1] - 1])
    assert [c.key for c in node.replay(mismatched=None)] == [key_of(0)]

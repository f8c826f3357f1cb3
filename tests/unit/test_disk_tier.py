"""The disk tier against real files and a real arena: round trips, two-phase writes, LRU
within capacity, restarts, and every fault (corruption, truncation, ENOSPC, EIO)."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offloadd.cache.arena import Arena, memory_backed
from offloadd.checksum import checksum_of
from offloadd.settings import DiskSettings
from offloadd.tiers import chunkfile
from offloadd.tiers.base import ChunkAddress
from offloadd.tiers.disk import DiskTier

NS = "ns"
ARENA_SIZE = 4 << 20
UNALIGNED = (3000, 8192, 100)  # the files pad them; O_DIRECT goes through the bounce buffer
ALIGNED = (4096, 8192)  # at aligned offsets too: O_DIRECT moves them in place
FILE_SIZE = chunkfile.ALIGN + chunkfile.aligned(sum(UNALIGNED))  # one chunk's file
assert sum(ALIGNED) == chunkfile.aligned(sum(UNALIGNED))


@pytest.fixture
def arena() -> Iterator[Arena]:
    arena = Arena(f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena", ARENA_SIZE)
    yield arena
    arena.close()


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


class Chunks:
    """Chunks of random bytes placed one after the other in the arena's first half."""

    def __init__(self, arena: Arena, aligned: bool) -> None:
        self.arena = arena
        self.aligned = aligned
        self.next = 0
        self.next_target = ARENA_SIZE // 2
        self.bytes: dict[bytes, bytes] = {}

    def make(
        self, key: bytes, sizes: tuple[int, ...] | None = None, namespace: str = NS
    ) -> ChunkAddress:
        extents = []
        for size in sizes or (ALIGNED if self.aligned else UNALIGNED):
            self.next = self.place(self.next)
            data = os.urandom(size)
            self.arena.view(self.next, size)[:] = data
            extents.append((self.next, size))
            self.next += size + 64  # a gap, so extents are not contiguous
        assert self.next < ARENA_SIZE // 2
        self.bytes[key] = self.read(ChunkAddress(namespace, key, tuple(extents)))
        return ChunkAddress(namespace, key, tuple(extents))

    def target(self, chunk: ChunkAddress, sizes: tuple[int, ...] | None = None) -> ChunkAddress:
        """The same chunk at fresh extents in the arena's second half (zeroed)."""
        offset = self.next_target
        extents = []
        for size in sizes or tuple(s for _, s in chunk.extents):
            offset = self.place(offset)
            self.arena.view(offset, size)[:] = bytes(size)
            extents.append((offset, size))
            offset += size + 128
        assert offset <= ARENA_SIZE
        self.next_target = offset
        return ChunkAddress(chunk.namespace, chunk.key, tuple(extents))

    def place(self, offset: int) -> int:
        return chunkfile.aligned(offset) if self.aligned else offset

    def read(self, chunk: ChunkAddress) -> bytes:
        return b"".join(bytes(self.arena.view(o, s)) for o, s in chunk.extents)


@pytest.fixture(params=[False, True], ids=["unaligned", "aligned"])
def chunks(arena: Arena, request: pytest.FixtureRequest) -> Chunks:
    return Chunks(arena, bool(request.param))


def path_of(tier: DiskTier, chunk: ChunkAddress) -> Path:
    return Path(tier.path) / chunkfile.file_name(chunk.namespace, chunk.key)


def files_in(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def test_round_trip_multi_shard(tmp_path: Path, arena: Arena, chunks: Chunks, direct: bool) -> None:
    with DiskTier(str(tmp_path / "disk"), 1 << 20, direct_io=direct) as tier:
        assert tier.direct_io is direct  # tmp_path is on a disk here
        written = [chunks.make(b"a"), chunks.make(b"b", (4096,)), chunks.make(b"c", (1, 2, 3))]
        assert tier.put(written, arena).stored == [True, True, True]
        assert tier.contains(NS, [b"a", b"b", b"c", b"d"]) == [True, True, True, False]
        assert tier.contains("other", [b"a"]) == [False]
        targets = [chunks.target(c) for c in written]
        assert tier.get(targets, arena) == [True, True, True]
        for target in targets:
            assert chunks.read(target) == chunks.bytes[target.key]
        stats = tier.stats()
        assert stats.name == "disk" and stats.chunks == 3 and stats.errors == 0
        assert stats.bytes_written == stats.bytes_read == sum(c.nbytes for c in written)
        assert stats.used_bytes == sum(path_of(tier, c).stat().st_size for c in written)
        assert tier.get([ChunkAddress(NS, b"missing", ((0, 10),))], arena) == [False]
        assert tier.stats().errors == 0  # a miss is no error


def test_present_chunk_is_touched_not_rewritten(
    tmp_path: Path, arena: Arena, chunks: Chunks
) -> None:
    with DiskTier(str(tmp_path), 2 * FILE_SIZE) as tier:
        a, b = chunks.make(b"a"), chunks.make(b"b")
        tier.put([a, b], arena)
        inode = path_of(tier, a).stat().st_ino
        assert tier.put([a], arena).stored == [True]  # a is now the most recent
        assert path_of(tier, a).stat().st_ino == inode
        assert tier.put([chunks.make(b"c")], arena).evicted == [(NS, b"b")]


def test_a_chunk_is_visible_only_once_whole(
    tmp_path: Path, arena: Arena, chunks: Chunks, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    tier = DiskTier(str(tmp_path), 1 << 20, direct_io=direct)
    chunk = chunks.make(b"a")
    final = path_of(tier, chunk)
    seen: list[tuple[bool, bool, bool, int]] = []
    rename = os.rename

    def checked_rename(source: Any, target: Any) -> None:
        seen.append(
            (
                tier.contains(NS, [b"a"])[0],
                final.exists(),
                str(source).endswith(chunkfile.TEMP_SUFFIX),
                os.stat(source).st_size,
            )
        )
        rename(source, target)

    monkeypatch.setattr(os, "rename", checked_rename)
    with tier:
        assert tier.put([chunk], arena).stored == [True]
        assert seen == [(False, False, True, FILE_SIZE)]  # whole before the rename, hidden till it
        assert final.exists() and tier.contains(NS, [b"a"]) == [True]


def test_temp_files_of_a_killed_run_are_removed_at_open(
    tmp_path: Path, arena: Arena, chunks: Chunks
) -> None:
    tier = DiskTier(str(tmp_path), 1 << 20)
    kept, torn = chunks.make(b"kept"), chunks.make(b"torn")
    tier.put([kept, torn], arena)
    tier.close()
    # A run killed mid-write leaves <name>.tmp (here half of a real file) and no final name.
    final = path_of(tier, torn)
    temp = final.with_name(final.name + chunkfile.TEMP_SUFFIX)
    temp.write_bytes(final.read_bytes()[: FILE_SIZE // 2])
    final.unlink()
    with DiskTier(str(tmp_path), 1 << 20) as reopened:
        assert not temp.exists()
        assert reopened.contains(NS, [b"kept", b"torn"]) == [True, False]
        assert reopened.stats().chunks == 1 and reopened.stats().used_bytes == FILE_SIZE


def test_lru_eviction_within_capacity(tmp_path: Path, arena: Arena, chunks: Chunks) -> None:
    with DiskTier(str(tmp_path), 3 * FILE_SIZE) as tier:
        a, b, c, d = (chunks.make(k) for k in (b"a", b"b", b"c", b"d"))
        assert tier.put([a, b, c], arena).evicted == []
        assert tier.get([chunks.target(a)], arena) == [True]  # a hit makes a recent
        write = tier.put([d], arena)
        assert write.stored == [True] and write.evicted == [(NS, b"b")]
        assert not path_of(tier, b).exists()
        assert tier.contains(NS, [b"a", b"b", b"c", b"d"]) == [True, False, True, True]
        e, f = chunks.make(b"e"), chunks.make(b"f")
        assert tier.put([e, f], arena).evicted == [(NS, b"c"), (NS, b"a")]
        assert tier.stats().used_bytes == 3 * FILE_SIZE <= tier.capacity
        assert len(files_in(tmp_path)) == 3


def test_a_chunk_larger_than_the_capacity_is_refused(
    tmp_path: Path, arena: Arena, chunks: Chunks
) -> None:
    with DiskTier(str(tmp_path), FILE_SIZE - 1) as tier:
        write = tier.put([chunks.make(b"a")], arena)
        assert write.stored == [False] and write.evicted == []
        assert tier.stats().errors == 0 and files_in(tmp_path) == []


def test_restart_keeps_chunks_and_their_order(tmp_path: Path, arena: Arena, chunks: Chunks) -> None:
    tier = DiskTier(str(tmp_path), 1 << 20)
    written = [chunks.make(k) for k in (b"a", b"b", b"c")]
    tier.put(written, arena)
    tier.close()
    for age, chunk in zip((10, 30, 20), written, strict=True):  # b oldest, then c, then a
        mtime = path_of(tier, chunk).stat().st_mtime - age
        os.utime(path_of(tier, chunk), (mtime, mtime))
    with DiskTier(str(tmp_path), 1 << 20) as reopened:
        assert reopened.contains(NS, [b"a", b"b", b"c"]) == [True, True, True]
        targets = [chunks.target(c) for c in written]
        for target in targets:
            assert reopened.get([target], arena) == [True]
            assert chunks.read(target) == chunks.bytes[target.key]
    # Smaller now: the oldest by mtime go first (a, b and c were all touched by the gets).
    os.utime(path_of(tier, written[1]), (1, 1))
    with DiskTier(str(tmp_path), 2 * FILE_SIZE) as smaller:
        assert smaller.contains(NS, [b"a", b"b", b"c"]) == [True, False, True]
        assert not path_of(tier, written[1]).exists()


def test_bad_files_are_removed_at_open(tmp_path: Path, arena: Arena, chunks: Chunks) -> None:
    tier = DiskTier(str(tmp_path), 1 << 20)
    a, b = chunks.make(b"a"), chunks.make(b"b")
    tier.put([a, b], arena)
    tier.close()
    garbage = tmp_path / "00" / ("00" * 16)
    garbage.write_bytes(b"not a chunk file" * 300)
    # b's file under a's name: its header names another chunk.
    os.replace(path_of(tier, b), path_of(tier, a))
    with DiskTier(str(tmp_path), 1 << 20) as reopened:
        assert reopened.stats().chunks == 0
        assert files_in(tmp_path) == []


def test_files_of_the_previous_version_are_removed_at_open(
    tmp_path: Path, arena: Arena, chunks: Chunks
) -> None:
    tier = DiskTier(str(tmp_path), 1 << 20)
    a = chunks.make(b"a")
    tier.put([a], arena)
    tier.close()
    data = bytearray(path_of(tier, a).read_bytes())
    header = chunkfile.unpack_header(memoryview(data))
    payload = bytes(data[header.length : header.length + header.payload_length])
    assert header.payload_sum == xxhash.xxh3_64_intdigest(payload) == checksum_of(payload)
    data[4:6] = (1).to_bytes(2, "little")  # version 1 (crc32s)
    path_of(tier, a).write_bytes(bytes(data))
    with DiskTier(str(tmp_path), 1 << 20) as reopened:
        assert reopened.stats().chunks == 0
        assert files_in(tmp_path) == []


def corrupt_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: corrupt_byte(p, chunkfile.ALIGN + 5000), id="payload-byte"),
        pytest.param(lambda p: corrupt_byte(p, 10), id="header-byte"),
        pytest.param(lambda p: os.truncate(p, chunkfile.ALIGN + 4096), id="truncated-payload"),
        pytest.param(lambda p: os.truncate(p, 100), id="truncated-header"),
        pytest.param(lambda p: p.unlink(), id="missing"),
    ],
)
def test_a_damaged_file_is_never_served(
    tmp_path: Path,
    arena: Arena,
    chunks: Chunks,
    direct: bool,
    damage: Callable[[Path], None],
) -> None:
    with DiskTier(str(tmp_path), 1 << 20, direct_io=direct) as tier:
        a, b = chunks.make(b"a"), chunks.make(b"b")
        tier.put([a, b], arena)
        damage(path_of(tier, a))
        assert tier.get([chunks.target(a)], arena) == [False]
        assert not path_of(tier, a).exists()
        assert tier.contains(NS, [b"a"]) == [False]
        assert tier.stats().errors == 1 and tier.stats().chunks == 1
        assert tier.stats().used_bytes == FILE_SIZE
        target = chunks.target(b)
        assert tier.get([target], arena) == [True]  # the others are still served
        assert chunks.read(target) == chunks.bytes[b"b"]


def test_a_header_naming_another_chunk_is_refused(
    tmp_path: Path, arena: Arena, chunks: Chunks, direct: bool
) -> None:
    with DiskTier(str(tmp_path), 1 << 20, direct_io=direct) as tier:
        a, b = chunks.make(b"a"), chunks.make(b"b")
        tier.put([a, b], arena)
        os.replace(path_of(tier, b), path_of(tier, a))
        assert tier.get([chunks.target(a)], arena) == [False]
        assert tier.stats().errors == 1 and not path_of(tier, a).exists()


def test_shard_sizes_must_match(tmp_path: Path, arena: Arena, chunks: Chunks, direct: bool) -> None:
    with DiskTier(str(tmp_path), 1 << 20, direct_io=direct) as tier:
        a = chunks.make(b"a")
        tier.put([a], arena)
        other_split = chunks.target(a, (a.nbytes,))  # same total, other shards
        assert tier.get([other_split], arena) == [False]
        assert tier.stats().errors == 1 and tier.contains(NS, [b"a"]) == [False]


def test_a_full_disk_is_counted_logged_once_and_cleaned_up(
    tmp_path: Path,
    arena: Arena,
    chunks: Chunks,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    direct: bool,
) -> None:
    tier = DiskTier(str(tmp_path), 1 << 20, direct_io=direct)
    written = [chunks.make(k) for k in (b"a", b"b", b"c")]

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "writev", full)
        with caplog.at_level(logging.WARNING, logger="offloadd.tiers.disk"):
            write = tier.put(written, arena)
    assert write.stored == [False, False, False]
    stats = tier.stats()
    assert stats.errors == 3 and not stats.healthy and stats.chunks == 0 and stats.used_bytes == 0
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert "ENOSPC" in caplog.text
    assert files_in(tmp_path) == []  # no temp file left behind
    assert tier.contains(NS, [b"a"]) == [False]
    assert tier.put(written[:1], arena).stored == [True]  # space again: writes resume
    assert tier.stats().healthy
    tier.close()


def test_an_unreadable_file_is_dropped(
    tmp_path: Path,
    arena: Arena,
    chunks: Chunks,
    monkeypatch: pytest.MonkeyPatch,
    direct: bool,
) -> None:
    tier = DiskTier(str(tmp_path), 1 << 20, direct_io=direct)
    a = chunks.make(b"a")
    tier.put([a], arena)

    def failing(*args: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(os, "preadv", failing)
        patch.setattr(os, "pread", failing)
        assert tier.get([chunks.target(a)], arena) == [False]
    assert tier.stats().errors == 1 and tier.contains(NS, [b"a"]) == [False]
    tier.close()


def test_remove_and_clear_only_touch_their_chunks(
    tmp_path: Path, arena: Arena, chunks: Chunks
) -> None:
    with DiskTier(str(tmp_path), 1 << 20) as tier:
        mine = [chunks.make(k) for k in (b"a", b"b", b"c")]
        theirs = [chunks.make(k, namespace="other") for k in (b"a", b"b")]
        tier.put(mine + theirs, arena)
        tier.remove(NS, [b"a", b"zzz"])
        assert tier.contains(NS, [b"a", b"b"]) == [False, True]
        tier.clear(NS)
        assert tier.contains(NS, [b"b", b"c"]) == [False, False]
        assert tier.contains("other", [b"a", b"b"]) == [True, True]
        assert len(files_in(tmp_path)) == 2
        assert tier.stats().used_bytes == 2 * FILE_SIZE
        targets = [chunks.target(c) for c in theirs]
        assert tier.get(targets[:1], arena) == [True]


def test_direct_io_refused_falls_back_to_buffered(
    tmp_path: Path, arena: Arena, chunks: Chunks, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tmpfs refuses O_DIRECT before Linux 6.6 (EINVAL); newer kernels accept it, so refuse
    # it here the way they would.
    real_open = os.open
    direct_opens: list[int] = []

    def no_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            direct_opens.append(flags)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with DiskTier(f"/dev/shm/offloadd-test-disk-{uuid.uuid4().hex[:12]}", 1 << 20) as tier:
        try:
            assert not tier.direct_io
            assert len(direct_opens) == 1  # the probe at open, then never again
            a = chunks.make(b"a")
            target = chunks.target(a)
            assert tier.put([a], arena).stored == [True]
            assert tier.get([target], arena) == [True]
            assert chunks.read(target) == chunks.bytes[b"a"]
            assert len(direct_opens) == 1 and tier.stats().errors == 0
        finally:
            shutil.rmtree(tier.path)


def test_direct_io_is_used_on_a_disk(
    tmp_path: Path, arena: Arena, chunks: Chunks, monkeypatch: pytest.MonkeyPatch
) -> None:
    if memory_backed(str(tmp_path)):
        pytest.skip("tmp_path is in memory here")
    real_open = os.open
    flags_seen: list[int] = []

    def spy(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        flags_seen.append(flags)
        return real_open(path, flags, *args, **kwargs)

    with DiskTier(str(tmp_path), 1 << 20) as tier:
        assert tier.direct_io
        a = chunks.make(b"a")
        monkeypatch.setattr(os, "open", spy)
        tier.put([a], arena)
        tier.get([chunks.target(a)], arena)
    assert len(flags_seen) == 2 and all(f & os.O_DIRECT for f in flags_seen)


def test_settings_and_default_capacity(tmp_path: Path) -> None:
    directory = tmp_path / "sub" / "disk"
    with DiskTier.from_settings(DiskSettings(path=str(directory), direct_io=False)) as tier:
        assert directory.stat().st_mode & 0o777 == 0o700
        assert not tier.direct_io
        info = os.statvfs(directory)
        half = info.f_bavail * info.f_frsize // 2
        assert abs(tier.capacity - half) < 64 << 20  # other writers share this disk
        tier.close()  # idempotent


@pytest.mark.parametrize("threads", [1, 4])
def test_one_batch_larger_than_the_capacity(
    tmp_path: Path, arena: Arena, chunks: Chunks, threads: int
) -> None:
    with DiskTier(str(tmp_path), 3 * FILE_SIZE, threads=threads) as tier:
        old = chunks.make(b"old")
        tier.put([old], arena)
        batch = [chunks.make(k) for k in (b"a", b"b", b"c", b"d")]
        write = tier.put([batch[0], *batch, batch[1]], arena)
        # Room for three: "old" goes, a-c are written, d finds no room (a-c are in flight).
        assert write.stored == [True, True, True, True, False, True]
        assert write.evicted == [(NS, b"old")]
        assert tier.contains(NS, [b"a", b"b", b"c", b"d"]) == [True, True, True, False]
        assert tier.stats().used_bytes == 3 * FILE_SIZE == len(files_in(tmp_path)) * FILE_SIZE
        targets = [chunks.target(c) for c in batch[:3]]
        assert tier.get(targets, arena) == [True, True, True]
        assert [chunks.read(t) for t in targets] == [chunks.bytes[c.key] for c in batch[:3]]


def test_contains_and_stats_from_another_thread_during_writes(
    tmp_path: Path, arena: Arena, chunks: Chunks
) -> None:
    written = [chunks.make(bytes([k])) for k in range(20)]
    keys = [c.key for c in written]
    answers: list[list[bool]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            answers.append(tier.contains(NS, keys))
            tier.stats()

    with DiskTier(str(tmp_path), 1 << 20) as tier:
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            assert all(tier.put(written, arena).stored)
        finally:
            done.set()
            watcher.join()
        answers.append(tier.contains(NS, keys))
    # Each chunk, once seen, stays seen: visibility only ever grows during the writes.
    for before, after in itertools.pairwise(answers):
        assert all(a <= b for a, b in zip(before, after, strict=True))
    assert answers[-1] == [True] * 20


def test_a_short_write_is_a_failed_one(
    tmp_path: Path, arena: Arena, chunks: Chunks, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    tier = DiskTier(str(tmp_path), 1 << 20, direct_io=direct)
    real_writev = os.writev

    def short(fd: int, parts: list[Any]) -> int:
        return real_writev(fd, [memoryview(parts[0])[: chunkfile.ALIGN]])  # a filling disk

    monkeypatch.setattr(os, "writev", short)
    assert tier.put([chunks.make(b"a")], arena).stored == [False]
    assert tier.stats().errors == 1 and files_in(tmp_path) == []
    tier.close()


class Model:
    """What the tier should hold: LRU by whole file sizes, room made in chunk order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.files: dict[tuple[str, bytes], int] = {}  # insertion order: least recent first

    def touch(self, name: tuple[str, bytes]) -> None:
        self.files[name] = self.files.pop(name)

    def put(self, batch: list[ChunkAddress]) -> tuple[list[bool], list[tuple[str, bytes]]]:
        stored: list[bool] = []
        evicted: list[tuple[str, bytes]] = []
        planned: dict[tuple[str, bytes], int] = {}
        used = sum(self.files.values())
        pending = 0  # this batch's bytes, not yet files
        for chunk in batch:
            name = (chunk.namespace, chunk.key)
            size = chunkfile.ALIGN + chunkfile.aligned(chunk.nbytes)
            if name in self.files:
                self.touch(name)
                stored.append(True)
            elif name in planned:
                stored.append(stored[planned[name]])
            elif pending + size > self.capacity:  # no room even with every file evicted
                stored.append(False)
            else:
                while used + size > self.capacity:
                    victim = next(iter(self.files))
                    used -= self.files.pop(victim)
                    evicted.append(victim)
                used += size
                pending += size
                planned[name] = len(stored)
                stored.append(True)
        for name in planned:
            chunk = next(c for c in batch if (c.namespace, c.key) == name)
            self.files[name] = chunkfile.ALIGN + chunkfile.aligned(chunk.nbytes)
        return stored, evicted


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    threads=st.sampled_from([1, 4]),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "remove", "clear"]),
            st.lists(st.tuples(st.sampled_from(["x", "y"]), st.integers(0, 5)), max_size=5),
        ),
        max_size=12,
    ),
)
def test_the_tier_against_a_model(
    tmp_path_factory: pytest.TempPathFactory,
    threads: int,
    steps: list[tuple[str, list[tuple[str, int]]]],
) -> None:
    sizes = {k: (4096 * (1 + k % 3), 1000 * k) for k in range(6)}  # 2-6 pages of file each

    def address(namespace: str, k: int) -> ChunkAddress:
        base = (k + 6 * (namespace == "y")) << 15  # a 32 KiB slot per chunk, no overlaps
        extents = ((base, sizes[k][0]), (base + 16384, sizes[k][1]))
        return ChunkAddress(namespace, bytes([k]), extents)

    arena = Arena(f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena", 1 << 20)
    directory = tmp_path_factory.mktemp("model")
    model = Model(7 * chunkfile.ALIGN)
    try:
        with DiskTier(str(directory), model.capacity, threads=threads) as tier:
            for op, names in steps:
                batch = [address(ns, k) for ns, k in names]
                if op == "put":
                    for chunk in batch:  # a chunk's bytes: its name, so any read is checkable
                        for offset, size in chunk.extents:
                            arena.view(offset, size)[:] = (chunk.namespace.encode() + chunk.key) * (
                                size // 2
                            )
                    write = tier.put(batch, arena)
                    assert (write.stored, write.evicted) == model.put(batch)
                elif op == "get":
                    targets = [
                        ChunkAddress(
                            c.namespace, c.key, tuple((o + (1 << 19), s) for o, s in c.extents)
                        )
                        for c in batch
                    ]
                    hits = tier.get(targets, arena)
                    assert hits == [(c.namespace, c.key) in model.files for c in batch]
                    for target, hit in zip(targets, hits, strict=True):
                        if hit:
                            model.touch((target.namespace, target.key))
                            for offset, size in target.extents:
                                expected = (target.namespace.encode() + target.key) * (size // 2)
                                assert bytes(arena.view(offset, size)) == expected
                elif op == "remove":
                    for ns in ("x", "y"):
                        tier.remove(ns, [bytes([k]) for n, k in names if n == ns])
                    for ns, k in names:
                        model.files.pop((ns, bytes([k])), None)
                else:
                    for ns in {n for n, _ in names}:
                        tier.clear(ns)
                        model.files = {n: s for n, s in model.files.items() if n[0] != ns}
                assert list(tier._files) == list(model.files)  # the LRU order itself
                assert tier.stats().used_bytes == sum(model.files.values())
                assert tier.stats().errors == 0
        with DiskTier(str(directory), model.capacity) as reopened:
            assert set(reopened._files) == set(model.files)
    finally:
        arena.close()


def test_a_full_disk_at_open_still_opens(
    tmp_path: Path, arena: Arena, chunks: Chunks, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def full(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", full)
        tier = DiskTier(str(tmp_path), 1 << 20)
        assert tier.put([chunks.make(b"a")], arena).stored == [False]
    assert tier.stats().errors == 1 and files_in(tmp_path) == []
    assert tier.put([chunks.make(b"b")], arena).stored == [True]
    tier.close()

"""vLLM's canonical layout in the pure core: one shard that several writers fill together.

The cache keeps a canonical chunk as one shard; every rank of the storing engine writes its
own fragments of it, and the chunk is visible only when all of them have. The journal's
checksum of such a shard is the one taken after every writer's bytes were in place. A rank's
canonical page must be tiled exactly by its runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from offloadd.cache import journal as journal_module
from offloadd.cache.arena import Arena
from offloadd.cache.index import ChunkCache
from offloadd.cache.journal import Journal
from offloadd.checksum import checksum
from offloadd.transfer.plan import GroupLayout, group_layouts, group_spans
from protocol.config import OffloadingGroupConfig
from protocol.handles import CanonicalPage, KVRegion, ShmHandle, region_problem

A = 4096
NS = "ns"


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def one_shard(_key: bytes) -> tuple[int, ...]:
    return (2 * A,)


def test_a_canonical_chunk_is_visible_only_when_every_writer_wrote() -> None:
    cache = ChunkCache(16 * A)
    w0 = cache.begin_store(NS, [key(0)], 0, one_shard, writers=2)
    w1 = cache.begin_store(NS, [key(0)], 1, one_shard, writers=2)
    (a,), (b,) = w0.writes, w1.writes
    assert (a.shard, a.part, b.shard, b.part) == (0, 0, 0, 1)
    assert (a.offset, a.size) == (b.offset, b.size) == (a.entry.offsets[0], 2 * A)  # one extent
    assert cache.stats().used_bytes == 2 * A
    assert cache.finish_store(w1.writes, ok=True) == []
    assert cache.lookup(NS, [key(0)]).hits == 0  # writer 0 has not written yet
    assert cache.finish_store(w0.writes, ok=True) == [a.entry]
    assert cache.lookup(NS, [key(0)]).hits == 1
    # Committed: nobody writes it again.
    assert cache.begin_store(NS, [key(0)], 0, one_shard, writers=2).skipped == [0]


def test_writers_of_another_count_leave_a_pending_chunk_to_its_writers() -> None:
    cache = ChunkCache(16 * A)
    first = cache.begin_store(NS, [key(0)], 0, one_shard, writers=2)
    # A TP=1 engine of the same canonical namespace: the TP=2 engine's ranks finish it.
    assert cache.begin_store(NS, [key(0)], 0, one_shard, writers=1).skipped == [0]
    # The same writer twice: skipped too.
    assert cache.begin_store(NS, [key(0)], 0, one_shard, writers=2).skipped == [0]
    cache.finish_store(first.writes, ok=False)  # a failed copy: nothing written
    # Nobody is writing it now: an engine of any size may take it.
    single = cache.begin_store(NS, [key(0)], 0, one_shard, writers=1)
    assert len(single.writes) == 1
    (entry,) = cache.finish_store(single.writes, ok=True)
    assert entry.committed


def test_abandoned_writer_drops_the_pending_chunk() -> None:
    cache = ChunkCache(16 * A)
    w0 = cache.begin_store(NS, [key(0)], 0, one_shard, writers=2)
    w1 = cache.begin_store(NS, [key(0)], 1, one_shard, writers=2)
    cache.abandon(w1.writes)  # rank 1's session went away mid-copy
    assert cache.finish_store(w1.writes, ok=True) == []
    assert cache.finish_store(w0.writes, ok=True) == []
    assert cache.get(NS, key(0)) is None
    assert cache.stats().used_bytes == 0


def test_writer_index_out_of_range_raises() -> None:
    cache = ChunkCache(16 * A)
    with pytest.raises(ValueError, match="writer 2 out of range"):
        cache.begin_store(NS, [key(0)], 2, one_shard, writers=2)
    with pytest.raises(ValueError, match="bad shard sizes"):
        cache.begin_store(NS, [key(0)], 0, lambda _key: (A, A), writers=2)


@pytest.fixture
def arena_path() -> Iterator[str]:
    path = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    yield path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def test_the_journal_keeps_the_checksum_taken_after_every_writer(
    arena_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tempfile.mkdtemp(prefix="od-canon-", dir="/tmp")
    path = os.path.join(directory, "journal")
    arena = Arena(arena_path, 16 * A, unlink_on_close=False)
    journal, _ = Journal.open(path, arena)
    journal.compact([])  # what the daemon does at start: the file then takes records
    cache = ChunkCache(16 * A)
    w0 = cache.begin_store(NS, [key(0)], 0, one_shard, writers=2)
    w1 = cache.begin_store(NS, [key(0)], 1, one_shard, writers=2)
    (write,) = w0.writes
    arena.view(write.offset, A)[:] = b"\x01" * A  # writer 0's half
    real = checksum
    nested: list[int] = []

    def slow_checksum(address: int, size: int) -> int:
        value = real(address, size)
        if not nested:  # writer 0's seal, still running: writer 1 copies and seals meanwhile
            nested.append(1)
            arena.view(write.offset + A, A)[:] = b"\x02" * A
            journal.seal(w1.writes)
        return value  # writer 0's checksum, taken before writer 1's bytes: stale

    monkeypatch.setattr(journal_module, "checksum", slow_checksum)
    journal.seal(w0.writes)  # started first, ends last: its stale checksum must not win
    monkeypatch.undo()
    assert nested
    cache.finish_store(w0.writes, ok=True)
    committed = cache.finish_store(w1.writes, ok=True)
    assert journal.committed(committed, cache.committed_chunks) == []
    journal.close()
    arena.close()
    # A restart verifies every chunk's bytes against its checksum: this one still matches.
    arena = Arena(arena_path, 16 * A, unlink_on_close=False)
    try:
        again, chunks = Journal.open(path, arena)
        again.close()
    finally:
        arena.close()
        shutil.rmtree(directory, ignore_errors=True)
    assert [chunk.key for chunk in chunks] == [key(0)]


def _region(page: int, canonical: CanonicalPage | None) -> KVRegion:
    return KVRegion(
        handle=ShmHandle(path="/dev/shm/x", offset=0, size=64 * page, fd=0),
        num_blocks=64,
        page_size=page,
        block_stride=page,
        layer_names=("l0",),
        canonical=canonical,
    )


def test_canonical_runs_must_tile_the_page_inside_the_canonical_page() -> None:
    # A TP=2 rank of a token-major page: 4 tokens of 8 bytes, every other 8 canonically.
    good = CanonicalPage(page_size=64, runs=((0, 8, 8, 4, 8, 16),), agnostic=True)
    assert region_problem(_region(32, good)) is None
    gap = CanonicalPage(page_size=64, runs=((0, 8, 8, 3, 8, 16),))
    assert "cover 24 bytes" in (region_problem(_region(32, gap)) or "")
    past = CanonicalPage(page_size=64, runs=((0, 16, 8, 4, 8, 16),))
    assert "past the canonical page" in (region_problem(_region(32, past)) or "")


def test_canonical_spans_put_each_fragment_at_its_canonical_place() -> None:
    page = CanonicalPage(page_size=64, runs=((0, 8, 8, 4, 8, 16),), agnostic=True)
    region = _region(32, page)
    (layout,) = group_layouts(
        [region], [OffloadingGroupConfig(tokens_per_block=4, layer_names=("l0",))]
    )
    assert layout == GroupLayout((0,), (32,), (64,))
    assert layout.shard_bytes(2) == 128  # the whole canonical chunk: 2 canonical pages
    spans = group_spans(layout, [region], [(1000, 64 * 32)], blocks_per_chunk=2)
    assert [(s.base, s.page, s.part, s.step) for s in spans] == [
        (1000 + 8 * i, 8, 8 + 16 * i, 64) for i in range(4)
    ]

"""Copies never touch two pinned pieces of the arena: allocation and copy merging, at plan level.

The arena is registered with cudaHostRegister in pieces of 64 GiB cut at fixed offsets, and one
DMA touching two registrations fails. A fake 256 GiB arena (pure arithmetic: no memory behind
the addresses) is filled through ``ChunkCache`` as the cuda daemon builds it, the daemon's
planner (``chunk_copies``) plans a store of every chunk in arena order from consecutive GPU
blocks (the worst case for merging), and the engine's merge (``move_arrays``) must leave every
copy inside one piece.
"""

from __future__ import annotations

import hashlib

import pytest

from offloadd.cache.index import ChunkCache, RestoredChunk, ShardWrite
from offloadd.transfer.batch import HostPieces, move_arrays
from offloadd.transfer.pinning import DEFAULT_PIECE
from offloadd.transfer.plan import chunk_copies
from offloadd.transfer.types import Direction, Span, Triple

GiB = 1 << 30
ARENA = 0x7E00_0000_0000  # where the fake arena is "mapped"
GPU = 0x7F00_0000_0000  # a rank's packed KV region: one row of every layer per block
LAYERS = 80
BLOCKS_PER_CHUNK = 16


def keys(count: int, salt: str) -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() + bytes(4) for i in range(count)]


def piece_of(address: int) -> int:
    return (address - ARENA) // DEFAULT_PIECE


@pytest.mark.parametrize("page_kib", [18, 40, 61, 64])
def test_a_full_256_gib_arena_plans_no_copy_across_a_pinned_piece(page_kib: int) -> None:
    assert 64 * GiB == DEFAULT_PIECE
    row = page_kib * 1024 * LAYERS  # packed layout: stride == page, blocks back to back
    shard = row * BLOCKS_PER_CHUNK
    cache = ChunkCache(256 * GiB, boundary=DEFAULT_PIECE)
    writes: list[ShardWrite] = []
    while True:
        reservation = cache.begin_store(
            "ns", keys(1024, f"{page_kib}-{len(writes)}-"), 0, lambda _: (shard,)
        )
        writes += reservation.writes
        if reservation.refused:
            break
    assert len(writes) >= (256 * GiB // shard) - 4  # only a tail per piece is lost
    for write in writes:
        assert piece_of(ARENA + write.offset) == piece_of(ARENA + write.offset + write.size - 1)

    # One store of every chunk, in arena order, from consecutive GPU blocks: wherever two
    # shards touch, both sides of the copy are contiguous across them.
    spans = (Span(GPU, row, row, 0),)
    moves: list[Triple] = []
    block = 0
    for write in sorted(writes, key=lambda w: w.offset):
        ids = list(range(block, block + BLOCKS_PER_CHUNK))
        chunk_copies(spans, ids, ARENA + write.offset, moves)
        block += BLOCKS_PER_CHUNK
    merged = move_arrays(moves, Direction.STORE, HostPieces(ARENA, DEFAULT_PIECE)).triples()
    for _src, dst, nbytes in merged:
        assert piece_of(dst) == piece_of(dst + nbytes - 1), (hex(dst), nbytes)
    assert sum(n for *_, n in merged) == shard * len(writes)
    if DEFAULT_PIECE % shard == 0:
        # Shards tile the pieces exactly, so without the cut a merge does run across it.
        unsplit = move_arrays(moves, Direction.STORE).triples()
        assert any(piece_of(d) != piece_of(d + n - 1) for _, d, n in unsplit)


def test_a_shard_larger_than_a_piece_is_refused_not_straddled() -> None:
    cache = ChunkCache(256 * GiB, boundary=DEFAULT_PIECE)
    reservation = cache.begin_store("ns", keys(1, "big"), 0, lambda _: (65 * GiB,))
    assert reservation.refused == [0] and reservation.writes == []


def test_restore_skips_a_chunk_written_across_a_cut_by_a_daemon_without_cuts() -> None:
    cache = ChunkCache(256 * GiB, boundary=DEFAULT_PIECE)
    kept = cache.restore(
        [
            RestoredChunk("ns", b"a" * 36, (64 * GiB - 4096,), (8192,)),  # straddles the cut
            RestoredChunk("ns", b"b" * 36, (64 * GiB,), (8192,)),
        ]
    )
    assert kept == 1
    assert cache.get("ns", b"b" * 36) is not None and cache.get("ns", b"a" * 36) is None

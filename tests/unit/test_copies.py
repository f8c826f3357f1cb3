"""The daemon's array planner (``chunk_copies`` into ``Copies``) moves exactly what the tuple
planner and the reference plan move, and reads back as a sequence of triples."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offloadd.transfer.batch import move_arrays
from offloadd.transfer.copies import ChunkRuns, Copies
from offloadd.transfer.plan import GroupLayout, chunk_copies, group_spans
from offloadd.transfer.types import Direction, Span
from protocol.handles import KVRegion
from tests.oracles import reference_pairs
from tests.strategies import plan_cases


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(plan_cases(), min_size=1, max_size=3))
def test_arrays_plan_the_same_copies_as_tuples(
    chunks: list[tuple[list[KVRegion], GroupLayout, list[int], int, int, bool]],
) -> None:
    load = chunks[0][-1]
    direction = Direction.LOAD if load else Direction.STORE
    tuples: list[tuple[int, int, int]] = []
    arrays = Copies()
    for index, (regions, layout, ids, bpc, first, _load) in enumerate(chunks):
        bases = [100_000 * (i + 1) + index * 10_000_000 for i in range(len(regions))]
        mappings = [(base, r.handle.size) for base, r in zip(bases, regions, strict=True)]
        spans = group_spans(layout, regions, mappings, blocks_per_chunk=bpc)
        shard = 1_000_000_000 + index * 1_000_000
        expected = chunk_copies(spans, ids, shard, tuples, first_sub_block=first, load=load)
        before = len(arrays)
        total = chunk_copies(spans, ids, shard, arrays, first_sub_block=first, load=load)
        assert total == expected
        planned = {(s + i, d + i) for s, d, n in arrays[before:] for i in range(n)}
        assert planned == reference_pairs(regions, layout, ids, bpc, first, load, bases, shard)
    assert move_arrays(arrays, direction).triples() == move_arrays(tuples, direction).triples()


def test_copies_read_back_as_triples() -> None:
    spans = (Span(1000, 128, 64, 0), Span(9000, 64, 64, 64 * 2))
    copies = Copies()
    assert len(copies) == 0 and list(copies) == [] and not copies
    assert chunk_copies(spans, [3, 1], 50_000, copies) == 2 * 128
    assert chunk_copies(spans, [0], 60_000, copies, first_sub_block=1, load=True) == 128
    expected = [
        (1000 + 3 * 128, 50_000, 64),
        (1000 + 1 * 128, 50_064, 64),
        (9000 + 3 * 64, 50_128, 64),
        (9000 + 1 * 64, 50_192, 64),
        (60_064, 1000, 64),  # a load: shard -> region, from sub-block 1
        (60_192, 9000, 64),
    ]
    assert list(copies) == expected
    assert len(copies) == 6 and copies[0] == expected[0] and copies[-1] == expected[-1]
    assert copies[1:3] == expected[1:3]
    assert chunk_copies(spans, [], 70_000, copies) == 0 and len(copies) == 6


@settings(max_examples=200, deadline=None, database=None)
@given(plan_cases(), st.integers(1, 4))
def test_a_run_of_chunks_plans_as_chunk_after_chunk(
    case: tuple[list[KVRegion], GroupLayout, list[int], int, int, bool], chunks: int
) -> None:
    regions, layout, ids, bpc, first, load = case
    bases = [100_000 * (i + 1) for i in range(len(regions))]
    mappings = [(base, r.handle.size) for base, r in zip(bases, regions, strict=True)]
    spans = group_spans(layout, regions, mappings, blocks_per_chunk=bpc)
    # Chunk c takes the drawn ids shifted by c (still in range: num_blocks is ample below).
    per_chunk = [[block + c for block in ids] for c in range(chunks)]
    if any(block >= regions[0].num_blocks for run in per_chunk for block in run):
        per_chunk = [ids] * chunks
    addresses = [1_000_000_000 + c * 1_000_000 for c in range(chunks)]
    one_by_one = Copies()
    total = sum(
        one_by_one.add_chunk(spans, run, address, first_sub_block=first, load=load)
        for run, address in zip(per_chunk, addresses, strict=True)
    )
    run = Copies()
    flat = [block for chunk in per_chunk for block in chunk]
    assert run.add_chunks(spans, flat, addresses, first_sub_block=first, load=load) == total
    assert list(run) == list(one_by_one)


def test_a_run_needs_equal_chunks() -> None:
    spans = (Span(1000, 128, 64, 0),)
    copies = Copies()
    assert copies.add_chunks(spans, [], []) == 0
    with pytest.raises(ValueError, match="3 block ids for 2 chunks of equal length"):
        copies.add_chunks(spans, [0, 1, 2], [5000, 6000])
    assert len(copies) == 0


def test_chunk_runs_plan_their_chunks_in_order_and_join_across_jobs() -> None:
    spans = (Span(1000, 128, 64, 0), Span(9000, 64, 64, 64 * 2))
    other = (Span(20_000, 128, 64, 0),)
    first, second = ChunkRuns(load=True), ChunkRuns(load=True)
    assert not first and first.nbytes == 0
    first.add(spans, [3, 1], 50_000)
    first.add(spans, [0, 2], 60_000)  # alike: the same run
    first.add(spans, [], 65_000)  # nothing to copy
    second.add(spans, [4, 5], 70_000)  # alike the first's last run: merged when joined
    second.add(other, [1], 80_000, first_sub_block=1)
    assert first and first.nbytes == 2 * 2 * 128 and second.nbytes == 2 * 128 + 64
    one_by_one = Copies()
    for ids, address in (([3, 1], 50_000), ([0, 2], 60_000), ([4, 5], 70_000)):
        one_by_one.add_chunk(spans, ids, address, load=True)
    one_by_one.add_chunk(other, [1], 80_000, first_sub_block=1, load=True)
    joined = ChunkRuns.joined([first, second])
    assert joined.nbytes == first.nbytes + second.nbytes
    assert list(joined.copies()) == list(one_by_one)
    assert list(first.copies()) == list(one_by_one)[: len(first.copies())]
    assert len(joined._runs) == 2  # the three chunks alike are one add_chunks
    with pytest.raises(ValueError, match="cannot be joined"):
        ChunkRuns.joined([first, ChunkRuns(load=False)])

"""The fast planning path copies exactly what the reference ``plan_chunk`` says."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from offloadd.transfer.plan import GroupLayout, chunk_copies, group_spans
from protocol.handles import KVRegion, ShmHandle
from tests.oracles import reference_pairs
from tests.strategies import plan_cases


@settings(max_examples=300, deadline=None, database=None)
@given(plan_cases())
def test_fast_path_moves_the_same_bytes(
    case: tuple[list[KVRegion], GroupLayout, list[int], int, int, bool],
) -> None:
    regions, layout, ids, bpc, first, load = case
    bases = [100_000 * (index + 1) for index in range(len(regions))]
    shard = 10_000_000
    spans = group_spans(
        layout,
        regions,
        [(base, region.handle.size) for base, region in zip(bases, regions, strict=True)],
        blocks_per_chunk=bpc,
    )
    out: list[tuple[int, int, int]] = []
    total = chunk_copies(spans, ids, shard, out, first_sub_block=first, load=load)
    fast = {(src + i, dst + i) for src, dst, nbytes in out for i in range(nbytes)}
    assert fast == reference_pairs(regions, layout, ids, bpc, first, load, bases, shard)
    assert total == sum(nbytes for _, _, nbytes in out)


def test_consecutive_unpadded_blocks_merge_into_one_copy_per_region() -> None:
    region = KVRegion(ShmHandle("/dev/shm/r", 0, 8 * 64), 8, 64, 64, ("l",))
    spans = group_spans(GroupLayout((0,), (64,)), [region], [(1000, 512)], blocks_per_chunk=4)
    out: list[tuple[int, int, int]] = []
    chunk_copies(spans, [2, 3, 4, 5], 50_000, out)
    assert out == [(1000 + 2 * 64, 50_000, 256)]


def test_spans_refuse_a_mapping_smaller_than_the_geometry() -> None:
    region = KVRegion(ShmHandle("/dev/shm/r", 0, 8 * 64), 8, 64, 64, ("l",))
    with pytest.raises(ValueError, match="exceed its mapping"):
        group_spans(GroupLayout((0,), (64,)), [region], [(1000, 100)], blocks_per_chunk=1)

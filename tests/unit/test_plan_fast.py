"""The daemon's fast planning path copies exactly what the reference ``plan_chunk`` says."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offloadd.transfer.plan import (
    GroupLayout,
    chunk_copies,
    group_spans,
    plan_chunk,
)
from protocol.handles import KVRegion, ShmHandle


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[KVRegion], GroupLayout, list[int], int, int, bool]:
    bpc = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(bpc, 24))
    regions = []
    for index in range(draw(st.integers(1, 3))):
        page = draw(st.sampled_from([8, 16, 64]))
        stride = page + draw(st.sampled_from([0, 0, 8, 24]))
        size = (num_blocks - 1) * stride + page
        regions.append(
            KVRegion(ShmHandle(f"/dev/shm/r{index}", 0, size), num_blocks, page, stride, ("l",))
        )
    layout = GroupLayout(tuple(range(len(regions))), tuple(region.page_size for region in regions))
    first = draw(st.integers(0, bpc - 1))
    ids = draw(
        st.one_of(
            st.lists(st.integers(0, num_blocks - 1), min_size=bpc - first, max_size=bpc - first),
            st.integers(0, num_blocks - bpc).map(lambda start: list(range(start, start + bpc))),
        )
    )
    ids = ids[: bpc - first]
    return regions, layout, ids, bpc, first, draw(st.booleans())


def _reference(
    regions: list[KVRegion],
    layout: GroupLayout,
    ids: list[int],
    bpc: int,
    first: int,
    load: bool,
    bases: list[int],
    shard: int,
) -> set[tuple[int, int]]:
    """Every (src byte, dst byte) pair the reference plan copies."""
    pairs = set()
    for move in plan_chunk(layout, regions, ids, blocks_per_chunk=bpc, first_sub_block=first):
        for i in range(move.nbytes):
            region_byte = bases[move.region] + move.region_offset + i
            shard_byte = shard + move.shard_offset + i
            pairs.add((shard_byte, region_byte) if load else (region_byte, shard_byte))
    return pairs


@settings(max_examples=300, deadline=None, database=None)
@given(cases())
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
    assert fast == _reference(regions, layout, ids, bpc, first, load, bases, shard)
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

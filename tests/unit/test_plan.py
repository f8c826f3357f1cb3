"""The reference plan (``tests.oracles.plan_chunk``) and ``offloadd.transfer.plan``'s layouts:
every byte of a chunk against a byte-by-byte reference."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offloadd.transfer.plan import GroupLayout, block_id_problem, group_layouts
from protocol.config import OffloadingGroupConfig
from protocol.handles import KVRegion, ShmHandle
from tests.oracles import Move, plan_chunk

PAD = 0xEE  # fills the padding between pages; must never reach a shard


def make_region(
    index: int, page: int, stride: int, num_blocks: int, layers: tuple[str, ...] = ()
) -> KVRegion:
    return KVRegion(
        handle=ShmHandle(path=f"/dev/shm/r{index}", offset=0, size=num_blocks * stride),
        num_blocks=num_blocks,
        page_size=page,
        block_stride=stride,
        layer_names=layers or (f"layer.{index}",),
    )


def region_bytes(region: KVRegion, index: int) -> bytearray:
    """Page bytes are (index, block, byte) patterns that are never PAD; padding is PAD."""
    data = bytearray([PAD]) * (region.num_blocks * region.block_stride)
    for block in range(region.num_blocks):
        start = block * region.block_stride
        for j in range(region.page_size):
            data[start + j] = (index * 89 + block * 31 + j * 7) % 0xEE
    return data


def reference(
    layout: GroupLayout,
    regions: Sequence[KVRegion],
    block_ids: Sequence[int],
    blocks_per_chunk: int,
    first_sub_block: int,
) -> dict[int, tuple[int, int]]:
    """Shard offset -> (region, region offset), one byte at a time."""
    where: dict[int, tuple[int, int]] = {}
    part_offset = 0
    for r in layout.regions:
        page = regions[r].page_size
        stride = regions[r].block_stride
        for i, block in enumerate(block_ids):
            sub_block = first_sub_block + i
            for byte in range(page):
                where[part_offset + sub_block * page + byte] = (r, block * stride + byte)
        part_offset += page * blocks_per_chunk
    return where


def store(moves: Sequence[Move], memory: Sequence[bytearray], shard: bytearray) -> None:
    for m in moves:
        shard[m.shard_offset : m.shard_offset + m.nbytes] = memory[m.region][
            m.region_offset : m.region_offset + m.nbytes
        ]


def load(moves: Sequence[Move], shard: bytes, memory: Sequence[bytearray]) -> None:
    for m in moves:
        memory[m.region][m.region_offset : m.region_offset + m.nbytes] = shard[
            m.shard_offset : m.shard_offset + m.nbytes
        ]


@st.composite
def chunk_cases(draw: st.DrawFn) -> tuple[list[KVRegion], GroupLayout, list[int], int, int]:
    num_blocks = draw(st.integers(min_value=1, max_value=10))
    count = draw(st.integers(min_value=1, max_value=3))
    regions = []
    for index in range(count):
        page = draw(st.integers(min_value=1, max_value=24))
        stride = page + draw(st.sampled_from([0, 0, 1, 3, 8]))
        regions.append(make_region(index, page, stride, num_blocks))
    # The group holds a non-empty subset of the regions' layers.
    members = draw(st.lists(st.sampled_from(range(count)), min_size=1, max_size=count, unique=True))
    group = OffloadingGroupConfig(
        tokens_per_block=16, layer_names=tuple(f"layer.{i}" for i in sorted(members))
    )
    (layout,) = group_layouts(regions, [group])
    blocks_per_chunk = draw(st.integers(min_value=1, max_value=4))
    first_sub_block = draw(st.integers(min_value=0, max_value=blocks_per_chunk - 1))
    n = draw(
        st.integers(min_value=1, max_value=min(blocks_per_chunk - first_sub_block, num_blocks))
    )
    block_ids = draw(
        st.one_of(
            # runs of neighbouring blocks, where merging happens
            st.integers(min_value=0, max_value=num_blocks - n).map(lambda s: list(range(s, s + n))),
            st.lists(
                st.integers(min_value=0, max_value=num_blocks - 1),
                min_size=n,
                max_size=n,
                unique=True,
            ),
        )
    )
    return regions, layout, block_ids, blocks_per_chunk, first_sub_block


@settings(max_examples=300, deadline=None)
@given(chunk_cases())
def test_plan_moves_every_byte_where_the_reference_says(
    case: tuple[list[KVRegion], GroupLayout, list[int], int, int],
) -> None:
    regions, layout, block_ids, bpc, first = case
    moves = plan_chunk(layout, regions, block_ids, blocks_per_chunk=bpc, first_sub_block=first)
    expected = reference(layout, regions, block_ids, bpc, first)
    shard_size = layout.shard_bytes(bpc)
    assert shard_size == sum(regions[r].page_size for r in layout.regions) * bpc

    # Each move stays inside its region and the shard, and no shard byte is written twice.
    written: Counter[int] = Counter()
    for m in moves:
        assert m.region in layout.regions
        assert m.nbytes > 0
        assert m.region_offset >= 0
        assert (
            m.region_offset + m.nbytes
            <= regions[m.region].num_blocks * regions[m.region].block_stride
        )
        assert m.shard_offset >= 0
        assert m.shard_offset + m.nbytes <= shard_size
        written.update(range(m.shard_offset, m.shard_offset + m.nbytes))
    assert max(written.values()) == 1
    assert set(written) == set(expected)

    # Store: region bytes -> shard.
    memory = [region_bytes(r, i) for i, r in enumerate(regions)]
    shard = bytearray([0xFF]) * shard_size
    store(moves, memory, shard)
    for offset, (r, region_offset) in expected.items():
        assert shard[offset] == memory[r][region_offset], (offset, r, region_offset)
    assert PAD not in shard
    untouched = [shard[o] for o in range(shard_size) if o not in expected]
    assert all(b == 0xFF for b in untouched)

    # Load: shard -> fresh region memory; only the planned pages change.
    source = bytes((o * 13 + 5) % 0xEE for o in range(shard_size))
    targets = [bytearray([PAD]) * (r.num_blocks * r.block_stride) for r in regions]
    load(moves, source, targets)
    touched = {(r, off): o for o, (r, off) in expected.items()}
    for r, target in enumerate(targets):
        for off, value in enumerate(target):
            if (r, off) in touched:
                assert value == source[touched[(r, off)]]
            else:
                assert value == PAD, (r, off)


@settings(max_examples=200, deadline=None)
@given(chunk_cases())
def test_no_two_adjacent_moves_could_have_been_merged(
    case: tuple[list[KVRegion], GroupLayout, list[int], int, int],
) -> None:
    regions, layout, block_ids, bpc, first = case
    moves = plan_chunk(layout, regions, block_ids, blocks_per_chunk=bpc, first_sub_block=first)
    for a, b in itertools.pairwise(moves):
        assert not (
            a.region == b.region
            and a.region_offset + a.nbytes == b.region_offset
            and a.shard_offset + a.nbytes == b.shard_offset
        )


def test_contiguous_unpadded_blocks_merge_into_one_move_per_region() -> None:
    regions = [make_region(0, 16, 16, 10), make_region(1, 8, 8, 10)]
    layout = GroupLayout((0, 1), (16, 8))
    moves = plan_chunk(layout, regions, [3, 4, 5], blocks_per_chunk=3)
    assert moves == [Move(0, 3 * 16, 0, 3 * 16), Move(1, 3 * 8, 3 * 16, 3 * 8)]


def test_moves_never_merge_across_regions() -> None:
    # Region 0's page of block 1 ends at byte 16, region 1's block 1 starts at byte 16, and
    # the shard parts are back to back: contiguous offsets, but different memory.
    regions = [make_region(0, 8, 8, 4), make_region(1, 8, 16, 4)]
    layout = GroupLayout((0, 1), (8, 8))
    moves = plan_chunk(layout, regions, [1], blocks_per_chunk=1)
    assert moves == [Move(0, 8, 0, 8), Move(1, 16, 8, 8)]


def test_mid_chunk_load_offsets_into_each_part() -> None:
    regions = [make_region(0, 16, 16, 10), make_region(1, 8, 8, 10)]
    layout = GroupLayout((0, 1), (16, 8))
    moves = plan_chunk(layout, regions, [7, 8], blocks_per_chunk=4, first_sub_block=2)
    assert moves == [Move(0, 7 * 16, 2 * 16, 2 * 16), Move(1, 7 * 8, 4 * 16 + 2 * 8, 2 * 8)]


def test_padded_strides_give_one_move_per_block() -> None:
    regions = [make_region(0, 16, 24, 10)]
    layout = GroupLayout((0,), (16,))
    moves = plan_chunk(layout, regions, [2, 3, 4], blocks_per_chunk=3)
    assert moves == [Move(0, 48, 0, 16), Move(0, 72, 16, 16), Move(0, 96, 32, 16)]


@pytest.mark.parametrize("block_ids", [[5, 4], [1, 3], [4, 4 + 10]])
def test_blocks_out_of_order_or_apart_do_not_merge(block_ids: list[int]) -> None:
    regions = [make_region(0, 16, 16, 20)]
    layout = GroupLayout((0,), (16,))
    moves = plan_chunk(layout, regions, block_ids, blocks_per_chunk=2)
    assert moves == [Move(0, b * 16, i * 16, 16) for i, b in enumerate(block_ids)]


def test_packed_layout_moves_whole_block_rows() -> None:
    # One region holds every layer; a block is one row of page == stride bytes.
    row = 3 * 32
    packed = KVRegion(
        handle=ShmHandle(path="/dev/shm/packed", offset=0, size=8 * row),
        num_blocks=8,
        page_size=row,
        block_stride=row,
        layer_names=("layer.0", "layer.1", "layer.2"),
    )
    group = OffloadingGroupConfig(
        tokens_per_block=16, layer_names=("layer.0", "layer.1", "layer.2")
    )
    (layout,) = group_layouts([packed], [group])
    assert layout == GroupLayout((0,), (row,))
    assert plan_chunk(layout, [packed], [5, 6], blocks_per_chunk=2) == [
        Move(0, 5 * row, 0, 2 * row)
    ]


def test_unpacked_layout_moves_one_part_per_layer() -> None:
    regions = [make_region(i, 32, 32, 8) for i in range(3)]
    group = OffloadingGroupConfig(
        tokens_per_block=16, layer_names=("layer.0", "layer.1", "layer.2")
    )
    (layout,) = group_layouts(regions, [group])
    assert layout == GroupLayout((0, 1, 2), (32, 32, 32))
    assert plan_chunk(layout, regions, [5, 6], blocks_per_chunk=2) == [
        Move(0, 5 * 32, 0, 64),
        Move(1, 5 * 32, 64, 64),
        Move(2, 5 * 32, 128, 64),
    ]


def test_too_many_blocks_for_one_chunk_are_refused() -> None:
    regions = [make_region(0, 16, 16, 10)]
    layout = GroupLayout((0,), (16,))
    with pytest.raises(ValueError, match="chunk"):
        plan_chunk(layout, regions, [0, 1, 2], blocks_per_chunk=2)
    with pytest.raises(ValueError, match="chunk"):
        plan_chunk(layout, regions, [0, 1], blocks_per_chunk=2, first_sub_block=1)


@pytest.mark.parametrize(
    ("block_ids", "num_blocks", "bad"),
    [
        ([-1], 8, -1),
        ([0, 8], 8, 8),
        ([3, 100, -5], 8, 100),
        ([0], 0, 0),
    ],
)
def test_block_id_problem_refuses_ids_outside_the_regions(
    block_ids: list[int], num_blocks: int, bad: int
) -> None:
    problem = block_id_problem(block_ids, num_blocks)
    assert problem is not None
    assert f"block id {bad} " in problem
    assert f"[0, {num_blocks})" in problem


@pytest.mark.parametrize(("block_ids", "num_blocks"), [([], 0), ([0, 7], 8), ([7, 0, 3], 8)])
def test_block_id_problem_accepts_ids_in_range(block_ids: list[int], num_blocks: int) -> None:
    assert block_id_problem(block_ids, num_blocks) is None


def test_hybrid_groups_share_a_region() -> None:
    # A region that holds layers of both groups (vLLM hybrids share KV tensors between an
    # attention layer and a Mamba layer) belongs to both layouts, in registration order.
    regions = [
        make_region(0, 64, 64, 10, ("attn.0", "mamba.0")),
        make_region(1, 16, 16, 10, ("attn.1",)),
        make_region(2, 40, 48, 10, ("mamba.1",)),
    ]
    groups = [
        OffloadingGroupConfig(tokens_per_block=16, layer_names=("attn.0", "attn.1")),
        OffloadingGroupConfig(tokens_per_block=64, layer_names=("mamba.1", "mamba.0")),
        OffloadingGroupConfig(tokens_per_block=16, layer_names=("nowhere",)),
    ]
    layouts = group_layouts(regions, groups)
    assert layouts == [
        GroupLayout((0, 1), (64, 16)),
        GroupLayout((0, 2), (64, 40)),
        GroupLayout((), ()),
    ]
    assert layouts[1].shard_bytes(2) == (64 + 40) * 2
    assert layouts[2].shard_bytes(4) == 0
    moves = plan_chunk(layouts[1], regions, [3], blocks_per_chunk=2, first_sub_block=1)
    assert moves == [Move(0, 3 * 64, 64, 64), Move(2, 3 * 48, 2 * 64 + 40, 40)]

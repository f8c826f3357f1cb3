"""Where every byte of a chunk goes: pure address arithmetic, shared by all copy engines.

A rank registers KV regions; each KV-cache group uses the regions that hold its layers. The
rank's *shard* of a chunk (one key = one chunk of one group) is laid out as in vLLM's host
slots: for each of the group's regions in registration order, ``blocks_per_chunk`` pages back
to back, sub-block ``j`` at ``j * page_size`` inside that region's part. Only the unpadded
page is moved; blocks sit ``block_stride`` apart in the rank's region.

A plan is a list of ``Move(region, region_offset, shard_offset, nbytes)``; an engine turns it
into absolute addresses for one direction. Neighbouring moves that are contiguous on both
sides are merged, so blocks laid out back to back cost one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from protocol.config import OffloadingGroupConfig
from protocol.handles import KVRegion


class GroupLayout(NamedTuple):
    """The regions (indices into the rank's regions) that hold one group's layers."""

    regions: tuple[int, ...]
    pages: tuple[int, ...]

    def shard_bytes(self, blocks_per_chunk: int) -> int:
        """Bytes of this rank's shard of one chunk of the group."""
        return sum(self.pages) * blocks_per_chunk


class Move(NamedTuple):
    """Copy ``nbytes`` between a region's ``region_offset`` and a shard's ``shard_offset``."""

    region: int
    region_offset: int
    shard_offset: int
    nbytes: int


def group_layouts(
    regions: Sequence[KVRegion], groups: Sequence[OffloadingGroupConfig]
) -> list[GroupLayout]:
    """For each group, the regions holding any of its layers, in registration order."""
    layouts = []
    for group in groups:
        names = set(group.layer_names)
        members = [i for i, region in enumerate(regions) if names.intersection(region.layer_names)]
        layouts.append(GroupLayout(tuple(members), tuple(regions[i].page_size for i in members)))
    return layouts


def plan_chunk(
    layout: GroupLayout,
    regions: Sequence[KVRegion],
    block_ids: Sequence[int],
    *,
    blocks_per_chunk: int,
    first_sub_block: int = 0,
) -> list[Move]:
    """Moves for one chunk: ``block_ids[i]`` holds sub-block ``first_sub_block + i``.

    ``first_sub_block`` > 0 is a load that starts mid-chunk. Block ids must already be
    validated against the regions (see ``block_id_problem``).
    """
    if first_sub_block + len(block_ids) > blocks_per_chunk:
        raise ValueError("more blocks than fit in one chunk")
    moves: list[Move] = []
    part_offset = 0
    for region_index, page in zip(layout.regions, layout.pages, strict=True):
        stride = regions[region_index].block_stride
        for i, block_id in enumerate(block_ids):
            _append(
                moves,
                Move(
                    region_index,
                    block_id * stride,
                    part_offset + (first_sub_block + i) * page,
                    page,
                ),
            )
        part_offset += page * blocks_per_chunk
    return moves


def _append(moves: list[Move], move: Move) -> None:
    if moves:
        last = moves[-1]
        if (
            last.region == move.region
            and last.region_offset + last.nbytes == move.region_offset
            and last.shard_offset + last.nbytes == move.shard_offset
        ):
            moves[-1] = last._replace(nbytes=last.nbytes + move.nbytes)
            return
    moves.append(move)


def block_id_problem(block_ids: Sequence[int], num_blocks: int) -> str | None:
    """Why ``block_ids`` cannot be used with regions of ``num_blocks`` blocks, or None."""
    for block_id in block_ids:
        if not 0 <= block_id < num_blocks:
            return f"block id {block_id} out of range [0, {num_blocks})"
    return None

"""Where every byte of a chunk goes: pure address arithmetic, shared by all copy engines.

A rank registers KV regions; each KV-cache group uses the regions that hold its layers
(``group_layouts``). The rank's *shard* of a chunk (one key = one chunk of one group) is laid
out as in vLLM's host slots: for each of the group's regions in registration order,
``blocks_per_chunk`` pages back to back, sub-block ``j`` at ``j * page_size`` inside that
region's part. Only the unpadded page is moved; blocks sit ``block_stride`` apart in the rank's
region. In vLLM's canonical layout the shard is the whole chunk in canonical pages (each
region's part holds ``blocks_per_chunk`` canonical pages), shared by every rank of the engine:
each rank's page lands in its fragments of the canonical page (``KVRegion.canonical``'s runs),
so the ranks' stores together write every byte once, and engines of any parallel size read
the same bytes.

What the daemon runs, per request (``server.requests``): ``chunk_ranges`` says which
sub-blocks of each key's chunk the request's block ids fill, and ``block_id_problem`` refuses
ids outside the regions. ``group_spans`` resolves a group's layout once per session against
the addresses the daemon mapped: one ``Span(base, stride, page, part)`` per region, checked to
stay inside its mapping. The chunks then go, with their spans, into a
``transfer.copies.ChunkRuns``, which plans consecutive chunks alike into the job's ``Copies``
as arrays in one go: absolute ``(src, dst, nbytes)`` copies, region -> shard for a store,
shard -> region for a load, unmerged (the engine merges over the whole job).

``chunk_copies`` plans one chunk the same way, into a ``Copies`` or into a list of tuples with
runs of consecutive blocks merged; the benchmarks (``bench.cuda_marshal``) time both.

The readable statement of the layout, one block at a time, is ``plan_chunk`` in
``tests/oracles.py``: the unit tests hold ``chunk_copies`` (both forms) against it byte for
byte, and ``Copies.add_chunks`` (what ``ChunkRuns`` calls) against ``chunk_copies``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import sub
from typing import NamedTuple

from offloadd.transfer.copies import Copies
from offloadd.transfer.types import Span
from protocol.config import OffloadingGroupConfig
from protocol.handles import KVRegion


class GroupLayout(NamedTuple):
    """The regions (indices into the rank's regions) that hold one group's layers.

    ``canonical`` (vLLM's canonical layout) holds each region's canonical page size: the
    shard is then the whole canonical chunk, of which this rank writes and reads only its
    fragments (``group_spans``).
    """

    regions: tuple[int, ...]
    pages: tuple[int, ...]
    canonical: tuple[int, ...] = ()

    def shard_bytes(self, blocks_per_chunk: int) -> int:
        """Bytes of this rank's shard of one chunk of the group (canonical: the chunk's)."""
        return sum(self.canonical or self.pages) * blocks_per_chunk


def group_layouts(
    regions: Sequence[KVRegion], groups: Sequence[OffloadingGroupConfig]
) -> list[GroupLayout]:
    """For each group, the regions holding any of its layers, in registration order."""
    layouts = []
    for group in groups:
        names = set(group.layer_names)
        members = [i for i, region in enumerate(regions) if names.intersection(region.layer_names)]
        pages = tuple(regions[i].page_size for i in members)
        canonical = [regions[i].canonical for i in members]
        if all(page is not None for page in canonical) and canonical:
            layouts.append(
                GroupLayout(tuple(members), pages, tuple(c.page_size for c in canonical if c))
            )
        else:
            layouts.append(GroupLayout(tuple(members), pages))
    return layouts


def chunk_ranges(
    num_keys: int,
    num_blocks: int,
    blocks_per_chunk: int,
    segments: Sequence[tuple[int, int, int]] = (),
    *,
    skip: int = 0,
) -> list[tuple[int, int]]:
    """``(first_sub_block, count)`` of each key's chunk, in order; block ids follow suit.

    Without ``segments`` every key has a full chunk except the first, which starts at
    ``skip``. A segment ``(keys, skip, blocks)`` is a run of keys whose ``blocks`` block ids
    start at sub-block ``skip`` of its first key and may end mid-chunk (vLLM stores leave out
    null blocks; loads start where the GPU prefix cache ends). Raises ValueError, naming the
    problem, when the counts do not add up.
    """
    bpc = blocks_per_chunk
    if not segments:
        segments = [(num_keys, skip, num_keys * bpc - skip)] if num_keys else []
        if num_keys and not 0 <= skip < bpc:
            raise ValueError(f"skip={skip} outside [0, {bpc})")
    ranges: list[tuple[int, int]] = []
    for keys, first, blocks in segments:
        if keys < 1 or not 0 <= first < bpc or blocks < 1:
            raise ValueError(
                f"segment ({keys}, {first}, {blocks}) needs keys >= 1, 0 <= skip < {bpc}, "
                "blocks >= 1"
            )
        if -(-(first + blocks) // bpc) != keys:
            raise ValueError(
                f"segment ({keys}, {first}, {blocks}): {blocks} blocks from sub-block {first} "
                f"span {-(-(first + blocks) // bpc)} chunks of {bpc}, not {keys}"
            )
        left = blocks
        for index in range(keys):
            start = first if index == 0 else 0
            count = min(bpc - start, left)
            ranges.append((start, count))
            left -= count
    if len(ranges) != num_keys:
        raise ValueError(f"segments cover {len(ranges)} keys, the request has {num_keys}")
    covered = sum(count for _, count in ranges)
    if covered != num_blocks:
        raise ValueError(f"segments cover {covered} block ids, the request has {num_blocks}")
    return ranges


def block_id_problem(block_ids: Sequence[int], num_blocks: int) -> str | None:
    """Why ``block_ids`` cannot be used with regions of ``num_blocks`` blocks, or None."""
    if not block_ids or (min(block_ids) >= 0 and max(block_ids) < num_blocks):
        return None  # the usual case, at C speed; the first bad id is named below
    for block_id in block_ids:
        if not 0 <= block_id < num_blocks:
            return f"block id {block_id} out of range [0, {num_blocks})"
    return None


# Resolved straight to addresses with the per-region arithmetic hoisted out of the per-block
# loop: planning runs on the event loop, so its cost per page is paid by every request.


def group_spans(
    layout: GroupLayout,
    regions: Sequence[KVRegion],
    mappings: Sequence[tuple[int, int]],
    *,
    blocks_per_chunk: int,
) -> tuple[Span, ...]:
    """The spans of one group; ``mappings[i]`` is region ``i``'s (address, size).

    Checked once here instead of per copy: every block id below ``num_blocks`` then stays
    inside its mapping. Raises ValueError otherwise.
    """
    spans: list[Span] = []
    part = 0
    for index, page in zip(layout.regions, layout.pages, strict=True):
        region = regions[index]
        address, size = mappings[index]
        if region.num_blocks and (region.num_blocks - 1) * region.block_stride + page > size:
            raise ValueError(f"region {index}: {region.num_blocks} blocks exceed its mapping")
        canonical = region.canonical
        if layout.canonical and canonical is not None:
            # One span per fragment: sub-block j of the chunk is canonical page j.
            for lo, co, size, count, lstride, cstride in canonical.runs:
                spans.extend(
                    Span(
                        address + lo + i * lstride,
                        region.block_stride,
                        size,
                        part + co + i * cstride,
                        canonical.page_size,
                    )
                    for i in range(count)
                )
            part += canonical.page_size * blocks_per_chunk
            continue
        spans.append(Span(address, region.block_stride, page, part))
        part += page * blocks_per_chunk
    return tuple(spans)


def chunk_copies(
    spans: Sequence[Span],
    block_ids: Sequence[int],
    shard_address: int,
    out: list[tuple[int, int, int]] | Copies,
    *,
    first_sub_block: int = 0,
    load: bool = False,
) -> int:
    """Append one chunk's ``(src, dst, nbytes)`` copies to ``out``; returns the bytes.

    A store copies region -> shard, a load (``load=True``) shard -> region. Block ids must be
    validated against ``num_blocks`` already. Into a ``Copies`` (what the daemon passes) the
    chunk goes as arrays, unmerged; into a list, as tuples with runs of consecutive blocks
    merged.
    """
    if isinstance(out, Copies):
        return out.add_chunk(
            spans, block_ids, shard_address, first_sub_block=first_sub_block, load=load
        )
    count = len(block_ids)
    runs = _runs(block_ids)
    total = 0
    for base, stride, page, part, step in spans:
        step = step or page
        dst = shard_address + part + first_sub_block * step
        total += page * count
        if runs is not None and stride == page == step:
            for first, length in runs:
                src, size = base + first * stride, length * page
                out.append((dst, src, size) if load else (src, dst, size))
                dst += size
            continue
        sources = [base + block * stride for block in block_ids]
        targets = range(dst, dst + count * step, step)
        sizes = repeat(page, count)
        if load:
            out.extend(zip(targets, sources, sizes, strict=False))
        else:
            out.extend(zip(sources, targets, sizes, strict=False))
    return total


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]] | None:
    """(first, length) runs of consecutive ids; None when no neighbours are consecutive."""
    if len(block_ids) < 2 or 1 not in set(map(sub, block_ids[1:], block_ids[:-1])):
        return None
    runs: list[tuple[int, int]] = []
    first, length = block_ids[0], 1
    for block in block_ids[1:]:
        if block == first + length:
            length += 1
        else:
            runs.append((first, length))
            first, length = block, 1
    runs.append((first, length))
    return runs

"""``offloadd.server.requests._ranges``: each key's chunk, first block id and the runs of alike
chunks, kept per shape for small jobs; the same answers as ``chunk_ranges``, and a bad shape
refused every time."""

from __future__ import annotations

import pytest

from offloadd.server import requests
from offloadd.transfer.plan import chunk_ranges
from protocol.messages import Segment

SHAPES = [
    (2, 2, 1, (), 0),
    (3, 10, 4, (), 2),
    (3, 8, 4, (Segment(1, 1, 3), Segment(2, 0, 5)), 0),  # two groups, the last part-filled
    # Alike but for their segments: a cache keyed on less would answer the second with the
    # first's ranges (the cases run in order, the cache warm).
    (2, 5, 4, (Segment(2, 1, 5),), 0),
    (2, 5, 4, (Segment(2, 3, 5),), 0),
    (40, 160, 4, (), 0),  # longer than the cached shapes
]


@pytest.mark.parametrize(("keys", "blocks", "bpc", "segments", "skip"), SHAPES)
def test_ranges_match_chunk_ranges_and_count_block_ids(
    keys: int, blocks: int, bpc: int, segments: tuple[Segment, ...], skip: int
) -> None:
    wire = [(s.keys, s.skip, s.blocks) for s in segments]
    expected = chunk_ranges(keys, blocks, bpc, wire, skip=skip)
    for _ in range(2):  # worked out, then (small jobs) from the cache
        chunks, firsts, alike = requests._ranges(keys, blocks, bpc, segments, skip)
        assert list(chunks) == expected
        assert list(firsts) == [sum(count for _, count in expected[:i]) for i in range(keys)]
        # The runs of alike chunks cover every key once, in order, each run's chunks alike.
        assert [start for start, _, _, _ in alike] == [0, *(end for _, end, _, _ in alike[:-1])]
        assert alike[-1][1] == keys
        for start, end, sub_block, count in alike:
            assert set(expected[start:end]) == {(sub_block, count)}
        assert all(alike[i][2:] != alike[i + 1][2:] for i in range(len(alike) - 1))


def test_a_shape_that_does_not_add_up_is_refused_every_time() -> None:
    bad = (Segment(2, 0, 9),)  # 9 blocks of 4 per chunk span 3 chunks, not 2
    for _ in range(2):
        with pytest.raises(ValueError, match="span 3 chunks"):
            requests._ranges(2, 9, 4, bad, 0)


def test_only_small_jobs_are_kept() -> None:
    requests._cached_shape_ranges.cache_clear()
    requests._ranges(2, 2, 1, (), 0)
    requests._ranges(2, 2, 1, (), 0)
    requests._ranges(requests._SHAPE_CACHE_KEYS + 1, requests._SHAPE_CACHE_KEYS + 1, 1, (), 0)
    info = requests._cached_shape_ranges.cache_info()
    assert (info.hits, info.misses, info.currsize) == (1, 1, 1)

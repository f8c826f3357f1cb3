"""Hypothesis strategies shared by the tests (wire types, chunk plans), and the settings of
property tests."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st

from offloadd.transfer.plan import GroupLayout
from protocol.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from protocol.handles import KVRegion, ShmHandle

# `make mutate` runs the unit tests once per mutant: property tests then draw fewer examples,
# always the same ones, so that a run stays short and its verdicts repeat.
MUTATING = bool(os.environ.get("OFFLOADD_MUTATE"))


def property_settings(max_examples: int, **kwargs: Any) -> settings:
    """``settings(max_examples=..., deadline=None, **kwargs)``; a fifth, derandomized, under
    ``make mutate``."""
    if MUTATING:
        kwargs.update(derandomize=True, database=None)
        max_examples = max(10, max_examples // 5)
    return settings(max_examples=max_examples, deadline=None, **kwargs)


def offloading_configs(
    ints: st.SearchStrategy[int],
    texts: st.SearchStrategy[str],
    extra_configs: st.SearchStrategy[dict[str, Any]],
) -> st.SearchStrategy[OffloadingConfig]:
    """Random ``OffloadingConfig``s whose numbers, names and extra_config come from the
    given strategies."""
    return st.builds(
        OffloadingConfig,
        groups=st.lists(
            st.builds(
                OffloadingGroupConfig,
                tokens_per_block=ints,
                layer_names=st.lists(texts, max_size=4).map(tuple),
            ),
            max_size=4,
        ).map(tuple),
        worker_kv_bytes_per_block=ints,
        enable_kv_cache_events=st.booleans(),
        extra_config=extra_configs,
        engine_id=texts,
        model=st.builds(OffloadingModelConfig, name=texts, dtype=texts),
        cache=st.builds(OffloadingCacheConfig, tokens_per_hash=ints, blocks_per_chunk=ints),
        parallel=st.builds(
            OffloadingParallelConfig,
            rank=ints,
            world_size=ints,
            tp_size=ints,
            pp_size=ints,
            pcp_size=ints,
            dcp_size=ints,
            data_parallel_index=ints,
            is_parallelism_agnostic=st.booleans(),
        ),
        replicated_layout=st.booleans(),
        num_cpu_blocks=st.none() | ints,
    )


@st.composite
def plan_cases(draw: st.DrawFn) -> tuple[list[KVRegion], GroupLayout, list[int], int, int, bool]:
    """One chunk to plan: ``(regions, layout, block ids, blocks per chunk, first sub-block,
    load)``, regions padded or not."""
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

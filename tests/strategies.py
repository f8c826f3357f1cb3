"""Hypothesis strategies shared by the wire tests, and the settings of property tests."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st

from protocol.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

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

"""Hypothesis strategies shared by the wire tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from protocol.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)


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

"""Configs, keys and block ids for tests, and nothing heavy: a rank process run as another
user imports this without torch or the daemon (``tests.integration.peer_process``)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from protocol.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

LAYERS = ("layer.0", "layer.1", "layer.2")
TOKENS_PER_BLOCK = 16


def make_config(
    *,
    engine_id: str = "engine-a",
    dp: int = 0,
    rank: int = 0,
    tp: int = 2,
    model: str = "test/model",
    dtype: str = "bfloat16",
    blocks_per_chunk: int = 2,
    bytes_per_block: int = 0,
    tokens_per_hash: int = TOKENS_PER_BLOCK,
    extra: dict[str, object] | None = None,
    events: bool = False,
) -> OffloadingConfig:
    """A one-group config shaped like build_offloading_config's output."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=TOKENS_PER_BLOCK, layer_names=LAYERS),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=dict(extra or {}),
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_hash, blocks_per_chunk=blocks_per_chunk
        ),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp,
            tp_size=tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=dp,
            is_parallelism_agnostic=True,
        ),
    )


def chain_keys(count: int, salt: bytes = b"", group: int = 0) -> list[bytes]:
    """Chained 32-byte hashes + u32be group, like vLLM's OffloadKeys."""
    keys, parent = [], salt
    for index in range(count):
        parent = hashlib.sha256(parent + index.to_bytes(4, "big")).digest()
        keys.append(parent + group.to_bytes(4, "big"))
    return keys


def chunk_block_ids(chunks: Sequence[int], blocks_per_chunk: int, base: int = 0) -> list[int]:
    """Block ids of chunk i: base + i*bpc ... base + i*bpc + bpc - 1."""
    return [base + c * blocks_per_chunk + j for c in chunks for j in range(blocks_per_chunk)]

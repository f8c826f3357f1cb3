"""Configs, keys and block ids for tests, and nothing heavy: a rank process run as another
user imports this without torch or the daemon (``tests.integration.peer_process``)."""

from __future__ import annotations

from collections.abc import Sequence

from offloadd.bench._util import chain_keys, one_group_config
from protocol.config import OffloadingConfig

__all__ = ["LAYERS", "TOKENS_PER_BLOCK", "chain_keys", "make_config"]

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
    return one_group_config(
        engine_id,
        model=model,
        layers=LAYERS,
        bytes_per_block=bytes_per_block,
        blocks_per_chunk=blocks_per_chunk,
        rank=rank,
        tp=tp,
        dp=dp,
        tokens_per_block=TOKENS_PER_BLOCK,
        tokens_per_hash=tokens_per_hash,
        dtype=dtype,
        events=events,
        extra=extra,
    )


def chunk_block_ids(chunks: Sequence[int], blocks_per_chunk: int, base: int = 0) -> list[int]:
    """Block ids of chunk i: base + i*bpc ... base + i*bpc + bpc - 1."""
    return [base + c * blocks_per_chunk + j for c in chunks for j in range(blocks_per_chunk)]

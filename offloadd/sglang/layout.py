"""What an SGLang rank tells the daemon: its page geometry, namespace config and keys.

Pure functions, no SGLang import, no I/O:

- ``page_runs(first, second, last, num_pages)`` reads SGLang's own page addresses
  (``HostKVCache.get_page_buffer_meta`` of pages 0, 1 and the last) and returns the runs a
  page is made of: ``PageRun(offset, size, stride)``, run ``i`` of page ``b`` at
  ``base + offset + b * stride``. It refuses a pool whose pages are not evenly spaced.
- ``offloading_config(...)`` is the daemon-side config of one SGLang rank. Each rank is its
  own one-rank engine: SGLang's ranks neither start nor stop together, and MLA's ranks all
  read what TP rank 0 alone wrote. What decides sharing is the namespace the daemon derives
  from it: the model, the KV dtype, the page (tokens and the byte size of each run), the
  host layout and a salt naming SGLang, the TP size and rank (not under MLA, where every
  rank holds the same bytes), the PP stage and the DCP shard, so SGLang engines of one
  model and geometry share, and nothing else does, a vLLM engine included.
- ``offload_key(key)`` turns SGLang's page key (a hex SHA-256 chain over token ids) into a
  daemon key: its 32 bytes and group 0.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

from protocol.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

__all__ = ["PageRun", "layer_names", "offload_key", "offloading_config", "page_runs"]

_GROUP = (0).to_bytes(4, "big")


class PageRun(NamedTuple):
    """One contiguous piece of every page: at ``offset + page * stride``, ``size`` bytes."""

    offset: int
    size: int
    stride: int


def page_runs(
    base: int,
    first: tuple[Sequence[int], Sequence[int]],
    second: tuple[Sequence[int], Sequence[int]],
    last: tuple[Sequence[int], Sequence[int]],
    num_pages: int,
) -> list[PageRun]:
    """The runs of a page, from the ``(pointers, sizes)`` SGLang gives for pages 0, 1 and
    ``num_pages - 1`` of a pool whose buffer starts at ``base``; ValueError when the pages
    are not laid out evenly (then no region describes the pool)."""
    pointers, sizes = first
    if num_pages < 2 or not pointers or len(pointers) != len(sizes):
        raise ValueError(f"a pool of {num_pages} pages and {len(pointers)} runs per page")
    if len(second[0]) != len(pointers) or len(last[0]) != len(pointers):
        raise ValueError("pages differ in their number of runs")
    runs = []
    for index, (pointer, size) in enumerate(zip(pointers, sizes, strict=True)):
        stride = second[0][index] - pointer
        if stride < size or second[1][index] != size or last[1][index] != size:
            raise ValueError(f"run {index} of a page is not evenly spaced")
        if last[0][index] != pointer + (num_pages - 1) * stride or pointer < base:
            raise ValueError(f"run {index} of the last page is not where the stride puts it")
        runs.append(PageRun(pointer - base, size, stride))
    return runs


def layer_names(runs: Sequence[PageRun]) -> tuple[str, ...]:
    """The names the runs' regions carry (one region per run)."""
    return tuple(f"sglang.run{index}" for index in range(len(runs)))


def offloading_config(
    *,
    engine_id: str,
    model: str,
    dtype: str,
    page_tokens: int,
    runs: Sequence[PageRun],
    layout: str,
    tp_size: int,
    tp_rank: int,
    is_mla: bool,
    pp_size: int = 1,
    pp_rank: int = 0,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    salt: str = "",
    events: bool = False,
) -> OffloadingConfig:
    """The config one SGLang rank says Hello with (see the module docstring)."""
    shard = "all" if is_mla else str(tp_rank)
    namespace = (
        f"sglang/tp{tp_size}:{shard}/pp{pp_size}:{pp_rank}/dcp{dcp_size}:{dcp_rank}/{layout}"
    )
    if salt:
        namespace += f"/{salt}"
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=page_tokens, layer_names=layer_names(runs), group_id=0
            ),
        ),
        # 0: the daemon does not compare it with the regions (runs of one page may share
        # a stride, which it would count once).
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=events,
        extra_config={"namespace": namespace, "engine": "sglang"},
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype=dtype.removeprefix("torch.")),
        cache=OffloadingCacheConfig(tokens_per_hash=page_tokens, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            is_parallelism_agnostic=False,
        ),
        kv_cache_layout=f"sglang:{layout}",
    )


def offload_key(key: str) -> bytes:
    """The daemon key of an SGLang page key: the hash's bytes, then group 0 (a key that is
    not 64 hex digits, as a custom hash function may give, is hashed first)."""
    try:
        digest = bytes.fromhex(key) if len(key) == 64 else b""
    except ValueError:
        digest = b""
    return (digest or hashlib.sha256(key.encode()).digest()) + _GROUP

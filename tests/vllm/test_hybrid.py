"""A hybrid model through vLLM 0.33's real scheduler, hybrid KV cache manager and connectors.

The harness's ``model="hybrid"`` is a Qwen2 whose layers alternate sliding-window
(`HYBRID_WINDOW` tokens) and full attention: vLLM gives each type its own KV cache group
(block ids from one pool, one layer of each group over the same memory) and offloads each
group's chunks under its own key. Sliding-window groups keep only the blocks a later hit can
use: vLLM drops the blocks behind the window (the block table names the null block there),
stores a chunk without its dropped leading blocks, and loads only the window before a hit,
which starts inside a chunk. Every loaded page of every group is compared with the bytes of
its prefix, and the next forward pass checks each group's context as far as its attention
reads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from offloadd.vllm.manager import OffloaddManager
from tests.integration.harness import DaemonThread
from tests.vllm.harness import (
    HYBRID_LAYER_TYPES,
    HYBRID_WINDOW,
    KVMismatchError,
    VllmHarness,
)
from tests.vllm.prompts import compute, prompt_of

BLOCK = 16
BPC = 4  # blocks per chunk
CHUNK = BLOCK * BPC
SWA, FULL = 0, 1  # vLLM's group ids for the hybrid model (checked below)
LAYERS_PER_GROUP = len(HYBRID_LAYER_TYPES) // 2
PROMPT = 200


def settle(h: VllmHarness, chunks: int, daemon: DaemonThread) -> None:
    """Wait until the scheduler's mirror shows ``chunks`` chunks (commits reach it async)."""
    manager = h.offloading_manager
    assert isinstance(manager, OffloaddManager)
    assert daemon.daemon is not None
    deadline = time.monotonic() + 30  # a loaded machine delays the mirror, never the bytes
    while len(manager._mirror.keys) < chunks:
        if time.monotonic() > deadline:
            stats = daemon.daemon.stats()
            raise AssertionError(
                f"mirror has {len(manager._mirror.keys)} of {chunks} chunks; the daemon "
                f"{stats.committed_entries} committed of {stats.entries}, "
                f"{stats.stores_refused} refused, {stats.jobs_in_flight} jobs in flight"
            )
        time.sleep(0.01)


def group_spans(h: VllmHarness, req_id: str, job: int = 0) -> dict[int, tuple[int, int]]:
    """(first block index, blocks) per group of one load job of `req_id`."""
    dst = h.load_jobs[req_id][job].dst
    return {g: (dst.block_indices[g], dst.group_sizes[g]) for g in (SWA, FULL)}


def window_blocks(h: VllmHarness, hit: int) -> tuple[int, int]:
    """(first block index, blocks) of the sliding window attention reads before `hit`."""
    spec = h.kv_cache_config.kv_cache_groups[SWA].kv_cache_spec
    first = h.context_start(spec, hit) // BLOCK
    return first, hit // BLOCK - first


def warm_block_0(h: VllmHarness, prompt: list[int]) -> None:
    """Put the prompt's first block back in the GPU prefix cache (both groups), so the
    connector's hit starts at block 1: inside the first chunk."""
    compute(h, prompt[:20], max_tokens=1)


@pytest.fixture
def daemon() -> Iterator[DaemonThread]:
    d = DaemonThread(capacity=64 << 20).start()
    yield d
    d.stop()


def hybrid(tmp_path: Path, daemon: DaemonThread, retention: int | None, **more: Any) -> VllmHarness:
    extra = {
        "spec_name": "OffloaddSpec",
        "spec_module_path": "offloadd.vllm",
        "offloadd_endpoint": daemon.endpoint,
        "block_size": CHUNK,
    }
    # 100 tokens a step: prefill steps end inside chunks, so vLLM has dropped a chunk's
    # leading sliding-window blocks by the time it stores that chunk.
    return VllmHarness(
        tmp_path,
        extra,
        model="hybrid",
        num_blocks=128,
        max_num_batched_tokens=100,
        prefix_cache_retention_interval=retention,
        **more,
    )


def test_hybrid_model_has_a_sliding_window_and_a_full_attention_group(
    tmp_path: Path, daemon: DaemonThread
) -> None:
    with hybrid(tmp_path, daemon, retention=0) as h:
        groups = h.kv_cache_config.kv_cache_groups
        assert [type(g.kv_cache_spec) for g in groups] == [SlidingWindowSpec, FullAttentionSpec]
        spec = groups[SWA].kv_cache_spec
        assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window == HYBRID_WINDOW
        config = h.ranks[0].offloading_spec.config
        assert [(g.group_id, g.sliding_window_size_in_chunks) for g in config.groups] == [
            (SWA, 1),
            (FULL, None),
        ]
        assert all(len(g.layer_names) == LAYERS_PER_GROUP for g in groups)


@pytest.mark.parametrize(("tp", "async_scheduling"), [(1, False), (2, False), (1, True)])
def test_sliding_window_chunks_skip_dropped_blocks_and_every_group_loads_mid_chunk(
    tmp_path: Path, daemon: DaemonThread, tp: int, async_scheduling: bool
) -> None:
    """With a retention interval of one chunk, vLLM keeps a window at every chunk's end."""
    prompt = prompt_of(PROMPT)
    with hybrid(
        tmp_path,
        daemon,
        retention=CHUNK,
        tensor_parallel_size=tp,
        async_scheduling=async_scheduling,
    ) as h:
        a = compute(h, prompt)
        # Step 2 computes [100, 200): the window behind 100 starts in block 5, so chunk 1's
        # block 4 is dropped (null) and that chunk is stored from its sub-block 1. With async
        # scheduling step 2 is scheduled before step 1's output is in, block 4 is still held
        # and the chunk is stored whole.
        assert h.forward_ranges[a][:2] == [(1, 0, 100), (2, 100, 100)]
        jobs = h.store_jobs[a]
        chunk_1 = [(4, 4)] if async_scheduling else [(5, 3)]
        assert [(j.src.block_indices[SWA], j.src.group_sizes[SWA]) for j in jobs] == [
            (0, 4),
            (chunk_1[0][0], chunk_1[0][1] + 4),
        ]
        assert [(j.src.block_indices[FULL], j.src.group_sizes[FULL]) for j in jobs] == [
            (0, 4),
            (4, 8),
        ]
        settle(h, 3 + 3, daemon)
        h.reset_prefix_cache()  # zero all KV
        warm_block_0(h, prompt)
        b = compute(h, prompt[:150] + prompt_of(9, seed=5))
        assert h.external_tokens(b) == 2 * CHUNK - BLOCK
        assert len(h.load_jobs[b]) == 1
        spans = group_spans(h, b)
        # Full attention: blocks 1..7 (from sub-block 1 of chunk 0). Sliding window: the
        # window before 128, blocks 6..7, from sub-block 2 of a chunk stored from sub-block 1.
        assert spans == {FULL: (1, 7), SWA: window_blocks(h, 2 * CHUNK)}
        assert spans[SWA] == (6, 2)
        assert all(first % BPC for first, _ in spans.values())
        assert h.assert_loaded_pages(b) == (7 + 2) * LAYERS_PER_GROUP * tp
        # The connector's hit and the loads are what B computes from.
        assert h.forward_ranges[b][0][1] == 2 * CHUNK


def test_default_retention_offloads_windows_only_where_a_hit_can_end(
    tmp_path: Path, daemon: DaemonThread
) -> None:
    """vLLM's default (retention 0) keeps a window only at a prompt's end or a junction
    with a cached prefix: a hit elsewhere misses in the sliding-window group."""
    prompt = prompt_of(PROMPT)
    with hybrid(tmp_path, daemon, retention=0) as h:
        a = compute(h, prompt)
        swa_stored = [(j.src.block_indices[SWA], j.src.group_sizes[SWA]) for j in h.store_jobs[a]]
        assert [s for s in swa_stored if s[1]] == [(8, 4)]  # chunk 2 only: the prompt's end
        settle(h, 3 + 1, daemon)
        h.reset_prefix_cache()
        warm_block_0(h, prompt)
        # A hit at 128 needs chunk 1's window, which nobody stored: no hit at all.
        b = compute(h, prompt[:150] + prompt_of(9, seed=5))
        assert h.external_tokens(b) == 0 and b not in h.load_jobs
        # B's shared prefix with A's stored chunks ends at 128 (a junction): B stored the
        # window behind it, chunk 1's last two blocks, and no full-attention chunk (A's).
        ((first, size),) = [
            (j.src.block_indices[SWA], j.src.group_sizes[SWA]) for j in h.store_jobs[b]
        ]
        assert (first, size) == window_blocks(h, 2 * CHUNK) == (6, 2)
        assert all(j.src.group_sizes[FULL] == 0 for j in h.store_jobs[b])
        settle(h, 3 + 2, daemon)

        # The whole prompt again: hit at 192, the window of chunk 2 and full attention.
        h.reset_prefix_cache()
        warm_block_0(h, prompt)
        c = compute(h, prompt + prompt_of(9, seed=6))
        assert h.external_tokens(c) == 3 * CHUNK - BLOCK
        assert group_spans(h, c) == {FULL: (1, 11), SWA: window_blocks(h, 3 * CHUNK)}
        assert h.assert_loaded_pages(c) == (11 + 2) * LAYERS_PER_GROUP

        # And at 128 now: B's chunk, stored from its sub-block 2, serves the window.
        h.reset_prefix_cache()
        warm_block_0(h, prompt)
        d = compute(h, prompt[:140] + prompt_of(9, seed=7))
        assert h.external_tokens(d) == 2 * CHUNK - BLOCK
        assert group_spans(h, d) == {FULL: (1, 7), SWA: (6, 2)}
        assert h.assert_loaded_pages(d) == (7 + 2) * LAYERS_PER_GROUP


@pytest.mark.parametrize(("index", "caught"), [(5, True), (4, False)])
def test_the_context_check_reads_a_sliding_window_as_far_as_attention_does(
    tmp_path: Path, daemon: DaemonThread, index: int, caught: bool
) -> None:
    """Computing from 100, a window of 20 reads 81..99: block 5 (80..95) on, not block 4."""
    with hybrid(tmp_path, daemon, retention=0) as h:
        req = h.add_request(prompt_of(PROMPT), max_tokens=1)
        h.step()  # [0, 100)
        assert h.forward_ranges[req] == [(1, 0, 100)]
        block_id = h.block_table(req, SWA)[index]
        name = h.kv_cache_config.kv_cache_groups[SWA].layer_names[-1]
        h.ranks[0].kv_bytes[name][block_id] ^= 0x55
        if caught:
            with pytest.raises(
                KVMismatchError, match=rf"{name}: context blocks \(by index\) \[5\]"
            ):
                h.step()
        else:
            h.run_until_finished()
            assert h.finished[req]

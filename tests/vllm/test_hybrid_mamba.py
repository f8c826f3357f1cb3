"""A Mamba hybrid through vLLM 0.33's real scheduler, hybrid KV cache manager and connectors.

The harness's ``model="mamba"`` alternates Mamba layers (vLLM's ``MambaSpec`` in prefix
caching's "align" mode) and full-attention layers: one KV cache group each, block ids from
one pool. vLLM 0.33's offloading connector offloads Mamba groups (`build_offloading_config`
gives them a window of one chunk): a Mamba chunk is the one state at the chunk's end, in the
chunk's last block, stored without the chunk's other blocks, and a hit loads that one block,
which is inside the chunk, next to the full-attention blocks from the hit's start. A state
exists only where a prefill step ended (align mode splits steps at block boundaries) and where
vLLM's retention keeps it, so a hit needs a step to have ended on its chunk boundary. Every
loaded page is compared with the bytes of its prefix, and the next forward pass checks the
state it starts from and the attention context (SimpleSpec's faults show that check fails).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tests.integration.harness import DaemonThread
from tests.vllm.harness import MAMBA_LAYER_TYPES, KVMismatchError, VllmHarness, sampled_token
from tests.vllm.prompts import compute, extra_for, prompt_of, settle

BLOCK = 16
BPC = 4  # blocks per chunk
CHUNK = BLOCK * BPC
MAMBA, FULL = 0, 1  # vLLM's group ids for the Mamba hybrid (checked below)
LAYERS_PER_GROUP = len(MAMBA_LAYER_TYPES) // 2
PROMPT = 200
PAGE = 2048  # bytes of one layer's block (an attention page, a Mamba state) at TP=1


def spans(specs: Iterable[GPULoadStoreSpec], group: int) -> list[tuple[int, int]]:
    """(first block index, blocks) of `group` in each of `specs`, empty ones left out."""
    return [
        (spec.block_indices[group], spec.group_sizes[group])
        for spec in specs
        if spec.group_sizes[group]
    ]


def stored(h: VllmHarness, req: str, group: int) -> list[tuple[int, int]]:
    return spans((job.src for job in h.store_jobs[req]), group)


def loaded(h: VllmHarness, req: str, group: int) -> list[tuple[int, int]]:
    return spans((job.dst for job in h.load_jobs[req]), group)


def compute_with_loads(h: VllmHarness, prompt: list[int], max_tokens: int = 2) -> tuple[str, int]:
    """Run a request that loads; return it and the loaded pages checked. They are checked
    after its first forward pass: the one that read them (a Mamba block can take the next
    state right after, where vLLM retains no state there)."""
    req = h.add_request(prompt, max_tokens=max_tokens)
    while req not in h.forward_ranges:
        h.step()
    pages = h.assert_loaded_pages(req)
    h.run_until_finished()
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(sampled_token(tokens))
    assert h.outputs[req] == tokens[len(prompt) :]
    return req, pages


def warm_block_0(h: VllmHarness, prompt: list[int]) -> None:
    """Put the prompt's first block back in the GPU prefix cache (both groups: the Mamba
    state after 16 tokens), so the connector's hit starts at block 1, inside chunk 0."""
    compute(h, prompt[:20], max_tokens=1)


@pytest.fixture
def daemon() -> Iterator[DaemonThread]:
    d = DaemonThread(capacity=64 << 20).start()
    yield d
    d.stop()


def mamba(
    tmp_path: Path, daemon: DaemonThread, step_tokens: int, retention: int | None, **more: Any
) -> VllmHarness:
    return VllmHarness(
        tmp_path,
        extra_for(daemon, block_size=CHUNK),
        model="mamba",
        num_blocks=128,
        max_num_batched_tokens=step_tokens,
        prefix_cache_retention_interval=retention,
        **more,
    )


def test_mamba_hybrid_has_a_mamba_and_a_full_attention_group(
    tmp_path: Path, daemon: DaemonThread
) -> None:
    with mamba(tmp_path, daemon, step_tokens=CHUNK, retention=None) as h:
        groups = h.kv_cache_config.kv_cache_groups
        assert [type(g.kv_cache_spec) for g in groups] == [MambaSpec, FullAttentionSpec]
        spec = groups[MAMBA].kv_cache_spec
        assert isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align"
        assert spec.block_size == BLOCK
        config = h.ranks[0].offloading_spec.config
        assert [(g.group_id, g.sliding_window_size_in_chunks) for g in config.groups] == [
            (MAMBA, 1),
            (FULL, None),
        ]
        assert all(len(g.layer_names) == LAYERS_PER_GROUP for g in groups)


@pytest.mark.parametrize(("tp", "async_scheduling"), [(1, False), (2, False), (1, True)])
def test_mamba_chunks_are_one_state_and_every_group_loads_mid_chunk(
    tmp_path: Path, daemon: DaemonThread, tp: int, async_scheduling: bool
) -> None:
    """Steps of one chunk leave a state at every chunk's end; vLLM's dense retention keeps
    them all."""
    prompt = prompt_of(PROMPT)
    with mamba(
        tmp_path,
        daemon,
        step_tokens=CHUNK,
        retention=None,
        tensor_parallel_size=tp,
        async_scheduling=async_scheduling,
    ) as h:
        a = compute(h, prompt)
        assert [r[1:] for r in h.forward_ranges[a][:3]] == [(0, 64), (64, 64), (128, 64)]
        # Each Mamba chunk is stored from its last sub-block: blocks 0..2 of it are left out.
        assert stored(h, a, MAMBA) == [(3, 1), (7, 1), (11, 1)]
        assert stored(h, a, FULL) == [(0, 4), (4, 4), (8, 4)]
        settle(h, 3 + 3)
        # The daemon copied the blocks named and nothing else: 12 attention pages and 3
        # states per layer (the ranks' halves at TP=2).
        assert daemon.daemon is not None
        assert daemon.daemon.stats().bytes_stored == (12 + 3) * LAYERS_PER_GROUP * PAGE
        h.reset_prefix_cache()  # zero all KV
        warm_block_0(h, prompt)
        b, pages = compute_with_loads(h, prompt[:150] + prompt_of(9, seed=5))
        assert h.external_tokens(b) == 2 * CHUNK - BLOCK
        assert len(h.load_jobs[b]) == 1
        # Full attention: blocks 1..7 (from sub-block 1 of chunk 0); Mamba: the state after
        # 128 tokens, block 7 (sub-block 3 of chunk 1). Both loads start inside a chunk.
        assert loaded(h, b, FULL) == [(1, 7)]
        assert loaded(h, b, MAMBA) == [(7, 1)]
        assert pages == (7 + 1) * LAYERS_PER_GROUP * tp
        # The connector's hit is what B computes from: the forward pass read the loaded state.
        assert h.forward_ranges[b][0][1] == 2 * CHUNK


@pytest.mark.parametrize(
    ("step_tokens", "retention", "full_stores"),
    [
        pytest.param(100, None, [(0, 4), (4, 8)], id="steps-end-off-chunk-boundaries"),
        pytest.param(CHUNK, 0, [(0, 4), (4, 4), (8, 4)], id="default-retention"),
    ],
)
def test_a_hit_needs_a_mamba_state_at_its_chunk_boundary(
    tmp_path: Path,
    daemon: DaemonThread,
    step_tokens: int,
    retention: int | None,
    full_stores: list[tuple[int, int]],
) -> None:
    """Steps ending at 96 and 192 leave no state at 64 or 128; vLLM's default retention (0)
    keeps the state only at the prompt's end. Either way only chunk 2's state is offloaded."""
    prompt = prompt_of(PROMPT)
    with mamba(tmp_path, daemon, step_tokens=step_tokens, retention=retention) as h:
        a = compute(h, prompt)
        assert stored(h, a, MAMBA) == [(11, 1)]
        # Full attention: a store per step, of the chunks the step completed.
        assert stored(h, a, FULL) == full_stores
        settle(h, 3 + 1)
        h.reset_prefix_cache()
        warm_block_0(h, prompt)
        # Full attention has chunks 0 and 1, Mamba no state after 128 tokens: no hit.
        b = compute(h, prompt[:150] + prompt_of(9, seed=5))
        assert h.external_tokens(b) == 0 and b not in h.load_jobs

        # The whole prompt again: hit at 192 in both groups.
        h.reset_prefix_cache()
        warm_block_0(h, prompt)
        c, pages = compute_with_loads(h, prompt + prompt_of(9, seed=6))
        assert h.external_tokens(c) == 3 * CHUNK - BLOCK
        assert loaded(h, c, FULL) == [(1, 11)]
        assert loaded(h, c, MAMBA) == [(11, 1)]
        assert pages == (11 + 1) * LAYERS_PER_GROUP
        assert h.forward_ranges[c][0][1] == 3 * CHUNK


def test_with_one_block_per_chunk_every_step_end_is_a_hit_point(
    tmp_path: Path, daemon: DaemonThread
) -> None:
    """The steps that gave no state at a 64-token chunk boundary above (ending at 96 and 192)
    give Mamba chunks 5 and 11 when a chunk is one block: a hit at 96."""
    prompt = prompt_of(PROMPT)
    with VllmHarness(
        tmp_path,
        extra_for(daemon, block_size=BLOCK),
        model="mamba",
        num_blocks=128,
        max_num_batched_tokens=100,
        prefix_cache_retention_interval=None,
    ) as h:
        a = compute(h, prompt)
        assert stored(h, a, MAMBA) == [(5, 1), (11, 1)]
        settle(h, 12 + 2)
        h.reset_prefix_cache()
        warm_block_0(h, prompt)
        b, pages = compute_with_loads(h, prompt[:150] + prompt_of(9, seed=5))
        assert h.external_tokens(b) == 96 - BLOCK
        assert loaded(h, b, FULL) == [(1, 5)]
        assert loaded(h, b, MAMBA) == [(5, 1)]
        assert pages == (5 + 1) * LAYERS_PER_GROUP
        assert h.forward_ranges[b][0][1] == 96


@pytest.mark.parametrize(("steps", "caught"), [(1, True), (2, False)])
def test_the_forward_pass_checks_the_mamba_state_it_starts_from(
    tmp_path: Path, daemon: DaemonThread, steps: int, caught: bool
) -> None:
    """Computing from 64 reads the state after 64 tokens (block 3); from 128 on, the state
    after 128 (block 7), and block 3 no longer matters."""
    with mamba(tmp_path, daemon, step_tokens=CHUNK, retention=None) as h:
        req = h.add_request(prompt_of(PROMPT), max_tokens=1)
        for _ in range(steps):
            h.step()
        assert h.forward_ranges[req][-1] == (steps, (steps - 1) * CHUNK, CHUNK)
        block_id = h.block_table(req, MAMBA)[3]
        assert block_id != 0
        name = h.kv_cache_config.kv_cache_groups[MAMBA].layer_names[-1]
        h.ranks[0].kv_bytes[name][block_id] ^= 0x55
        if caught:
            with pytest.raises(KVMismatchError, match=rf"{name}: the Mamba state in block 3 "):
                h.step()
        else:
            h.run_until_finished()
            assert h.finished[req]


@pytest.mark.parametrize(
    ("fault", "tp"), [(None, 1), ("skip_loads", 1), ("ignore_skip", 1), ("other_rank", 2)]
)
def test_a_wrong_mamba_load_fails_the_next_forward_pass(
    tmp_path: Path, simple_extra: dict[str, object], fault: str | None, tp: int
) -> None:
    """SimpleSpec (tests/vllm/simple_spec.py) loading right, then wrong states: none,
    sub-block 0 of the chunk instead of its last (where the state is), another rank's. The
    step computing from the hit reads the state vLLM named, so it fails there (the Mamba group
    is checked first, whatever full attention got)."""
    extra = {**simple_extra, "block_size": CHUNK}
    if fault is not None:
        extra["simple_fault"] = fault
    prompt = prompt_of(PROMPT)
    with VllmHarness(
        tmp_path,
        extra,
        model="mamba",
        num_blocks=128,
        max_num_batched_tokens=CHUNK,
        prefix_cache_retention_interval=None,
        tensor_parallel_size=tp,
    ) as h:
        compute(h, prompt)
        h.reset_prefix_cache()
        b = h.add_request(prompt[:150] + prompt_of(9, seed=5), max_tokens=2)
        if fault is None:  # the same engine, loading right
            h.run_until_finished()
            assert h.external_tokens(b) == 2 * CHUNK and h.finished[b]
            return
        with pytest.raises(KVMismatchError, match="the Mamba state in block 7 "):
            h.run_until_finished()

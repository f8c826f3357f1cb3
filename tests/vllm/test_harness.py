"""The harness drives vLLM's real scheduler and connector, and checks bytes.

Proved with SimpleSpec (tests/vllm/simple_spec.py), loaded as an out-of-tree
spec: request A computes and stores, the GPU prefix cache is reset and all KV
zeroed, request B shares a prefix and must get it back through the connector.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from vllm.distributed.kv_events import BlockStored

from tests.vllm.harness import (
    NUM_LAYERS,
    KVMismatchError,
    VllmHarness,
    backing_file,
    sampled_token,
)

BLOCK = 16


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


def expected_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(sampled_token(tokens))
    return tokens[len(prompt) :]


def compute(h: VllmHarness, prompt: list[int], max_tokens: int = 3) -> str:
    """Run one request to completion; check the simulated sampler's output."""
    req = h.add_request(prompt, max_tokens=max_tokens)
    h.run_until_finished()
    assert h.finished[req] == "length"
    assert h.outputs[req] == expected_outputs(prompt, max_tokens)
    return req


A_PROMPT = prompt_of(100)


def b_prompt(shared: int) -> list[int]:
    return A_PROMPT[:shared] + prompt_of(7, seed=1)


def store_a_then_reset(h: VllmHarness) -> None:
    a = compute(h, A_PROMPT)
    assert h.external_tokens(a) == 0
    assert h.offloading_manager.calls.get("complete_store", 0) >= 1
    h.reset_prefix_cache()  # and zero every rank's KV


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("chunk_tokens", [16, 32])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_store_then_load_round_trip(
    tmp_path: Path,
    simple_extra: dict[str, object],
    tp: int,
    chunk_tokens: int,
    async_scheduling: bool,
) -> None:
    extra = {**simple_extra, "block_size": chunk_tokens}
    with VllmHarness(
        tmp_path, extra, tensor_parallel_size=tp, async_scheduling=async_scheduling
    ) as h:
        assert type(h.scheduler).__name__ == ("AsyncScheduler" if async_scheduling else "Scheduler")
        assert h.ranks[0].offloading_spec.blocks_per_chunk == chunk_tokens // BLOCK
        store_a_then_reset(h)
        b = compute(h, b_prompt(85), max_tokens=2)
        aligned = 85 - 85 % chunk_tokens  # 80 or 64
        call = h.match_call(b)
        assert (call.num_computed_tokens, call.num_matched, call.load_async) == (0, aligned, True)
        assert [index for _, index, _ in h.loaded_blocks(b)] == list(range(aligned // BLOCK))
        assert h.assert_loaded_pages(b) == aligned // BLOCK * NUM_LAYERS * tp
        # B computed only what it did not load.
        (_, start, n), *_decode = h.forward_ranges[b]
        assert (start, n) == (aligned, len(b_prompt(85)) - aligned)


def test_load_starting_mid_chunk(tmp_path: Path, simple_extra: dict[str, object]) -> None:
    """B's GPU prefix cache still holds the first block of a two-block chunk:
    the load starts at block 1 and the spec must skip one sub-block."""
    with VllmHarness(tmp_path, {**simple_extra, "block_size": 32}) as h:
        store_a_then_reset(h)
        c = compute(h, A_PROMPT[:20], max_tokens=1)  # caches block 0 on the GPU only
        assert h.external_tokens(c) == 0  # less than a chunk: nothing to load
        b = compute(h, b_prompt(70), max_tokens=2)
        call = h.match_call(b)
        assert (call.num_computed_tokens, call.num_matched) == (16, 48)
        (job,) = h.load_jobs[b]
        assert list(job.dst.block_indices) == [1]  # skip = 1 % 2
        assert [index for _, index, _ in h.loaded_blocks(b)] == [1, 2, 3]
        copies = h.ranks[0].offloading_worker.log[job.job_id]
        assert [sub for _, _, sub, _ in copies] == [1, 0, 1]
        assert h.forward_ranges[b][0][1:] == (64, len(b_prompt(70)) - 64)
        assert h.assert_loaded_pages(b) == 3 * NUM_LAYERS


@pytest.mark.parametrize(
    ("fault", "tp", "chunk_tokens", "c_len"),
    [("skip_loads", 1, 16, 0), ("other_rank", 2, 16, 0), ("ignore_skip", 1, 32, 20)],
)
def test_harness_catches_wrong_loads(
    tmp_path: Path,
    simple_extra: dict[str, object],
    fault: str,
    tp: int,
    chunk_tokens: int,
    c_len: int,
) -> None:
    """A spec that loads the wrong bytes fails B's forward pass: attention
    would read them."""
    extra = {**simple_extra, "block_size": chunk_tokens, "simple_fault": fault}
    with VllmHarness(tmp_path, extra, tensor_parallel_size=tp) as h:
        store_a_then_reset(h)
        if c_len:
            compute(h, A_PROMPT[:c_len], max_tokens=1)
        h.add_request(b_prompt(70), max_tokens=2)
        with pytest.raises(KVMismatchError, match="do not hold their tokens' KV"):
            h.run_until_finished()


def test_sync_load(tmp_path: Path, simple_extra: dict[str, object]) -> None:
    """With a sync-load budget the load runs inside B's first step (expedited,
    started before the forward pass)."""
    extra = {**simple_extra, "sync_load_budget_bytes": 1 << 30}
    with VllmHarness(tmp_path, extra) as h:
        store_a_then_reset(h)
        b = compute(h, b_prompt(40), max_tokens=2)
        call = h.match_call(b)
        assert (call.num_matched, call.load_async) == (32, False)
        (job,) = h.load_jobs[b]
        assert job.sync
        assert h.assert_loaded_pages(b) == 2 * NUM_LAYERS


def test_delayed_completion(tmp_path: Path, simple_extra: dict[str, object]) -> None:
    """Jobs reported a few get_finished calls late: stores become loadable
    and loads finish later, under async scheduling, on two ranks."""
    extra = {**simple_extra, "simple_report_delay": 3}
    with VllmHarness(tmp_path, extra, tensor_parallel_size=2, async_scheduling=True) as h:
        store_a_then_reset(h)
        b = compute(h, b_prompt(50), max_tokens=2)
        assert h.external_tokens(b) == 48
        assert h.assert_loaded_pages(b) == 3 * NUM_LAYERS * 2


def test_data_parallel_engines_share_one_cache(
    tmp_path: Path, simple_extra: dict[str, object]
) -> None:
    """Two DP engines (dense model: independent, DP index kept) and one cache."""
    with (
        VllmHarness(
            tmp_path / "dp0", simple_extra, data_parallel_size=2, data_parallel_index=0
        ) as h0,
        VllmHarness(
            tmp_path / "dp1", simple_extra, data_parallel_size=2, data_parallel_index=1
        ) as h1,
    ):
        for index, h in enumerate((h0, h1)):
            parallel = h.ranks[0].offloading_spec.config.parallel
            assert parallel.data_parallel_index == index
            assert h.ranks[0].offloading_spec.config.engine_id == f"harness_dp{index}"
        compute(h0, A_PROMPT)
        b = compute(h1, b_prompt(70), max_tokens=2)
        assert h1.external_tokens(b) == 64
        assert h1.assert_loaded_pages(b) == 4 * NUM_LAYERS


def test_kv_memory_is_a_shared_file_mapping(
    tmp_path: Path, simple_extra: dict[str, object]
) -> None:
    """What the spec's worker is given lives in each rank's own /dev/shm file,
    findable through /proc/self/maps."""
    with VllmHarness(tmp_path, simple_extra, tensor_parallel_size=2, num_blocks=32) as h:
        a = compute(h, A_PROMPT)
        paths = set()
        for state in h.ranks:
            canonical = state.offloading_worker.kv_caches
            # LBHNC is layer-compact: one (num_blocks, page) tensor per layer.
            assert len(canonical.tensors) == NUM_LAYERS
            assert [[r.tensor_idx for r in refs] for refs in canonical.group_data_refs] == [
                list(range(NUM_LAYERS))
            ]
            for layer, tensor in enumerate(canonical.tensors):
                ptr = tensor.tensor.data_ptr()
                path, offset = backing_file(ptr)
                assert path == str(state.buffer.path)
                assert path.startswith("/dev/shm/")
                assert offset == ptr - state.buffer.tensor.data_ptr()
                assert ptr == h.page(state.rank, layer, 0).data_ptr()
                paths.add(path)
            # A page read from the file is the page the forward pass wrote.
            block_id = h.scheduler_outputs[0].scheduled_new_reqs[0].block_ids[0][0]
            layer_page = h.page(state.rank, 0, block_id)
            page_path, page_offset = backing_file(layer_page.data_ptr())
            fd = os.open(page_path, os.O_RDONLY)
            try:
                data = os.pread(fd, layer_page.numel(), page_offset)
            finally:
                os.close(fd)
            assert data == layer_page.numpy().tobytes()
            want = h.expected_page_bytes(h.tokens(a)[:BLOCK], 0, state.rank)
            assert data == want.numpy().tobytes()
        assert len(paths) == 2


def test_kv_events(tmp_path: Path, simple_extra: dict[str, object]) -> None:
    """GPU and offloading events arrive on the zmq ipc endpoint and decode with
    vLLM's own KVEventBatch."""
    with VllmHarness(tmp_path, simple_extra, kv_events=True) as h:
        assert h.kv_events_endpoint is not None
        assert h.kv_events_endpoint.startswith("ipc://")
        with h.subscribe_kv_events() as events:
            compute(h, A_PROMPT)
            # 100 prompt tokens: 6 full blocks in the GPU prefix cache, 6 offloaded.
            stored: dict[str | None, int] = {}
            while stored != {"GPU": 6, "CPU": 6}:
                got = events.receive(timeout=10)
                assert got is not None, f"events stopped at {stored}"
                for event in got[1].events:
                    if isinstance(event, BlockStored):
                        stored[event.medium] = stored.get(event.medium, 0) + len(event.block_hashes)
            assert events.drain() == []


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption(
    tmp_path: Path, simple_extra: dict[str, object], async_scheduling: bool
) -> None:
    """Too few blocks for two decoding requests: one is preempted and resumed
    (new block table, tokens from the scheduler) and both still sample right."""
    with VllmHarness(tmp_path, simple_extra, num_blocks=13, async_scheduling=async_scheduling) as h:
        prompts = [prompt_of(80, seed) for seed in (2, 3)]
        reqs = [h.add_request(p, max_tokens=30) for p in prompts]
        h.run_until_finished()
        assert any(so.preempted_req_ids for so in h.scheduler_outputs)
        for req, prompt in zip(reqs, prompts, strict=True):
            assert h.outputs[req] == expected_outputs(prompt, 30)


@pytest.mark.parametrize(("layout", "num_tensors"), [("LBNHC", NUM_LAYERS), ("BLHNC", 1)])
def test_other_kv_cache_layouts(
    tmp_path: Path, simple_extra: dict[str, object], layout: str, num_tensors: int
) -> None:
    """Token-major pages (LBNHC), and block-outer packing (BLHNC: the connector
    offloads both layers of a block as one region)."""
    with VllmHarness(tmp_path, simple_extra, kv_cache_layout=layout) as h:
        assert h.vllm_config.cache_config.kv_cache_layout == layout
        assert len(h.ranks[0].offloading_worker.kv_caches.tensors) == num_tensors
        store_a_then_reset(h)
        b = compute(h, b_prompt(40), max_tokens=2)
        assert h.external_tokens(b) == 32
        assert h.assert_loaded_pages(b) == 2 * NUM_LAYERS

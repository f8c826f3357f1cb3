"""What is shared across parallelism, through vLLM 0.33's real scheduler and worker connectors.

- MLA is stored once: vLLM marks an MLA engine at TP > 1 ``replicated_layout`` (every rank
  holds the same latent bytes); the daemon keeps one shard per chunk, written by rank 0, and
  every rank loads that same shard.
- Direct-layout namespaces stay keyed by parallelism: a TP=1 and a TP=2 engine of one model
  never see each other's chunks (their pages hold different bytes).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from tests.integration.harness import DaemonThread
from tests.vllm.harness import NUM_LAYERS, VllmHarness
from tests.vllm.prompts import compute, prompt_of, settle

BLOCK = 16


@pytest.fixture
def daemon() -> Iterator[DaemonThread]:
    d = DaemonThread(capacity=64 << 20).start()
    yield d
    d.stop()


def extra_for(daemon: DaemonThread, **more: object) -> dict[str, object]:
    return {
        "spec_name": "OffloaddSpec",
        "spec_module_path": "offloadd.vllm",
        "offloadd_endpoint": daemon.endpoint,
        **more,
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_mla_is_stored_once_and_every_rank_loads_it(
    tmp_path: Path, daemon: DaemonThread, tp: int
) -> None:
    chunk_tokens = 64  # 4 blocks of 2 layers x 16 tokens x 48 bf16: 12 KiB, arena-aligned
    prompt = prompt_of(200)
    with VllmHarness(
        tmp_path, extra_for(daemon, block_size=chunk_tokens), tensor_parallel_size=tp, model="mla"
    ) as h:
        spec = h.ranks[0].offloading_spec
        assert spec.config.replicated_layout  # vLLM's own verdict, not ours
        assert spec.offloadd_config.replicated_layout
        one_copy = spec.config.worker_kv_bytes_per_block * (chunk_tokens // BLOCK)
        assert one_copy % 4096 == 0
        a = compute(h, prompt)
        chunks = 200 // chunk_tokens
        settle(h, chunks)
        assert daemon.daemon is not None
        stats = daemon.daemon.stats()
        assert stats.committed_entries == chunks
        # One copy per chunk whatever the TP size: rank 0's shard, nobody else's.
        assert stats.used_bytes == chunks * one_copy
        (engine,) = (e for e in daemon.daemon.registry.engines() if e.ready)
        assert engine.namespace is not None
        assert engine.namespace.shard_sizes == [(one_copy,)]
        h.reset_prefix_cache()  # zero every rank's KV
        b = compute(h, prompt[:150] + prompt_of(9, seed=5))
        assert h.external_tokens(b) == 128
        # Every rank's every loaded page equals the latent bytes A computed (the same on
        # every rank), so each rank read the one shard.
        assert h.assert_loaded_pages(b) == 128 // BLOCK * NUM_LAYERS * tp
        assert h.external_tokens(a) == 0


def test_direct_layout_namespaces_are_keyed_by_tp(tmp_path: Path, daemon: DaemonThread) -> None:
    prompt = prompt_of(100)
    extra = extra_for(daemon)
    with VllmHarness(tmp_path, extra, tensor_parallel_size=1, engine_id="tp1") as h1:
        compute(h1, prompt)
        settle(h1, 6)
        with VllmHarness(tmp_path, extra, tensor_parallel_size=2, engine_id="tp2") as h2:
            b = compute(h2, prompt[:70] + prompt_of(7, seed=1))
            assert h2.external_tokens(b) == 0  # TP=1's chunks are not TP=2's
            settle(h2, 4)  # it stored its own (77 tokens: 4 chunks)
            assert daemon.daemon is not None
            namespaces = {e.namespace for e in daemon.daemon.stats().engines}
            assert len(namespaces) == 2
            assert daemon.daemon.stats().committed_entries == 6 + 4
            h1.reset_prefix_cache()
            c = compute(h1, prompt[:70] + prompt_of(7, seed=2))
            # TP=1 finds its own 64 tokens, never TP=2's copies of them.
            assert h1.external_tokens(c) == 64
            assert h1.assert_loaded_pages(c) == 4 * NUM_LAYERS

"""vLLM's canonical layout through vLLM 0.33's real scheduler and worker connectors.

With ``canonical_layout: true`` vLLM gives each rank a ``CanonicalPageMapping`` per layer: copy
runs from the rank's page into a parallelism-free page (all KV heads). The daemon keeps one
canonical chunk per key, which the engine's ranks fill together (each its own heads) and
which becomes visible only when every rank has written; its namespace carries no TP size, so
a TP=1 and a TP=2 engine of the same model share keys and load each other's bytes. With fewer
KV heads than TP ranks vLLM replicates each head over several ranks: one of them (elected per
key) writes each canonical byte, every rank loads its heads, and the chunk is visible when
every head shard's writer has written.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from offloadd.errors import InvalidRequest
from offloadd.server.registry import elected_keys
from offloadd.vllm import regions
from protocol.handles import CanonicalPage

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from offloadd.server.daemon import Daemon
from tests.integration.harness import DaemonThread
from tests.vllm.harness import NUM_LAYERS, VllmHarness, layer_name
from tests.vllm.prompts import compute, extra_for, prompt_of, settle

BLOCK = 16
CHUNK = 32  # tokens per offloaded chunk: 2 GPU blocks
# Head-major pages (vLLM's default here): a TP=2 rank's page is one contiguous piece of the
# canonical page. Token-major pages: its heads of each token are a fragment of their own,
# one canonical token row apart.
LAYOUTS = pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])


@pytest.fixture
def daemon() -> Iterator[DaemonThread]:
    d = DaemonThread(capacity=64 << 20).start()
    yield d
    d.stop()


def canonical(daemon: DaemonThread) -> dict[str, object]:
    return extra_for(daemon, block_size=CHUNK, canonical_layout=True)


def running(daemon: DaemonThread) -> Daemon:
    assert daemon.daemon is not None
    return daemon.daemon


def namespace_of(daemon: DaemonThread, engine_id: str) -> str:
    (engine,) = (e for e in running(daemon).registry.engines() if e.ready and e.key[0] == engine_id)
    assert engine.namespace is not None
    return engine.namespace.name


def head_slice(h: VllmHarness, rank: int, layer: int, block_id: int) -> torch.Tensor:
    """The KV of one block of a layer on a rank, as (heads, tokens, bytes)."""
    return h.ranks[rank].kv_bytes[layer_name(layer)][block_id]


def stored_bytes_by_rank(h: VllmHarness) -> list[int]:
    """Bytes each rank's finished jobs copied from now on (what its JobDones said), by rank."""
    copied = [0] * len(h.ranks)
    for state in h.ranks:
        worker = state.offloading_worker
        real = worker.get_finished

        def spy(rank: int = state.rank, real: Any = real) -> Any:
            results = real()
            copied[rank] += sum(result.transfer_size or 0 for result in results)
            return results

        worker.get_finished = spy
    return copied


def all_heads(h: VllmHarness, layer: int, block_id: int) -> torch.Tensor:
    """Every KV head of one block of a layer, in head order: one rank per head shard."""
    first: dict[int, int] = {}
    for rank in range(len(h.ranks)):
        first.setdefault(h.kv_rank(rank), rank)
    return torch.cat([head_slice(h, first[shard], layer, block_id) for shard in sorted(first)])


@LAYOUTS
def test_tp2_canonical_chunks_are_one_shard_both_ranks_fill(
    tmp_path: Path, daemon: DaemonThread, layout: str
) -> None:
    prompt = prompt_of(100)
    with VllmHarness(
        tmp_path, canonical(daemon), tensor_parallel_size=2, kv_cache_layout=layout
    ) as h:
        spec = h.ranks[0].offloading_spec
        assert spec.config.canonical_layout and spec.offloadd_config.canonical_layout
        assert spec.config.parallel.is_parallelism_agnostic  # vLLM's own verdict
        for state in h.ranks:  # each rank's regions carry its fragments of the canonical page
            regions = state.offloading_worker._regions
            assert regions and all(r.canonical is not None for r in regions)
            assert all(r.canonical.page_size == 2 * r.page_size for r in regions)
            fragments = {run[3] for r in regions for run in r.canonical.runs}
            assert fragments == ({1} if layout == "LBHNC" else {BLOCK})
        a = compute(h, prompt)
        chunks = 100 // CHUNK
        settle(h, chunks)
        stats = running(daemon).stats()
        assert stats.committed_entries == chunks
        # One canonical chunk per key: both ranks' heads, stored once.
        chunk_bytes = 2 * spec.config.worker_kv_bytes_per_block * (CHUNK // BLOCK)
        (engine,) = (e for e in running(daemon).registry.engines() if e.ready)
        assert engine.namespace is not None
        assert engine.namespace.shard_sizes == [(chunk_bytes,)]
        assert engine.namespace.writers == 2
        assert stats.used_bytes == chunks * chunk_bytes
        h.reset_prefix_cache()  # zero every rank's KV
        b = compute(h, prompt[:70] + prompt_of(9, seed=5))
        assert h.external_tokens(b) == 64
        # Every rank's every loaded page holds its own heads' bytes.
        assert h.assert_loaded_pages(b) == 64 // BLOCK * NUM_LAYERS * 2
        assert h.external_tokens(a) == 0


def test_tp1_canonical_round_trip(tmp_path: Path, daemon: DaemonThread) -> None:
    prompt = prompt_of(100)
    with VllmHarness(tmp_path, canonical(daemon), tensor_parallel_size=1) as h:
        compute(h, prompt)
        settle(h, 3)
        (engine,) = (e for e in running(daemon).registry.engines() if e.ready)
        assert engine.namespace is not None and engine.namespace.writers == 1
        h.reset_prefix_cache()
        b = compute(h, prompt[:70] + prompt_of(9, seed=5))
        assert h.external_tokens(b) == 64
        assert h.assert_loaded_pages(b) == 64 // BLOCK * NUM_LAYERS


@pytest.mark.parametrize(
    ("store_tp", "load_tp", "kv_heads", "layout"),
    [
        *[(s, t, 2, layout) for s, t in [(1, 2), (2, 1)] for layout in ("LBHNC", "LBNHC")],
        # KV heads replicated over ranks on either side.
        (1, 2, 1, "LBHNC"),
        (2, 1, 1, "LBNHC"),
        (1, 4, 2, "LBNHC"),
        (4, 1, 2, "LBHNC"),
        (4, 2, 2, "LBHNC"),
    ],
)
def test_canonical_chunks_are_shared_across_tp(
    tmp_path: Path, daemon: DaemonThread, store_tp: int, load_tp: int, kv_heads: int, layout: str
) -> None:
    prompt = prompt_of(100)
    with VllmHarness(
        tmp_path,
        canonical(daemon),
        tensor_parallel_size=store_tp,
        engine_id="a",
        kv_cache_layout=layout,
        num_kv_heads=kv_heads,
    ) as ha:
        a = compute(ha, prompt)
        settle(ha, 3)
        stored = running(daemon).stats().committed_entries
        assert stored == 3
        with VllmHarness(
            tmp_path,
            canonical(daemon),
            tensor_parallel_size=load_tp,
            engine_id="b",
            kv_cache_layout=layout,
            num_kv_heads=kv_heads,
        ) as hb:
            assert namespace_of(daemon, "a") == namespace_of(daemon, "b")
            settle(hb, 3)  # B's mirror shows A's chunks: one namespace
            b = compute(hb, prompt[:70] + prompt_of(9, seed=5))
            # Exactly the shared tokens: two whole chunks of the 70 shared ones.
            assert hb.external_tokens(b) == 64
            assert hb.assert_loaded_pages(b) == 64 // BLOCK * NUM_LAYERS * load_tp
            # Every loaded fragment equals the bytes A computed: B's rank r holds A's heads
            # [s * heads_b, (s + 1) * heads_b) of its head shard s, block by block, in every
            # layer (ranks of one shard, replicas, hold the same heads).
            heads_b = max(1, kv_heads // load_tp)
            loaded = hb.loaded_blocks(b)
            assert [index for _, index, _ in loaded] == list(range(64 // BLOCK))
            table_a = {index: block for _, index, block in ha.stored_blocks(a)}
            for _, index, block_b in loaded:
                for layer in range(NUM_LAYERS):
                    whole = all_heads(ha, layer, table_a[index])
                    assert whole.shape[0] == kv_heads
                    for r in range(load_tp):
                        got = head_slice(hb, r, layer, block_b)
                        shard = hb.kv_rank(r)
                        want = whole[shard * heads_b : (shard + 1) * heads_b]
                        assert torch.equal(got, want), (index, layer, r)
            # B's 79 tokens hold 2 whole chunks, both A's: it stored nothing new.
            assert running(daemon).stats().committed_entries == stored
            # B stores a chunk into the namespace A's engine made, with B's own writers
            # (not A's count), and A loads it back: every page of A's ranks exact.
            longer = prompt + prompt_of(40, seed=7)
            compute(hb, longer)
            settle(hb, stored + 1)
            assert running(daemon).stats().committed_entries == stored + 1
            ha.reset_prefix_cache()
            settle(ha, stored + 1)
            c = compute(ha, longer)
            assert ha.external_tokens(c) == 4 * CHUNK
            assert ha.assert_loaded_pages(c) == 4 * CHUNK // BLOCK * NUM_LAYERS * store_tp


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 1), (4, 1), (4, 2)])
def test_replicated_kv_heads_are_written_once_and_loaded_by_every_rank(
    tmp_path: Path, daemon: DaemonThread, tp: int, kv_heads: int
) -> None:
    """More TP ranks than KV heads: vLLM's mappings say ``tp // kv_heads`` ranks hold each
    head; the daemon has one writer per head shard, and one replica per key copies it."""
    prompt = prompt_of(100)
    with VllmHarness(
        tmp_path, canonical(daemon), tensor_parallel_size=tp, num_kv_heads=kv_heads
    ) as h:
        spec = h.ranks[0].offloading_spec
        assert spec.config.parallel.is_parallelism_agnostic  # vLLM's own verdict
        assert not spec.config.replicated_layout
        for state in h.ranks:
            assert {r.canonical.writers for r in state.offloading_worker._regions} == {
                tp // kv_heads
            }
        (engine,) = (e for e in running(daemon).registry.engines() if e.ready)
        assert engine.canonical is not None and engine.namespace is not None
        assert engine.canonical.writers == engine.namespace.writers == kv_heads
        copied = stored_bytes_by_rank(h)
        compute(h, prompt)
        settle(h, 3)
        # One canonical copy of every head per chunk, each byte copied by exactly one rank.
        shard_bytes = spec.config.worker_kv_bytes_per_block * (CHUNK // BLOCK)  # one head's
        chunk_bytes = kv_heads * shard_bytes
        assert engine.namespace.shard_sizes == [(chunk_bytes,)]
        stats = running(daemon).stats()
        assert stats.committed_entries == 3
        assert stats.used_bytes == stats.bytes_stored == 3 * chunk_bytes
        # The elected replica of each key (rotating by key) copied it; the others nothing.
        keys = list(h.offloading_manager._mirror.keys)
        assert len(keys) == 3
        want = [len(elected_keys(engine, rank, keys)) * shard_bytes for rank in range(tp)]
        assert copied == want and sum(want) == 3 * chunk_bytes
        h.reset_prefix_cache()  # zero every rank's KV, the replicas' too
        b = compute(h, prompt[:70] + prompt_of(9, seed=5))
        assert h.external_tokens(b) == 64
        assert h.assert_loaded_pages(b) == 64 // BLOCK * NUM_LAYERS * tp


def test_overlapping_canonical_writers_are_refused(
    tmp_path: Path, daemon: DaemonThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank whose canonical runs overlap another's without being the same bytes (two
    writers of one byte, and a gap) keeps the engine from ever becoming ready."""
    real = regions.canonical_page

    def overlapping(mapping: object) -> CanonicalPage | None:
        page = real(mapping)
        if page is None:
            return None
        # Rank 1's head lands half a page early: over rank 0's second half.
        runs = tuple((lo, co // 2, *rest) for lo, co, *rest in page.runs)
        return CanonicalPage(page.page_size, runs, page.writers, page.agnostic)  # type: ignore[arg-type]

    monkeypatch.setattr(regions, "canonical_page", overlapping)
    with pytest.raises(InvalidRequest, match="ranks 0 and 1 write overlapping canonical bytes"):
        VllmHarness(tmp_path, canonical(daemon), tensor_parallel_size=2)
    assert not any(e.ready for e in running(daemon).registry.engines())


@pytest.mark.parametrize("model", ["llama", "mla"])
def test_dcp_canonical_round_trip_kept_apart_from_other_parallel_sizes(
    tmp_path: Path, daemon: DaemonThread, model: str
) -> None:
    """Decode context parallelism: DCP=2 over TP=2 ranks that both hold the one KV head (or
    MLA's latent). Each rank holds every other token of a 32-token block; vLLM's mappings
    interleave them into one canonical page of all 32 tokens, both ranks writers of their
    own tokens. vLLM marks
    such pages not parallelism-agnostic (context parallel token sharding), so the namespace
    keeps the parallel layout: a TP=1 engine of blocks of the same 32 tokens shares nothing,
    although (checked here) the canonical bytes it stores are the same."""
    prompt = prompt_of(100)
    with VllmHarness(
        tmp_path,
        canonical(daemon),
        tensor_parallel_size=2,
        num_kv_heads=1,
        decode_context_parallel_size=2,
        engine_id="dcp",
        model=model,
    ) as h:
        spec = h.ranks[0].offloading_spec
        assert spec.config.parallel.dcp_size == 2
        assert not spec.config.parallel.is_parallelism_agnostic
        assert not spec.config.replicated_layout  # MLA too: the ranks hold other tokens
        assert h.block_size == CHUNK  # a block spans both ranks' 16 tokens
        for state in h.ranks:
            for region in state.offloading_worker._regions:
                assert region.canonical.page_size == 2 * region.page_size
                assert (region.canonical.writers, region.canonical.agnostic) == (1, False)
        (engine,) = (e for e in running(daemon).registry.engines() if e.ready)
        assert engine.canonical is not None and engine.canonical.writers == 2
        copied = stored_bytes_by_rank(h)
        compute(h, prompt)
        settle(h, 3)
        rank_bytes = spec.config.worker_kv_bytes_per_block  # one block per chunk
        stats = running(daemon).stats()
        assert stats.committed_entries == 3
        aligned = -(-2 * rank_bytes // 4096) * 4096  # the arena's extents are 4 KiB aligned
        assert (stats.used_bytes, stats.bytes_stored) == (3 * aligned, 3 * 2 * rank_bytes)
        assert copied == [3 * rank_bytes, 3 * rank_bytes]  # each rank its own tokens
        h.reset_prefix_cache()
        b = compute(h, prompt[:70] + prompt_of(9, seed=5))
        assert h.external_tokens(b) == 64
        assert h.assert_loaded_pages(b) == 64 // CHUNK * NUM_LAYERS * 2  # both ranks
        with VllmHarness(
            tmp_path,
            canonical(daemon),
            tensor_parallel_size=1,
            num_kv_heads=1,
            # vLLM's CPU MLA backend takes 16-token blocks only (its keys then hash other
            # spans: nothing to compare bytes with).
            block_size=CHUNK if model == "llama" else BLOCK,
            engine_id="tp1",
            model=model,
        ) as h1:
            dcp, tp1 = namespace_of(daemon, "dcp"), namespace_of(daemon, "tp1")
            assert dcp != tp1
            c = compute(h1, prompt[:70] + prompt_of(9, seed=6))
            assert h1.external_tokens(c) == 0
            if model != "llama":
                return
            settle(h1, 2)
            cache, arena = running(daemon)._cache, running(daemon)._arena
            assert cache is not None and arena is not None
            for key in h1.offloading_manager._mirror.keys:
                ours, theirs = cache.get(tp1, key), cache.get(dcp, key)
                assert ours is not None and theirs is not None
                assert ours.sizes == theirs.sizes
                assert bytes(arena.view(ours.offsets[0], ours.sizes[0])) == bytes(
                    arena.view(theirs.offsets[0], theirs.sizes[0])
                )


def test_canonical_and_direct_layouts_never_share(tmp_path: Path, daemon: DaemonThread) -> None:
    prompt = prompt_of(100)
    with VllmHarness(tmp_path, canonical(daemon), engine_id="canon") as h1:
        compute(h1, prompt)
        settle(h1, 3)
        direct = extra_for(daemon, block_size=CHUNK)
        with VllmHarness(tmp_path, direct, engine_id="direct") as h2:
            assert namespace_of(daemon, "canon") != namespace_of(daemon, "direct")
            b = compute(h2, prompt[:70] + prompt_of(9, seed=5))
            assert h2.external_tokens(b) == 0


def test_mla_canonical_is_stored_once_and_shared_across_tp(
    tmp_path: Path, daemon: DaemonThread
) -> None:
    """Pure MLA in the canonical layout: vLLM marks it replicated (every rank holds the whole
    latent page), so rank 0 alone writes the one canonical copy, at TP=2 as at TP=1."""
    prompt = prompt_of(100)
    with VllmHarness(
        tmp_path, canonical(daemon), tensor_parallel_size=2, model="mla", engine_id="a"
    ) as ha:
        spec = ha.ranks[0].offloading_spec
        assert spec.config.canonical_layout and spec.config.replicated_layout
        compute(ha, prompt)
        settle(ha, 3)
        one_copy = spec.config.worker_kv_bytes_per_block * (CHUNK // BLOCK)
        (engine,) = (e for e in running(daemon).registry.engines() if e.ready)
        assert engine.namespace is not None
        assert engine.namespace.shard_sizes == [(one_copy,)]  # one latent copy, not two
        aligned = -(-one_copy // 4096) * 4096  # the arena's extents are 4 KiB aligned
        stats = running(daemon).stats()
        assert (stats.committed_entries, stats.used_bytes) == (3, 3 * aligned)
        with VllmHarness(
            tmp_path, canonical(daemon), tensor_parallel_size=1, model="mla", engine_id="b"
        ) as hb:
            assert namespace_of(daemon, "a") == namespace_of(daemon, "b")
            settle(hb, 3)
            b = compute(hb, prompt[:70] + prompt_of(9, seed=5))
            assert hb.external_tokens(b) == 64
            assert hb.assert_loaded_pages(b) == 64 // BLOCK * NUM_LAYERS

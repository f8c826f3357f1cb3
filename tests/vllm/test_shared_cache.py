"""Two data-parallel vLLM engines share one daemon whose arena is smaller than their working
set: the cache keeps admitting. Both engines are vLLM's real scheduler and worker connectors
(the harness), the daemon is a real one; every request's hits are loaded and every loaded page
is checked. The total hit rate is compared with an exact shared LRU of the same capacity
(``tests.helpers.shared_lru_hits``) over the same requests, and the refused keys with the
keys offered.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from offloadd.vllm.manager import OffloaddManager
from tests.helpers import shared_lru_hits
from tests.integration.harness import DaemonThread
from tests.vllm.harness import NUM_LAYERS, VllmHarness, sampled_token

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
CHUNK_BYTES = 4096  # one aligned extent per chunk of the tiny model (checked below)
ARENA_CHUNKS = 40
DOCUMENTS = 24
DOCUMENT_CHUNKS = 4
REQUESTS = 160


def workload(seed: int = 7) -> list[list[int]]:
    """Zipf-popular documents of 4 chunks, each request one of them plus 21 tokens of its
    own (one more full chunk): 24 x 4 shared chunks plus 160 unique ones through 40 slots."""
    rnd = random.Random(seed)
    docs = [[rnd.randrange(3, 1000) for _ in range(DOCUMENT_CHUNKS * BLOCK)] for _ in range(24)]
    weights = [1 / (rank + 1) for rank in range(DOCUMENTS)]
    prompts = []
    for _ in range(REQUESTS):
        (doc,) = rnd.choices(docs, weights)
        prompts.append(doc + [rnd.randrange(3, 1000) for _ in range(BLOCK + 5)])
    return prompts


def chunk_keys(prompt: list[int]) -> list[object]:
    return [tuple(prompt[: (i + 1) * BLOCK]) for i in range(len(prompt) // BLOCK)]


def settle(d: DaemonThread, managers: list[OffloaddManager]) -> None:
    """Wait until the daemon's copies are done and both mirrors show every committed chunk."""
    assert d.daemon is not None
    deadline = time.monotonic() + 30  # a loaded machine delays the mirror, never the bytes
    while True:
        stats = d.daemon.stats()
        sizes = {len(m._mirror.keys) for m in managers}
        if stats.jobs_in_flight == 0 and sizes == {stats.committed_entries}:
            return
        assert time.monotonic() < deadline, (
            f"mirrors {sizes}, daemon {stats.committed_entries} "
            f"{[len(m._mirror.keys) for m in managers]}"
        )
        time.sleep(0.005)


def test_two_dp_engines_keep_admitting_on_a_full_arena(tmp_path: Path) -> None:
    d = DaemonThread(capacity=ARENA_CHUNKS * CHUNK_BYTES).start()
    try:
        extra = {
            "spec_name": "OffloaddSpec",
            "spec_module_path": "offloadd.vllm",
            "offloadd_endpoint": d.endpoint,
        }
        with (
            VllmHarness(tmp_path, extra, data_parallel_size=2, data_parallel_index=0) as h0,
            VllmHarness(tmp_path, extra, data_parallel_size=2, data_parallel_index=1) as h1,
        ):
            assert 2 * h0.page(0, 0, 0).numel() <= CHUNK_BYTES
            engines = [h0, h1]
            managers = [h.offloading_manager for h in engines]
            assert all(isinstance(m, OffloaddManager) for m in managers)
            prompts = workload()
            hits = loaded = 0
            for i, prompt in enumerate(prompts):
                h = engines[i % 2]  # round robin over the two engines
                h.reset_prefix_cache()  # offload hits only, not the engine's own GPU cache
                req = h.add_request(prompt, max_tokens=1)
                h.run_until_finished()
                assert h.outputs[req] == [sampled_token(prompt)]
                chunks = h.external_tokens(req) // BLOCK
                hits += chunks
                loaded += h.assert_loaded_pages(req)
                assert loaded == hits * NUM_LAYERS
                settle(d, managers)
            assert d.daemon is not None
            stats = d.daemon.stats()
        offered = sum(len(chunk_keys(p)) for p in prompts)
        expected = shared_lru_hits([chunk_keys(p) for p in prompts], ARENA_CHUNKS)
        refused = sum(stats.stores_refused_by_reason.values())
        print(
            f"\nhit rate {hits / offered:.3f} vs shared LRU {expected / offered:.3f}; "
            f"refused {refused} of {offered} keys {stats.stores_refused_by_reason}; "
            f"{stats.evictions} evictions"
        )
        assert stats.evictions > 0  # the arena was smaller than the working set
        assert hits >= 0.9 * expected
        # The goal is 1%; not met yet: 4-6% of the keys are still refused (reason
        # "ack"), stores that reach the daemon before the other engine's scheduler has
        # acknowledged the evictions their room waits for (waiting for the ack instead of
        # dropping is the missing piece). The bound catches the old Reserve path (34%).
        assert refused <= 0.10 * offered
    finally:
        d.stop()

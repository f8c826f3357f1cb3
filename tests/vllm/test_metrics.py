"""vLLM's own ``vllm:kv_offload_*`` series for an engine on offloadd.

vLLM's real Scheduler and OffloadingConnector run against a real daemon (tests/vllm/harness.py);
each step's ``SchedulerStats`` (what the engine core sends its stat loggers) is fed to vLLM's
own ``PrometheusStatLogger``, and the series it builds are read back from the registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

from offloadd.vllm.stats import chunk_bytes
from tests.integration.harness import DaemonThread
from tests.vllm.harness import VllmHarness
from tests.vllm.prompts import A_PROMPT, b_prompt, compute, extra_for, settle

CAPACITY = 64 << 20


@pytest.fixture
def daemon() -> Iterator[DaemonThread]:
    d = DaemonThread(capacity=CAPACITY).start()
    yield d
    d.stop()


def _payloads(h: VllmHarness) -> list[dict[str, Any]]:
    return [s.kv_connector_stats for s in h.scheduler_stats if s.kv_connector_stats]


def _sample(name: str, labels: dict[str, str]) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_offload_stats_reach_vllms_prometheus_series(tmp_path: Path, daemon: DaemonThread) -> None:
    with VllmHarness(tmp_path, extra_for(daemon), tensor_parallel_size=2) as h:
        unregister_vllm_metrics()
        prom = PrometheusStatLogger(h.vllm_config, engine_indexes=[0])
        try:
            compute(h, A_PROMPT)  # 6 chunks stored
            settle(h, 6)
            h.reset_prefix_cache()
            b = compute(h, b_prompt(70))  # 4 of them loaded
            assert h.external_tokens(b) == 64
            for stats in h.scheduler_stats:
                prom.record(stats, None, engine_idx=0)

            assert daemon.daemon is not None
            counters = daemon.daemon.stats()
            assert counters.bytes_stored > 0 and counters.bytes_loaded > 0
            total = OffloadingConnectorStats()
            for payload in _payloads(h):
                total.aggregate(OffloadingConnectorStats(data=payload))
            flat = total.reduce()
            # Transfer series: the ranks' bytes, summed as the daemon counted them.
            assert flat["vllm:kv_offload_store_bytes"] == counters.bytes_stored
            assert flat["vllm:kv_offload_load_bytes"] == counters.bytes_loaded
            assert flat["vllm:kv_offload_load_size_count"] == 2 * len(h.load_jobs[b])
            assert flat["vllm:kv_offload_store_time"] >= 0
            # Manager series: room asked for the 6 chunks; nothing pinned once all is done.
            assert flat["vllm:kv_offload_cpu_allocation_size_sum"] == 6
            assert flat["vllm:kv_offload_cpu_cache_usage_perc"] == 0
            write_usage = [
                value
                for payload in _payloads(h)
                for value in payload["data"]
                .get("vllm:kv_offload_cpu_cache_write_usage_perc", {})
                .values()
            ]
            assert max(write_usage) > 0  # stores reserved, not yet written by the ranks
            # Config info, once: the daemon's capacity in this engine's chunks.
            (info,) = [p["info"] for p in _payloads(h) if p.get("info") is not None]
            chunk = chunk_bytes(h.offloading_manager._config)
            assert info == [
                {
                    "cpu_num_chunks": CAPACITY // chunk,
                    "cpu_blocks_per_chunk": 1,
                    "cpu_kv_cache_size_bytes": CAPACITY // chunk * chunk,
                    "cpu_kv_cache_size_tokens": info[0]["cpu_kv_cache_size_tokens"],
                }
            ]
            assert int(info[0]["cpu_kv_cache_size_tokens"]) > 0
            # Hits: vLLM's external prefix cache counters, from host memory.
            hits = [s.connector_prefix_cache_stats for s in h.scheduler_stats]
            assert sum(c.hits for c in hits if c is not None) == 64
            sources: dict[CacheHitSource, int] = {}
            for c in hits:
                for source, n in (c.hits_by_source if c is not None else {}).items():
                    sources[source] = sources.get(source, 0) + n
            assert sources == {CacheHitSource.HOST: 64}

            # What vLLM's Prometheus logger exports from them.
            model = cast(str, h.vllm_config.model_config.served_model_name)
            labels = {"model_name": model, "engine": "0"}
            assert _sample("vllm:kv_offload_store_bytes_total", labels) == counters.bytes_stored
            assert _sample("vllm:kv_offload_load_bytes_total", labels) == counters.bytes_loaded
            assert _sample("vllm:kv_offload_load_size_count", labels) == 2 * len(h.load_jobs[b])
            assert _sample("vllm:kv_offload_cpu_allocation_size_sum", labels) == 6
            assert _sample("vllm:kv_offload_cpu_cache_usage_perc", labels) == 0
            assert _sample("vllm:external_prefix_cache_hits_total", labels) == 64
            host = {**labels, "source": "host"}
            assert _sample("vllm:prompt_tokens_cached_by_source_total", host) == 64
            info_labels = {k: str(v) for k, v in info[0].items()}
            assert _sample("vllm:kv_offload_config_info", {**labels, **info_labels}) == 1
        finally:
            unregister_vllm_metrics()

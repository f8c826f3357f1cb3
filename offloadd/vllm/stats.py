"""What vLLM 0.33 builds its ``vllm:kv_offload_*`` series from, for an engine on offloadd.

vLLM's ``OffloadingConnector`` reads three things from an out-of-tree spec, and publishes them
exactly as for its own CPU spec:

- ``OffloadingSpec.build_metric_definitions`` (a classmethod, read in the API server): the
  spec's own series. A name the manager reports must be declared there, or vLLM's Prometheus
  logger fails an assertion. Ours are the CPU spec's names (``CPUOffloadingMetrics``), so a
  dashboard built for ``CPUOffloadingSpec`` reads an engine on offloadd unchanged.
- ``OffloadingManager.get_stats`` (scheduler, every step, under the manager's lock): one
  ``OffloadingConnectorStats`` payload of what happened since the last call. ``ManagerStats``
  below keeps the counts the manager feeds it.
- ``OffloadingManager.config_info`` (scheduler, once, with the first payload): the labels of
  ``vllm:kv_offload_config_info``; the spec declares their names (``config_info_keys``).

The transfer series (``vllm:kv_offload_{load,store}_{bytes,time,size}``) need nothing here:
vLLM builds them from the ``TransferResult`` sizes and times the ranks' worker returns. The
connector's own series (lookup delays, allocation failures) and the hit counters
(``vllm:external_prefix_cache_hits``, ``vllm:prompt_tokens_cached_by_source``, whose source
is ``OffloadingManager.get_load_source``) come from vLLM's scheduler itself.

Usage means what it means for the CPU spec: the fraction of the cache pinned by this engine's
transfers (chunks being stored, chunks held for loads), over the daemon's capacity, which every
engine on the node shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import ConfigInfoMapping, OffloadingMetricMetadata
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from protocol.config import OffloadingConfig

__all__ = ["ManagerStats", "config_info_keys", "metric_definitions"]


def metric_definitions(extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
    """The CPU spec's series (usage gauges, allocation sizes), with its help texts and buckets."""
    # offloadd has no store threshold: without one the CPU spec declares no skipped-store counter.
    extra = {key: value for key, value in extra_config.items() if key != "store_threshold"}
    return CPUOffloadingSpec.build_metric_definitions(extra)


def config_info_keys() -> tuple[str, ...]:
    """The labels of ``vllm:kv_offload_config_info``: the CPU spec's (``cpu_num_chunks``...)."""
    return CPUOffloadingInfo.config_info_keys()


def chunk_bytes(config: OffloadingConfig) -> int:
    """Bytes one chunk of this engine takes in the daemon: every rank's shard of its blocks."""
    shards = 1 if config.replicated_layout else config.parallel.world_size
    return config.worker_kv_bytes_per_block * config.cache.blocks_per_chunk * shards


class ManagerStats:
    """The counts behind ``OffloaddManager.get_stats``; the manager calls it under its lock."""

    def __init__(self, config: OffloadingConfig) -> None:
        self._config = config
        self.chunk_bytes = chunk_bytes(config)
        self.capacity_bytes: int | None = None  # the daemon's, asked once it answers
        self.held_chunks = 0  # chunks this engine's loads pin (prepare_load to complete_load)
        self._allocations: list[int] = []

    @property
    def capacity_chunks(self) -> int:
        """The daemon's capacity in this engine's chunks (0 until it is known)."""
        if not self.capacity_bytes or self.chunk_bytes <= 0:
            return 0
        return self.capacity_bytes // self.chunk_bytes

    def allocated(self, chunks: int) -> None:
        """A ``prepare_store`` asked the daemon for room for ``chunks`` chunks."""
        self._allocations.append(chunks)

    def loading(self, chunks: int) -> None:
        """A ``prepare_load`` pinned ``chunks`` chunks."""
        self.held_chunks += chunks

    def loaded(self, chunks: int) -> None:
        """A ``complete_load`` released ``chunks`` chunks."""
        self.held_chunks = max(self.held_chunks - chunks, 0)

    def take(self, storing_chunks: int) -> OffloadingConnectorStats:
        """The payload for this step: usage now, and the allocations since the last call."""
        stats = OffloadingConnectorStats()
        capacity = self.capacity_chunks
        write = min(storing_chunks / capacity, 1.0) if capacity else 0.0
        read = min(self.held_chunks / capacity, 1.0) if capacity else 0.0
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, min(write + read, 1.0))
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, read)
        for size in self._allocations:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self._allocations.clear()
        return stats

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """The CPU spec's facts, for the daemon's capacity (empty while it is unknown)."""
        if self.capacity_bytes is None:
            return [{}]
        num_chunks = self.capacity_chunks
        # vLLM's own arithmetic (tokens at max_model_len), on our copy of its config.
        info = CPUOffloadingInfo.from_config(
            self._config,  # type: ignore[arg-type]
            num_chunks,
            self.chunk_bytes,
        )
        return [info.as_config_info()]

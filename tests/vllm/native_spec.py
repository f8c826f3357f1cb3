"""vLLM's own CPU offloading spec, runnable on a CPU host: the baseline a trace soak measures
offloadd against.

Load it as an out-of-tree spec::

    {"spec_name": "NativeCPUSpec", "spec_module_path": "tests.vllm.native_spec",
     "cpu_bytes_to_use": 32 << 20}

The scheduler side is vLLM 0.33's ``CPUOffloadingSpec`` and its ``CPUOffloadingManager``
unchanged (capacity from ``cpu_bytes_to_use``, LRU eviction, chunk ids as its load and store
specs). Its worker needs CUDA and pinned memory, so the ranks get a worker that copies pages
with torch indexing between the KV tensors and a host store keyed by vLLM's chunk id
(``SimpleWorker``'s copy, addressed by chunk id instead of key): what vLLM's worker does,
without a GPU. Each engine's rank has its own store, as each engine has its own CPU cache.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, LoadStoreSpec, OffloadingWorker
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from tests.vllm.simple_spec import SimpleWorker


class NativeCPUWorker(SimpleWorker):
    """Copies a job's blocks to or from the host chunks vLLM's manager chose."""

    def _chunks(self, spec: LoadStoreSpec) -> list[Any]:
        assert isinstance(spec, CPULoadStoreSpec)
        return [int(chunk) for chunk in spec.block_ids]


class NativeCPUSpec(CPUOffloadingSpec):
    """vLLM's CPU spec with a worker that runs without CUDA."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = NativeCPUWorker(kv_caches, {}, self.blocks_per_chunk, 0)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]

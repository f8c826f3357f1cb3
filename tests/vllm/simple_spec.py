"""A tiny out-of-tree offloading spec, used to prove the vLLM harness works.

Load it the way any out-of-tree spec is loaded::

    {"spec_name": "SimpleSpec", "spec_module_path": "tests.vllm.simple_spec",
     "simple_store": "<namespace>"}

The manager keeps a set of stored keys; the worker copies pages with plain torch
indexing between the `CanonicalKVCaches` tensors and an in-process store
``{key: [per-layer (blocks_per_chunk, page) int8 tensors]}``. Both live in a
module-level namespace (``extra_config["simple_store"]``) so that several
harness engines in one process (data parallel) share one cache, as a real
node-local cache would. The worker's store is keyed by the worker's rank: rank r
only ever reads what rank r wrote.

``extra_config["simple_report_delay"]`` (default 0) holds each finished job back
for that many ``get_finished`` calls, to exercise asynchronous completion.

``extra_config["simple_fault"]`` makes the worker wrong on purpose, so tests can
show the harness notices: ``"skip_loads"`` (loads copy nothing),
``"ignore_skip"`` (a load starting mid-chunk is read from the chunk's first
sub-block), ``"other_rank"`` (loads read rank ``r ^ 1``'s pages).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig


@dataclass
class _Namespace:
    """What one cache holds: the keys that are loadable, and each rank's pages."""

    stored: set[OffloadKey] = field(default_factory=set)
    # rank -> key -> one (blocks_per_chunk, page_size_bytes) tensor per layer ref
    pages: dict[int, dict[OffloadKey, list[torch.Tensor]]] = field(default_factory=dict)


_NAMESPACES: dict[str, _Namespace] = {}


def namespace(name: str) -> _Namespace:
    """The shared state behind ``extra_config["simple_store"] == name``."""
    return _NAMESPACES.setdefault(name, _Namespace())


def drop_namespace(name: str) -> None:
    _NAMESPACES.pop(name, None)


class SimpleLoadStoreSpec(LoadStoreSpec):
    """Names the chunks to copy: keys in group-major, chunk order."""

    def __init__(self, keys: Iterable[OffloadKey]):
        self.keys = list(keys)

    def __repr__(self) -> str:
        return f"SimpleLoadStoreSpec({len(self.keys)} keys)"


class SimpleManager(OffloadingManager):
    def __init__(self, ns: _Namespace, emit_events: bool):
        self._ns = ns
        self._pending: set[OffloadKey] = set()
        self._emit_events = emit_events
        self._events: list[OffloadingEvent] = []
        # Counters a test can assert on.
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._count("lookup")
        return LookupResult.HIT if key in self._ns.stored else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        self._count("prepare_load")
        missing = [k for k in keys if k not in self._ns.stored]
        assert not missing, f"prepare_load of keys never stored: {missing}"
        return SimpleLoadStoreSpec(keys)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        self._count("prepare_store")
        new = [k for k in keys if k not in self._ns.stored and k not in self._pending]
        self._pending.update(new)
        return PrepareStoreOutput(
            keys_to_store=new, store_spec=SimpleLoadStoreSpec(new), evicted_keys=[]
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self._count("complete_store")
        keys = list(keys)
        self._pending.difference_update(keys)
        if success:
            self._ns.stored.update(keys)
            if self._emit_events:
                self._events.append(OffloadingEvent(keys=keys, medium=Medium.CPU, removed=False))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._count("complete_load")

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        yield from events

    def reset_cache(self) -> None:
        self._count("reset_cache")
        removed = list(self._ns.stored)
        self._ns.stored.clear()
        for pages in self._ns.pages.values():
            pages.clear()
        if self._emit_events and removed:
            self._events.append(OffloadingEvent(keys=removed, medium=Medium.CPU, removed=True))


class SimpleWorker(OffloadingWorker):
    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        pages: dict[OffloadKey, list[torch.Tensor]],
        blocks_per_chunk: int,
        report_delay: int,
        fault: str | None = None,
        load_pages: dict[OffloadKey, list[torch.Tensor]] | None = None,
    ):
        self.kv_caches = kv_caches
        self._pages = pages
        self._load_pages = pages if load_pages is None else load_pages
        self._bpc = blocks_per_chunk
        self._report_delay = report_delay
        self._fault = fault
        # [job result, get_finished calls still to wait]
        self._done: list[list[object]] = []
        # Per job: (group, key, sub-block, gpu block id) copied; for tests.
        self.log: dict[int, list[tuple[int, OffloadKey, int, int]]] = {}

    def _walk(
        self, gpu: GPULoadStoreSpec, keys: list[OffloadKey], honour_skip: bool = True
    ) -> Iterable[tuple[int, OffloadKey, int, int]]:
        """Yield (group, key, sub-block index in the chunk, GPU block id)."""
        block_ids = [int(b) for b in gpu.block_ids]
        key_idx = -1
        offset = 0
        for group, (size, first_index) in enumerate(
            zip(gpu.group_sizes, gpu.block_indices, strict=True)
        ):
            if not honour_skip:
                first_index -= first_index % self._bpc
            for j in range(size):
                position = first_index + j
                sub = position % self._bpc
                if j == 0 or sub == 0:
                    key_idx += 1
                yield group, keys[key_idx], sub, block_ids[offset + j]
            offset += size
        assert key_idx == len(keys) - 1, f"{len(keys)} keys but {key_idx + 1} chunks"

    def _copy(
        self, job_id: int, gpu: GPULoadStoreSpec, keys: list[OffloadKey], store: bool
    ) -> None:
        start = time.perf_counter()
        nbytes = 0
        log = self.log.setdefault(job_id, [])
        if not store and self._fault == "skip_loads":
            keys = []
            gpu = GPULoadStoreSpec([], [0] * len(gpu.group_sizes), gpu.block_indices)
        honour_skip = store or self._fault != "ignore_skip"
        for group, key, sub, block_id in self._walk(gpu, keys, honour_skip):
            refs = self.kv_caches.group_data_refs[group]
            if store:
                entry = self._pages.get(key)
                if entry is None:
                    entry = [
                        torch.zeros(self._bpc, ref.page_size_bytes, dtype=torch.int8)
                        for ref in refs
                    ]
                    self._pages[key] = entry
            else:
                entry = self._load_pages[key]
            for ref, chunk in zip(refs, entry, strict=True):
                gpu_page = self.kv_caches.tensors[ref.tensor_idx].tensor[
                    block_id, : ref.page_size_bytes
                ]
                if store:
                    chunk[sub].copy_(gpu_page)
                else:
                    gpu_page.copy_(chunk[sub])
                nbytes += ref.page_size_bytes
            log.append((group, key, sub, block_id))
        result = TransferResult(job_id, True, nbytes, time.perf_counter() - start)
        self._done.append([result, self._report_delay])

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._copy(job_id, src_spec, self._chunks(dst_spec), store=True)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        self._copy(job_id, dst_spec, self._chunks(src_spec), store=False)
        return True

    def _chunks(self, spec: LoadStoreSpec) -> list[OffloadKey]:
        """What names the host chunks of ``spec`` in the store (its keys here)."""
        assert isinstance(spec, SimpleLoadStoreSpec)
        return spec.keys

    def get_finished(self) -> list[TransferResult]:
        ready: list[TransferResult] = []
        waiting: list[list[object]] = []
        for entry in self._done:
            result, delay = entry
            assert isinstance(result, TransferResult) and isinstance(delay, int)
            if delay <= 0:
                ready.append(result)
            else:
                waiting.append([result, delay - 1])
        self._done = waiting
        return ready

    def wait(self, job_ids: set[int]) -> None:
        # Copies are done at submit; waiting only releases them for reporting.
        for entry in self._done:
            result = entry[0]
            assert isinstance(result, TransferResult)
            if result.job_id in job_ids:
                entry[1] = 0


class SimpleSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self._ns = namespace(str(self.extra_config.get("simple_store", "default")))
        self._report_delay = int(self.extra_config.get("simple_report_delay", 0))
        self._fault = self.extra_config.get("simple_fault")
        assert self._fault in (None, "skip_loads", "ignore_skip", "other_rank"), self._fault
        self.manager: SimpleManager | None = None
        self.worker: SimpleWorker | None = None

    def get_manager(self) -> OffloadingManager:
        assert self.manager is None
        self.manager = SimpleManager(self._ns, self.kv_events_config.enable_kv_cache_events)
        return self.manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        assert self.worker is None
        rank = self.config.parallel.rank
        pages = self._ns.pages.setdefault(rank, {})
        load_pages = None
        if self._fault == "other_rank":
            load_pages = self._ns.pages.setdefault(rank ^ 1, {})
        self.worker = SimpleWorker(
            kv_caches, pages, self.blocks_per_chunk, self._report_delay, self._fault, load_pages
        )
        return self.worker

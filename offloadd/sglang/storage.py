"""``OffloaddHiCacheStorage``: offloadd as SGLang 0.5.23's HiCache L3 (``dynamic`` backend).

SGLang builds it as ``OffloaddHiCacheStorage(storage_config, kwargs)``, then calls
``register_mem_pool_host(host_pool)`` once; after that its prefetch, backup and scheduler
threads call, concurrently:

- ``batch_exists(keys)`` -> how many leading keys the daemon holds (one ``Lookup``);
- ``batch_set_v1(keys, host_indices)`` / ``batch_get_v1(keys, host_indices)`` -> one bool
  per key, True when that page was stored / loaded (one ``Store`` or ``Load`` and its
  ``JobDone``). ``host_indices`` are token slots of the host pool, ``page_size`` per key.

Contract kept for SGLang: a call never raises and never returns None (a raise or a None kills
SGLang's prefetch thread); a daemon that is away (not started, killed, restarting) makes
misses and skipped writes, and is connected to again at most once a second; the blocking
client is not thread-safe, so one lock serialises the calls of SGLang's threads.

Copies. With ``"allocator": "shm"`` in the extra config SGLang's host pool lives in a memfd:
its pages are registered with the daemon by descriptor and the daemon copies between the pool
and its arena directly (zero copies in the rank). Otherwise the pool is private memory the
daemon cannot reach, and each page is copied once more, through a staging memfd of
``staging_pages`` pages (default 128, SGLang's batch) that is registered instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from offloadd.client import OffloadClient
from offloadd.endpoint import default_endpoint
from offloadd.errors import DaemonUnavailable, OffloaddError
from offloadd.sglang.layout import (
    PageRun,
    layer_names,
    offload_key,
    offloading_config,
    page_runs,
)
from offloadd.vllm.regions import NotShareable, open_region_files, shared_file_of
from protocol.config import OffloadingConfig
from protocol.handles import KVRegion, ShmHandle

__all__ = ["OffloaddHiCacheStorage"]

logger = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
STAGING_PAGES = 128


class _Staging:
    """A memfd of ``pages`` staged pages, one region per run (the pool's geometry), so the
    namespace is the same as with a shared pool."""

    def __init__(self, runs: Sequence[PageRun], pages: int) -> None:
        self.pages = pages
        self.runs = [PageRun(0, run.size, run.size) for run in runs]
        total = pages * sum(run.size for run in runs)
        self._fd = os.memfd_create("offloadd-sglang-staging", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, total)
        self._mmap = mmap.mmap(self._fd, total, mmap.MAP_SHARED)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        self.path = f"memfd:offloadd-sglang-staging-{uuid.uuid4().hex[:12]}"
        self.offsets = list(itertools.accumulate((pages * run.size for run in runs), initial=0))

    def regions(self) -> list[KVRegion]:
        names = layer_names(self.runs)
        return [
            KVRegion(
                handle=ShmHandle(path=self.path, offset=offset, size=self.pages * run.size),
                num_blocks=self.pages,
                page_size=run.size,
                block_stride=run.size,
                layer_names=(name,),
            )
            for offset, run, name in zip(self.offsets, self.runs, names, strict=False)
        ]

    def files(self) -> dict[str, int]:
        return {self.path: self._fd}

    def copy(self, slot: int, pointers: Sequence[int], *, into_pool: bool) -> None:
        """Copy one page between the pool (``pointers``, one per run) and staging ``slot``."""
        for index, (pointer, run) in enumerate(zip(pointers, self.runs, strict=True)):
            staged = self.base + self.offsets[index] + slot * run.size
            if into_pool:
                ctypes.memmove(pointer, staged, run.size)
            else:
                ctypes.memmove(staged, pointer, run.size)


class OffloaddHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's ``HiCacheStorage`` over one offloadd session for this rank (see the module
    docstring). Extra config keys: ``endpoint`` (default: the daemon's default socket),
    ``timeout`` (seconds a request may take, 5), ``namespace`` (a salt: engines share only
    with the same salt), ``engine_id`` (a prefix of this rank's engine id),
    ``staging_pages`` (128), ``kv_events`` (false)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra: dict[str, Any] = dict(storage_config.extra_config or {})
        if not extra.get("interface_v1"):
            raise ValueError(
                'offloadd needs "interface_v1": 1 in --hicache-storage-backend-extra-config'
            )
        self._storage_config = storage_config
        self._extra = extra
        self._endpoint = str(extra.get("endpoint") or default_endpoint(service=False))
        self._timeout = float(extra.get("timeout", 5.0))
        prefix = str(extra.get("engine_id") or "sglang")
        self._engine_id = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._jobs = itertools.count(1)
        self._client: OffloadClient | None = None
        self._retry_at = 0.0
        self._warned_at = 0.0
        self._config: OffloadingConfig | None = None
        self._regions: list[KVRegion] = []
        self._files: dict[str, int] = {}
        self._staging: _Staging | None = None
        self._pool: Any = None
        self._page_tokens = 0
        self.zero_copy = False

    # -- set-up --------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Describe the host pool's pages to the daemon (by descriptor when it is shared)."""
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        page = int(pool.page_size)
        pages = int(pool.size) // page
        base = int(pool.kv_buffer.data_ptr())

        def meta(index: int) -> tuple[list[int], list[int]]:
            import torch

            indices = torch.arange(index * page, (index + 1) * page, dtype=torch.int64)
            pointers, sizes = pool.get_page_buffer_meta(indices)
            return [int(p) for p in pointers], [int(s) for s in sizes]

        runs = page_runs(base, meta(0), meta(1), meta(pages - 1), pages)
        self._pool, self._page_tokens = pool, page
        config = self._storage_config
        self._config = offloading_config(
            engine_id=self._engine_id,
            model=str(config.model_name or ""),
            dtype=str(pool.dtype),
            page_tokens=page,
            runs=runs,
            layout=str(pool.layout),
            tp_size=int(config.tp_size),
            tp_rank=int(config.tp_rank),
            is_mla=bool(config.is_mla_model),
            pp_size=int(config.pp_size),
            pp_rank=int(config.pp_rank),
            dcp_size=int(getattr(config, "dcp_size", 1)),
            dcp_rank=int(getattr(config, "dcp_rank", 0)),
            salt=str(self._extra.get("namespace", "")),
            events=bool(self._extra.get("kv_events", False)),
        )
        shared = self._shared_regions(pool, runs, pages, base)
        if shared is not None:
            self._regions, self._files = shared
            self.zero_copy = True
        else:
            staging_pages = int(self._extra.get("staging_pages", STAGING_PAGES))
            self._staging = _Staging(runs, staging_pages)
            self._regions, self._files = self._staging.regions(), self._staging.files()
        logger.info(
            "offloadd HiCache storage: tp rank %d of %d, %d-token pages of %d runs, %s",
            config.tp_rank,
            config.tp_size,
            page,
            len(runs),
            "zero copy (shared host pool)" if self.zero_copy else "one staging copy per page",
        )
        with self._lock:
            self._session()

    def _shared_regions(
        self, pool: Any, runs: Sequence[PageRun], pages: int, base: int
    ) -> tuple[list[KVRegion], dict[str, int]] | None:
        """The pool's own pages as regions, when it lives in a shared file (``allocator:
        shm``), with its descriptor; None otherwise."""
        if getattr(pool, "fd", None) is None:
            return None
        span = max(run.offset + (pages - 1) * run.stride + run.size for run in runs)
        try:
            path, offset = shared_file_of(base, span)
        except NotShareable as exc:
            logger.info("host pool not shared (%s): staging copies", exc)
            return None
        names = layer_names(runs)
        regions = [
            KVRegion(
                handle=ShmHandle(path=path, offset=offset + run.offset, size=run.stride * pages),
                num_blocks=pages,
                page_size=run.size,
                block_stride=run.stride,
                layer_names=(name,),
            )
            for run, name in zip(runs, names, strict=True)
        ]
        return regions, open_region_files(regions)

    def _session(self) -> OffloadClient | None:
        """The connected client, or None while the daemon is away (retried once a second)."""
        if self._client is not None:
            return self._client
        now = time.monotonic()
        if now < self._retry_at or self._config is None:
            return None
        try:
            client = OffloadClient.connect(
                self._endpoint,
                self._config,
                self._regions,
                files=self._files,
                name=f"sglang tp{self._storage_config.tp_rank}",
                timeout=self._timeout,
            )
        except (OffloaddError, OSError) as exc:
            self._away(exc)
            return None
        self._client = client
        logger.info("offloadd HiCache storage connected to %s", self._endpoint)
        return client

    def _away(self, exc: BaseException) -> None:
        """Drop the session after a failure; warn at most every 30 s."""
        now = time.monotonic()
        self._retry_at = now + RETRY_SECONDS
        if self._client is not None and isinstance(exc, DaemonUnavailable):
            with contextlib.suppress(Exception):
                self._client.close(goodbye=False)
            self._client = None
        if now - self._warned_at >= 30.0:
            self._warned_at = now
            logger.warning("offloadd at %s unavailable (%s): L3 misses", self._endpoint, exc)

    # -- the v1 interface ----------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading keys the daemon holds; 0 when it is away."""
        if not keys:
            return 0
        with self._lock:
            client = self._session()
            if client is None:
                return 0
            try:
                return int(client.lookup([offload_key(k) for k in keys]).hits)
            except Exception as exc:
                self._away(exc)
                return 0

    def exists(self, key: str) -> bool:
        """Whether the daemon holds ``key``."""
        return self.batch_exists([key]) == 1

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Store each page; True for each one the daemon committed."""
        return self._transfer(keys, host_indices, store=True)

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Load each page into the host pool; True for each one loaded."""
        return self._transfer(keys, host_indices, store=False)

    def _transfer(self, keys: list[str], host_indices: Any, *, store: bool) -> list[bool]:
        results = [False] * len(keys)
        if not keys:
            return results
        with self._lock:
            try:
                step = self._staging.pages if self._staging is not None else len(keys)
                for start in range(0, len(keys), step):
                    batch = keys[start : start + step]
                    slots = host_indices[start * self._page_tokens :][
                        : len(batch) * self._page_tokens
                    ]
                    done = self._transfer_batch(batch, slots, store=store)
                    results[start : start + len(batch)] = done
                    if not all(done):
                        break
            except Exception as exc:
                self._away(exc)
        return results

    def _transfer_batch(self, keys: list[str], slots: Any, *, store: bool) -> list[bool]:
        client = self._session()
        if client is None:
            return [False] * len(keys)
        page = self._page_tokens
        okeys = [offload_key(k) for k in keys]
        staging = self._staging
        if staging is None:
            block_ids = [int(slot) // page for slot in slots[::page].tolist()]
        else:
            block_ids = list(range(len(keys)))
            pointers = self._page_pointers(slots, len(keys))
            if store:
                for slot, page_pointers in enumerate(pointers):
                    staging.copy(slot, page_pointers, into_pool=False)
        job = next(self._jobs)
        if store:
            client.store(job, okeys, block_ids)
        else:
            client.load(job, okeys, block_ids)
        finished = client.wait([job], raise_on_failure=False)
        if not finished:  # unanswered in time: treated as failed (a late commit is harmless)
            return [False] * len(keys)
        done = finished[0]
        failed = set(done.failed_keys)
        if not done.ok and not failed:
            failed = set(okeys)
        ok = [key not in failed for key in okeys]
        if staging is not None and not store:
            for slot, page_pointers in enumerate(pointers):
                if ok[slot]:
                    staging.copy(slot, page_pointers, into_pool=True)
        return ok

    def _page_pointers(self, slots: Any, count: int) -> list[list[int]]:
        """Each page's run addresses in the pool, from SGLang's own page table."""
        pointers, _ = self._pool.get_page_buffer_meta(slots)
        runs = len(pointers) // count
        return [[int(p) for p in pointers[i * runs : (i + 1) * runs]] for i in range(count)]

    # -- the rest of HiCacheStorage --------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        """Unused: SGLang calls ``batch_get_v1`` (``interface_v1``)."""
        return None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[None]:
        """Unused: SGLang calls ``batch_get_v1`` (``interface_v1``)."""
        return [None] * len(keys)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Unused: SGLang calls ``batch_set_v1`` (``interface_v1``)."""
        return False

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Unused: SGLang calls ``batch_set_v1`` (``interface_v1``)."""
        return False

    def clear(self) -> None:
        """Nothing: the daemon's cache is shared with other engines (``offloadd cache
        clear`` drops a namespace)."""

    def close(self) -> None:
        """Say Bye and close the session and the descriptors; idempotent."""
        with self._lock:
            client, self._client = self._client, None
            self._retry_at = float("inf")
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
            files, self._files = self._files, {}
            for path, fd in files.items():
                if self._staging is None or path != self._staging.path:
                    with contextlib.suppress(OSError):
                        os.close(fd)

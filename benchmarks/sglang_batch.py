"""SGLang's HiCache L3 batch through offloadd vs an in-process copy of the same pages.

``sglang_set_64`` / ``sglang_get_64``: one ``batch_set_v1`` (``batch_get_v1``) of 64 pages,
as SGLang 0.5.23's backup (prefetch) thread calls it, on offloadd's backend built by SGLang's
own backend factory (``dynamic``) over SGLang's own host pool (``MHATokenToKVPoolHost``,
``page_first``, the ``shm`` allocator: no copy in the rank, the daemon copies between the
pool's memfd and its arena, with pread/pwrite as SGLang's memfd is not sealable), and a
daemon subprocess.

- value: GB/s of the batch's page bytes over the call's wall time (a set of 64 new keys, a
  get of them into other host pages), median over repetitions; params: the call's ms.
- baseline: the same bytes moved in this process, each run of each page (its K, its V) one
  ``ctypes.memmove`` between the host pool and a same-size pre-faulted shm arena: what the
  cheapest in-process L3 costs. Each repetition runs offloadd and the baseline back to back;
  the ratio is the median of the pairs' ratios. No goal yet: the figures are for
  comparison (a first run on the 2-core VM: set 0.33, get 0.43 of the in-process copy; the
  daemon journals and checksums each page before the set returns, and copies through the
  memfd's descriptor as SGLang does not create it sealable).
- The get's pages are checked against the set's, every repetition.

Geometry: a Llama-3-8B rank (32 layers, 8 KV heads of 128, bf16) in 8-token pages: 1 MiB a
page (K and V, 512 KiB each), 64 MiB a batch; ``--smoke``: 4 layers, 4-token pages.
Needs SGLang (skipped without); SGLang's pools are imported with ``tests/sglang``'s
torchvision stand-in (a CPU install of SGLang has no torchvision), test code the wheel does
not carry, which is why the group lives here (``python -m benchmarks --only sglang``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from offloadd.bench._util import Context, MiB, Result, median, paired_ratio
from offloadd.bench.datapath import daemon
from offloadd.cache.arena import Arena

PAGES = 64
HEADS = 8
HEAD_DIM = 128

Move = tuple[int, int, int]  # (destination, source, bytes)


def run(ctx: Context) -> list[Result]:
    """``sglang_set_64`` and ``sglang_get_64`` (offloadd vs an in-process copy)."""
    names = (f"sglang_set_{PAGES}", f"sglang_get_{PAGES}")
    if not any(ctx.wanted(name) for name in names):
        return []
    if importlib.util.find_spec("sglang") is None:
        ctx.skip("sglang", "SGLang is not installed; scripts/install-sglang.sh installs it")
        return []
    import torch

    layers, page = ctx.pick((32, 8), (32, 8), (4, 4))
    reps = ctx.pick(9, 5, 1)
    host = _host_pool(layers, page)
    page_bytes = 2 * layers * page * HEADS * HEAD_DIM * 2
    batch = PAGES * page_bytes
    sources = torch.arange(0, PAGES * page, dtype=torch.int64)
    targets = sources + PAGES * page
    store_moves = _moves(host, sources)
    load_moves = _moves(host, targets)
    generator = torch.Generator().manual_seed(45)
    shape = (2, PAGES * page, layers, HEADS, HEAD_DIM)
    host.kv_buffer[:, sources] = torch.randn(shape, generator=generator).to(torch.bfloat16)
    ctx.progress(f"sglang: {reps} batches of {PAGES} pages of {page_bytes >> 10} KiB")
    timings: dict[str, list[float]] = {"set": [], "get": [], "base_set": [], "base_get": []}
    arena = Arena(ctx.scratch.shm_path("sglang-baseline.arena"), batch)
    capacity = (reps + 1) * batch + 8 * MiB
    with contextlib.closing(arena), daemon(ctx, capacity, "sglang") as (endpoint, _process):
        backend = _backend(host, endpoint)
        try:
            for rep in range(reps + 1):  # the first: warm-up
                keys = [hashlib.sha256(f"{rep}-{i}".encode()).hexdigest() for i in range(PAGES)]
                host.kv_buffer[:, targets] = 0
                calls: tuple[tuple[str, Callable[[], object]], ...] = (
                    ("set", partial(backend.batch_set_v1, keys, sources)),
                    ("base_set", partial(_copy, arena.address, store_moves, into_pool=False)),
                    ("get", partial(backend.batch_get_v1, keys, targets)),
                    ("base_get", partial(_copy, arena.address, load_moves, into_pool=True)),
                )
                for what, call in calls:
                    seconds, answer = _timed(call)
                    if answer is not None and answer != [True] * PAGES:
                        raise RuntimeError(f"sglang: {what} of a batch answered {answer}")
                    if rep:
                        timings[what].append(seconds)
                if not torch.equal(host.kv_buffer[:, targets], host.kv_buffer[:, sources]):
                    raise RuntimeError("sglang: the pages got back differ from those set")
        finally:
            backend.close()
    results = []
    for what, name in zip(("set", "get"), names, strict=True):
        ours = [batch / s / 1e9 for s in timings[what]]
        base = [batch / s / 1e9 for s in timings[f"base_{what}"]]
        results.append(
            Result(
                name,
                median(ours),
                "GB/s",
                median(base),
                paired_ratio(ours, base),
                {
                    "pages": PAGES,
                    "page_bytes": page_bytes,
                    "ms": median(timings[what]) * 1e3,
                    "baseline_ms": median(timings[f"base_{what}"]) * 1e3,
                    "repetitions": reps,
                    "baseline": "in-process memmove of the same page runs",
                    "daemon_copies": "pread/pwrite (SGLang's memfd is not sealable)",
                },
            )
        )
    return [r for r in results if ctx.wanted(r.name)]


def _host_pool(layers: int, page: int) -> Any:
    """SGLang's host pool of ``2 * PAGES`` pages (the set's and the get's) in a memfd."""

    from tests.sglang.cpu_fakes import install_torchvision_stub
    from tests.sglang.pools import device_pool

    install_torchvision_stub()
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = device_pool(page, page, layers=layers, heads=HEADS, head_dim=HEAD_DIM)
    return MHATokenToKVPoolHost(
        device._mha_buffer_info(),
        1.0,
        0,
        page,
        "page_first",
        pin_memory=False,
        device="cpu",
        allocator_type="shm",
        device_capacity_tokens=page,
        start_layer=0,
        end_layer=layers,
        host_token_capacity=2 * PAGES * page,
    )


def _backend(host: Any, endpoint: str) -> Any:
    """offloadd's backend, as SGLang's factory builds it for ``dynamic``."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from tests.sglang.pools import backend_extra, storage_config

    config = storage_config("bench/llama-3-8b-rank", backend_extra(endpoint, 30.0))
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    if not backend.zero_copy:
        raise RuntimeError("sglang: the host pool is not shared with the daemon")
    return backend


def _moves(host: Any, slots: Any) -> list[Move]:
    """Each run of each page at ``slots``: (offset in the baseline arena, pool address, size)."""
    pointers, sizes = host.get_page_buffer_meta(slots)
    moves, offset = [], 0
    for pointer, size in zip(pointers, sizes, strict=True):
        moves.append((offset, int(pointer), int(size)))
        offset += int(size)
    return moves


def _copy(base: int, moves: list[Move], *, into_pool: bool) -> None:
    for offset, pointer, size in moves:
        if into_pool:
            ctypes.memmove(pointer, base + offset, size)
        else:
            ctypes.memmove(base + offset, pointer, size)


def _timed(call: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    answer = call()
    return time.perf_counter() - started, answer

"""One SGLang engine run by SGLang's own HiCache, as its own process
(``python -m tests.sglang.tree_engine``).

SGLang 0.5.23's parts, built as its scheduler builds them: ``ServerArgs`` with
``--enable-hierarchical-cache --hicache-storage-backend dynamic`` and offloadd's extra config,
published; its device pool (``MHATokenToKVPool`` on CPU), token allocator and request pool; a
``UnifiedRadixCache`` whose ``init_hicache`` builds the host pool (``MHATokenToKVPoolHost``,
``page_first``, SGLang's ``shm`` allocator), the ``HybridCacheController`` with its prefetch
and backup threads, and the storage backend (offloadd, through SGLang's backend factory).
What the script does is what SGLang's scheduler does around the cache:

- ``set``: a prefill has written the prefix's KV (known bytes, from a seed) into device slots
  from the allocator; the request's tokens and slots are inserted into the tree. Then
  scheduler steps (``check_hicache_events``) until SGLang has written the pages through to
  its host pool and backed them up to L3 itself, and both acknowledgements are drained.
- ``get`` (a fresh engine, empty tree): a request for the prefix and one more token
  (SGLang's ``Req``) matches the tree (``init_next_round_input``), is prefetched from L3
  (``prefetch_from_storage`` with the arguments the scheduler passes), and is polled with
  scheduler steps until ``check_prefetch_progress``; then it matches again (now a host hit),
  and ``init_load_back`` and ``ready_to_load_host_cache`` load it into the device pool. The
  device slots on the tree's path are compared with the known bytes.

Faked, because a CPU cannot run them (``tests/sglang/cpu_fakes.py``): host-memory pinning
(``cudaHostRegister``) and SGLang's two ``sgl_kernel`` copy kernels for ``page_first``.
SGLang's prefetch timeout is raised (``prefetch_timeout_base``): the first run compiles its
hash extension, which takes longer than the default second. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from array import array
from typing import Any

import torch

from tests.sglang.cpu_fakes import install_hicache_cpu_fakes, install_torchvision_stub
from tests.sglang.pools import backend_extra, device_pool

PAGE = 4
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
DEVICE_TOKENS = 256
DEADLINE = 90.0  # seconds a step loop may poll (above the prefetch timeout)


def expected_kv(tokens: int) -> torch.Tensor:
    """The bytes engine A's prefill wrote: ``[K or V, layer, token, head, dim]``."""
    generator = torch.Generator().manual_seed(45)
    shape = (2, LAYERS, tokens, HEADS, HEAD_DIM)
    return torch.randn(shape, generator=generator).to(torch.bfloat16)


def build(endpoint: str, model: str, timeout: float) -> tuple[Any, Any, Any]:
    """SGLang's cache with HiCache and offloadd as L3: (tree, device pool, allocator)."""
    install_torchvision_stub()
    install_hicache_cpu_fakes()
    from sglang.srt import runtime_context
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs

    extra = backend_extra(endpoint, timeout, prefetch_threshold=PAGE, prefetch_timeout_base=60)
    server_args = ServerArgs(
        model_path="dummy",
        served_model_name=model,
        device="cpu",
        page_size=PAGE,
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_mem_layout="page_first",
        hicache_io_backend="kernel",
        hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra),
    )
    runtime_context.publish(
        server_args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0)
    )
    device = device_pool(DEVICE_TOKENS, PAGE, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM)
    allocator = PagedTokenToKVPoolAllocator(
        DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", device, need_sort=False
    )
    requests = ReqToTokenPool(
        size=4, max_context_len=DEVICE_TOKENS, device="cpu", enable_memory_saver=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=requests,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
        tree_components=(ComponentType.FULL,),
    )
    tree = UnifiedRadixCache(params)
    tree.init_hicache(server_args, params)
    return tree, device, allocator


def steps_until(tree: Any, done: Any) -> bool:
    """Scheduler steps (``check_hicache_events``) until ``done()``; False past DEADLINE."""
    deadline = time.monotonic() + DEADLINE
    while True:
        tree.check_hicache_events()
        if done():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def store(tree: Any, device: Any, allocator: Any, tokens: list[int]) -> dict[str, object]:
    """Engine A: the prefix's KV in device slots, inserted; SGLang backs it up itself."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    slots = allocator.alloc(len(tokens))
    kv = expected_kv(len(tokens))
    for layer in range(LAYERS):
        device.k_buffer[layer][slots] = kv[0, layer]
        device.v_buffer[layer][slots] = kv[1, layer]
    tree.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
    acked = steps_until(tree, lambda: not tree.ongoing_write_through and not tree.ongoing_backup)
    return {"backed_up": acked}


def load(tree: Any, device: Any, tokens: list[int]) -> dict[str, object]:
    """Engine B: match, prefetch from L3, match again, load back; compare the device KV."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    from sglang.srt.sampling.sampling_params import SamplingParams

    request = Req("b", "", array("q", [*tokens, 1]), SamplingParams(max_new_tokens=1))
    request.init_next_round_input(tree)
    out: dict[str, object] = {"device_hit": request.prefix_len, "host_hit": request.host_hit_length}
    # As the scheduler's storage prefetch: from the host match to the longest prefix.
    matched = request.prefix_len + request.host_hit_length
    ids = request.full_untruncated_fill_ids
    end = request._compute_max_prefix_len(len(ids))
    anchor = request.last_host_node
    tree.prefetch_from_storage(
        request.cache_request_handle,
        anchor,
        ids[matched:end],
        tree.get_last_hash_value(anchor),
        None,
        matched_prefix_tokens=ids[:matched],
    )
    handle = request.cache_request_handle
    out["prefetched"] = steps_until(tree, lambda: tree.check_prefetch_progress(handle))
    out["l3_hit"], _ = tree.pop_prefetch_loaded_span(handle)
    request.init_next_round_input(tree)
    out["host_hit_after"] = request.host_hit_length
    loaded, node = tree.init_load_back(
        InitLoadBackParams(
            best_match_node=request.best_match_node,
            host_hit_length=request.host_hit_length,
            req=request,
        )
    )
    out["loaded_back"] = loaded
    consumer = tree.ready_to_load_host_cache()
    steps_until(tree, lambda: tree.is_load_back_event_done(consumer))
    slots = tree.path_device_indices(node)
    kv = expected_kv(len(tokens))
    exact = []
    for page in range(len(slots) // PAGE):
        span = slice(page * PAGE, (page + 1) * PAGE)
        exact.append(
            all(
                torch.equal(device.k_buffer[layer][slots[span]], kv[0, layer, span])
                and torch.equal(device.v_buffer[layer][slots[span]], kv[1, layer, span])
                for layer in range(LAYERS)
            )
        )
    out["exact"] = exact
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("set", "get"))
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--pages", type=int, default=8)
    parser.add_argument("--model", default="test/tiny-mha")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)

    tree, device, allocator = build(args.endpoint, args.model, args.timeout)
    backend = tree.cache_controller.storage_backend
    tokens = list(range(100, 100 + args.pages * PAGE))
    out: dict[str, object] = {"zero_copy": backend.zero_copy}
    if args.role == "set":
        out.update(store(tree, device, allocator, tokens))
    else:
        out.update(load(tree, device, tokens))
    tree.shutdown()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

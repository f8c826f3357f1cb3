"""One SGLang engine's L3 side, run as its own process (``python -m tests.sglang.hicache_engine``).

SGLang's own parts: its device KV pool (``MHATokenToKVPool`` on CPU), its host pool
(``MHATokenToKVPoolHost``, with the ``shm`` allocator or the default one), its
``StorageBackendFactory`` loading offloadd through ``dynamic``, and its page keys
(``get_hash_str`` chains). What SGLang's HiCache controller would do with them is done here:
``set`` fills the prefix's pages with known bytes and backs them up (``batch_set_v1``);
``get`` (a fresh, empty engine) asks ``batch_exists`` and loads the hits into other host
slots (``batch_get_v1``), then compares them with the known bytes. Prints one JSON line;
with ``--hold`` it then keeps its session (its engine listed by the daemon) until its stdin
ends.
A process of its own keeps SGLang's imports and threads out of the test process.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tests.sglang.cpu_fakes import install_torchvision_stub
from tests.sglang.pools import backend_extra, device_pool, storage_config

PAGE = 4
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
DEVICE_TOKENS = 256


def expected_page(index: int) -> torch.Tensor:
    """The bytes engine A wrote for page ``index``: K and V of every layer, from a seed."""
    generator = torch.Generator().manual_seed(1000 + index)
    shape = (2, PAGE, LAYERS, HEADS, HEAD_DIM)
    return torch.randn(shape, generator=generator).to(torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("set", "get"))
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--allocator", default="shm")
    parser.add_argument("--pages", type=int, default=8)
    parser.add_argument("--model", default="test/tiny-mha")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args(argv)

    install_torchvision_stub()
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str

    device = device_pool(DEVICE_TOKENS, PAGE, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM)
    host = MHATokenToKVPoolHost(
        device._mha_buffer_info(),
        2.0,
        0,
        PAGE,
        "page_first",
        pin_memory=False,
        device="cpu",
        allocator_type=args.allocator,
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
    )
    extra = backend_extra(args.endpoint, args.timeout, args.allocator)
    config = storage_config(args.model, extra)
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)

    tokens = list(range(args.pages * PAGE))
    keys: list[str] = []
    prior = None
    for page in range(args.pages):
        prior = get_hash_str(tokens[page * PAGE : (page + 1) * PAGE], prior)
        keys.append(prior)

    out: dict[str, object] = {"zero_copy": backend.zero_copy}
    if args.role == "set":
        first = 3  # host pages 3.. hold the prefix
        for page in range(args.pages):
            slot = (first + page) * PAGE
            host.kv_buffer[:, slot : slot + PAGE] = expected_page(page)
        indices = torch.arange(first * PAGE, (first + args.pages) * PAGE, dtype=torch.int64)
        out["set"] = backend.batch_set_v1(keys, indices)
    else:
        hits = backend.batch_exists(keys)
        out["exists"] = hits
        first = 11  # other host pages than engine A's
        indices = torch.arange(first * PAGE, (first + args.pages) * PAGE, dtype=torch.int64)
        got = backend.batch_get_v1(keys, indices)
        out["get"] = got
        out["exact"] = [
            bool(
                torch.equal(
                    host.kv_buffer[:, (first + page) * PAGE : (first + page + 1) * PAGE],
                    expected_page(page),
                )
            )
            for page in range(args.pages)
        ]
    print(json.dumps(out), flush=True)
    if args.hold:
        sys.stdin.read()
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SGLang 0.5.23's own HiCache drives offloadd: its tree, controller and threads decide
what is backed up to L3, prefetched and loaded back, against a real ``offloadd serve``.

Each engine is its own process (``tests/sglang/tree_engine.py``): a ``UnifiedRadixCache``
with ``init_hicache``, so a ``HybridCacheController`` with SGLang's prefetch and backup
threads, a ``shm`` host pool and offloadd loaded through ``dynamic``. Engine A inserts a
prefix and SGLang backs it up to L3 itself; engine B, empty, matches the prefix, SGLang
prefetches it from L3 into B's host pool and loads it back into B's device pool, byte-exact.

Faked, because a CPU cannot run them (``tests/sglang/cpu_fakes.py``): host-memory pinning
(``cudaHostRegister`` succeeds without pinning) and SGLang's two ``sgl_kernel`` copy kernels
for the ``page_first`` host layout (``transfer_kv_all_layer_lf_pf``,
``transfer_kv_per_layer_pf_lf``), replaced by torch indexing.
"""

from __future__ import annotations

import importlib.util
import signal

import pytest

from offloadd.client import OffloadClient
from tests.integration.harness import ServeProcess
from tests.sglang.engines import PAGES, finish, start, tree_engine

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="SGLang is not installed (scripts/install-sglang.sh installs 0.5.23)",
    ),
    pytest.mark.timeout(240),
]

TOKENS = PAGES * 4  # the tree engine's pages are 4 tokens

LOADED = {
    "zero_copy": True,
    "device_hit": 0,  # B starts empty: no device hit ...
    "host_hit": 0,  # ... and no host hit
    "prefetched": True,
    "l3_hit": TOKENS,  # SGLang prefetched the whole prefix from offloadd ...
    "host_hit_after": TOKENS,  # ... into its host pool, where the tree now finds it ...
    "loaded_back": TOKENS,  # ... and loaded it back into the device pool
    "exact": [True] * PAGES,  # with A's bytes
}


def test_sglang_backs_up_a_prefix_and_an_empty_engine_loads_it(serve: ServeProcess) -> None:
    serve.start()
    assert tree_engine("set", serve.endpoint) == {"zero_copy": True, "backed_up": True}
    with OffloadClient(serve.endpoint, timeout=5.0, heartbeat=0) as client:
        listing = client.list_cache()
    # What SGLang's backup thread wrote: each page of the prefix, under the model's name.
    assert [(ns.name.split("@")[0], ns.chunks) for ns in listing.namespaces] == [
        ("test/tiny-mha", PAGES)
    ]
    assert tree_engine("get", serve.endpoint) == LOADED


def test_engine_b_hits_after_the_daemon_is_killed_and_restarted(serve: ServeProcess) -> None:
    serve.start()
    assert tree_engine("set", serve.endpoint)["backed_up"] is True
    assert serve.stop(signal.SIGKILL) == -signal.SIGKILL
    serve.start()
    assert tree_engine("get", serve.endpoint) == LOADED


def test_without_a_daemon_a_skips_its_backup_and_b_misses(serve: ServeProcess) -> None:
    # Two independent engines, so they run at once; neither may raise.
    a = start("tests.sglang.tree_engine", "set", serve.endpoint, 0.5)
    b = start("tests.sglang.tree_engine", "get", serve.endpoint, 0.5)
    assert finish(a) == {"zero_copy": True, "backed_up": True}  # acked as failed, not raised
    assert finish(b) == {
        "zero_copy": True,
        "device_hit": 0,
        "host_hit": 0,
        "prefetched": True,
        "l3_hit": 0,
        "host_hit_after": 0,
        "loaded_back": 0,
        "exact": [],
    }

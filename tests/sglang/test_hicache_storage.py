"""offloadd as SGLang 0.5.23's HiCache L3, against a real ``offloadd serve``.

Each engine is its own process (``tests/sglang/hicache_engine.py``) with SGLang's own device
and host pools, its backend factory loading offloadd through ``dynamic``, and its page keys.
The engine process calls the storage interface as the controller's zero-copy path does, so
both host-pool allocators are covered; ``test_hicache_tree.py`` has SGLang's own tree and
controller make the calls (and restart the daemon between engines).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.integration.harness import ServeProcess
from tests.sglang.engines import PAGES, engine, finish, start

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="SGLang is not installed (scripts/install-sglang.sh installs 0.5.23)",
    ),
    pytest.mark.timeout(240),
]


def test_engine_b_loads_engine_a_prefix_byte_exact(serve: ServeProcess) -> None:
    serve.start()
    a = engine("set", serve.endpoint)
    assert a == {"zero_copy": True, "set": [True] * PAGES}
    # B with a shared host pool, and C with a private one (no shm allocator), which stages
    # each page once and shares the namespace; independent, so they run at once.
    b = start("tests.sglang.hicache_engine", "get", serve.endpoint, 5.0, "--allocator", "shm")
    c = start("tests.sglang.hicache_engine", "get", serve.endpoint, 5.0, "--allocator", "default")
    loaded = {"exists": PAGES, "get": [True] * PAGES, "exact": [True] * PAGES}
    assert finish(b) == {"zero_copy": True, **loaded}
    assert finish(c) == {"zero_copy": False, **loaded}


def test_no_daemon_means_misses_and_skipped_writes(serve: ServeProcess) -> None:
    a = start("tests.sglang.hicache_engine", "set", serve.endpoint, 0.5, "--allocator", "shm")
    b = start("tests.sglang.hicache_engine", "get", serve.endpoint, 0.5, "--allocator", "shm")
    assert finish(a)["set"] == [False] * PAGES
    got = finish(b)
    assert got["exists"] == 0 and got["get"] == [False] * PAGES

"""offloadd as SGLang 0.5.23's HiCache L3, against a real ``offloadd serve``.

Each engine is its own process (``tests/sglang/hicache_engine.py``) with SGLang's own device
and host pools, its backend factory loading offloadd through ``dynamic``, and its page keys.
Not driven here: SGLang's ``UnifiedRadixCache`` and ``HybridCacheController`` (the engine
process calls the storage interface as the controller's zero-copy path does).
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from tests.integration.harness import ServeProcess
from tests.sglang.engines import PAGES, engine

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="SGLang is not installed (scripts/install-sglang.sh installs 0.5.23)",
    ),
    pytest.mark.timeout(240),
]


@pytest.fixture
def serve() -> Iterator[ServeProcess]:
    workdir = tempfile.mkdtemp(prefix="od-", dir="/tmp")
    daemon = ServeProcess(workdir, f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena")
    yield daemon
    daemon.cleanup()
    shutil.rmtree(workdir, ignore_errors=True)


def test_engine_b_loads_engine_a_prefix_byte_exact(serve: ServeProcess) -> None:
    serve.start()
    a = engine("set", serve.endpoint)
    assert a == {"zero_copy": True, "set": [True] * PAGES}
    b = engine("get", serve.endpoint)
    assert b == {"zero_copy": True, "exists": PAGES, "get": [True] * PAGES, "exact": [True] * PAGES}
    # A private host pool (no shm allocator) stages each page once, and shares the namespace.
    c = engine("get", serve.endpoint, allocator="default")
    assert c == {
        "zero_copy": False,
        "exists": PAGES,
        "get": [True] * PAGES,
        "exact": [True] * PAGES,
    }


def test_engine_b_hits_after_a_warm_restart(serve: ServeProcess) -> None:
    serve.start()
    assert engine("set", serve.endpoint)["set"] == [True] * PAGES
    serve.stop()
    serve.start()
    b = engine("get", serve.endpoint)
    assert b["exists"] == PAGES and b["exact"] == [True] * PAGES


def test_no_daemon_means_misses_and_skipped_writes(serve: ServeProcess) -> None:
    a = engine("set", serve.endpoint, timeout=0.5)
    assert a["set"] == [False] * PAGES
    b = engine("get", serve.endpoint, timeout=0.5)
    assert b["exists"] == 0 and b["get"] == [False] * PAGES

"""A vLLM engine and an SGLang engine on one ``offloadd serve`` at once.

vLLM 0.33's real Scheduler and OffloadingConnector (``tests/vllm/harness.py``, in this process)
and SGLang 0.5.23's host pool and backend factory (``tests/sglang/hicache_engine.py``, a
process of its own) store into and load from the same daemon: each loads its own bytes
byte-exact, their namespaces differ, and the arena's used bytes are both engines' together.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

import tests.vllm.harness  # noqa: F401  (first: it selects vLLM's CPU platform)
from offloadd.cache.allocator import ExtentAllocator
from offloadd.client import OffloadClient
from tests.integration.harness import ServeProcess
from tests.sglang.engines import PAGES, engine
from tests.vllm.harness import NUM_LAYERS, VllmHarness
from tests.vllm.prompts import A_PROMPT, b_prompt, compute, extra_for, settle

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="SGLang is not installed (scripts/install-sglang.sh installs 0.5.23)",
    ),
    pytest.mark.timeout(240),
]

BLOCK = 16


def test_a_vllm_and_an_sglang_engine_share_one_daemon(tmp_path: Path, serve: ServeProcess) -> None:
    serve.start()
    with VllmHarness(tmp_path, extra_for(serve, block_size=BLOCK)) as h:
        compute(h, A_PROMPT)
        stored = 96 // BLOCK  # 100 prompt tokens: whole chunks only
        settle(h, stored)
        # SGLang engine A stores its prefix and keeps its session while the daemon is read.
        with subprocess.Popen(
            [
                sys.executable, "-m", "tests.sglang.hicache_engine", "set",
                "--endpoint", serve.endpoint, "--pages", str(PAGES), "--hold",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as setter:  # fmt: skip
            assert setter.stdout is not None and setter.stdin is not None
            line = setter.stdout.readline()
            assert json.loads(line) == {"zero_copy": True, "set": [True] * PAGES}, line
            with OffloadClient(serve.endpoint, timeout=5.0, heartbeat=0) as client:
                stats = client.stats()
                listing = client.list_cache()
            setter.stdin.close()  # the engine closes its backend and exits
            setter.wait(60)
        assert setter.returncode == 0
        engines = {state.engine_id: state for state in stats.engines}
        assert len(engines) == 2, engines
        assert all(state.ready for state in engines.values())
        namespaces = {state.namespace for state in engines.values()}
        assert len(namespaces) == 2 and "" not in namespaces, engines
        usage = {ns.name: ns for ns in listing.namespaces}
        assert set(usage) == namespaces
        chunks = sorted(ns.chunks for ns in usage.values())
        assert chunks == sorted([stored, PAGES])
        # One arena, its room shared: what is used is both engines' chunks together, each
        # chunk's extent rounded up to the arena's 4 KiB alignment (an SGLang page here is
        # 768 bytes, a vLLM chunk 4 KiB).
        rounding = ExtentAllocator(1 << 20)  # the daemon's alignment: the default
        assert all(ns.nbytes > 0 and ns.nbytes % ns.chunks == 0 for ns in usage.values())
        assert stats.used_bytes == sum(
            ns.chunks * rounding.alloc_size(ns.nbytes // ns.chunks) for ns in usage.values()
        )

        # vLLM loads its own prefix back after its GPU prefix cache is dropped ...
        h.reset_prefix_cache()
        b = compute(h, b_prompt(85))
        aligned = 85 - 85 % BLOCK
        assert h.external_tokens(b) == aligned
        assert h.assert_loaded_pages(b) == aligned // BLOCK * NUM_LAYERS
    # ... and a second, empty SGLang engine loads SGLang's prefix byte-exact.
    got = engine("get", serve.endpoint)
    assert got == {
        "zero_copy": True,
        "exists": PAGES,
        "get": [True] * PAGES,
        "exact": [True] * PAGES,
    }

"""tests/vllm: vLLM 0.33's real Scheduler and OffloadingConnector on a CPU host.

The test modules skip only when vLLM is not installed (CI installs it). vLLM is
imported once, here, through the harness: it selects vLLM's CPU platform and
silences the one deprecation warning importing vLLM raises, so test modules may
import vllm directly afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Iterator

import pytest

# Read by vLLM when it is imported: keep its logs to warnings and errors.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

if importlib.util.find_spec("vllm") is not None:
    import tests.vllm.harness  # noqa: F401


@pytest.fixture
def store_name() -> Iterator[str]:
    """A fresh SimpleSpec cache namespace, dropped afterwards."""
    from tests.vllm import simple_spec

    name = f"test-{uuid.uuid4().hex}"
    yield name
    simple_spec.drop_namespace(name)


@pytest.fixture
def simple_extra(store_name: str) -> dict[str, object]:
    """kv_connector_extra_config loading SimpleSpec as an out-of-tree spec."""
    return {
        "spec_name": "SimpleSpec",
        "spec_module_path": "tests.vllm.simple_spec",
        "simple_store": store_name,
    }

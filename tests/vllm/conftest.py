"""tests/vllm: vLLM 0.33's real Scheduler and OffloadingConnector on a CPU host.

The test modules skip only when vLLM is not installed; under `make test` (CI) they never
skip (OFFLOADD_REQUIRE_VLLM, below). vLLM is
imported once, here, through the harness: it selects vLLM's CPU platform and
silences the one deprecation warning importing vLLM raises, so test modules may
import vllm directly afterwards.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import uuid
from collections.abc import Iterator

import pytest

# Read by vLLM when it is imported: keep its logs to warnings and errors.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# `make test` (what CI runs) installs vLLM and sets this to the version it pinned: there a
# missing or other vLLM fails the run instead of skipping the plugin's tests, which would
# pass without having run them.
_REQUIRED = os.environ.get("OFFLOADD_REQUIRE_VLLM", "")
if _REQUIRED:
    try:
        _found = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        _found = "none"
    if _found != _REQUIRED:
        raise pytest.UsageError(
            f"OFFLOADD_REQUIRE_VLLM={_REQUIRED}: the vLLM plugin tests need vLLM {_REQUIRED}, "
            f"found {_found} (scripts/bootstrap.sh installs it)"
        )

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

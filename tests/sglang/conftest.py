"""`make test` (what CI runs) installs SGLang and sets OFFLOADD_REQUIRE_SGLANG to the version
it pinned: there a missing or other SGLang fails the run instead of skipping the HiCache
backend's tests, which would pass without having run them (as OFFLOADD_REQUIRE_VLLM does for
tests/vllm). ``serve``: an ``offloadd serve`` process on a private endpoint and arena, not
started."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterator

import pytest

from tests.integration.harness import ServeProcess, serve_process

_REQUIRED = os.environ.get("OFFLOADD_REQUIRE_SGLANG", "")
if _REQUIRED:
    try:
        _found = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        _found = "none"
    if _found != _REQUIRED:
        raise pytest.UsageError(
            f"OFFLOADD_REQUIRE_SGLANG={_REQUIRED}: the SGLang backend tests need SGLang "
            f"{_REQUIRED}, found {_found} (scripts/install-sglang.sh installs it)"
        )


@pytest.fixture
def serve() -> Iterator[ServeProcess]:
    with serve_process() as daemon:
        yield daemon

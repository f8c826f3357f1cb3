"""The test harness the development benchmarks drive vLLM through (``tests/vllm``)."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def harness_modules(*names: str) -> list[ModuleType]:
    """``tests.vllm.harness`` and then the test modules ``names``: the benchmarks that drive
    vLLM's own scheduler and workers. ``ImportError`` saying why when vLLM is missing (the
    caller skips). Any other failure to import them is ``RuntimeError``: a checkout with
    vLLM whose harness does not import is broken, and must not read as a skip."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError("vLLM is not installed")
    try:
        # The harness first: importing it selects vLLM's CPU platform.
        return [importlib.import_module(name) for name in ("tests.vllm.harness", *names)]
    except ImportError as exc:
        raise RuntimeError(f"tests/vllm does not import: {exc!r}") from exc

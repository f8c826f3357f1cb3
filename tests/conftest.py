"""Every asyncio test runs on both the default loop and uvloop (what the daemon uses)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Any] = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return factories

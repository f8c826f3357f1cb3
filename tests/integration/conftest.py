from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from offloadd.transfer.engine import CopyEngine
from tests.integration.harness import DaemonThread, Rank
from tests.integration.wheels import build_dist

DaemonFactory = Callable[..., DaemonThread]


@pytest.fixture
def daemon_factory() -> Iterator[DaemonFactory]:
    started: list[DaemonThread] = []

    def start(
        capacity: int = 64 << 20,
        copy_engine: CopyEngine | None = None,
        session_timeout: float = 30.0,
        **settings: Any,
    ) -> DaemonThread:
        daemon = DaemonThread(capacity, copy_engine, session_timeout, **settings).start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> DaemonThread:
    return daemon_factory()


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    """Ranks a test creates are appended here and closed afterwards."""
    created: list[Rank] = []
    yield created
    for rank in created:
        rank.close()


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, the sdist) as ``make dist`` builds them, once per session."""
    return build_dist(tmp_path_factory.mktemp("dist"))

"""``offloadd serve`` as an operator runs it: what it leaves behind at exit, and what SIGHUP
does to it."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from tests.integration.harness import ServeProcess


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="od-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _arena() -> str:
    return f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"


def _files(top: str) -> set[str]:
    """Every file under ``top`` (sockets included), relative to it."""
    return {
        os.path.relpath(os.path.join(directory, name), top)
        for directory, _dirs, names in os.walk(top)
        for name in names
    }


@pytest.mark.timeout(60)
def test_sigterm_leaves_only_the_arena_the_journal_and_its_key(workdir: str) -> None:
    serve = ServeProcess(workdir, _arena(), beside=True)  # every socket where "auto" puts it
    try:
        serve.start()
        sockets = {"d.sock", "d.sock.lock", "d.sock.peer", "d.sock.metrics"}
        sockets |= {"d.sock.events", "d.sock.replay"}
        assert sockets <= _files(workdir), "the test no longer sees every socket it means to"
        assert serve.stop(signal.SIGTERM) == 0
        assert _files(workdir) == {"state/d.journal", "state/d.journal.key"}
        assert os.path.exists(serve.arena)
    finally:
        serve.cleanup()  # and the arena

"""Giving the arena's memory back (issue 47), step by step as docs/operations.md says, against
a real ``offloadd serve``: a clear frees room in the arena, not memory; a stopped daemon keeps
its arena (for the warm restart) and so its memory; removing the arena and its journal
returns the memory, and the next start is cold.

The arena lives on a tmpfs of the test's own (sticky, as /dev/shm is), so what is measured,
the tmpfs's used bytes, is the arena's alone and not other processes' shared memory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from tests.helpers import tmpfs
from tests.integration.harness import ServeProcess

CAPACITY = 64 << 20
MIB = 1 << 20


@pytest.fixture
def shm() -> Iterator[str]:
    """A tmpfs of this test's own, mode 1777 like /dev/shm."""
    with tmpfs("128m", "1777", "od-shm-") as directory:
        yield directory


@pytest.fixture
def serve(shm: str) -> Iterator[ServeProcess]:
    """The daemon with the default layout of its arena, ``offloadd-<uid>/arena``, on ``shm``."""
    workdir = tempfile.mkdtemp(prefix="od-", dir="/tmp")
    arena_dir = f"{shm}/offloadd-{os.geteuid()}"
    os.mkdir(arena_dir, 0o700)
    daemon = ServeProcess(workdir, f"{arena_dir}/arena", capacity="64MiB")
    yield daemon
    daemon.cleanup()
    shutil.rmtree(workdir, ignore_errors=True)


def _used(path: str) -> int:
    """Bytes in use on the file system of ``path``."""
    info = os.statvfs(path)
    return (info.f_blocks - info.f_bfree) * info.f_frsize


def _offloadd(*argv: str, ok: tuple[int, ...] = (0,)) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "offloadd", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode in ok, result.stdout + result.stderr
    return result.stdout


def _stats(endpoint: str) -> dict[str, object]:
    stats: dict[str, object] = json.loads(_offloadd("status", "--json", "--endpoint", endpoint))
    return stats


def _demo(endpoint: str, phase: str) -> dict[str, int]:
    """The demo's summary (a load that finds nothing exits 1: that is not an error here)."""
    argv = ["demo", "--endpoint", endpoint, "--phase", phase, "--seed", "3", "--chunks", "16"]
    summary: dict[str, int] = json.loads(_offloadd(*argv, "--json", "--events", "none", ok=(0, 1)))
    return summary


def test_clear_stop_and_remove_give_the_arenas_memory_back(shm: str, serve: ServeProcess) -> None:
    idle = _used(shm)
    serve.start()
    endpoint = serve.endpoint
    # Serving: the arena is pre-faulted, its whole capacity in memory.
    assert _used(shm) - idle >= CAPACITY
    assert _demo(endpoint, "store")["chunks_stored"] == 16
    stats = _stats(endpoint)
    assert stats["arena"] == serve.arena, "status names the file to remove"
    assert stats["used_bytes"]

    # 1. A clear empties the cache but frees no memory: the arena stays mapped and faulted.
    cleared = _offloadd("cache", "clear", "--all", "--endpoint", endpoint)
    assert cleared.startswith("offloadd cache clear: dropped 16 chunks"), cleared
    assert _stats(endpoint)["used_bytes"] == 0
    assert _used(shm) - idle >= CAPACITY

    # 2. A stop (SIGTERM, as systemctl stop) keeps the arena and its journal for a warm start,
    # and so their memory.
    assert serve.stop() == 0
    journal = serve.journal
    assert os.path.exists(serve.arena) and os.path.exists(journal)
    assert os.stat(serve.arena).st_blocks * 512 >= CAPACITY
    assert _used(shm) - idle >= CAPACITY

    # 3. Removing the arena and its journal returns the memory (the key stays: a later
    # journal is still authenticated with it).
    os.unlink(serve.arena)
    os.unlink(journal)
    assert _used(shm) - idle < MIB
    assert os.path.exists(journal + ".key")

    # 4. The next start is cold: an empty cache, the memory taken again.
    serve.start()
    assert _stats(endpoint)["entries"] == 0
    assert _demo(endpoint, "load")["hits"] == 0
    assert _used(shm) - idle >= CAPACITY
    assert serve.stop() == 0

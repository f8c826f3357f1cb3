"""The command line as a user runs it: real subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from offloadd.client import OffloadClient
from tests.integration.harness import ServeProcess


def _offloadd(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "offloadd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


@pytest.fixture
def served() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``offloadd serve`` on a private endpoint and arena, removing both at exit."""
    workdir = tempfile.mkdtemp(prefix="od-", dir="/tmp")
    arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    daemon = ServeProcess(workdir, arena, persist=False).start()
    assert daemon.process is not None
    yield daemon.endpoint, daemon.process
    assert daemon.stop(signal.SIGTERM) == 0
    assert not os.path.exists(workdir + "/d.sock"), "socket file left behind"
    assert not os.path.exists(arena), "arena left behind"
    daemon.cleanup()
    shutil.rmtree(workdir, ignore_errors=True)


def _into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """``offloadd ARGS`` whose stdout is a pipe nobody reads any more (``| head -1`` once
    head has exited): every write to it fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "offloadd", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args",
    [
        ["check-config"],
        ["check-config", "--json", "--capacity", "8GiB"],
        ["check-config", "--preflight", "--events-endpoint", "", "--metrics-address", ""],
    ],
)
def test_a_command_whose_reader_went_away_ends_quietly(args: list[str]) -> None:
    result = _into_closed_pipe(*args)
    assert result.stderr == ""  # no BrokenPipeError traceback, nor "Exception ignored"
    assert result.returncode == 141  # 128 + SIGPIPE, as the shell reports `yes | head -1`


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["serve", "--help"]])
def test_help_into_a_closed_pipe_ends_quietly(args: list[str]) -> None:
    result = _into_closed_pipe(*args)
    assert result.stderr == ""
    assert result.returncode == 0  # argparse's: it drops what it could not write


@pytest.mark.timeout(120)
def test_status_and_demo_into_a_closed_pipe_end_quietly(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    endpoint, _ = served
    for args in (["status"], ["status", "--json"], ["demo", "--chunks", "4", "--json"]):
        result = _into_closed_pipe(*args, "--endpoint", endpoint)
        assert (result.returncode, result.stderr) == (141, ""), args


def test_demo_starts_its_own_daemon_and_verifies_every_byte() -> None:
    tmp = tempfile.mkdtemp(prefix="od-", dir="/tmp")  # where the demo makes its directory
    try:
        result = _offloadd("demo", "--json", "--chunks", "32", env={**os.environ, "TMPDIR": tmp})
        left = os.listdir(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert result.returncode == 0, result.stderr
    assert left == [], "the demo left its directory (or the daemon's sockets in it)"
    summary = json.loads(result.stdout)
    assert summary["mismatches"] == 0
    assert summary["chunks_stored"] == 32
    assert summary["hits"] == 64  # two engines, each sees all 32 chunks
    assert summary["chunks_loaded"] == 64
    assert summary["bytes_verified"] == 2 * 2 * 32 * 2 * 2 * (32 << 10)


def test_demo_phases_against_one_running_daemon(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    endpoint, _ = served
    stored = _offloadd("demo", "--endpoint", endpoint, "--phase", "store", "--json", "--seed", "5")
    assert stored.returncode == 0, stored.stderr
    assert json.loads(stored.stdout)["chunks_stored"] == 64

    loaded = _offloadd("demo", "--endpoint", endpoint, "--phase", "load", "--json", "--seed", "5")
    assert loaded.returncode == 0, loaded.stderr
    summary = json.loads(loaded.stdout)
    assert summary["hits"] == 128 and summary["mismatches"] == 0
    assert summary["bytes_verified"] > 0

    # Another seed means other prefixes: nothing cached, the demo says so and fails.
    other = _offloadd("demo", "--endpoint", endpoint, "--phase", "load", "--json", "--seed", "6")
    assert other.returncode == 1
    assert json.loads(other.stdout)["hits"] == 0


def test_second_daemon_does_not_take_over_a_live_endpoint(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    endpoint, process = served
    second = _offloadd(
        "serve",
        "--endpoint",
        endpoint,
        "--arena",
        "/dev/shm/od-test-second",
        "--capacity",
        "16MiB",
        timeout=30,
    )
    assert second.returncode == 1
    assert "already serves" in second.stderr
    assert not os.path.exists("/dev/shm/od-test-second")
    with OffloadClient(endpoint, timeout=2) as client:
        assert client.stats().sessions == 0  # the first daemon still answers
    assert process.poll() is None


def test_demo_against_missing_daemon_fails_clearly() -> None:
    result = _offloadd("demo", "--endpoint", "ipc:///tmp/od-nothing-here.sock", timeout=60)
    assert result.returncode == 1
    assert result.stderr.startswith("offloadd demo: ")
    assert "ipc:///tmp/od-nothing-here.sock" in result.stderr
    assert "Traceback" not in result.stderr


def test_version() -> None:
    result = _offloadd("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("offloadd ")

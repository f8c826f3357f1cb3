"""``offloadd serve`` refused by its environment at start: one line and an exit, never a hang."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import msgspec
import pytest

from offloadd.server.publisher import EventBindError
from tests.integration.harness import DaemonThread
from tests.ports import free_port


@pytest.mark.timeout(90)
def test_a_control_port_in_use_ends_serve_with_one_line() -> None:
    arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        try:
            result = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "offloadd",
                    "serve",
                    "--endpoint",
                    endpoint,
                    "--arena",
                    arena,
                    "--capacity",
                    "16MiB",
                    "--no-persist",
                    "--events-endpoint",
                    "",
                    "--metrics-address",
                    "",
                    "--log-level",
                    "WARNING",
                ],
                capture_output=True,
                text=True,
                timeout=60,  # it used to wait forever in the ZeroMQ context's term()
                check=False,
            )
        finally:
            leftover = os.path.exists(arena)
            if leftover:
                os.unlink(arena)
    # Exit status 1: the command ran and could not start (status 2 is for bad settings).
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("offloadd: ") and endpoint in lines[0]
    assert "Address already in use" in lines[0]
    assert not leftover, "the arena of a daemon that never served was left behind"


def _serve_args(arena: str, **flags: str) -> list[str]:
    args = {
        "--endpoint": f"tcp://127.0.0.1:{free_port()}",
        "--arena": arena,
        "--capacity": "4GiB",
        "--events-endpoint": "",
        "--metrics-address": "",
        "--log-level": "WARNING",
        **flags,
    }
    return [item for pair in args.items() for item in pair]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("setting", ["--metrics-address", "--events-endpoint"])
def test_a_busy_port_stops_serve_before_the_arena_exists(setting: str) -> None:
    arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        value = f"127.0.0.1:{port}" if setting == "--metrics-address" else f"tcp://127.0.0.1:{port}"
        try:
            result = subprocess.run(
                [sys.executable, "-m", "offloadd", "serve", "--no-persist",
                 *_serve_args(arena, **{setting: value})],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
        finally:
            leftover = os.path.exists(arena)
            if leftover:
                os.unlink(arena)
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.splitlines()
    name = "metrics.address" if setting == "--metrics-address" else "events.endpoint"
    assert line.startswith(f"offloadd: {name} {value}: cannot bind 127.0.0.1:{port}"), line
    assert "Address already in use" in line
    # The 4 GiB arena was never created, let alone pre-faulted.
    assert not leftover


@pytest.mark.timeout(90)
def test_preflight_fails_on_a_busy_port_and_an_unwritable_arena(tmp_path: Path) -> None:
    def check_config(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "offloadd", "check-config", "--preflight", *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    good = check_config(*_serve_args(arena), "--journal", str(tmp_path / "state" / "j"))
    assert good.returncode == 0, good.stdout + good.stderr
    assert all(line.startswith("ok   ") for line in good.stdout.splitlines()), good.stdout
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = check_config(*_serve_args(arena, **{"--metrics-address": f"127.0.0.1:{port}"}))
    assert busy.returncode == 1
    assert f"FAIL metrics.address 127.0.0.1:{port}: cannot bind" in busy.stdout
    assert "checks failed" in busy.stderr
    # sysfs takes no new file, whatever the permission bits say (and even for root).
    unwritable = check_config(*_serve_args("/sys/x.arena"))
    assert unwritable.returncode == 1
    assert "FAIL cache.arena /sys/x.arena: /sys is not writable by uid" in unwritable.stdout
    assert not os.path.exists(arena)


@pytest.mark.timeout(90)
def test_a_first_start_that_fails_after_the_arena_leaves_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The checks passed, then the port was taken before the publisher bound it (a race the
    # checks cannot close): the arena this start created goes with it.
    monkeypatch.setattr("offloadd.server.daemon.raise_on_failure", lambda *a, **k: None)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        daemon = DaemonThread()
        daemon.settings = msgspec.structs.replace(
            daemon.settings,
            cache=msgspec.structs.replace(
                daemon.settings.cache, persist=True, journal=f"{daemon.workdir}/state/journal"
            ),
            events=msgspec.structs.replace(
                daemon.settings.events, endpoint=f"tcp://127.0.0.1:{taken.getsockname()[1]}"
            ),
        )
        try:
            with pytest.raises(EventBindError):
                daemon.start()
            assert not os.path.exists(daemon.arena_path)
        finally:
            if os.path.exists(daemon.arena_path):
                os.unlink(daemon.arena_path)


_FROZEN_AFTER_SERVE = """
import gc, os, signal, sys, threading, time
from offloadd.cli import main
endpoint = sys.argv[1]

def stop_once_listening():
    while not os.path.exists(endpoint.removeprefix("ipc://")):
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=stop_once_listening, daemon=True).start()
status = main(["serve", "--endpoint", endpoint, "--arena", sys.argv[2], "--capacity", "16MiB",
               "--no-persist", "--events-endpoint", "", "--metrics-address", "",
               "--log-level", "WARNING"])
print(status, gc.get_freeze_count())
"""


@pytest.mark.timeout(90)
def test_serve_freezes_its_startup_heap_for_the_collector(tmp_path: Path) -> None:
    # A full collection over the startup heap took 30-80 ms inside a step's Store or Load.
    arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    endpoint = f"ipc://{tmp_path}/control.sock"
    try:
        result = subprocess.run(
            [sys.executable, "-c", _FROZEN_AFTER_SERVE, endpoint, arena],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        if os.path.exists(arena):
            os.unlink(arena)
    status, frozen = result.stdout.split()
    assert status == "0", result.stderr
    assert int(frozen) > 10_000, result.stdout  # every module and object startup built

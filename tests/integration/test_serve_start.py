"""``offloadd serve`` refused by its environment at start: one line and an exit, never a hang."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

import pytest


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

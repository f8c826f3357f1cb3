"""A real ``offloadd serve`` process answers its health probes on the metrics endpoint."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

from offloadd import __version__


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def get(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A daemon with metrics on a loopback port; yields that ``HOST:PORT``."""
    run = tmp_path_factory.mktemp("run")
    os.chmod(run, 0o700)
    address = f"127.0.0.1:{free_port()}"
    arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    process = subprocess.Popen(
        [
            sys.executable, "-m", "offloadd", "serve",
            "--endpoint", f"ipc://{run}/offloadd.sock",
            "--arena", arena,
            "--capacity", "16MiB",
            "--no-persist",
            "--events-endpoint", "",
            "--metrics-address", address,
            "--log-level", "WARNING",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[1]
            try:
                if get(address, "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the daemon never became ready"
            time.sleep(0.05)
        yield address
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
        if os.path.exists(arena):
            os.unlink(arena)


@pytest.mark.timeout(120)
def test_probes_and_a_404(served: str) -> None:
    assert get(served, "/healthz") == (200, "ok\n")
    assert get(served, "/readyz") == (200, "ready\n")
    assert get(served, "/livez")[0] == 404
    status, text = get(served, "/metrics")
    assert status == 200
    assert "process_resident_memory_bytes" in text
    assert "process_start_time_seconds" in text
    assert f'offloadd_build_info{{copy_engine="cpu",version="{__version__}"}} 1.0' in text

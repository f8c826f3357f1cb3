"""A real ``mooncake_master`` on free 127.0.0.1 ports, with its HTTP metadata server.

``MooncakeMaster.start()`` waits until the metadata server answers; ``kill()`` and
``start()`` again restart it on the same ports (a restart loses every object, as in
production). ``mooncake_available()`` says whether the tests can run: under ``CI=true`` a
missing install fails them instead of skipping (CI installs the extra, scripts/bootstrap.sh).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from tests.ports import free_ports

_START_TIMEOUT = 30.0


def master_binary() -> str | None:
    """``mooncake_master`` beside this interpreter (the venv's bin), else on the PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mooncake_master")


def mooncake_problem() -> str:
    """What keeps the cluster tier from running here, or ``""``."""
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake is not installed (pip install 'offloadd[mooncake]')"
    try:
        importlib.import_module("mooncake.store")
    except ImportError as exc:
        return f"mooncake.store does not import ({exc}; apt-get install libibverbs1?)"
    if master_binary() is None:
        return "mooncake_master is not on the PATH"
    return ""


def require_mooncake() -> None:
    """Skip the calling test module without mooncake; under CI=true, fail instead."""
    problem = mooncake_problem()
    if not problem:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{problem}: CI must install it (scripts/bootstrap.sh)", pytrace=False)
    pytest.skip(problem, allow_module_level=True)


class MooncakeMaster:
    """One master process on loopback; a context manager that kills it at exit."""

    def __init__(self, *, lease_ms: int = 5000) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master is not installed")
        self._binary = binary
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        self._lease_ms = lease_ms
        # Closed (and removed) in __exit__, after the process that writes it is gone.
        self._log = tempfile.NamedTemporaryFile(prefix="mooncake-master-", suffix=".log")  # noqa: SIM115
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self) -> MooncakeMaster:
        """Start (or restart) the master and wait until its metadata server answers."""
        assert self.process is None, "already running"
        self.process = subprocess.Popen(
            [
                self._binary,
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                # Leases shorter than the default 10 s (a test rewrites objects it has read),
                # long enough for any transfer of a loaded machine (an expired one: -707).
                f"--default_kv_lease_ttl={self._lease_ms}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited: {self.log_tail()}")
            if self._answers():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"mooncake_master did not answer in {_START_TIMEOUT}s")

    def _answers(self) -> bool:
        if not self._rpc_listening():
            return False
        try:
            urllib.request.urlopen(f"{self.metadata}?key=probe", timeout=1).close()
        except urllib.error.HTTPError:
            return True  # 404 for an unknown key: it answers
        except OSError:
            return False
        return True

    def _rpc_listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.rpc_port), timeout=1):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL and reap; idempotent."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait(timeout=30)
        self.process = None

    def log_tail(self, size: int = 2000) -> str:
        with open(self._log.name, "rb") as handle:
            return handle.read()[-size:].decode(errors="replace")

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        self._log.close()

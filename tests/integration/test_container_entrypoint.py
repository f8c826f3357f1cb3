"""deploy/entrypoint.sh as the image runs it: the Containerfile's environment, the
DaemonSet's environment and arguments and the ConfigMap's offloadd.toml, with the paths the
DaemonSet mounts (config, socket directory, state directory, arena) in temporary places. It
must start a daemon that serves the demo, answer `status`, and stop cleanly on SIGTERM,
keeping the arena and its journal (warm restart)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy_series import ROOT
from tests.ports import free_port

ENTRYPOINT = ROOT / "deploy" / "entrypoint.sh"
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
KUBERNETES = ROOT / "deploy" / "kubernetes"
BIN = Path(sys.executable).parent  # the image has offloadd on its PATH; here the venv's


def _final_stage() -> str:
    return CONTAINERFILE.read_text().rsplit("\nFROM ", 1)[1]


def _image() -> tuple[list[str], list[str], dict[str, str]]:
    """ENTRYPOINT, CMD and ENV of the image's final stage."""
    stage = _final_stage()
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", stage, re.MULTILINE)
    cmd = re.search(r"^CMD (\[.*\])$", stage, re.MULTILINE)
    assert entrypoint and cmd, "exec-form ENTRYPOINT and CMD"
    env = dict(re.findall(r"^ENV (\w+)=(\S+)$", stage, re.MULTILINE))
    return json.loads(entrypoint[1]), json.loads(cmd[1]), env


def _manifest(name: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((KUBERNETES / name).read_text())
    return document


@dataclass
class Container:
    """The paths the DaemonSet mounts, here; the environment the container gets."""

    root: str
    env: dict[str, str]
    arena: str
    metrics: str

    @property
    def socket(self) -> str:
        return f"{self.env['RUNTIME_DIRECTORY']}/offloadd.sock"

    def log(self) -> str:
        with open(f"{self.root}/container.log", errors="replace") as log:
            return log.read()

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``kubectl exec`` of the entrypoint with ``args``: the container's environment."""
        return subprocess.run(
            [str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=timeout,
            check=False, env=self.env, cwd=self.root,
        )  # fmt: skip


@pytest.fixture
def container() -> Iterator[Container]:
    if not (BIN / "offloadd").exists():
        pytest.skip(f"no offloadd script beside {sys.executable} (pip install -e .)")
    root = tempfile.mkdtemp(prefix="od-ctr-", dir="/tmp")
    _, _, image_env = _image()
    (daemon,) = _manifest("daemonset.yaml")["spec"]["template"]["spec"]["containers"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("OFFLOADD_")}
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
        env.pop(key, None)
    env.update(image_env)
    env.update({item["name"]: item["value"] for item in daemon["env"] if "value" in item})
    env["OFFLOADD_EVENTS__POD"] = "node-a"  # the DaemonSet's spec.nodeName
    # The mounts, in temporary places: the ConfigMap, /run/offloadd and /var/lib/offloadd
    # (as the init container leaves them), the arena in /dev/shm under a unique name.
    config = Path(root, "etc", "offloadd.toml")
    config.parent.mkdir()
    # Each value is checked where it comes from, so a group this host lacks is taken out of
    # the file itself, not overridden.
    toml, groups = re.subn(
        r'^socket_group = "offloadd-clients"$',
        'socket_group = ""',
        _manifest("configmap.yaml")["data"]["offloadd.toml"],
        flags=re.MULTILINE,
    )
    assert groups == 1, "the ConfigMap names the socket group"
    config.write_text(toml)
    os.mkdir(f"{root}/run", 0o750)
    os.mkdir(f"{root}/state", 0o700)
    arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    metrics = f"127.0.0.1:{free_port()}"
    env.update(
        OFFLOADD_CONFIG=str(config),
        RUNTIME_DIRECTORY=f"{root}/run",
        STATE_DIRECTORY=f"{root}/state",
        OFFLOADD_CACHE__ARENA=arena,
        # What this host lacks: a GPU, 64 GiB to spare; and a port of its own, where the pod
        # has its own network namespace.
        OFFLOADD_SERVER__COPY_ENGINE="cpu",
        OFFLOADD_CACHE__CAPACITY="64MiB",
        OFFLOADD_METRICS__ADDRESS=metrics,
        # The demo's ranks run as this test's root, which the ConfigMap's tenancy refuses an
        # engine session (only uids of a tenant's range have one: test_kube_identity.py).
        OFFLOADD_TENANCY__UID_RANGES_ONLY="false",
    )
    # The image's PATH, with this checkout's offloadd where the image has its venv.
    env["PATH"] = image_env["PATH"].replace("/opt/offloadd/venv/bin", str(BIN))
    env["PYTHONPATH"] = str(ROOT)
    try:
        yield Container(root, env, arena, metrics)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(arena)
        shutil.rmtree(root, ignore_errors=True)


PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def _wait_serving(container: Container, process: subprocess.Popen[bytes]) -> str:
    """``/metrics`` once the daemon reports its uptime (its sockets are bound by then)."""
    deadline = time.monotonic() + 90
    while True:
        assert process.poll() is None, f"exited with {process.returncode}:\n{container.log()}"
        try:
            with urllib.request.urlopen(f"http://{container.metrics}/metrics", timeout=5) as r:
                text: str = r.read().decode()
            if "\noffloadd_uptime_seconds " in text:
                return text
        except (urllib.error.URLError, ConnectionError):
            pass
        assert time.monotonic() < deadline, f"not serving:\n{container.log()}"
        time.sleep(0.05)  # poll interval while it starts


def test_entrypoint_serves_the_demo_and_stops_on_sigterm(container: Container) -> None:
    entrypoint, cmd, _ = _image()
    assert entrypoint == ["/usr/local/bin/offloadd-entrypoint"]
    assert f"COPY deploy/entrypoint.sh {entrypoint[0]}" in _final_stage()
    (daemon,) = _manifest("daemonset.yaml")["spec"]["template"]["spec"]["containers"]
    args = daemon.get("args", cmd)
    assert args == cmd == ["serve"]

    with open(f"{container.root}/container.log", "ab") as log:
        process = subprocess.Popen(
            [str(ENTRYPOINT), *args], stdout=log, stderr=log, env=container.env,
            cwd=container.root, start_new_session=True,
        )  # fmt: skip
    try:
        metrics = _wait_serving(container, process)
        assert "offloadd_capacity_bytes 6.7108864e+07" in metrics
        # The kubelet's probes, as the DaemonSet declares them, pass once it serves.
        probes = [daemon[kind]["httpGet"]["path"] for kind in PROBES if kind in daemon]
        assert {"/healthz", "/readyz"} <= set(probes)
        for path in probes:
            with urllib.request.urlopen(f"http://{container.metrics}{path}", timeout=5) as r:
                assert r.status == 200, path
        # exec: the daemon is the process the kubelet signals, reading the mounted config.
        with open(f"/proc/{process.pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
        assert b"serve" in argv and container.env["OFFLOADD_CONFIG"].encode() in argv
        assert os.path.exists(container.socket), "the socket in RUNTIME_DIRECTORY"

        status = container.run("status", timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        demo = container.run("demo", "--endpoint", f"ipc://{container.socket}")
        assert demo.returncode == 0, demo.stdout + demo.stderr + container.log()
        assert "0 mismatched" in demo.stdout

        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, container.log()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    assert not os.path.exists(container.socket), "socket left behind"
    # Kept for the next pod: the arena, its journal and key in STATE_DIRECTORY.
    assert os.path.exists(container.arena)
    journal = Path(container.env["STATE_DIRECTORY"], Path(container.arena).name + ".journal")
    assert journal.exists() and journal.with_name(journal.name + ".key").exists()


def test_entrypoint_passes_check_config_the_mounted_file(container: Container) -> None:
    result = container.run("check-config", "--json", timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    settings = json.loads(result.stdout)
    assert settings["cache"]["arena"] == container.arena
    assert settings["cache"]["persist"] is True
    container.env["OFFLOADD_CONFIG"] = f"{container.root}/missing.toml"
    missing = container.run("check-config", timeout=60)
    assert missing.returncode == 2 and "missing.toml" in missing.stderr

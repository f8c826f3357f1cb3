"""``offloadd install --prefix``: the wheel ``make dist`` builds installed into a temporary
root, its unit verified by ``systemd-analyze verify``, the daemon started from that venv and
answered by that venv's client, a second run changing nothing.

``install`` runs as the quickstart runs it, from the wheel itself with the standard library
alone (``python -S``: no site-packages), and installs the wheel it runs from.

The venv is made first with this interpreter's site-packages on its path (a ``.pth`` file),
as an operator makes it first with the node's torch (docs/operations.md): ``install
--no-deps`` then adds the wheel alone, and nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadd import install

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """This environment without settings or a systemd service's variables."""
    skip = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "RUNTIME_DIRECTORY", "PYTHONPATH")
    return {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD_") and k not in skip}


def _install(wheel: Path, prefix: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**_env(), "PYTHONPATH": str(wheel)}
    return subprocess.run(
        [sys.executable, "-S", "-m", "offloadd", "install", "--prefix", str(prefix), *args],
        capture_output=True, text=True, env=env, cwd=prefix.parent, timeout=180, check=False,
    )  # fmt: skip


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    return tmp_path / "root"


def _venv_with_this_interpreters_packages(prefix: Path) -> Path:
    venv = prefix / install.VENV.lstrip("/")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_dry_run_changes_nothing_and_prints_the_vllm_line(
    dist: tuple[Path, Path], prefix: Path
) -> None:
    wheel, _ = dist
    done = _install(wheel, prefix, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert not prefix.exists()
    assert f"would   create venv and install {wheel.name}" in done.stdout
    assert f"would   write unit {prefix}/etc/systemd/system/offloadd.service" in done.stdout
    assert "3 changes to make; nothing was changed" in done.stdout
    assert '"kv_load_failure_policy": "recompute"' in done.stdout
    assert '"offloadd_endpoint": "ipc:///run/offloadd/offloadd.sock"' in done.stdout


def test_a_missing_wheel_is_one_line(dist: tuple[Path, Path], prefix: Path) -> None:
    prefix.parent.mkdir(exist_ok=True)
    done = _install(dist[0], prefix, "--wheel", str(prefix / "none.whl"))
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("offloadd install: argument --wheel: no wheel (*.whl) at "), line
    assert not prefix.exists()


@contextlib.contextmanager
def _serving(offloadd: Path) -> Iterator[str]:
    """The installed ``offloadd serve`` on a private endpoint and arena; its endpoint."""
    workdir = tempfile.mkdtemp(prefix="od-", dir="/tmp")
    endpoint = f"ipc://{workdir}/d.sock"
    arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    env = {**_env(), "XDG_STATE_HOME": workdir}
    command = [str(offloadd), "serve", "--endpoint", endpoint, "--arena", arena,
               "--capacity", "16MiB", "--no-persist", "--events-endpoint", "",
               "--metrics-address", ""]  # fmt: skip
    log = Path(workdir) / "daemon.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=out, env=env, cwd=workdir)
    try:
        yield endpoint
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(arena)
        shutil.rmtree(workdir, ignore_errors=True)


def _status(offloadd: Path, endpoint: str, timeout: float = 60) -> str:
    """The installed client's ``offloadd status`` once the daemon answers."""
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run(
            [str(offloadd), "status", "--endpoint", endpoint, "--timeout", "1"],
            capture_output=True, text=True, env=_env(), cwd="/", timeout=30, check=False,
        )  # fmt: skip
        if done.returncode == 0:
            return done.stdout
        assert time.monotonic() < deadline, f"no daemon answered: {done.stderr}"


@pytest.mark.timeout(240)
def test_install_into_a_prefix_verify_the_unit_and_serve_from_the_venv(
    dist: tuple[Path, Path], prefix: Path
) -> None:
    wheel, _ = dist
    venv = _venv_with_this_interpreters_packages(prefix)
    first = _install(wheel, prefix, "--no-deps")
    assert first.returncode == 0, first.stderr
    assert f"from {wheel}\n" in first.stdout  # the wheel it runs from
    assert "3 changes made" in first.stdout
    assert "create system" not in first.stdout  # --prefix: no users unless --create-users

    unit = prefix / "etc/systemd/system/offloadd.service"
    config = prefix / "etc/offloadd/offloadd.toml"
    offloadd = venv / "bin" / "offloadd"
    assert f"ExecStart={offloadd} serve --config {config}\n" in unit.read_text()
    assert config.read_text() == (REPO / "systemd" / "offloadd.toml").read_text()
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import offloadd; print(offloadd.__file__)"],
        capture_output=True, text=True, env=_env(), cwd="/", timeout=60, check=True,
    )  # fmt: skip
    assert where.stdout.startswith(str(venv)), where.stdout  # the wheel's, not the checkout's

    analyze = shutil.which("systemd-analyze")
    if analyze:  # its ExecStart= must exist and be executable, among the rest
        verified = subprocess.run(
            [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
        )
        assert verified.returncode == 0, verified.stderr
        assert verified.stderr == "", verified.stderr

    stamps = {path: path.stat().st_mtime_ns for path in (unit, config, venv / install.MARKER)}
    again = _install(wheel, prefix, "--no-deps")
    assert again.returncode == 0, again.stderr
    assert "nothing to change: already installed" in again.stdout
    assert "doing" not in again.stdout
    assert {path: path.stat().st_mtime_ns for path in stamps} == stamps

    with _serving(offloadd) as endpoint:
        assert "offloadd" in _status(offloadd, endpoint)

    if not analyze:
        pytest.skip(
            "systemd-analyze is not installed here (apt-get install systemd): unit unverified"
        )


def test_an_edited_settings_file_is_kept_and_a_changed_unit_replaced(
    dist: tuple[Path, Path], prefix: Path
) -> None:
    wheel, _ = dist
    _venv_with_this_interpreters_packages(prefix)
    assert _install(wheel, prefix, "--no-deps").returncode == 0
    unit = prefix / "etc/systemd/system/offloadd.service"
    config = prefix / "etc/offloadd/offloadd.toml"
    config.write_text('[cache]\ncapacity = "2GiB"\n')
    unit.write_text(unit.read_text() + "# edited\n")
    done = _install(wheel, prefix, "--no-deps")
    assert done.returncode == 0, done.stderr
    assert f"doing   replace unit {unit}" in done.stdout
    assert "1 change made" in done.stdout
    assert config.read_text() == '[cache]\ncapacity = "2GiB"\n'
    assert "# edited" not in unit.read_text()

"""The built wheel: what lands in site-packages, and that ``offloadd bench`` runs from it.

The wheel is built from a copy of the sources (so the checkout gets no build/ or egg-info),
installed with ``pip install --target`` into a temporary directory, and run with only that
directory on ``PYTHONPATH`` from a directory outside the checkout, so nothing can be
imported from the checkout by accident.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(the wheel, the directory it is installed into)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("protocol", "offloadd"):
        shutil.copytree(
            REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    wheels = root / "wheels"
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
        check=True,
        timeout=120,
    )
    (wheel,) = wheels.glob("offloadd-*.whl")
    target = root / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=120,
    )
    yield wheel, target


def _installed_env(target: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD_")}
    env["PYTHONPATH"] = str(target)
    return env


def test_wheel_holds_only_offloadd_and_protocol(wheel_install: tuple[Path, Path]) -> None:
    wheel, _ = wheel_install
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        recorded = [line.split(",")[0] for line in archive.read(record).decode().splitlines()]
    for listing in (names, recorded):
        top = {name.split("/")[0] for name in listing if name}
        packages = {name for name in top if not name.endswith(".dist-info")}
        assert packages == {"offloadd", "protocol"}
    assert "offloadd/bench/__init__.py" in names
    assert "offloadd/bench/_servers.py" in names


def test_bench_runs_from_the_installed_wheel(
    wheel_install: tuple[Path, Path], tmp_path: Path
) -> None:
    _, target = wheel_install
    env = _installed_env(target)
    where = subprocess.run(
        [sys.executable, "-c", "import offloadd.bench, protocol; print(offloadd.bench.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=True,
    )
    assert where.stdout.strip() == str(target / "offloadd" / "bench" / "__init__.py")

    script = target / "bin" / "offloadd"
    helped = subprocess.run(
        [str(script), "bench", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert helped.returncode == 0, helped.stderr
    assert "--quick" in helped.stdout

    # The smallest real run: a daemon and an echo server as subprocesses of the installed
    # package (python -m offloadd.bench._servers), eight real clients, a table.
    results = tmp_path / "bench.json"
    ran = subprocess.run(
        [str(script), "bench", "--quick", "--only", "handshake", "--json", str(results)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert "handshake_8_ranks" in ran.stdout
    assert "Traceback" not in ran.stderr
    assert results.exists()

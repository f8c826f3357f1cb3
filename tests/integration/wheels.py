"""The wheel and sdist as ``make dist`` builds them, built once per test session
(tests/integration/test_wheel.py checks them, test_install.py installs the wheel).

Built from a copy of the sources, so the checkout gets no build/ or egg-info.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


def build_dist(root: Path) -> tuple[Path, Path]:
    """(the wheel, the sdist), built under ``root`` from a copy of the checkout's sources."""
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    for package in ("protocol", "offloadd"):
        shutil.copytree(
            REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    wheels = root / "wheels"
    subprocess.run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
        check=True,
        timeout=120,
    )
    (wheel,) = wheels.glob("offloadd-*.whl")
    sdists = root / "sdists"
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from setuptools import build_meta; build_meta.build_sdist({str(sdists)!r})",
        ],
        check=True,
        timeout=120,
        cwd=source,
        capture_output=True,
    )
    (sdist,) = sdists.glob("offloadd-*.tar.gz")
    return wheel, sdist

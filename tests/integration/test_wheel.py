"""The built wheel and sdist: their metadata and LICENSE, what lands in site-packages, that
every module in it imports from it alone, that it carries the files ``offloadd install``
writes, and that ``offloadd bench`` runs from it.

The wheel is built once per session from a copy of the sources (tests/integration/wheels.py),
installed with ``pip install --target`` into a temporary directory, and run with only that
directory on ``PYTHONPATH`` from a directory outside the checkout, so nothing can be
imported from the checkout by accident (the declared dependencies come from this
interpreter's site-packages).
"""

from __future__ import annotations

import ast
import email.parser
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import offloadd
from tests.integration.wheels import PIP

REPO = Path(__file__).resolve().parents[2]
# The checkout's packages the wheel does not carry: nothing in it may need them.
UNSHIPPED = ("tests", "benchmarks")
# What an optional extra installs (vllm, mooncake, cuda12/13): a module of the plugin or of a
# tier may not import where its extra is missing, and that is all it may miss.
OPTIONAL = {"vllm", "mooncake", "cryptography", "cuda"}

# Imports every module named in argv[2:], in this fresh interpreter, and prints a JSON report:
# an import of tests or benchmarks fails as if they were absent (as on a node, even when this
# interpreter could reach a checkout), and each module must come from argv[1].
IMPORT_EVERY_MODULE = """
import importlib, importlib.abc, json, sys, traceback

target, names = sys.argv[1], sys.argv[2:]
unshipped = {"tests", "benchmarks"}


class Unshipped(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in unshipped:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the wheel)", name=name)
        return None


sys.meta_path.insert(0, Unshipped())
report = {"imported": [], "missing": {}, "failed": {}, "elsewhere": {}}
for name in names:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        report["missing"][name] = [exc.name or "", traceback.format_exc()]
        continue
    except BaseException:
        report["failed"][name] = traceback.format_exc()
        continue
    report["imported"].append(name)
    where = getattr(module, "__file__", None) or ""
    if not where.startswith(target):
        report["elsewhere"][name] = where
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def built(
    dist: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, Path]:
    """(the wheel, the directory it is installed into, the sdist), as ``make dist`` builds
    them."""
    wheel, sdist = dist
    target = tmp_path_factory.mktemp("wheel") / "site"
    subprocess.run(
        [*PIP, "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=120,
    )
    return wheel, target, sdist


@pytest.fixture(scope="module")
def wheel_install(built: tuple[Path, Path, Path]) -> tuple[Path, Path]:
    """(the wheel, the directory it is installed into)."""
    return built[0], built[1]


# What an index shows of the package: the core metadata fields each must carry.
METADATA = {
    "Name": ["offloadd"],
    "License-Expression": ["Apache-2.0"],
    "License-File": ["LICENSE"],
    "Author": ["offloadd developers"],
}


def _metadata_problems(text: str) -> list[str]:
    """What a METADATA or PKG-INFO lacks of ``METADATA``, classifiers and keywords, or has
    that it should not: project URLs (the project has no public home; pyproject.toml)."""
    message = email.parser.Parser().parsestr(text)
    problems = [
        f"{field}: {message.get_all(field)} != {values}"
        for field, values in METADATA.items()
        if message.get_all(field) != values
    ]
    # An index shows these as the project's links: none until there is a real one.
    if message.get_all("Project-URL") or message.get("Home-page"):
        problems.append(f"Project-URL: {message.get_all('Project-URL')}")
    classifiers = message.get_all("Classifier") or []
    if "Operating System :: POSIX :: Linux" not in classifiers or len(classifiers) < 5:
        problems.append(f"Classifier: {classifiers}")
    if "vllm" not in (message.get("Keywords") or "").split(","):
        problems.append(f"Keywords: {message.get('Keywords')}")
    if message.get("Version") != offloadd.__version__:
        problems.append(f"Version: {message.get('Version')} != {offloadd.__version__}")
    return problems


def test_wheel_and_sdist_carry_the_metadata_and_the_license(
    built: tuple[Path, Path, Path],
) -> None:
    wheel, _, sdist = built
    license_text = (REPO / "LICENSE").read_text()
    assert license_text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in license_text
    info = f"offloadd-{offloadd.__version__}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        assert _metadata_problems(archive.read(f"{info}/METADATA").decode()) == []
        assert archive.read(f"{info}/licenses/LICENSE").decode() == license_text
    top = f"offloadd-{offloadd.__version__}"
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
        pkg_info = archive.extractfile(f"{top}/PKG-INFO")
        copied = archive.extractfile(f"{top}/LICENSE")
        assert pkg_info is not None and copied is not None
        assert _metadata_problems(pkg_info.read().decode()) == []
        assert copied.read().decode() == license_text
    # The sdist builds the same wheel: its sources are all there.
    assert {f"{top}/pyproject.toml", f"{top}/README.md", f"{top}/offloadd/cli.py"} <= names
    assert f"{top}/protocol/messages.py" in names
    assert not any(name.startswith((f"{top}/tests/", f"{top}/benchmarks/")) for name in names)


def test_wheel_carries_the_files_offloadd_install_writes(
    wheel_install: tuple[Path, Path], tmp_path: Path
) -> None:
    """The unit and the settings file, as systemd/ in the checkout has them, read the way
    ``offloadd install`` reads them from an installed wheel."""
    wheel, target = wheel_install
    with zipfile.ZipFile(wheel) as archive:
        for name in ("offloadd.service", "offloadd.toml"):
            shipped = archive.read(f"offloadd/data/{name}").decode()
            assert shipped == (REPO / "systemd" / name).read_text(), name
    code = "from offloadd.install import shipped; print(shipped('offloadd.service'), end='')"
    read = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_installed_env(target),
        cwd=tmp_path,
        timeout=60,
        check=True,
    )
    assert read.stdout == (REPO / "systemd" / "offloadd.service").read_text()


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


def _wheel_modules(wheel: Path) -> dict[str, str]:
    """Every module in the wheel (dotted name -> its source), ``__main__`` modules aside:
    importing one runs its command."""
    modules = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not name.endswith(".py") or name.endswith("/__main__.py"):
                continue
            dotted = name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            modules[dotted] = archive.read(name).decode()
    return modules


def test_no_module_in_the_wheel_names_the_tests_or_the_benchmarks(
    wheel_install: tuple[Path, Path],
) -> None:
    """Statically: no import statement, no import call given a literal, no module-name
    literal under ``tests`` or ``benchmarks``, in any module the wheel carries."""
    wheel, _ = wheel_install
    modules = _wheel_modules(wheel)
    assert "offloadd.cli" in modules and "protocol.messages" in modules
    offenders = []
    for dotted, source in modules.items():
        for node in ast.walk(ast.parse(source, dotted)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]  # import_module("tests.x"), a spec module path, ...
            else:
                continue
            offenders += [
                f"{dotted}:{node.lineno}: {name}"
                for name in names
                if name.split(".")[0] in UNSHIPPED and name.replace(".", "").isidentifier()
            ]
    assert offenders == []


@pytest.mark.timeout(180)
def test_every_module_in_the_wheel_imports_from_the_wheel_alone(
    wheel_install: tuple[Path, Path], tmp_path: Path
) -> None:
    wheel, target = wheel_install
    names = sorted(_wheel_modules(wheel))
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_MODULE, str(target), *names],
        capture_output=True,
        text=True,
        env=_installed_env(target),
        cwd=tmp_path,
        timeout=170,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["failed"] == {}
    assert report["elsewhere"] == {}
    # Only a missing optional extra may keep a module from importing.
    bad = {
        name: trace
        for name, (missing, trace) in report["missing"].items()
        if missing.split(".")[0] not in OPTIONAL
    }
    assert bad == {}
    assert set(report["imported"]) | set(report["missing"]) == set(names)
    assert {"offloadd.cli", "offloadd.gpu_check", "offloadd.bench.vllm_manager"} <= set(
        report["imported"]
    )


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

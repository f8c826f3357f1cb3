"""The tests' own layout: helpers live in helper modules, never in a test module.

A test module (``test_*.py``) holds tests; what two of them share (fakes, builders, oracles,
harnesses) lives in a helper module (``tests/fakes.py``, ``tests/helpers.py``,
``tests/oracles.py``, ``tests/integration/harness.py``, ...). And the code that ships
(``offloadd``, ``protocol``) never imports the tests or the development benchmarks: the
wheel carries neither ``tests`` nor ``benchmarks``. Not by an import statement, and not by
name at run time either: ``importlib.import_module("tests...")``, ``__import__`` or
``find_spec`` given a string literal, or any string literal that is a dotted module name
under them (a name in a tuple an import loop walks, a spec module path vLLM imports).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Top-level packages of the checkout that the wheel does not carry.
UNSHIPPED = ("tests", "benchmarks")
# Calls that import (or find) a module named by their first argument.
IMPORT_CALLS = ("import_module", "__import__", "find_spec")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def imported_modules(source: str, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every module ``source`` (a module of ``package``) imports:
    relative imports resolved, ``from package import name`` counted as ``package.name`` too
    (the name may be a module)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            found.append((node.lineno, module))
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and _called_name(node.func) in IMPORT_CALLS:
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append((node.lineno, first.value))  # importlib.import_module("x.y")
    return found


def _called_name(func: ast.expr) -> str:
    """``import_module`` for ``importlib.import_module(...)`` and ``import_module(...)``."""
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def module_literals(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every string literal in ``source`` that is a dotted name."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and _DOTTED.fullmatch(node.value)
    ]


def imports(*tops: str, root: Path = ROOT) -> list[tuple[str, int, str]]:
    """``(file, line, module)`` of every import in the packages ``tops`` under ``root``."""
    found = []
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            package = path.relative_to(root).with_suffix("").parts[:-1]
            for line, module in imported_modules(path.read_text(), package):
                found.append((str(path.relative_to(root)), line, module))
    return found


def unshipped(module: str) -> bool:
    """Whether ``module`` is (under) a package the wheel does not carry."""
    return module.split(".", 1)[0] in UNSHIPPED


def shipped_offenders(root: Path = ROOT) -> list[str]:
    """``file:line: name`` wherever ``offloadd`` or ``protocol`` under ``root`` imports, or
    names as a module, ``tests`` or ``benchmarks``."""
    offenders = [
        f"{path}:{line}: {module}"
        for path, line, module in imports("offloadd", "protocol", root=root)
        if unshipped(module)
    ]
    for top in ("offloadd", "protocol"):
        for path in sorted((root / top).rglob("*.py")):
            offenders += [
                f"{path.relative_to(root)}:{line}: {text!r}"
                for line, text in module_literals(path.read_text())
                if unshipped(text)
            ]
    return offenders


def names_a_test_module(module: str) -> bool:
    return any(part.startswith("test_") for part in module.split("."))


def test_no_module_under_tests_imports_a_test_module() -> None:
    offenders = [
        f"{path}:{line}: {module}"
        for path, line, module in imports("tests")
        if names_a_test_module(module)
    ]
    assert offenders == [], "move what is shared into a helper module:\n" + "\n".join(offenders)


def test_shipped_code_never_imports_the_tests_or_the_benchmarks() -> None:
    assert shipped_offenders() == []


@pytest.mark.parametrize(
    "line",
    [
        "import tests.vllm.harness",
        "from benchmarks import vllm_step",
        "from tests import helpers",
        'harness = importlib.import_module("tests.vllm.harness")',
        'from importlib import import_module\nstep = import_module("benchmarks.vllm_step")',
        'tests = __import__("tests")',
        'spec = importlib.util.find_spec("tests.vllm")',
        'mods = [importlib.import_module(n) for n in ("tests.vllm.harness", *names)]',
        'extra = {"spec_module_path": "tests.vllm.simple_spec"}',
    ],
)
def test_the_shipped_code_check_catches_every_way_of_naming_them(line: str, tmp_path: Path) -> None:
    """The check above, run on a module of a stand-in checkout, flags each form."""
    for top in ("offloadd", "protocol"):
        (tmp_path / top).mkdir()
        (tmp_path / top / "__init__.py").write_text('"""Docs may name tests.vllm.harness."""\n')
    (tmp_path / "offloadd" / "bench.py").write_text(f"import importlib\n\n\ndef f():\n    {line}\n")
    offenders = shipped_offenders(tmp_path)
    assert offenders, line
    assert all(o.startswith("offloadd/bench.py:") for o in offenders), offenders


def test_the_shipped_code_check_leaves_other_names_alone(tmp_path: Path) -> None:
    for top in ("offloadd", "protocol"):
        (tmp_path / top).mkdir()
    (tmp_path / "offloadd" / "ok.py").write_text(
        "import importlib\n"
        'importlib.import_module("mooncake.store")\n'
        "importlib.import_module(name)\n"
        'path = "tests/vllm/harness.py"\n'
        'words = "run the tests"\n'
        'latest = "testsuite.x"\n'
    )
    assert shipped_offenders(tmp_path) == []


def test_the_walk_sees_every_form_of_import() -> None:
    """The checks above would pass vacuously if the walk missed a form of import."""
    source = (
        "import os\n"
        "from tests.integration.harness import make_rank\n"
        "from .test_x import helper\n"
        "from . import test_y\n"
        "import tests.vllm.test_z\n"
        "def f():\n"
        "    from ..integration.test_w import thing\n"
        '    importlib.import_module("tests.unit.test_v")\n'
        '    __import__("tests.unit.test_u")\n'
    )
    modules = [module for _, module in imported_modules(source, ("tests", "unit"))]
    assert "tests.integration.harness.make_rank" in modules
    assert [module for module in modules if names_a_test_module(module)] == [
        "tests.unit.test_x",
        "tests.unit.test_x.helper",
        "tests.unit.test_y",
        "tests.vllm.test_z",
        "tests.integration.test_w",
        "tests.integration.test_w.thing",
        "tests.unit.test_v",
        "tests.unit.test_u",
    ]
    assert len(imports("tests")) > 500  # the walk found the suite

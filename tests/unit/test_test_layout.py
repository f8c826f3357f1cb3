"""The tests' own layout: helpers live in helper modules, never in a test module.

A test module (``test_*.py``) holds tests; what two of them share (fakes, builders, oracles,
harnesses) lives in a helper module (``tests/fakes.py``, ``tests/helpers.py``,
``tests/oracles.py``, ``tests/integration/harness.py``, ...). And the code that ships
(``offloadd``, ``protocol``) never imports the tests: the wheel carries no ``tests``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
    return found


def imports(*tops: str) -> list[tuple[str, int, str]]:
    """``(file, line, module)`` of every import in the packages ``tops``."""
    found = []
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            package = path.relative_to(ROOT).with_suffix("").parts[:-1]
            for line, module in imported_modules(path.read_text(), package):
                found.append((str(path.relative_to(ROOT)), line, module))
    return found


def names_a_test_module(module: str) -> bool:
    return any(part.startswith("test_") for part in module.split("."))


def test_no_module_under_tests_imports_a_test_module() -> None:
    offenders = [
        f"{path}:{line}: {module}"
        for path, line, module in imports("tests")
        if names_a_test_module(module)
    ]
    assert offenders == [], "move what is shared into a helper module:\n" + "\n".join(offenders)


def test_shipped_code_never_imports_the_tests() -> None:
    offenders = [
        f"{path}:{line}: {module}"
        for path, line, module in imports("offloadd", "protocol")
        if module == "tests" or module.startswith("tests.")
    ]
    assert offenders == []


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
    ]
    assert len(imports("tests")) > 500  # the walk found the suite

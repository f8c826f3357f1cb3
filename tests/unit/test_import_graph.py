"""The import graph of ``offloadd`` and ``protocol``: no loops, and the process boundary holds.

Read from the source with ``ast`` (nothing is imported), so a loop hidden behind a
``TYPE_CHECKING`` block or a function-level import counts as much as a top-level one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("offloadd", "protocol")
# What ranks and routers import: none of it may reach the daemon's wing.
LIBRARIES = (
    "offloadd.client",
    "offloadd.client_core",
    "offloadd.async_client",
    "offloadd.subscriber",
    "offloadd.shm",
    "offloadd.errors",
    "offloadd.cuda_ipc",
    "offloadd.peer",
    "offloadd.vllm",
    "offloadd.sglang",
)
SERVER = "offloadd.server"


def module_files() -> dict[str, Path]:
    """Every module of the two packages, by dotted name."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imported_names(name: str, path: Path) -> Iterator[str]:
    """Every dotted name an import statement in the module names (and each name it imports
    from a module, which may itself be a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the two packages it imports."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for imported in imported_names(name, path):
            # "from offloadd.x import y" names y; keep the longest prefix that is a module.
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_is_read_from_every_module() -> None:
    graph = import_graph()
    assert "offloadd.server.daemon" in graph
    assert "offloadd.server.sessions" in graph["offloadd.server.daemon"]
    assert "protocol.messages" in graph["offloadd.client"]


def test_no_import_loops() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import loop: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("library", LIBRARIES)
def test_libraries_do_not_import_the_server(library: str) -> None:
    graph = import_graph()
    modules = [name for name in graph if name == library or name.startswith(library + ".")]
    assert modules, f"{library} not found"
    # Anything a library module reaches, directly or through others, stays outside the server.
    seen: set[str] = set()
    stack = list(modules)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(graph[node])
    reached = sorted(n for n in seen if n == SERVER or n.startswith(SERVER + "."))
    assert not reached, f"{library} reaches {reached}"


def test_protocol_imports_only_itself() -> None:
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith("protocol"):
            assert all(t.startswith("protocol") for t in targets), (name, targets)


def test_the_pure_mirror_does_not_import_vllm() -> None:
    code = (
        "import sys, offloadd.vllm, offloadd.vllm.mirror, offloadd.vllm.probes;"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_composition_root_stays_small() -> None:
    # daemon.py builds, wires and closes; anything else belongs in the part it is about.
    lines = (ROOT / "offloadd" / "server" / "daemon.py").read_text().count("\n")
    assert lines <= 450, f"offloadd/server/daemon.py has {lines} lines"

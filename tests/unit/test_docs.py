"""The repository stands alone: its docs and comments point inside it (docs/design.md)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["README.md", "pyproject.toml", "Makefile", "docs", "protocol", "offloadd", "tests",
           "benchmarks", "systemd", "scripts"]  # fmt: skip
# Places outside the repository that earlier text pointed to.
OUTSIDE = ("../shared", "DESIGN.md", "reference/vllm.md", "reference/transport.md", "/work/")


def _text_files() -> list[Path]:
    files: list[Path] = []
    for name in SOURCES:
        path = REPO / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [
            p
            for p in candidates
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc",)
        ]
    return files


def test_nothing_refers_to_files_outside_the_repository() -> None:
    offenders = [
        f"{path.relative_to(REPO)}: {needle}"
        for path in _text_files()
        if path != Path(__file__).resolve()
        for needle in OUTSIDE
        if needle in path.read_text(errors="replace")
    ]
    assert not offenders


def test_design_document_has_its_sections() -> None:
    design = (REPO / "docs" / "design.md").read_text()
    for heading in ("Layout and layers", "The wire", "The cache", "Events", "The failure model",
                    "The CUDA path", "Settings", "vLLM plugin"):  # fmt: skip
        assert f". {heading}" in design, heading
    assert '"Use with vLLM" ([docs/vllm.md](vllm.md))' in design
    assert "# Use with vLLM" in (REPO / "docs" / "vllm.md").read_text()
    assert "TODO" not in design


DESIGN = REPO / "docs" / "design.md"
DESIGN_MAX_BYTES = 50_000  # readable in an hour; history belongs in docs/decisions.md
# The layout covers the modules of these packages; the benchmarks get one line.
PACKAGES = ("offloadd", "protocol")
UNLISTED = ("__init__.py", "__main__.py")
ENTRY = re.compile(r"^( *)(\S(?:.*?\S)?)(?: {2,}(.*))?$")


def _layout_block(text: str) -> list[str]:
    """The lines of the first fenced block under the "Layout" heading."""
    section = re.search(r"^## [^\n]*Layout[^\n]*\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "design.md has no Layout section"
    block = re.search(r"^```[^\n]*\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, "the Layout section has no tree"
    return block.group(1).splitlines()


def _layout_modules(lines: list[str]) -> set[str]:
    """Every ``.py`` path the tree names, relative to the repository.

    A line is ``NAME  DESCRIPTION`` indented by its depth; a NAME ending in ``/`` opens a
    directory for the deeper lines. ``.py`` names count in the NAME column and in the
    description of a directory's line (``cache/  allocator.py, policy.py ...``); a line
    indented to the description column of the entry above continues that entry.
    """
    modules: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, directory) of the open directories
    entry_dir, description_column = "", 0
    for line in lines:
        match = ENTRY.match(line)
        if not match:
            continue
        indent = len(match.group(1))
        if description_column and indent >= description_column:
            names = re.findall(r"[\w/]+\.py\b", line)  # continues the entry above
        else:
            name, description = match.group(2), match.group(3) or ""
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else ""
            description_column = len(line) - len(description) if description else 0
            if name.endswith("/") and "," not in name:
                entry_dir = f"{parent}{name}"
                stack.append((indent, entry_dir))
                names = re.findall(r"[\w/]+\.py\b", description)
            else:
                entry_dir = parent
                names = re.findall(r"[\w/]+\.py\b", name)
        modules.update(f"{entry_dir}{n}" for n in names)
    return modules


def test_design_document_is_readable_in_an_hour() -> None:
    size = DESIGN.stat().st_size
    assert size <= DESIGN_MAX_BYTES, f"design.md is {size} bytes; move history to decisions.md"


def test_design_layout_lists_the_modules_on_disk() -> None:
    listed = {
        m for m in _layout_modules(_layout_block(DESIGN.read_text())) if m.startswith(PACKAGES)
    }
    on_disk = {
        str(p.relative_to(REPO))
        for package in PACKAGES
        for p in (REPO / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    missing = sorted(m for m in listed if m not in on_disk)
    assert not missing, f"design.md lists modules that do not exist: {missing}"
    unlisted = sorted(
        m
        for m in on_disk - listed
        if Path(m).name not in UNLISTED and not m.startswith("offloadd/bench/")
    )
    assert not unlisted, f"design.md's layout omits: {unlisted}"


def test_layout_parser_reads_directories_descriptions_and_continuations() -> None:
    tree = [
        "offloadd/",
        "  shm.py                shared memory",
        "  cache/                index.py (ChunkCache),",
        "                        journal.py (warm restart)",
        "  server/               the daemon:",
        "    daemon.py           the root",
        "  status.py, demo.py    commands",
        "protocol/               the wire",
        "  events.py             codec",
        "tests/                  fakes.py",
    ]
    assert _layout_modules(tree) == {
        "offloadd/shm.py",
        "offloadd/cache/index.py",
        "offloadd/cache/journal.py",
        "offloadd/server/daemon.py",
        "offloadd/status.py",
        "offloadd/demo.py",
        "protocol/events.py",
        "tests/fakes.py",
    }

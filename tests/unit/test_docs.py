"""The repository stands alone: its docs and comments point inside it (docs/design.md)."""

from __future__ import annotations

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

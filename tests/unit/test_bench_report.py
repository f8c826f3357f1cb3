"""docs/performance.md's table of the last run is generated (``make perf``), not copied: it is
exactly the rendering of the JSON kept in docs/bench/, and the renderer replaces only its
region."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offloadd.bench._util import Result
from offloadd.bench.report import BEGIN, END, main, read_results, rendered, with_table

ROOT = Path(__file__).resolve().parents[2]
RUN = [str(ROOT / "docs/bench/offloadd-bench.json"), str(ROOT / "docs/bench/benchmarks.json")]


def test_the_documents_table_is_the_rendering_of_the_kept_run() -> None:
    assert main([*RUN, "--into", str(ROOT / "docs/performance.md"), "--check"]) == 0


def test_the_region_is_replaced_and_nothing_else(tmp_path: Path) -> None:
    results = [
        Result("a_row", 2.0, "GB/s", 4.0, 0.5, {"goal": "ratio >= 0.9", "goal_met": False}),
        Result("b_row", 0.1234, "ms", 0.2, 0.617),
    ]
    source = tmp_path / "run.json"
    source.write_text(json.dumps([r.as_json() for r in results]))
    assert read_results([str(source)]) == results
    document = tmp_path / "doc.md"
    document.write_text(f"# Title\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    assert main([str(source), "--into", str(document), "--check"]) == 1
    assert main([str(source), "--into", str(document)]) == 0
    text = document.read_text()
    assert text.startswith("# Title\n\nbefore\n") and text.endswith(f"{END}\nafter\n")
    assert "old table" not in text
    rows = [line.split() for line in text.splitlines() if line.startswith(("a_row", "b_row"))]
    assert rows == [
        ["a_row", "2.00", "4.00", "GB/s", "0.50", "ratio", ">=", "0.9", "MISSED"],
        ["b_row", "0.123", "0.200", "ms", "0.62"],
    ]
    assert main([str(source), "--into", str(document), "--check"]) == 0
    assert with_table(text, rendered(results, [str(source)])) == text


def test_a_document_without_the_region_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no region"):
        with_table("# nothing generated here\n", rendered([], ["x.json"]))

"""offloadd.bench.cuda_marshal runs without a GPU and reports what its table needs."""

from __future__ import annotations

from offloadd.bench import cuda_marshal


def test_a_small_run_reports_both_paths_split_into_planning_and_marshalling() -> None:
    figures = cuda_marshal.measure(2048, 1)
    assert figures["copies"] == 2048
    for path in ("new", "old"):
        for part in ("plan_us", "marshal_us", "us_per_copy"):
            assert figures[f"{path}_{part}"] > 0.0
    result = cuda_marshal._result(figures)
    assert result.name == "cuda_marshal_per_copy" and result.params["goal"] == "value <= 0.1"

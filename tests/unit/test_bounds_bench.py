"""offloadd.bench.bounds runs end to end (small) and reports both rows with their baselines."""

from __future__ import annotations

import pytest

from offloadd.bench import _util, bounds


def test_a_small_run_reports_both_rows_against_their_baselines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bounds, "KEYS", 256)
    monkeypatch.setattr(bounds, "ENGINES", 2)
    scratch = _util.Scratch()
    try:
        ctx = _util.Context(True, scratch, _util.Progress(), [])
        results = bounds.run(ctx)
        assert [r.name for r in results] == ["pinned_lookup_tenant_ns", "reserve_store_lease_ns"]
        for result in results:
            assert result.unit == "ns/key" and result.value > 0 and result.baseline > 0
            assert result.params["rounds"] == 7 and "goal" in result.params
        assert results[0].params["tenant_owners"] == 2 * bounds.SESSIONS
        only = _util.Context(True, scratch, _util.Progress(), ["reserve_store_lease_ns"])
        assert [r.name for r in bounds.run(only)] == ["reserve_store_lease_ns"]
    finally:
        scratch.close()

"""offloadd.bench.disk runs end to end (small) and reports both rows with their baselines."""

from __future__ import annotations

import os

import pytest

from offloadd.bench import _util, disk


def test_a_small_run_reports_write_and_read_against_plain_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(disk, "CHUNK", 64 << 10)  # 64 chunks of 64 KiB: 4 MiB in all
    scratch = _util.Scratch()
    try:
        ctx = _util.Context(True, scratch, _util.Progress(), [])
        results = disk.run(ctx)
        assert [r.name for r in results] == ["disk_write_64KiB", "disk_read_64KiB"]
        for result in results:
            assert result.unit == "GB/s" and result.value > 0 and result.baseline > 0
            assert result.params["chunks"] == 64 and "reads_cached" in result.params
        assert not os.path.exists(os.path.join(scratch.workdir, "disk"))
        assert scratch.leftovers() == []
        only_reads = _util.Context(True, scratch, _util.Progress(), ["disk_read_*"])
        assert [r.name for r in disk.run(only_reads)] == ["disk_read_64KiB"]
    finally:
        scratch.close()

"""offloadd.bench.tiers runs end to end (small): the disk tier's hit rate against the arena
alone, publish / promote through two daemons on a real mooncake_master against raw, and the
cluster tier's sealing and opening against the plain checksum."""

from __future__ import annotations

import os

import pytest

from offloadd.bench import _util, mooncake, tiers
from tests.mooncake_master import require_mooncake


def test_the_disk_tier_hit_rate_rows_compare_with_the_arena_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in {
        "HIT_PAGE": 4096,
        "ARENA_CHUNKS": 16,
        "DOCS": 12,
        "DOC_CHUNKS": 4,
        "SUFFIX_CHUNKS": 1,
        "QUICK_REQUESTS": 60,
    }.items():
        monkeypatch.setattr(tiers, name, value)
    scratch = _util.Scratch()
    try:
        ctx = _util.Context(True, scratch, _util.Progress(), [])
        results = tiers.run_hit_rate(ctx)
        assert [r.name for r in results] == ["tiers_hit_rate_disk4x", "tiers_request_time_disk4x"]
        hit, per_request = results
        assert 0 < hit.baseline <= 1 and 0 < hit.value <= 1 and hit.unit == "hit rate"
        assert per_request.value > 0 and per_request.baseline > 0
        params = hit.params
        assert params["requests"] == 60 and params["chunks_verified"] > 0
        assert (params["failed_requests"], params["disk_errors"]) == (0, 0)
        assert params["disk_promotions"] > 0
        assert not [n for n in os.listdir("/var/tmp") if n.startswith(scratch.tag)]
    finally:
        scratch.close()


def test_the_cluster_rows_compare_daemons_with_raw_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require_mooncake()
    monkeypatch.setattr(tiers, "CLUSTER_PAGE", 16 << 10)  # 256 KiB chunks
    monkeypatch.setattr(tiers, "QUICK_CHUNKS", 16)
    scratch = _util.Scratch()
    try:
        ctx = _util.Context(True, scratch, _util.Progress(), ["mooncake_daemon_*"])
        results = tiers.run_cluster(ctx)
        assert [r.name for r in results] == ["mooncake_daemon_publish", "mooncake_daemon_promote"]
        for result in results:
            assert result.unit == "GiB/s" and result.value > 0 and result.baseline > 0
            assert result.params["chunks"] == 16 and result.params["chunk_bytes"] == 256 << 10
    finally:
        scratch.close()


def test_the_aead_rows_seal_and_open_against_the_plain_checksum() -> None:
    require_mooncake()
    scratch = _util.Scratch()
    try:
        ctx = _util.Context(True, scratch, _util.Progress(), ["mooncake_seal_*", "mooncake_open_*"])
        results = mooncake.run_aead(ctx)
        assert [r.name for r in results] == [
            "mooncake_seal_256KiB",
            "mooncake_open_256KiB",
            "mooncake_seal_4MiB",
            "mooncake_open_4MiB",
        ]
        for result in results:
            assert result.unit == "GiB/s" and result.value > 0 and result.baseline > 0
            assert result.params["reps"] == 3
    finally:
        scratch.close()

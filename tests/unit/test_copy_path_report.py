"""A degraded cuda copy path is loud: a status line and a metric, from the daemon's stats."""

from __future__ import annotations

import pytest

from offloadd.server.metrics import Metrics
from offloadd.status import describe
from tests.helpers import fake_stats, value


@pytest.mark.parametrize(
    ("path", "degraded", "line"),
    [
        ({}, 0.0, None),
        ({"batched": True, "pinned": True}, 0.0, "copies     cuda: batched, arena pinned"),
        (
            {"batched": False, "pinned": True},
            1.0,
            "copies     cuda DEGRADED: NOT batched (one driver call per copy), arena pinned; "
            "see the daemon log",
        ),
        (
            {"batched": True, "pinned": False},
            1.0,
            "copies     cuda DEGRADED: batched, arena NOT pinned (pageable); see the daemon log",
        ),
    ],
)
def test_copy_path_in_status_and_metrics(
    path: dict[str, bool], degraded: float, line: str | None
) -> None:
    stats = fake_stats(copy_path=path)
    lines = [text.strip() for text in describe(stats, "ipc:///run/offloadd/offloadd.sock")]
    copies = [text for text in lines if text.startswith("copies")]
    assert copies == ([line] if line else [])
    metrics = Metrics(lambda: stats)
    assert value(metrics, "offloadd_copy_engine_degraded") == degraded
    for feature, ok in path.items():
        assert value(metrics, "offloadd_copy_path", feature=feature) == (1.0 if ok else 0.0)

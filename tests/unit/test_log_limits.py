"""Client-caused log lines are limited per uid (``offloadd.logs.PerUidLog``): a flood from one
user is held back and counted, and another user's lines still go out. Pure: a fake clock."""

from __future__ import annotations

import logging

import pytest

from offloadd.logs import PerUidLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_one_uids_flood_is_held_back_and_anothers_lines_go_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="offloadd.test")
    clock = Clock()
    log = PerUidLog(logging.getLogger("offloadd.test"), burst=3, interval=1.0, clock=clock)
    logged = [log(1000, logging.INFO, "flood %d", n) for n in range(1000)]
    assert logged.count(True) == 3
    assert log(2000, logging.WARNING, "victim")  # a bucket of its own
    assert _lines(caplog) == ["flood 0", "flood 1", "flood 2", "victim"]
    # One more line per interval; it says how many were held back since the last one.
    clock.now = 1.0
    assert log(1000, logging.INFO, "flood again")
    assert not log(1000, logging.INFO, "flood again")
    assert _lines(caplog)[-1] == "flood again (997 more lines of uid 1000 held back)"
    # A quiet uid gets its burst back, no more.
    clock.now = 100.0
    assert [log(1000, logging.INFO, "later") for _ in range(5)].count(True) == 3


def test_lines_below_the_level_cost_no_token_and_the_uids_kept_are_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="offloadd.test")
    clock = Clock()
    log = PerUidLog(logging.getLogger("offloadd.test"), burst=1, uids=4, clock=clock)
    assert not log(7, logging.DEBUG, "not logged anyway")
    assert log(7, logging.WARNING, "first")
    for uid in range(100):  # many uids: only the 4 most recent are remembered
        log(uid, logging.WARNING, "line")
    assert len(log._buckets) == 4

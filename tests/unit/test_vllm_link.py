"""The plugin's one reconnect policy (``Reconnect``) and the link's attempts, without a daemon.

The link's turns are driven by hand on a fake clock; its owner is a set of fakes.
"""

from __future__ import annotations

import itertools
from typing import cast

import pytest

from offloadd.client import OffloadClient
from offloadd.errors import DaemonUnavailable
from offloadd.vllm import link as link_module
from offloadd.vllm.link import (
    ATTEMPT_SECONDS,
    MAX_PAUSE_SECONDS,
    PAUSE_SECONDS,
    Reconnect,
    SessionLink,
)
from tests.fakes import Clock

TICK = 0.02


def attempt_times(policy: Reconnect, clock: Clock, seconds: float, outcome: str) -> list[float]:
    """Tick for ``seconds``; each attempt due ends as ``outcome``: "nobody" (refused at
    once), "timeout" (waited ``ATTEMPT_SECONDS``) or "refused" (answered at once, no)."""
    times: list[float] = []
    end = clock.now + seconds
    while clock.now < end:
        clock.now += TICK
        if not policy.due(clock.now):
            continue
        times.append(clock.now)
        policy.attempted(clock.now)
        if outcome == "nobody":
            policy.nobody_listens()
        elif outcome == "timeout":
            clock.now += ATTEMPT_SECONDS
            policy.failed(ATTEMPT_SECONDS)
        else:
            policy.failed(0.001)
    return times


def gaps(times: list[float]) -> list[float]:
    return [round(b - a, 1) for a, b in itertools.pairwise(times)]


def test_where_nobody_listens_attempts_stay_a_second_apart() -> None:
    clock = Clock()
    policy = Reconnect(clock.now)
    times = attempt_times(policy, clock, 30.0, "nobody")
    assert len(times) >= 28
    assert set(gaps(times)) == {PAUSE_SECONDS}  # a restarted daemon waits a second at most
    assert policy.pause == PAUSE_SECONDS


def test_attempts_that_time_out_double_the_pause_up_to_16_s() -> None:
    clock = Clock()
    policy = Reconnect(clock.now)
    times = attempt_times(policy, clock, 120.0, "timeout")
    # From an attempt's start to the next (its own wait is part of the pause it doubled).
    assert gaps(times)[:6] == [2.0, 4.0, 8.0, 16.0, 16.0, 16.0]
    assert policy.pause == MAX_PAUSE_SECONDS


def test_a_refusal_keeps_the_pause_and_a_session_resets_it() -> None:
    clock = Clock()
    policy = Reconnect(clock.now)
    attempt_times(policy, clock, 20.0, "timeout")
    assert policy.pause == MAX_PAUSE_SECONDS
    attempt_times(policy, clock, 40.0, "refused")  # a daemon that answers, refusing
    assert policy.pause == MAX_PAUSE_SECONDS
    policy.connected()
    assert policy.pause == PAUSE_SECONDS
    attempt_times(policy, clock, 20.0, "timeout")
    policy.nobody_listens()  # the frozen daemon was killed: back to once a second
    assert policy.pause == PAUSE_SECONDS


def test_an_attempt_waits_a_pause_after_the_last_or_the_lost_session() -> None:
    clock = Clock()
    policy = Reconnect(clock.now)
    assert not policy.due(clock.now + PAUSE_SECONDS - 0.01)  # the first connect counts
    assert policy.due(clock.now + PAUSE_SECONDS)
    clock.now += 50.0
    policy.attempted(clock.now)  # the session was lost now
    assert not policy.due(clock.now + 0.5)
    assert policy.due(clock.now + PAUSE_SECONDS)


class FakeClient:
    def __init__(self) -> None:
        self.closed = False

    def close(self, *, goodbye: bool = True) -> None:
        self.closed = True


class Owner:
    """The owner's parts: ``connect`` waits ``waits`` seconds of the clock, then fails
    (``fails``) or returns a new client; ``adopt`` takes it unless ``has_one``."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.waits = 0.0
        self.fails = False
        self.has_one = False
        self.attempts = 0
        self.made: list[FakeClient] = []
        self.adopted: list[FakeClient] = []

    def connect(self, timeout: float) -> OffloadClient:
        assert timeout == ATTEMPT_SECONDS
        self.attempts += 1
        self.clock.now += self.waits
        if self.fails:
            raise DaemonUnavailable("no answer")
        self.made.append(FakeClient())
        return cast("OffloadClient", self.made[-1])

    def adopt(self, client: OffloadClient) -> bool:
        if self.has_one:
            return False
        self.adopted.append(cast("FakeClient", client))
        return True


@pytest.fixture
def listening(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether someone listens at the endpoint, as the link's probe sees it."""
    state = [True]
    monkeypatch.setattr(link_module, "nobody_listens", lambda endpoint: not state[0])
    return state


def turns(link: SessionLink, owner: Owner, seconds: float) -> None:
    end = owner.clock.now + seconds
    while owner.clock.now < end:
        owner.clock.now += TICK
        link._reconnect(owner.connect, owner.adopt)


def test_the_link_backs_off_from_a_frozen_daemon_and_adopts_once_it_answers(
    listening: list[bool],
) -> None:
    clock = Clock()
    link = SessionLink("inproc://test", "rank 0", tick=TICK, clock=clock)
    owner = Owner(clock)
    owner.waits, owner.fails = ATTEMPT_SECONDS, True  # frozen: each attempt times out
    turns(link, owner, 60.0)
    assert owner.attempts == 6  # at 1, 3, 7, 15, 31 and 47 s
    assert link._policy.pause == MAX_PAUSE_SECONDS
    listening[0] = False  # killed: probed once a second, nothing attempted
    attempts = owner.attempts
    turns(link, owner, 20.0)
    assert owner.attempts == attempts
    listening[0] = True  # restarted: connected within a second
    owner.waits, owner.fails = 0.0, False
    turns(link, owner, PAUSE_SECONDS + 2 * TICK)
    assert owner.adopted == owner.made and len(owner.made) == 1
    assert link._policy.pause == PAUSE_SECONDS


def test_a_session_the_owner_has_already_or_that_comes_after_close_is_closed(
    listening: list[bool],
) -> None:
    clock = Clock()
    link = SessionLink("inproc://test", "scheduler e", tick=TICK, clock=clock)
    owner = Owner(clock)
    owner.has_one = True  # reset_cache connected meanwhile
    turns(link, owner, PAUSE_SECONDS + TICK)
    assert len(owner.made) == 1 and owner.made[0].closed and not owner.adopted
    owner.has_one = False
    link.stop.set()  # shutdown began while connecting
    turns(link, owner, PAUSE_SECONDS + TICK)
    assert len(owner.made) == 2 and owner.made[1].closed and not owner.adopted

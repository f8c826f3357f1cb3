"""TierProbes: what a scheduler asks a tiered daemon about keys its mirror lacks."""

from __future__ import annotations

from offloadd.vllm.probes import Probe, TierProbes
from tests.fakes import Clock


def make() -> tuple[TierProbes, Clock]:
    clock = Clock()
    return TierProbes(clock=clock, recheck=0.5, miss_ttl=1.0), clock


def test_unknown_keys_retry_and_queue_per_request_in_lookup_order() -> None:
    probes, _ = make()
    assert probes.lookup("a", b"k2") is Probe.RETRY
    assert probes.lookup("a", b"k1") is Probe.RETRY
    assert probes.lookup("b", b"k1") is Probe.RETRY
    assert probes.lookup("a", b"k2") is Probe.RETRY  # asked twice in a step: queued once
    assert probes.has_queued and not probes.awaiting
    assert probes.take_queued() == [[b"k2", b"k1"], [b"k1"]]
    assert probes.take_queued() == []
    assert not probes.has_queued and probes.awaiting  # asked, no answer yet
    probes.answered([b"k2", b"k1"], hits=2, pending=[])
    assert not probes.awaiting


def test_answer_marks_pending_up_to_the_first_miss_and_leaves_later_keys_unknown() -> None:
    probes, _ = make()
    keys = [b"hit", b"p1", b"p2", b"gone", b"after"]
    probes.answered(keys, hits=1, pending=[1, 2])
    assert probes.lookup("r", b"p1") is Probe.PENDING
    assert probes.lookup("r", b"p2") is Probe.PENDING
    assert probes.lookup("r", b"gone") is Probe.MISS
    assert probes.take_queued() == []
    assert probes.lookup("r", b"after") is Probe.RETRY  # the daemon never looked there
    assert probes.lookup("r", b"hit") is Probe.RETRY  # hits live in the mirror, not here
    assert len(probes) == 3


def test_a_pending_key_is_asked_again_after_recheck_and_a_miss_after_its_ttl() -> None:
    probes, clock = make()
    probes.answered([b"p", b"m"], hits=0, pending=[0])
    clock.now += 0.49
    assert probes.lookup("r", b"p") is Probe.PENDING
    assert probes.lookup("r", b"m") is Probe.MISS
    clock.now += 0.02
    assert probes.lookup("r", b"p") is Probe.RETRY  # a failed promotion never reaches the mirror
    clock.now += 0.5
    assert probes.lookup("r", b"m") is Probe.RETRY
    assert probes.take_queued() == [[b"p", b"m"]]


def test_a_later_answer_replaces_an_earlier_one() -> None:
    probes, _ = make()
    probes.answered([b"k"], hits=0, pending=[0])
    probes.answered([b"k"], hits=0, pending=[])
    assert probes.lookup("r", b"k") is Probe.MISS
    probes.answered([b"k"], hits=0, pending=[0])
    assert probes.lookup("r", b"k") is Probe.PENDING
    probes.answered([b"k"], hits=1, pending=[])
    assert len(probes) == 0


def test_forget_expired_bounds_the_memory() -> None:
    probes, clock = make()
    probes.answered([b"p", b"m"], hits=0, pending=[0])
    probes.answered([b"q"], hits=0, pending=[0])
    assert len(probes) == 3
    clock.now += 0.6
    probes.forget_expired()
    assert len(probes) == 1  # the miss is kept for its ttl
    clock.now += 0.5
    probes.forget_expired()
    assert len(probes) == 0


def test_forget_drops_what_was_said_about_keys() -> None:
    probes, _ = make()
    probes.answered([b"p", b"m"], hits=0, pending=[0])
    probes.forget([b"m", b"p", b"unknown"])
    assert len(probes) == 0
    assert probes.lookup("r", b"m") is Probe.RETRY  # asked again: it may be in a tier now


def test_a_key_asked_is_not_asked_again_until_its_answer_or_recheck() -> None:
    probes, clock = make()
    assert probes.lookup("a", b"k") is Probe.RETRY
    assert probes.take_queued() == [[b"k"]]  # sent in the step's message, not awaited
    assert probes.lookup("a", b"k") is Probe.RETRY  # its answer is on its way
    assert probes.take_queued() == []
    probes.unanswered([b"k"])  # the message never went (or the Lookup was refused)
    assert probes.lookup("a", b"k") is Probe.RETRY
    assert probes.take_queued() == [[b"k"]]
    clock.now += 0.51  # no answer within recheck: asked again
    assert probes.lookup("a", b"k") is Probe.RETRY
    assert probes.take_queued() == [[b"k"]]
    probes.answered([b"k"], hits=0, pending=[0])
    assert probes.lookup("a", b"k") is Probe.PENDING

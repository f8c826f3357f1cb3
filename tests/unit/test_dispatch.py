"""The handler table (``offloadd.server.dispatch``): one entry per request type, and dispatch
that keeps each mode's reply rule. Pure: fake handlers, a recorder for replies."""

from __future__ import annotations

import logging
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from offloadd.server.checks import Refused
from offloadd.server.dispatch import (
    QUANTUM_KEYS,
    QUANTUM_LOOKUPS,
    TABLE,
    Dispatcher,
    Mode,
    Session,
)
from offloadd.server.limits import Limits
from offloadd.server.peek import peek, step_counts
from offloadd.server.registry import Registry
from offloadd.server.state import Accepted, SessionState
from offloadd.settings import LimitsSettings
from protocol.errors import ErrorCode
from protocol.messages import (
    Bye,
    Clear,
    ClearCache,
    GetStats,
    Hello,
    HoldKeys,
    HoldResult,
    ListCache,
    Load,
    Lookup,
    LookupResult,
    Ok,
    Ping,
    Reply,
    Request,
    Reserve,
    StepJobs,
    Store,
    UpdateHolds,
    Wait,
    encode,
)
from tests.helpers import hello as make_hello
from tests.helpers import register_engine

PEER = b"peer"


@dataclass
class Recorder:
    sent: list[Reply] = field(default_factory=list)
    errors: list[tuple[int, ErrorCode, str]] = field(default_factory=list)
    later: list[Callable[[], object]] = field(default_factory=list)  # quanta not yet run

    def send(self, identity: bytes, message: Reply) -> None:
        assert identity == PEER
        self.sent.append(message)

    def protocol_error(
        self, identity: bytes, request_id: int, code: ErrorCode, message: str
    ) -> None:
        self.errors.append((request_id, code, message))

    def internal_error(self, identity: bytes, request_id: int) -> None:
        self.errors.append((request_id, ErrorCode.INTERNAL, ""))

    def run_next(self, identity: bytes, work: Callable[[], object]) -> None:
        assert identity == PEER
        self.later.append(work)

    def turns(self) -> int:
        """Run the quanta left, one per turn, as the receive loop would; how many ran."""
        ran = 0
        while self.later:
            self.later.pop(0)()
            ran += 1
        return ran


def _state() -> SessionState:
    return SessionState(PEER, register_engine(Registry())[0].session, [])


def _dispatcher(
    recorder: Recorder, state: SessionState | None, **overrides: Callable[..., object]
) -> Dispatcher:
    """Every handler refuses unless overridden (by request class name)."""

    def refuse(*_args: object) -> object:
        raise Refused(ErrorCode.BAD_REQUEST, "not in this test")

    table = {kind: overrides.get(kind.__name__, refuse) for kind in TABLE}
    return Dispatcher(table, recorder, session_of=lambda _sid: state)


def test_every_request_of_the_wire_has_exactly_one_entry_with_a_mode() -> None:
    wire = typing.get_args(Request)
    assert len(wire) == len(set(wire))
    assert set(TABLE) == set(wire)
    assert all(isinstance(TABLE[kind].mode, Mode) for kind in wire)
    # Only Hello runs off the loop; the jobs are answered by a notice; the waits deferred.
    assert [k for k in wire if TABLE[k].mode is Mode.OFF_LOOP] == [Hello]
    assert {k.__name__ for k in wire if TABLE[k].mode is Mode.NOTICE} == {"Store", "Load"}
    assert {k for k in wire if TABLE[k].mode is Mode.DEFERRED} == {Lookup, Wait}
    assert {k for k in wire if TABLE[k].session is not Session.REQUIRED} == {
        Hello,
        GetStats,
        Ping,
        ListCache,
        ClearCache,
    }


def test_handlers_must_match_the_table() -> None:
    table: dict[type[Any], Callable[..., object]] = {kind: print for kind in TABLE}
    del table[Clear]
    with pytest.raises(ValueError, match=r"differ for \['Clear'\]"):
        Dispatcher(table, Recorder(), session_of=lambda _sid: None)


def test_a_now_handler_s_reply_is_sent() -> None:
    recorder, state = Recorder(), _state()
    dispatch = _dispatcher(recorder, state, Bye=lambda st, request: Ok(request.request_id, 1))
    dispatch(PEER, Bye(7))
    assert recorder.sent == [Ok(7, 1)] and not recorder.errors


def test_a_now_handler_returning_none_is_an_internal_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder = Recorder()
    dispatch = _dispatcher(recorder, _state(), Clear=lambda state, request: None)
    with caplog.at_level(logging.ERROR, logger="offloadd.server.dispatch"):
        dispatch(PEER, Clear(4))
    assert recorder.sent == []
    assert recorder.errors == [(4, ErrorCode.INTERNAL, "")]
    assert "Clear is answered now, but its handler returned None" in caplog.text


def test_a_notice_handler_s_reply_goes_before_what_then_sends() -> None:
    recorder = Recorder()

    def store(state: SessionState, request: Store) -> Accepted:
        return Accepted(Ok(request.request_id), then=lambda: recorder.sent.append(Ok(99)))

    dispatch = _dispatcher(recorder, _state(), Store=store)
    dispatch(PEER, Store(3, job_id=1, keys=[], block_ids=[]))
    assert recorder.sent == [Ok(3), Ok(99)]


def test_a_notice_handler_returning_a_bare_reply_is_an_internal_error() -> None:
    recorder = Recorder()
    dispatch = _dispatcher(recorder, _state(), Store=lambda state, request: Ok(1))
    dispatch(PEER, Store(3, job_id=1, keys=[], block_ids=[]))
    assert recorder.sent == [] and recorder.errors == [(3, ErrorCode.INTERNAL, "")]


def test_a_deferred_handler_answers_later_once_through_reply(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder, kept = Recorder(), []

    def lookup(state: SessionState, request: Lookup, reply: Callable[[Reply], None]) -> None:
        kept.append(reply)

    dispatch = _dispatcher(recorder, _state(), Lookup=lookup)
    dispatch(PEER, Lookup(5, keys=[]))
    assert recorder.sent == [] and not recorder.errors  # nothing yet: deferred
    kept[0](LookupResult(5, 0, [], 0))
    with caplog.at_level(logging.ERROR, logger="offloadd.server.dispatch"):
        kept[0](LookupResult(5, 1, [], 0))  # a second answer is a bug: dropped, logged
    assert recorder.sent == [LookupResult(5, 0, [], 0)]
    assert "a second reply to request 5 dropped" in caplog.text


def test_a_deferred_handler_returning_a_reply_is_an_internal_error() -> None:
    recorder = Recorder()
    dispatch = _dispatcher(recorder, _state(), Wait=lambda state, request, reply: Ok(1))
    dispatch(PEER, Wait(6, [], 1.0))
    assert recorder.sent == [] and recorder.errors == [(6, ErrorCode.INTERNAL, "")]


def test_hello_answers_itself_and_gets_no_session() -> None:
    recorder, calls = Recorder(), []

    def hello(identity: bytes, request: Hello) -> None:
        calls.append(identity)

    dispatch = _dispatcher(recorder, None, Hello=hello)
    dispatch(PEER, make_hello())
    assert calls == [PEER] and recorder.sent == [] and not recorder.errors


def test_a_session_is_required_except_for_stats_ping_and_hello() -> None:
    recorder = Recorder()
    seen: list[SessionState | None] = []

    def ping(identity: bytes, state: SessionState | None, request: Ping) -> Reply:
        seen.append(state)
        return Ok(request.request_id)

    dispatch = _dispatcher(recorder, None, Ping=ping, Bye=lambda st, rq: Ok(rq.request_id))
    dispatch(PEER, Ping(1))
    dispatch(PEER, Bye(2))
    assert seen == [None] and recorder.sent == [Ok(1)]
    assert recorder.errors == [(2, ErrorCode.NOT_REGISTERED, "say Hello first")]


def test_a_refusal_is_answered_with_its_code_and_refreshes_last_seen() -> None:
    recorder, state = Recorder(), _state()
    state.last_seen = 0.0
    _dispatcher(recorder, state)(PEER, Clear(9))
    assert recorder.errors == [(9, ErrorCode.BAD_REQUEST, "not in this test")]
    assert state.last_seen > 0.0


def _step_dispatcher(recorder: Recorder) -> Dispatcher:
    """A dispatcher whose lookups answer every key missing and whose step messages hold
    nothing: what a step message's own handling leaves to its lookups."""

    def lookup(state: SessionState, request: Lookup, reply: Callable[[Reply], None]) -> None:
        reply(LookupResult(request.request_id, len(request.keys), [], 0))

    def update_holds(state: SessionState, request: UpdateHolds) -> Reply:
        return HoldResult(request.request_id, 0, [])

    return _dispatcher(recorder, _state(), Lookup=lookup, UpdateHolds=update_holds)


def test_a_step_message_s_lookups_follow_it_each_answered_alone() -> None:
    recorder = Recorder()

    dispatch = _step_dispatcher(recorder)
    probes = [Lookup(8, [b"a"]), Lookup(9, [b"b", b"c"])]
    dispatch(PEER, UpdateHolds(7, lookups=probes))
    assert recorder.sent == [
        HoldResult(7, 0, []),
        LookupResult(8, 1, [], 0),
        LookupResult(9, 2, [], 0),
    ]
    # A refused carrier (Reserve refuses here) still has its lookups answered.
    dispatch(PEER, Reserve(10, [b"k"], lookups=[Lookup(11, [b"d"])]))
    assert recorder.errors == [(10, ErrorCode.BAD_REQUEST, "not in this test")]
    assert recorder.sent[-1] == LookupResult(11, 1, [], 0)


def test_a_message_too_large_for_the_bounds_is_refused_whole_before_its_session() -> None:
    recorder, calls = Recorder(), []

    def lookup(state: SessionState, request: Lookup, reply: Callable[[Reply], None]) -> None:
        calls.append(request.request_id)
        reply(LookupResult(request.request_id, len(request.keys), [], 0))

    table = {kind: print for kind in TABLE} | {Lookup: lookup}
    limits = Limits(LimitsSettings(lookups_per_message=2))
    dispatch = Dispatcher(
        table, recorder, session_of=lambda _sid: None, bounds=limits.message_problem
    )
    probes = [Lookup(8 + i, [b"a"]) for i in range(3)]
    dispatch(PEER, UpdateHolds(7, lookups=probes))
    # One refusal, for the carrier; none of its lookups handled, not even NOT_REGISTERED.
    assert [(rid, code) for rid, code, _ in recorder.errors] == [(7, ErrorCode.TOO_LARGE)]
    assert "limits.lookups_per_message = 2" in recorder.errors[0][2]
    assert not calls and not recorder.sent


def _looked_up(recorder: Recorder) -> list[int]:
    return [reply.request_id for reply in recorder.sent if isinstance(reply, LookupResult)]


def test_a_step_messages_lookups_run_in_quanta_each_on_a_later_turn() -> None:
    recorder = Recorder()

    dispatch = _step_dispatcher(recorder)
    probes = [Lookup(100 + i, [b"k"]) for i in range(QUANTUM_LOOKUPS * 3 + 1)]
    dispatch(PEER, UpdateHolds(7, lookups=probes))
    # The carrier and one quantum now; each later quantum on a turn of its own.
    assert recorder.sent[0] == HoldResult(7, 0, [])
    assert _looked_up(recorder) == list(range(100, 100 + QUANTUM_LOOKUPS))
    assert recorder.turns() == 3
    assert _looked_up(recorder) == [probe.request_id for probe in probes]
    # Lookups of many keys are cut by keys: QUANTUM_KEYS worth at most, one at least.
    recorder = Recorder()
    dispatch = _step_dispatcher(recorder)
    wide = [Lookup(200 + i, [b"k"] * (QUANTUM_KEYS // 2)) for i in range(5)]
    dispatch(PEER, UpdateHolds(8, lookups=wide))
    assert _looked_up(recorder) == [200, 201]
    assert recorder.turns() == 2 and _looked_up(recorder) == [200 + i for i in range(5)]


def test_a_frame_needing_a_session_its_sender_lacks_is_refused_without_decoding() -> None:
    recorder = Recorder()
    limits = Limits(LimitsSettings(lookups_per_message=200))
    table = {kind: print for kind in TABLE}
    dispatch = Dispatcher(
        table, recorder, session_of=lambda _sid: None, bounds=limits.message_problem
    )
    probes = [Lookup(100 + i, [b"k"] * 3) for i in range(QUANTUM_LOOKUPS + 10)]
    assert dispatch.unregistered(PEER, encode(Reserve(7, [b"a"], lookups=probes)))
    # Refused whole, one answer: its lookups are the sender's to send again after a Hello.
    assert recorder.errors == [(7, ErrorCode.NOT_REGISTERED, "say Hello first")]
    assert not recorder.later
    # Beyond a bound: the same one TOO_LARGE as the decoded message gets.
    too_many = UpdateHolds(9, lookups=[Lookup(i, []) for i in range(201)])
    recorder.errors.clear()
    assert dispatch.unregistered(PEER, encode(too_many))
    assert recorder.errors == [(9, ErrorCode.TOO_LARGE, limits.message_problem(too_many))]
    # Keys beyond their bound, in a frame long enough to hold that many: counted, refused.
    few = Dispatcher(
        table,
        recorder,
        session_of=lambda _sid: None,
        bounds=Limits(LimitsSettings(keys_per_message=10)).message_problem,
    )
    recorder.errors.clear()
    assert few.unregistered(PEER, encode(Reserve(11, [b"k"] * 11)))
    assert [(rid, code) for rid, code, _ in recorder.errors] == [(11, ErrorCode.TOO_LARGE)]
    assert "limits.keys_per_message = 10" in recorder.errors[0][2]
    # What needs no session, or is not a request at all, is decoded as before.
    for frame in (encode(GetStats(1)), encode(Ping(2)), encode(make_hello()), b"\xc1junk"):
        assert not dispatch.unregistered(PEER, frame)
    # A sender with a session: decoded and dispatched.
    with_session = Dispatcher(table, recorder, session_of=lambda _sid: _state())
    assert not with_session.unregistered(PEER, encode(Clear(3)))


@pytest.mark.parametrize(
    "request_",
    [
        Reserve(1, [b"a", b"b"], holds=[HoldKeys("t", [b"c"] * 3)], lookups=[Lookup(2, [b"d"])]),
        Reserve(1, [], release=[HoldKeys("t", [b"e"] * 20)], touch=[b"f"] * 70_000),
        UpdateHolds(
            1, hold=[HoldKeys("t", [b"g"] * 5)], lookups=[Lookup(i, []) for i in range(17)]
        ),
        StepJobs(1, [Store(0, 2, [b"h"] * 40, [1] * 80), Load(0, 3, [b"i"] * 2, [0, 1])]),
    ],
)
def test_a_peeked_frame_counts_what_its_decoded_request_does(request_: Request) -> None:
    peeked = peek(encode(request_))
    assert peeked is not None and peeked.counts(keys=True) == step_counts(request_)
    # Its keys are counted only when asked (the frame may hold more than the bound).
    counts = peeked.counts(keys=False)
    assert counts is not None and counts.keys == 0
    stats = peek(encode(GetStats(1)))
    assert stats is not None and stats.counts(keys=True) is None

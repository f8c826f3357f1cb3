"""The clients' shared core: job bookkeeping and what a lost session does to it."""

from __future__ import annotations

import pytest

from offloadd.client import _ClientCore
from offloadd.errors import ConfigMismatch, JobError, NotReady, RequestFailed
from protocol.errors import ErrorCode
from protocol.messages import (
    Error,
    Hello,
    HoldKeys,
    JobDone,
    LookupResult,
    Ok,
    Reserved,
    decode_reply,
    encode,
)
from tests.integration.harness import make_config


def _core() -> _ClientCore:
    core = _ClientCore()
    core.hello(make_config(), [], "worker", "", "test")
    return core


def test_lost_session_fails_unfinished_jobs_and_says_hello_again() -> None:
    core = _core()
    core.accepted(1)
    core.accepted(2)
    core.record(JobDone(1, True, [], 10, 0.1))
    hello = core.hello_again(Error(7, ErrorCode.NOT_REGISTERED, "say Hello first"))
    assert isinstance(hello, Hello) and hello.pid_namespace > 0
    done, missing = core.take_finished([1, 2])
    assert missing == []
    assert done[0].ok and not done[1].ok
    assert "session lost" in done[1].error
    with pytest.raises(JobError, match="job 2 failed"):
        core.check_jobs(done, [], raise_on_failure=True)
    assert core.submitted == set()


def test_other_errors_do_not_trigger_a_new_hello() -> None:
    core = _core()
    core.accepted(1)
    assert core.hello_again(Error(7, ErrorCode.BAD_REQUEST, "no")) is None
    assert core.hello_again(LookupResult(7, 0, [])) is None
    assert core.submitted == {1}


def test_expect_maps_error_codes_to_the_error_tree() -> None:
    with pytest.raises(ConfigMismatch, match=r"model\.dtype"):
        _ClientCore.expect(Error(1, ErrorCode.CONFIG_MISMATCH, "model.dtype: a vs b"), Hello)
    with pytest.raises(NotReady):
        _ClientCore.expect(Error(1, ErrorCode.ENGINE_NOT_READY, "waits"), Hello)
    with pytest.raises(RequestFailed, match="code 999"):
        _ClientCore.expect(Error(1, 999, "from a newer daemon"), Hello)


def test_decode_records_job_results_and_ignores_garbage() -> None:
    core = _core()
    core.accepted(4)
    reply = core.decode(encode(JobDone(4, True, [], 1, 0.0)))
    assert reply == decode_reply(encode(JobDone(4, True, [], 1, 0.0)))
    assert core.finished[4].ok and core.submitted == set()
    assert core.decode(b"\xc1garbage") is None


def test_a_posted_reserve_numbers_itself_before_its_lookups_and_books_their_replies() -> None:
    core = _core()
    request = core.reserve([b"k1"], [HoldKeys("t", [b"k0"])], [], 3, [[b"k0"], [b"k2"]])
    assert (request.keys, request.holds, request.ack) == ([b"k1"], [HoldKeys("t", [b"k0"])], 3)
    assert [lookup.keys for lookup in request.lookups] == [[b"k0"], [b"k2"]]
    ids = core.posted(request)
    assert ids == [request.request_id, *(lookup.request_id for lookup in request.lookups)]
    assert ids == sorted(ids) and len(set(ids)) == 3
    # Their replies are kept in arrival order; one nobody posted for is not.
    core.decode(encode(LookupResult(ids[2], 0, [])))
    core.decode(encode(Reserved(ids[0], [0])))
    core.decode(encode(LookupResult(ids[2] + 1, 1, [])))
    assert core.take_answers() == [LookupResult(ids[2], 0, []), Reserved(ids[0], [0])]
    assert core.take_answers() == []
    # A late second reply under a taken id is not an answer again.
    core.decode(encode(Reserved(ids[0], [0])))
    core.decode(encode(LookupResult(ids[1], 1, [])))
    assert core.take_answers() == [LookupResult(ids[1], 1, [])]


def test_posted_update_holds_and_ping_are_answered_through_take_answers() -> None:
    core = _core()
    holds = core.update_holds([HoldKeys("a", [b"k"])], [HoldKeys("b", [b"j"])], 7, [[b"k"]])
    assert (holds.hold, holds.release, holds.ack) == (
        [HoldKeys("a", [b"k"])],
        [HoldKeys("b", [b"j"])],
        7,
    )
    hold_id, lookup_id = core.posted(holds)
    assert lookup_id == holds.lookups[0].request_id > hold_id
    (ping_id,) = core.posted(core.ping())
    core.decode(encode(Ok(ping_id, 1)))
    core.decode(encode(Error(hold_id, ErrorCode.WRONG_ROLE, "only schedulers")))
    assert core.take_answers() == [
        Ok(ping_id, 1),
        Error(hold_id, ErrorCode.WRONG_ROLE, "only schedulers"),
    ]
    assert core.awaited == {lookup_id}


def test_a_lost_session_forgets_posted_requests_and_their_answers() -> None:
    core = _core()
    first, second = core.posted(core.ping()), core.posted(core.ping())
    core.decode(encode(Ok(first[0], 1)))
    core.lost_session()
    core.decode(encode(Ok(second[0], 0)))  # a reply of the old session, come late
    assert core.take_answers() == []


def test_a_timed_out_pings_late_answer_that_the_session_is_unknown_asks_for_hello() -> None:
    core = _core()
    known, unknown = core.ping(), core.ping()
    core.late_ping = known.request_id
    core.decode(encode(Ok(known.request_id, 1)))  # late, but the daemon knows the session
    assert not core.session_lost and core.late_ping is None
    core.late_ping = unknown.request_id
    core.decode(encode(Ok(unknown.request_id + 1, 0)))  # not the late ping's answer
    assert not core.session_lost
    core.decode(encode(Ok(unknown.request_id, 0)))  # a restarted daemon's
    assert core.session_lost and core.late_ping is None

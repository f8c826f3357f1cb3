"""The clients' shared core: job bookkeeping and what a lost session does to it."""

from __future__ import annotations

import pytest

from offloadd.client import _ClientCore
from offloadd.errors import ConfigMismatch, JobError, NotReady, RequestFailed
from protocol.errors import ErrorCode
from protocol.messages import Error, Hello, JobDone, LookupResult, decode_reply, encode
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

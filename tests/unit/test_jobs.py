"""offloadd.server.jobs: the job table, copy completion, Wait and its waiters, the drain.

No sockets: the copy engine, the cache, the handle table and the announcer are fakes, and
replies land in a list. Copies finish when the test resolves their futures.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from offloadd.server.checks import Refused
from offloadd.server.commit import Commit, Committer
from offloadd.server.jobs import Jobs
from offloadd.server.metrics import Counters, Metrics
from offloadd.server.registry import Namespace, Registry
from offloadd.server.state import Accepted, Job, SessionState
from offloadd.settings import ServerSettings
from offloadd.transfer.types import Direction
from protocol.errors import ErrorCode
from protocol.messages import JobAccepted, JobDone, JobsDone, Reply, Wait, WaitResult
from tests.fakes import MOVES, FakeCopyEngine, FakeHandles, FakeImport
from tests.helpers import register_engine


@dataclass
class FakeCache:
    calls: list[tuple[str, object]] = field(default_factory=list)

    def finish_store(self, writes: list[object], *, ok: bool) -> list[object]:
        self.calls.append(("finish_store", ok))
        return []

    def finish_reads(self, reads: Iterable[object]) -> None:
        self.calls.append(("finish_reads", len(list(reads))))

    def abandon(self, writes: list[object]) -> None:
        self.calls.append(("abandon", len(writes)))

    def listen(self, listener: object) -> None:
        """The committer listens for removals (this fake removes nothing)."""


@dataclass
class FakeAnnouncer:
    committed: list[tuple[str, list[object]]] = field(default_factory=list)

    def chunks_committed(
        self, namespace: Namespace, entries: list[object], *, source: str = ""
    ) -> None:
        self.committed.append((namespace.name, entries))


@dataclass
class Rig:
    jobs: Jobs
    state: SessionState
    imported: FakeImport
    cache: FakeCache
    copies: FakeCopyEngine
    announcer: FakeAnnouncer
    counters: Counters
    sent: list[Reply]

    def job(self, job_id: int, direction: Direction = Direction.STORE) -> Job:
        return Job(job_id, self.state, direction, [b"k" * 8 + bytes(4)], [], 4096)

    def submit(self, job_id: int, direction: Direction = Direction.STORE) -> Job:
        job = self.job(job_id, direction)
        accepted = self.jobs.submit(self.state, 100 + job_id, job, MOVES)
        assert accepted == Accepted(JobAccepted(100 + job_id, job_id))
        return job

    def answer(self, accepted: Accepted) -> None:
        """What dispatch does with a NOTICE handler's answer: send it, then run ``then``."""
        self.sent.append(accepted.reply)
        if accepted.then is not None:
            accepted.then()

    def wait(self, request: Wait) -> list[Reply]:
        """Handle ``request``: the replies sent at once (later ones go to ``sent``)."""
        now: list[Reply] = []
        returned = False

        def reply(message: Reply) -> None:
            (self.sent if returned else now).append(message)

        self.jobs.wait(self.state, request, reply)
        returned = True
        return now

    def replies(self, kind: type[Any]) -> list[Any]:
        return [reply for reply in self.sent if isinstance(reply, kind)]


@pytest.fixture
def rig() -> Iterator[Rig]:
    registry = Registry()
    session = register_engine(registry)[0].session
    imported = FakeImport()
    state = SessionState(b"peer", session, [imported])  # type: ignore[list-item]
    copies = FakeCopyEngine(name="fake", manual=True, refusal=RuntimeError("no lane"))
    cache, announcer, counters = FakeCache(), FakeAnnouncer(), Counters()
    sent: list[Reply] = []

    def send(identity: bytes, message: Reply) -> None:
        assert identity == b"peer"
        sent.append(message)

    jobs = Jobs(
        ServerSettings(recent_jobs=3, drain_seconds=0.05),
        registry,
        cache,  # type: ignore[arg-type]
        copies,
        FakeHandles(),  # type: ignore[arg-type]
        Committer(cache, announcer, journal=None),  # type: ignore[arg-type]
        metrics=Metrics(),
        counters=counters,
        send=send,
    )
    yield Rig(jobs, state, imported, cache, copies, announcer, counters, sent)


async def settle(condition: Any, timeout: float = 5.0) -> None:
    """Let the loop run callbacks until ``condition()`` holds (or fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


@pytest.mark.asyncio
async def test_a_finished_copy_commits_answers_its_waiter_and_lets_the_imports_go(
    rig: Rig,
) -> None:
    rig.submit(1)
    assert rig.jobs.in_flight == 1 and rig.imported.refs == 2 and 1 in rig.state.jobs
    assert rig.wait(Wait(7, [1], timeout=30.0)) == []  # waits for job 1
    rig.copies.futures[0].set_result(0.25)
    await settle(lambda: rig.jobs.in_flight == 0)
    done = JobDone(1, True, [], 4096, 0.25, "")
    assert rig.sent == [done, WaitResult(7, [done], [])]
    assert rig.cache.calls == [("finish_store", True)]
    assert rig.announcer.committed and rig.counters.bytes_stored == 4096
    assert rig.imported.refs == 1 and not rig.state.jobs and not rig.state.waiters
    # Finished jobs stay known to Wait: answered at once.
    assert rig.wait(Wait(8, [1], timeout=30.0)) == [WaitResult(8, [done], [])]


@pytest.mark.asyncio
async def test_a_failed_copy_fails_every_key_and_is_counted(rig: Rig) -> None:
    job = rig.submit(1, Direction.LOAD)
    rig.copies.futures[0].set_exception(OSError("bus error"))
    await settle(lambda: rig.jobs.in_flight == 0)
    (done,) = rig.replies(JobDone)
    assert not done.ok and done.failed_keys == job.keys and "copy failed: bus error" in done.error
    assert rig.cache.calls == [("finish_reads", 0)]
    assert rig.counters.jobs_failed == 1 and rig.counters.bytes_loaded == 0


@pytest.mark.asyncio
async def test_copy_failures_are_logged_rate_limited(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    # One client's broken copies must not flood the log: one line per interval, the rest
    # counted (in the next line and in offloadd_jobs_total{outcome="failed"}).
    caplog.set_level(logging.ERROR, logger="offloadd.server.jobs")
    for job_id in range(1, 51):
        rig.submit(job_id, Direction.LOAD)
        rig.copies.futures[-1].set_exception(OSError("bus error"))
    await settle(lambda: rig.jobs.in_flight == 0)
    assert len(rig.replies(JobDone)) == 50 and rig.counters.jobs_failed == 50
    failed = [r for r in caplog.records if "copy failed" in r.getMessage()]
    assert len(failed) == 1, [r.getMessage() for r in failed]


@pytest.mark.asyncio
async def test_wait_answers_at_once_refuses_unknown_ids_and_times_out(rig: Rig) -> None:
    with pytest.raises(Refused, match=r"unknown job ids \[5\]") as refused:
        rig.wait(Wait(1, [5], timeout=1.0))
    assert refused.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(Refused, match="NaN"):
        rig.wait(Wait(1, [], timeout=math.nan))
    rig.submit(2)
    # A timeout of 0 is a poll: the job is still pending.
    assert rig.wait(Wait(2, [2], timeout=0.0)) == [WaitResult(2, [], [2])]
    assert rig.wait(Wait(3, [2], timeout=0.01)) == []
    await settle(lambda: rig.replies(WaitResult))
    assert rig.replies(WaitResult) == [WaitResult(3, [], [2])] and not rig.state.waiters


@pytest.mark.asyncio
async def test_each_session_keeps_its_last_recent_jobs_for_wait(rig: Rig) -> None:
    for job_id in range(5):
        rig.answer(rig.jobs.accept_without_copy(rig.state, job_id, rig.job(job_id)))
    assert list(rig.state.done) == [2, 3, 4]  # recent_jobs = 3
    assert rig.replies(JobAccepted) == [JobAccepted(i, i) for i in range(5)]
    with pytest.raises(Refused, match="unknown job ids"):
        rig.wait(Wait(9, [1], timeout=0.0))


@pytest.mark.asyncio
async def test_nothing_to_move_completes_the_job_at_once(rig: Rig) -> None:
    rig.answer(rig.jobs.submit(rig.state, 11, rig.job(1), []))  # JobAccepted, then JobDone
    assert rig.sent == [JobAccepted(11, 1), JobDone(1, True, [], 4096, 0.0, "")]
    assert rig.cache.calls == [("finish_store", True)] and rig.jobs.in_flight == 0
    assert not rig.copies.futures


@pytest.mark.asyncio
async def test_a_job_the_copy_engine_refuses_is_unbooked(rig: Rig) -> None:
    rig.copies.refuse.set()
    with pytest.raises(Refused, match="refused the job: no lane") as refused:
        rig.jobs.submit(rig.state, 1, rig.job(1), MOVES)
    assert refused.value.code == ErrorCode.INTERNAL
    assert rig.jobs.in_flight == 0 and not rig.state.jobs and rig.imported.refs == 1
    assert rig.cache.calls == [("finish_store", False)]
    await rig.jobs.drain()  # nothing in flight: returns at once


@pytest.mark.asyncio
async def test_an_abandoned_session_answers_its_waiters_and_its_late_copy_nobody(
    rig: Rig,
) -> None:
    job = rig.submit(1)
    assert rig.wait(Wait(5, [1], timeout=30.0)) == []
    rig.state.alive = False  # what Sessions does before abandoning
    rig.jobs.abandon(rig.state)
    assert job.abandoned and ("abandon", 0) in rig.cache.calls
    assert rig.sent == [WaitResult(5, [], [1])] and not rig.state.waiters
    draining = asyncio.ensure_future(rig.jobs.drain())
    rig.copies.futures[0].set_result(0.1)
    await asyncio.wait_for(draining, 5)
    assert rig.jobs.in_flight == 0 and rig.imported.refs == 1
    assert rig.cache.calls[-1] == ("finish_store", False)  # abandoned: nothing commits
    assert rig.sent == [WaitResult(5, [], [1])]  # the late JobDone went to nobody


@pytest.mark.asyncio
async def test_the_drain_gives_up_after_its_grace(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.submit(1)
    rig.jobs.draining = True
    with caplog.at_level(logging.WARNING, logger="offloadd.server"):
        await asyncio.wait_for(rig.jobs.drain(), 5)  # drain_seconds = 0.05
    assert "1 jobs still in flight after" in caplog.text
    rig.copies.futures[0].set_result(0.1)
    await settle(lambda: rig.jobs.in_flight == 0)


def _booked(rig: Rig, job_id: int, direction: Direction, nbytes: int, event: bytes) -> Job:
    job = rig.job(job_id, direction)
    job.nbytes = nbytes
    moves = [(job_id * 1000, job_id * 1000 + 100_000, nbytes)]
    assert rig.jobs.submit(rig.state, 0, job, moves, event).reply == JobAccepted(0, job_id)
    return job


@pytest.mark.asyncio
async def test_a_batch_starts_each_direction_as_one_copy_and_answers_in_one_frame(
    rig: Rig,
) -> None:
    with rig.jobs.batch():
        for job_id, nbytes in ((1, 100), (2, 300)):
            _booked(rig, job_id, Direction.LOAD, nbytes, b"event%d" % job_id)
        _booked(rig, 3, Direction.LOAD, 0, b"")  # no event of its own: the last one covers it
        _booked(rig, 4, Direction.STORE, 64, b"")
        assert not rig.copies.futures and rig.jobs.in_flight == 4  # booked, not started
        # One reference on the imports per copy, taken with its first job (the session's own
        # is the 1): each copy's jobs end together.
        assert rig.imported.refs == 1 + 2
    stores, loads = sorted(rig.copies.handed, key=lambda h: h[0] is Direction.LOAD)
    assert loads == (
        Direction.LOAD,
        [(1000, 101_000, 100), (2000, 102_000, 300), (3000, 103_000, 0)],
        b"event2",
    )
    assert stores == (Direction.STORE, [(4000, 104_000, 64)], None)
    load_future = rig.copies.futures[[h[0] for h in rig.copies.handed].index(Direction.LOAD)]
    load_future.set_result(0.8)
    await settle(lambda: rig.jobs.in_flight == 1)
    (frame,) = rig.replies(JobsDone)
    assert [(d.job_id, d.ok, d.nbytes) for d in frame.dones] == [
        (1, True, 100),
        (2, True, 300),
        (3, True, 0),
    ]
    assert [d.seconds for d in frame.dones] == pytest.approx([0.2, 0.6, 0.0])  # by bytes
    # The three loads' entries are let go in one call, their JobDones sent in one frame.
    assert rig.cache.calls == [("finish_reads", 0)] and not rig.replies(JobDone)
    assert list(rig.state.done) == [1, 2, 3]  # kept for Wait as lone jobs are
    assert rig.imported.refs == 1 + 1  # the store's copy still holds its reference


@pytest.mark.asyncio
async def test_a_batch_the_engine_refuses_answers_each_job_and_unbooks_it(rig: Rig) -> None:
    rig.copies.refuse.set()
    with rig.jobs.batch():
        _booked(rig, 1, Direction.LOAD, 10, b"")
        _booked(rig, 2, Direction.LOAD, 10, b"")
    dones = rig.replies(JobDone)
    refused = (False, ErrorCode.INTERNAL)
    assert [(d.job_id, d.ok, d.code) for d in dones] == [(1, *refused), (2, *refused)]
    assert all("refused the job: no lane" in d.error for d in dones)
    assert rig.jobs.in_flight == 0 and not rig.state.jobs and rig.imported.refs == 1


@pytest.mark.asyncio
async def test_a_batch_whose_copy_fails_fails_every_job_it_carried(rig: Rig) -> None:
    with rig.jobs.batch():
        _booked(rig, 1, Direction.STORE, 10, b"")
        _booked(rig, 2, Direction.STORE, 20, b"")
    (future,) = rig.copies.futures
    future.set_exception(OSError("bus error"))
    await settle(lambda: rig.jobs.in_flight == 0)
    (frame,) = rig.replies(JobsDone)
    assert [(d.job_id, d.ok) for d in frame.dones] == [(1, False), (2, False)]
    assert all(d.error == "copy failed: bus error" for d in frame.dones)
    assert rig.cache.calls == [("finish_store", False)]  # both jobs' writes, none committed
    assert rig.imported.refs == 1 and rig.counters.jobs_failed == 2


def _store_with_deadline(rig: Rig, job_id: int, deadline: float) -> Job:
    job = rig.job(job_id)
    job.deadline = deadline
    job.writes = [object()]  # type: ignore[list-item]  # the fake cache takes any write
    assert rig.jobs.submit(rig.state, 0, job, MOVES).reply == JobAccepted(0, job_id)
    return job


@pytest.mark.asyncio
async def test_a_store_whose_copy_ends_past_its_deadline_is_not_committed(rig: Rig) -> None:
    # The deadline passes while the copy is in flight (a daemon frozen past it, say).
    _store_with_deadline(rig, 1, time.monotonic() + 0.01)
    await settle(lambda: time.monotonic() > rig.state.jobs[1].deadline)
    rig.copies.futures[0].set_result(0.5)
    await settle(lambda: rig.jobs.in_flight == 0)
    (done,) = rig.replies(JobDone)
    assert not done.ok and done.failed_keys == [b"k" * 8 + bytes(4)]
    assert "store deadline passed" in done.error and "not committed" in done.error
    assert rig.cache.calls == [("finish_store", False)]  # nothing visible, its room freed
    assert rig.announcer.committed[0][1] == [] and rig.counters.bytes_stored == 0
    assert rig.counters.refused == {"late": 1} and rig.counters.jobs_failed == 1
    assert rig.imported.refs == 1


@pytest.mark.asyncio
async def test_a_store_whose_copy_ends_before_its_deadline_commits(rig: Rig) -> None:
    with rig.jobs.batch():  # checked per job at the copy's end, batched or not
        _store_with_deadline(rig, 1, time.monotonic() + 3600.0)
        _store_with_deadline(rig, 2, time.monotonic() - 1.0)  # already past as it ends
    (future,) = rig.copies.futures
    future.set_result(0.5)
    await settle(lambda: rig.jobs.in_flight == 0)
    (frame,) = rig.replies(JobsDone)
    assert [(d.job_id, d.ok) for d in frame.dones] == [(1, True), (2, False)]
    assert rig.cache.calls == [("finish_store", True), ("finish_store", False)]
    assert rig.counters.refused == {"late": 1} and rig.counters.bytes_stored == 4096


@dataclass
class LosingCommitter:
    """Commits every write but those of ``lose``, which its journal refuses."""

    lose: set[bytes]
    commits: list[int] = field(default_factory=list)

    def seal(self, writes: list[Any], then: Callable[[], object]) -> None:
        then()

    def commit(self, namespace: Any, writes: list[Any], *, ok: bool = True) -> Commit:
        self.commits.append(len(writes))
        entries = [write.entry for write in writes] if ok else []
        lost = [entry for entry in entries if entry.key in self.lose]
        return Commit([e for e in entries if e not in lost], lost, "journal full")


@pytest.mark.asyncio
async def test_a_batch_of_stores_commits_once_and_fails_only_the_job_that_lost_a_chunk(
    rig: Rig,
) -> None:
    committer = rig.jobs._committer = LosingCommitter({b"b2"})  # type: ignore[assignment]
    with rig.jobs.batch():
        for job_id, keys in ((1, [b"a1"]), (2, [b"b1", b"b2"]), (3, [b"c1"])):
            job = rig.job(job_id)
            job.keys = keys
            job.writes = [SimpleNamespace(entry=SimpleNamespace(key=k)) for k in keys]  # type: ignore[misc]
            assert rig.jobs.submit(rig.state, 0, job, MOVES).reply == JobAccepted(0, job_id)
    (future,) = rig.copies.futures
    future.set_result(0.5)
    await settle(lambda: rig.jobs.in_flight == 0)
    assert committer.commits == [4]  # the four writes of three jobs, as one commit
    (frame,) = rig.replies(JobsDone)
    assert [(d.job_id, d.ok, d.failed_keys) for d in frame.dones] == [
        (1, True, []),
        (2, False, [b"b2"]),
        (3, True, []),
    ]
    assert frame.dones[1].error == "not committed: journal full"
    assert frame.dones[0].error == frame.dones[2].error == ""
    assert rig.counters.jobs_failed == 1


def test_refuse_late_refuses_only_a_store_past_its_deadline(rig: Rig) -> None:
    rig.jobs.refuse_late(0.0, [b"k"])  # no deadline: today's behaviour
    rig.jobs.refuse_late(time.monotonic() + 3600.0, [b"k"])
    assert rig.counters.refused == {}
    with pytest.raises(Refused) as refused:
        rig.jobs.refuse_late(time.monotonic() - 0.5, [b"a", b"b"])
    assert refused.value.code == ErrorCode.DEADLINE_PASSED and "deadline" in str(refused.value)
    assert rig.counters.refused == {"late": 2}

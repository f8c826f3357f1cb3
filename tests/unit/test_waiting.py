"""The waiting stores' room: a share per tenant, and a store with no room is not stored."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from offloadd.server.state import Accepted, Job
from offloadd.server.waiting import REFUSED_WAITING, WaitingStores
from offloadd.transfer.types import Direction
from protocol.messages import JobAccepted

ENGINE = ("engine", 0)


@dataclass
class FakeJobs:
    """What WaitingStores asks of Jobs: bookings, JobDones, refused keys."""

    parked: int = 0
    done: dict[int, tuple[bool, list[bytes], str]] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)

    def park(self, job: Job, timer: asyncio.TimerHandle) -> None:
        job.waiting = timer
        self.parked += 1

    def unpark(self, job: Job) -> None:
        assert job.waiting is not None
        job.waiting.cancel()
        job.waiting = None
        self.parked -= 1

    def complete(self, job: Job, *, ok: bool, seconds: float, error: str) -> None:
        self.done[job.job_id] = (ok, list(job.failed_keys), error)

    def accept_without_copy(self, state: Any, request_id: int, job: Job, error: str) -> Accepted:
        def done() -> None:
            self.complete(job, ok=not job.failed_keys, seconds=0.0, error=error)

        return Accepted(JobAccepted(request_id, job.job_id), then=done)

    def count_refused(self, reason: str, keys: int) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + keys


class FakeCache:
    def listen(self, listener: object) -> None:
        pass

    def unplaced(self, namespace: str, keys: Sequence[bytes]) -> int:
        return 0


class FakeRegistry:
    """One scheduler, ``sched``, whose Reserve 1 is never read."""

    def session(self, session_id: str) -> Any:
        return SimpleNamespace(engine_key=ENGINE, reserves_read=0) if session_id else None


def _waiting(jobs: FakeJobs, *, most: int, per_tenant: int) -> WaitingStores:
    return WaitingStores(
        cast(Any, FakeCache()),
        cast(Any, jobs),
        cast(Any, FakeRegistry()),
        seconds=60.0,
        most=most,
        per_tenant=per_tenant,
    )


_ids = iter(range(1, 1 << 30))


def _job(tenant: str) -> Job:
    state = SimpleNamespace(session=SimpleNamespace(tenant=tenant, engine_key=ENGINE))
    job_id = next(_ids)
    return Job(job_id, cast(Any, state), Direction.STORE, [f"k{job_id}".encode()], [], 0)


def _park(waiting: WaitingStores, job: Job, started: list[int]) -> Accepted | None:
    answer = waiting.park(
        job, "ns", job.keys, lambda: started.append(job.job_id), ("sched", 1), request_id=7
    )
    if answer is not None and answer.then is not None:
        answer.then()  # what dispatch runs right after the reply
    return answer


def test_a_store_before_its_reserve_waits_and_one_with_no_room_is_not_stored() -> None:
    async def run() -> None:
        jobs = FakeJobs()
        waiting = _waiting(jobs, most=64, per_tenant=4)
        started: list[int] = []
        flood = [_job("u2") for _ in range(10)]
        answers = [_park(waiting, job, started) for job in flood]
        assert all(isinstance(a, Accepted) and isinstance(a.reply, JobAccepted) for a in answers)
        # Four wait; the six beyond the tenant's share are answered, and not stored: never ok.
        assert jobs.parked == 4 and waiting.waiting == 4
        assert sorted(jobs.done) == [job.job_id for job in flood[4:]]
        for job in flood[4:]:
            ok, failed, error = jobs.done[job.job_id]
            assert not ok and failed == job.keys and "waiting_stores_per_tenant = 4" in error
        assert jobs.refused == {REFUSED_WAITING: 6}
        # Another tenant's store still waits for its Reserve.
        victim = _job("u1")
        _park(waiting, victim, started)
        assert jobs.parked == 5 and victim.job_id not in jobs.done and not started
        # Not blocked (no Reserve named): starts now, as before.
        assert waiting.park(victim, "ns", victim.keys, lambda: None) is None

    asyncio.run(run())


def test_a_full_queue_gives_a_tenant_below_its_share_the_place_of_the_largest_tenants_latest() -> (
    None
):
    async def run() -> None:
        jobs = FakeJobs()
        waiting = _waiting(jobs, most=8, per_tenant=8)
        started: list[int] = []
        flood = [_job("u2") for _ in range(8)]
        for job in flood:
            _park(waiting, job, started)
        assert jobs.parked == 8 and not jobs.done  # the whole queue, within its own bound
        # Tenant u1's stores take the flood's latest places, up to its even share (4 of 8).
        victims = [_job("u1") for _ in range(5)]
        for victim in victims:
            _park(waiting, victim, started)
        assert jobs.parked == 8
        dropped = [job.job_id for job in flood[4:]]
        assert [j for j in jobs.done if j in dropped] == dropped[::-1]  # latest first
        assert all(not jobs.done[j][0] for j in dropped)
        # Its fifth is beyond its share: not stored either; none of its first four is.
        assert list(jobs.done) == [*dropped[::-1], victims[4].job_id]
        assert not jobs.done[victims[4].job_id][0]
        assert jobs.refused == {REFUSED_WAITING: 5}

    asyncio.run(run())

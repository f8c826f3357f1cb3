"""Rank stores of reserved keys that wait: for their room, or for the Reserve itself.

A scheduler's ``Reserve`` may find room for a key only in removed entries that another
engine's mirror still shows; the cache reserves such a key *unplaced* and gives it extents
when that mirror acknowledges the removal (``ChunkCache.unplaced``; ``placed()``). A rank's
store of it that arrives first waits here instead of dropping the key, and runs once the
cache has placed every one of its keys. And the daemon reads the scheduler's socket and its
ranks' in turns (zmq's fair queue), so a daemon that fell behind may read a rank's Store
before the scheduler's Reserve that it follows (the scheduler posts it before the step
reaches the ranks); the Store names that Reserve (``Store.reserver``, ``reserve_id``) and
waits here until it is read (``wake``) instead of skipping every key as unreserved.

Contract of ``WaitingStores`` (the event loop's thread only):
- ``park(job, namespace, keys, start, reserve, request_id)``: None when the store ``job`` of
  ``keys`` does not wait (the caller starts it now), else its answer. It waits when some of
  its keys are unplaced, or ``reserve`` (scheduler session id, request id) names a Reserve of
  a live scheduler of the job's engine not read yet (``Session.reserves_read``), and there is
  room (below); it is then booked in its session's jobs (``Jobs.park``: a Wait shows it
  pending, a drain waits for it), answered ``JobAccepted``, and ``start()`` runs it later on
  the loop, when the Reserve is read and the cache has placed all its keys, or after
  ``seconds`` at most (its keys still unplaced are then refused, reason ``ack``, as they are
  without waiting; keys never reserved are skipped). Nothing of it is copied, and nothing is
  visible, before ``start()``. With no room it is not stored: answered ``JobAccepted``, then
  a ``JobDone`` not ok with every key failed (counted as refused, reason ``waiting``), never
  started without its Reserve (whose keys it would skip as unreserved, and say ok).
- Room, per tenant (the job's session's): each tenant may have ``per_tenant`` stores
  waiting, and all together ``most``. When all the room is taken, a tenant with fewer
  than its even share (``most`` over the tenants with stores waiting, itself counted)
  takes the place of the latest store of the tenant with the most waiting, which ends as a
  store with no room does (``JobDone`` not ok). So one tenant filling the queue never
  takes another's share.
- ``wake()`` (``placed()`` as the cache's listener): keys were placed, or a scheduler's
  Reserve was read; the stores that no longer wait start after the caller returned.
- A waiting store whose session ended (``Jobs.abandon`` unbooks it) never starts; it leaves
  the queue at the next placement, or when its wait would have ended.
- ``waiting``: how many stores wait now (``Jobs.parked``: an ended session's are unbooked).

Bounded four ways: ``most`` stores, ``per_tenant`` of one tenant, ``seconds`` each, and each
session's ``limits.jobs_per_session`` (a waiting store counts as in flight).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence

from offloadd.cache.index import ChunkCache, Entry
from offloadd.server.jobs import Jobs
from offloadd.server.registry import Registry
from offloadd.server.state import Accepted, Job
from protocol.messages import JobAccepted

__all__ = ["MOST_WAITING", "REFUSED_WAITING", "WAIT_SECONDS", "WaitingStores", "wait_bound"]

logger = logging.getLogger(__name__)

_Reserve = tuple[str, int]  # a scheduler session id and its Reserve's request id ("": none)

# A mirror acknowledges within a tick of its background thread (offloadd.vllm.manager, 20 ms).
# One that says nothing is dropped after ``server.mirror_ack_timeout`` (``Sessions``), which
# frees the room it held and places the waiting keys; the daemon waits a little longer than
# that (``wait_bound``), so a store's keys are refused "ack" only if that drop never came.
WAIT_SECONDS = 1.0
MOST_WAITING = 4096
REFUSED_WAITING = "waiting"  # store keys not stored: no room to wait for their Reserve


def wait_bound(mirror_ack_timeout: float) -> float:
    """How long a store waits for its room: past the drop of a mirror that never acknowledges
    (the reaper runs every quarter of the bound at most, so it drops it within 1.5x)."""
    return 1.5 * mirror_ack_timeout + 0.1


class WaitingStores:
    """Stores waiting for their reserved keys' room; see the module docstring."""

    def __init__(
        self,
        cache: ChunkCache,
        jobs: Jobs,
        registry: Registry,
        *,
        seconds: float = WAIT_SECONDS,
        most: int = MOST_WAITING,
        per_tenant: int = MOST_WAITING,
    ) -> None:
        self._cache = cache
        self._jobs = jobs
        self._registry = registry
        self._seconds = seconds
        self._most = most
        self._per_tenant = per_tenant
        # In arrival order: job -> (namespace, keys, start, reserve).
        self._queue: dict[Job, tuple[str, Sequence[bytes], Callable[[], None], _Reserve]] = {}
        self._tenants: Counter[str] = Counter()  # stores in the queue, per tenant
        self._scheduled = False
        cache.listen(self)  # placed() wakes the stores

    @property
    def waiting(self) -> int:
        """Stores waiting now (those of ended sessions left out)."""
        return self._jobs.parked

    def park(
        self,
        job: Job,
        namespace: str,
        keys: Sequence[bytes],
        start: Callable[[], None],
        reserve: _Reserve = ("", 0),
        request_id: int = 0,
    ) -> Accepted | None:
        """None when ``job`` need not wait; else its answer: ``start()`` runs it later, or it
        had no room and its JobDone says it was not stored."""
        if not self._blocked(job, namespace, keys, reserve):
            return None
        for gone in [job for job in self._queue if job.abandoned]:
            self._remove(gone)
        tenant = job.state.session.tenant
        problem = self._room(tenant)
        if problem:
            job.failed_keys = list(job.keys)
            self._jobs.count_refused(REFUSED_WAITING, len(job.keys))
            return self._jobs.accept_without_copy(job.state, request_id, job, problem)
        timer = asyncio.get_running_loop().call_later(self._seconds, self._expired, job)
        self._jobs.park(job, timer)
        self._queue[job] = (namespace, keys, start, reserve)
        self._tenants[tenant] += 1
        return Accepted(JobAccepted(request_id, job.job_id))

    def _room(self, tenant: str) -> str:
        """Why a store of ``tenant`` may not wait ("" when it may, after making room)."""
        mine = self._tenants[tenant]
        if mine >= self._per_tenant:
            return (
                f"not stored: {mine} stores of this tenant wait for their Reserve or room "
                f"already (limits.waiting_stores_per_tenant = {self._per_tenant})"
            )
        if len(self._queue) < self._most:
            return ""
        share = self._most // (len(self._tenants) + (0 if mine else 1))
        top, largest = max((count, name) for name, count in self._tenants.items())
        if mine >= share or top <= mine + 1:
            return (
                f"not stored: all {self._most} places for waiting stores are taken, {mine} "
                f"by this tenant (its even share: {share})"
            )
        latest = next(job for job in reversed(self._queue) if job.state.session.tenant == largest)
        self._remove(latest)
        self._jobs.unpark(latest)
        latest.failed_keys = list(latest.keys)
        self._jobs.count_refused(REFUSED_WAITING, len(latest.keys))
        message = f"not stored: its place in the {self._most} waiting stores went to another tenant"
        self._jobs.complete(latest, ok=False, seconds=0.0, error=message)
        return ""

    def _remove(self, job: Job) -> tuple[str, Sequence[bytes], Callable[[], None], _Reserve]:
        entry = self._queue.pop(job)
        tenant = job.state.session.tenant
        self._tenants[tenant] -= 1
        if not self._tenants[tenant]:
            del self._tenants[tenant]
        return entry

    def _blocked(self, job: Job, namespace: str, keys: Sequence[bytes], reserve: _Reserve) -> bool:
        session_id, request_id = reserve
        if session_id:
            scheduler = self._registry.session(session_id)
            if (
                scheduler is not None
                and scheduler.engine_key == job.state.session.engine_key
                and scheduler.reserves_read < request_id
            ):
                return True
        return self._cache.unplaced(namespace, keys) > 0

    def removed(self, entries: Sequence[Entry]) -> None:
        """Nothing: evictions free no room a waiting store needs (acknowledgements do)."""

    def placed(self) -> None:
        """The cache placed waiting keys (a ``CacheListener``): ``wake``."""
        self.wake()

    def wake(self) -> None:
        """Start the stores that no longer wait, once the caller (the cache placing keys, a
        handler reading a Reserve) has returned."""
        if self._queue and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        for job, (namespace, keys, start, reserve) in list(self._queue.items()):
            if job.abandoned:
                self._remove(job)
            elif not self._blocked(job, namespace, keys, reserve):
                self._remove(job)
                self._start(job, start)

    def _expired(self, job: Job) -> None:
        if job not in self._queue:
            return
        entry = self._remove(job)
        if job.abandoned:
            return
        logger.debug(
            "%s: job %d waited %.1fs for its scheduler's Reserve or the room other mirrors "
            "hold; storing what is reserved and placed",
            job.state.session.describe(),
            job.job_id,
            self._seconds,
        )
        self._start(job, entry[2])

    def _start(self, job: Job, start: Callable[[], None]) -> None:
        self._jobs.unpark(job)
        start()

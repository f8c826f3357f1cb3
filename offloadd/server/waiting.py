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
- ``park(job, namespace, keys, start, reserve)``: whether the store ``job`` of ``keys`` waits.
  It waits when some of its keys are unplaced, or ``reserve`` (scheduler session id, request
  id) names a Reserve of a live scheduler of the job's engine not read yet
  (``Session.reserves_read``), and fewer than ``most`` stores wait already; it is then
  booked in its session's jobs (``Jobs.park``: a Wait shows it pending, a drain waits for it)
  and ``start()`` runs it later on the loop, when the Reserve is read and the cache has
  placed all its keys, or after ``seconds`` at most (its keys still unplaced are then
  refused, reason ``ack``, as they are without waiting; keys never reserved are skipped).
  Nothing of it is copied, and nothing is visible, before ``start()``.
- ``wake()`` (``placed()`` as the cache's listener): keys were placed, or a scheduler's
  Reserve was read; the stores that no longer wait start after the caller returned.
- A waiting store whose session ended (``Jobs.abandon`` unbooks it) never starts; it leaves
  the queue at the next placement, or when its wait would have ended.
- ``waiting``: how many stores wait now (``Jobs.parked``: an ended session's are unbooked).

Bounded three ways: ``most`` stores, ``seconds`` each, and each session's
``limits.jobs_per_session`` (a waiting store counts as in flight).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from offloadd.cache.index import ChunkCache, Entry
from offloadd.server.jobs import Jobs
from offloadd.server.registry import Registry
from offloadd.server.state import Job

__all__ = ["MOST_WAITING", "WAIT_SECONDS", "WaitingStores", "wait_bound"]

logger = logging.getLogger(__name__)

_Reserve = tuple[str, int]  # a scheduler session id and its Reserve's request id ("": none)

# A mirror acknowledges within a tick of its background thread (offloadd.vllm.manager, 20 ms).
# One that says nothing is dropped after ``server.mirror_ack_timeout`` (``Sessions``), which
# frees the room it held and places the waiting keys; the daemon waits a little longer than
# that (``wait_bound``), so a store's keys are refused "ack" only if that drop never came.
WAIT_SECONDS = 1.0
MOST_WAITING = 4096


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
    ) -> None:
        self._cache = cache
        self._jobs = jobs
        self._registry = registry
        self._seconds = seconds
        self._most = most
        # In arrival order: job -> (namespace, keys, start, reserve).
        self._queue: dict[Job, tuple[str, Sequence[bytes], Callable[[], None], _Reserve]] = {}
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
    ) -> bool:
        """Whether ``job`` waits for its Reserve or its unplaced keys; ``start()`` runs it
        later if so."""
        if not self._blocked(job, namespace, keys, reserve):
            return False
        for gone in [job for job in self._queue if job.abandoned]:
            del self._queue[gone]
        if len(self._queue) >= self._most:
            return False
        timer = asyncio.get_running_loop().call_later(self._seconds, self._expired, job)
        self._jobs.park(job, timer)
        self._queue[job] = (namespace, keys, start, reserve)
        return True

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
                del self._queue[job]
            elif not self._blocked(job, namespace, keys, reserve):
                del self._queue[job]
                self._start(job, start)

    def _expired(self, job: Job) -> None:
        entry = self._queue.pop(job, None)
        if entry is None or job.abandoned:
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

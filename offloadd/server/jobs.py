"""Jobs and waiters: the copies in flight, how they finish, and ``Wait``.

A job is one ``Store`` or ``Load`` of one session. Its cache side was reserved by the handler
(``offloadd.server.requests``); here it is booked, copied and finished.

Contract of ``Jobs`` (the event loop's thread only; a copy's end arrives from the copy
engine's threads through ``call_soon_threadsafe``, then runs through ``bulk``: the control
socket's bulk lane (its session's tenant's), behind the Lookups and Reserves waiting, or at
once when none is given):
- ``submit(state, request_id, job, moves, wait_event)``: book the job in its session's table,
  take a reference on the session's imports for the copy (inside ``batch``, one for all the
  jobs of the copy, taken with its first: a session that ended before the batch closes
  leaves them mapped), hand the moves to the copy engine,
  answer ``Accepted(JobAccepted)`` (``offloadd.server.dispatch``'s NOTICE mode). Nothing to
  move: the job completes right after its JobAccepted is sent. If the engine refuses the
  job, the booking is undone and ``Refused(INTERNAL)`` raised. ``submit_together(state, jobs,
  runs, wait_event)``: ``submit`` of several jobs of one session and direction, each with
  bytes to copy and answered by its JobDone only, whose chunks one ``ChunkRuns`` holds.
- When the copy ends (and a store's shards are sealed), the cache side is finished (a
  store's chunks commit through ``offloadd.server.commit``; a load's entries are let go), the
  imports released, and ``complete`` sends ``JobDone``, keeps it for ``Wait`` (the last
  ``server.recent_jobs`` per session) and answers the waiters it satisfies. The jobs of one
  copy finish together: their stores in one commit (one journal record, one mirror message,
  one event batch), their loads' entries in one call, their metrics once.
- A store with a deadline (``Job.deadline``, the rank's CLOCK_MONOTONIC) whose copy ends past
  it is not committed (its writes end not-ok, its JobDone says why, its keys are counted under
  ``REFUSED_LATE``); ``refuse_late(deadline, keys)`` raises ``Refused(DEADLINE_PASSED)`` for
  one not started by then (requests and waiting stores call it).
- ``batch()`` (a context): jobs submitted inside are booked at once and started when it
  closes, those of one session and direction as one copy with one end; their JobDones go in
  one ``JobsDone`` frame. A copy that fails fails all the jobs it carried; one the engine
  refuses gets each its JobDone (``refuse``, INTERNAL) instead of raising.
- ``accept_without_copy(state, request_id, job, error)``: ``JobAccepted``, then ``JobDone`` at
  once, for a job with nothing to copy.
- ``wait(state, request, reply)`` (DEFERRED): ``reply(WaitResult)`` at once when none of the
  jobs is in flight or the timeout is not positive, else when the last one finishes or the
  timeout passes.
- A ``StepJobs``' jobs are answered by their ``JobDone`` only (``requests.step_jobs`` sends no
  ``JobAccepted``); ``refuse(state, job_id, keys, code, message)``: the ``JobDone`` of such a
  job refused before it started (its ``code`` set), counted as a protocol error.
- ``park(job, timer)`` / ``unpark(job)``: book a store that waits for its room
  (``offloadd.server.waiting``) before it is started, and take the booking back (cancelling
  ``timer``, the end of its wait) just before it is; ``parked``: how many are booked so now.
- ``abandon(state)``: the session is gone: its stores are abandoned (nothing it half-wrote
  becomes visible), its jobs answer nobody, its waiters are answered now (the abandoned jobs
  listed as pending), its waiting stores are unbooked and never start.
- ``in_flight``: jobs booked and not finished; ``drain()`` waits, up to
  ``server.drain_seconds``, until there are none. ``draining``: no new jobs are taken;
  ``refuse_while_draining(store_keys)`` raises ``Refused(SHUTTING_DOWN)`` then, counting the
  store keys refused under the reason ``draining`` (reservations and stores call it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from itertools import chain

from offloadd.cache.index import ChunkCache
from offloadd.logs import PerUidLog
from offloadd.server.checks import Refused
from offloadd.server.commit import Committer
from offloadd.server.metrics import Counters, Metrics
from offloadd.server.registry import Registry
from offloadd.server.state import Accepted, Job, SessionState, Waiter, wait_result
from offloadd.settings import ServerSettings
from offloadd.transfer.copies import ChunkRuns
from offloadd.transfer.engine import CopyEngine
from offloadd.transfer.handles import HandleTable, Import
from offloadd.transfer.types import Direction, Triple
from protocol.errors import ErrorCode
from protocol.messages import JobAccepted, JobDone, JobsDone, Reply, Wait

__all__ = ["REFUSED_DRAINING", "REFUSED_LATE", "Job", "Jobs", "Waiter", "late", "wait_result"]

logger = logging.getLogger(__name__)

REFUSED_DRAINING = "draining"  # store keys refused while the daemon stops (GetStats reasons)
REFUSED_LATE = "late"  # store keys not started or not committed: their deadline had passed


def late(deadline: float) -> bool:
    """A store's ``deadline`` (the rank's CLOCK_MONOTONIC; 0: none) has passed."""
    return deadline > 0.0 and time.monotonic() > deadline


@dataclass(eq=False)
class _Copy:
    """The jobs of one copy (one session and direction), what they move (each submit's, in
    order), the CUDA event the copy waits for (the last one given: the rank records each
    job's on one stream, in order, so the last covers all) and the one reference on the
    session's imports they hold together, released when the copy ends."""

    imports: list[Import]
    jobs: list[Job] = field(default_factory=list)
    moves: list[Sequence[Triple] | ChunkRuns] = field(default_factory=list)
    wait_event: bytes = b""

    def add(
        self, jobs: Sequence[Job], moves: Sequence[Triple] | ChunkRuns, wait_event: bytes
    ) -> None:
        self.jobs.extend(jobs)
        self.moves.append(moves)
        self.wait_event = wait_event or self.wait_event


def _planned(parts: list[Sequence[Triple] | ChunkRuns]) -> Sequence[Triple]:
    """The copies of ``parts`` (jobs of one session and direction), in order, as one job's."""
    runs = [part for part in parts if isinstance(part, ChunkRuns)]
    if len(runs) == len(parts):
        # A step's chunks alike: one run, planned once.
        return (runs[0] if len(runs) == 1 else ChunkRuns.joined(runs)).copies()
    if len(parts) == 1:
        assert not isinstance(parts[0], ChunkRuns)
        return parts[0]
    return list(chain.from_iterable(p.copies() if isinstance(p, ChunkRuns) else p for p in parts))


class Jobs:
    """The copies in flight and their waiters; see the module docstring."""

    def __init__(
        self,
        settings: ServerSettings,
        registry: Registry,
        cache: ChunkCache,
        copy: CopyEngine,
        handles: HandleTable,
        committer: Committer,
        *,
        metrics: Metrics,
        counters: Counters,
        send: Callable[[bytes, Reply], None],
        bulk: Callable[[Callable[[], object], str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self._cache = cache
        self._copy = copy
        self._handles: HandleTable | None = handles
        self._committer = committer
        self.metrics = metrics
        self.counters = counters
        self._send = send
        self._bulk = bulk or (lambda work, _tenant: work())
        self.in_flight = 0
        self.parked = 0  # of them, stores waiting for their room (park, unpark)
        self.draining = False
        # Inside ``batch``: the copies booked, not started, by (session, direction).
        self._batch: dict[tuple[int, Direction], _Copy] | None = None
        self._idle = asyncio.Event()
        # One line per failure would let one client's broken copies flood the log (the
        # failures are each counted: offloadd_jobs_total{outcome="failed"}).
        # One line per uid per 10 s each: one user's broken copies hide no other user's.
        self._warn_unstarted = PerUidLog(logger, burst=1, interval=10.0)
        self._warn_failed = PerUidLog(logger, burst=1, interval=10.0)

    def handles_closed(self) -> None:
        """Release nothing more (the daemon closed the handle table: all is unmapped)."""
        self._handles = None

    def refuse_while_draining(self, store_keys: int = 0) -> None:
        """Refuse a job, reservation or hold while the daemon stops (its store keys counted)."""
        if not self.draining:
            return
        if store_keys:
            self.count_refused(REFUSED_DRAINING, store_keys)
        raise Refused(
            ErrorCode.SHUTTING_DOWN,
            "the daemon is shutting down: no new jobs, reservations or holds until it is back",
        )

    async def drain(self) -> None:
        """Wait, up to ``server.drain_seconds``, until no job is in flight."""
        if self.in_flight == 0:
            return
        grace = self.settings.drain_seconds
        logger.info("draining %d in-flight jobs (up to %.0fs)", self.in_flight, grace)
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            logger.warning("%d jobs still in flight after %.0fs", self.in_flight, grace)

    def release_imports(self, imports: Sequence[Import]) -> None:
        """Drop one reference on each of ``imports`` (the last one unmaps it)."""
        if self._handles is None:
            return
        for imported in imports:
            self._handles.release(imported)

    def accept_without_copy(
        self, state: SessionState, request_id: int, job: Job, error: str = ""
    ) -> Accepted:
        """Answer JobAccepted, then JobDone at once: ``job`` has nothing to copy."""

        def done() -> None:
            self.complete(job, ok=not job.failed_keys, seconds=0.0, error=error)

        return Accepted(JobAccepted(request_id, job.job_id), then=done)

    def refuse_late(self, deadline: float, keys: Sequence[bytes]) -> None:
        """Refuse a store whose deadline has passed (its keys counted under ``late``): the
        rank may have given its blocks back already."""
        if not late(deadline):
            return
        self.count_refused(REFUSED_LATE, len(keys))
        raise Refused(
            ErrorCode.DEADLINE_PASSED,
            f"the store's deadline passed {time.monotonic() - deadline:.3f}s ago: not started",
        )

    def count_refused(self, reason: str, keys: int) -> None:
        """Count ``keys`` store keys refused for ``reason`` (GetStats, metrics)."""
        refused = self.counters.refused
        refused[reason] = refused.get(reason, 0) + keys

    def refuse(
        self, state: SessionState, job_id: int, keys: list[bytes], code: ErrorCode, message: str
    ) -> None:
        """The JobDone of a StepJobs job refused before it started (nothing booked)."""
        self.counters.protocol_errors += 1
        self.metrics.protocol_error(code.name)
        self.counters.jobs_failed += 1
        logger.debug(
            "%s: job %d refused: %s %s", state.session.describe(), job_id, code.name, message
        )
        if state.alive:
            self._send(state.identity, JobDone(job_id, False, keys, 0, 0.0, message, int(code)))

    def submit(
        self,
        state: SessionState,
        request_id: int,
        job: Job,
        moves: Sequence[Triple] | ChunkRuns,
        wait_event: bytes = b"",
    ) -> Accepted:
        """Book ``job`` and start its copy (inside ``batch``: when the batch closes); see the
        module docstring. ``moves``: the copies, or the chunks to plan them from."""
        if not moves:
            error = self._commit_store(job, ok=True) if job.direction is Direction.STORE else ""
            return self.accept_without_copy(state, request_id, job, error)
        self._book(state, [job], moves, wait_event)
        return Accepted(JobAccepted(request_id, job.job_id))

    def submit_together(
        self, state: SessionState, jobs: Sequence[Job], runs: ChunkRuns, wait_event: bytes = b""
    ) -> None:
        """``submit`` of ``jobs`` (of one session and direction, each with bytes to copy,
        answered by their JobDone only) whose chunks ``runs`` holds, in order: one plan for
        them all, and no job record of its own made for each."""
        self._book(state, jobs, runs, wait_event)

    def _book(
        self,
        state: SessionState,
        jobs: Sequence[Job],
        moves: Sequence[Triple] | ChunkRuns,
        wait_event: bytes,
    ) -> None:
        """Book ``jobs`` and start their copy (inside ``batch``: when it closes)."""
        table = state.jobs
        for job in jobs:
            table[job.job_id] = job
        self.in_flight += len(jobs)
        if self._batch is not None:
            key = (id(state), jobs[0].direction)
            copy = self._batch.get(key)
            if copy is None:
                copy = self._batch[key] = _Copy(self._retained(state))
            copy.add(jobs, moves, wait_event)
            return
        copy = _Copy(self._retained(state))
        copy.add(jobs, moves, wait_event)
        try:
            self._launch(copy)
        except Exception as exc:
            self._not_started(copy, exc)
            raise Refused(ErrorCode.INTERNAL, f"the copy engine refused the job: {exc}") from None

    def _retained(self, state: SessionState) -> list[Import]:
        """A reference on each of the session's imports, for one copy."""
        assert self._handles is not None
        for imported in state.imports:
            self._handles.retain(imported)
        return list(state.imports)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Jobs submitted inside start when it closes, each direction's as one copy with one
        end: a step's 256 loads cost the copy engine and the loop one hand-over each way, not
        256 (and no copy thread takes the GIL while the step is still being planned). A copy
        that fails fails all of its jobs; one the engine refuses gets each its JobDone."""
        if self._batch is not None:  # nested: the outer batch starts them
            yield
            return
        self._batch = {}
        try:
            yield
        finally:
            # One copy per session and direction (its windows, its device).
            copies, self._batch = self._batch, None
            for copy in copies.values():
                try:
                    self._launch(copy)
                except Exception as exc:
                    self._not_started(copy, exc)
                    message = f"the copy engine refused the job: {exc}"
                    for job in copy.jobs:
                        self.refuse(job.state, job.job_id, job.keys, ErrorCode.INTERNAL, message)

    def _launch(self, copy: _Copy) -> None:
        """Hand ``copy`` (jobs of one session and direction) to the copy engine as one."""
        group = copy.jobs
        first = group[0]
        state, direction = first.state, first.direction
        future = self._copy.submit(
            direction,
            _planned(copy.moves),
            device=state.imports[0].device if state.imports else -1,
            wait_event=copy.wait_event or None,
        )
        loop = asyncio.get_running_loop()
        store = direction is Direction.STORE

        def on_done(done: Future[float]) -> None:
            def finished() -> None:
                work = partial(self._copies_finished, copy, done)
                loop.call_soon_threadsafe(self._bulk, work, state.session.tenant)

            if store and not done.cancelled() and done.exception() is None:
                writes = [w for job in group for w in job.writes]
                self._committer.seal(writes, finished)  # off the loop, before it can commit
                return
            finished()

        if future.done() and not store:
            # Copied already (a small load, on this thread): its JobDone goes now, before
            # anything planned after it (a step's stores), not a turn of the loop later.
            try:
                self._copies_finished(copy, future)
            except Exception:
                logger.exception("internal error ending a load copied at once")
            return
        future.add_done_callback(on_done)

    def _not_started(self, copy: _Copy, exc: Exception) -> None:
        """Undo the booking of jobs the copy engine refused to start: else they would stay in
        flight forever (Wait never answered, drain never finished)."""
        self.release_imports(copy.imports)
        for job in copy.jobs:
            self._unbook(job)
            self._warn_unstarted(
                job.state.session.uid,
                logging.ERROR,
                "%s: job %d not started: %s",
                job.state.session.describe(),
                job.job_id,
                exc,
            )

    def _unbook(self, job: Job) -> None:
        """Undo ``submit``'s booking of a job the copy engine refused to start (its copy's
        imports are released by the caller)."""
        job.state.jobs.pop(job.job_id, None)
        self.in_flight -= 1
        if job.direction is Direction.STORE:
            self._committer.fail(job.writes)
        else:
            self._cache.finish_reads([job.reads] if job.reads else [])
        if self.in_flight == 0:
            self._idle.set()

    def _copies_finished(self, copy: _Copy, future: Future[float]) -> None:
        jobs = copy.jobs
        self.release_imports(copy.imports)
        try:
            seconds = future.result()
            error = ""
        except Exception as exc:
            first = jobs[0]
            self._warn_failed(
                first.state.session.uid,
                logging.ERROR,
                "%s: copy failed for %d jobs (job %d first): %s",
                first.state.session.describe(),
                len(jobs),
                first.job_id,
                exc,
            )
            seconds, error = 0.0, f"copy failed: {exc}"
        copied = not error
        # The cache side of all of them at once: a step's 256 stores commit as one journal
        # record, one mirror message and one event batch, not 256 of each. A store's JobDone
        # says what committed, so it commits first; a load's bytes are the rank's once the
        # copy ended, so its JobDone goes first (a request's first token waits for it).
        store = jobs[0].direction is Direction.STORE
        errors = self._end_stores(jobs, copied=copied) if store else [""] * len(jobs)
        total = sum(job.nbytes for job in jobs)
        dones: list[JobDone] = []
        nbytes: list[int] = []
        failed = 0
        for job, why in zip(jobs, errors, strict=True):
            self.in_flight -= 1
            if not copied:
                job.failed_keys = list(job.keys)
            ok = copied and not job.failed_keys
            # Each job's share of the copy's time, for its JobDone.
            share = seconds * job.nbytes / total if len(jobs) > 1 and total else seconds
            done = self._settled(job, ok=ok, seconds=share, error=error or why)
            nbytes.append(0 if error or why else job.nbytes)
            failed += not ok
            if done is not None:
                dones.append(done)
        state = jobs[0].state
        if not store and copied:
            # Counted before the JobDone leaves: a rank that reads the stats on its reply
            # sees its own load in them.
            self.counters.bytes_loaded += total
        if dones:
            self._send(state.identity, dones[0] if len(dones) == 1 else JobsDone(dones))
            self._wake_waiters(state)
        if not store:
            self._cache.finish_reads(job.reads for job in jobs if job.reads)
        engine_id, dp = state.session.engine_key
        self.metrics.jobs_finished(
            jobs[0].direction.value, engine_id, dp, nbytes, seconds=seconds, failed=failed
        )
        if self.in_flight == 0:
            self._idle.set()

    def _end_stores(self, jobs: list[Job], *, copied: bool) -> list[str]:
        """End the writes of one copy's stores (of one session): those copied in time commit
        together; why each job failed ("" when it did not)."""
        errors = [""] * len(jobs)
        commit: list[int] = []  # indexes into jobs
        give_up: list[int] = []
        for index, job in enumerate(jobs):
            # Checked once the copy has ended: a commit then means every byte was read before
            # the deadline, so before the rank could give its blocks back to vLLM (it gives a
            # store up only past it, on the same clock). However long the daemon was frozen
            # in between, bytes of reused blocks are never committed.
            commits = copied and not job.abandoned
            overdue = commits and late(job.deadline)
            if overdue:
                self.count_refused(REFUSED_LATE, len(job.writes))
                overrun = time.monotonic() - job.deadline
                errors[index] = (
                    f"store deadline passed ({overrun:.3f}s ago) as its copy ended: not committed"
                )
                job.failed_keys = list(job.keys)
            elif copied:
                self.counters.bytes_stored += job.nbytes
            (commit if commits and not overdue else give_up).append(index)
        refused = self._commit_stores([jobs[i] for i in commit], ok=True)
        for index, why in zip(commit, refused, strict=True):
            errors[index] = why
        self._commit_stores([jobs[i] for i in give_up], ok=False)  # nothing commits
        return errors

    def _commit_store(self, job: Job, *, ok: bool) -> str:
        """End the store's writes through the committer; why some did not commit, or ""."""
        return self._commit_stores([job], ok=ok)[0]

    def _commit_stores(self, jobs: Sequence[Job], *, ok: bool) -> list[str]:
        """End the writes of one session's stores as one commit; for each job, why some of
        its chunks did not commit (their keys join its ``failed_keys``), or ""."""
        if not jobs:
            return []
        engine = self.registry.engine(jobs[0].state.session.engine_key)
        namespace = engine.namespace if engine is not None else None
        writes = [write for job in jobs for write in job.writes]
        outcome = self._committer.commit(namespace, writes, ok=ok)
        if not outcome.lost:
            return [""] * len(jobs)
        lost = {entry.key for entry in outcome.lost}
        reasons = []
        for job in jobs:
            keys = [w.entry.key for w in job.writes if w.entry.key in lost]
            job.failed_keys = job.failed_keys + keys
            reasons.append(f"not committed: {outcome.reason}" if keys else "")
        return reasons

    def complete(self, job: Job, *, ok: bool, seconds: float, error: str) -> None:
        """Count ``job`` finished; unless its session is gone, send and keep its JobDone."""
        engine_id, dp = job.state.session.engine_key
        nbytes = 0 if error else job.nbytes
        self.metrics.job_finished(
            job.direction.value, engine_id, dp, nbytes=nbytes, seconds=seconds, ok=ok
        )
        done = self._settled(job, ok=ok, seconds=seconds, error=error)
        if done is not None:
            self._send(job.state.identity, done)
            self._wake_waiters(job.state)

    def _settled(self, job: Job, *, ok: bool, seconds: float, error: str) -> JobDone | None:
        """``complete`` but for the metrics and the sending: the JobDone kept for Wait, None
        when its session is gone (nobody to answer)."""
        state = job.state
        state.jobs.pop(job.job_id, None)
        if not ok:
            self.counters.jobs_failed += 1
        if job.abandoned or not state.alive:
            return None
        done = JobDone(job.job_id, ok, job.failed_keys, job.nbytes, seconds, error)
        state.done[job.job_id] = done
        while len(state.done) > self.settings.recent_jobs:
            state.done.popitem(last=False)
        return done

    def abandon(self, state: SessionState) -> None:
        """The session is gone; see the module docstring."""
        for job in state.jobs.values():
            job.abandoned = True
            if job.direction is Direction.STORE:
                self._committer.abandon(job.writes)
        for waiter in state.waiters:
            if waiter.timer is not None:
                waiter.timer.cancel()
            # Every request is answered: a peer that said Hello again (or Bye) on this socket
            # still gets its Wait's reply, the abandoned jobs listed as pending.
            waiter.reply(wait_result(state, waiter))
        state.waiters.clear()
        for job in [job for job in state.jobs.values() if job.waiting is not None]:
            self.unpark(job)

    def park(self, job: Job, timer: asyncio.TimerHandle) -> None:
        """Book the store ``job``, which waits for its room until ``timer`` at most."""
        job.state.jobs[job.job_id] = job
        job.waiting = timer
        self.in_flight += 1
        self.parked += 1

    def unpark(self, job: Job) -> None:
        """Take back ``park``'s booking of ``job`` (it starts now, or never)."""
        if job.waiting is None:
            return
        job.waiting.cancel()
        job.waiting = None
        job.state.jobs.pop(job.job_id, None)
        self.in_flight -= 1
        self.parked -= 1
        if self.in_flight == 0:
            self._idle.set()

    # ----------------------------------------------------------------- wait

    def wait(self, state: SessionState, request: Wait, reply: Callable[[Reply], None]) -> None:
        """Answer now, or register a waiter answered when its jobs finish or it times out."""
        if math.isnan(request.timeout):  # uvloop's call_later raises on NaN
            raise Refused(ErrorCode.BAD_REQUEST, "Wait timeout is NaN")
        unknown = [j for j in request.job_ids if j not in state.jobs and j not in state.done]
        if unknown:
            raise Refused(ErrorCode.BAD_REQUEST, f"unknown job ids {unknown[:10]}")
        waiter = Waiter(request.request_id, list(request.job_ids), reply)
        if not any(j in state.jobs for j in waiter.job_ids) or request.timeout <= 0:
            reply(wait_result(state, waiter))
            return
        loop = asyncio.get_running_loop()
        waiter.timer = loop.call_later(request.timeout, self._wait_timed_out, state, waiter)
        state.waiters.append(waiter)

    def _wake_waiters(self, state: SessionState) -> None:
        for waiter in list(state.waiters):
            if not any(j in state.jobs for j in waiter.job_ids):
                state.waiters.remove(waiter)
                if waiter.timer is not None:
                    waiter.timer.cancel()
                waiter.reply(wait_result(state, waiter))

    def _wait_timed_out(self, state: SessionState, waiter: Waiter) -> None:
        if waiter in state.waiters and state.alive:
            state.waiters.remove(waiter)
            waiter.reply(wait_result(state, waiter))

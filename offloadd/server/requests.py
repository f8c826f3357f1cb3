"""The requests on the cache: Lookup, Store, Load, Release and Clear.

Each handler admits the request in one call (``offloadd.server.admission``), asks the
cache (``ChunkCache``) and answers; a Store or Load reserves its keys in the cache, plans the
copies between the rank's regions and the arena (``transfer.plan``) and hands the job to
``Jobs``, which answers ``JobAccepted`` now and ``JobDone`` when the copy ends.

Contract of ``CacheRequests`` (the event loop's thread only; each call handles one request to
completion, raising ``Refused`` for one the daemon answers with an Error):
- ``lookup``: the leading committed keys and the pending ones, pinned for a lease on request
  (the lease cut to ``limits.max_lease_seconds``; a hit is pinned only within the engine's
  share of the capacity and its tenant's, which the cache counts with the engine and its
  tenant as the pins' accounts). With
  tiers below the arena (``offloadd.server.tiers``), keys after the hits that a tier
  holds are promoted and reported pending; a tier that answers off the loop (the cluster)
  defers the reply (``reply`` is kept, ``offloadd.server.dispatch``'s DEFERRED mode), sent
  within its ``lookup_timeout``. Without tiers nothing of this runs.
- ``store`` and ``load``: worker ranks of a ready engine only, never while draining, a job id
  not in flight in the session, at most ``limits.jobs_per_session`` in flight, and only while
  the rank's files are as large as when it registered (a file that shrank is refused here,
  never met by a copy); block ids checked against the rank's regions. A Store's refused keys
  come back in ``JobDone.failed_keys``; a Load of a missing key fails whole. The copies reach
  the rank's unmapped files through their descriptors (``ChunkRuns(state.windows)``). A Store of
  reserved keys whose room waits on another mirror's acknowledgement, or whose scheduler's
  ``Reserve`` (``Store.reserve_id``) is not read yet, waits for it
  (``offloadd.server.waiting``): answered ``JobAccepted`` now, started when the keys are
  placed (the engine still ready, the files not shrunk), else its ``JobDone`` says why not.
  A Store whose ``deadline`` has passed is refused (``DEADLINE_PASSED``), when it arrives and
  when a waiting one would start: the rank may have given its blocks back to vLLM.
- ``step_jobs``: each Store and Load of a rank's step handled as above, in order, none
  answered ``JobAccepted`` (the per-job checks run once over the whole step when all its
  jobs pass them, each job's alone otherwise: the same refusals either way); a job refused
  (or failing inside the daemon) gets its ``JobDone`` with the code and the next job still
  runs; the message is answered ``Ok(jobs started)``.
- ``release``: drop the session's pins of the keys. ``clear``: drop the engine's namespace.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate, groupby, repeat
from typing import NamedTuple

from offloadd.cache.arena import Arena
from offloadd.cache.index import ChunkCache, Reads, ShardWrite
from offloadd.logs import PerUidLog
from offloadd.server.admission import Admission, Step
from offloadd.server.checks import Refused, check_offloaded
from offloadd.server.commit import Committer
from offloadd.server.jobs import Jobs
from offloadd.server.limits import Limits
from offloadd.server.metrics import Metrics
from offloadd.server.mirrors import Mirrors
from offloadd.server.registry import (
    Engine,
    Namespace,
    Registry,
    elected_keys,
    group_of_key,
    one_group,
    store_part,
)
from offloadd.server.schedulers import acker
from offloadd.server.state import Accepted, Job, SessionState
from offloadd.server.tiers import Tiers
from offloadd.server.usage import Usage
from offloadd.server.waiting import WaitingStores, wait_bound
from offloadd.settings import Settings
from offloadd.transfer.copies import ChunkRuns, block_bytes
from offloadd.transfer.plan import block_id_problem, chunk_ranges, group_spans
from offloadd.transfer.types import Direction, Span
from protocol.errors import ErrorCode
from protocol.messages import (
    Clear,
    Load,
    Lookup,
    LookupResult,
    Ok,
    Release,
    Reply,
    Segment,
    StepJobs,
    Store,
)

__all__ = ["CacheRequests"]

logger = logging.getLogger(__name__)


class CacheRequests:
    """Lookup, Store, Load, Release and Clear; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        cache: ChunkCache,
        arena: Arena,
        mirrors: Mirrors,
        jobs: Jobs,
        commit: Committer,
        *,
        metrics: Metrics,
        limits: Limits,
        tiers: Tiers | None = None,
    ) -> None:
        self.settings = settings
        self.usage = Usage()  # who used which namespace, when (offloadd cache ls)
        self._tiers = tiers
        self._limits = limits
        self.registry = registry
        self._cache = cache
        self._arena = arena
        self._mirrors = mirrors
        self._jobs = jobs
        self._commit = commit
        self.metrics = metrics
        # A store waits out a silent mirror: dropped after mirror_ack_timeout (plus up to two
        # reaper periods), its removals free their room and the store is placed.
        self._admit = Admission(registry, jobs, limits, self.usage)  # each kind's, once
        self._log = PerUidLog(logger)  # Clear's line: limited per uid
        self.waiting = WaitingStores(
            cache,
            jobs,
            registry,
            seconds=wait_bound(settings.server.mirror_ack_timeout),
            per_tenant=settings.limits.waiting_stores_per_tenant,
        )

    def lookup(self, state: SessionState, request: Lookup, reply: Callable[[Reply], None]) -> None:
        """Which leading keys are committed, which are pending; pin the hits if asked."""
        started = time.perf_counter()
        engine, namespace = self._admit.keyed(state, request.keys)
        lease = self._limits.lease(request.lease_seconds, self.settings.cache.pin_lease_seconds)
        if lease is None:
            raise Refused(ErrorCode.BAD_REQUEST, f"lease_seconds={request.lease_seconds!r}")
        owner = state.session.session_id
        outcome = self._cache.lookup(
            namespace.name,
            request.keys,
            pin_owner=owner if request.pin else None,
            lease=lease if request.pin else 0.0,
            account=engine.key,  # pins within the engine's budget (limits.protected_fraction)
            tenant=engine.tenant,  # and its tenant's (limits.tenant_protected_fraction)
        )
        self.usage.looked_up(
            engine.key, namespace.name, outcome.hits, len(request.keys) - outcome.hits
        )
        pinned = outcome.pinned
        pending = outcome.pending
        tiers = self._tiers
        if tiers is not None and outcome.hits < len(request.keys):
            hits = outcome.hits

            def answer(promoted: list[int]) -> None:
                # A deferred reply: the session may have left meanwhile.
                if state.alive:
                    found = sorted(pending + promoted)
                    reply(LookupResult(request.request_id, hits, found, pinned))
                self.metrics.lookup_finished(time.perf_counter() - started)

            promoted = tiers.probe(
                namespace, request.keys, hits, answer, acker=acker(self._mirrors, state)
            )
            if promoted is None:
                return  # ``answer`` replies when the tier's probe ends
            if promoted:
                pending = sorted(pending + promoted)
        self.metrics.lookup_finished(time.perf_counter() - started)
        reply(LookupResult(request.request_id, outcome.hits, pending, pinned))

    def release(self, state: SessionState, request: Release) -> Reply:
        """Drop the session's pins of ``request.keys``."""
        _engine, namespace = self._admit.keyed(state, request.keys)
        owner = state.session.session_id
        count = self._cache.release(namespace.name, request.keys, owner)
        return Ok(request.request_id, count)

    def clear(self, state: SessionState, request: Clear) -> Reply:
        """Drop every chunk of the session's namespace."""
        engine, namespace = self._admit.ready(state)
        removed = self._cache.clear_namespace(namespace.name, acker=acker(self._mirrors, state))
        keys = self._commit.cleared(engine, namespace, removed)
        self._log(
            state.session.uid,
            logging.INFO,
            "%s cleared namespace %s: %d chunks",
            state.session.describe(),
            namespace.name,
            len(keys),
        )
        return Ok(request.request_id, len(keys))

    def step_jobs(self, state: SessionState, request: StepJobs) -> Reply:
        """Run each job of the step as its lone request would run; see the module docstring."""
        started = 0
        step: Step | None = None
        problem: Refused | None = None
        try:
            step = self._admit.step(state, request.jobs)
        except Refused as refused:
            problem = refused
        # Loads first, as a copy of their own: a request's first token waits for them, a
        # store can wait (vLLM orders neither against the other: they use other blocks).
        loads = [job for job in request.jobs if isinstance(job, Load)]
        stores = [job for job in request.jobs if not isinstance(job, Load)]
        if loads:
            with self._jobs.batch():
                if step is not None:
                    loaded = self._loads(state, loads, step)
                    started += sum(map(self._started, repeat(state), loaded))
                else:
                    started += sum(self._step_job(state, job, step, problem) for job in loads)
        with self._jobs.batch():
            started += sum(self._step_job(state, job, step, problem) for job in stores)
        return Ok(request.request_id, started)

    def _step_job(
        self,
        state: SessionState,
        job: Store | Load,
        step: Step | None,
        problem: Refused | None,
    ) -> int:
        """One job of a StepJobs: 1 if it started, else 0 (its JobDone says why)."""
        outcome: Accepted | Exception
        try:
            if problem is not None:
                raise problem
            outcome = (
                self.store(state, job, step=step)
                if isinstance(job, Store)
                else self.load(state, job, step=step)
            )
        except Exception as exc:
            outcome = exc
        return self._started(state, (job, outcome))

    def _started(
        self, state: SessionState, ended: tuple[Store | Load, Accepted | Exception]
    ) -> int:
        """1 if a StepJobs' job started, else 0 (its JobDone says why)."""
        job, outcome = ended
        if isinstance(outcome, Refused):
            self._jobs.refuse(state, job.job_id, job.keys, outcome.code, str(outcome))
            return 0
        if isinstance(outcome, Exception):
            # A bug in one job must not lose the others' answers.
            logger.error("internal error in job %d of a StepJobs", job.job_id, exc_info=outcome)
            message = "internal error; see daemon log"
            self._jobs.refuse(state, job.job_id, job.keys, ErrorCode.INTERNAL, message)
            return 0
        # Its JobDone is the only answer: no JobAccepted, but what follows it still runs.
        if outcome.then is not None:
            outcome.then()
        return 1

    def store(self, state: SessionState, request: Store, *, step: Step | None = None) -> Accepted:
        """Reserve the rank's shard of each key and copy its blocks into the arena (``step``:
        see ``Admission.store``)."""
        engine, namespace = self._admit.store(state, request, step)
        bpc = namespace.blocks_per_chunk
        if not request.segments and len(request.block_ids) != len(request.keys) * bpc:
            raise Refused(
                ErrorCode.BAD_REQUEST,
                f"{len(request.keys)} keys need {len(request.keys) * bpc} block ids "
                f"({bpc} per chunk), got {len(request.block_ids)}",
            )
        ranges = self._chunk_ranges(request.keys, request.block_ids, bpc, request.segments)
        self._check_block_ids(state, request.block_ids, step)
        check_offloaded(request.keys, namespace)
        session = state.session
        job = Job(request.job_id, state, Direction.STORE, request.keys, [], 0)
        job.deadline = request.deadline
        if namespace.replicated and session.rank != 0:
            # Replicated layout: rank 0's shard is every rank's; the others ack at once.
            return self._jobs.accept_without_copy(state, request.request_id, job)
        # Canonical layout: of the ranks holding the same canonical bytes, one writes each key.
        mine = elected_keys(engine, session.rank, request.keys)
        if not mine:
            return self._jobs.accept_without_copy(state, request.request_id, job)
        if request.reserved and (
            parked := self.waiting.park(
                job,
                namespace.name,
                [request.keys[i] for i in mine] if len(mine) < len(request.keys) else request.keys,
                lambda: self._start_waiting(state, request, job, ranges, namespace, mine),
                (request.reserver, request.reserve_id),
                request.request_id,
            )
        ):
            return parked
        return self._start_store(state, request, job, ranges, namespace, mine, engine)

    def _start_waiting(
        self,
        state: SessionState,
        request: Store,
        job: Job,
        ranges: _Ranges,
        namespace: Namespace,
        mine: list[int],
    ) -> None:
        """Start a store that waited for its room; a refusal is its JobDone."""
        try:
            engine = self._admit.waited(state, job.deadline, job.keys)
            accepted = self._start_store(state, request, job, ranges, namespace, mine, engine)
        except Refused as refused:
            job.failed_keys = list(job.keys)
            self._jobs.complete(job, ok=False, seconds=0.0, error=str(refused))
            return
        except Exception:
            logger.exception("internal error starting job %d", job.job_id)
            job.failed_keys = list(job.keys)
            self._jobs.complete(job, ok=False, seconds=0.0, error="internal error")
            return
        if accepted.then is not None:
            accepted.then()

    def _start_store(
        self,
        state: SessionState,
        request: Store,
        job: Job,
        ranges: _Ranges,
        namespace: Namespace,
        mine: list[int],
        engine: Engine,
    ) -> Accepted:
        """Reserve and copy the keys ``mine`` (indexes into the request's) names."""
        session = state.session
        bpc = namespace.blocks_per_chunk
        # Canonical layout: one shard, the canonical chunk, that the engine's writers fill
        # together, each its own fragments; it commits when all have.
        shard, writers = store_part(engine, session.rank)
        keys = request.keys if len(mine) == len(request.keys) else [request.keys[i] for i in mine]
        cache = self._cache
        reservation = cache.begin_store(
            namespace.name,
            keys,
            shard,
            namespace.shard_sizes_for_key,
            allocate=not request.reserved,
            writers=writers,
        )
        job.failed_keys = [keys[i] for i in reservation.refused]
        job.writes = reservation.writes
        if job.failed_keys:
            logger.debug("%s: %d keys refused (no room)", session.describe(), len(job.failed_keys))
        arena_address = self._arena.address
        # Planned as arrays (the cuda engine takes them as they are); the rank's files are
        # reached by descriptor (offloadd.transfer.guarded).
        runs = ChunkRuns(state.windows)
        block_ids = request.block_ids
        chunks, firsts, _ = ranges
        positions = namespace.group_positions
        writes = reservation.writes
        if writes and one_group(keys):
            spans, shard_bytes = self._spans(state, positions[group_of_key(keys[0])], bpc)
            if shard_bytes > min(write.size for write in writes):
                raise AssertionError("shard plan exceeds its slot")
            _add_by_runs(runs, spans, _write_pieces(writes, mine, ranges, block_ids, arena_address))
        else:
            for write in writes:
                group = group_of_key(keys[write.index])
                spans, shard_bytes = self._spans(state, positions[group], bpc)
                if shard_bytes > write.size:
                    raise AssertionError("shard plan exceeds its slot")
                index = mine[write.index]
                sub_block, count = chunks[index]
                start = firsts[index]
                address = arena_address + write.offset
                runs.add(spans, block_ids[start : start + count], address, sub_block)
        job.nbytes += runs.nbytes
        return self._jobs.submit(state, request.request_id, job, runs, request.wait_event)

    def load(self, state: SessionState, request: Load, *, step: Step | None = None) -> Accepted:
        """Copy committed chunks into the rank's blocks: every key, or none (``step``: see
        ``Admission.load``)."""
        ((_, outcome),) = self._loads(state, [request], step)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _loads(
        self, state: SessionState, requests: Sequence[Load], step: Step | None
    ) -> list[tuple[Load, Accepted | Exception]]:
        """``load`` of each request, in order, their held entries read in one call (a step's
        loads; 64 read one by one cost ~0.3 ms): each with its outcome, a refusal or a bug
        as the exception it raised."""
        if len(requests) > 1 and (step is None or not step.checked):
            # Checked alone: each is booked before the next one's checks count the jobs.
            return [done for request in requests for done in self._loads(state, [request], step)]
        outcomes: list[Accepted | Exception] = []
        checked: list[tuple[int, _Ranges]] = []
        where: tuple[Engine, Namespace] | None = None
        for request in requests:
            try:
                where = self._admit.load(state, request, step)
                ranges = self._load_ranges(state, request, where[1], step)
            except Exception as exc:
                outcomes.append(exc)
                continue
            checked.append((len(outcomes), ranges))
            outcomes.append(_UNSTARTED)
        if where is None:
            return list(zip(requests, outcomes, strict=True))
        engine, namespace = where
        try:
            all_reads = self._begin_loads(engine, namespace, [requests[i] for i, _ in checked])
        except Exception as exc:
            all_reads, outcomes = [], [exc if o is _UNSTARTED else o for o in outcomes]
        started = list(zip(checked, all_reads, strict=False))
        together = [
            (index, ranges, reads) for (index, ranges), reads in started if not reads.missing
        ]
        if len(together) > 1:
            try:
                self._start_loads(state, [requests[i] for i, _, _ in together], namespace, together)
            except Exception:  # a bug in one job: each alone, for its own outcome
                logger.exception("a step's loads could not be planned together")
            else:
                for index, _, _ in together:
                    outcomes[index] = _STARTED_TOGETHER
        for (index, ranges), reads in started:
            if outcomes[index] is not _UNSTARTED:
                continue
            try:
                outcomes[index] = self._start_load(state, requests[index], namespace, ranges, reads)
            except Exception as exc:
                outcomes[index] = exc
        return list(zip(requests, outcomes, strict=True))

    def _load_ranges(
        self, state: SessionState, request: Load, namespace: Namespace, step: Step | None
    ) -> _Ranges:
        """The checks of a Load's block ids: its chunks' ranges in them."""
        bpc = namespace.blocks_per_chunk
        skip = request.skip
        expected = len(request.keys) * bpc - skip
        if not request.keys or (
            not request.segments and (not 0 <= skip < bpc or len(request.block_ids) != expected)
        ):
            raise Refused(
                ErrorCode.BAD_REQUEST,
                f"{len(request.keys)} keys with skip={skip} need {expected} block ids "
                f"({bpc} per chunk, 0 <= skip < {bpc}), got {len(request.block_ids)}",
            )
        ranges = self._chunk_ranges(
            request.keys, request.block_ids, bpc, request.segments, skip=skip
        )
        self._check_block_ids(state, request.block_ids, step)
        return ranges

    def _start_load(
        self,
        state: SessionState,
        request: Load,
        namespace: Namespace,
        ranges: _Ranges,
        reads: Reads,
    ) -> Accepted:
        """Copy the chunks ``reads`` holds for a checked Load (none: it fails whole)."""
        session = state.session
        bpc = namespace.blocks_per_chunk
        job = Job(request.job_id, state, Direction.LOAD, request.keys, [], 0)
        if reads.missing:
            job.failed_keys = list(reads.missing)
            self._jobs.counters.loads_missing += 1
            return self._jobs.accept_without_copy(
                state, request.request_id, job, "keys not in cache"
            )
        job.reads = reads
        shard = 0 if namespace.replicated or namespace.writers else session.rank
        arena_address = self._arena.address
        runs = ChunkRuns(state.windows, load=True)  # as in store
        block_ids = request.block_ids
        positions = namespace.group_positions
        chunks, firsts, _ = ranges
        extents = self._cache.read_extents(reads.rows, shard)
        for key, (offset, size), (sub_block, count), position in zip(
            request.keys, extents, chunks, firsts, strict=True
        ):
            spans, shard_bytes = self._spans(state, positions[group_of_key(key)], bpc)
            if shard_bytes > size:
                raise AssertionError("shard plan exceeds its slot")
            address = arena_address + offset
            runs.add(spans, block_ids[position : position + count], address, sub_block)
        job.nbytes += runs.nbytes
        return self._jobs.submit(state, request.request_id, job, runs, request.wait_event)

    def _start_loads(
        self,
        state: SessionState,
        requests: Sequence[Load],
        namespace: Namespace,
        checked: Sequence[tuple[int, _Ranges, Reads]],
    ) -> None:
        """``_start_load`` of checked Loads whose every key is read (``checked``: each one's
        place, ranges and reads), planned as one: one ``read_extents``, one ``ChunkRuns``,
        each group's spans looked up once and, when the step's keys are all of one group,
        its chunks added by runs (64 loads started one by one cost ~0.6 ms). Raises before
        booking any of them when one cannot be planned; each started one's JobDone is its
        only answer."""
        bpc = namespace.blocks_per_chunk
        shard = 0 if namespace.replicated or namespace.writers else state.session.rank
        arena_address = self._arena.address
        runs = ChunkRuns(state.windows, load=True)
        positions = namespace.group_positions
        keys = [key for request in requests for key in request.keys]
        one = one_group(keys)
        groups = {group_of_key(keys[0])} if one else set(map(group_of_key, keys))
        planned = {group: self._spans(state, positions[group], bpc) for group in groups}
        rows = [row for _, _, reads in checked for row in reads.rows]
        extents = self._cache.read_extents(rows, shard)
        addresses = [arena_address + offset for offset, _ in extents]
        nbytes: list[int] = []
        if one:
            spans, shard_bytes = planned[next(iter(groups))]
            if shard_bytes > min(size for _, size in extents):
                raise AssertionError("shard plan exceeds its slot")
            _add_by_runs(runs, spans, _load_pieces(requests, checked, addresses))
            per_block = block_bytes(spans)  # what ChunkRuns counts per block id
            for _, ranges, _reads in checked:
                blocks = sum(count * (end - start) for start, end, _, count in ranges.alike)
                nbytes.append(blocks * per_block)
        else:
            at = 0
            for request, (_, ranges, _reads) in zip(requests, checked, strict=True):
                before = runs.nbytes
                block_ids = request.block_ids
                for index, key in enumerate(request.keys):
                    spans, shard_bytes = planned[group_of_key(key)]
                    if shard_bytes > extents[at + index][1]:
                        raise AssertionError("shard plan exceeds its slot")
                    sub_block, count = ranges.chunks[index]
                    first = ranges.firsts[index]
                    ids = block_ids[first : first + count]
                    runs.add(spans, ids, addresses[at + index], sub_block)
                at += len(request.keys)
                nbytes.append(runs.nbytes - before)
        jobs: list[Job] = []
        for request, (_, _ranges, reads), size in zip(requests, checked, nbytes, strict=True):
            job = Job(request.job_id, state, Direction.LOAD, request.keys, [], size)
            job.reads = reads
            jobs.append(job)
        self._jobs.submit_together(state, jobs, runs, _last_event(requests))

    def _begin_loads(
        self, engine: Engine, namespace: Namespace, requests: Sequence[Load]
    ) -> list[Reads]:
        """Read each Load's entries: those a scheduler of ``engine`` holds under its token
        (``hold``); by key for the others and where no scheduler does (that scheduler's
        session ended: replaced, or dropped for a silent mirror), which fails only for keys
        that are gone."""
        cache = self._cache
        found: list[Reads | None] = [None] * len(requests)
        waiting = [index for index, request in enumerate(requests) if request.hold]
        for scheduler in engine.schedulers.values():
            if not waiting:
                break
            held = [(requests[i].hold, requests[i].keys) for i in waiting]
            for index, reads in zip(
                waiting, cache.begin_reads_held(scheduler.session_id, held), strict=True
            ):
                if not reads.missing:
                    found[index] = reads
            waiting = [index for index in waiting if found[index] is None]
        return [
            reads if reads is not None else cache.begin_reads(namespace.name, request.keys)
            for request, reads in zip(requests, found, strict=True)
        ]

    @staticmethod
    def _chunk_ranges(
        keys: list[bytes],
        block_ids: list[int],
        bpc: int,
        segments: Sequence[Segment],
        *,
        skip: int = 0,
    ) -> _Ranges:
        try:
            return _ranges(len(keys), len(block_ids), bpc, tuple(segments), skip)
        except ValueError as exc:
            raise Refused(ErrorCode.BAD_REQUEST, str(exc)) from None

    def _check_block_ids(
        self, state: SessionState, block_ids: list[int], step: Step | None
    ) -> None:
        if step is not None and step.checked:
            return
        problem = block_id_problem(block_ids, state.session.num_blocks)
        if problem:
            raise Refused(ErrorCode.BAD_REQUEST, problem)

    def _spans(self, state: SessionState, group: int, bpc: int) -> tuple[tuple[Span, ...], int]:
        """The session's resolved spans of ``group`` (built once) and its shard bytes.

        Building them checks every region's geometry against what the daemon really mapped,
        so block ids validated against ``num_blocks`` can never address outside a region.
        """
        planned = state.spans.get(group)
        if planned is None:
            layout = state.session.layouts[group]
            mappings = [(imported.address, imported.size) for imported in state.imports]
            spans = group_spans(layout, state.session.regions, mappings, blocks_per_chunk=bpc)
            planned = state.spans[group] = (spans, layout.shard_bytes(bpc))
        return planned


def _add_by_runs(
    runs: ChunkRuns,
    spans: tuple[Span, ...],
    pieces: Iterable[tuple[tuple[int, int], list[int], list[int]]],
) -> None:
    """Add ``pieces`` (chunks of one group, ``spans``: each piece its chunks' ``(first
    sub-block, block count)``, block ids and shard addresses) to ``runs``, consecutive pieces
    alike as one ``add_alike``: one call per chunk (a store's) or per load cost more than
    the piece's own work."""
    alike: tuple[int, int] | None = None
    ids: list[int] = []
    addresses: list[int] = []
    for chunk, more_ids, more_addresses in pieces:
        if chunk != alike:
            if alike is not None:
                runs.add_alike(spans, ids, addresses, alike[0])
            alike, ids, addresses = chunk, [], []
        ids += more_ids
        addresses += more_addresses
    if alike is not None:
        runs.add_alike(spans, ids, addresses, alike[0])


def _write_pieces(
    writes: Sequence[ShardWrite],
    mine: Sequence[int],
    ranges: _Ranges,
    block_ids: list[int],
    arena_address: int,
) -> Iterator[tuple[tuple[int, int], list[int], list[int]]]:
    """A store's writes as ``_add_by_runs`` pieces, a chunk each."""
    chunks, firsts = ranges.chunks, ranges.firsts
    for write in writes:
        index = mine[write.index]
        chunk, start = chunks[index], firsts[index]
        yield chunk, block_ids[start : start + chunk[1]], [arena_address + write.offset]


def _load_pieces(
    requests: Sequence[Load], checked: Sequence[tuple[int, _Ranges, Reads]], addresses: list[int]
) -> Iterator[tuple[tuple[int, int], list[int], list[int]]]:
    """A step's checked Loads as ``_add_by_runs`` pieces, a run of chunks alike each."""
    at = 0
    for request, (_, ranges, _reads) in zip(requests, checked, strict=True):
        block_ids, firsts = request.block_ids, ranges.firsts
        for start, end, sub_block, count in ranges.alike:
            first = firsts[start]
            ids = block_ids[first : first + count * (end - start)]
            yield (sub_block, count), ids, addresses[at + start : at + end]
        at += len(request.keys)


def _last_event(requests: Sequence[Load]) -> bytes:
    """The CUDA event the last of ``requests`` that names one waits for ("" if none does)."""
    return next((request.wait_event for request in reversed(requests) if request.wait_event), b"")


# A checked Load's place in ``CacheRequests._loads``' outcomes until it is started.
_UNSTARTED = Exception("not started")
# The outcome of a step's Load started with others (``_start_loads``): its JobDone is its only
# answer, as for any job of a StepJobs, so no reply of its own is made.
_STARTED_TOGETHER = Accepted(Ok(0, 0))


class _Ranges(NamedTuple):
    """Each key's chunk ``(first_sub_block, count)`` (``chunk_ranges``) and the index of its
    first block id in the request's; ``alike``: the runs of consecutive keys whose chunks
    are alike, each ``(first key, end key, first_sub_block, count)``."""

    chunks: Sequence[tuple[int, int]]
    firsts: Sequence[int]
    alike: Sequence[tuple[int, int, int, int]]


_SHAPE_CACHE_KEYS = 32  # jobs of up to this many keys have their ranges kept per shape


def _ranges(
    num_keys: int, num_blocks: int, bpc: int, segments: tuple[Segment, ...], skip: int
) -> _Ranges:
    """``_Ranges`` of a request of this shape (ValueError for one that does not add up):
    kept per shape for jobs of a few keys, whose shapes a step repeats (6.8 -> 1.4 us per
    load of 2 keys), worked out each time for longer ones (the cache stays small)."""
    if num_keys <= _SHAPE_CACHE_KEYS:
        return _cached_shape_ranges(num_keys, num_blocks, bpc, segments, skip)
    return _shape_ranges(num_keys, num_blocks, bpc, segments, skip)


def _shape_ranges(
    num_keys: int, num_blocks: int, bpc: int, segments: tuple[Segment, ...], skip: int
) -> _Ranges:
    wire = [(s.keys, s.skip, s.blocks) for s in segments]
    chunks = tuple(chunk_ranges(num_keys, num_blocks, bpc, wire, skip=skip))
    firsts = tuple(accumulate((count for _, count in chunks[:-1]), initial=0)) if chunks else ()
    alike = []
    start = 0
    for chunk, run in groupby(chunks):
        length = len(list(run))
        alike.append((start, start + length, *chunk))
        start += length
    return _Ranges(chunks, firsts, tuple(alike))  # tuples: a cached value is shared


# A bad shape raises again each time: lru_cache keeps results only.
_cached_shape_ranges = functools.lru_cache(maxsize=512)(_shape_ranges)

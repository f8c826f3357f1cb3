"""The rank side: vLLM's ``OffloadingWorker`` over the daemon, one per GPU worker.

Contract with vLLM 0.33 (``OffloadingConnectorWorker``):
- ``submit_store`` / ``submit_load`` return True (vLLM asserts it) and send nothing: the job
  joins the step's ``StepJobs``. vLLM submits a step's jobs one call at a time and its
  interface says nothing when the last one is in, so ``step_hook`` (installed by the spec's
  ``get_worker``) calls ``send_step`` once they are: after ``handle_preemptions`` in a step
  without loads (before the forward pass), else after ``start_kv_transfers``: methods of the
  one calling ``OffloadingConnectorWorker`` instance, wrapped, not vLLM's classes, nor
  ``get_kv_transfer_group()`` (unset in some processes, a ``MultiConnector`` when connectors
  are combined); see docs/decisions.md. The step's jobs also leave at the next call that needs
  them sent: ``wait`` (synchronous loads, flushed stores) and ``get_finished`` (after the
  forward pass; all that is left to send where the hook could not be installed). One message
  per rank per step, whatever the batch, and no round trip: the daemon answers each job with
  its ``JobDone`` notice, read without waiting.
- ``get_finished`` never blocks (a non-blocking poll); ``wait`` blocks until the jobs finish.
- A store that the daemon could not complete is harmless (the chunk is just not cached), so it
  is reported as done. A load the daemon answers as failed (keys gone, refused) is reported
  to vLLM as a load error (``offloadd.vllm.load_failures``), so the scheduler recomputes the
  request (``kv_load_failure_policy="recompute"``) or fails it alone ("fail"), and counted
  (``load_failures.count``); the engine runs on. The worker raises ``LoadFailed`` rather than
  let the engine run on KV never loaded only where vLLM cannot be told (the connector's
  methods not found, or a synchronous load with several KV cache groups), and for a load
  still unanswered after ``offloadd_load_timeout`` (a daemon that resumed later would copy
  into blocks given to another request by then).
- A store the daemon does not answer is given up (done, nothing cached) once its deadline,
  ``offloadd_store_timeout`` after its submit, has passed: the Store carries that deadline
  and the daemon neither starts nor commits it past it, so the blocks go back to vLLM safe
  even from a frozen daemon that resumes later. Only when the Welcome said the daemon reads
  the rank's clock (``shared_clock``); else no deadline is sent and a store is given up after
  ``offloadd_load_timeout`` (docs/design.md says why that is unsafe, and rare).
- A daemon that is away (killed, restarting, stopped) fails no load: a load that could not be
  sent, or whose session the daemon lost, waits for the daemon to answer again (at most
  ``offloadd_load_timeout`` from its submit), says Hello again and is sent again by key
  (the new daemon restored its arena; the old session's hold is gone). Only keys that are
  gone by then fail it. No call waits on the daemon longer than ``STEP_TIMEOUT_SECONDS``
  inside a step (``wait`` excepted), and while it is away nothing is asked of it but one
  ``PROBE_TIMEOUT_SECONDS`` ping every ``KEEPALIVE_SECONDS``. It counts as away after a
  failed exchange until it is back (a message from it read, or, where it could not be
  reached, a connection again: then the rank says Hello at once), ``AWAY_SECONDS`` at
  most. A daemon that is stopping
  (``SHUTTING_DOWN``: a planned restart) counts as away: its refused loads wait for the next
  one, its refused stores are done (nothing cached). A step that sends its jobs
  pings not: the daemon's answer to the ``StepJobs`` proves the session (a ping goes only
  once an answer is ``KEEPALIVE_SECONDS`` late, or the daemon said it forgot the session).
  An idle rank (an engine without requests calls nothing) proves its session once a second
  from the rank's ``SessionLink`` thread (``offloadd.vllm.link``: also its heartbeat, and a
  session again by the link's policy where there was none), never during one of vLLM's
  calls: a restarted daemon hears every rank again at once (its engine, and so the
  scheduler's mirror, waits for them).

Ordering against the GPU: on CUDA every store and load carries an interprocess event recorded
on the current stream, and the daemon's copy waits for it; CPU tensors need no event (the
forward pass has finished writing when vLLM submits).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from offloadd.client import SESSION_LOST, OffloadClient
from offloadd.errors import (
    DaemonUnavailable,
    JobError,
    NotPermitted,
    NotReady,
    OffloaddError,
    RequestFailed,
)
from offloadd.logs import LogLimiter
from offloadd.vllm.link import SessionLink
from offloadd.vllm.load_failures import LoadFailures
from offloadd.vllm.regions import kv_regions, open_region_files
from offloadd.vllm.transfer_specs import OffloaddLoadSpec, OffloaddStoreSpec
from protocol.config import OffloadingConfig
from protocol.errors import ErrorCode
from protocol.handles import KVRegion
from protocol.messages import JobDone, Load, Segment, Store

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")

KEEPALIVE_SECONDS = 1.0  # how often an idle or waiting rank proves its session
AWAY_SECONDS = 1.0  # after a failure, asked nothing at most this long (``_away``)
STEP_TIMEOUT_SECONDS = 0.3  # an exchange inside a step waits at most this long
PROBE_TIMEOUT_SECONDS = 0.2  # a ping to a daemon that may be away
RESEND_POLL_SECONDS = 0.05  # wait(): between tries to resend loads the daemon refused
# What ends a rank's note that its daemon is away before ``AWAY_SECONDS`` (``_away``).
_BackWhen = Literal["heard", "connected", "timer"]


class LoadFailed(RuntimeError):
    """A KV load could not be completed; vLLM must not compute on those blocks."""


@dataclass
class _Job:
    load: bool
    started: float
    event: Any = None  # the CUDA event the daemon waits on, kept alive until the job ends
    # A load: what to send again by key if the daemon loses it (keys, block ids, segments).
    redo: tuple[list[bytes], list[int], list[Segment]] | None = None
    sent: bool = True  # False: waiting for the daemon to answer, then sent by key
    request: str = ""  # a load: vLLM's request id (a failure is reported for it)
    expedited: bool = False  # a load vLLM waits for in this step (synchronous)
    # A store's Store.deadline (time.monotonic(); 0: none, the daemon's clock is not ours):
    # given up once past it, never before (the daemon commits nothing copied past it).
    deadline: float = 0.0


def segments_for(
    keys: Sequence[bytes], gpu: GPULoadStoreSpec, blocks_per_chunk: int, group_ids: Sequence[int]
) -> list[Segment]:
    """The wire segments of one job: per group, its keys and its blocks from ``gpu``.

    vLLM lists keys group-major in config order; group ``g`` has ``group_sizes[g]`` blocks
    starting at sub-block ``block_indices[g] % blocks_per_chunk`` of its first chunk.
    """
    segments: list[Segment] = []
    position = 0
    for group_id, size, index in zip(group_ids, gpu.group_sizes, gpu.block_indices, strict=True):
        if size == 0:
            continue
        skip = index % blocks_per_chunk
        count = -(-(skip + size) // blocks_per_chunk)
        names = {int.from_bytes(key[-4:], "big") for key in keys[position : position + count]}
        if len(keys) < position + count or names != {group_id}:
            raise ValueError(
                f"group {group_id}: {size} blocks from sub-block {skip} need {count} keys of "
                f"that group at position {position}; the keys name groups {sorted(names)}"
            )
        segments.append(Segment(count, skip, int(size)))
        position += count
    if position != len(keys):
        raise ValueError(f"{len(keys)} keys for blocks that fill {position} chunks")
    return segments


def without_skipped(
    keys: Sequence[bytes],
    block_ids: Sequence[int],
    segments: Sequence[Segment],
    blocks_per_chunk: int,
    skipped: Collection[int],
) -> tuple[list[bytes], list[int], list[Segment]]:
    """A store's keys, block ids and segments without the keys at the ``skipped`` positions
    (their chunks got no room in the daemon): a segment with a hole splits in two."""
    out_keys: list[bytes] = []
    out_blocks: list[int] = []
    out: list[Segment] = []
    position = first_block = 0
    for segment in segments:
        remaining = segment.blocks
        run: list[int] | None = None  # [keys, skip, blocks] of the segment being built
        for index in range(segment.keys):
            start = segment.skip if index == 0 else 0
            count = min(blocks_per_chunk - start, remaining)
            remaining -= count
            if position + index in skipped:
                if run is not None:
                    out.append(Segment(*run))
                    run = None
            else:
                out_keys.append(keys[position + index])
                out_blocks.extend(block_ids[first_block : first_block + count])
                if run is None:
                    run = [0, start, 0]
                run[0] += 1
                run[2] += count
            first_block += count
        if run is not None:
            out.append(Segment(*run))
        position += segment.keys
    return out_keys, out_blocks, out


def _taking_turns(
    method: Callable[Concatenate[OffloaddWorker, _P], _R],
) -> Callable[Concatenate[OffloaddWorker, _P], _R]:
    """vLLM's call, holding the worker's lock (the link's thread waits its turn)."""

    @functools.wraps(method)
    def taking_turns(self: OffloaddWorker, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            try:
                return method(self, *args, **kwargs)
            finally:
                self._called = time.monotonic()

    return taking_turns


class OffloaddWorker(OffloadingWorker):
    """vLLM's rank-side worker backed by offloadd; see the module docstring."""

    def __init__(
        self,
        config: OffloadingConfig,
        kv_caches: Any,
        *,
        endpoint: str,
        optional: bool,
        load_timeout: float = 60.0,
        timeout: float = 10.0,
        store_timeout: float = 10.0,
        load_wait: float = 0.0,
    ) -> None:
        self._config = config
        self._endpoint = endpoint
        self._bpc = config.cache.blocks_per_chunk
        self._group_ids = config.group_ids()
        self._regions: list[KVRegion] = kv_regions(
            kv_caches, config.groups, canonical=config.canonical_layout
        )
        # CPU tensors: their files, opened here (the rank owns them) and passed to the daemon
        # as descriptors; kept for a reconnect.
        self._files = open_region_files(self._regions)
        self._cuda = any(t.tensor.is_cuda for t in kv_caches.tensors)
        self._device = next((t.tensor.device for t in kv_caches.tensors if t.tensor.is_cuda), None)
        self._load_timeout = load_timeout
        self._store_timeout = store_timeout
        self._load_wait = load_wait  # get_finished waits this long for a step's loads
        self._warn_given_up = LogLimiter(logger)  # a frozen daemon gives up every store
        self._warn_load_failed = LogLimiter(logger)  # a daemon that lost its arena fails many
        self.load_failures = LoadFailures()  # reported to vLLM by step_hook's wrappers
        self._jobs: dict[int, _Job] = {}
        self._step: list[Store | Load] = []  # this step's jobs, sent together by _flush
        self._posted = False  # this step's jobs went out (get_finished then pings not)
        self._results: list[TransferResult] = []
        self._checked = time.monotonic()  # the last proof of the session (_tend)
        self._away_until = 0.0  # the daemon did not answer: not asked again before this
        self._away_since = 0.0  # when it was noted away
        self._back_when: _BackWhen = "timer"  # ... and what ends that earlier (``_away``)
        self.loads_resent = 0  # loads sent again by key to a daemon that came back
        self.stores_given_up = 0  # stores reported done unanswered, past their bound
        self.stores_unsent = 0  # stores reported done without being sent (no daemon)
        self.keys_not_stored = 0  # keys of finished stores the daemon did not store
        # vLLM's calls and the link's thread take turns on the client (one at a time).
        self._link = SessionLink(endpoint, f"rank {config.parallel.rank}", tick=KEEPALIVE_SECONDS)
        self._lock = self._link.lock
        self._called = time.monotonic()  # the end of vLLM's latest call
        self.idle_messages = 0  # sent by the link's thread, none of a step's
        self._client: OffloadClient | None = None
        try:
            self._client = self._connect(timeout)
        except DaemonUnavailable:
            if not optional:
                raise DaemonUnavailable(
                    f"offloadd: no daemon answers at {endpoint} (rank "
                    f"{config.parallel.rank}); start it, point offloadd_endpoint at it, or set "
                    '"offloadd_optional": true'
                ) from None
            logger.warning("offloadd: no daemon at %s; rank runs without offload", endpoint)
        self._link.start(
            client=lambda: self._client,
            connect=self._connect,
            adopt=self._adopt,
            idle=self._keep_idle_session,
        )

    # -- vLLM's interface --------------------------------------------------------------------

    @_taking_turns
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Send the store of the keys the daemon reserved; a store that cannot be sent, or
        of no such key, is reported done (nothing cached)."""
        assert isinstance(dst_spec, OffloaddStoreSpec)
        client = self._connected()
        skipped = dst_spec.skipped
        if client is None or len(skipped) >= len(dst_spec.keys) or self._away():
            if len(skipped) < len(dst_spec.keys):  # keys the scheduler reserved: lost
                self.stores_unsent += 1
            self._results.append(TransferResult(job_id, True))
            return True
        segments = segments_for(dst_spec.keys, src_spec, self._bpc, self._group_ids)
        keys, block_ids = list(dst_spec.keys), src_spec.block_ids.tolist()
        if skipped:
            keys, block_ids, segments = without_skipped(
                keys, block_ids, segments, self._bpc, skipped
            )
        job = _Job(load=False, started=time.perf_counter())
        welcome = client.welcome
        if welcome is not None and welcome.shared_clock:
            job.deadline = time.monotonic() + self._store_timeout
        wait_event, job.event = self._record_event()
        store = Store(
            0, job_id, keys, block_ids, wait_event, segments, True, job.deadline, *dst_spec.reserve
        )
        self._step.append(store)
        self._jobs[job_id] = job
        return True

    @_taking_turns
    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Send the load of the keys the scheduler holds; raises LoadFailed if it cannot."""
        assert isinstance(src_spec, OffloaddLoadSpec)
        segments = segments_for(src_spec.keys, dst_spec, self._bpc, self._group_ids)
        job = _Job(load=True, started=time.perf_counter())
        job.request, job.expedited = src_spec.hold, expedited
        job.redo = (list(src_spec.keys), dst_spec.block_ids.tolist(), segments)
        client = self._connected()
        if client is None:
            self._results.append(self._load_failed(job_id, job, f"no daemon at {self._endpoint}"))
            return True
        self._jobs[job_id] = job
        if self._away():
            job.sent = False
            return True
        wait_event, job.event = self._record_event()
        keys, block_ids = job.redo[0], job.redo[1]
        self._step.append(Load(0, job_id, keys, block_ids, 0, wait_event, segments, src_spec.hold))
        return True

    @_taking_turns
    def send_step(self) -> None:
        """vLLM's last submission of the step is in (``step_hook``): send the step's jobs."""
        client = self._connected()
        if client is not None:
            self._flush(client)

    @_taking_turns
    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call; never blocks. Sends the step's jobs not sent."""
        client = self._connected()
        if client is not None:
            self._flush(client)
            if self._jobs:
                try:
                    client.poll(0)
                    self._await_new_loads(client)
                except OffloaddError as exc:
                    logger.warning("offloadd: poll failed: %s", exc)
                self._collect(client)
            posted, self._posted = self._posted, False
            self._tend(client, posted=posted)
        results, self._results = self._results, []
        return results

    def _await_new_loads(self, client: OffloadClient) -> None:
        """Wait until the loads sent in the last ``offloadd_load_wait_ms`` are answered, or
        that bound from the newest one's submit has passed (see ``offloadd.vllm.spec``)."""
        if not self._load_wait:
            return
        finished = client.finished
        while True:
            newest = max(
                (
                    job.started
                    for job_id, job in self._jobs.items()
                    if job.load and job.sent and job_id not in finished
                ),
                default=None,
            )
            left = 0.0 if newest is None else newest + self._load_wait - time.perf_counter()
            if left <= 0:
                return
            client.poll(max(left, 0.001))  # zmq waits whole milliseconds

    @_taking_turns
    def wait(self, job_ids: set[int]) -> None:
        """Block until ``job_ids`` are finished (their results still come from get_finished)."""
        client = self._connected()
        if client is None:
            return
        self._flush(client)
        # Ends: each job finishes, or _collect gives it up (stores) or raises (loads) past
        # its load timeout.
        while pending := [job_id for job_id in job_ids if job_id in self._jobs]:
            sent = [job_id for job_id in pending if self._jobs[job_id].sent]
            if sent:
                # JobError: not all finished yet (or the daemon is away): tended below.
                with contextlib.suppress(JobError):
                    client.wait(sent, KEEPALIVE_SECONDS, raise_on_failure=False)
            else:
                client.poll(RESEND_POLL_SECONDS)
            self._collect(client)
            if all(job_id not in self._jobs for job_id in pending):
                break
            self._tend(client, now=True)

    def shutdown(self) -> None:
        """Stop the link's thread, then end the session (taking turns with vLLM's calls)."""
        self._link.close()
        with self._lock:
            client, self._client = self._client, None
            if client is not None:
                client.close()
            files, self._files = self._files, {}
            for fd in files.values():
                os.close(fd)

    # -- internals -------------------------------------------------------------------------

    def _connect(self, timeout: float) -> OffloadClient:
        device_uuid = ""
        if self._device is not None:
            from offloadd.cuda_ipc import device_uuid as uuid_of

            device_uuid = uuid_of(self._device.index or 0)
        client = OffloadClient.connect(
            self._endpoint,
            self._config,
            self._regions,
            device_uuid=device_uuid,
            name=f"vllm rank {self._config.parallel.rank}",
            mirror=True,  # this engine's scheduler publishes its events
            timeout=timeout,
            heartbeat=0,  # the link sends them
            files=self._files,
        )
        client.timeout = min(timeout, STEP_TIMEOUT_SECONDS)  # asked inside vLLM's steps
        return client

    def _adopt(self, client: OffloadClient) -> bool:
        """Under the lock: the link's session (an optional daemon that was not there at
        start)."""
        if self._client is not None:
            return False
        self._client = client
        return True

    def _keep_idle_session(self) -> None:
        """The link's idle work, under the lock: a rank vLLM has not called for a second
        proves its session, saying Hello again to a daemon that restarted: the engine
        there, and so its scheduler's mirror, waits for every rank's Hello, and an engine
        without requests calls nothing. What that does to jobs in flight (a lost session
        fails them) waits for vLLM's next call (``_tend`` sends loads again, ``_collect``
        reports)."""
        client = self._client
        clock = time.monotonic()
        if client is None or clock - max(self._called, self._checked) < KEEPALIVE_SECONDS:
            return
        self._checked = clock
        sent = client.sent
        try:
            client.keepalive(PROBE_TIMEOUT_SECONDS)
        except OffloaddError as exc:
            # Not noted as away: a busy daemon's late answer must not skip the next step's
            # stores; vLLM's own calls decide that (and raise a refusal that matters).
            logger.debug("offloadd: rank %d keepalive: %s", self._config.parallel.rank, exc)
        else:
            self._away_until = 0.0
        finally:
            self.idle_messages += client.sent - sent

    def _away(self) -> bool:
        """Noted away (``_note_failure``) and not back: a daemon that did not answer is back
        once a message from it is read (a late answer shows it busy, not frozen); one that
        could not be reached, once the rank is connected to it again (a restarted daemon,
        within zmq's reconnect interval of its start); one that is stopping, when the
        timer ends. A daemon that is back gets the next step's stores."""
        if time.monotonic() >= self._away_until:
            return False
        client = self._client
        if client is None or self._back_when == "timer":
            return True
        if self._back_when == "heard":
            with contextlib.suppress(OffloaddError):
                client.poll(0)  # a late answer waiting here
            back = client.heard_at > self._away_since
        else:
            back = client.can_send()
            if back:  # most likely a new daemon: its engine waits for this rank's Hello
                self._checked = 0.0  # so the session is proved at the next ``_tend``
        if back:
            self._away_until = 0.0
        return not back

    def _note_failure(self, exc: Exception) -> None:
        """After a daemon that did not answer, could not be reached, or is stopping, ask
        nothing of it until it is back (``_away``), ``AWAY_SECONDS`` at most."""
        if not (isinstance(exc, DaemonUnavailable) or _stopping(exc)):
            return
        self._away_since = clock = time.monotonic()
        self._away_until = clock + AWAY_SECONDS
        self._checked = clock
        client = self._client
        if _stopping(exc) or client is None:
            self._back_when = "timer"  # it answers, refusing: its messages say nothing
        else:
            self._back_when = "heard" if client.can_send() else "connected"

    def _flush(self, client: OffloadClient) -> None:
        """Send the step's jobs in one StepJobs; if no daemon takes it, its stores are done
        (nothing cached) and its loads wait for the daemon."""
        staged, self._step = self._step, []
        if not staged:
            return
        try:
            client.post_jobs(staged)
        except OffloaddError as exc:
            logger.warning("offloadd: %d jobs of the step not sent: %s", len(staged), exc)
            self._note_failure(exc)
            for spec in staged:
                job = self._jobs[spec.job_id]
                if job.load:
                    job.sent = False
                else:
                    del self._jobs[spec.job_id]
                    self.stores_unsent += 1
                    self._results.append(TransferResult(spec.job_id, True))
            return
        self._posted = True

    def _tend(self, client: OffloadClient, *, now: bool = False, posted: bool = False) -> None:
        """Every ``KEEPALIVE_SECONDS`` (or ``now``): prove the session, so that a restarted
        daemon hears this rank again (its engine is ready again only once every rank said
        Hello), and send the loads waiting for it, by key. ``posted``: this step sent its
        jobs; their answer proves the session unless it is ``KEEPALIVE_SECONDS`` late."""
        clock = time.monotonic()
        self._checked = max(self._checked, client.answered_at)
        if posted and not now and not client.session_lost:
            late = client.unanswered_since
            if late is None or clock - late < KEEPALIVE_SECONDS:
                return
        now = now or client.session_lost
        if self._away():
            return
        waiting = any(not job.sent for job in self._jobs.values())
        if not (now or waiting) and clock - self._checked < KEEPALIVE_SECONDS:
            return
        if waiting and not now and clock - self._checked < 0.1:
            return
        self._checked = clock
        try:
            client.keepalive(PROBE_TIMEOUT_SECONDS)
        except (DaemonUnavailable, NotReady, NotPermitted) as exc:
            self._note_failure(exc)
            return
        except RequestFailed as exc:
            if not _stopping(exc):  # a stopping daemon refused the Hello: wait for the next
                raise
            self._note_failure(exc)
            return
        self._away_until = 0.0
        self._collect(client)  # the lost session's jobs, recorded failed by the keepalive
        for job_id, job in list(self._jobs.items()):
            if job.sent or job.redo is None:
                continue
            keys, block_ids, segments = job.redo
            wait_event, job.event = self._record_event()
            try:
                client.load(job_id, keys, block_ids, segments=segments, wait_event=wait_event)
            except (DaemonUnavailable, NotReady) as exc:
                self._note_failure(exc)
                return
            except OffloaddError as exc:
                if _stopping(exc):  # sent again to the daemon that comes after it
                    self._note_failure(exc)
                    return
                del self._jobs[job_id]
                self._results.append(self._load_failed(job_id, job, f"refused again: {exc}"))
                continue
            job.sent = True
            self.loads_resent += 1
            logger.info(
                "offloadd: rank %d: load job %d sent again by key (%d keys)",
                self._config.parallel.rank,
                job_id,
                len(keys),
            )

    def _connected(self) -> OffloadClient | None:
        return self._client  # under the lock: vLLM's calls take turns with the link's thread

    def _record_event(self) -> tuple[bytes, Any]:
        """An interprocess CUDA event after the current stream's work, for the daemon to wait
        on; nothing on CPU."""
        if not self._cuda:
            return b"", None
        import torch

        event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        return bytes(event.ipc_handle()), event  # type: ignore[no-untyped-call]

    def _collect(self, client: OffloadClient) -> None:
        now, clock = time.perf_counter(), time.monotonic()
        for job_id, job in list(self._jobs.items()):
            done = client.finished.get(job_id) if job.sent else None
            if done is not None and job.load and not done.ok and _retry(done):
                # The daemon that took it is gone (or its engine waits for ranks again):
                # sent again by key once one answers.
                del client.finished[job_id]
                job.sent = False
                done = None
            if done is None:
                if job.deadline:
                    # Past its deadline the daemon commits none of its bytes: the blocks are
                    # vLLM's again, whatever the daemon does with the copy later.
                    if clock <= job.deadline:
                        continue
                elif now - job.started <= self._load_timeout:
                    continue
                if job.load:
                    # Not reported for recompute: a daemon that resumes later would still
                    # copy into blocks vLLM has given to another request by then.
                    raise LoadFailed(
                        f"offloadd: load job {job_id} did not finish within "
                        f"{self._load_timeout:.0f}s (daemon at {self._endpoint} gone?)"
                    )
                # A store that never ends (the daemon went away or froze) must not hold the
                # blocks: vLLM gets it back as done, nothing was cached.
                bound = "offloadd_store_timeout" if job.deadline else "offloadd_load_timeout"
                self._warn_given_up(
                    logging.WARNING,
                    "offloadd: store job %d to the daemon at %s not done within %s=%gs; "
                    "given up (nothing cached)",
                    job_id,
                    self._endpoint,
                    bound,
                    self._store_timeout if job.deadline else self._load_timeout,
                )
                self.stores_given_up += 1
                done = JobDone(job_id, False, [], 0, 0.0, "timed out")
            del self._jobs[job_id]
            self._results.append(self._result(job_id, job, done))

    def _result(self, job_id: int, job: _Job, done: JobDone) -> TransferResult:
        if done.code == ErrorCode.SHUTTING_DOWN and not job.load:
            logger.debug("offloadd: store job %d not taken: the daemon is stopping", job_id)
        elif done.code == ErrorCode.DEADLINE_PASSED:  # a late daemon: nothing cached, no harm
            logger.debug("offloadd: store job %d not taken: %s", job_id, done.error)
        elif done.code:
            logger.warning(
                "offloadd: %s job %d refused: %s",
                "load" if job.load else "store",
                job_id,
                done.error,
            )
        if job.load and not done.ok:
            why = f"{done.error or 'keys missing'}, {len(done.failed_keys)} keys"
            return self._load_failed(job_id, job, why)
        if not done.ok:
            self.keys_not_stored += len(done.failed_keys)
            logger.debug("offloadd: store job %d stored part: %s", job_id, done.error)
        return TransferResult(job_id, True, done.nbytes, done.seconds)

    def _load_failed(self, job_id: int, job: _Job, why: str) -> TransferResult:
        """A load that cannot be served: reported to vLLM to recompute its request (a
        finished transfer here, its failure through ``load_failures``); raises
        ``LoadFailed`` where vLLM cannot be told."""
        failures = self.load_failures
        if not failures.can_report(job.expedited):
            raise LoadFailed(
                f"offloadd: load job {job_id} failed ({why}); vLLM cannot be told here, and "
                "the engine must not run on KV that was not loaded"
            )
        assert job.redo is not None
        failures.failed(job.request, job.redo[1], expedited=job.expedited)
        self._warn_load_failed(
            logging.WARNING,
            "offloadd: load job %d of request %s failed (%s); vLLM recomputes it "
            "(%d loads failed so far)",
            job_id,
            job.request,
            why,
            failures.count,
        )
        return TransferResult(job_id, True)


def _retry(done: JobDone) -> bool:
    """A failed load to send again by key: its session was lost, its engine was not ready
    (a daemon restarted and not every rank said Hello yet), or the daemon is stopping (the
    next one takes it)."""
    return done.error == SESSION_LOST or done.code in _RETRIED


_RETRIED = frozenset({ErrorCode.ENGINE_NOT_READY, ErrorCode.SHUTTING_DOWN})


def _stopping(exc: Exception) -> bool:
    """The daemon refused because it is stopping (a planned restart): like one away."""
    return isinstance(exc, RequestFailed) and exc.code == ErrorCode.SHUTTING_DOWN

"""The cuda copy engine: batched DMA between ranks' GPU memory and the host arena.

It implements the ``CopyEngine`` contract of ``offloadd.transfer.engine`` for triples whose
one side is device memory (a rank's KV tensor imported over CUDA IPC) and the other host
memory (the arena: pinned when ``offloadd.transfer.pinning`` could register it, pageable
otherwise, which is correct but slower).

Per job (``submit(direction, moves, *, device, wait_event=None)``; ``submit`` takes
ownership of ``moves``, which the caller must not change afterwards):
- The job runs on the daemon-owned stream of its lane, ``(device, direction)``: one stream,
  one issuing thread and one completion thread per lane, created on first use. ``device``
  is the rank's *local* ordinal (``Import.device``).
- ``wait_event``, when given (stores and loads alike), is a CUDA IPC event handle (64 bytes
  of ``torch.cuda.Event(interprocess=True).ipc_handle()``) that the rank recorded on its
  compute stream: the lane's stream waits for it before copying, so a store never reads KV
  the model has not finished writing, and a load never overwrites blocks the model still
  reads. The wait covers the event's latest record when the job is issued, so a rank may
  re-record one event every step. The rank-side alternative is to synchronize its compute
  stream before sending the request; then no event is needed.
- The copies of a job are ONE driver call: ``offloadd.transfer.batch`` builds the address
  arrays with numpy (merging neighbours contiguous on both sides, never across a cut between
  the arena's pinned pieces, ``host_pieces``) and calls ``cuMemcpyBatchAsync`` through
  ctypes. On a driver without it (before CUDA 12.8), or one that answers "not supported",
  each merged copy is one ``cuMemcpyAsync``: the engine then reports ``batched`` False and
  says so in an error log line, since it is several times slower for small blocks.
- Start and end events (timing enabled, blocking sync) bracket the copies. The lane's
  completion thread blocks in ``end.synchronize()`` (the thread sleeps; no polling) and
  resolves the job's future the moment the copy ends, with the elapsed seconds or the error.

Ordering: jobs of one lane run and complete in submission order (one stream; the completion
thread resolves them strictly in order, a failed job included). Lanes are independent, so
the FIFO per direction of the contract holds per device, and different GPUs never wait for
each other. Loads and stores run on separate streams and may overlap.

What moves: the engine only sees absolute ``(src, dst, nbytes)`` triples; which bytes those
are is ``offloadd.transfer.plan``'s business (the unpadded page of each block, at the padded
block stride; packed and unpacked layouts are both just regions there).

``close()`` waits until every submitted job has completed and been resolved, then stops the
threads and drops the streams.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from offloadd.transfer import libcuda
from offloadd.transfer.batch import (
    CUDA_ERROR_NOT_SUPPORTED,
    BatchCopier,
    HostPieces,
    move_arrays,
)
from offloadd.transfer.types import Direction, MoveArrays, Triple

logger = logging.getLogger(__name__)

_IPC_EVENT_CACHE = 256
PER_COPY = "cuMemcpyAsync per copy"


class Backend(Protocol):
    """What the engine needs from CUDA; ``TorchCudaBackend`` in the daemon, fakes in tests.

    Streams need ``wait_event(event)``; events need ``record(stream)``, ``synchronize()``
    (blocks the calling thread until the event completed; raises on a device error) and
    ``elapsed_time(end) -> milliseconds`` (torch's ``Stream`` and ``Event`` have them).
    """

    @property
    def name(self) -> str:
        """How copies are issued, for logs and status."""
        ...

    @property
    def batched(self) -> bool:
        """Whether a job's copies are one batched driver call (the fast path)."""
        ...

    def bind_thread(self, device: int) -> None:
        """Make ``device`` current in the calling thread."""
        ...

    def stream(self, device: int) -> Any:
        """A new non-default stream on ``device`` (called on the lane's thread)."""
        ...

    def timing_event(self, device: int) -> Any:
        """A new event with timing enabled whose ``synchronize`` sleeps, not spins."""
        ...

    def ipc_event(self, device: int, handle: bytes) -> Any:
        """The interprocess event a rank exported as ``handle``."""
        ...

    def copy(self, stream: Any, direction: Direction, arrays: MoveArrays) -> None:
        """Enqueue the copies on ``stream``; raises if the driver refuses them."""
        ...


class CudaCopyError(RuntimeError):
    """The driver refused a copy; the message names the call and the error."""


def _torch() -> Any:
    import torch

    return torch


class _LoopCopier:
    """One ``cuMemcpyAsync`` per merged copy (drivers without the batch API)."""

    def __init__(self, driver: libcuda.LibCuda) -> None:
        self._driver = driver

    def copy(self, stream: int, arrays: MoveArrays) -> None:
        """Enqueue each copy; stops at the first refusal."""
        memcpy = self._driver.memcpy_async
        for index, (src, dst, nbytes) in enumerate(arrays.triples()):
            code = memcpy(dst, src, nbytes, stream)
            if code != libcuda.CUDA_SUCCESS:
                raise CudaCopyError(
                    f"cuMemcpyAsync of copy {index} ({nbytes} bytes {src:#x} -> {dst:#x}) "
                    f"failed: {self._driver.error_name(code)}"
                )


class TorchCudaBackend:
    """Streams and events from torch; copies through the driver library with ctypes."""

    def __init__(
        self, *, batch: bool = True, torch: Any = None, driver: libcuda.LibCuda | None = None
    ) -> None:
        torch = torch if torch is not None else _torch()
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda copy engine needs a CUDA device, and torch sees none")
        torch.cuda.init()
        driver = driver if driver is not None else libcuda.load()
        if driver is None:
            raise RuntimeError("libcuda.so.1 (the NVIDIA driver library) cannot be loaded")
        self._torch = torch
        self._driver = driver
        self._loop = _LoopCopier(driver)
        self._batch = BatchCopier.resolve(driver.lib) if batch else None
        self._lock = threading.Lock()
        self.degraded = ""  # why copies are not batched ("" while they are)
        if not batch:
            self.degraded = "batching turned off (make_engine(batch=False))"
            logger.info("cuda copies: %s, as asked", PER_COPY)
        elif self._batch is None:
            self._give_up_batching(
                "the driver has no cuMemcpyBatchAsync (it needs a CUDA 12.8 or newer driver)"
            )

    @property
    def name(self) -> str:
        """The copy path in use."""
        batch = self._batch
        return batch.name if batch is not None else PER_COPY

    @property
    def batched(self) -> bool:
        """Whether copies go out as one batch per job."""
        return self._batch is not None

    def bind_thread(self, device: int) -> None:
        """Make ``device``'s primary context current in the calling thread."""
        self._torch.cuda.set_device(device)
        # cudaSetDevice alone may defer creating the context; a stream query forces it.
        self._torch.cuda.current_stream(device).query()

    def stream(self, device: int) -> Any:
        """A pool stream of ``device`` (torch creates them non-blocking)."""
        return self._torch.cuda.Stream(device=device)

    def timing_event(self, device: int) -> Any:
        """An event with timing and blocking sync (its device is its stream's)."""
        return self._torch.cuda.Event(enable_timing=True, blocking=True)

    def ipc_event(self, device: int, handle: bytes) -> Any:
        """Open an interprocess event a rank exported."""
        return self._torch.cuda.Event.from_ipc_handle(self._torch.device("cuda", device), handle)

    def copy(self, stream: Any, direction: Direction, arrays: MoveArrays) -> None:
        """One batched call, or the per-copy loop where batching is unavailable."""
        handle = int(stream.cuda_stream)
        batch = self._batch
        if batch is not None:
            code, failed = batch.copy(handle, direction, arrays)
            if code == libcuda.CUDA_SUCCESS:
                return
            if code != CUDA_ERROR_NOT_SUPPORTED:
                where = f" at copy {failed}" if failed is not None else ""
                raise CudaCopyError(
                    f"{batch.name} of {len(arrays)} copies failed{where}: "
                    f"{self._driver.error_name(code)}"
                )
            self._give_up_batching(f"{batch.name} answered CUDA_ERROR_NOT_SUPPORTED")
        self._loop.copy(handle, arrays)

    def _give_up_batching(self, reason: str) -> None:
        with self._lock:
            if self.degraded:
                return
            self._batch = None
            self.degraded = reason
        logger.error(
            "cuda copy path DEGRADED: %s; one cuMemcpyAsync per copy from now on, several "
            "times slower for small blocks. Update the NVIDIA driver to CUDA 12.8 or newer.",
            reason,
        )


# --- the engine ----------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    lane: _Lane
    future: Future[float]
    submitted: float = field(default_factory=time.perf_counter)
    issued: bool = False
    cancelled: bool = False
    start: Any = None
    end: Any = None
    waited: Any = None  # the rank's IPC event, kept until the job is done
    error: BaseException | None = None


@dataclass(eq=False)
class _Lane:
    device: int
    direction: Direction
    executor: ThreadPoolExecutor
    cond: threading.Condition = field(default_factory=threading.Condition)
    pending: deque[_Job] = field(default_factory=deque)
    stream: Any = None
    bound: bool = False  # the issuing thread has made its device current
    stopping: bool = False
    waiter: threading.Thread | None = None


class CudaCopyEngine:
    """CopyEngine for CUDA memory; see the module docstring for the guarantees."""

    name = "cuda"

    def __init__(self, backend: Backend | None = None, *, host_pieces: HostPieces | None = None):
        self._backend: Backend = backend if backend is not None else TorchCudaBackend()
        self._pieces = host_pieces
        self._lanes: dict[tuple[int, Direction], _Lane] = {}
        self._lanes_lock = threading.Lock()
        self._closed = False
        self._ipc_events: OrderedDict[tuple[int, bytes], Any] = OrderedDict()
        self._ipc_lock = threading.Lock()
        logger.info("cuda copy engine: %s", self._backend.name)

    @property
    def batched(self) -> bool:
        """Whether each job is one batched driver call (False: degraded, per-copy)."""
        return self._backend.batched

    @property
    def path(self) -> str:
        """How copies are issued, for status lines."""
        return self._backend.name

    def submit(
        self,
        direction: Direction,
        moves: Sequence[Triple],
        *,
        device: int = -1,
        wait_event: bytes | None = None,
    ) -> Future[float]:
        """Queue ``moves`` on lane ``(device, direction)``; the future gives the seconds."""
        if self._closed:
            raise RuntimeError("copy engine is closed")
        if device < 0:
            raise ValueError("the cuda engine needs the local device index of the rank's memory")
        future: Future[float] = Future()
        lane = self._lane(device, direction)
        job = _Job(lane, future)
        with lane.cond:
            lane.pending.append(job)
        try:
            lane.executor.submit(self._issue, job, moves, wait_event)
        except BaseException as exc:
            # Never leave a job the completion thread would wait for forever.
            job.error = exc
            with lane.cond:
                job.issued = True
                lane.cond.notify_all()
        return future

    def close(self) -> None:
        """Wait for every submitted job, then stop the threads; idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lanes_lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.executor.shutdown(wait=True)  # every job is issued after this
        for lane in lanes:
            with lane.cond:
                lane.stopping = True
                lane.cond.notify_all()
        for lane in lanes:
            if lane.waiter is not None:
                lane.waiter.join()
        with self._lanes_lock:
            self._lanes.clear()
        with self._ipc_lock:
            self._ipc_events.clear()

    # ----------------------------------------------------------------- issuing (lane threads)

    def _lane(self, device: int, direction: Direction) -> _Lane:
        key = (device, direction)
        with self._lanes_lock:
            lane = self._lanes.get(key)
            if lane is None:
                name = f"offloadd-cuda{device}-{direction.value}"
                lane = _Lane(device, direction, ThreadPoolExecutor(1, thread_name_prefix=name))
                lane.waiter = threading.Thread(
                    target=self._complete_lane, args=(lane,), name=f"{name}-done", daemon=True
                )
                lane.waiter.start()
                self._lanes[key] = lane
        return lane

    def _issue(self, job: _Job, moves: Sequence[Triple], wait_event: bytes | None) -> None:
        backend = self._backend
        lane = job.lane
        try:
            if not job.future.set_running_or_notify_cancel():
                job.cancelled = True
                return
            arrays = move_arrays(moves, lane.direction, self._pieces)
            if not lane.bound:
                backend.bind_thread(lane.device)
                lane.bound = True
            if lane.stream is None:
                lane.stream = backend.stream(lane.device)
            stream = lane.stream
            if wait_event:
                job.waited = self._ipc_event(lane.device, wait_event)
                stream.wait_event(job.waited)
            start = backend.timing_event(lane.device)
            end = backend.timing_event(lane.device)
            start.record(stream)
            job.start = start
            try:
                if len(arrays):
                    backend.copy(stream, lane.direction, arrays)
            finally:
                # Recorded even after a refused copy: the job is resolved only once what was
                # enqueued has finished, so its memory is never released under a copy.
                end.record(stream)
                job.end = end
        except BaseException as exc:
            job.error = exc
        finally:
            with lane.cond:
                job.issued = True
                lane.cond.notify_all()

    def _ipc_event(self, device: int, handle: bytes) -> Any:
        # A rank re-records one interprocess event, so the same handle comes back each step;
        # opening it once saves a cudaIpcOpenEventHandle per job.
        key = (device, bytes(handle))
        with self._ipc_lock:
            event = self._ipc_events.get(key)
            if event is not None:
                self._ipc_events.move_to_end(key)
                return event
        event = self._backend.ipc_event(device, bytes(handle))
        with self._ipc_lock:
            self._ipc_events[key] = event
            while len(self._ipc_events) > _IPC_EVENT_CACHE:
                self._ipc_events.popitem(last=False)
        return event

    # ----------------------------------------------------------------- completion (lane threads)

    def _complete_lane(self, lane: _Lane) -> None:
        """Resolve the lane's jobs in order, each the moment its end event completes."""
        bound = False
        while True:
            with lane.cond:
                while not (lane.pending and lane.pending[0].issued):
                    if lane.stopping and not lane.pending:
                        return
                    lane.cond.wait()
                job = lane.pending[0]
            if not bound and job.end is not None:
                # Once per thread, so the runtime never falls back to (and initialises a
                # context on) device 0 for this lane's synchronisations.
                with contextlib.suppress(Exception):
                    self._backend.bind_thread(lane.device)
                bound = True
            outcome = self._outcome(job)
            with lane.cond:
                lane.pending.popleft()
            self._resolve(job, *outcome)

    @staticmethod
    def _outcome(job: _Job) -> tuple[float, BaseException | None]:
        """(seconds, error) once the job's copies have finished; blocks until then."""
        if job.cancelled:
            return 0.0, None
        if job.end is None:
            return 0.0, job.error or RuntimeError("the copy was never issued")
        try:
            job.end.synchronize()
        except Exception as exc:
            return 0.0, exc
        if job.error is not None:
            return 0.0, job.error
        try:
            seconds = float(job.start.elapsed_time(job.end)) / 1000.0
        except Exception:
            seconds = time.perf_counter() - job.submitted
        return seconds, None

    @staticmethod
    def _resolve(job: _Job, seconds: float, error: BaseException | None) -> None:
        job.waited = None
        if job.cancelled:
            return
        with contextlib.suppress(InvalidStateError):
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(seconds)


def make_engine(*, batch: bool = True, host_pieces: HostPieces | None = None) -> CudaCopyEngine:
    """The engine the daemon runs with ``server.copy_engine = "cuda"``.

    Raises RuntimeError without a CUDA device. ``batch=False`` forces the per-copy path
    (for comparisons). ``host_pieces``: the arena's pinned pieces, never merged across.
    """
    return CudaCopyEngine(TorchCudaBackend(batch=batch), host_pieces=host_pieces)

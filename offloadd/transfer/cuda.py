"""The cuda copy engine: batched DMA between ranks' GPU memory and the host arena.

It implements the ``CopyEngine`` contract of ``offloadd.transfer.engine`` for triples whose
one side is device memory (a rank's KV tensor imported over CUDA IPC) and the other host
memory (the arena: pinned when ``offloadd.transfer.pinning`` could register it, pageable
otherwise, which is correct but slower).

Per job (``submit(direction, moves, *, device, wait_event=None)``):
- The job runs on the daemon-owned stream of its lane, ``(device, direction)``: one stream
  and one issuing thread per lane, created on first use. ``device`` is the rank's *local*
  ordinal (``Import.device``).
- ``wait_event``, when given, is a CUDA IPC event handle (64 bytes of
  ``torch.cuda.Event(interprocess=True).ipc_handle()``) that the rank recorded on its compute
  stream after writing the blocks: the lane's stream waits for it before copying, so a
  store never reads KV the model has not finished writing. The wait covers the event's
  latest record when the job is issued, so a rank may re-record one event every step (a
  newer record only makes the copy wait longer). The rank-side alternative is to
  synchronize the compute stream before sending ``Store``; then no event is needed.
- The copies of a job are ONE driver call: ``cudaMemcpyBatchAsync`` (cuda-python, CUDA
  >= 12.8) over src/dst/size arrays built once per job, with ``srcAccessOrder`` STREAM for
  stores (device -> host) and ANY for loads (host -> device; no earlier work on the stream
  touches the arena slot, which is committed before any load may read it). Without
  cuda-python, or on a driver without the batch API, each merged triple is one
  ``cuMemcpyAsync`` (logged once as the slower path).
- Start and end events (timing enabled) bracket the copies; a single poller thread polls
  ``end.query()`` (never on the asyncio loop) and resolves the job's future with the
  elapsed seconds, or with the error.

Ordering: jobs of one lane run and complete in submission order (one stream; futures are
resolved strictly in order, a failed job included). Lanes are independent, so the FIFO
per direction of the contract holds per device, and different GPUs never wait for each
other. Loads and stores run on separate streams and may overlap.

What moves: the engine only sees absolute ``(src, dst, nbytes)`` triples. Which bytes those
are is ``offloadd.transfer.plan``'s business: only the unpadded page of each block moves, at
the padded block stride, and packed (one row per block for all layers) and unpacked (one
region per layer) layouts are both just regions there. Neighbouring triples contiguous on
both sides are merged here once more (``merge_moves``), since chunk plans concatenate.

``close()`` waits until every submitted job has completed and been resolved, then stops the
threads and drops the streams.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from offloadd.transfer import libcuda
from offloadd.transfer.engine import Direction, Triple

logger = logging.getLogger(__name__)

_POLL_MIN = 50e-6
_POLL_MAX = 1e-3
_IPC_EVENT_CACHE = 256

AccessOrder = Literal["stream", "any"]


# --- pure helpers --------------------------------------------------------------------------


def merge_moves(moves: Iterable[Triple]) -> list[Triple]:
    """Drop empty moves and merge neighbours that are contiguous on both sides."""
    merged: list[Triple] = []
    for src, dst, nbytes in moves:
        if nbytes < 0:
            raise ValueError(f"negative copy size {nbytes}")
        if nbytes == 0:
            continue
        if merged:
            last_src, last_dst, last_n = merged[-1]
            if last_src + last_n == src and last_dst + last_n == dst:
                merged[-1] = (last_src, last_dst, last_n + nbytes)
                continue
        merged.append((src, dst, nbytes))
    return merged


def batch_arrays(moves: Iterable[Triple]) -> tuple[list[int], list[int], list[int]]:
    """``(srcs, dsts, sizes)`` for one batched copy call, built once per job."""
    merged = merge_moves(moves)
    return [m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged]


def src_access_order(direction: Direction) -> AccessOrder:
    """How the driver may read a job's sources.

    In stream order for stores (device memory, written by work the stream waited for); at
    any time for loads (the arena slot, which no work on the stream touches).
    """
    return "stream" if direction is Direction.STORE else "any"


# --- backends ------------------------------------------------------------------------------


class Backend(Protocol):
    """What the engine needs from CUDA; ``TorchCudaBackend`` in the daemon, fakes in tests.

    Streams need ``wait_event(event)``; events need ``record(stream)``, ``query()`` and
    ``elapsed_time(end) -> milliseconds`` (torch's ``Stream`` and ``Event`` have them).
    """

    @property
    def name(self) -> str:
        """How copies are issued, for logs."""
        ...

    def bind_thread(self, device: int) -> None:
        """Make ``device`` current in the calling thread."""
        ...

    def stream(self, device: int) -> Any:
        """A new non-default stream on ``device`` (called on the lane's thread)."""
        ...

    def timing_event(self, device: int) -> Any:
        """A new event with timing enabled."""
        ...

    def ipc_event(self, device: int, handle: bytes) -> Any:
        """The interprocess event a rank exported as ``handle``."""
        ...

    def copy(
        self,
        stream: Any,
        direction: Direction,
        srcs: list[int],
        dsts: list[int],
        sizes: list[int],
    ) -> None:
        """Enqueue the copies on ``stream``; raises if the driver refuses them."""
        ...


class CudaCopyError(RuntimeError):
    """The driver refused a copy; the message names the call and the error."""


def _torch() -> Any:
    import torch

    return torch


def _cuda_runtime() -> Any | None:
    """cuda-python's runtime bindings with the batch API, or None."""
    for name in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "cudaMemcpyBatchAsync"):
            return module
    return None


class _LoopCopier:
    """One ``cuMemcpyAsync`` per merged triple, through ctypes on the driver library."""

    name = "cuMemcpyAsync per copy"

    def __init__(self) -> None:
        driver = libcuda.load()
        if driver is None:
            raise RuntimeError("libcuda.so.1 (the NVIDIA driver library) cannot be loaded")
        self._driver = driver

    def bind(self, device: int) -> None:
        """Nothing beyond torch's binding (which made the primary context current)."""

    def copy(
        self, stream: int, direction: Direction, srcs: list[int], dsts: list[int], sizes: list[int]
    ) -> None:
        """Enqueue each copy; stops at the first refusal."""
        memcpy = self._driver.memcpy_async
        for index, (src, dst, nbytes) in enumerate(zip(srcs, dsts, sizes, strict=True)):
            code = memcpy(dst, src, nbytes, stream)
            if code != libcuda.CUDA_SUCCESS:
                raise CudaCopyError(
                    f"cuMemcpyAsync of copy {index} ({nbytes} bytes {src:#x} -> {dst:#x}) "
                    f"failed: {self._driver.error_name(code)}"
                )


class _BatchCopier:
    """``cudaMemcpyBatchAsync`` through cuda-python: one call per job."""

    name = "cudaMemcpyBatchAsync"

    def __init__(self, runtime: Any) -> None:
        self._rt = runtime
        orders = runtime.cudaMemcpySrcAccessOrder
        self._attrs: dict[Direction, Any] = {}
        for direction in Direction:
            attrs = runtime.cudaMemcpyAttributes()
            attrs.srcAccessOrder = (
                orders.cudaMemcpySrcAccessOrderStream
                if src_access_order(direction) == "stream"
                else orders.cudaMemcpySrcAccessOrderAny
            )
            self._attrs[direction] = attrs
        errors = runtime.cudaError_t
        # A driver or library without the batch API: switch to the per-copy path for good.
        self.unsupported = {
            int(getattr(errors, name))
            for name in (
                "cudaErrorNotSupported",
                "cudaErrorCallRequiresNewerDriver",
                "cudaErrorInsufficientDriver",
                "cudaErrorSymbolNotFound",
            )
            if hasattr(errors, name)
        }
        self._success = int(errors.cudaSuccess)

    def bind(self, device: int) -> int:
        """cuda-python keeps its own notion of the current device: set it too.

        Returns the cudaError code: one of ``unsupported`` means this cuda-python cannot
        run on the installed driver (the caller stops batching); others raise.
        """
        (err, *_rest) = self._rt.cudaSetDevice(device)
        code = int(err)
        if code != self._success and code not in self.unsupported:
            raise CudaCopyError(f"cudaSetDevice({device}) failed: {err}")
        return code

    def copy(
        self, stream: int, direction: Direction, srcs: list[int], dsts: list[int], sizes: list[int]
    ) -> int:
        """Enqueue the batch; returns the cudaError code (0 on success)."""
        result = self._rt.cudaMemcpyBatchAsync(
            dsts, srcs, sizes, len(sizes), [self._attrs[direction]], [0], 1, stream
        )
        # CUDA 12.x bindings return (err, failIdx); 13.x dropped failIdx and return (err,).
        err = result[0] if isinstance(result, tuple) else result
        code = int(err)
        if code != self._success and code not in self.unsupported:
            fail_index = result[1] if isinstance(result, tuple) and len(result) > 1 else None
            raise CudaCopyError(
                f"cudaMemcpyBatchAsync of {len(sizes)} copies failed: {err}"
                + (f" at copy {fail_index}" if fail_index is not None else "")
            )
        return code


class TorchCudaBackend:
    """Streams and events from torch; copies batched via cuda-python when it is installed."""

    def __init__(self, *, batch: bool = True) -> None:
        torch = _torch()
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda copy engine needs a CUDA device, and torch sees none")
        torch.cuda.init()
        self._torch = torch
        self._loop: _LoopCopier | None = None
        self._batch: _BatchCopier | None = None
        runtime = _cuda_runtime() if batch else None
        if runtime is not None:
            self._batch = _BatchCopier(runtime)
        else:
            if batch:
                logger.warning(
                    "cuda-python is not installed: one cuMemcpyAsync per copy (slower); "
                    "install offloadd[cuda] for batched copies"
                )
            self._loop = _LoopCopier()
        self._fallback_lock = threading.Lock()

    @property
    def name(self) -> str:
        """The copy path in use."""
        return _BatchCopier.name if self._batch is not None else _LoopCopier.name

    def bind_thread(self, device: int) -> None:
        """Set ``device`` for torch (primary context current) and for cuda-python."""
        self._torch.cuda.set_device(device)
        # cudaSetDevice alone may defer creating the context; a stream query forces it.
        self._torch.cuda.current_stream(device).query()
        batch = self._batch
        if batch is not None:
            code = batch.bind(device)
            if code != 0:
                self._give_up_batching(code)

    def stream(self, device: int) -> Any:
        """A pool stream of ``device`` (torch creates them non-blocking)."""
        return self._torch.cuda.Stream(device=device)

    def timing_event(self, device: int) -> Any:
        """An event with timing (its device is the stream's it is recorded on)."""
        return self._torch.cuda.Event(enable_timing=True)

    def ipc_event(self, device: int, handle: bytes) -> Any:
        """Open an interprocess event a rank exported."""
        return self._torch.cuda.Event.from_ipc_handle(self._torch.device("cuda", device), handle)

    def copy(
        self,
        stream: Any,
        direction: Direction,
        srcs: list[int],
        dsts: list[int],
        sizes: list[int],
    ) -> None:
        """One batched call, or the per-copy loop where batching is unavailable."""
        handle = int(stream.cuda_stream)
        batch = self._batch
        if batch is not None:
            code = batch.copy(handle, direction, srcs, dsts, sizes)
            if code == 0:
                return
            self._give_up_batching(code)
        assert self._loop is not None
        self._loop.copy(handle, direction, srcs, dsts, sizes)

    def _give_up_batching(self, code: int) -> None:
        with self._fallback_lock:
            if self._batch is None:
                return
            logger.warning(
                "cudaMemcpyBatchAsync is unavailable here (cudaError %d: it needs a CUDA 12.8 "
                "driver, and cuda-python no newer than the driver): one cuMemcpyAsync per "
                "copy from now on (slower)",
                code,
            )
            self._loop = _LoopCopier()
            self._batch = None


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
    pending: deque[_Job] = field(default_factory=deque)
    stream: Any = None
    bound: bool = False  # the lane's thread has made its device current


class CudaCopyEngine:
    """CopyEngine for CUDA memory; see the module docstring for the guarantees."""

    name = "cuda"

    def __init__(self, backend: Backend | None = None) -> None:
        self._backend: Backend = backend if backend is not None else TorchCudaBackend()
        self._lanes: dict[tuple[int, Direction], _Lane] = {}
        self._cond = threading.Condition()
        self._outstanding = 0
        self._closed = False
        self._stopping = False
        self._ipc_events: OrderedDict[tuple[int, bytes], Any] = OrderedDict()
        self._ipc_lock = threading.Lock()
        self._poller = threading.Thread(target=self._poll, name="offloadd-cuda-poll", daemon=True)
        self._poller.start()
        logger.info("cuda copy engine: %s", self._backend.name)

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
        with self._cond:
            lane.pending.append(job)
            self._outstanding += 1
        try:
            lane.executor.submit(self._issue, job, list(moves), wait_event)
        except BaseException as exc:
            # Never leave a job the poller would wait for forever.
            job.error = exc
            with self._cond:
                job.issued = True
                self._cond.notify_all()
        return future

    def close(self) -> None:
        """Wait for every submitted job, then stop the threads; idempotent."""
        if self._closed:
            return
        self._closed = True
        for lane in list(self._lanes.values()):
            lane.executor.shutdown(wait=True)
        with self._cond:
            while self._outstanding and self._poller.is_alive():
                self._cond.wait(0.1)
            self._stopping = True
            self._cond.notify_all()
        self._poller.join()
        self._lanes.clear()
        with self._ipc_lock:
            self._ipc_events.clear()

    # ----------------------------------------------------------------- issuing (lane threads)

    def _lane(self, device: int, direction: Direction) -> _Lane:
        key = (device, direction)
        lane = self._lanes.get(key)
        if lane is None:
            executor = ThreadPoolExecutor(
                1, thread_name_prefix=f"offloadd-cuda{device}-{direction.value}"
            )
            lane = _Lane(device, direction, executor)
            with self._cond:  # the poller lists the lanes
                self._lanes[key] = lane
        return lane

    def _issue(self, job: _Job, moves: list[Triple], wait_event: bytes | None) -> None:
        backend = self._backend
        lane = job.lane
        try:
            if not job.future.set_running_or_notify_cancel():
                job.cancelled = True
                return
            srcs, dsts, sizes = batch_arrays(moves)
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
                if sizes:
                    backend.copy(stream, lane.direction, srcs, dsts, sizes)
            finally:
                # Recorded even after a refused copy: the job is resolved only once what was
                # enqueued has finished, so its memory is never released under a copy.
                end.record(stream)
                job.end = end
        except BaseException as exc:
            job.error = exc
        finally:
            with self._cond:
                job.issued = True
                self._cond.notify_all()

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

    # ----------------------------------------------------------------- completion (poller)

    def _poll(self) -> None:
        delay = _POLL_MIN
        bound = -1
        while True:
            with self._cond:
                while not self._outstanding and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._outstanding:
                    return
                lanes = list(self._lanes.values())
            progressed = False
            for lane in lanes:
                while True:
                    with self._cond:
                        head = lane.pending[0] if lane.pending else None
                    if head is None or not head.issued:
                        break
                    if bound != lane.device and not head.cancelled and head.end is not None:
                        with contextlib.suppress(Exception):
                            self._backend.bind_thread(lane.device)
                        bound = lane.device
                    outcome = self._outcome(head)
                    if outcome is None:
                        break
                    with self._cond:
                        lane.pending.popleft()
                        self._outstanding -= 1
                        self._cond.notify_all()
                    self._resolve(head, *outcome)
                    progressed = True
            if progressed:
                delay = _POLL_MIN
                continue
            with self._cond:
                notified = self._cond.wait(delay)
            delay = _POLL_MIN if notified else min(delay * 2, _POLL_MAX)

    @staticmethod
    def _outcome(job: _Job) -> tuple[float, BaseException | None] | None:
        """None while the job runs; else (seconds, error)."""
        if job.cancelled:
            return 0.0, None
        if job.end is None:
            return 0.0, job.error or RuntimeError("the copy was never issued")
        try:
            if not job.end.query():
                return None
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


def make_engine(*, batch: bool = True) -> CudaCopyEngine:
    """The engine the daemon runs with ``server.copy_engine = "cuda"``.

    Raises RuntimeError without a CUDA device. ``batch=False`` forces the per-copy path
    (for comparisons).
    """
    return CudaCopyEngine(TorchCudaBackend(batch=batch))

"""Copy engines: submit a batch of moves in one direction, get a completion.

Contract (every engine: ``cpu`` here, ``cuda`` in ``offloadd.transfer.cuda``):
- ``submit(direction, moves, *, device=-1, wait_event=None)`` takes absolute
  ``(src, dst, nbytes)`` triples, already validated to lie inside their regions, and returns
  a ``concurrent.futures.Future`` that resolves to the seconds the copy took, or raises if it
  failed. ``device`` is the local CUDA ordinal of the rank's memory (``Import.device``) and
  ``wait_event`` an optional CUDA IPC event handle the copy must wait for; the cpu engine
  ignores both.
- Jobs of one direction complete in submission order (FIFO per direction; the cuda engine
  keeps this per device, so GPUs never wait for each other); the two directions run
  independently.
- The caller keeps source and destination mapped until the future resolves, and does not
  change ``moves`` after ``submit`` (the engine takes it as it is, without a copy).
- ``close()`` waits for submitted copies and stops the engine; it is idempotent.
- The cpu engine copies what a ``Copies`` lists in its ``windows`` (a rank's shared-memory
  files that are not mapped) with ``pread``/``pwrite`` on their descriptors
  (``offloadd.transfer.guarded``): a rank that truncates its file, or leaves holes in a full
  tmpfs, fails its job, never the daemon.
- The cpu engine copies a load of at most ``INLINE_LOAD_BYTES`` at once, on the caller's
  thread, when no load copy is queued before it (FIFO holds): the future it returns is done.

Otherwise the daemon's event loop never copies bytes itself: it submits and awaits futures.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from offloadd.transfer.batch import move_arrays
from offloadd.transfer.copies import Copies
from offloadd.transfer.guarded import guarded_copy
from offloadd.transfer.types import Direction, Triple


class CopyEngine(Protocol):
    """What the daemon needs from a copy engine; see the module docstring."""

    name: str

    def submit(
        self,
        direction: Direction,
        moves: Sequence[Triple],
        *,
        device: int = -1,
        wait_event: bytes | None = None,
    ) -> Future[float]:
        """Start copying ``moves``; the future gives the seconds spent."""
        ...

    def close(self) -> None:
        """Drain and stop."""
        ...


def _copy_all(moves: Sequence[Triple], direction: Direction) -> float:
    # Imported here: batch and guarded build on this module's Direction and Triple.

    started = time.perf_counter()
    # Neighbours contiguous on both sides become one copy (the planner does not merge).
    arrays = move_arrays(moves, direction)
    if isinstance(moves, Copies) and moves.windows:
        guarded_copy(arrays, direction, moves.windows)
        return time.perf_counter() - started
    memmove = ctypes.memmove
    for src, dst, nbytes in arrays.triples():
        memmove(dst, src, nbytes)  # releases the GIL while it copies
    return time.perf_counter() - started


# A load this small is copied on the event loop when no load copy is queued: a request's
# first token waits for it, and on the Mooncake trace a load handed to the copy thread
# waited 1.6 ms (median) for the GIL while the loop planned the step's stores, then as long
# again for the loop to take its end, around a copy of 0.5 ms. 1 MiB: ~0.1 ms of memmove.
# Not more: a larger load copied here holds up the other engines' loads (decisions.md).
INLINE_LOAD_BYTES = 1 << 20


def _total_bytes(moves: Sequence[Triple]) -> int:
    if isinstance(moves, Copies):
        return int(moves.columns()[2].sum())
    return sum(nbytes for _src, _dst, nbytes in moves)


class CpuCopyEngine:
    """Copies between host mappings with memmove on one worker thread per direction (and
    small loads at once: ``INLINE_LOAD_BYTES``)."""

    name = "cpu"

    def __init__(self) -> None:
        self._pools = {
            direction: ThreadPoolExecutor(1, thread_name_prefix=f"offloadd-{direction.value}")
            for direction in Direction
        }
        self._closed = False
        self._lock = threading.Lock()
        self._queued = dict.fromkeys(Direction, 0)  # copies handed to a thread, not ended

    def submit(
        self,
        direction: Direction,
        moves: Sequence[Triple],
        *,
        device: int = -1,
        wait_event: bytes | None = None,
    ) -> Future[float]:
        """Queue ``moves`` behind earlier jobs of the same direction.

        ``device`` and ``wait_event`` concern CUDA memory only and are ignored here.
        """
        if self._closed:
            raise RuntimeError("copy engine is closed")
        with self._lock:
            inline = (
                direction is Direction.LOAD
                and not self._queued[direction]
                and _total_bytes(moves) <= INLINE_LOAD_BYTES
            )
            if not inline:
                self._queued[direction] += 1
        if inline:
            done: Future[float] = Future()
            try:
                done.set_result(_copy_all(moves, direction))
            except Exception as exc:
                done.set_exception(exc)
            return done
        future = self._pools[direction].submit(_copy_all, moves, direction)
        future.add_done_callback(lambda _future: self._ended(direction))
        return future

    def _ended(self, direction: Direction) -> None:
        with self._lock:
            self._queued[direction] -= 1

    def close(self) -> None:
        """Wait for queued copies, then stop the threads."""
        if self._closed:
            return
        self._closed = True
        for pool in self._pools.values():
            pool.shutdown(wait=True)

"""The cpu copy engine: a small load is copied at once on the caller's thread when no load
copy is queued before it; anything else goes to its direction's thread, in order."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator

from offloadd.transfer.engine import INLINE_LOAD_BYTES, CpuCopyEngine
from offloadd.transfer.types import Direction, Triple


class Recorded(list[Triple]):
    """Copies that note which threads read them; a thread other than the test's waits for
    ``gate`` first (a copy held in its thread)."""

    def __init__(self, moves: list[Triple], gate: threading.Event | None = None) -> None:
        super().__init__(moves)
        self.threads: set[str] = set()
        self.gate = gate

    def __iter__(self) -> Iterator[Triple]:
        thread = threading.current_thread()
        self.threads.add(thread.name)
        if self.gate is not None and thread is not threading.main_thread():
            assert self.gate.wait(10)
        return super().__iter__()


def buffers(size: int) -> tuple[ctypes.Array[ctypes.c_char], ctypes.Array[ctypes.c_char]]:
    """A source of ``size`` patterned bytes and a zeroed destination as large."""
    src, dst = ctypes.create_string_buffer(size), ctypes.create_string_buffer(size)
    src.raw = bytes(range(256)) * (size // 256)
    return src, dst


def moves_of(src: ctypes.Array[ctypes.c_char], dst: ctypes.Array[ctypes.c_char]) -> list[Triple]:
    return [(ctypes.addressof(src), ctypes.addressof(dst), len(src))]


def test_a_small_load_is_copied_at_once_on_the_callers_thread() -> None:
    engine = CpuCopyEngine()
    try:
        src, dst = buffers(4096)
        moves = Recorded(moves_of(src, dst))
        future = engine.submit(Direction.LOAD, moves)
        assert future.done() and moves.threads == {threading.main_thread().name}
        assert dst.raw == src.raw
    finally:
        engine.close()


def test_stores_large_loads_and_loads_behind_a_queued_one_go_to_their_thread() -> None:
    engine = CpuCopyEngine()
    gate = threading.Event()
    try:
        src, dst = buffers(4096)
        store = Recorded(moves_of(src, dst))
        engine.submit(Direction.STORE, store).result(10)
        assert "offloadd-store_0" in store.threads

        big_src, big_dst = buffers(INLINE_LOAD_BYTES + 4096)
        big = Recorded(moves_of(big_src, big_dst), gate)
        first = engine.submit(Direction.LOAD, big)
        small_src, small_dst = buffers(4096)
        small = Recorded(moves_of(small_src, small_dst))
        second = engine.submit(Direction.LOAD, small)  # the big one is still queued: FIFO
        assert not second.done()
        gate.set()
        first.result(10)
        second.result(10)
        assert "offloadd-load_0" in big.threads and "offloadd-load_0" in small.threads
        assert big_dst.raw == big_src.raw and small_dst.raw == small_src.raw

        after = Recorded(moves_of(small_src, small_dst))  # nothing queued again: at once
        assert engine.submit(Direction.LOAD, after).done()
        assert after.threads == {threading.main_thread().name}
    finally:
        gate.set()
        engine.close()


def test_a_small_load_that_fails_returns_its_error_in_the_future() -> None:
    engine = CpuCopyEngine()
    try:
        future = engine.submit(Direction.LOAD, [(0, 0, -1)])
        assert future.done() and isinstance(future.exception(), ValueError)
    finally:
        engine.close()

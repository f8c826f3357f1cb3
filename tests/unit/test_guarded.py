"""offloadd.transfer.guarded: copies through a rank file's descriptor, on real tmpfs files."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import uuid
from collections.abc import Iterator

import pytest

from offloadd.transfer import guarded
from offloadd.transfer.batch import move_arrays
from offloadd.transfer.copies import Copies
from offloadd.transfer.engine import CpuCopyEngine
from offloadd.transfer.guarded import (
    guarded_copy,
    region_file_problem,
    reserve,
    shrunk,
    unreserve,
)
from offloadd.transfer.types import Direction, FileWindow, Span

SIZE = 64 << 10


@pytest.fixture
def window() -> Iterator[tuple[FileWindow, str]]:
    """A /dev/shm file of SIZE pseudo-random bytes behind a reserved window."""
    path = f"/dev/shm/od-test-guarded-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.pwrite(fd, os.urandom(SIZE), 0)
    address = reserve(SIZE)
    try:
        yield FileWindow(address, SIZE, fd), path
    finally:
        unreserve(address, SIZE)
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def test_stores_read_and_loads_write_the_file(window: tuple[FileWindow, str]) -> None:
    file, path = window
    host = ctypes.create_string_buffer(3 * 4096)
    base = ctypes.addressof(host)
    # Three scattered pages of the file into one contiguous slot, as a store plans them.
    moves = [
        (file.address + page * 4096, base + i * 4096, 4096) for i, page in enumerate((7, 2, 9))
    ]
    guarded_copy(move_arrays(moves, Direction.STORE), Direction.STORE, [file])
    with open(path, "rb") as f:
        data = f.read()
    assert (
        host.raw
        == data[7 * 4096 : 8 * 4096] + data[2 * 4096 : 3 * 4096] + data[9 * 4096 : 10 * 4096]
    )
    # And back into other pages, as a load does.
    loads = [
        (base + i * 4096, file.address + page * 4096, 4096) for i, page in enumerate((0, 1, 15))
    ]
    guarded_copy(move_arrays(loads, Direction.LOAD), Direction.LOAD, [file])
    with open(path, "rb") as f:
        data = f.read()
    assert data[: 2 * 4096] + data[15 * 4096 : 16 * 4096] == host.raw


def test_the_cpu_engine_takes_the_descriptor_path_for_copies_with_windows(
    window: tuple[FileWindow, str],
) -> None:
    file, path = window
    host = ctypes.create_string_buffer(8192)
    moves = Copies([file])
    moves.add_chunk([Span(file.address, 4096, 4096, 0)], [3, 4], ctypes.addressof(host))
    engine = CpuCopyEngine()
    try:
        engine.submit(Direction.STORE, moves).result(10)
    finally:
        engine.close()
    with open(path, "rb") as f:
        assert host.raw == f.read()[3 * 4096 : 5 * 4096]


def test_a_file_that_shrank_fails_the_copy_not_the_process(window: tuple[FileWindow, str]) -> None:
    file, path = window
    os.truncate(path, 4096)
    assert "shrank from 65536 to 4096" in shrunk([file])
    host = ctypes.create_string_buffer(4096)
    moves = [(file.address + 8192, ctypes.addressof(host), 4096)]
    with pytest.raises(OSError, match="shrank under the copy"):
        guarded_copy(move_arrays(moves, Direction.STORE), Direction.STORE, [file])
    os.truncate(path, SIZE)
    assert shrunk([file]) == ""


def test_a_copy_leaving_its_window_is_refused(window: tuple[FileWindow, str]) -> None:
    file, _path = window
    host = ctypes.create_string_buffer(4096)
    moves = [(file.address + SIZE - 2048, ctypes.addressof(host), 4096)]
    with pytest.raises(ValueError, match="outside"):
        guarded_copy(move_arrays(moves, Direction.STORE), Direction.STORE, [file])


def test_copies_outside_the_windows_are_plain_memory(window: tuple[FileWindow, str]) -> None:
    file, path = window
    mapped = ctypes.create_string_buffer(b"mapped memory, e.g. a sealed memfd", 4096)
    host = ctypes.create_string_buffer(8192)
    moves = [
        (file.address, ctypes.addressof(host), 4096),
        (ctypes.addressof(mapped), ctypes.addressof(host) + 4096, 4096),
    ]
    guarded_copy(move_arrays(moves, Direction.STORE), Direction.STORE, [file])
    with open(path, "rb") as f:
        assert host.raw == f.read(4096) + mapped.raw


def test_what_a_region_file_must_be(window: tuple[FileWindow, str]) -> None:
    file, path = window
    assert region_file_problem(file.fd) == ""
    read_only = os.open(path, os.O_RDONLY)
    try:
        assert "read-write" in region_file_problem(read_only)
    finally:
        os.close(read_only)
    on_disk = os.open("/proc/self/exe", os.O_RDONLY)
    try:
        assert "not on tmpfs" in region_file_problem(on_disk)
    finally:
        os.close(on_disk)
    memfd = os.memfd_create("od-test")
    try:
        assert region_file_problem(memfd) == ""
    finally:
        os.close(memfd)


def _shuffled_neighbours(
    direction: Direction, file: FileWindow, host: int, size: int, count: int, seed: int
) -> tuple[list[tuple[int, int, int]], list[int]]:
    """``count`` copies of ``size`` bytes between consecutive file slots and host slots in
    a shuffled order (as a step's loads reach the rank's blocks); the file slot of each
    host slot."""
    slots = list(range(count))
    random.Random(seed).shuffle(slots)
    pairs = [(file.address + slot * size, host + i * size) for i, slot in enumerate(slots)]
    if direction is Direction.STORE:
        return [(f, h, size) for f, h in pairs], slots
    return [(h, f, size) for f, h in pairs], slots


@pytest.mark.parametrize("direction", list(Direction))
def test_neighbours_in_the_file_are_one_call_whatever_their_order(
    direction: Direction, window: tuple[FileWindow, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies whose file sides follow each other go in one preadv/pwritev of at most
    IOV_MAX buffers, each buffer's bytes where its own copy says."""
    file, path = window
    size, count = 16, 2500  # more than IOV_MAX (1024): three calls
    host = ctypes.create_string_buffer(os.urandom(size * count), size * count)
    moves, slots = _shuffled_neighbours(direction, file, ctypes.addressof(host), size, count, 3)
    name = "_preadv" if direction is Direction.STORE else "_pwritev"
    real, calls = getattr(guarded, name), []

    def counted(*args: object) -> int:
        calls.append(args[2])
        return int(real(*args))

    monkeypatch.setattr(guarded, name, counted)
    arrays = move_arrays(moves, direction)  # merges the few neighbours on both sides
    guarded_copy(arrays, direction, [file])
    assert calls == [1024, 1024, len(arrays) - 2048]
    with open(path, "rb") as f:
        data = f.read()
    for i, slot in enumerate(slots):
        assert host.raw[i * size : (i + 1) * size] == data[slot * size : (slot + 1) * size]


def test_a_file_that_shrank_under_a_run_fails_at_its_end(window: tuple[FileWindow, str]) -> None:
    """A short preadv (the file ended inside the run) finishes buffer by buffer: the bytes
    before the end are read, and the error names the byte where the file ended."""
    file, path = window
    with open(path, "rb") as f:
        data = f.read()
    os.truncate(path, 6144)
    host = ctypes.create_string_buffer(8192)
    moves = [
        (file.address + 4096 + i * 4096, ctypes.addressof(host) + i * 4096, 4096) for i in (1, 0)
    ]
    with pytest.raises(OSError, match="ended at byte 6144"):
        guarded_copy(move_arrays(moves, Direction.STORE), Direction.STORE, [file])
    assert host.raw[:2048] == data[4096:6144]

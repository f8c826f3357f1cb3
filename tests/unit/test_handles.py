"""offloadd.transfer.handles: the refcounted import table, on descriptors of real files."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator

import pytest

from offloadd.transfer.batch import move_arrays
from offloadd.transfer.guarded import guarded_copy
from offloadd.transfer.handles import HandleError, HandleTable, Import
from offloadd.transfer.types import Direction
from protocol.handles import CudaIpcHandle, ShmHandle

SHM = "/dev/shm"
SIZE = 8192

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="needs /dev/shm")

MakePath = Callable[..., str]


@pytest.fixture
def shm_path() -> Iterator[MakePath]:
    """Unique paths under /dev/shm; everything made through it is removed afterwards."""
    made: list[str] = []

    def make(size: int | None = SIZE, *, fill: bytes = b"") -> str:
        path = os.path.join(SHM, f"offloadd-test-{os.getpid()}-{uuid.uuid4().hex[:10]}")
        made.append(path)
        if size is not None:
            with open(path, "wb") as f:
                f.truncate(size)
                f.write(fill)
        return path

    yield make
    for path in made:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@pytest.fixture
def fds() -> Iterator[Callable[..., int]]:
    """Descriptors opened for a test (closed afterwards), as a rank would open them."""
    opened: list[int] = []

    def open_(path: str, flags: int = os.O_RDWR) -> int:
        fd = os.open(path, flags | os.O_CLOEXEC)
        opened.append(fd)
        return fd

    yield open_
    for fd in opened:
        with contextlib.suppress(OSError):
            os.close(fd)


@pytest.fixture
def table() -> Iterator[HandleTable]:
    handles = HandleTable()
    yield handles
    handles.close()


def _handle(path: str, offset: int = 0, size: int = SIZE) -> ShmHandle:
    return ShmHandle(path=path, offset=offset, size=size, fd=0)


def _read_through(imported: Import, offset: int, count: int) -> bytes:
    """``count`` bytes at ``offset`` of the region, the way a store reads them."""
    buffer = ctypes.create_string_buffer(count)
    arrays = move_arrays(
        [(imported.address + offset, ctypes.addressof(buffer), count)], Direction.STORE
    )
    assert imported.window is not None
    guarded_copy(arrays, Direction.STORE, [imported.window])
    return buffer.raw


def test_one_file_twice_shares_one_import(
    table: HandleTable, shm_path: MakePath, fds: Callable[..., int]
) -> None:
    path = shm_path()
    first = table.open(_handle(path, 0, 4096), fds(path))
    second = table.open(_handle(path, 4096, 4096), fds(path))
    assert len(table) == 1
    assert second.address == first.address + 4096
    assert (first.size, second.size) == (4096, 4096)
    table.release(first)
    assert len(table) == 1
    table.release(second)
    assert len(table) == 0


def test_same_file_through_another_name_shares_the_import(
    table: HandleTable, shm_path: MakePath, fds: Callable[..., int]
) -> None:
    path = shm_path()
    alias = shm_path(None)
    os.link(path, alias)
    a = table.open(_handle(path), fds(path))
    b = table.open(_handle(alias), fds(alias))
    assert len(table) == 1
    assert a.address == b.address
    table.release(a)
    table.release(b)
    assert len(table) == 0


def test_retain_keeps_the_import_until_the_last_release(
    table: HandleTable, shm_path: MakePath, fds: Callable[..., int]
) -> None:
    path = shm_path()
    imported = table.open(_handle(path), fds(path))
    table.retain(imported)  # e.g. a copy in flight
    table.release(imported)
    assert len(table) == 1
    table.release(imported)
    assert len(table) == 0


def test_the_table_keeps_its_own_descriptor_and_closes_it(
    table: HandleTable, shm_path: MakePath, fds: Callable[..., int]
) -> None:
    path = shm_path()
    given = fds(path)
    imported = table.open(_handle(path, 100, 1000), given)
    os.close(given)  # the registration closes the rank's descriptor after the Hello
    os.pwrite(fds(path), b"written by the rank", 105)
    assert _read_through(imported, 5, 19) == b"written by the rank"
    window = imported.window
    assert window is not None and window.fd != given
    table.release(imported)
    with pytest.raises(OSError) as closed:
        os.fstat(window.fd)
    assert closed.value.errno == errno.EBADF


def test_the_file_is_never_mapped(
    table: HandleTable, shm_path: MakePath, fds: Callable[..., int]
) -> None:
    path = shm_path()
    imported = table.open(_handle(path), fds(path))
    with open("/proc/self/maps") as file:
        maps = file.read()
    assert path not in maps  # reached through pread/pwrite on the descriptor only
    start = f"{imported.address:x}-"
    line = next(line for line in maps.splitlines() if line.startswith(start))
    assert line.split()[1].startswith("---")  # reserved address space, no access at all
    table.release(imported)


def test_close_releases_everything(
    table: HandleTable, shm_path: MakePath, fds: Callable[..., int]
) -> None:
    one, two = shm_path(), shm_path()
    table.open(_handle(one), fds(one))
    imported = table.open(_handle(two), fds(two))
    table.retain(imported)
    assert len(table) == 2
    table.close()
    assert len(table) == 0


def test_a_path_without_a_descriptor_is_refused(table: HandleTable, shm_path: MakePath) -> None:
    with pytest.raises(HandleError, match=r"file descriptors .* opens no path"):
        table.open(ShmHandle(path=shm_path(), offset=0, size=SIZE))
    assert len(table) == 0


def test_a_file_not_on_tmpfs_is_refused(table: HandleTable, fds: Callable[..., int]) -> None:
    directory = tempfile.mkdtemp(prefix="od-h-", dir="/var/tmp")
    try:
        path = os.path.join(directory, "kv")
        with open(path, "wb") as f:
            f.truncate(SIZE)
        with pytest.raises(HandleError, match="not on tmpfs"):
            table.open(_handle(path), fds(path))
    finally:
        shutil.rmtree(directory)
    assert len(table) == 0


def test_a_read_only_descriptor_is_refused(
    table: HandleTable, shm_path: MakePath, fds: Callable[..., int]
) -> None:
    path = shm_path()
    with pytest.raises(HandleError, match="read-write"):
        table.open(_handle(path), fds(path, os.O_RDONLY))
    assert len(table) == 0


def test_a_directory_or_a_fifo_is_refused(
    table: HandleTable, shm_path: MakePath, fds: Callable[..., int]
) -> None:
    directory = shm_path(None)
    os.mkdir(directory)
    with pytest.raises(HandleError, match="not a regular file"):
        table.open(_handle(directory, 0, 1), fds(directory, os.O_RDONLY))
    fifo = shm_path(None)
    os.mkfifo(fifo)
    with pytest.raises(HandleError, match="not a regular file"):
        table.open(_handle(fifo, 0, 1), fds(fifo, os.O_RDWR | os.O_NONBLOCK))
    assert len(table) == 0


def test_a_bad_descriptor_and_an_empty_file_are_refused(
    table: HandleTable, shm_path: MakePath, fds: Callable[..., int]
) -> None:
    with pytest.raises(HandleError, match="bad descriptor"):
        table.open(_handle(shm_path()), 10_000)
    empty = shm_path(0)
    with pytest.raises(HandleError, match="empty"):
        table.open(_handle(empty, 0, 0), fds(empty))
    assert len(table) == 0


@pytest.mark.parametrize(
    ("offset", "size"),
    [(0, SIZE + 1), (SIZE, 1), (SIZE - 10, 11), (SIZE * 4, 0)],
)
def test_region_past_the_end_of_the_file_is_refused(
    table: HandleTable, shm_path: MakePath, fds: Callable[..., int], offset: int, size: int
) -> None:
    path = shm_path()
    with pytest.raises(HandleError, match="outside"):
        table.open(_handle(path, offset, size), fds(path))
    assert len(table) == 0  # the import made for the check is not leaked


def test_region_past_the_end_keeps_an_existing_import_counted_right(
    table: HandleTable, shm_path: MakePath, fds: Callable[..., int]
) -> None:
    path = shm_path()
    good = table.open(_handle(path), fds(path))
    with pytest.raises(HandleError):
        table.open(_handle(path, 1, SIZE), fds(path))
    assert len(table) == 1
    table.release(good)
    assert len(table) == 0


@pytest.mark.parametrize(("offset", "size"), [(-4096, 4096), (-1, 1), (100, -50)])
def test_negative_offset_or_size_is_refused(
    table: HandleTable, shm_path: MakePath, fds: Callable[..., int], offset: int, size: int
) -> None:
    # Handles are opened before the registry checks geometry: the table itself must never
    # hand out an address before the import.
    path = shm_path()
    with pytest.raises(HandleError, match="negative"):
        table.open(_handle(path, offset, size), fds(path))
    assert len(table) == 0


def test_the_daemons_files_are_refused_under_any_name(
    shm_path: MakePath, fds: Callable[..., int]
) -> None:
    arena, journal = shm_path(), shm_path()
    alias = shm_path(None)
    os.link(arena, alias)
    link = shm_path(None)
    os.symlink(arena, link)
    handles = HandleTable(forbidden=[arena, journal])
    for name in (arena, alias, link, journal):  # the rank opens a link: its fd is the arena's
        with pytest.raises(HandleError, match="daemon's own files"):
            handles.open(_handle(name), fds(name))
    # A journal rewritten under the same name is a new inode: still refused.
    replacement = shm_path()
    os.rename(replacement, journal)
    with pytest.raises(HandleError, match="daemon's own files"):
        handles.open(_handle(journal), fds(journal))
    assert len(handles) == 0
    other = shm_path()
    imported = handles.open(_handle(other), fds(other))  # other files are still fine
    handles.release(imported)


def test_a_memfd_is_sealed_against_shrinking_and_mapped(table: HandleTable) -> None:
    memfd = os.memfd_create("od-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(memfd, SIZE)
        os.pwrite(memfd, b"in the memfd", 100)
        imported = table.open(_handle("memfd:od-test"), memfd)
        assert imported.sealed and imported.window is None
        with pytest.raises(PermissionError):
            os.ftruncate(memfd, SIZE // 2)
        os.ftruncate(memfd, SIZE * 2)  # growing is still fine
        # It cannot shrink and its tmpfs has no size limit: a fault in it is always served,
        # so copies go through the mapping.
        assert ctypes.string_at(imported.address + 100, 12) == b"in the memfd"
        table.release(imported)
    finally:
        os.close(memfd)


def test_a_memfd_that_cannot_be_sealed_is_reached_by_descriptor(table: HandleTable) -> None:
    memfd = os.memfd_create("od-test", os.MFD_CLOEXEC)  # born with F_SEAL_SEAL
    try:
        os.ftruncate(memfd, SIZE)
        imported = table.open(_handle("memfd:od-test"), memfd)
        assert not imported.sealed and imported.window is not None
        table.release(imported)
    finally:
        os.close(memfd)


def test_cuda_ipc_handles_are_refused_with_a_clear_message(table: HandleTable) -> None:
    handle = CudaIpcHandle(
        device_uuid="GPU-00000000-0000-0000-0000-000000000000",
        handle=b"\x00" * 64,
        storage_size=1 << 20,
        storage_offset=0,
        ref_counter_handle=b"ref",
        ref_counter_offset=0,
        event_handle=b"\x00" * 64,
        event_sync_required=False,
        offset=0,
        size=1 << 20,
    )
    with pytest.raises(HandleError, match="CUDA IPC handles need the cuda copy engine"):
        table.open(handle)
    assert len(table) == 0

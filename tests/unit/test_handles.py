"""offloadd.transfer.handles: the refcounted import table, on real files in /dev/shm."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator

import pytest

from offloadd.transfer.handles import HandleError, HandleTable
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
def table() -> Iterator[HandleTable]:
    handles = HandleTable(allowed_dirs=(SHM,))
    yield handles
    handles.close()


@pytest.fixture
def outside_dir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="od-h-", dir="/tmp")
    yield directory
    shutil.rmtree(directory)


def test_opening_one_file_twice_shares_one_mapping(table: HandleTable, shm_path: MakePath) -> None:
    path = shm_path()
    first = table.open(ShmHandle(path=path, offset=0, size=4096))
    second = table.open(ShmHandle(path=path, offset=4096, size=4096))
    assert len(table) == 1
    assert second.address == first.address + 4096
    assert (first.size, second.size) == (4096, 4096)
    table.release(first)
    assert len(table) == 1
    table.release(second)
    assert len(table) == 0


def test_same_file_through_another_name_shares_the_mapping(
    table: HandleTable, shm_path: MakePath
) -> None:
    path = shm_path()
    alias = shm_path(None)
    os.link(path, alias)
    a = table.open(ShmHandle(path=path, offset=0, size=SIZE))
    b = table.open(ShmHandle(path=alias, offset=0, size=SIZE))
    assert len(table) == 1
    assert a.address == b.address
    table.release(a)
    table.release(b)
    assert len(table) == 0


def test_retain_keeps_the_mapping_until_the_last_release(
    table: HandleTable, shm_path: MakePath
) -> None:
    imported = table.open(ShmHandle(path=shm_path(), offset=0, size=SIZE))
    table.retain(imported)  # e.g. a copy in flight
    table.release(imported)
    assert len(table) == 1
    table.release(imported)
    assert len(table) == 0


def test_bytes_written_at_the_address_are_in_the_file_and_back(
    table: HandleTable, shm_path: MakePath
) -> None:
    path = shm_path()
    imported = table.open(ShmHandle(path=path, offset=100, size=1000))
    ctypes.memmove(imported.address + 5, b"through the mapping", 19)
    with open(path, "rb") as f:
        f.seek(105)
        assert f.read(19) == b"through the mapping"
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"through the file", 600)
    finally:
        os.close(fd)
    assert ctypes.string_at(imported.address + 500, 16) == b"through the file"
    table.release(imported)


def test_close_unmaps_everything(table: HandleTable, shm_path: MakePath) -> None:
    table.open(ShmHandle(path=shm_path(), offset=0, size=SIZE))
    imported = table.open(ShmHandle(path=shm_path(), offset=0, size=SIZE))
    table.retain(imported)
    assert len(table) == 2
    table.close()
    assert len(table) == 0


def test_path_outside_the_allowed_dirs_is_refused(table: HandleTable, outside_dir: str) -> None:
    path = os.path.join(outside_dir, "kv")
    with open(path, "wb") as f:
        f.truncate(SIZE)
    with pytest.raises(HandleError, match="outside the shared-memory dirs"):
        table.open(ShmHandle(path=path, offset=0, size=SIZE))
    assert len(table) == 0


def test_dot_dot_out_of_the_allowed_dir_is_refused(table: HandleTable, outside_dir: str) -> None:
    path = os.path.join(outside_dir, "kv")
    with open(path, "wb") as f:
        f.truncate(SIZE)
    sneaky = os.path.join(SHM, "..", "..", os.path.relpath(path, "/"))
    assert os.path.exists(sneaky)
    with pytest.raises(HandleError, match="outside"):
        table.open(ShmHandle(path=sneaky, offset=0, size=SIZE))


def test_a_sibling_dir_sharing_the_prefix_is_not_allowed(outside_dir: str) -> None:
    allowed = os.path.join(outside_dir, "shm")
    sibling = os.path.join(outside_dir, "shm-evil")
    os.mkdir(allowed)
    os.mkdir(sibling)
    path = os.path.join(sibling, "kv")
    with open(path, "wb") as f:
        f.truncate(SIZE)
    handles = HandleTable(allowed_dirs=(allowed,))
    with pytest.raises(HandleError, match="outside"):
        handles.open(ShmHandle(path=path, offset=0, size=SIZE))
    # A file in a subdirectory of an allowed dir is fine.
    os.mkdir(os.path.join(allowed, "sub"))
    inside = os.path.join(allowed, "sub", "kv")
    with open(inside, "wb") as f:
        f.truncate(SIZE)
    imported = handles.open(ShmHandle(path=inside, offset=0, size=SIZE))
    handles.release(imported)
    assert len(handles) == 0


def test_symlink_out_of_the_allowed_dir_is_refused(
    table: HandleTable, shm_path: MakePath, outside_dir: str
) -> None:
    target = os.path.join(outside_dir, "secret")
    with open(target, "wb") as f:
        f.truncate(SIZE)
    link = shm_path(None)
    os.symlink(target, link)
    with pytest.raises(HandleError):
        table.open(ShmHandle(path=link, offset=0, size=SIZE))
    assert len(table) == 0


def test_directory_is_refused(table: HandleTable, shm_path: MakePath) -> None:
    directory = shm_path(None)
    os.mkdir(directory)
    with pytest.raises(HandleError):
        table.open(ShmHandle(path=directory, offset=0, size=1))
    assert len(table) == 0


def test_fifo_is_refused_as_not_a_regular_file(table: HandleTable, shm_path: MakePath) -> None:
    fifo = shm_path(None)
    os.mkfifo(fifo)
    with pytest.raises(HandleError, match="not a regular file"):
        table.open(ShmHandle(path=fifo, offset=0, size=1))
    assert len(table) == 0


def test_missing_file_is_refused(table: HandleTable, shm_path: MakePath) -> None:
    with pytest.raises(HandleError, match="cannot open"):
        table.open(ShmHandle(path=shm_path(None), offset=0, size=1))


def test_empty_file_is_refused(table: HandleTable, shm_path: MakePath) -> None:
    with pytest.raises(HandleError, match="empty"):
        table.open(ShmHandle(path=shm_path(0), offset=0, size=0))
    assert len(table) == 0


@pytest.mark.parametrize(
    ("offset", "size"),
    [(0, SIZE + 1), (SIZE, 1), (SIZE - 10, 11), (SIZE * 4, 0)],
)
def test_region_past_the_end_of_the_file_is_refused(
    table: HandleTable, shm_path: MakePath, offset: int, size: int
) -> None:
    with pytest.raises(HandleError, match="outside"):
        table.open(ShmHandle(path=shm_path(), offset=offset, size=size))
    assert len(table) == 0  # the mapping made for the check is not leaked


def test_region_past_the_end_keeps_an_existing_mapping_counted_right(
    table: HandleTable, shm_path: MakePath
) -> None:
    path = shm_path()
    good = table.open(ShmHandle(path=path, offset=0, size=SIZE))
    with pytest.raises(HandleError):
        table.open(ShmHandle(path=path, offset=1, size=SIZE))
    assert len(table) == 1
    table.release(good)
    assert len(table) == 0


@pytest.mark.parametrize(("offset", "size"), [(-4096, 4096), (-1, 1), (100, -50)])
def test_negative_offset_or_size_is_refused(
    table: HandleTable, shm_path: MakePath, offset: int, size: int
) -> None:
    # Handles are opened before the registry checks geometry: the table itself must never
    # hand out an address before the mapping.
    with pytest.raises(HandleError, match="negative"):
        table.open(ShmHandle(path=shm_path(), offset=offset, size=size))
    assert len(table) == 0


def test_the_arena_is_refused_under_any_name(shm_path: MakePath) -> None:
    arena = shm_path()
    alias = shm_path(None)
    os.link(arena, alias)
    link = shm_path(None)
    os.symlink(arena, link)
    handles = HandleTable(allowed_dirs=(SHM,), forbidden=[arena])
    for name in (arena, alias, link):
        with pytest.raises(HandleError, match="arena"):
            handles.open(ShmHandle(path=name, offset=0, size=SIZE))
    assert len(handles) == 0
    # Other files are still fine.
    imported = handles.open(ShmHandle(path=shm_path(), offset=0, size=SIZE))
    handles.release(imported)


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

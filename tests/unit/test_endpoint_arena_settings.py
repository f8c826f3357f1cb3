"""Endpoint claims, the arena file, and size parsing: small pieces with real files."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import pathlib
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from offloadd.cache.arena import Arena, ArenaError
from offloadd.endpoint import EndpointClaim, EndpointInUse, ipc_path
from offloadd.settings import AmbiguousSize, format_size, parse_size

SHM = "/dev/shm"
ARENA_SIZE = 1 << 20


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A short /tmp dir: unix socket paths are limited to 107 bytes."""
    directory = tempfile.mkdtemp(prefix="od-", dir="/tmp")
    yield directory
    shutil.rmtree(directory)


@pytest.fixture
def arena_path() -> Iterator[str]:
    if not os.path.isdir(SHM):
        pytest.skip("needs /dev/shm")
    path = os.path.join(SHM, f"offloadd-test-{os.getpid()}-{uuid.uuid4().hex[:10]}.arena")
    yield path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# --- EndpointClaim ------------------------------------------------------------------------


def test_ipc_path() -> None:
    assert ipc_path("ipc:///run/offloadd/offloadd.sock") == "/run/offloadd/offloadd.sock"
    assert ipc_path("tcp://127.0.0.1:5555") is None


def test_second_claim_of_a_held_path_is_refused(short_dir: str) -> None:
    endpoint = f"ipc://{short_dir}/d.sock"
    first = EndpointClaim(endpoint)
    try:
        with pytest.raises(EndpointInUse, match=endpoint):
            EndpointClaim(endpoint)
        # The refused claim must not have removed the holder's lock file.
        assert os.path.exists(f"{short_dir}/d.sock.lock")
    finally:
        first.release()
    again = EndpointClaim(endpoint)
    again.release()


def test_claim_writes_the_pid_into_the_lock_file(short_dir: str) -> None:
    claim = EndpointClaim(f"ipc://{short_dir}/d.sock")
    try:
        with open(f"{short_dir}/d.sock.lock") as f:
            assert f.read() == f"{os.getpid()}\n"
    finally:
        claim.release()


def test_stale_socket_without_a_live_lock_is_removed_and_claimed(short_dir: str) -> None:
    path = f"{short_dir}/d.sock"
    # A crashed daemon leaves its socket file and an unlocked lock file with an old pid.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    with open(path + ".lock", "w") as f:
        f.write("999999999\n")
    assert os.path.exists(path)
    claim = EndpointClaim(f"ipc://{path}")
    try:
        assert not os.path.exists(path)
        with open(path + ".lock") as f:
            assert f.read() == f"{os.getpid()}\n"
    finally:
        claim.release()


def test_a_live_lock_protects_the_socket_file(short_dir: str) -> None:
    path = f"{short_dir}/d.sock"
    with open(path, "w") as f:
        f.write("a live daemon's socket")
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(EndpointInUse):
            EndpointClaim(f"ipc://{path}")
        assert os.path.exists(path)
    finally:
        os.close(fd)


def test_release_removes_socket_and_lock_file_and_is_idempotent(short_dir: str) -> None:
    path = f"{short_dir}/d.sock"
    claim = EndpointClaim(f"ipc://{path}")
    with open(path, "w") as f:  # what binding would have created
        f.write("")
    claim.release()
    assert not os.path.exists(path)
    assert not os.path.exists(path + ".lock")
    claim.release()


def test_claim_creates_the_runtime_dir(short_dir: str) -> None:
    claim = EndpointClaim(f"ipc://{short_dir}/run/sub/d.sock")
    try:
        assert os.path.isdir(f"{short_dir}/run/sub")
        assert os.path.exists(f"{short_dir}/run/sub/d.sock.lock")
    finally:
        claim.release()


def test_too_long_path_is_a_value_error(short_dir: str) -> None:
    path = os.path.join(short_dir, "x" * (108 - len(short_dir)))
    assert len(path) == 109
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        EndpointClaim(f"ipc://{path}")
    assert os.listdir(short_dir) == []


def test_longest_allowed_path_is_claimed(short_dir: str) -> None:
    path = os.path.join(short_dir, "x" * (106 - len(short_dir)))
    assert len(path) == 107
    EndpointClaim(f"ipc://{path}").release()


def test_non_ipc_endpoints_claim_nothing(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a lock file named after the endpoint would land here
    open_fds = sorted(os.listdir("/proc/self/fd"))
    for endpoint in ("tcp://127.0.0.1:5555", "inproc://offloadd"):
        assert ipc_path(endpoint) is None
        claim = EndpointClaim(endpoint)
        again = EndpointClaim(endpoint)  # nothing is locked: a second claim is not in use
        assert claim.endpoint == again.endpoint == endpoint
        claim.release()
        claim.release()
        again.release()
    assert sorted(os.listdir("/proc/self/fd")) == open_fds  # no lock file was opened
    assert os.listdir(tmp_path) == []  # nor created


# --- Arena --------------------------------------------------------------------------------


def test_arena_creates_a_file_of_the_right_size(arena_path: str) -> None:
    arena = Arena(arena_path, ARENA_SIZE)
    try:
        assert os.stat(arena_path).st_size == ARENA_SIZE
        assert arena.size == ARENA_SIZE
        assert arena.path == arena_path
    finally:
        arena.close()


def test_second_arena_on_the_same_path_is_refused_while_open(arena_path: str) -> None:
    arena = Arena(arena_path, ARENA_SIZE)
    try:
        with pytest.raises(ArenaError, match="in use"):
            Arena(arena_path, ARENA_SIZE)
        # The refused attempt left the file alone.
        assert os.stat(arena_path).st_size == ARENA_SIZE
    finally:
        arena.close()
    again = Arena(arena_path, ARENA_SIZE)
    again.close()


def test_close_unlinks_and_is_idempotent(arena_path: str) -> None:
    arena = Arena(arena_path, ARENA_SIZE)
    arena.close()
    assert not os.path.exists(arena_path)
    arena.close()


def test_view_reads_back_written_bytes(arena_path: str) -> None:
    arena = Arena(arena_path, ARENA_SIZE)
    try:
        view = arena.view(4096, 11)
        view[:] = b"hello arena"
        view.release()
        again = arena.view(4096, 11)
        assert bytes(again) == b"hello arena"
        again.release()
        # The address is the same memory, and so is the file.
        assert ctypes.string_at(arena.address + 4096, 11) == b"hello arena"
        with open(arena_path, "rb") as f:
            f.seek(4096)
            assert f.read(11) == b"hello arena"
        ctypes.memmove(arena.address + ARENA_SIZE - 3, b"end", 3)
        tail = arena.view(ARENA_SIZE - 3, 3)
        assert bytes(tail) == b"end"
        tail.release()
    finally:
        arena.close()


@pytest.mark.parametrize(("offset", "size"), [(-1, 1), (ARENA_SIZE, 1), (ARENA_SIZE - 1, 2)])
def test_view_outside_the_arena_is_refused(arena_path: str, offset: int, size: int) -> None:
    arena = Arena(arena_path, ARENA_SIZE)
    try:
        with pytest.raises(ValueError, match="outside"):
            arena.view(offset, size)
    finally:
        arena.close()


def test_kept_arena_keeps_its_bytes_for_the_next_daemon(arena_path: str) -> None:
    first = Arena(arena_path, ARENA_SIZE, unlink_on_close=False)
    ctypes.memmove(first.address + 12345, b"survivor", 8)
    first.close()
    assert os.path.exists(arena_path)
    progress: list[float] = []
    second = Arena(arena_path, ARENA_SIZE, progress=progress.append)
    try:
        view = second.view(12345, 8)
        assert bytes(view) == b"survivor"  # pre-faulting must not clobber data
        view.release()
        assert progress[-1] == 1.0
    finally:
        second.close()


@pytest.mark.parametrize("size", [0, -1])
def test_arena_size_must_be_positive(arena_path: str, size: int) -> None:
    with pytest.raises(ArenaError, match="positive"):
        Arena(arena_path, size)
    assert not os.path.exists(arena_path)


def test_arena_directory_must_exist(short_dir: str) -> None:
    with pytest.raises(ArenaError, match="does not exist"):
        Arena(os.path.join(short_dir, "missing", "arena"), ARENA_SIZE)


def test_arena_larger_than_the_filesystem_is_refused(arena_path: str) -> None:
    with pytest.raises(ArenaError, match="does not fit"):
        Arena(arena_path, 1 << 62)


# --- sizes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("8GiB", 8 << 30),
        ("512MiB", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("4096", 4096),
        ("4096B", 4096),
        ("0", 0),
        ("64kib", 64 << 10),
        ("2TiB", 2 << 40),
        (" 8 GiB ", 8 << 30),
        ("0.5MiB", 512 << 10),
        ("1.3MiB", 1363148),  # 1363148.8: the fraction of a byte is dropped
        ("8Gi", 8 << 30),  # Kubernetes' short form is binary too
        # SI units are decimal: what an operator writing "8GB" reads on a disk's label.
        ("8GB", 8 * 10**9),
        ("8gb", 8 * 10**9),
        ("64kB", 64_000),
        ("64KB", 64_000),
        ("512MB", 512 * 10**6),
        ("1.5GB", 15 * 10**8),
        ("2TB", 2 * 10**12),
    ],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize(
    "text",
    ["", "GiB", "abc", "-1G", "8XB", "8 G B", "1.5.2G", "8PiB", "1e9", "0x10", "8GiBs", "8Gb s"],
)
def test_parse_size_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "binary", "decimal"),
    [
        ("8G", "8GiB (8589934592 bytes)", "8GB (8000000000 bytes)"),
        ("64k", "64KiB (65536 bytes)", "64KB (64000 bytes)"),
        ("1.5M", "1.5MiB (1572864 bytes)", "1.5MB (1500000 bytes)"),
        ("2T", "2TiB (2199023255552 bytes)", "2TB (2000000000000 bytes)"),
    ],
)
def test_a_bare_unit_is_refused_with_both_readings(text: str, binary: str, decimal: str) -> None:
    # 8G is 8 GiB to systemd and dd and 8 GB to Kubernetes: no guess either way.
    with pytest.raises(AmbiguousSize) as refused:
        parse_size(text)
    assert str(refused.value) == f"{text!r} is ambiguous: write {binary} or {decimal}"


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0B"),
        (512, "512B"),
        (1023, "1023B"),
        (1024, "1.0KiB"),
        (1536, "1.5KiB"),
        (512 << 20, "512.0MiB"),
        (3 << 29, "1.5GiB"),
        (8 << 30, "8.0GiB"),
        (1 << 40, "1.0TiB"),
        (3 << 41, "6.0TiB"),
        (2048 << 40, "2048.0TiB"),
    ],
)
def test_format_size(nbytes: int, text: str) -> None:
    assert format_size(nbytes) == text


@pytest.mark.parametrize("nbytes", [1024, 3 << 29, 512 << 20, 8 << 30, 5 << 40])
def test_format_then_parse_round_trips_exact_sizes(nbytes: int) -> None:
    assert parse_size(format_size(nbytes)) == nbytes

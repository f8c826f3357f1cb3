"""offloadd.peer and offloadd.server.peers: the registration socket on its own, with a real
event loop and real peers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import stat
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

import offloadd.server.peers
from offloadd.errors import DaemonUnavailable, InvalidRequest
from offloadd.peer import RegionFiles, register
from offloadd.server.peers import PeerListener
from protocol.handles import KVRegion, ShmHandle
from protocol.peer import (
    FDS_PER_MESSAGE,
    MAX_MESSAGE,
    Register,
    RegisterRefused,
    decode_peer_reply,
    encode_peer,
)
from tests.fakes import Clock


@pytest.fixture
def socket_dir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="od-peer-", dir="/tmp")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest_asyncio.fixture
async def listener(socket_dir: str) -> AsyncIterator[tuple[PeerListener, Clock, str]]:
    clock = Clock(1000.0)
    peers = PeerListener(
        f"{socket_dir}/d.sock.peer",
        socket_mode="0660",
        socket_group="",
        max_descriptors=300,
        per_uid=3,
        token_seconds=30.0,
        clock=clock,
    )
    peers.start(asyncio.get_running_loop())
    yield peers, clock, f"ipc://{socket_dir}/d.sock"
    peers.close()


def _kv_file() -> tuple[str, int]:
    path = f"/dev/shm/od-test-peer-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.ftruncate(fd, 8192)
    return path, fd


def _open_targets(path: str) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}") == path
    return count


@pytest.mark.asyncio
async def test_the_kernel_says_who_registered_and_the_files_come_along(
    listener: tuple[PeerListener, Clock, str],
) -> None:
    peers, _clock, endpoint = listener
    path, fd = _kv_file()
    try:
        identity = uuid.uuid4().bytes
        registered = await asyncio.to_thread(register, endpoint, identity, [fd])
        assert registered is not None
        assert (registered.uid, registered.gid, registered.pid) == (
            os.getuid(),
            os.getgid(),
            os.getpid(),
        )
        assert stat.S_IMODE(os.stat(peers.path).st_mode) == 0o660
        assert peers.take(registered.token, uuid.uuid4().bytes) is None  # not its identity
        assert peers.take(registered.token, identity) is None  # and so used up
        registered = await asyncio.to_thread(register, endpoint, identity, [fd])
        assert registered is not None
        taken = peers.take(registered.token, identity)
        assert taken is not None and taken.peer.pid == os.getpid()
        assert taken.pidfd is not None and not taken.exited()
        assert os.fstat(taken.fds[0]).st_ino == os.fstat(fd).st_ino
        assert peers.take(registered.token, identity) is None  # one time
        taken.close()
        assert _open_targets(path) == 1  # ours only: what was passed is closed again
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.asyncio
async def test_unused_tokens_expire_and_a_user_may_have_only_a_few(
    listener: tuple[PeerListener, Clock, str],
) -> None:
    peers, clock, endpoint = listener
    path, fd = _kv_file()
    try:
        identity = uuid.uuid4().bytes
        tokens = [
            (await asyncio.to_thread(register, endpoint, identity, [fd])).token  # type: ignore[union-attr]
            for _ in range(3)
        ]
        assert _open_targets(path) == 4
        with pytest.raises(InvalidRequest, match="registrations_per_uid"):
            await asyncio.to_thread(register, endpoint, identity, [fd])
        clock.now += 31
        assert peers.take(tokens[0], identity) is None
        assert len(peers) == 0 and _open_targets(path) == 1  # expired: descriptors closed
        assert await asyncio.to_thread(register, endpoint, identity, [fd]) is not None
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.asyncio
async def test_many_descriptors_travel_in_several_messages(
    listener: tuple[PeerListener, Clock, str],
) -> None:
    peers, _clock, endpoint = listener
    path, fd = _kv_file()
    copies = [os.dup(fd) for _ in range(FDS_PER_MESSAGE + 30)]
    try:
        identity = uuid.uuid4().bytes
        registered = await asyncio.to_thread(register, endpoint, identity, copies)
        assert registered is not None
        taken = peers.take(registered.token, identity)
        assert taken is not None and len(taken.fds) == len(copies)
        taken.close()
        with pytest.raises(InvalidRequest, match="regions_per_session"):
            await asyncio.to_thread(register, endpoint, identity, copies + copies)
        assert _open_targets(path) == 1 + len(copies)
    finally:
        for copy in copies:
            os.close(copy)
        os.close(fd)
        os.unlink(path)


def _raw_exchange(path: str, payload: bytes, fds: list[int] | None = None) -> RegisterRefused:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(path)
        socket.send_fds(sock, [payload], fds or [])
        reply = decode_peer_reply(sock.recv(MAX_MESSAGE))
    assert isinstance(reply, RegisterRefused), reply
    return reply


@pytest.mark.asyncio
async def test_garbage_a_wrong_version_and_a_lying_count_are_refused(
    listener: tuple[PeerListener, Clock, str],
) -> None:
    peers, _clock, _endpoint = listener
    path, fd = _kv_file()
    try:
        garbage = await asyncio.to_thread(_raw_exchange, peers.path, b"\xc1garbage")
        assert garbage.code == 1  # MALFORMED
        old = encode_peer(Register(99, b"id"))
        assert (await asyncio.to_thread(_raw_exchange, peers.path, old)).code == 2
        lying = encode_peer(Register(1, b"id", descriptors=0))
        refused = await asyncio.to_thread(_raw_exchange, peers.path, lying, [fd])
        assert "more than 0 descriptors" in refused.message
        assert _open_targets(path) == 1 and len(peers) == 0
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.asyncio
async def test_a_silent_connection_is_dropped(
    listener: tuple[PeerListener, Clock, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    peers, _clock, _endpoint = listener
    monkeypatch.setattr(offloadd.server.peers, "CONNECTION_SECONDS", 0.05)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(peers.path)
        assert await asyncio.to_thread(sock.recv, 16) == b""  # hung up on, nothing said


def test_no_registration_socket_on_tcp_and_none_listening_is_unavailable(socket_dir: str) -> None:
    assert register("tcp://127.0.0.1:5555", b"id") is None
    with pytest.raises(DaemonUnavailable, match="no daemon answers"):
        register(f"ipc://{socket_dir}/nothing.sock", b"id", timeout=1.0)


def test_region_files_number_each_file_once_and_allocate_its_pages() -> None:
    path, fd = _kv_file()
    os.close(fd)
    try:
        regions = [
            KVRegion(ShmHandle(path, 0, 4096), 1, 4096, 4096, ("a",)),
            KVRegion(ShmHandle(path, 4096, 4096), 1, 4096, 4096, ("b",)),
        ]
        files = RegionFiles.open(regions)
        try:
            assert [r.handle.fd for r in files.regions] == [0, 0]  # type: ignore[union-attr]
            assert len(files.fds) == 1
            assert os.fstat(files.fds[0]).st_blocks * 512 >= 8192  # no hole left
        finally:
            files.close()
    finally:
        os.unlink(path)


@pytest.mark.asyncio
async def test_who_registered_for_an_identity_is_known_until_its_token_is_used(
    listener: tuple[PeerListener, Clock, str],
) -> None:
    # The control socket's lanes queue a Hello on its way under its registrant's tenant.
    peers, clock, endpoint = listener
    identity, other = uuid.uuid4().bytes, uuid.uuid4().bytes
    assert peers.peer_of(identity) is None
    first = await asyncio.to_thread(register, endpoint, identity, [])
    second = await asyncio.to_thread(register, endpoint, identity, [])
    assert first is not None and second is not None
    found = peers.peer_of(identity)
    assert found is not None and (found.uid, found.pid) == (os.getuid(), os.getpid())
    assert peers.peer_of(other) is None
    taken = peers.take(first.token, identity)  # the older token: the last one still names it
    assert taken is not None
    taken.close()
    assert peers.peer_of(identity) is not None
    taken = peers.take(second.token, identity)
    assert taken is not None
    taken.close()
    assert peers.peer_of(identity) is None
    await asyncio.to_thread(register, endpoint, other, [])
    clock.now += 31
    assert peers.take(b"expire the rest", other) is None
    assert peers.peer_of(other) is None and len(peers) == 0

"""The registration socket's client end: a rank proves who it is and hands over its files.

The wire is ``protocol.peer``; the daemon end is ``offloadd.server.peers``.

- ``RegionFiles.open(regions, files)`` opens each shared-memory region's file with the rank's
  own rights (or duplicates a descriptor the caller already has, ``files`` by path), makes
  sure its pages exist (``posix_fallocate`` over what the regions use: a sparse region on a
  full tmpfs is refused here, with ENOSPC, not discovered by a copy) and numbers the
  descriptors into the handles (``ShmHandle.fd``).
- ``register(endpoint, identity, fds)`` performs the exchange and returns ``Registered``
  (None where the endpoint has no registration socket: ``tcp://``, ``inproc://``).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from offloadd.errors import DaemonUnavailable, error_from_reply
from protocol.handles import KVRegion, ShmHandle
from protocol.messages import Error
from protocol.peer import (
    FDS_PER_MESSAGE,
    MAX_MESSAGE,
    MORE_DESCRIPTORS,
    PEER_PROTOCOL_VERSION,
    Register,
    Registered,
    RegisterRefused,
    decode_peer_reply,
    encode_peer,
    peer_socket_path,
)

__all__ = ["RegionFiles", "register"]


@dataclass(eq=False)
class RegionFiles:
    """A rank's regions with their files' descriptors (the rank's own), numbered in order."""

    regions: tuple[KVRegion, ...]
    fds: list[int]

    @classmethod
    def open(
        cls, regions: Sequence[KVRegion], files: Mapping[str, int] | None = None
    ) -> RegionFiles:
        """Open (or duplicate, from ``files``) each shared-memory file once and allocate
        the bytes its regions use; raises OSError naming the file."""
        given = files or {}
        index: dict[str, int] = {}
        ends: dict[str, int] = {}
        for region in regions:
            handle = region.handle
            if isinstance(handle, ShmHandle):
                index.setdefault(handle.path, len(index))
                ends[handle.path] = max(ends.get(handle.path, 0), handle.offset + handle.size)
        fds: list[int] = []
        try:
            for path in index:
                if path in given:
                    fd = os.dup(given[path])
                else:
                    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                fds.append(fd)
                _allocate(fd, path, ends[path])
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        numbered = tuple(
            msgspec.structs.replace(
                region, handle=msgspec.structs.replace(region.handle, fd=index[region.handle.path])
            )
            if isinstance(region.handle, ShmHandle)
            else region
            for region in regions
        )
        return cls(numbered, fds)

    def close(self) -> None:
        """Close the descriptors. Idempotent."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def _allocate(fd: int, path: str, end: int) -> None:
    """Give every page the regions use a page of memory, without growing the file."""
    length = min(end, os.fstat(fd).st_size)
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, length)
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot allocate the {length} bytes of {path}: {exc.strerror}"
        ) from None


def register(
    endpoint: str, identity: bytes, fds: Sequence[int] = (), timeout: float = 10.0
) -> Registered | None:
    """Register with the daemon at ``endpoint`` (None where there is no registration socket).

    Raises ``DaemonUnavailable`` when nobody answers and a ``RequestFailed`` subclass when the
    daemon refuses.
    """
    path = peer_socket_path(endpoint)
    if path is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(max(timeout, 0.001))
        try:
            sock.connect(path)
            first = encode_peer(Register(PEER_PROTOCOL_VERSION, identity, len(fds)))
            for start in range(0, max(len(fds), 1), FDS_PER_MESSAGE):
                payload = first if start == 0 else MORE_DESCRIPTORS
                socket.send_fds(sock, [payload], list(fds[start : start + FDS_PER_MESSAGE]))
            data = sock.recv(MAX_MESSAGE)
        except (OSError, TimeoutError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise DaemonUnavailable(
                f"no daemon answers at {endpoint} (registration socket {path}: {reason})"
            ) from None
    finally:
        sock.close()
    try:
        reply = decode_peer_reply(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise DaemonUnavailable(f"no valid answer from {endpoint} ({path})") from None
    if isinstance(reply, RegisterRefused):
        raise error_from_reply(Error(0, reply.code, reply.message))
    return reply

"""Claiming an ``ipc://`` control path so that a second daemon cannot silently take it over.

libzmq lets a second process bind an ipc path that a live process serves (the first one
silently loses it). A lock file beside the socket, held with ``flock`` for the daemon's
lifetime, decides: if it is locked a live daemon owns the path; if not, any socket file
there is stale (left by a crash) and is removed before binding.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

_SUN_PATH_MAX = 107


class EndpointInUse(Exception):
    """Another live daemon serves this endpoint."""


class EndpointRefused(Exception):
    """The endpoint cannot be served safely as configured (the message says what to set)."""


_LOOPBACK = ("127.", "localhost", "[::1]", "::1")


def check_tcp_security(endpoint: str, curve_secret_key_file: str) -> None:
    """A tcp control endpoint off loopback must use CURVE (anyone could store and load)."""
    if not endpoint.startswith("tcp://") or curve_secret_key_file:
        return
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    if not host.startswith(_LOOPBACK):
        raise EndpointRefused(
            f"{endpoint} is reachable from other hosts: set server.curve_secret_key_file "
            "(and server.curve_clients_dir) or use an ipc:// endpoint"
        )


def restrict_socket(path: str, mode: str, group: str) -> None:
    """Give the ipc socket file ``mode`` (octal string) and ``group``: who may connect."""
    if group:
        import grp

        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise EndpointRefused(f"server.socket_group {group!r} does not exist") from None
        os.chown(path, -1, gid)
    os.chmod(path, int(mode, 8))


def ipc_path(endpoint: str) -> str | None:
    """The filesystem path of an ``ipc://`` endpoint, else None."""
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


class EndpointClaim:
    """Holds the lock of one ipc path; ``release()`` removes socket and lock file."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        path = ipc_path(endpoint)
        self._path = path
        self._lock_fd: int | None = None
        if path is None:
            return
        if len(path.encode()) > _SUN_PATH_MAX:
            raise ValueError(f"ipc path {path!r} is longer than {_SUN_PATH_MAX} bytes")
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, mode=0o750, exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise EndpointInUse(f"a live offloadd already serves {endpoint}") from exc
            raise
        self._lock_fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        if os.path.exists(path):
            os.unlink(path)  # stale: its owner no longer holds the lock

    def release(self) -> None:
        """Remove the socket file and drop the lock. Idempotent."""
        if self._lock_fd is None or self._path is None:
            return
        for leftover in (self._path, self._path + ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
        os.close(self._lock_fd)
        self._lock_fd = None

"""Who may reach the daemon's endpoints, and claiming an ``ipc://`` path for one daemon.

libzmq lets a second process bind an ipc path that a live process serves (the first one
silently loses it). A lock file beside the socket, held with ``flock`` for the daemon's
lifetime, decides: if it is locked a live daemon owns the path; if not, any socket file
there is stale (left by a crash) and is removed before binding.

Every ipc socket the daemon binds (control, KV events, replay, metrics) lives in a directory
only the daemon's user can change (``prepare_ipc_dir``), is created with no access for
anyone else and then given ``server.socket_mode`` and ``server.socket_group``
(``restrict_socket``); whoever binds one removes its file at close (``remove_socket_file``
for the zmq ones, which libzmq leaves behind). A tcp control endpoint off loopback needs
CURVE with a client allow-list, and a secret key file nobody else can read
(``check_tcp_security``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import os
import socket
from collections.abc import Callable, Iterator
from typing import TypeVar

from offloadd.safety import private_dir_problem, secret_file_problem

_SUN_PATH_MAX = 107
_T = TypeVar("_T")


class EndpointInUse(Exception):
    """Another live daemon serves this endpoint."""


class EndpointRefused(Exception):
    """The endpoint cannot be served safely as configured (the message says what to set)."""


def is_loopback(endpoint: str) -> bool:
    """Whether a ``tcp://HOST:PORT`` endpoint listens on loopback only."""
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name, or a host name that may resolve anywhere


def check_tcp_security(
    endpoint: str, curve_secret_key_file: str, curve_clients_dir: str = ""
) -> None:
    """A tcp control endpoint off loopback must use CURVE and admit listed clients only
    (anyone who reaches it could store and load); a CURVE secret key must be private."""
    if not endpoint.startswith("tcp://"):
        return
    if curve_secret_key_file:
        problem = secret_file_problem(curve_secret_key_file)
        if problem:
            raise EndpointRefused(f"server.curve_secret_key_file: {problem}")
    if curve_clients_dir:
        problem = private_dir_problem(curve_clients_dir)
        if problem:
            raise EndpointRefused(f"server.curve_clients_dir: {problem}")
    if is_loopback(endpoint):
        return
    if not curve_secret_key_file or not curve_clients_dir:
        raise EndpointRefused(
            f"{endpoint} is reachable from other hosts: set server.curve_secret_key_file and "
            "server.curve_clients_dir (the public keys of the clients allowed in), or use an "
            "ipc:// endpoint"
        )


def prepare_ipc_dir(path: str) -> None:
    """Create the directory of the ipc socket ``path`` if needed, and refuse one that anyone
    but the daemon's user could change (they could replace the socket with their own)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o750, exist_ok=True)
    problem = private_dir_problem(directory)
    if problem:
        raise EndpointRefused(f"socket directory of {path}: {problem}")


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Files created inside get no access for group and others (then set as configured)."""
    previous = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(previous)


def bind_ipc(bind: Callable[[], _T], path: str, mode: str, group: str) -> _T:
    """``bind()`` a socket at ``path`` in a checked directory, private from its first
    instant, then give it ``mode`` and ``group``."""
    prepare_ipc_dir(path)
    with private_umask():
        bound = bind()
    restrict_socket(path, mode, group)
    return bound


def socket_file(path: str) -> tuple[int, int] | None:
    """``(device, inode)`` of the file at ``path``, None when there is none: what
    ``remove_socket_file`` compares, taken right after the bind."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def remove_socket_file(path: str, bound: tuple[int, int] | None) -> None:
    """Remove the ipc socket file at ``path`` if it is still the one this process bound
    (``bound``, from ``socket_file``). libzmq leaves the file of a socket it closes, and
    binds over a file that is there: one another process bound since stays its own."""
    if bound is not None and socket_file(path) == bound:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


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
        prepare_ipc_dir(path)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path + ".lock", flags, 0o600)
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


NODE_RUNTIME_DIR = "/run/offloadd"  # the node daemon's directory (systemd RuntimeDirectory=)


def runtime_dir(*, service: bool = True) -> str:
    """Where the control socket lives when no endpoint is given.

    The daemon under systemd uses its ``$RUNTIME_DIRECTORY``; anyone else (the daemon run by
    hand, and every client, which must not take the runtime directory of whatever service
    runs it: ``service=False``) takes ``/run/offloadd`` where it exists, so the daemon's and
    the ranks' defaults agree on a node whatever their environments; then the per-user
    ``$XDG_RUNTIME_DIR/offloadd`` and ``/tmp/offloadd-<uid>``.
    """
    systemd_dir = os.environ.get("RUNTIME_DIRECTORY") if service else None
    if systemd_dir:
        return systemd_dir.split(":")[0]
    if os.path.isdir(NODE_RUNTIME_DIR):
        return NODE_RUNTIME_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "offloadd")
    return f"/tmp/offloadd-{os.getuid()}"


def state_dir() -> str:
    """Where the journal lives when none is given: kept across restarts, private."""
    systemd_dir = os.environ.get("STATE_DIRECTORY")
    if systemd_dir:
        return systemd_dir.split(":")[0]
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg:
        return os.path.join(xdg, "offloadd")
    return os.path.join(os.path.expanduser("~"), ".local", "state", "offloadd")


def default_endpoint(*, service: bool = True) -> str:
    """``ipc://<runtime dir>/offloadd.sock`` (``service=False``: as a client finds it)."""
    return f"ipc://{os.path.join(runtime_dir(service=service), 'offloadd.sock')}"


def offset_endpoint_port(endpoint: str, k: int) -> str:
    """The endpoint of dp index ``k``, as vLLM derives it.

    ``tcp://host:P`` -> ``tcp://host:(P+k)``, ``inproc://x`` -> ``inproc://x_dp{k}``;
    ``k == 0`` returns the endpoint unchanged. Other schemes (``ipc://`` included) cannot
    be offset and raise ValueError.
    """
    if k < 0:
        raise ValueError(f"dp index must be >= 0, not {k}")
    if k == 0 or not endpoint:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{k}"
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if not sep or base == "tcp" or not port.isdigit():
            raise ValueError(
                f"cannot offset {endpoint!r} for dp index {k}: it needs an explicit port "
                "(tcp://host:PORT)"
            )
        return f"{base}:{int(port) + k}"
    raise ValueError(
        f"cannot offset {endpoint!r} for dp index {k}: only tcp:// and inproc:// endpoints "
        "get one endpoint per dp index (set port_per_dp = false to share one publisher)"
    )


def replay_beside(endpoint: str) -> str:
    """The replay endpoint beside a PUB endpoint in the daemon's default layout: port + 1
    beside ``tcp://`` (as 5557 and 5558), ``PATH.replay`` beside ``ipc://PATH.events``; ``""``
    for other endpoints, which have no such neighbour."""
    path = ipc_path(endpoint)
    if path is not None:
        stem, dot, suffix = path.rpartition(".")
        return f"ipc://{stem}.replay" if dot and suffix == "events" else ""
    if not endpoint.startswith("tcp://"):
        return ""
    try:
        guess = offset_endpoint_port(endpoint, 1)
    except ValueError:
        return ""
    return guess if int(guess.rpartition(":")[2]) <= 65535 else ""


_WILDCARD_HOSTS = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]", "[*]": "[::1]"}


def connectable(endpoint: str) -> str:
    """An endpoint a process on this node can connect to: a wildcard host becomes loopback.

    ``tcp://*:5557`` and ``tcp://0.0.0.0:5557`` -> ``tcp://127.0.0.1:5557``; anything else is
    returned unchanged.
    """
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if sep and host in _WILDCARD_HOSTS:
        return f"tcp://{_WILDCARD_HOSTS[host]}:{port}"
    return endpoint


def nobody_listens(endpoint: str) -> bool:
    """Whether a connection to ``endpoint`` is refused at once: no process serves it (a
    daemon that died, even leaving its socket file, or has not started yet).

    A frozen daemon's socket still takes connections into its listen backlog (False): only
    its answer is late. ``inproc://``, other schemes, and hosts that do not resolve: False.
    """
    path = ipc_path(endpoint)
    address: str | tuple[str, int]
    if path is not None:
        family = socket.AF_UNIX
        address = "\0" + path[1:] if path.startswith("@") else path  # abstract namespace
    elif endpoint.startswith("tcp://"):
        host, _, port = connectable(endpoint)[len("tcp://") :].rpartition(":")
        family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
        address = (host.strip("[]"), int(port))
    else:
        return False
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.1)
            code = probe.connect_ex(address)
    except (OSError, ValueError):
        return False
    return code in (errno.ENOENT, errno.ECONNREFUSED)

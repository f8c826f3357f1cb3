"""What ``serve`` needs from the machine, checked before anything is built or pre-faulted.

``preflight(settings)`` returns one ``Check`` per need: every endpoint can be bound (each
tcp port is bound and released at once; an ipc socket's directory is one only the daemon's
user can change, and no live daemon holds the path), the arena's directory takes the file
and its file system has room for ``cache.capacity``, as has the memory this process may take
(its cgroup's limit, else the machine's: ``offloadd.server.memory``), the state directory
keeps the journal privately, the disk tier's directory is usable, the copy engine can
run here, and the daemon's own uid is in no tenant's ``tenancy.uid_ranges``.
``offloadd check-config --preflight`` prints them; ``serve`` runs the same checks first, so a
busy port or an unwritable arena stops it in a second, not after minutes of pre-faulting.
A check names the setting it is about and the path or address.

Checks create nothing: a missing directory passes when its nearest existing parent would
let the daemon create it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from offloadd.cache.journal import shm_dirs_problem
from offloadd.endpoint import check_tcp_security, ipc_path
from offloadd.safety import private_dir_problem, secret_file_problem
from offloadd.server.memory import MemoryLimit, available_memory
from offloadd.settings import (
    UNIX_PREFIX,
    Settings,
    format_size,
    parse_address,
)
from offloadd.transfer.choice import choose_copy_engine, cuda_copy_problem

__all__ = ["Check", "PreflightError", "capacity_problem", "preflight", "raise_on_failure"]


@dataclass(frozen=True)
class Check:
    """One need of ``serve``: ``what`` it is about, and ``problem`` ("" when it is met)."""

    what: str
    problem: str = ""

    @property
    def ok(self) -> bool:
        """Whether the need is met."""
        return not self.problem


class PreflightError(Exception):
    """``serve`` cannot start here; the message is the first failed check."""


def preflight(
    settings: Settings, *, claimed: bool = False, copy_engine: bool = True
) -> list[Check]:
    """Every check, in the order ``serve`` meets them. ``claimed``: the caller is the daemon
    about to open the arena, holding the control endpoint's claim already (the arena's own
    open, which comes next and before any pre-faulting, checks its file and room itself, and
    says more: who owns a file it refuses); ``copy_engine=False``: the caller brings its own."""
    checks = []
    settings = settings.exposed()
    endpoint = settings.endpoint()
    if not (claimed and ipc_path(endpoint) is not None):
        checks.append(_endpoint_check("server.endpoint", endpoint, settings))
    if settings.events.enabled and settings.events.endpoint:
        checks.append(_endpoint_check("events.endpoint", settings.events.endpoint, settings))
        if settings.events.replay_endpoint:
            checks.append(
                _endpoint_check("events.replay_endpoint", settings.events.replay_endpoint, settings)
            )
    if settings.metrics.address:
        checks.append(_metrics_check(settings.metrics.address))
    if not claimed:
        checks.append(_arena_check(settings))
    if settings.cache.persist:
        checks.append(_journal_check(settings.journal_path(), settings.server.shm_dirs))
    if settings.disk.path:
        checks.append(_named("disk.path", settings.disk.path, _creatable_dir(settings.disk.path)))
    if copy_engine:
        checks.append(_copy_engine_check(settings.server.copy_engine))
    if settings.tenancy.uid_ranges:
        checks.append(_uid_ranges_check(settings))
    return checks


def raise_on_failure(
    settings: Settings, *, claimed: bool = False, copy_engine: bool = True
) -> None:
    """Raise ``PreflightError`` with the first failed check (``serve`` calls this first)."""
    for check in preflight(settings, claimed=claimed, copy_engine=copy_engine):
        if not check.ok:
            raise PreflightError(f"{check.what}: {check.problem}")


def _uid_ranges_check(settings: Settings) -> Check:
    """The daemon's own user in a tenant's range would make that tenant's engines the owner of
    the arena, journal and sockets: refused."""
    uid = os.geteuid()
    for first, last, name in settings.tenancy.uid_range_table():
        if first <= uid <= last:
            return Check(
                "tenancy.uid_ranges",
                f"the daemon's own uid {uid} is in tenant {name}'s range {first}-{last}: run "
                "the daemon as a uid no tenant has",
            )
    return Check("tenancy.uid_ranges")


def _named(setting: str, value: str, problem: str) -> Check:
    return Check(f"{setting} {value}", problem)


def _endpoint_check(setting: str, endpoint: str, settings: Settings) -> Check:
    path = ipc_path(endpoint)
    if path is not None:
        return _named(setting, endpoint, _ipc_problem(path))
    if endpoint.startswith("tcp://"):
        if setting == "server.endpoint":
            try:
                check_tcp_security(
                    endpoint,
                    settings.server.curve_secret_key_file,
                    settings.server.curve_clients_dir,
                )
            except Exception as exc:
                return _named(setting, endpoint, str(exc))
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if port.isdigit():
            return _named(setting, endpoint, _bind_problem(host, int(port)))
    return _named(setting, endpoint, "")  # inproc:// or a wildcard port: nothing to hold


def _metrics_check(address: str) -> Check:
    if address.startswith(UNIX_PREFIX):
        return _named("metrics.address", address, _ipc_problem(address[len(UNIX_PREFIX) :]))
    try:
        host, port = parse_address(address)
    except ValueError as exc:
        return _named("metrics.address", address, str(exc))
    return _named("metrics.address", address, _bind_problem(host, port))


def _bind_problem(host: str, port: int) -> str:
    """Why ``host:port`` cannot be bound now ("" when it can; it is released at once)."""
    if port == 0:
        return ""
    host = host.strip("[]")
    if host in ("*", ""):
        host = "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As the daemon's own sockets do (zmq and http.server both set it), so a port in
        # TIME_WAIT after a restart is not reported busy.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            busy = " (another process has it)" if exc.errno == errno.EADDRINUSE else ""
            return f"cannot bind {host}:{port}: {exc.strerror or exc}{busy}"
    return ""


def _ipc_problem(path: str) -> str:
    """Why the daemon cannot serve an ipc socket at ``path`` ("" when it can)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(directory):
        return _creatable_dir(directory)
    problem = private_dir_problem(directory)
    if problem:
        return f"socket directory: {problem}"
    lock = path + ".lock"
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return "a live offloadd already serves it"
        finally:
            os.close(fd)
    return ""


def _creatable_dir(path: str) -> str:
    """Why the daemon could not use (or create) the directory ``path`` ("" when it can)."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory"
    # Asked of the file system itself: permission bits say nothing for root, nor for a
    # read-only mount or one (sysfs, procfs) that takes no new files.
    try:
        os.close(os.open(existing, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600))
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return f"{existing} is not writable by uid {os.geteuid()}: {exc.strerror}"
        return _named_file_problem(existing)
    return ""


def _named_file_problem(directory: str) -> str:
    """The same question where the file system has no O_TMPFILE: make a file and remove it."""
    name = os.path.join(directory, f".offloadd-preflight-{os.getpid()}")
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR, 0o600)
    except OSError as exc:
        return f"{directory} is not writable by uid {os.geteuid()}: {exc.strerror}"
    os.close(fd)
    os.unlink(name)
    return ""


def _arena_check(settings: Settings) -> Check:
    path = settings.arena_path()
    capacity = settings.cache.capacity
    directory = os.path.dirname(path)
    problem = _creatable_dir(directory)
    if not problem and os.path.lexists(path):
        problem = _file_problem(path, lambda info: os.access(path, os.R_OK | os.W_OK))
    if not problem:
        problem = capacity_problem(capacity)
    if not problem and os.path.isdir(directory):
        info = os.statvfs(directory)
        existing = os.stat(path).st_size if os.path.exists(path) else 0
        free = info.f_bavail * info.f_frsize + existing
        if capacity > free:
            problem = (
                f"cache.capacity {format_size(capacity)} does not fit: {directory} has "
                f"{format_size(free)} free"
            )
    return _named("cache.arena", path, problem)


def capacity_problem(capacity: int, memory: MemoryLimit | None = None) -> str:
    """Why an arena of ``capacity`` bytes cannot be pre-faulted here: more than the memory
    this process may take (``memory``, by default ``available_memory()``: its cgroup's limit,
    else the machine's); "" when it fits (or nothing says how much there is)."""
    memory = memory or available_memory()
    if not memory.nbytes or capacity <= memory.nbytes:
        return ""
    return (
        f"cache.capacity {format_size(capacity)} is more than {memory.what}, "
        f"{format_size(memory.nbytes)}"
    )


def _file_problem(path: str, usable: Callable[[os.stat_result], bool]) -> str:
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file"
    if not usable(info):
        return f"{path} is not readable and writable by uid {os.geteuid()}"
    return ""


def _journal_check(journal: str, shm_dirs: Sequence[str]) -> Check:
    directory = os.path.dirname(journal)
    problem = shm_dirs_problem(journal, shm_dirs)
    if problem:
        return Check(f"cache.journal {journal}", problem)
    if os.path.lexists(directory):
        problem = private_dir_problem(directory)
    else:
        problem = _creatable_dir(directory)
    key = journal + ".key"
    if not problem and os.path.lexists(key):
        problem = secret_file_problem(key)
    return _named("cache.journal", journal, problem)


def _copy_engine_check(configured: str) -> Check:
    engine, why = choose_copy_engine(configured)
    problem = cuda_copy_problem() if engine == "cuda" and not why else ""
    what = f"server.copy_engine {configured}" + (f" (runs {engine}: {why})" if why else "")
    return Check(what, problem)

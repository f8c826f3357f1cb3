"""Connections each ZeroMQ socket keeps, per uid and in all: no client exhausts the descriptors.

libzmq accepts on its own I/O thread, and its ipc listener aborts the process when ``accept``
fails with ``EMFILE`` (``ipc_listener.cpp`` asserts on every errno but a short list, which
lacks it); no socket or context option bounds the connections a listener accepts
(``ZMQ_MAX_SOCKETS`` counts ZeroMQ sockets, not their connections). So the daemon watches each
listening socket's monitor and closes a newcomer beyond the bounds as soon as libzmq reports
it accepted: the connection lasts one accept, and the descriptors held stay below the limit.

- ``Tally`` (pure): the connections of one socket by descriptor and uid.
  ``accepted(fd, uid)`` says whether a new connection is kept (False: more than ``per_socket``
  in all, or ``per_uid`` of that uid); ``closed(fd)`` forgets one, kept or refused.
- ``raise_nofile()`` lifts the soft descriptor limit to the hard one at start;
  ``nofile_problem`` says when the bounds would not stay below it (the daemon warns).
- ``ConnectionGate``: ``watch(sock, name)`` (on the loop, before ``bind``) starts monitoring a
  socket; a thread of its own reads the monitors (the loop may be busy), reads each accepted
  connection's uid from the kernel (``SO_PEERCRED``; every tcp peer is ``REMOTE_UID``) and
  shuts a refused one down, which makes libzmq close it. ``close()`` (idempotent) stops the
  thread and closes the monitors; call it before the context is terminated.

What this does not do: refuse before ``accept`` (libzmq owns the listener). A burst that
outruns the thread between two of its reads still takes descriptors until it catches up:
the bounds sit far below the descriptor limit (``raise_nofile`` lifts the soft limit to the
hard one at start) so that the headroom absorbs it. A descriptor number libzmq reuses before
the thread reads its event may be judged by its new peer's uid (never a crash; at worst one
connection closed or kept wrongly, once).
"""

from __future__ import annotations

import contextlib
import logging
import resource
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from offloadd.logs import LogLimiter

__all__ = ["REMOTE_UID", "ConnectionGate", "Tally", "nofile_problem", "raise_nofile"]

logger = logging.getLogger(__name__)

REMOTE_UID = -1  # every peer of a tcp endpoint: no kernel identity
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
_UCRED = struct.Struct("3i")
_POLL_MS = 100


@dataclass
class Tally:
    """The open connections of one socket, by descriptor, and how many each uid has."""

    per_socket: int
    per_uid: int
    uids: dict[int, int] = field(default_factory=dict)  # fd -> uid, kept connections
    counts: Counter[int] = field(default_factory=Counter)
    refused: set[int] = field(default_factory=set)  # shut down, not yet closed by libzmq

    def accepted(self, fd: int, uid: int) -> bool:
        """Whether the connection libzmq accepted as ``fd`` from ``uid`` is kept."""
        self.closed(fd)  # a descriptor reused before its close was seen
        if len(self.uids) >= self.per_socket or self.counts[uid] >= self.per_uid:
            self.refused.add(fd)
            return False
        self.uids[fd] = uid
        self.counts[uid] += 1
        return True

    def closed(self, fd: int) -> None:
        """Forget the connection ``fd`` (libzmq closed it)."""
        self.refused.discard(fd)
        uid = self.uids.pop(fd, None)
        if uid is not None:
            self.counts[uid] -= 1
            if not self.counts[uid]:
                del self.counts[uid]

    def problem(self, uid: int) -> str:
        """Which bound a refusal of ``uid`` hit, for the log."""
        if len(self.uids) >= self.per_socket:
            return f"{len(self.uids)} connections open (limits.socket_connections)"
        return f"uid {uid} has {self.counts[uid]} open (limits.socket_connections_per_uid)"


def raise_nofile() -> int:
    """Lift the soft descriptor limit to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


def nofile_problem(sockets: int, per_socket: int, metrics: int, nofile: int) -> str:
    """Why the connection bounds do not sit below the descriptor limit ("" when they do):
    ``sockets`` ZeroMQ sockets of ``per_socket`` connections each and ``metrics``
    connections, with half the limit left for everything else (regions, registrations)."""
    held = sockets * per_socket + metrics
    if held <= nofile // 2:
        return ""
    return (
        f"{sockets} ZeroMQ sockets of limits.socket_connections = {per_socket} and "
        f"limits.metrics_connections = {metrics} may hold {held} descriptors, more than half "
        f"the descriptor limit ({nofile}): raise LimitNOFILE or lower them"
    )


def _peer_uid(fd: int) -> int | None:
    """The uid of the peer on ``fd`` (REMOTE_UID off unix sockets); None once it is gone."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.family != socket.AF_UNIX:
            return REMOTE_UID
        _pid, uid, _gid = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        return int(uid)
    except OSError:
        return None
    finally:
        sock.detach()  # libzmq owns the descriptor


def _shut(fd: int) -> None:
    """Shut the connection on ``fd`` down: libzmq reads its end and closes it."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


@dataclass
class _Watched:
    name: str
    address: str
    tally: Tally
    monitor: zmq.Socket[bytes] | None = None


class ConnectionGate:
    """Bounds the connections of the ZeroMQ sockets it watches; see the module docstring."""

    def __init__(self, ctx: zmq.Context[Any], per_socket: int, per_uid: int) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
        self._per_socket = per_socket
        self._per_uid = per_uid
        self._lock = threading.Lock()
        self._new: list[_Watched] = []
        self._watched: list[_Watched] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warn = LogLimiter(logger)
        self.refused = 0  # connections closed for a bound, all sockets together

    def watch(self, sock: zmq.Socket[Any], name: str) -> None:
        """Bound ``sock``'s connections from now on (call before it binds)."""
        if self._stop.is_set():
            return
        address = f"inproc://offloadd-connections-{id(self)}-{name}-{id(sock)}"
        sock.monitor(address, _EVENTS)
        with self._lock:
            self._new.append(_Watched(name, address, Tally(self._per_socket, self._per_uid)))
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="offloadd-connections", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Stop watching; idempotent. The monitors close on the gate's thread."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(5)

    def __enter__(self) -> ConnectionGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                with self._lock:
                    new, self._new = self._new, []
                for watched in new:
                    monitor = self._ctx.socket(zmq.PAIR)
                    monitor.setsockopt(zmq.LINGER, 0)
                    monitor.connect(watched.address)
                    watched.monitor = monitor
                    poller.register(monitor, zmq.POLLIN)
                    self._watched.append(watched)
                for monitor, _ in poller.poll(_POLL_MS):
                    watched = next(w for w in self._watched if w.monitor is monitor)
                    if not self._drain(watched):
                        poller.unregister(monitor)
                        monitor.close(linger=0)
                        self._watched.remove(watched)
        except Exception:
            logger.exception("the connection gate stopped; connections are no longer bounded")
        finally:
            for watched in self._watched:
                if watched.monitor is not None:
                    watched.monitor.close(linger=0)
            self._watched = []

    def _drain(self, watched: _Watched) -> bool:
        """Judge every event queued on ``watched``'s monitor; False once it stopped."""
        monitor = watched.monitor
        assert monitor is not None
        events: list[tuple[int, int]] = []
        with contextlib.suppress(zmq.Again):
            while True:
                message = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
                events.append((int(message["event"]), int(message["value"])))
        # A connection that closed within this batch is not judged: its descriptor may
        # already be another peer's.
        last_close = {
            fd: i for i, (event, fd) in enumerate(events) if event == zmq.EVENT_DISCONNECTED
        }
        tally, alive = watched.tally, True
        for i, (event, fd) in enumerate(events):
            if event == zmq.EVENT_MONITOR_STOPPED:
                alive = False
            elif event == zmq.EVENT_DISCONNECTED:
                tally.closed(fd)
            elif last_close.get(fd, -1) > i:
                continue
            else:
                uid = _peer_uid(fd)
                if uid is not None and not tally.accepted(fd, uid):
                    _shut(fd)
                    self.refused += 1
                    self._warn(
                        logging.WARNING,
                        "refused a connection to the %s socket: %s",
                        watched.name,
                        tally.problem(uid),
                    )
        return alive


def open_connection_gate(
    ctx: zmq.Context[Any], limits: Any, sockets: int, metrics: int
) -> ConnectionGate:
    """The gate of a daemon's ZeroMQ sockets (``sockets`` of them; ``metrics``: the metrics
    server's bound, 0 without one), after raising the soft descriptor limit to the hard one:
    libzmq aborts on a descriptor it cannot get. Warns where the bounds could exhaust it."""
    nofile = raise_nofile()
    gate = ConnectionGate(ctx, limits.socket_connections, limits.socket_connections_per_uid)
    problem = nofile_problem(sockets, limits.socket_connections, metrics, nofile)
    if problem:
        logger.warning("connections may exhaust the descriptors: %s", problem)
    return gate

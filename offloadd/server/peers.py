"""The registration socket's daemon end: who a local peer is (from the kernel) and the files it
hands over. The wire is ``protocol.peer``; the client end is ``offloadd.peer``.

``PeerListener`` (runs on the daemon's event loop, never blocks it):
- ``start(loop)`` binds the ``SOCK_SEQPACKET`` socket beside the ipc control endpoint, private
  from its first instant, then gives it ``server.socket_mode`` and ``server.socket_group``
  like the control socket (the directory was checked when the endpoint was claimed).
- For each connection it reads ``SO_PEERCRED`` (uid, gid, pid in the daemon's pid namespace)
  and takes a pidfd of the peer at once (``SO_PEERPIDFD``, else ``pidfd_open``), so a pid
  reused later cannot be mistaken for it. Then it reads ``Register`` and the descriptors that
  come with it (over several messages when there are more than ``FDS_PER_MESSAGE``), answers
  ``Registered`` with a random one-time token, and closes the connection. A connection that
  says nothing within ``CONNECTION_SECONDS`` is dropped. A uid may hold at most
  ``connections_per_uid`` registration connections open (more are answered ``TOO_LARGE`` and
  closed at once), and all uids together at most ``MAX_CONNECTIONS``, so one user's idle
  connections never stop another's registrations.
- Descriptors per uid: a ``Register`` is refused (``TOO_LARGE``) when the descriptors it
  announces, with those the uid's waiting registrations and open connections hold and those
  its live sessions keep (``live_descriptors(uid)``, set by the sessions), would pass
  ``descriptors_per_uid``.
- ``take(token, identity)`` hands the ``Registration`` to the Hello (or GetStats) that brings
  its token from the ZeroMQ identity it names, once; the caller then owns it and ``close()``s
  it (its descriptors; the pidfd unless taken). ``peer_of(identity)``: who registered last for that
  identity and has not brought its token yet (the control socket's lanes queue the requests
  of a peer with no session under its tenant). Tokens expire after ``token_seconds``; a uid
  may have at most ``per_uid`` registrations waiting; each may carry ``max_descriptors``.
- ``listen_beside(endpoint, settings, loop)``: the listener an ipc control endpoint gets,
  bounded by ``[limits]``, started; None for tcp:// and inproc://.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from offloadd.endpoint import private_umask, restrict_socket
from offloadd.settings import Settings
from protocol.errors import ErrorCode
from protocol.peer import (
    FDS_PER_MESSAGE,
    MAX_MESSAGE,
    MORE_DESCRIPTORS,
    PEER_PROTOCOL_VERSION,
    Register,
    Registered,
    RegisterRefused,
    decode_register,
    encode_peer,
    peer_socket_path,
)

__all__ = ["REMOTE", "Peer", "PeerListener", "Registration", "listen_beside"]

logger = logging.getLogger(__name__)

CONNECTION_SECONDS = 5.0
MAX_CONNECTIONS = 1024  # all uids together; each holds a socket and a pidfd
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5


@dataclass(frozen=True, slots=True)
class Peer:
    """A peer as the kernel describes it: uid, gid, pid (0 where the daemon cannot see it)."""

    uid: int
    gid: int
    pid: int

    @property
    def remote(self) -> bool:
        """No kernel identity: a peer on a tcp:// control endpoint (``REMOTE``)."""
        return self.uid < 0


REMOTE = Peer(-1, -1, 0)


@dataclass(eq=False)
class Registration:
    """A registered peer waiting for (or taken by) its Hello: owns descriptors and a pidfd."""

    token: bytes
    identity: bytes
    peer: Peer
    fds: list[int]
    pidfd: int | None
    expires: float

    def take_pidfd(self) -> int | None:
        """The pidfd, now the caller's to close."""
        pidfd, self.pidfd = self.pidfd, None
        return pidfd

    def exited(self) -> bool:
        """Whether the registering process is gone already (its pidfd is readable)."""
        if self.pidfd is None:
            return False
        import select

        # poll, not select: a pidfd above 1023 (a daemon holding many descriptors) is fine.
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        """Close every descriptor still held. Idempotent."""
        _close_all(self.fds, self.take_pidfd())
        self.fds = []


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    peer: Peer
    pidfd: int | None
    timer: asyncio.TimerHandle | None = None
    register: Register | None = None
    fds: list[int] = field(default_factory=list)
    refused: bool = False  # answered: what still comes is read and dropped until it hangs up


class PeerListener:
    """The daemon's end of the registration socket; see the module docstring."""

    def __init__(
        self,
        path: str,
        *,
        socket_mode: str,
        socket_group: str,
        max_descriptors: int,
        per_uid: int,
        token_seconds: float,
        connections_per_uid: int = 8,
        descriptors_per_uid: int = 8192,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._mode = socket_mode
        self._group = socket_group
        self._max_descriptors = max_descriptors
        self._per_uid = per_uid
        self._token_seconds = token_seconds
        self._connections_per_uid = connections_per_uid
        self._descriptors_per_uid = descriptors_per_uid
        # Descriptors a uid's live sessions keep (the sessions replace this).
        self.live_descriptors: Callable[[int], int] = lambda uid: 0
        self._clock = clock
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connections: set[_Connection] = set()
        self._waiting: dict[bytes, Registration] = {}
        self._identities: dict[bytes, bytes] = {}  # identity -> the token registered last

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind and listen; raises OSError (or EndpointRefused for a bad group)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # stale: the endpoint's lock says no live daemon owns it
        sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
        )
        try:
            with private_umask():
                sock.bind(self.path)
            restrict_socket(self.path, self._mode, self._group)
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        self._sock, self._loop = sock, loop
        loop.add_reader(sock.fileno(), self._accept)

    def __len__(self) -> int:
        """Registrations waiting for their Hello."""
        return len(self._waiting)

    def take(self, token: bytes, identity: bytes) -> Registration | None:
        """The registration of ``token`` if it is valid for ``identity`` (used up either way)."""
        self._expire()
        registration = self._pop(token) if token else None
        if registration is None:
            return None
        if registration.identity != identity:
            registration.close()
            return None
        return registration

    def close(self) -> None:
        """Stop listening, drop connections and waiting registrations. Idempotent."""
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for connection in list(self._connections):
            self._drop(connection)
        for registration in self._waiting.values():
            registration.close()
        self._waiting.clear()
        self._identities.clear()

    def peer_of(self, identity: bytes) -> Peer | None:
        """Who registered for ``identity`` and has not said Hello yet (None: nobody)."""
        registration = self._waiting.get(self._identities.get(identity, b""))
        return registration.peer if registration is not None else None

    def _pop(self, token: bytes) -> Registration | None:
        registration = self._waiting.pop(token, None)
        if registration is not None and self._identities.get(registration.identity) == token:
            del self._identities[registration.identity]
        return registration

    # -- the loop's callbacks ---------------------------------------------------------------

    def _accept(self) -> None:
        assert self._sock is not None and self._loop is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: the next accept may succeed
                logger.warning("registration socket: accept failed: %s", exc.strerror)
                return
            conn.setblocking(False)
            pid, uid, gid = struct.unpack(
                "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            )
            problem = self._connection_problem(uid)
            if problem:
                logger.debug("registration connection of uid %d refused: %s", uid, problem)
                with contextlib.suppress(OSError):  # the peer reads it, or gets a reset
                    conn.send(encode_peer(RegisterRefused(int(ErrorCode.TOO_LARGE), problem)))
                conn.close()
                continue
            connection = _Connection(conn, Peer(uid, gid, pid), _pidfd_of(conn, pid))
            self._connections.add(connection)
            connection.timer = self._loop.call_later(CONNECTION_SECONDS, self._drop, connection)
            self._loop.add_reader(conn.fileno(), self._receive, connection)

    def _connection_problem(self, uid: int) -> str:
        if len(self._connections) >= MAX_CONNECTIONS:
            return f"{MAX_CONNECTIONS} registration connections are open"
        open_ = sum(1 for c in self._connections if c.peer.uid == uid)
        if open_ >= self._connections_per_uid:
            return (
                f"this user has {open_} registration connections open "
                f"(limits.connections_per_uid = {self._connections_per_uid})"
            )
        return ""

    def _descriptors_of(self, uid: int) -> int:
        waiting = sum(len(r.fds) + 1 for r in self._waiting.values() if r.peer.uid == uid)
        connecting = sum(len(c.fds) + 2 for c in self._connections if c.peer.uid == uid)
        return waiting + connecting + self.live_descriptors(uid)

    def _receive(self, connection: _Connection) -> None:
        room = FDS_PER_MESSAGE * 4
        try:
            data, ancillary, flags, _ = connection.sock.recvmsg(
                MAX_MESSAGE, socket.CMSG_SPACE(room), socket.MSG_CMSG_CLOEXEC
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(connection)
            return
        connection.fds.extend(_descriptors(ancillary))
        if not data:  # the peer hung up
            self._drop(connection)
            return
        if connection.refused:
            # Refused early, while the peer still sends: read its messages to the end, so it
            # gets to read the refusal instead of a reset connection.
            _close_all(connection.fds, None)
            connection.fds = []
            return
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            self._refuse(connection, ErrorCode.TOO_LARGE, "message or descriptors cut short")
            return
        if connection.register is None:
            try:
                connection.register = decode_register(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._refuse(connection, ErrorCode.MALFORMED, str(exc))
                return
            problem = self._register_problem(connection)
            if problem is not None:
                self._refuse(connection, *problem)
                return
        elif data != MORE_DESCRIPTORS:
            self._refuse(connection, ErrorCode.MALFORMED, "expected only more descriptors")
            return
        wanted = connection.register.descriptors
        if len(connection.fds) > wanted:
            self._refuse(connection, ErrorCode.BAD_REQUEST, f"more than {wanted} descriptors")
        elif len(connection.fds) == wanted:
            self._answer(connection)

    def _register_problem(self, connection: _Connection) -> tuple[ErrorCode, str] | None:
        register = connection.register
        assert register is not None
        if register.protocol_version != PEER_PROTOCOL_VERSION:
            return (
                ErrorCode.UNSUPPORTED_VERSION,
                f"registration version {register.protocol_version} is not {PEER_PROTOCOL_VERSION}",
            )
        if not 0 <= register.descriptors <= self._max_descriptors:
            return (
                ErrorCode.TOO_LARGE,
                f"{register.descriptors} descriptors: limits.regions_per_session allows "
                f"{self._max_descriptors}",
            )
        if not 1 <= len(register.identity) <= 255:
            return ErrorCode.BAD_REQUEST, "a ZeroMQ routing id has 1 to 255 bytes"
        self._expire()
        uid = connection.peer.uid
        waiting = sum(1 for r in self._waiting.values() if r.peer.uid == uid)
        if waiting >= self._per_uid:
            return (
                ErrorCode.TOO_LARGE,
                f"{waiting} registrations of this user wait for their Hello "
                f"(limits.registrations_per_uid = {self._per_uid})",
            )
        held = self._descriptors_of(uid) - len(connection.fds)
        if held + register.descriptors > self._descriptors_per_uid:
            return (
                ErrorCode.TOO_LARGE,
                f"{register.descriptors} descriptors: this user holds {held} already "
                f"(limits.descriptors_per_uid = {self._descriptors_per_uid})",
            )
        return None

    def _answer(self, connection: _Connection) -> None:
        register = connection.register
        assert register is not None
        token = secrets.token_bytes(32)
        peer = connection.peer
        registration = Registration(
            token,
            register.identity,
            peer,
            connection.fds,
            connection.pidfd,
            self._clock() + self._token_seconds,
        )
        connection.fds, connection.pidfd = [], None
        self._waiting[token] = registration
        self._identities[register.identity] = token
        self._reply(connection, Registered(token, peer.uid, peer.gid, peer.pid))

    def _refuse(self, connection: _Connection, code: ErrorCode, message: str) -> None:
        logger.debug("registration of uid %d refused: %s", connection.peer.uid, message)
        with contextlib.suppress(OSError):  # a peer that left loses its answer
            connection.sock.send(encode_peer(RegisterRefused(int(code), message)))
        _close_all(connection.fds, connection.pidfd)
        connection.fds, connection.pidfd, connection.refused = [], None, True

    def _reply(self, connection: _Connection, message: Registered) -> None:
        with contextlib.suppress(OSError):  # a peer that left loses its answer
            connection.sock.send(encode_peer(message))
        self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        if connection not in self._connections:
            return
        self._connections.discard(connection)
        if connection.timer is not None:
            connection.timer.cancel()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(connection.sock.fileno())
        connection.sock.close()
        _close_all(connection.fds, connection.pidfd)
        connection.fds, connection.pidfd = [], None

    def _expire(self) -> None:
        now = self._clock()
        for token in [t for t, r in self._waiting.items() if r.expires <= now]:
            registration = self._pop(token)
            if registration is not None:
                registration.close()


def _close_all(fds: Sequence[int], pidfd: int | None) -> None:
    for fd in (*fds, *(() if pidfd is None else (pidfd,))):
        with contextlib.suppress(OSError):
            os.close(fd)


def _pidfd_of(conn: socket.socket, pid: int) -> int | None:
    """A pidfd of the peer process: from the socket (no pid reuse race), else by pid."""
    try:
        fd = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
        if fd >= 0:
            os.set_inheritable(fd, False)
            return fd
    except OSError:
        pass
    if pid <= 0:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(array.array("i", data[:usable]))
    return fds


def listen_beside(
    endpoint: str, settings: Settings, loop: asyncio.AbstractEventLoop
) -> PeerListener | None:
    """The registration socket beside an ipc control ``endpoint``, started on ``loop``; None
    for tcp:// and inproc:// (no kernel identity, no regions)."""
    path = peer_socket_path(endpoint)
    if path is None:
        return None
    server, limits = settings.server, settings.limits
    peers = PeerListener(
        path,
        socket_mode=server.socket_mode,
        socket_group=server.socket_group,
        max_descriptors=limits.regions_per_session,
        per_uid=limits.registrations_per_uid,
        token_seconds=limits.token_seconds,
        connections_per_uid=limits.connections_per_uid,
        descriptors_per_uid=limits.descriptors_per_uid,
    )
    peers.start(loop)
    return peers

"""The control socket: the ROUTER every rank and scheduler talks to.

It binds the daemon's endpoint (an ipc socket is created with no access for others, then
given ``server.socket_mode`` and ``server.socket_group``; CURVE when configured), receives
one request per frame, checks the framing (one frame, at most ``server.max_frame_bytes``;
a Hello at most ``limits.hello_bytes``, judged on the raw frame before it is decoded, since a
decoded config costs many times its encoded size), decodes it and hands it to ``dispatch``
(``offloadd.server.dispatch``: who answers, and when); any frame that cannot be read is
answered with an ``Error`` and counted, and a bug inside a handler is logged and answered
with ``INTERNAL``, so one peer never takes the daemon down for the others.

Contract of ``ControlSocket`` (the event loop's thread only):
- ``bind(ctx)``: create and bind the socket; on failure nothing stays open (an open socket
  would keep the context's ``term()`` waiting forever).
- ``receive_loop()``: receive until cancelled. Requests are read into two lanes
  (``offloadd.server.lanes``): control requests (Lookup, Reserve, ...) are handled before
  bulk work (Store, Load, StepJobs, Hello, ... and the copies' ends given to ``run_bulk``),
  one peer's requests always in the order it sent them, and each lane serves the tenants
  (``tenant_of(identity)``; "" for a peer nobody knows) in turn; the loop's other
  callbacks run after each bulk item and after ``_BATCH`` control ones. While a peer's
  Hello is handled off the loop (``RequestGate``), its later frames are held, then given to
  ``handle_frames`` in order.
- ``run_bulk(work, tenant)``: run ``work`` on the loop in ``tenant``'s bulk lane, behind the
  control requests queued; at once when the receive loop is not running (before it starts,
  once it ended) or waits on an empty socket with nothing queued (a copy's end then skips a
  turn of the loop).
- ``send(identity, reply)``: never blocks: a reply to a peer that is gone or not reading is
  dropped, and so is every reply once the socket is closed.
- ``protocol_error(identity, request_id, code, message)``: answer an Error and count it.
- ``internal_error(identity, request_id)``: answer ``INTERNAL`` for a bug, counted in metrics.
- ``close()``: close the socket and stop CURVE authentication; idempotent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from offloadd.endpoint import ipc_path, restrict_socket
from offloadd.safety import printable
from offloadd.server.gate import RequestGate
from offloadd.server.lanes import URGENT, Lanes, Next
from offloadd.server.metrics import Counters, Metrics
from offloadd.settings import Settings
from protocol.errors import ErrorCode
from protocol.messages import Error, Reply, Request, decode_request, encode, peek_request_id

if TYPE_CHECKING:
    from zmq.auth.asyncio import AsyncioAuthenticator

__all__ = ["ControlSocket"]

logger = logging.getLogger(__name__)

_BATCH = 32  # control requests handled back to back before the loop runs other callbacks
_TURN = 0.005  # seconds of requests handled back to back, at most, before the same
_QUEUED = 256  # requests read ahead into the lanes; above, zmq's queues hold the rest
_QUEUED_FRAMES = 4  # ... or this many server.max_frame_bytes of their frames
# Complete frames libzmq queues per connection before it stops reading it (its default,
# 1,000, let one connection park 1,000 frames of max_frame_bytes); at 16 the socket reads
# as fast as at 1,000 (the reader keeps its pipes near empty anyway).
RCVHWM = 16
# A frame this much over max_frame_bytes is still read and answered TOO_LARGE, so a client
# that oversteps learns why; a larger one ends its connection before libzmq reads it.
FRAME_SLACK = 64 << 10


class _Kind(msgspec.Struct):
    """A request's tag and id only: every other field is skipped, never built."""

    type: str = ""
    request_id: int = 0


_kind_decoder = msgspec.msgpack.Decoder(_Kind)


def _kind(frame: bytes) -> str:
    """A frame's request tag, or "" when it does not decode as a request."""
    try:
        return _kind_decoder.decode(frame).type
    except Exception:  # garbage (nested too deep: RecursionError): handle_frames answers it
        return ""


class ControlSocket:
    """The daemon's ROUTER socket; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        endpoint: str,
        gate: RequestGate,
        *,
        dispatch: Callable[[bytes, Request], None],
        unregistered: Callable[[bytes, bytes], bool] = lambda _identity, _frame: False,
        metrics: Metrics,
        counters: Counters,
        tenant_of: Callable[[bytes], str] = lambda _identity: "",
    ) -> None:
        self.settings = settings
        self.endpoint = endpoint
        self._gate = gate
        self._dispatch = dispatch
        self._unregistered = unregistered
        self._running: tuple[bytes, bool] | None = None  # (peer, bulk) of the item running
        self.metrics = metrics
        self.counters = counters
        self._sock: zmq.Socket[bytes] | None = None  # blocking calls never block: see send
        self._readable: asyncio.Event | None = None  # receive_loop's wake-up, see send
        self._auth: AsyncioAuthenticator | None = None  # CURVE authentication, when used
        self._tenant_of = tenant_of
        self._lanes = Lanes(_BATCH, tenant_of)

    def bind(
        self,
        ctx: zmq.asyncio.Context,
        watch: Callable[[zmq.Socket[bytes], str], None] | None = None,
    ) -> None:
        """Create and bind the ROUTER (and start CURVE when configured); closed on failure.
        ``watch`` bounds its connections from before it binds (``server.connections``)."""
        server = self.settings.server
        # A plain socket on the shared context: the loop reads it in batches (receive_loop)
        # and sends with DONTWAIT, with no asyncio future per message.
        sock: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, server.max_frame_bytes + FRAME_SLACK)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            if server.curve_secret_key_file:
                self._start_curve(ctx, sock)
            if watch is not None:
                watch(sock, "control")
            path = ipc_path(self.endpoint)
            # Created with no access for others from the first instant, then set as configured.
            previous = os.umask(0o177) if path else None
            try:
                sock.bind(self.endpoint)
            finally:
                if previous is not None:
                    os.umask(previous)
            if path:
                restrict_socket(path, server.socket_mode, server.socket_group)
        except BaseException:
            # Not ours to keep: an open socket would hold the context's term() forever.
            sock.close(linger=0)
            raise
        self._sock = sock

    def _start_curve(self, ctx: zmq.asyncio.Context, sock: zmq.Socket[bytes]) -> None:
        import zmq.auth
        from zmq.auth.asyncio import AsyncioAuthenticator

        server = self.settings.server
        public, secret = zmq.auth.load_certificate(server.curve_secret_key_file)
        if secret is None:
            raise ValueError(f"{server.curve_secret_key_file} holds no secret key")
        self._auth = AsyncioAuthenticator(ctx)
        self._auth.start()
        if server.curve_clients_dir:
            self._auth.configure_curve(domain="*", location=server.curve_clients_dir)
        else:
            logger.warning("CURVE without server.curve_clients_dir: any client key is accepted")
            self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def close(self) -> None:
        """Close the socket and stop CURVE authentication (before the context's term)."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    async def receive_loop(self) -> None:
        """Read the ROUTER into the lanes and run their items, control first.

        Requests are read without a future each, up to ``_QUEUED`` ahead of the handlers, so
        a Lookup that arrived behind Stores is seen before they run; libzmq queues fairly
        across peers. The loop only waits on the socket's file descriptor when nothing is
        queued. zmq's FD is edge-triggered and any send may consume the edge of a request
        that just arrived, so ``EVENTS`` is read before waiting, and ``send`` reads it while
        this loop waits. Other callbacks (copy ends posting to ``run_bulk``, timers, events)
        run after each bulk item and after ``_BATCH`` control ones. A peer's frames wait
        behind the gate while its Hello runs.
        """
        assert self._sock is not None
        sock = self._sock
        lanes = self._lanes
        loop = asyncio.get_running_loop()
        readable = self._readable = asyncio.Event()
        fd = int(sock.getsockopt(zmq.FD))
        loop.add_reader(fd, readable.set)
        ran, began = 0, time.perf_counter()
        try:
            while True:
                self._read(sock)
                popped = lanes.pop()
                if popped is None:
                    readable.clear()
                    if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                        await readable.wait()
                        began = time.perf_counter()
                    continue
                item, bulk = popped
                if isinstance(item, tuple):
                    self._running = (item[0], bulk)
                elif isinstance(item, Next):
                    self._running = (item.peer, bulk)
                try:
                    self._run(item)
                finally:
                    self._running = None
                ran += 1
                if bulk or ran >= _BATCH or time.perf_counter() - began > _TURN:
                    await asyncio.sleep(0)
                    ran, began = 0, time.perf_counter()
        finally:
            self._readable = None
            self._running = None
            loop.remove_reader(fd)
            # A copy's end still finishes its job; the requests not handled are dropped, as
            # those never read are.
            while (popped := lanes.pop()) is not None:
                if not isinstance(popped[0], tuple | Next):
                    loop.call_soon(popped[0])
            self._lanes = Lanes(_BATCH, self._tenant_of)

    def run_bulk(self, work: Callable[[], object], tenant: str = "") -> None:
        """Run ``work`` (on the loop) in ``tenant``'s bulk lane; at once if nothing is
        receiving."""
        readable = self._readable
        if readable is None:
            work()
            return
        sock = self._sock
        if (
            not readable.is_set()
            and not self._lanes
            and sock is not None
            and not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN
        ):
            # Nothing to run before it: the receive loop would wake only to run it.
            self._run(work)
            return
        self._lanes.add_work(work, tenant)
        readable.set()

    def run_next(self, identity: bytes, work: Callable[[], object]) -> None:
        """Run ``work``, the rest of the request of ``identity`` running now, on a later turn
        of the loop before ``identity``'s next request, in that request's lane; at once (to
        its end) when it is not the receive loop's item running (a Hello's held frames)."""
        running = self._running
        if running is None or running[0] != identity:
            work()
            return
        self._lanes.add_next(identity, work, running[1])

    def _read(self, sock: zmq.Socket[bytes]) -> None:
        lanes = self._lanes
        limit = self.settings.limits.hello_bytes
        frame = self.settings.server.max_frame_bytes
        # Read ahead up to the bounds, copying about one frame's worth per call (a turn).
        most = min(_QUEUED_FRAMES * frame, lanes.bytes + frame)
        while lanes.requests < _QUEUED and lanes.bytes < most:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            rest = frames[1:]
            # Only the tag is read here; handle_frames checks and decodes the whole frame.
            urgent = len(rest) == 1 and len(rest[0]) <= limit and _kind(rest[0]) in URGENT
            lanes.add(frames[0], rest, urgent)

    def _run(self, item: tuple[bytes, list[bytes]] | Callable[[], object]) -> None:
        if not isinstance(item, tuple):
            try:
                item()
            except Exception:
                logger.exception("internal error in work run on the loop")
            return
        identity, frames = item
        if not self._gate.hold(identity, frames):
            self.handle_frames(identity, frames)

    def handle_frames(self, identity: bytes, frames: list[bytes]) -> None:
        """Handle one request; a bug inside is logged and answered with INTERNAL."""
        try:
            self._on_frames(identity, frames)
        except Exception:
            # A bug must not take the daemon down; the peer still gets an answer.
            logger.exception("internal error while handling a request")
            self.internal_error(identity, peek_request_id(frames[-1]) if frames else 0)

    def internal_error(self, identity: bytes, request_id: int) -> None:
        """Answer ``INTERNAL`` for a bug (the caller logged it)."""
        self.metrics.protocol_error(ErrorCode.INTERNAL.name)
        self.send(identity, Error(request_id, ErrorCode.INTERNAL, "internal error; see daemon log"))

    def send(self, identity: bytes, message: Reply) -> None:
        """Send without ever blocking the loop: a peer that is gone or not reading loses it."""
        sock = self._sock
        if sock is None:
            return
        try:
            sock.send_multipart([identity, encode(message)], flags=zmq.DONTWAIT)
        except zmq.ZMQError:  # EAGAIN: not reading; EHOSTUNREACH: gone (ROUTER_MANDATORY)
            logger.debug("dropped a reply to a peer that is gone or not reading")
        # While the receive loop waits, this send may have taken the edge of a new request.
        readable = self._readable
        if (
            readable is not None
            and not readable.is_set()
            and int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN
        ):
            readable.set()

    def _on_frames(self, identity: bytes, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.protocol_error(identity, 0, ErrorCode.MALFORMED, "expected exactly one frame")
            return
        frame = frames[0]
        if len(frame) > self.settings.server.max_frame_bytes:
            self.protocol_error(
                identity,
                0,
                ErrorCode.TOO_LARGE,
                f"frame of {len(frame)} bytes exceeds {self.settings.server.max_frame_bytes}",
            )
            return
        if len(frame) > self.settings.limits.hello_bytes:
            try:
                kind = _kind_decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.protocol_error(identity, 0, ErrorCode.MALFORMED, str(exc))
                return
            if kind.type == "hello":
                self.protocol_error(
                    identity,
                    kind.request_id,
                    ErrorCode.TOO_LARGE,
                    f"a Hello of {len(frame)} bytes: limits.hello_bytes is "
                    f"{self.settings.limits.hello_bytes}",
                )
                return
        if self._unregistered(identity, frame):
            return
        try:
            request = decode_request(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.protocol_error(identity, peek_request_id(frame), ErrorCode.MALFORMED, str(exc))
            return
        self._dispatch(identity, request)

    def protocol_error(
        self, identity: bytes, request_id: int, code: ErrorCode, message: str
    ) -> None:
        """Answer ``Error(code, message)`` and count it."""
        self.counters.protocol_errors += 1
        self.metrics.protocol_error(code.name)
        logger.debug("refused request %d: %s %s", request_id, code.name, printable(message))
        self.send(identity, Error(request_id, code, message))

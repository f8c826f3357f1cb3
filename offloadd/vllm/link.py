"""``SessionLink``: a plugin process's liveness loop, one per owner (the scheduler's
``OffloaddManager``, a rank's ``OffloaddWorker``), with the one reconnect policy.

The owner keeps its client and what a session means to it; the link keeps the session alive.
Contract:
- ``lock``: vLLM's calls and the link's thread take turns on the owner's client under it.
  The thread never waits for it, but to hand a new session over (``adopt``).
- ``start(client=, connect=, adopt=, idle=)``: one thread, ``offloadd-link <name>``; every
  ``tick`` seconds, where ``client()`` (the owner's session, read without the lock: one
  attribute, set only under it)
  - is a session: a heartbeat ``Ping`` for it every ``HEARTBEAT_SECONDS``, without the lock,
    on a socket only this thread uses (a long vLLM call holding the lock, a long
    ``schedule()``, leaves the owner's keepalives waiting, and a session the daemon cannot
    watch, from another pid namespace, must not be reaped for that silence); then, if the
    lock is free, ``idle()`` under it: the owner's keepalives and reads, never waiting long;
  - is None: when ``Reconnect`` says so, ``connect(timeout)`` off the lock (raises
    ``OffloaddError``), then ``adopt(client)`` under it (False: the owner connected
    meanwhile; the new client is closed).
- ``close()``: the thread ends (an attempt under way finishes first); idempotent. The owner
  closes its client after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import zmq

from offloadd.client import DEFAULT_HEARTBEAT, Heartbeat, OffloadClient
from offloadd.endpoint import nobody_listens
from offloadd.errors import OffloaddError

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = DEFAULT_HEARTBEAT  # well within the daemon's session_timeout (30 s)
PAUSE_SECONDS = 1.0  # between attempts to connect again, while nobody listens
MAX_PAUSE_SECONDS = 16.0  # the longest pause, after attempts that timed out
# An attempt waits this long for the Welcome (and a scheduler's snapshot): a daemon just
# restarted on a loaded node can take longer than a step's bound.
ATTEMPT_SECONDS = 2.0


class Reconnect:
    """When to try connecting again (pure: the caller passes the clock).

    An attempt is due a pause after the last one (or after the session was lost). Where
    nobody listens (a daemon that died) the pause stays ``PAUSE_SECONDS``: a restarted daemon
    gets its sessions back within a second of serving. An attempt that timed out (a frozen
    daemon, whose listen backlog keeps each attempt's connection until it runs again)
    doubles it, up to ``MAX_PAUSE_SECONDS``, so attempts do not pile up there. One that
    failed fast (refused) keeps it; a session resets it.
    """

    def __init__(self, now: float) -> None:
        self.pause = PAUSE_SECONDS
        self._last = now

    def due(self, now: float) -> bool:
        return now - self._last >= self.pause

    def attempted(self, now: float) -> None:
        """An attempt starts (or the session was lost): the next one a pause later."""
        self._last = now

    def nobody_listens(self) -> None:
        self.pause = PAUSE_SECONDS

    def failed(self, waited: float) -> None:
        """The attempt failed after ``waited`` seconds."""
        if waited >= ATTEMPT_SECONDS:
            self.pause = min(2 * self.pause, MAX_PAUSE_SECONDS)

    def connected(self) -> None:
        self.pause = PAUSE_SECONDS


class _Hooks(NamedTuple):
    """The owner's parts (``SessionLink.start``)."""

    client: Callable[[], OffloadClient | None]
    connect: Callable[[float], OffloadClient]
    adopt: Callable[[OffloadClient], bool]
    idle: Callable[[], None]


class SessionLink:
    """The lock, the stop event and the one background thread of a plugin owner; see the
    module docstring."""

    def __init__(
        self,
        endpoint: str,
        name: str,
        *,
        tick: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self._tick = tick
        self._clock = clock
        self._policy = Reconnect(clock())
        self._thread: threading.Thread | None = None
        self._linked = False  # the owner had a session at the last turn
        self._beat_at = 0.0  # the next heartbeat

    def start(
        self,
        *,
        client: Callable[[], OffloadClient | None],
        connect: Callable[[float], OffloadClient],
        adopt: Callable[[OffloadClient], bool],
        idle: Callable[[], None],
    ) -> None:
        """Start the thread; the owner's parts as the module docstring says."""
        self._linked = client() is not None
        self._thread = threading.Thread(
            target=self._run,
            args=(_Hooks(client, connect, adopt, idle),),
            name=f"offloadd-link {self.name}",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, hooks: _Hooks) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        heartbeat = Heartbeat(ctx, self.endpoint)  # this thread's alone
        try:
            while not self.stop.wait(self._tick):
                try:
                    session = hooks.client()
                    if session is None:
                        self._reconnect(hooks.connect, hooks.adopt)
                    else:
                        self._tend(session, heartbeat, hooks.idle)
                except Exception:
                    logger.exception("offloadd: %s: background turn failed", self.name)
        finally:
            heartbeat.close()
            ctx.term()

    def _tend(self, session: OffloadClient, heartbeat: Heartbeat, idle: Callable[[], None]) -> None:
        self._linked = True
        now = self._clock()
        welcome = session.welcome
        if welcome is not None and now >= self._beat_at:
            heartbeat.ping(welcome.session_id)
            self._beat_at = now + HEARTBEAT_SECONDS
        if self.lock.acquire(blocking=False):  # else vLLM is in a call
            try:
                idle()
            finally:
                self.lock.release()

    def _reconnect(
        self, connect: Callable[[float], OffloadClient], adopt: Callable[[OffloadClient], bool]
    ) -> None:
        """One attempt, if due (off the lock)."""
        policy, started = self._policy, self._clock()
        if self._linked:  # the owner gave its session up: the first attempt a pause later
            self._linked = False
            policy.attempted(started)
        if not policy.due(started):
            return
        policy.attempted(started)
        if nobody_listens(self.endpoint):
            policy.nobody_listens()
            return
        try:
            client = connect(ATTEMPT_SECONDS)
        except OffloaddError as exc:
            policy.failed(self._clock() - started)
            logger.debug("offloadd: %s: not connected: %s", self.name, exc)
            return
        policy.connected()
        if self.stop.is_set():
            client.close()
            return
        with self.lock:
            adopted = adopt(client)
        if not adopted:  # the owner connected meanwhile
            client.close()
            return
        logger.info("offloadd: %s connected to %s", self.name, self.endpoint)

"""The handler table and the dispatch that keeps to it: how each request is answered.

Every request runs on the event loop's thread and its handler runs to completion without
awaiting, so handlers never interleave. ``TABLE`` declares, per request type, how it is
answered and whether it needs a session:

- ``NOW``: the handler returns the reply; dispatch sends it. A NOW handler that returns
  anything but a reply is a bug: logged, and the sender told ``INTERNAL``.
- ``NOTICE``: answered now like NOW, and completed later by a notice (a Store's or Load's
  ``JobDone``, sent by ``offloadd.server.jobs``). The handler returns ``Accepted``; its
  ``then``, when set, runs right after the reply is sent, so a job with nothing to copy
  sends its ``JobDone`` after its ``JobAccepted``.
- ``DEFERRED``: the handler receives ``reply``, a callable that sends at most one reply to
  the sender, and returns None; it answers now or keeps ``reply`` and answers later on the
  loop (a Lookup waiting on a tier's probe, a Wait waiting on jobs).
- ``OFF_LOOP``: the handler returns None and answers the sender itself: at once, or from the
  loop once its work on another thread ends, the peer's later requests held meanwhile
  (``offloadd.server.gate``). Only Hello (a cuda daemon's CUDA IPC imports).

Nested requests: a scheduler's step message (``Reserve``, ``UpdateHolds``) carries the step's
tier probes in ``lookups``; each is dispatched as if it arrived alone right after its carrier
(its own rule, reply and errors), whether or not the carrier was refused. They run in quanta
(``QUANTUM_LOOKUPS`` lookups or ``QUANTUM_KEYS`` keys, whichever comes first): each quantum
after the first is handed to ``Replies.run_next``, which runs it on a later turn of the loop,
before any later request of the same peer, so a message of 4,096 lookups holds the loop for
a quantum at a time, not for all of them.

Size first: ``bounds(request)`` (``Limits.message_problem``) says why a request is too large
for its size alone (lookups, jobs, keys); such a request is refused ``TOO_LARGE`` before its
session is looked up, and none of its nested lookups or jobs is handled, so no message costs
more work than the bounds allow, from a peer with a session or without.

No session, no decoding: ``unregistered(identity, frame)`` answers a frame whose request needs
a session its sender does not have, reading only its tag, id and counts
(``offloadd.server.peek``): ``TOO_LARGE`` beyond the bounds, else one ``NOT_REGISTERED``. A
step message is refused whole then, its nested lookups unanswered: the sender must say Hello
and send them again (the clients forget what they awaited of a lost session), and a flood of
them from peers that never said Hello costs the daemon one answer a message.

A handler's ``Refused`` is answered with an ``Error`` carrying its code, whatever the mode.
Session rules: ``REQUIRED`` handlers get ``(state, request)`` and the session's last_seen is
refreshed; ``OPTIONAL`` ones (GetStats, Ping, ListCache, ClearCache) get
``(identity, state or None, request)``; ``NONE`` (Hello) gets ``(identity, request)``. A
request whose session is required but missing is refused with ``NOT_REGISTERED``.
"""

from __future__ import annotations

import enum
import logging
import time
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from offloadd.server.checks import Refused
from offloadd.server.peek import Peek, peek
from offloadd.server.state import Accepted, SessionState
from protocol.errors import ErrorCode
from protocol.messages import (
    Ack,
    Bye,
    Clear,
    ClearCache,
    GetStats,
    Hello,
    ListCache,
    Load,
    Lookup,
    Ping,
    Release,
    Reply,
    Request,
    Reserve,
    StepJobs,
    Store,
    UpdateHolds,
    Wait,
)

if TYPE_CHECKING:
    from offloadd.server.admin import CacheAdmin
    from offloadd.server.jobs import Jobs
    from offloadd.server.requests import CacheRequests
    from offloadd.server.schedulers import Schedulers
    from offloadd.server.sessions import Sessions
    from offloadd.server.stats import Stats

__all__ = ["TABLE", "Accepted", "Dispatcher", "Mode", "Replies", "Rule", "Session", "handlers"]

logger = logging.getLogger(__name__)

# A quantum of a step message's nested lookups: what one turn of the loop handles of them.
QUANTUM_LOOKUPS = 64
QUANTUM_KEYS = 16_384


class Mode(enum.Enum):
    """How a request is answered; see the module docstring."""

    NOW = "now"
    NOTICE = "notice"
    DEFERRED = "deferred"
    OFF_LOOP = "off_loop"


class Session(enum.Enum):
    """Whether a request needs the sender's session."""

    REQUIRED = "required"
    OPTIONAL = "optional"
    NONE = "none"


@dataclass(frozen=True)
class Rule:
    """One request type's entry in ``TABLE``."""

    mode: Mode
    session: Session = Session.REQUIRED


TABLE: dict[type[Any], Rule] = {
    Hello: Rule(Mode.OFF_LOOP, Session.NONE),
    GetStats: Rule(Mode.NOW, Session.OPTIONAL),
    Ping: Rule(Mode.NOW, Session.OPTIONAL),
    # An operator's (offloadd cache): no session needed, the sender's user decides.
    ListCache: Rule(Mode.NOW, Session.OPTIONAL),
    ClearCache: Rule(Mode.NOW, Session.OPTIONAL),
    Lookup: Rule(Mode.DEFERRED),
    Store: Rule(Mode.NOTICE),
    Load: Rule(Mode.NOTICE),
    # A step's stores and loads: Ok(count) now, then each job's JobDone (no JobAccepted).
    StepJobs: Rule(Mode.NOW),
    Release: Rule(Mode.NOW),
    Wait: Rule(Mode.DEFERRED),
    Clear: Rule(Mode.NOW),
    # A scheduler's step: answered now, then each of its ``lookups`` as a Lookup (above).
    Reserve: Rule(Mode.NOW),
    UpdateHolds: Rule(Mode.NOW),
    Ack: Rule(Mode.NOW),
    Bye: Rule(Mode.NOW),
}

_REPLIES = typing.get_args(Reply)
_SAY_HELLO = "say Hello first"
_BY_TAG = {kind.__struct_config__.tag: rule for kind, rule in TABLE.items()}


def handlers(
    sessions: Sessions,
    requests: CacheRequests,
    jobs: Jobs,
    schedulers: Schedulers,
    stats: Stats,
    admin: CacheAdmin,
) -> dict[type[Any], Callable[..., object]]:
    """The handler of each request type in ``TABLE``, called as its rule says."""
    return {
        Hello: sessions.hello,
        GetStats: stats.get_stats,
        Ping: lambda _identity, state, request: sessions.ping(state, request),
        Lookup: requests.lookup,
        Store: requests.store,
        Load: requests.load,
        StepJobs: requests.step_jobs,
        Release: requests.release,
        Wait: jobs.wait,
        Clear: requests.clear,
        Reserve: schedulers.reserve,
        UpdateHolds: schedulers.update_holds,
        Ack: schedulers.ack,
        Bye: sessions.bye,
        ListCache: admin.list_cache,
        ClearCache: admin.clear_cache,
    }


class Replies(Protocol):
    """Where dispatch sends: the control socket, or a test's recorder."""

    def send(self, identity: bytes, message: Reply) -> None:
        """Send ``message`` to ``identity`` without blocking."""

    def protocol_error(
        self, identity: bytes, request_id: int, code: ErrorCode, message: str
    ) -> None:
        """Answer ``Error(code, message)`` and count it."""

    def internal_error(self, identity: bytes, request_id: int) -> None:
        """Answer ``INTERNAL`` for a bug (logged by the caller) and count it."""

    def run_next(self, identity: bytes, work: Callable[[], object]) -> None:
        """Run ``work`` (the rest of ``identity``'s request) on a later turn of the loop,
        before ``identity``'s next request; at once when nothing is receiving."""


class _HandlerBug(Exception):
    """A handler broke its mode's rule (logged, answered INTERNAL)."""


class Dispatcher:
    """Routes each request to its handler by ``TABLE``; see the module docstring.

    ``handlers`` names one callable per request type of ``TABLE``, no more and no fewer;
    ``session_of`` finds the sender's live session by its identity in hex.
    """

    def __init__(
        self,
        handlers: Mapping[type[Any], Callable[..., object]],
        replies: Replies,
        *,
        session_of: Callable[[str], SessionState | None],
        bounds: Callable[[Request | Peek], str] = lambda _request: "",
    ) -> None:
        differ = set(handlers) ^ set(TABLE)
        if differ:
            names = sorted(kind.__name__ for kind in differ)
            raise ValueError(f"handlers and TABLE differ for {names}")
        self._handlers = dict(handlers)
        self._replies = replies
        self._session_of = session_of
        self._bounds = bounds

    def __call__(self, identity: bytes, request: Request) -> None:
        """Handle ``request`` from ``identity`` and answer it as ``TABLE`` says."""
        kind = type(request)
        rule = TABLE.get(kind)
        if rule is None:
            self._refuse(identity, request, Refused(ErrorCode.MALFORMED, f"unexpected {kind}"))
            return
        problem = self._bounds(request)
        if problem:
            self._refuse(identity, request, Refused(ErrorCode.TOO_LARGE, problem))
            return
        try:
            self._dispatch(identity, request, rule, self._handlers[kind])
        except Refused as refused:
            self._refuse(identity, request, refused)
        except _HandlerBug as bug:
            logger.error("handler bug: %s", bug)
            self._replies.internal_error(identity, request.request_id)
        if isinstance(request, Reserve | UpdateHolds) and request.lookups:
            self._nested(identity, request.lookups, 0)

    def _nested(self, identity: bytes, lookups: list[Lookup], start: int) -> None:
        """Dispatch a quantum of ``lookups`` from ``start``; the rest on a later turn."""
        end, keys = start, 0
        while end < len(lookups) and end - start < QUANTUM_LOOKUPS and keys < QUANTUM_KEYS:
            keys += len(lookups[end].keys)
            end += 1
        for index in range(start, end):
            self(identity, lookups[index])
        if end < len(lookups):
            self._replies.run_next(identity, lambda: self._nested(identity, lookups, end))

    def unregistered(self, identity: bytes, frame: bytes) -> bool:
        """Answer ``frame`` without decoding it when its request needs a session its sender
        lacks (see the module docstring); False when it is to be decoded and dispatched."""
        if self._session_of(identity.hex()) is not None:
            return False
        peeked = peek(frame)
        if peeked is None:
            return False
        rule = _BY_TAG.get(peeked.type)
        if rule is None or rule.session is not Session.REQUIRED:
            return False
        problem = self._bounds(peeked)
        if problem:
            self._replies.protocol_error(identity, peeked.request_id, ErrorCode.TOO_LARGE, problem)
            return True
        self._replies.protocol_error(
            identity, peeked.request_id, ErrorCode.NOT_REGISTERED, _SAY_HELLO
        )
        return True

    def _dispatch(
        self, identity: bytes, request: Request, rule: Rule, handler: Callable[..., object]
    ) -> None:
        args: tuple[object, ...]
        if rule.session is Session.NONE:
            args = (identity, request)
        else:
            state = self._session_of(identity.hex())
            if rule.session is Session.OPTIONAL:
                args = (identity, state, request)
            elif state is None:
                raise Refused(ErrorCode.NOT_REGISTERED, _SAY_HELLO)
            else:
                state.last_seen = time.monotonic()
                args = (state, request)
        name = type(request).__name__
        if rule.mode is Mode.DEFERRED:
            args = (*args, self._reply_once(identity, request.request_id))
        result = handler(*args)
        if rule.mode is Mode.NOW:
            if not isinstance(result, _REPLIES):
                raise _HandlerBug(f"{name} is answered now, but its handler returned {result!r}")
            self._replies.send(identity, result)
        elif rule.mode is Mode.NOTICE:
            if not isinstance(result, Accepted):
                raise _HandlerBug(f"{name} is answered by Accepted, not {result!r}")
            self._replies.send(identity, result.reply)
            if result.then is not None:
                result.then()
        elif result is not None:
            raise _HandlerBug(f"{name} answers itself, but its handler returned {result!r}")

    def _reply_once(self, identity: bytes, request_id: int) -> Callable[[Reply], None]:
        """A deferred handler's ``reply``: the first call sends, a second is a bug (logged)."""
        sent = False

        def reply(message: Reply) -> None:
            nonlocal sent
            if sent:
                logger.error("a second reply to request %d dropped: %r", request_id, message)
                return
            sent = True
            self._replies.send(identity, message)

        return reply

    def _refuse(self, identity: bytes, request: Request, refused: Refused) -> None:
        self._replies.protocol_error(identity, request.request_id, refused.code, str(refused))

"""The daemon's plain state of a session and of its jobs: data only, shared by ``sessions``
(which makes and ends sessions) and ``jobs`` (which runs their copies), so neither imports
the other.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from offloadd.cache.index import Reads, ShardWrite
from offloadd.server.peers import REMOTE, Peer
from offloadd.server.registry import Session
from offloadd.transfer.handles import Import
from offloadd.transfer.types import Direction, FileWindow, Span
from protocol.messages import JobDone, Reply, WaitResult

__all__ = ["Accepted", "Job", "SessionState", "Waiter", "silent_sessions", "wait_result"]


@dataclass(eq=False)
class SessionState:
    """The daemon's runtime view of one registry session."""

    identity: bytes
    session: Session
    imports: list[Import]
    jobs: dict[int, Job] = field(default_factory=dict)
    done: OrderedDict[int, JobDone] = field(default_factory=OrderedDict)
    waiters: list[Waiter] = field(default_factory=list)
    alive: bool = True
    last_seen: float = field(default_factory=time.monotonic)
    # By group, built lazily: its resolved spans and shard bytes (the namespace's chunk size).
    spans: dict[int, tuple[tuple[Span, ...], int]] = field(default_factory=dict)
    pidfd: int | None = None  # watched with the loop: readable once the process exited
    peer: Peer = REMOTE  # who the kernel says the peer is (offloadd.peer)
    windows: tuple[FileWindow, ...] = ()  # its shared-memory files, reached by descriptor
    unsealed: tuple[FileWindow, ...] = ()  # those that could shrink: checked before each job


def silent_sessions(
    states: Iterable[SessionState], *, now: float, timeout: float
) -> list[SessionState]:
    """The live sessions no pidfd watches that said nothing for ``timeout`` seconds."""
    deadline = now - timeout
    return [
        state
        for state in states
        if state.pidfd is None and state.last_seen < deadline and state.alive
    ]


@dataclass(eq=False)
class Job:
    """One Store or Load of one session, from its booking to its JobDone."""

    job_id: int
    state: SessionState
    direction: Direction
    keys: list[bytes]
    failed_keys: list[bytes]
    nbytes: int
    writes: list[ShardWrite] = field(default_factory=list)
    reads: Reads | None = None  # a load's, until its copy ends
    abandoned: bool = False
    # A store waiting for its room (offloadd.server.waiting): the end of its wait.
    waiting: asyncio.TimerHandle | None = None
    # A store's ``Store.deadline`` (CLOCK_MONOTONIC; 0: none): committed only by then.
    deadline: float = 0.0


@dataclass(eq=False)
class Waiter:
    """A Wait not answered yet."""

    request_id: int
    job_ids: list[int]
    reply: Callable[[Reply], None]  # the Wait's sender, as dispatch gave it
    timer: asyncio.TimerHandle | None = None


def wait_result(state: SessionState, waiter: Waiter) -> WaitResult:
    """What ``waiter`` is told now: its jobs that are done, and those still in flight."""
    done = [state.done[j] for j in waiter.job_ids if j in state.done]
    pending = [j for j in waiter.job_ids if j in state.jobs]
    return WaitResult(waiter.request_id, done, pending)


@dataclass(frozen=True)
class Accepted:
    """A NOTICE handler's answer (``offloadd.server.dispatch``): ``reply`` now, then
    ``then()`` (if any) right after it."""

    reply: Reply
    then: Callable[[], None] | None = None

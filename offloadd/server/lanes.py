"""Two lanes of work for the event loop: control requests first, bulk work between them.

A scheduler's Lookup or Reserve costs the loop tens of microseconds; a rank's Store costs it
a millisecond or more (its chunks placed, evictions journaled and announced, the copy
queued), and so does the end of each copy (commit, journal, announce, JobDone). Handled in
arrival order, a Lookup waits behind every Store and copy end queued before it. Here it
waits for at most the one bulk item the loop is running when it arrives.

Contract of ``Lanes`` (the event loop's thread only; pure, no sockets):
- ``add(peer, frames, urgent)``: queue a request as read from the socket. ``urgent`` (a
  control request, see ``URGENT``) goes to the control lane, unless the same peer still has
  a request in the bulk lane: then it queues behind that one, so one peer's requests are
  always handled in the order it sent them.
- ``add_work(work)``: queue a callable in the bulk lane (a copy's end), in order with the
  bulk requests.
- ``pop()``: ``(item, bulk)``, the next item and whether it came from the bulk lane, or None
  when both lanes are empty; an item is a ``(peer, frames)`` tuple or a callable. Control
  first, but after ``burst`` control items in a row one bulk item goes (a peer flooding
  Lookups slows the stores, never stops them).
- ``requests``: requests queued in both lanes (the reader stops reading the socket above a
  bound, so zmq's queues push back); ``len()``: every item queued.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

__all__ = ["URGENT", "Lanes"]

# Request tags (protocol.messages) answered ahead of bulk work: each is cheap on the loop
# and someone waits on it (vLLM's scheduler step, a Wait, a heartbeat). GetStats is not: an
# admin's covers every engine, and nothing latency-bound waits on it.
URGENT = frozenset({"lookup", "reserve", "holds", "ack", "release", "wait", "ping"})

Request = tuple[bytes, list[bytes]]
Item = Request | Callable[[], object]


class Lanes:
    """The control lane and the bulk lane; see the module docstring."""

    def __init__(self, burst: int) -> None:
        self._burst = burst
        self._control: deque[Request] = deque()
        self._bulk: deque[Item] = deque()
        self._in_bulk: dict[bytes, int] = {}  # per peer: its requests in the bulk lane
        self._run = 0  # control items popped since the last bulk item
        self.requests = 0

    def __len__(self) -> int:
        return len(self._control) + len(self._bulk)

    def add(self, peer: bytes, frames: list[bytes], urgent: bool) -> None:
        """Queue a request; see the module docstring."""
        self.requests += 1
        if urgent and peer not in self._in_bulk:
            self._control.append((peer, frames))
            return
        self._in_bulk[peer] = self._in_bulk.get(peer, 0) + 1
        self._bulk.append((peer, frames))

    def add_work(self, work: Callable[[], object]) -> None:
        """Queue ``work`` in the bulk lane."""
        self._bulk.append(work)

    def pop(self) -> tuple[Item, bool] | None:
        """The next item to run and whether it is bulk, or None; see the module docstring."""
        if self._control and (self._run < self._burst or not self._bulk):
            self._run += 1
            self.requests -= 1
            return self._control.popleft(), False
        self._run = 0
        if not self._bulk:
            return None
        item = self._bulk.popleft()
        if isinstance(item, tuple):
            self.requests -= 1
            peer = item[0]
            left = self._in_bulk[peer] - 1
            if left:
                self._in_bulk[peer] = left
            else:
                del self._in_bulk[peer]
        return item, True

"""Two lanes of work for the event loop, control requests first, each served tenant by tenant.

A scheduler's Lookup or Reserve costs the loop tens of microseconds; a rank's Store costs it
a millisecond or more (its chunks placed, evictions journaled and announced, the copy
queued), and so does the end of each copy (commit, journal, announce, JobDone). Handled in
arrival order, a Lookup waits behind every Store and copy end queued before it. Here it
waits for at most the one bulk item the loop is running when it arrives. And handled in
arrival order, one tenant's flood (many sessions, each sending as fast as it can) fills the
queue ahead of everyone else's requests; here each lane serves its tenants in turn.

Contract of ``Lanes`` (the event loop's thread only; pure, no sockets):
- ``Lanes(burst, tenant_of, weight_of)``: ``tenant_of(peer)`` names the tenant a request
  is queued under when it is read (the daemon's: its session's, else its registration's,
  else "": the peers it knows nothing of share one turn);
  ``weight_of(tenant)`` the items it may have served per turn (1 when not given).
- ``add(peer, frames, urgent)``: queue a request as read from the socket. ``urgent`` (a
  control request, see ``URGENT``) goes to the control lane, unless the same peer still has
  a request in the bulk lane: then it queues behind that one, so one peer's requests are
  always handled in the order it sent them. A peer's requests stay under the tenant of its
  first one still queued (a Hello changes it), for the same reason.
- ``add_work(work, tenant)``: queue a callable in ``tenant``'s bulk lane (a copy's end), in
  order with that tenant's bulk requests.
- ``add_next(peer, work, bulk)``: queue the rest of ``peer``'s request, cut into quanta,
  ahead of everything of its tenant in the lane that request came from, counted as one of
  ``peer``'s (so its later control requests queue behind it as behind a bulk request).
- ``pop()``: ``(item, bulk)``, the next item and whether it came from the bulk lane, or None
  when both lanes are empty; an item is a ``(peer, frames)`` tuple or a callable. Control
  first, but after ``burst`` control items in a row one bulk item goes (a peer flooding
  Lookups slows the stores, never stops them). Control items are counted by their size, so
  that a flood of large ones lets bulk through as often as one of small ones would: a request
  counts one per ``UNIT`` bytes of its frame (one at least), the rest of a request cut into
  quanta ``QUANTUM_ITEMS``. Within a lane, tenants with items queued take turns (deficit
  round robin, each item costing one): a tenant's turn serves up to its weight of items in
  arrival order, then the next tenant's begins.
- ``requests`` and ``bytes``: requests queued in both lanes and their frames' bytes (the
  reader stops reading the socket above a bound on each, so zmq's queues push back);
  ``len()``: every item queued.

The bound this gives (``docs/security.md``, "Fair service across tenants"): with weights 1,
a request waits for at most one item of each other tenant in its own lane; a control request
for at most one bulk item besides, a bulk one for at most ``burst`` control items between two
bulk items. Each item's work is bounded in turn (``limits.*_per_message``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["URGENT", "Lanes", "Next"]

# Request tags (protocol.messages) answered ahead of bulk work: each is cheap on the loop
# and someone waits on it (vLLM's scheduler step, a Wait, a heartbeat). GetStats is not: an
# admin's covers every engine, and nothing latency-bound waits on it.
URGENT = frozenset({"lookup", "reserve", "holds", "ack", "release", "wait", "ping"})

Request = tuple[bytes, list[bytes]]
# How much of ``burst`` a control item uses: a request one per UNIT bytes of its frame (a
# Lookup of a prompt's keys is one), the rest of a request cut into quanta QUANTUM_ITEMS (a
# quantum answers 64 lookups).
UNIT = 16 << 10
QUANTUM_ITEMS = 16


@dataclass(slots=True)
class Next:
    """The rest of a peer's request (``add_next``); called like any work."""

    peer: bytes
    work: Callable[[], object]

    def __call__(self) -> object:
        return self.work()


Item = Request | Callable[[], object]


@dataclass(slots=True)
class _Peer:
    """A peer with requests queued: under which tenant, how many, how many of them bulk."""

    tenant: str
    queued: int = 0
    in_bulk: int = 0


@dataclass(slots=True)
class _Lane:
    """One lane: each tenant's queue, and the tenants with items queued in turn order."""

    queues: dict[str, deque[Item]] = field(default_factory=dict)
    turns: deque[str] = field(default_factory=deque)
    left: int = 0  # items the tenant at the head of ``turns`` may still take this turn

    def __bool__(self) -> bool:
        return bool(self.turns)

    def add(self, tenant: str, item: Item, *, first: bool = False) -> None:
        queue = self.queues.get(tenant)
        if queue is None:
            queue = self.queues[tenant] = deque()
        if not queue:
            self.turns.append(tenant)
        if first:
            queue.appendleft(item)
        else:
            queue.append(item)

    def pop(self, weight_of: Callable[[str], int]) -> Item:
        tenant = self.turns[0]
        if self.left <= 0:
            self.left = max(1, weight_of(tenant))
        queue = self.queues[tenant]
        item = queue.popleft()
        self.left -= 1
        if not queue:
            del self.queues[tenant]
            self.turns.popleft()
            self.left = 0
        elif self.left <= 0:
            self.turns.rotate(-1)
        return item


class Lanes:
    """The control lane and the bulk lane; see the module docstring."""

    def __init__(
        self,
        burst: int,
        tenant_of: Callable[[bytes], str] = lambda _peer: "",
        weight_of: Callable[[str], int] = lambda _tenant: 1,
    ) -> None:
        self._burst = burst
        self._tenant_of = tenant_of
        self._weight_of = weight_of
        self._control = _Lane()
        self._bulk = _Lane()
        self._peers: dict[bytes, _Peer] = {}  # those with requests queued
        self._run = 0  # control items (by their size) popped since the last bulk item
        self._items = 0
        self.requests = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self._items

    def add(self, peer: bytes, frames: list[bytes], urgent: bool) -> None:
        """Queue a request; see the module docstring."""
        self.requests += 1
        self.bytes += sum(map(len, frames))
        self._items += 1
        known = self._peer(peer)
        known.queued += 1
        if urgent and not known.in_bulk:
            self._control.add(known.tenant, (peer, frames))
            return
        known.in_bulk += 1
        self._bulk.add(known.tenant, (peer, frames))

    def add_next(self, peer: bytes, work: Callable[[], object], bulk: bool) -> None:
        """Queue the rest of ``peer``'s request first; see the module docstring."""
        self._items += 1
        known = self._peer(peer)
        known.queued += 1
        known.in_bulk += bulk
        (self._bulk if bulk else self._control).add(known.tenant, Next(peer, work), first=True)

    def _peer(self, peer: bytes) -> _Peer:
        known = self._peers.get(peer)
        if known is None:
            known = self._peers[peer] = _Peer(self._tenant_of(peer))
        return known

    def add_work(self, work: Callable[[], object], tenant: str = "") -> None:
        """Queue ``work`` in ``tenant``'s bulk lane."""
        self._items += 1
        self._bulk.add(tenant, work)

    def pop(self) -> tuple[Item, bool] | None:
        """The next item to run and whether it is bulk, or None; see the module docstring."""
        if self._control and (self._run < self._burst or not self._bulk):
            item = self._control.pop(self._weight_of)
            if isinstance(item, tuple):
                self._run += 1 + sum(map(len, item[1])) // UNIT
            else:
                self._run += QUANTUM_ITEMS
            bulk = False
        else:
            self._run = 0
            if not self._bulk:
                return None
            item = self._bulk.pop(self._weight_of)
            bulk = True
        self._items -= 1
        if isinstance(item, tuple):
            self.requests -= 1
            self.bytes -= sum(map(len, item[1]))
            peer = item[0]
        elif isinstance(item, Next):
            peer = item.peer
        else:
            return item, bulk
        known = self._peers[peer]
        known.queued -= 1
        known.in_bulk -= bulk
        if not known.queued:
            del self._peers[peer]
        return item, bulk

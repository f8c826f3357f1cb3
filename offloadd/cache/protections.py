"""What keeps rows from eviction on behalf of an owner: pins, holds and reservations (pure).

Each protection is a mark on the row (``offloadd.cache.lifecycle``) and an entry in one of
the dicts here, and its bytes are charged to its owner in the one ``Ledger``
(``offloadd.cache.ledger``), at the very points it is taken and dropped; nothing else calls
the ledger. Contract of ``Protections``:

- Pins (``lookup`` with a lease): ``pin_hits`` pins committed rows until an expiry, within a
  room; ``unpin_keys`` / ``release_owner`` drop them; ``pinned(row, now)`` says whether an
  unexpired pin holds a row (dropping its pins once all expired); ``drop_pins`` drops a
  row's pins as it leaves the index.
- Holds (a scheduler's requests): ``hold_tokens``, ``release_hold_tokens`` and
  ``release_holds``; ``held_rows`` reads the rows a token holds (removed ones too).
- Reservations (a scheduler's new keys): ``reserve`` marks pending rows as an owner's and
  starts their lease; ``committed`` ends them as they commit, ``end_reservation`` as one
  leaves; ``release_reservations`` and ``lapsed`` end an owner's, or those whose lease ended.
  With ``reservation_renewals``, a key is reserved at most that many times more after its
  first reservation until it is stored (``committed``): ``renewable(namespace, key)`` says
  whether it may be reserved again, so a lease that a scheduler renews by reserving the key
  again after it lapsed (or after it left) ends. The count is kept for the last
  ``RENEWALS_KEPT`` keys reserved.
- ``room(account, tenant, now)``: what an engine within its tenant may still protect,
  expired pins dropped first (they protect nothing); ``tenant_binds`` says which bound that
  was, ``owned(owner)`` what an owner protects.

Nothing here takes a row out of the index or frees it: a call that may leave a dead row
unused returns the rows, and the cache releases them (``offloadd.cache.placement``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

from offloadd.cache import lifecycle
from offloadd.cache.ledger import TENANT, Ledger
from offloadd.cache.lifecycle import COMMITTED, DEAD, Event
from offloadd.cache.rows import NO_ROWS, Rows
from offloadd.cache.watchers import Watchers

__all__ = ["RENEWALS_KEPT", "Protections"]

RENEWALS_KEPT = 1 << 16  # keys whose reservations since their last store are counted

_HOLD = int(Event.HOLD)
_UNHOLD = int(Event.UNHOLD)
_PIN = int(Event.PIN)
_UNPIN = int(Event.UNPIN)
_RESERVE = int(Event.RESERVE)
_UNRESERVE = int(Event.UNRESERVE)
_NO_PINS: dict[str, float] = {}
_INF = float("inf")


class Protections:
    """Pins, holds and reservations, and their ledger; see the module docstring."""

    def __init__(
        self,
        rows: Rows,
        watchers: Watchers,
        *,
        budget: int | None,
        tenant_budget: int | None,
        reservation_lease: float | None,
        reservation_renewals: int | None = None,
    ) -> None:
        self._rows = rows
        self._watchers = watchers
        self._ledger = Ledger(budget, tenant_budget)
        self.pins: dict[int, dict[str, float]] = {}
        self.owners: dict[str, set[int]] = {}  # owner -> rows it pins (a session's end)
        self.row_holds: dict[int, int] = {}
        # (owner, token) -> key -> (row, count): holds of a scheduler's requests.
        self.holds: dict[tuple[str, str], dict[bytes, tuple[int, int]]] = {}
        self._hold_tokens: dict[str, set[str]] = {}
        self.reserved_by: dict[int, str] = {}
        self._reservations: dict[str, set[int]] = {}
        # Reservations end by this time (``reservation_lease``): row -> deadline, and the
        # rows of each reserve call with their deadline, oldest first (the lease is one for
        # all, the clock never goes back); rows whose deadline differs or is gone are stale.
        self._lease = reservation_lease
        self._reserved_until: dict[int, float] = {}
        self._deadlines: deque[tuple[float, list[int]]] = deque()
        # (namespace id, key) -> its reservations since it was last stored, oldest first.
        self._renewals = reservation_renewals
        self._reserved_times: OrderedDict[tuple[int, bytes], int] = OrderedDict()

    # -- the ledger -------------------------------------------------------------------------

    def room(self, account: Hashable | None, tenant: Hashable | None, now: float) -> float:
        """The bytes ``account`` within ``tenant`` may still protect (no bound without
        either); their expired pins are dropped first."""
        ledger = self._ledger
        if ledger.room(account, tenant) == _INF:
            return _INF
        for member in ledger.members(account, tenant):
            heap = ledger.expiries(member)
            while heap and heap[0][0] <= now:
                expiry, row = heapq.heappop(heap)
                pins = self.pins.get(row)
                if pins is not None and pins.get(member, _INF) <= expiry:
                    self._drop_pin(row, member)
                    if not ledger.bounded(member):
                        break  # its last bytes went: forgotten, heap and all
        return ledger.room(account, tenant)

    def owned(self, owner: str) -> int:
        """Bytes ``owner``'s pins (possibly expired), holds and reservations keep."""
        return self._ledger.owned(owner)

    def tenant_binds(self, account: Hashable | None, tenant: Hashable | None) -> bool:
        """Whether ``room`` comes from the tenant's bound rather than the engine's."""
        return self._ledger.binding(account, tenant) == TENANT

    def _cost(self, row: int) -> int:
        rows = self._rows
        return rows.nbytes[rows.shape.v[row]]

    # -- pins -------------------------------------------------------------------------------

    def pin_hits(
        self,
        hits: Sequence[int],
        owner: str,
        expiry: float,
        room: float,
        account: Hashable | None,
        tenant: Hashable | None,
    ) -> int:
        """Pin ``hits`` for ``owner`` until ``expiry``, those new to it within ``room``
        bytes; returns how many are pinned."""
        if room == _INF:
            for row in hits:
                self._pin(row, owner, expiry, account, tenant)
            return len(hits)
        pinned = 0
        pins, nbytes, shape_of = self.pins, self._rows.nbytes, self._rows.shape.v
        for row in hits:
            if owner not in pins.get(row, _NO_PINS):
                cost = nbytes[shape_of[row]]
                if cost > room:
                    continue
                room -= cost
            self._pin(row, owner, expiry, account, tenant)
            pinned += 1
        return pinned

    def _pin(
        self,
        row: int,
        owner: str,
        expiry: float,
        account: Hashable | None,
        tenant: Hashable | None,
    ) -> None:
        pins = self.pins.get(row)
        if pins is None:
            pins = self.pins[row] = {}
            state = self._rows.state.v
            state[row] = lifecycle.step(state[row], _PIN)
        old = pins.get(owner)
        if old is not None and expiry <= old:
            return
        pins[owner] = expiry
        ledger = self._ledger
        if old is None:
            ledger.charge(owner, self._cost(row), account, tenant)
            self.owners.setdefault(owner, set()).add(row)
        if ledger.bounded(owner):
            heap = ledger.expiries(owner)
            heapq.heappush(heap, (expiry, row))
            owned = self.owners[owner]
            if len(heap) > 2 * len(owned) + 64:  # released pins leave stale items
                heap = [(self.pins[pinned][owner], pinned) for pinned in owned]
                heapq.heapify(heap)
                ledger.set_expiries(owner, heap)

    def unpin_keys(self, table: dict[bytes, int], keys: Sequence[bytes], owner: str) -> int:
        """Drop ``owner``'s pins on the rows of ``keys`` in ``table``; returns how many."""
        owned = self.owners.get(owner)
        if owned is None:
            return 0
        dropped = 0
        for key in keys:
            row = table.get(key)
            pins = self.pins.get(row) if row is not None else None
            if pins is None or owner not in pins:
                continue
            assert row is not None
            del pins[owner]
            if not pins:
                self._unpin(row)
            owned.discard(row)
            self._ledger.refund(owner, self._cost(row))
            dropped += 1
        if not owned:
            del self.owners[owner]
        return dropped

    def release_owner(self, owner: str) -> int:
        """Drop every pin of ``owner``; returns how many were dropped."""
        owned = self.owners.pop(owner, None)
        if owned is None:
            return 0
        refund, nbytes, shape_of = self._ledger.refund, self._rows.nbytes, self._rows.shape.v
        for row in owned:
            pins = self.pins[row]
            del pins[owner]
            if not pins:
                self._unpin(row)
            refund(owner, nbytes[shape_of[row]])
        return len(owned)

    def _drop_pin(self, row: int, owner: str) -> None:
        """Drop ``owner``'s pin on ``row`` (it has one)."""
        pins = self.pins[row]
        del pins[owner]
        if not pins:
            self._unpin(row)
        owned = self.owners[owner]
        owned.discard(row)
        if not owned:
            del self.owners[owner]
        self._ledger.refund(owner, self._cost(row))

    def _unpin(self, row: int) -> None:
        del self.pins[row]
        state = self._rows.state.v
        state[row] = lifecycle.step(state[row], _UNPIN)

    def pinned(self, row: int, now: float) -> bool:
        """Whether an unexpired pin holds ``row``; drops the pins if all have expired."""
        if any(expiry > now for expiry in self.pins[row].values()):
            return True
        self.drop_pins(row)
        return False

    def drop_pins(self, row: int) -> None:
        """Drop every pin on ``row`` (it has some)."""
        cost = self._cost(row)
        for owner in self.pins[row]:
            owned = self.owners[owner]
            owned.discard(row)
            if not owned:
                del self.owners[owner]
            self._ledger.refund(owner, cost)
        self._unpin(row)

    # -- holds ------------------------------------------------------------------------------

    def hold_tokens(
        self,
        namespace: str,
        owner: str,
        holds: Sequence[tuple[str, Sequence[bytes]]],
        room: float,
        account: Hashable | None,
        tenant: Hashable | None,
    ) -> tuple[list[bytes], list[int], list[int]]:
        """Hold each token's keys (see ``ChunkCache.hold_tokens``), new holds within
        ``room``. Returns the keys not held (missing, then beyond the room), the committed
        rows held (to touch) and the dead rows no longer held (to release)."""
        rows = self._rows
        table = rows.tables.get(namespace, NO_ROWS)
        state = rows.state.v
        missing: list[bytes] = []
        over: list[bytes] = []
        touched: list[int] = []
        nbytes, shape_of = rows.nbytes, rows.shape.v
        row_holds, find = self.row_holds, self._watchers.find
        charged = refunded = 0  # settled with the ledger once, at the end
        replaced: list[tuple[int, int]] = []  # (row, holds) of keys re-held on a new row
        for token, keys in holds:
            held = self.holds.get((owner, token))
            for key in keys:
                row = table.get(key)
                if row is not None and state[row] & COMMITTED:
                    touched.append(row)
                else:
                    row = find(namespace, key)
                    if row is None:
                        missing.append(key)
                        continue
                previous = held.get(key) if held is not None else None
                cost = nbytes[shape_of[row]]
                if previous is None:
                    if cost > room:
                        over.append(key)
                        continue
                    room -= cost
                    charged += cost
                elif previous[0] != row:
                    charged += cost
                    refunded += nbytes[shape_of[previous[0]]]
                    replaced.append(previous)  # re-held after a re-store: the newest
                    previous = (row, 0)
                if held is None:
                    held = self.holds[(owner, token)] = {}
                    self._hold_tokens.setdefault(owner, set()).add(token)
                held[key] = (row, 1 if previous is None else previous[1] + 1)
                row_holds[row] = row_holds.get(row, 0) + 1
                state[row] = lifecycle.step(state[row], _HOLD)
        if charged:
            self._ledger.charge(owner, charged, account, tenant)
        if refunded:
            self._ledger.refund(owner, refunded)
        dead = [row for row, count in replaced if self._unhold(row, count)]
        return (missing + over if over else missing), touched, dead

    def release_hold_tokens(
        self, owner: str, releases: Sequence[tuple[str, Sequence[bytes]]]
    ) -> tuple[int, list[int]]:
        """Drop one hold of ``(owner, token)`` on each token's keys; returns how many holds
        were dropped and the dead rows no longer held."""
        refunded = 0
        unheld: list[int] = []
        nbytes, shape_of = self._rows.nbytes, self._rows.shape.v
        for token, keys in releases:
            held = self.holds.get((owner, token))
            if held is None:
                continue
            for key in keys:
                found = held.get(key)
                if found is None:
                    continue
                row, count = found
                if count > 1:
                    held[key] = (row, count - 1)
                else:
                    del held[key]
                    refunded += nbytes[shape_of[row]]
                unheld.append(row)
            if not held:
                del self.holds[(owner, token)]
                tokens = self._hold_tokens[owner]
                tokens.discard(token)
                if not tokens:
                    del self._hold_tokens[owner]
        if refunded:  # before the rows are let go: what they free is counted as free
            self._ledger.refund(owner, refunded)
        return len(unheld), [row for row in unheld if self._unhold(row, 1)]

    def release_holds(self, owner: str) -> tuple[int, list[int]]:
        """Drop every hold of ``owner``; returns how many keys and the dead rows unheld."""
        dropped = 0
        dead: list[int] = []
        refund, nbytes, shape_of = self._ledger.refund, self._rows.nbytes, self._rows.shape.v
        for token in self._hold_tokens.pop(owner, set()):
            for row, count in self.holds.pop((owner, token)).values():
                refund(owner, nbytes[shape_of[row]])
                if self._unhold(row, count):
                    dead.append(row)
                dropped += 1
        return dropped, dead

    def _unhold(self, row: int, count: int) -> bool:
        """Drop ``count`` holds of ``row``; whether that left it dead and unheld."""
        holds = self.row_holds[row] - count
        if holds:
            self.row_holds[row] = holds
            return False
        del self.row_holds[row]
        state = self._rows.state.v
        state[row] = lifecycle.step(state[row], _UNHOLD)
        return bool(state[row] & DEAD)

    def held_rows(
        self, owner: str, loads: Sequence[tuple[str, Sequence[bytes]]]
    ) -> list[tuple[list[int], list[bytes]]]:
        """For each ``(token, keys)``: the rows the token holds for every key, or none and
        the keys it does not hold."""
        holds = self.holds
        no_hold: dict[bytes, tuple[int, int]] = {}
        found: list[tuple[list[int], list[bytes]]] = []
        for token, keys in loads:
            held = holds.get((owner, token), no_hold)
            try:
                found.append(([held[key][0] for key in keys], []))
            except KeyError:
                found.append(([], [key for key in keys if key not in held]))
        return found

    def held(self) -> int:
        """Keys held, over every token."""
        return sum(len(held) for held in self.holds.values())

    # -- reservations -----------------------------------------------------------------------

    def reserve(
        self, rows: list[int], owner: str, account: Hashable | None, tenant: Hashable | None
    ) -> None:
        """``owner`` reserves the new pending ``rows`` (their lease starts with ``lease``):
        one ledger charge for them all."""
        if not rows:
            return
        reserved_by, state, step = self.reserved_by, self._rows.state.v, lifecycle.step
        nbytes, shape_of = self._rows.nbytes, self._rows.shape.v
        cost = 0
        for row in rows:
            reserved_by[row] = owner
            state[row] = step(state[row], _RESERVE)
            cost += nbytes[shape_of[row]]
        self._ledger.charge(owner, cost, account, tenant)
        self._reservations.setdefault(owner, set()).update(rows)
        if self._renewals is not None:
            times = self._reserved_times
            for row in rows:
                name = self._name(row)
                times[name] = times.pop(name, 0) + 1
            while len(times) > RENEWALS_KEPT:
                times.popitem(last=False)

    def renewable(self, namespace: str, key: bytes) -> bool:
        """Whether ``key`` may be reserved (again): within ``reservation_renewals``."""
        ns = self._rows.namespace_ids.get(namespace)
        if self._renewals is None or ns is None:
            return True
        return self._reserved_times.get((ns, key), 0) <= self._renewals

    def committed(self, rows: list[int]) -> None:
        """``rows`` committed: their reservations end (one refund per owner) and their keys'
        reservations start counting afresh."""
        reserved_by, until = self.reserved_by, self._reserved_until
        state, step = self._rows.state.v, lifecycle.step
        nbytes, shape_of = self._rows.nbytes, self._rows.shape.v
        refunds: dict[str, int] = {}
        for row in rows:
            owner = reserved_by.pop(row, None)
            if owner is None:
                continue
            until.pop(row, None)
            state[row] = step(state[row], _UNRESERVE)
            refunds[owner] = refunds.get(owner, 0) + nbytes[shape_of[row]]
            reserved = self._reservations[owner]
            reserved.discard(row)
            if not reserved:
                del self._reservations[owner]
        for owner, cost in refunds.items():
            self._ledger.refund(owner, cost)
        if self._reserved_times:
            for row in rows:
                self._reserved_times.pop(self._name(row), None)

    def _name(self, row: int) -> tuple[int, bytes]:
        key = self._rows.keys[row]
        assert key is not None
        return int(self._rows.ns.v[row]), key

    def lease(self, rows: list[int], now: float) -> None:
        """Start the lease of the rows one ``reserve`` call reserved."""
        if self._lease is not None and rows:
            deadline = now + self._lease
            self._reserved_until.update(dict.fromkeys(rows, deadline))
            self._deadlines.append((deadline, rows))

    def end_reservation(self, row: int) -> None:
        """End ``row``'s reservation, if it has one (it committed, or leaves the index)."""
        owner = self.reserved_by.pop(row, None)
        if owner is not None:
            self._reserved_until.pop(row, None)
            state = self._rows.state.v
            state[row] = lifecycle.step(state[row], _UNRESERVE)
            self._ledger.refund(owner, self._cost(row))
            reserved = self._reservations[owner]
            reserved.discard(row)
            if not reserved:
                del self._reservations[owner]

    def release_reservations(self, owner: str) -> list[int]:
        """End every reservation of ``owner``; returns their rows (still pending)."""
        rows = self._reservations.pop(owner, set())
        until, state = self._reserved_until, self._rows.state.v
        for row in rows:
            del self.reserved_by[row]
            until.pop(row, None)
            state[row] = lifecycle.step(state[row], _UNRESERVE)
            self._ledger.refund(owner, self._cost(row))
        return list(rows)

    def lapsed(self, now: float) -> list[int]:
        """End the reservations whose lease ended by ``now``; returns their rows that no
        copy writes (those being written are left plain pending: their store has begun)."""
        deadlines = self._deadlines
        if not deadlines or deadlines[0][0] > now:
            return []
        lapsed: list[int] = []
        while deadlines and deadlines[0][0] <= now:
            deadline, rows = deadlines.popleft()
            for row in rows:
                if self._reserved_until.get(row) != deadline:
                    continue  # committed, released or re-reserved since
                self.end_reservation(row)
                if row not in self._rows.writing:
                    lapsed.append(row)
        return lapsed

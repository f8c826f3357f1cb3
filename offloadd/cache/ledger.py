"""The bytes each owner keeps from eviction, and each account's share against its budget.

``ChunkCache`` owns what is protected (its pins, holds and reservations, which eviction
reads); this is the count of those bytes, changed by the cache at the very points it takes or
drops a protection, so the count and the protections cannot drift apart. Contract:

- ``charge(owner, nbytes, account)`` / ``refund(owner, nbytes)``: the owner now protects
  ``nbytes`` more / fewer (an entry's payload, all shards together). With an ``account`` (the
  daemon's engine key) the owner's bytes count towards it from then on; an owner never
  charged with one is counted but bounded by nothing. An owner whose count falls to zero is
  forgotten, its account and pin expiries with it.
- ``room(account)``: the bytes the account may still protect, ``budget`` minus what its
  owners protect (``math.inf`` with no budget). The cache asks before it takes a protection,
  never takes one beyond the room, so nothing is taken and then given back.
- ``expiries(owner)``: a heap of ``(expiry, row)`` of the owner's pins, for the cache to
  drop expired pins of an account before it counts that account's room. Items may be stale
  (pins released or extended since); the cache checks each against its pins.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

__all__ = ["Ledger"]


class Ledger:
    """Protected bytes per owner and per account; see the module docstring."""

    __slots__ = ("_account", "_bytes", "_expiries", "_members", "_totals", "budget")

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget  # bytes each account may protect; None: no bound
        self._bytes: dict[str, int] = {}
        self._account: dict[str, Hashable] = {}
        self._members: dict[Hashable, set[str]] = {}
        self._totals: dict[Hashable, int] = {}
        self._expiries: dict[str, list[tuple[float, int]]] = {}

    def owned(self, owner: str) -> int:
        """Bytes ``owner`` protects (its pins possibly expired)."""
        return self._bytes.get(owner, 0)

    def used(self, account: Hashable) -> int:
        """Bytes the owners of ``account`` protect."""
        return self._totals.get(account, 0)

    def room(self, account: Hashable) -> float:
        """Bytes ``account`` may still protect."""
        if self.budget is None:
            return math.inf
        return max(0, self.budget - self._totals.get(account, 0))

    def bounded(self, owner: str) -> bool:
        """Whether a budget bounds ``owner`` (its pins' expiries are then kept)."""
        return self.budget is not None and owner in self._account

    def members(self, account: Hashable) -> list[str]:
        """The owners counted towards ``account``."""
        return list(self._members.get(account, ()))

    def account_of(self, owner: str) -> Hashable | None:
        """The account ``owner`` counts towards, if any."""
        return self._account.get(owner)

    def _enroll(self, owner: str, account: Hashable) -> None:
        self._leave(owner)
        self._account[owner] = account
        self._members.setdefault(account, set()).add(owner)
        nbytes = self._bytes.get(owner, 0)
        if nbytes:
            self._totals[account] = self._totals.get(account, 0) + nbytes

    def charge(self, owner: str, nbytes: int, account: Hashable | None = None) -> None:
        """``owner`` protects ``nbytes`` more, counted towards ``account`` if given."""
        if account is not None and self._account.get(owner) != account:
            self._enroll(owner, account)
        self._bytes[owner] = self._bytes.get(owner, 0) + nbytes
        account = self._account.get(owner)
        if account is not None:
            self._totals[account] = self._totals.get(account, 0) + nbytes

    def refund(self, owner: str, nbytes: int) -> None:
        """``owner`` protects ``nbytes`` fewer; forgotten when nothing is left."""
        left = self._bytes[owner] - nbytes
        account = self._account.get(owner)
        if account is not None:
            total = self._totals[account] - nbytes
            if total:
                self._totals[account] = total
            else:
                del self._totals[account]
        if left:
            self._bytes[owner] = left
            return
        del self._bytes[owner]
        self._expiries.pop(owner, None)
        self._leave(owner)

    def expiries(self, owner: str) -> list[tuple[float, int]]:
        """The heap of ``(expiry, row)`` of ``owner``'s pins (created empty)."""
        heap = self._expiries.get(owner)
        if heap is None:
            heap = self._expiries[owner] = []
        return heap

    def set_expiries(self, owner: str, heap: list[tuple[float, int]]) -> None:
        """Replace ``owner``'s expiry heap (compacted by the cache)."""
        self._expiries[owner] = heap

    def _leave(self, owner: str) -> None:
        account = self._account.pop(owner, None)
        if account is None:
            return
        nbytes = self._bytes.get(owner, 0)
        if nbytes:
            total = self._totals[account] - nbytes
            if total:
                self._totals[account] = total
            else:
                del self._totals[account]
        members = self._members[account]
        members.discard(owner)
        if not members:
            del self._members[account]

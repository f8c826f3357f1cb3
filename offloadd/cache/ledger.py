"""The bytes each owner keeps from eviction, and each account's share against its budget.

``ChunkCache`` owns what is protected (its pins, holds and reservations, which eviction
reads); this is the count of those bytes, changed by the cache at the very points it takes or
drops a protection, so the count and the protections cannot drift apart. An owner counts
towards two accounts at once: its engine (``account``, the daemon's engine key, bounded by
``budget``) and that engine's tenant (``tenant``, the uid or group its sessions come from,
bounded by ``tenant_budget``), so one user's engines together keep at most a tenant's share
however many engines it starts. Contract:

- ``charge(owner, nbytes, account, tenant)`` / ``refund(owner, nbytes)``: the owner now
  protects ``nbytes`` more / fewer (an entry's payload, all shards together). With an
  ``account`` and/or a ``tenant`` the owner's bytes count towards them from then on; an
  owner never charged with one is counted but bounded by nothing. An owner whose count falls
  to zero is forgotten, its accounts and pin expiries with it.
- ``room(account, tenant)``: the bytes the owners of both may still protect: the least of
  ``budget`` minus what the engine's owners protect and ``tenant_budget`` minus what the
  tenant's owners protect (``math.inf`` where no budget applies). ``binding`` says which of
  the two is the smaller. The cache asks before it takes a protection, never takes one
  beyond the room, so nothing is taken and then given back.
- ``expiries(owner)``: a heap of ``(expiry, row)`` of the owner's pins, for the cache to
  drop expired pins of an account's (or a tenant's) members before it counts the room. Items
  may be stale (pins released or extended since); the cache checks each against its pins.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

__all__ = ["ENGINE", "TENANT", "Ledger"]

# The two kinds of account an owner counts towards (the first item of an account's key).
ENGINE = 0
TENANT = 1

_Key = tuple[int, Hashable]


class Ledger:
    """Protected bytes per owner, per engine and per tenant; see the module docstring."""

    __slots__ = (
        "_accounts",
        "_bytes",
        "_expiries",
        "_members",
        "_totals",
        "budget",
        "tenant_budget",
    )

    def __init__(self, budget: int | None = None, tenant_budget: int | None = None) -> None:
        self.budget = budget  # bytes each engine may protect; None: no bound
        self.tenant_budget = tenant_budget  # bytes each tenant's engines may protect together
        self._bytes: dict[str, int] = {}
        self._accounts: dict[str, tuple[_Key, ...]] = {}
        self._members: dict[_Key, set[str]] = {}
        self._totals: dict[_Key, int] = {}
        self._expiries: dict[str, list[tuple[float, int]]] = {}

    def owned(self, owner: str) -> int:
        """Bytes ``owner`` protects (its pins possibly expired)."""
        return self._bytes.get(owner, 0)

    def used(self, account: Hashable) -> int:
        """Bytes the owners of engine ``account`` protect."""
        return self._totals.get((ENGINE, account), 0)

    def tenant_used(self, tenant: Hashable) -> int:
        """Bytes the owners of ``tenant`` (all its engines) protect."""
        return self._totals.get((TENANT, tenant), 0)

    def room(self, account: Hashable | None, tenant: Hashable | None = None) -> float:
        """Bytes ``account`` (within ``tenant``) may still protect."""
        return min(self._engine_room(account), self._tenant_room(tenant))

    def binding(self, account: Hashable | None, tenant: Hashable | None) -> int:
        """Which bound ``room`` comes from: ``TENANT`` when the tenant's is the smaller."""
        return TENANT if self._tenant_room(tenant) < self._engine_room(account) else ENGINE

    def _engine_room(self, account: Hashable | None) -> float:
        if self.budget is None or account is None:
            return math.inf
        return max(0, self.budget - self._totals.get((ENGINE, account), 0))

    def _tenant_room(self, tenant: Hashable | None) -> float:
        if self.tenant_budget is None or tenant is None:
            return math.inf
        return max(0, self.tenant_budget - self._totals.get((TENANT, tenant), 0))

    def bounded(self, owner: str) -> bool:
        """Whether a budget bounds ``owner`` (its pins' expiries are then kept)."""
        keys = self._accounts.get(owner, ())
        return any(
            (self.budget if kind == ENGINE else self.tenant_budget) is not None for kind, _ in keys
        )

    def members(self, account: Hashable | None, tenant: Hashable | None = None) -> list[str]:
        """The owners counted towards ``account`` or ``tenant`` (each once)."""
        found: dict[str, None] = {}
        if account is not None:
            found.update(dict.fromkeys(self._members.get((ENGINE, account), ())))
        if tenant is not None:
            found.update(dict.fromkeys(self._members.get((TENANT, tenant), ())))
        return list(found)

    def account_of(self, owner: str) -> Hashable | None:
        """The engine account ``owner`` counts towards, if any."""
        for kind, name in self._accounts.get(owner, ()):
            if kind == ENGINE:
                return name
        return None

    def _enroll(self, owner: str, keys: tuple[_Key, ...]) -> None:
        self._leave(owner)
        self._accounts[owner] = keys
        nbytes = self._bytes.get(owner, 0)
        for key in keys:
            self._members.setdefault(key, set()).add(owner)
            if nbytes:
                self._totals[key] = self._totals.get(key, 0) + nbytes

    def charge(
        self,
        owner: str,
        nbytes: int,
        account: Hashable | None = None,
        tenant: Hashable | None = None,
    ) -> None:
        """``owner`` protects ``nbytes`` more, counted towards ``account`` and ``tenant`` if
        given (an owner named with other accounts than before moves to them)."""
        if account is not None or tenant is not None:
            keys: tuple[_Key, ...] = ()
            if account is not None:
                keys += ((ENGINE, account),)
            if tenant is not None:
                keys += ((TENANT, tenant),)
            if self._accounts.get(owner) != keys:
                self._enroll(owner, keys)
        self._bytes[owner] = self._bytes.get(owner, 0) + nbytes
        totals = self._totals
        for key in self._accounts.get(owner, ()):
            totals[key] = totals.get(key, 0) + nbytes

    def refund(self, owner: str, nbytes: int) -> None:
        """``owner`` protects ``nbytes`` fewer; forgotten when nothing is left."""
        left = self._bytes[owner] - nbytes
        totals = self._totals
        for key in self._accounts.get(owner, ()):
            total = totals[key] - nbytes
            if total:
                totals[key] = total
            else:
                del totals[key]
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
        keys = self._accounts.pop(owner, ())
        nbytes = self._bytes.get(owner, 0)
        for key in keys:
            if nbytes:
                total = self._totals[key] - nbytes
                if total:
                    self._totals[key] = total
                else:
                    del self._totals[key]
            members = self._members[key]
            members.discard(owner)
            if not members:
                del self._members[key]

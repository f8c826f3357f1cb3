"""Eviction order for the host chunk cache.

A policy only *orders* live keys; whether a key may be evicted right now (being loaded, pinned,
being written, part of the store that needs the room) is the cache's decision. Contract of
``EvictionPolicy[K]``:

- ``insert(key)``: a new live key (the cache just allocated it). Inserting a live key counts as
  a touch.
- ``touch(keys)``: the keys were used (a lookup hit, a load). They are walked in reverse, as
  vLLM does, so that the earlier keys of a prefix end up most recent: a prefix is only useful
  from its start, so its head should outlive its tail. Keys that are not live are ignored.
- ``candidates()``: the live keys in eviction order, first = evict first. The caller may stop
  early and skips keys it cannot evict; it never mutates the policy while iterating (it
  collects victims, drops the iterator, then reports each with ``evicted``).
- ``evicted(key)``: the cache evicted a live key to make room (ARC remembers it as a ghost).
- ``remove(key)``: the key left for another reason (explicit removal, abandoned store); no
  history is kept. Unknown keys are ignored.
- ``len(policy)`` / ``key in policy``: live keys.

``LruPolicy`` is vLLM's LRU. ``ArcPolicy`` is vLLM's ARC (its offloading ``cpu/policies``)
adapted to a cache whose capacity is in bytes, not slots: the adaptive target and the ghost
lists are bounded by the number of live keys instead of a slot count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["ArcPolicy", "EvictionPolicy", "LruPolicy", "make_policy"]

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(Protocol[K]):
    """The order in which live keys are offered for eviction; see the module docstring."""

    def insert(self, key: K) -> None:
        """Add a new live key."""
        ...

    def touch(self, keys: Sequence[K]) -> None:
        """Record a use of ``keys``; earlier keys end up more recent than later ones."""
        ...

    def remove(self, key: K) -> None:
        """Forget ``key`` (not an eviction: no history is kept)."""
        ...

    def candidates(self) -> Iterator[K]:
        """Live keys, first = evict first. The policy must not be mutated while iterating."""
        ...

    def evicted(self, key: K) -> None:
        """``key`` was evicted to make room."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LruPolicy(Generic[K]):
    """Least recently used first: one ordered dict, LRU end first."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K) -> None:
        """Add ``key`` as the most recent key."""
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, keys: Sequence[K]) -> None:
        """Move live ``keys`` to the most recent end, ``keys[0]`` last (most recent)."""
        order = self._order
        for key in reversed(keys):
            if key in order:
                order.move_to_end(key)

    def remove(self, key: K) -> None:
        """Forget ``key``."""
        self._order.pop(key, None)

    def candidates(self) -> Iterator[K]:
        """Least recently used first."""
        return iter(self._order)

    def evicted(self, key: K) -> None:
        """Same as ``remove``: LRU keeps no history."""
        self._order.pop(key, None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class ArcPolicy(Generic[K]):
    """Adaptive replacement: T1 (seen once), T2 (seen again), ghosts B1/B2, a target for |T1|.

    - ``insert`` puts a key in T1, except a ghost: a B1 ghost raises the target by
      ``max(1, |B2|/|B1|)``, a B2 ghost lowers it by ``max(1, |B1|/|B2|)``, and the key goes
      straight to T2 (it was wanted again after being evicted).
    - ``touch`` moves a T1 key to T2, or refreshes a T2 key.
    - ``candidates`` yields T1 (oldest first) while the T1 keys not yet yielded are at least the
      target, then T2, then the rest of T1; this is ARC's replace rule applied victim by victim,
      assuming each yielded key is taken.
    - ``evicted`` moves the key to B1 or B2; each ghost list is trimmed to the number of live
      keys, oldest ghost first. ``remove`` keeps no ghost.
    """

    __slots__ = ("_b1", "_b2", "_t1", "_t2", "_target")

    def __init__(self) -> None:
        self._t1: OrderedDict[K, None] = OrderedDict()
        self._t2: OrderedDict[K, None] = OrderedDict()
        self._b1: OrderedDict[K, None] = OrderedDict()
        self._b2: OrderedDict[K, None] = OrderedDict()
        self._target = 0.0

    @property
    def target(self) -> float:
        """The adaptive target size of T1 (in keys)."""
        return self._target

    def insert(self, key: K) -> None:
        """Add ``key``: to T1, or to T2 after adapting the target if it is a ghost."""
        if key in self._t1 or key in self._t2:
            self.touch((key,))
            return
        if key in self._b1:
            delta = max(1.0, len(self._b2) / len(self._b1))
            self._target = min(self._target + delta, float(len(self) + 1))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            delta = max(1.0, len(self._b1) / len(self._b2))
            self._target = max(self._target - delta, 0.0)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def touch(self, keys: Sequence[K]) -> None:
        """Promote live ``keys`` to the most recent end of T2, ``keys[0]`` last."""
        t1, t2 = self._t1, self._t2
        for key in reversed(keys):
            if key in t1:
                del t1[key]
                t2[key] = None
            elif key in t2:
                t2.move_to_end(key)

    def remove(self, key: K) -> None:
        """Forget ``key``, ghost included."""
        for lst in (self._t1, self._t2, self._b1, self._b2):
            lst.pop(key, None)
        self._trim_ghosts()

    def candidates(self) -> Iterator[K]:
        """T1 while its remaining size is at least the target, then T2, then the rest of T1."""
        t1_keys = iter(self._t1)
        remaining = len(self._t1)
        while remaining and remaining >= self._target:
            yield next(t1_keys)
            remaining -= 1
        yield from self._t2
        yield from t1_keys

    def evicted(self, key: K) -> None:
        """Turn live ``key`` into a ghost (T1 -> B1, T2 -> B2)."""
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        else:
            return
        self._trim_ghosts()

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def is_ghost(self, key: object) -> bool:
        """Whether ``key`` is remembered in B1 or B2."""
        return key in self._b1 or key in self._b2

    def _trim_ghosts(self) -> None:
        live = len(self)
        for ghosts in (self._b1, self._b2):
            while len(ghosts) > live:
                ghosts.popitem(last=False)


_POLICIES: dict[str, type[LruPolicy[Any]] | type[ArcPolicy[Any]]] = {
    "lru": LruPolicy,
    "arc": ArcPolicy,
}


def make_policy(name: str) -> EvictionPolicy[K]:
    """A new, empty policy by name: ``"lru"`` or ``"arc"``."""
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; expected one of {', '.join(sorted(_POLICIES))}"
        ) from None
    return cls()

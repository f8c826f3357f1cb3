"""Reference implementations the tests hold the daemon's fast code against; nothing in
``offloadd`` imports them.

- ``LruPolicy`` and ``ArcPolicy`` (``EvictionPolicy[K]``, made by ``make_policy``): vLLM's LRU
  and ARC (its offloading ``cpu/policies``) over hashable keys, one ordered dict per list.
  ``offloadd.cache.policy``'s ``RowLru``/``RowArc`` must order the cache's rows exactly as
  these order keys. ARC is adapted to a cache whose capacity is in bytes, not slots: the
  adaptive target and the ghost lists are bounded by the number of live keys instead of a
  slot count.
- ``plan_chunk``: the copies of one chunk as ``Move(region, region_offset, shard_offset,
  nbytes)``, one block at a time, merged where contiguous on both sides: the readable
  statement of ``offloadd.transfer.plan``'s layout, which ``chunk_copies`` must copy byte for
  byte. ``reference_pairs`` spells a plan out as byte pairs.

Contract of ``EvictionPolicy[K]`` (``RowPolicy``'s, with keys for rows):

- ``insert(key)``: a new live key. Inserting a live key counts as a touch.
- ``touch(keys)``: the keys were used; walked in reverse, so the earlier keys of a prefix end
  up most recent. Keys that are not live are ignored.
- ``candidates()``: the live keys in eviction order, first = evict first; not mutated while
  iterated.
- ``evicted(key)``: evicted to make room (ARC remembers it as a ghost).
- ``remove(key)``: left for another reason; no history is kept. Unknown keys are ignored.
- ``len(policy)`` / ``key in policy``: live keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from offloadd.transfer.plan import GroupLayout
from protocol.handles import KVRegion

K = TypeVar("K", bound=Hashable)


# -- eviction policies over keys ------------------------------------------------------------


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


# -- chunk plans ----------------------------------------------------------------------------


class Move(NamedTuple):
    """Copy ``nbytes`` between a region's ``region_offset`` and a shard's ``shard_offset``."""

    region: int
    region_offset: int
    shard_offset: int
    nbytes: int


def plan_chunk(
    layout: GroupLayout,
    regions: Sequence[KVRegion],
    block_ids: Sequence[int],
    *,
    blocks_per_chunk: int,
    first_sub_block: int = 0,
) -> list[Move]:
    """Moves for one chunk: ``block_ids[i]`` holds sub-block ``first_sub_block + i``.

    ``first_sub_block`` > 0 is a load that starts mid-chunk. Block ids must already be
    validated against the regions (``offloadd.transfer.plan.block_id_problem``).
    """
    if first_sub_block + len(block_ids) > blocks_per_chunk:
        raise ValueError("more blocks than fit in one chunk")
    moves: list[Move] = []
    part_offset = 0
    for region_index, page in zip(layout.regions, layout.pages, strict=True):
        stride = regions[region_index].block_stride
        for i, block_id in enumerate(block_ids):
            _append(
                moves,
                Move(
                    region_index,
                    block_id * stride,
                    part_offset + (first_sub_block + i) * page,
                    page,
                ),
            )
        part_offset += page * blocks_per_chunk
    return moves


def _append(moves: list[Move], move: Move) -> None:
    if moves:
        last = moves[-1]
        if (
            last.region == move.region
            and last.region_offset + last.nbytes == move.region_offset
            and last.shard_offset + last.nbytes == move.shard_offset
        ):
            moves[-1] = last._replace(nbytes=last.nbytes + move.nbytes)
            return
    moves.append(move)


def reference_pairs(
    regions: list[KVRegion],
    layout: GroupLayout,
    ids: list[int],
    bpc: int,
    first: int,
    load: bool,
    bases: list[int],
    shard: int,
) -> set[tuple[int, int]]:
    """Every (src byte, dst byte) pair the reference plan copies."""
    pairs = set()
    for move in plan_chunk(layout, regions, ids, blocks_per_chunk=bpc, first_sub_block=first):
        for i in range(move.nbytes):
            region_byte = bases[move.region] + move.region_offset + i
            shard_byte = shard + move.shard_offset + i
            pairs.add((shard_byte, region_byte) if load else (region_byte, shard_byte))
    return pairs

"""Who writes which bytes of a canonical chunk: vLLM's canonical layout across an engine's ranks.

In vLLM's canonical layout each rank's regions carry copy runs into the canonical page
(``KVRegion.canonical``). Ranks whose runs land on the same canonical bytes hold the same
bytes (KV heads replicated over TP ranks, or MLA's latent: vLLM's ``num_writers > 1``); ranks
whose runs land elsewhere hold other heads. Contract:

- ``canonical_plan(regions_by_rank)`` checks, region by region, that any two ranks' canonical
  bytes are either the same bytes (replicas) or disjoint, that the distinct fragment sets tile
  the canonical page exactly once (no gap, no byte written from two places), that each set is
  held by as many ranks as vLLM's ``writers`` says, and that the ranks fall into the same
  replica groups, in the same canonical order, in every region. Otherwise it raises
  ``CanonicalMismatch`` saying where. It is pure: the registry calls it when the last rank of
  an engine says Hello, before the engine is ready.
- The plan numbers the distinct fragment sets ``0 .. writers - 1`` in canonical order (the
  same bytes get the same index at any TP size: a TP=4 engine's writer 1 fills what a TP=2
  engine's rank 1 fills, so the cache's rule that a pending chunk is joined only by writers of
  its own count stays sound), and gives each rank its place among its replicas.
- ``elected(key, role)``: whether this rank writes ``key``'s chunk. Exactly one replica of
  each fragment set does, rotating by key as vLLM rotates by canonical page
  (``CanonicalPageMapping.is_writer``) so stores spread over the replicas; the others'
  stores of that key copy nothing. Every replica reads its fragments on load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from protocol.handles import CanonicalPage, KVRegion

__all__ = ["CanonicalMismatch", "CanonicalPlan", "Role", "canonical_plan", "elected"]

Intervals = tuple[tuple[int, int], ...]


class CanonicalMismatch(ValueError):
    """The ranks' canonical runs do not split each canonical page into replicas."""


@dataclass(frozen=True)
class Role:
    """A rank's part in filling a canonical chunk."""

    writer: int  # which fragment set (the cache's writer index)
    replica: int  # its place among the ranks holding that set
    replicas: int  # how many ranks hold it


@dataclass(frozen=True)
class CanonicalPlan:
    """``writers`` fragment sets fill each canonical chunk; ``roles`` by rank."""

    writers: int
    roles: Mapping[int, Role]


def elected(key: bytes, role: Role) -> bool:
    """Whether the rank of ``role`` writes ``key``'s chunk (one replica per key)."""
    if role.replicas == 1:
        return True
    return int.from_bytes(key[:8], "big") % role.replicas == role.replica


def canonical_plan(regions_by_rank: Mapping[int, Sequence[KVRegion]]) -> CanonicalPlan:
    """The engine's writers and each rank's role; raises CanonicalMismatch (see the module)."""
    ranks = sorted(regions_by_rank)
    counts = {len(regions_by_rank[rank]) for rank in ranks}
    if len(counts) > 1:
        raise CanonicalMismatch(f"the ranks register different numbers of regions: {counts}")
    order: tuple[tuple[int, ...], ...] | None = None
    for index in range(counts.pop() if counts else 0):
        groups = _replica_groups(index, {rank: regions_by_rank[rank][index] for rank in ranks})
        if order is None:
            order = groups
        elif groups != order:
            raise CanonicalMismatch(
                f"region {index}: ranks hold the same bytes as {list(groups)}, but "
                f"{list(order)} in region 0"
            )
    if order is None:  # no regions: each rank its own writer, as before canonical runs
        order = tuple((rank,) for rank in ranks)
    roles = {
        rank: Role(writer, replica, len(group))
        for writer, group in enumerate(order)
        for replica, rank in enumerate(group)
    }
    return CanonicalPlan(len(order), roles)


def _replica_groups(index: int, regions: Mapping[int, KVRegion]) -> tuple[tuple[int, ...], ...]:
    """The ranks of each distinct fragment set of region ``index``, in canonical order."""
    by_set: dict[Intervals, list[int]] = {}
    page_size = 0
    for rank, region in regions.items():
        canonical = region.canonical
        if canonical is None:
            raise CanonicalMismatch(f"region {index} of rank {rank} has no canonical page")
        if page_size and canonical.page_size != page_size:
            raise CanonicalMismatch(f"region {index}: canonical pages of different sizes")
        page_size = canonical.page_size
        by_set.setdefault(_canonical_bytes(index, rank, canonical), []).append(rank)
    sets = sorted(by_set, key=lambda intervals: intervals[0] if intervals else (0, 0))
    for intervals in sets:
        holders = by_set[intervals]
        claimed = {regions[rank].canonical.writers for rank in holders}  # type: ignore[union-attr]
        if claimed != {len(holders)}:
            raise CanonicalMismatch(
                f"region {index}: ranks {holders} hold the same canonical bytes, but vLLM "
                f"says {sorted(claimed)} ranks do"
            )
    end, owner = 0, -1
    pieces = sorted((start, stop, by_set[s][0]) for s in sets for start, stop in s)
    for start, stop, rank in pieces:
        if start < end:
            raise CanonicalMismatch(
                f"region {index}: ranks {owner} and {rank} write overlapping canonical bytes "
                f"(at byte {start}) that are not the same bytes: each canonical byte must "
                "have one writer"
            )
        if start > end:
            raise CanonicalMismatch(
                f"region {index}: no rank holds canonical bytes [{end}, {start}) of the "
                f"page of {page_size}"
            )
        end, owner = stop, rank
    if end != page_size:
        raise CanonicalMismatch(
            f"region {index}: no rank holds canonical bytes [{end}, {page_size})"
        )
    return tuple(tuple(by_set[intervals]) for intervals in sets)


def _canonical_bytes(index: int, rank: int, canonical: CanonicalPage) -> Intervals:
    """The canonical bytes one rank's runs cover, merged; its own overlaps raise."""
    pieces = sorted(
        (co + i * cstride, co + i * cstride + size)
        for _lo, co, size, count, _ls, cstride in canonical.runs
        for i in range(count)
    )
    merged: list[tuple[int, int]] = []
    for start, stop in pieces:
        if merged and start < merged[-1][1]:
            raise CanonicalMismatch(
                f"region {index} of rank {rank}: its runs write canonical byte {start} twice"
            )
        if merged and start == merged[-1][1]:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return tuple(merged)

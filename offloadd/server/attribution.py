"""Which KV events a cache change produces, in vLLM's offloading-connector form.

vLLM's CPU offloading announces one placeholder ``BlockStored`` per stored chunk key (the
chunk's last block hash, no tokens, ``block_size=0``, medium ``"CPU"``, the key's group) and
``BlockRemoved`` grouped by group (its ``OffloadingEventsTracker`` in the default mode).
Chunks on a tier below the arena are announced the same way, as vLLM 0.33's tiered
offloading announces its own: medium ``"STORAGE"``, locality ``"LOCAL"`` (the daemon's disk)
or ``"REMOTE"`` (the cluster).
Routers treat these as location updates for hashes they learned from GPU events. Hashes go
out as vLLM sends them by default, the low 64 bits as an unsigned int, or as raw bytes when
the engine asks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from offloadd.server.registry import group_of_key
from protocol.events import MEDIUM_CPU, BlockRemoved, BlockStored, KVEvent, hash_for_wire

MAX_EVENTS_PER_BATCH = 1000


def stored_events(
    keys: Iterable[bytes],
    *,
    raw_hashes: bool,
    medium: str = MEDIUM_CPU,
    locality: str | None = None,
) -> list[KVEvent]:
    """One ``BlockStored`` per committed chunk key (``medium``, ``locality``: where it now
    is; no locality for the arena, as vLLM's CPU offloading sends none)."""
    events: list[KVEvent] = [
        BlockStored(
            block_hashes=[hash_for_wire(key[:-4], as_int=not raw_hashes)],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=group_of_key(key),
            locality=locality,
        )
        for key in keys
    ]
    return events


def removed_events(
    keys: Iterable[bytes],
    *,
    raw_hashes: bool,
    medium: str = MEDIUM_CPU,
    locality: str | None = None,
) -> list[KVEvent]:
    """``BlockRemoved`` events, one per group, listing the removed chunk hashes in order."""
    by_group: dict[int, list[int | bytes]] = {}
    for key in keys:
        by_group.setdefault(group_of_key(key), []).append(
            hash_for_wire(key[:-4], as_int=not raw_hashes)
        )
    events: list[KVEvent] = [
        BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group, locality=locality)
        for group, hashes in by_group.items()
    ]
    return events


def in_batches(
    events: Sequence[KVEvent], size: int = MAX_EVENTS_PER_BATCH
) -> Iterator[list[KVEvent]]:
    """``events`` cut into lists of at most ``size`` (a snapshot can hold millions)."""
    for start in range(0, len(events), size):
        yield list(events[start : start + size])

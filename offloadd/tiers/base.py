"""The interface of a tier below the arena (``docs/design.md``, tiers).

A tier keeps whole chunks: every shard of one cache entry, in shard order, as one object
named by ``(namespace, key)``. Its methods block (file or network I/O) and are called from
that tier's own worker thread only, never from the event loop, one call at a time, so a
tier needs no locking of its own except around what ``stats`` reads.

Contract of ``Tier``:
- ``put``: read each chunk's shards from the arena and keep them as one object. True where
  the chunk is now in the tier (or already was). An object becomes visible to ``contains``
  and ``get`` only once every byte of it is written (two-phase, as in the arena). To make
  room the tier evicts its own least recently used chunks; the evicted names come back in
  ``TierWrite.evicted`` so the daemon announces them.
- ``get``: fill each chunk's arena extents from the tier. True only where the object was
  there, had exactly the chunk's shard sizes, and every byte passed its checksum; a missing,
  torn or corrupted object is False (and dropped, so it is never tried again). A False
  chunk's extents may hold garbage: the caller never commits them.
- ``contains``: which keys the tier holds now (an answer that may be stale by the time of a
  ``get``; ``get`` is the check that counts).
- ``remove`` / ``clear``: forget chunks (a namespace cleared by its engine).
- ``stats``: a snapshot, safe to call from any thread.
- Errors: a fault of the medium (a full disk, an unreachable master) is counted in
  ``stats().errors`` and reported as False / not contained; it never raises into the
  caller, so the daemon keeps serving host-memory hits.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from offloadd.cache.arena import Arena

__all__ = ["ChunkAddress", "Tier", "TierCounters", "TierStats", "TierWrite"]


@dataclass(frozen=True, slots=True)
class ChunkAddress:
    """One chunk as the arena holds it: ``(offset, size)`` of each shard, in shard order."""

    namespace: str
    key: bytes
    extents: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.extents)


@dataclass(slots=True)
class TierWrite:
    """What one ``put`` did: stored per chunk, and the chunks it evicted to make room."""

    stored: list[bool]
    evicted: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TierStats:
    """A tier's figures for ``status`` and metrics (counters since the daemon started)."""

    name: str
    capacity: int
    used_bytes: int
    chunks: int
    healthy: bool = True  # False while the medium is unreachable (master down, disk gone)
    errors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0  # time spent in writes, for GB/s
    read_seconds: float = 0.0


@dataclass(slots=True)
class TierCounters:
    """What a tier counts as it works; kept and read under the tier's own lock."""

    healthy: bool = True
    errors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0

    def stats(self, name: str, capacity: int, used_bytes: int, chunks: int) -> TierStats:
        return TierStats(
            name=name,
            capacity=capacity,
            used_bytes=used_bytes,
            chunks=chunks,
            healthy=self.healthy,
            errors=self.errors,
            bytes_written=self.bytes_written,
            bytes_read=self.bytes_read,
            write_seconds=self.write_seconds,
            read_seconds=self.read_seconds,
        )


class Tier(abc.ABC):
    """A store of whole chunks below the arena; see the module docstring."""

    name: str  # "disk", "mooncake": in status, metrics and logs

    @abc.abstractmethod
    def put(self, chunks: Sequence[ChunkAddress], arena: Arena) -> TierWrite: ...

    @abc.abstractmethod
    def get(self, chunks: Sequence[ChunkAddress], arena: Arena) -> list[bool]: ...

    @abc.abstractmethod
    def contains(self, namespace: str, keys: Sequence[bytes]) -> list[bool]: ...

    @abc.abstractmethod
    def remove(self, namespace: str, keys: Sequence[bytes]) -> None: ...

    @abc.abstractmethod
    def clear(self, namespace: str) -> None: ...

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    @abc.abstractmethod
    def close(self) -> None: ...

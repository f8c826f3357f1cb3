"""Host chunk cache: extent allocator, eviction policies and the index (pure, no I/O)."""

from offloadd.cache.allocator import ExtentAllocator
from offloadd.cache.index import (
    CacheStats,
    ChunkCache,
    Entry,
    LoadReservation,
    LookupOutcome,
    Reads,
    ShardWrite,
    StoreReservation,
)

__all__ = [
    "CacheStats",
    "ChunkCache",
    "Entry",
    "ExtentAllocator",
    "LoadReservation",
    "LookupOutcome",
    "Reads",
    "ShardWrite",
    "StoreReservation",
]

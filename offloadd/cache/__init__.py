"""Host chunk cache: extent allocator, eviction policies and the index (pure, no I/O)."""

from offloadd.cache.allocator import ExtentAllocator
from offloadd.cache.index import (
    CacheStats,
    ChunkCache,
    Entry,
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
    "LookupOutcome",
    "Reads",
    "ShardWrite",
    "StoreReservation",
]

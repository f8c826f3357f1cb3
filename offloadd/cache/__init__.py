"""Host chunk cache: extent allocator, eviction policies and the index (pure, no I/O)."""

from offloadd.cache.allocator import ExtentAllocator
from offloadd.cache.index import (
    CacheStats,
    ChunkCache,
    Entry,
    LoadReservation,
    LookupOutcome,
    ShardWrite,
    StoreReservation,
)
from offloadd.cache.policy import ArcPolicy, EvictionPolicy, LruPolicy, make_policy

__all__ = [
    "ArcPolicy",
    "CacheStats",
    "ChunkCache",
    "Entry",
    "EvictionPolicy",
    "ExtentAllocator",
    "LoadReservation",
    "LookupOutcome",
    "LruPolicy",
    "ShardWrite",
    "StoreReservation",
    "make_policy",
]

"""ChunkCache: two-phase stores, loads, pins, eviction, abandonment, and a model-based check."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from offloadd.cache.index import ChunkCache, Entry, Reads, RestoredChunk, ShardWrite
from offloadd.cache.placement import _overlaps
from tests.fakes import Clock
from tests.strategies import property_settings

A = 4096
NS = "ns"


def one_shard(key: bytes) -> tuple[int, ...]:
    return (A,)


def two_shards(key: bytes) -> tuple[int, ...]:
    return (A, A)


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def store(
    cache: ChunkCache,
    keys: Sequence[bytes],
    sizes: Callable[[bytes], tuple[int, ...]] = one_shard,
    ns: str = NS,
) -> list[Entry]:
    """Store every shard of ``keys`` and commit; returns the entries evicted on the way."""
    evicted: list[Entry] = []
    for shard in range(len(sizes(b""))):
        res = cache.begin_store(ns, keys, shard, sizes)
        assert not res.refused
        evicted += res.evicted
        cache.finish_store(res.writes, ok=True)
    return evicted


def evicted_keys(entries: Sequence[Entry]) -> list[bytes]:
    return [e.key for e in entries]


# -- two-phase store ---------------------------------------------------------------------------


def test_two_phase_store_becomes_visible_after_the_last_shard() -> None:
    cache = ChunkCache(16 * A)
    keys = [k(0), k(1)]
    r0 = cache.begin_store(NS, keys, 0, two_shards)
    assert [w.index for w in r0.writes] == [0, 1]
    assert r0.skipped == r0.refused == [] and r0.evicted == []
    assert cache.finish_store(r0.writes, ok=True) == []

    out = cache.lookup(NS, keys)
    assert (out.hits, out.pending) == (0, [0, 1])
    assert cache.begin_reads(NS, keys).missing == keys
    assert cache.keys_in(NS) == []

    r1 = cache.begin_store(NS, keys, 1, two_shards)
    assert [w.entry for w in r1.writes] == [w.entry for w in r0.writes]  # joined, not new
    for w0, w1 in zip(r0.writes, r1.writes, strict=True):
        assert w0.offset != w1.offset and w0.offset % A == 0 and w1.size == A
    committed = cache.finish_store(r1.writes, ok=True)
    assert [e.key for e in committed] == keys
    assert all(e.committed and e.nbytes == 2 * A for e in committed)

    out = cache.lookup(NS, keys)
    assert (out.hits, out.pending, out.pinned) == (2, [], 0)
    assert cache.keys_in(NS) == keys
    s = cache.stats()
    assert (s.entries, s.committed, s.pending) == (2, 2, 0)
    assert s.used_bytes == s.committed_bytes == 4 * A
    assert (s.lookups, s.hit_keys, s.miss_keys) == (2, 2, 2)


def test_lookup_counts_leading_hits_and_reports_every_pending_key() -> None:
    cache = ChunkCache(16 * A)
    store(cache, [k(0), k(2)])
    cache.begin_store(NS, [k(4)], 0, two_shards)  # pending
    out = cache.lookup(NS, [k(0), k(1), k(2), k(4), k(5)])
    assert out.hits == 1  # k(1) is missing; the committed k(2) after it is not a hit
    assert out.pending == [3]
    assert cache.lookup("other", [k(0)]).hits == 0


def test_a_pending_key_ends_the_prefix_hit() -> None:
    cache = ChunkCache(16 * A)
    store(cache, [k(0), k(2)])
    cache.begin_store(NS, [k(1)], 0, two_shards)  # pending between two committed keys
    out = cache.lookup(NS, [k(0), k(1), k(2)])
    assert (out.hits, out.pending) == (1, [1])
    s = cache.stats()
    assert (s.hit_keys, s.miss_keys) == (1, 2)


def test_a_lookup_touches_only_its_hits() -> None:
    cache = ChunkCache(5 * A)
    store(cache, [k(0), k(1), k(2)])
    cache.begin_store(NS, [k(3)], 0, two_shards)  # pending, its copy in flight
    # k(0) is a hit; k(1) and k(2) come after a miss: not touched, so still the oldest.
    assert cache.lookup(NS, [k(0), k(9), k(1), k(2)]).hits == 1
    assert evicted_keys(store(cache, [k(4)])) == [k(1)]
    assert evicted_keys(store(cache, [k(5)])) == [k(2)]
    assert evicted_keys(store(cache, [k(6)])) == [k(0)]


def test_restore_of_committed_or_in_flight_shards_is_skipped() -> None:
    cache = ChunkCache(16 * A)
    store(cache, [k(0)], two_shards)
    r = cache.begin_store(NS, [k(0), k(1)], 0, two_shards)
    assert r.skipped == [0] and [w.index for w in r.writes] == [1]
    again = cache.begin_store(NS, [k(1)], 0, two_shards)  # shard 0 in flight
    assert again.skipped == [0] and again.writes == []
    cache.finish_store(r.writes, ok=True)
    again = cache.begin_store(NS, [k(1)], 0, two_shards)  # shard 0 written
    assert again.skipped == [0] and again.writes == []
    assert cache.stats().used_bytes == 4 * A


def test_failed_store_leaves_nothing_visible_and_can_be_retried() -> None:
    cache = ChunkCache(16 * A)
    r = cache.begin_store(NS, [k(0)], 0, one_shard)
    assert cache.finish_store(r.writes, ok=False) == []
    assert cache.lookup(NS, [k(0)]).hits == 0
    retry = cache.begin_store(NS, [k(0)], 0, one_shard)
    assert retry.writes[0].entry is r.writes[0].entry
    assert retry.writes[0].offset == r.writes[0].offset
    assert [e.key for e in cache.finish_store(retry.writes, ok=True)] == [k(0)]
    assert cache.lookup(NS, [k(0)]).hits == 1


def test_misuse_raises_and_changes_nothing() -> None:
    cache = ChunkCache(16 * A)
    r = cache.begin_store(NS, [k(0)], 0, two_shards)
    with pytest.raises(ValueError, match=r"shard 0 of Entry\('ns', 00000000, pending.* is not"):
        cache.finish_store([*r.writes, *r.writes], ok=True)
    assert r.writes[0].entry.writing == 1
    cache.finish_store(r.writes, ok=True)
    with pytest.raises(ValueError, match=r"shard 0 of .* is not being written"):
        cache.finish_store(r.writes, ok=True)
    # shard 2 is outside the 2-shard layout of the pending k(0); the write on k(1) is undone.
    with pytest.raises(ValueError, match="shard 2 out of range for 2 shards of 00000000 in names"):
        cache.begin_store(NS, [k(1), k(0)], 2, lambda _: (A, A, A))
    new = cache.get(NS, k(1))
    assert new is not None and new.writing == 0
    with pytest.raises(ValueError, match=r"bad shard sizes \(4096,\) for shard 1 of 00000002"):
        cache.begin_store(NS, [k(2)], 1, one_shard)
    with pytest.raises(ValueError, match="bad shard sizes"):
        cache.begin_store(NS, [k(2)], 0, lambda _: (A, 0))
    with pytest.raises(ValueError, match="bad shard sizes"):
        cache.begin_store(NS, [k(2)], 0, lambda _: ())
    with pytest.raises(ValueError, match="shard must not be negative, got -1"):
        cache.begin_store(NS, [k(2)], -1, one_shard)
    assert cache.get(NS, k(2)) is None
    store(cache, [k(3)])
    entry = cache.get(NS, k(3))
    assert entry is not None
    ended = cache.begin_reads(NS, [k(3)])
    cache.finish_reads([ended])
    with pytest.raises(ValueError, match=r"Entry\('ns', 00000003, committed.* is not being read"):
        cache.finish_reads([ended])  # a read ended twice
    assert entry.readers == 0
    load = cache.begin_reads(NS, [k(3)])
    with pytest.raises(ValueError, match="is not being read"):
        cache.finish_reads([load, load])  # one read begun, two ended
    assert entry.readers == 1
    cache.finish_reads([load])
    assert entry.readers == 0


def test_alignment_and_sizes_per_key() -> None:
    def by_key(key: bytes) -> tuple[int, ...]:
        return (100 * (key[-1] + 1), 1)

    cache = ChunkCache(4096, align=512)
    res = cache.begin_store(NS, [k(0), k(5)], 0, by_key)
    assert [(w.size, w.entry.sizes) for w in res.writes] == [(100, (100, 1)), (600, (600, 1))]
    assert all(off % 512 == 0 for w in res.writes for off in w.entry.offsets)
    assert cache.stats().used_bytes == 512 + 512 + 1024 + 512
    assert cache.get("unknown", k(0)) is None and cache.get(NS, k(9)) is None


def test_a_short_lease_pins_and_release_counts_the_pins_dropped() -> None:
    clock = Clock()
    cache = ChunkCache(2 * A, clock=clock)
    store(cache, [k(0), k(1)])
    assert cache.lookup(NS, [k(0), k(1)], pin_owner="s", lease=0.5).pinned == 2
    assert cache.begin_store(NS, [k(2)], 0, one_shard).refused == [0]
    assert cache.release(NS, [k(0), k(1)], "s") == 2
    assert cache.release(NS, [k(0)], "s") == 0


# -- loads -------------------------------------------------------------------------------------


def test_load_takes_all_keys_or_none() -> None:
    cache = ChunkCache(16 * A)
    store(cache, [k(0), k(1)])
    res = cache.begin_reads(NS, [k(0), k(2), k(1), k(3)])
    assert res.entries == [] and res.missing == [k(2), k(3)]
    assert all(e.readers == 0 for e in (cache.get(NS, k(0)), cache.get(NS, k(1))) if e)
    res = cache.begin_reads(NS, [k(0), k(1)])
    assert res.missing == [] and [e.readers for e in res.entries] == [1, 1]
    cache.finish_reads([res])
    assert [e.readers for e in res.entries] == [0, 0]


# -- capacity and eviction ---------------------------------------------------------------------


def test_three_times_capacity_evicts_least_recent_first_and_never_overflows() -> None:
    n = 8
    cache = ChunkCache(n * A)
    for i in range(3 * n):
        evicted = store(cache, [k(i)])
        assert cache.stats().used_bytes <= n * A
        assert evicted_keys(evicted) == ([k(i - n)] if i >= n else [])
        assert all(e.dead and e.committed and e.offsets == [] for e in evicted)
    assert cache.keys_in(NS) == [k(i) for i in range(2 * n, 3 * n)]
    s = cache.stats()
    assert (s.evictions, s.committed, s.used_bytes) == (2 * n, n, n * A)


def test_lookup_touch_protects_the_prefix_head() -> None:
    cache = ChunkCache(4 * A)
    store(cache, [k(0), k(1), k(2), k(3)])
    assert cache.lookup(NS, [k(0), k(1)]).hits == 2
    # LRU order now: k2, k3, k1, k0 (touched in reverse, so the head is most recent).
    assert evicted_keys(store(cache, [k(4)])) == [k(2)]
    assert evicted_keys(store(cache, [k(5)])) == [k(3)]
    assert evicted_keys(store(cache, [k(6)])) == [k(1)]


def test_pinned_and_loading_entries_are_never_evicted() -> None:
    cache = ChunkCache(8 * A)
    store(cache, [k(i) for i in range(8)])
    assert cache.lookup(NS, [k(0), k(1)], pin_owner="sched", lease=60.0).pinned == 2
    load = cache.begin_reads(NS, [k(2), k(3)])
    for i in range(100, 140):
        evicted = store(cache, [k(i)])
        assert not {k(0), k(1), k(2), k(3)} & set(evicted_keys(evicted))
        assert cache.stats().used_bytes <= 8 * A
    assert cache.lookup(NS, [k(0), k(1), k(2), k(3)]).hits == 4
    cache.finish_reads([load])
    # Six new keys: everything but the two pinned ones goes, k(2) and k(3) included.
    gone = evicted_keys(store(cache, [k(i) for i in range(200, 206)]))
    assert len(gone) == 6 and {k(2), k(3)} <= set(gone)
    assert cache.lookup(NS, [k(0), k(1)]).hits == 2


def test_store_is_refused_when_nothing_is_evictable() -> None:
    clock = Clock()
    cache = ChunkCache(4 * A, clock=clock)
    store(cache, [k(0), k(1), k(2), k(3)])
    cache.lookup(NS, [k(0), k(1)], pin_owner="a", lease=10.0)
    load = cache.begin_reads(NS, [k(2), k(3)])
    res = cache.begin_store(NS, [k(7), k(8), k(9)], 0, one_shard)
    assert res.writes == [] and res.evicted == [] and res.refused == [0, 1, 2]
    s = cache.stats()
    assert (s.stores_refused, s.evictions, s.used_bytes) == (3, 0, 4 * A)
    assert cache.get(NS, k(7)) is None
    cache.finish_reads([load])
    res = cache.begin_store(NS, [k(7)], 0, one_shard)
    assert evicted_keys(res.evicted) == [k(3)]  # the load touched k(3), then k(2)


def test_a_store_that_cannot_fit_evicts_nothing() -> None:
    cache = ChunkCache(4 * A)
    store(cache, [k(0), k(1), k(2)])
    cache.lookup(NS, [k(0), k(1)], pin_owner="s", lease=60.0)
    # One free page plus the evictable k(2) make two pages: a three-page key cannot fit.
    res = cache.begin_store(NS, [k(9)], 0, lambda _: (3 * A,))
    assert res.refused == [0] and res.evicted == []
    assert cache.lookup(NS, [k(2)]).hits == 1
    assert cache.stats().evictions == 0


def test_refusal_covers_the_rest_of_the_request() -> None:
    cache = ChunkCache(4 * A)
    store(cache, [k(0)])
    # Three new keys fit (k(0) is skipped and protected); k(4) finds only protected entries.
    res = cache.begin_store(NS, [k(1), k(0), k(2), k(3), k(4), k(0)], 0, one_shard)
    assert [w.index for w in res.writes] == [0, 2, 3]
    assert res.skipped == [1]
    assert res.refused == [4, 5]
    assert res.evicted == []
    assert cache.stats().stores_refused == 2


def test_keys_of_the_same_request_are_never_evicted() -> None:
    cache = ChunkCache(4 * A)
    store(cache, [k(0), k(1), k(2)])
    # k(0) and k(1) are the least recent but belong to the request: k(2) goes instead.
    res = cache.begin_store(NS, [k(0), k(1), k(3), k(4)], 0, one_shard)
    assert res.skipped == [0, 1]
    assert [w.index for w in res.writes] == [2, 3]
    assert evicted_keys(res.evicted) == [k(2)]
    # A pending entry of the request with no copy in flight is protected as well.
    cache2 = ChunkCache(2 * A)
    first = cache2.begin_store(NS, [k(0)], 0, two_shards)
    cache2.finish_store(first.writes, ok=True)
    res = cache2.begin_store(NS, [k(0), k(1)], 1, two_shards)
    assert [w.index for w in res.writes] == [0]
    assert res.refused == [1] and res.evicted == []


def test_pin_lease_expires_with_the_clock() -> None:
    clock = Clock()
    cache = ChunkCache(A, clock=clock)
    store(cache, [k(0)])
    cache.lookup(NS, [k(0)], pin_owner="s", lease=5.0)  # until 105
    clock.now = 104.0
    assert cache.begin_store(NS, [k(1)], 0, one_shard).refused == [0]
    cache.lookup(NS, [k(0)], pin_owner="s", lease=5.0)  # extended until 109
    clock.now = 108.0
    assert cache.begin_store(NS, [k(1)], 0, one_shard).refused == [0]
    cache.lookup(NS, [k(0)], pin_owner="s", lease=0.5)  # a shorter lease never shortens
    clock.now = 108.75
    assert cache.begin_store(NS, [k(1)], 0, one_shard).refused == [0]
    clock.now = 109.0  # a lease ends at its expiry
    res = cache.begin_store(NS, [k(1)], 0, one_shard)
    assert evicted_keys(res.evicted) == [k(0)]
    assert cache.release_owner("s") == 0  # the expired pin went with the entry


def test_refused_keys_are_counted_across_stores() -> None:
    cache = ChunkCache(A)
    store(cache, [k(0)])
    cache.lookup(NS, [k(0)], pin_owner="s", lease=60.0)
    assert cache.begin_store(NS, [k(1), k(2)], 0, one_shard).refused == [0, 1]
    assert cache.begin_store(NS, [k(3)], 0, one_shard).refused == [0]
    assert cache.stats().stores_refused == 3


def test_release_skips_keys_without_pins() -> None:
    cache = ChunkCache(2 * A)
    store(cache, [k(0), k(1)])
    cache.lookup(NS, [k(1)], pin_owner="s", lease=60.0)
    assert cache.release(NS, [k(0), k(9), k(1)], "s") == 1


def test_handles_stay_one_per_entry_across_many() -> None:
    # More handles than the cache keeps references for before sweeping the dead ones.
    cache = ChunkCache(6000 * A)
    keys = [k(i) for i in range(6000)]
    for start in range(0, 6000, 100):
        store(cache, keys[start : start + 100])  # their handles die batch by batch
    kept = [cache.get(NS, key) for key in keys[:10]]
    assert [cache.get(NS, key) for key in keys[:10]] == kept
    assert len(cache._handles) <= 4096  # the references of dead handles were swept


def test_lookup_without_lease_does_not_pin() -> None:
    cache = ChunkCache(A)
    store(cache, [k(0)])
    assert cache.lookup(NS, [k(0)], pin_owner="s").pinned == 0
    assert evicted_keys(store(cache, [k(1)])) == [k(0)]


def test_release_and_release_owner() -> None:
    cache = ChunkCache(4 * A)
    store(cache, [k(0), k(1), k(2), k(3)])
    cache.lookup(NS, [k(0), k(1), k(2)], pin_owner="a", lease=60.0)
    cache.lookup(NS, [k(0), k(1)], pin_owner="b", lease=60.0)
    assert cache.release(NS, [k(0), k(3)], "a") == 1
    assert cache.release(NS, [k(0)], "a") == 0
    assert cache.release("other", [k(0)], "b") == 0
    # k(0) is still pinned by b; k(3) is not pinned at all.
    assert evicted_keys(store(cache, [k(4)])) == [k(3)]
    assert cache.release_owner("a") == 2
    assert cache.release_owner("a") == 0
    assert evicted_keys(store(cache, [k(5)])) == [k(2)]
    assert cache.release_owner("b") == 2
    e0 = cache.get(NS, k(0))
    assert e0 is not None and e0.pins is None
    assert set(evicted_keys(store(cache, [k(6), k(7)]))) == {k(0), k(1)}


# -- abandonment -------------------------------------------------------------------------------


def test_abandoned_entry_never_becomes_visible_and_its_slots_come_back() -> None:
    cache = ChunkCache(8 * A)
    w0 = cache.begin_store(NS, [k(0)], 0, two_shards).writes
    w1 = cache.begin_store(NS, [k(0)], 1, two_shards).writes
    entry = w0[0].entry
    cache.abandon(w0)  # the session writing shard 0 went away
    assert entry.dead and cache.get(NS, k(0)) is None
    assert cache.lookup(NS, [k(0)]).pending == []
    assert cache.finish_store(w1, ok=True) == []  # the other rank's copy completes: still dead
    assert not entry.committed
    assert cache.stats().used_bytes == 2 * A  # shard 0's copy is still in flight
    assert cache.finish_store(w0, ok=True) == []
    assert entry.offsets == []
    s = cache.stats()
    assert (s.used_bytes, s.entries, s.committed, s.pending) == (0, 0, 0, 0)
    # The key can be stored afresh.
    store(cache, [k(0)], two_shards)
    assert cache.lookup(NS, [k(0)]).hits == 1


def test_abandon_leaves_committed_entries_and_finished_writes_alone() -> None:
    cache = ChunkCache(8 * A)
    store(cache, [k(0)])
    done = cache.begin_store(NS, [k(1)], 0, two_shards).writes
    cache.finish_store(done, ok=True)
    r = cache.begin_store(NS, [k(0), k(1)], 1, two_shards)
    cache.abandon(done)  # already finished: nothing to abandon
    cache.abandon(r.writes)  # k(0) is committed and untouched; k(1) is pending and dropped
    assert cache.lookup(NS, [k(0)]).hits == 1
    assert cache.get(NS, k(1)) is None
    cache.finish_store(r.writes, ok=True)
    assert cache.stats().used_bytes == A


def test_abandon_of_a_batch_with_finished_and_unfinished_writes() -> None:
    cache = ChunkCache(8 * A)
    writes = cache.begin_store(NS, [k(0), k(1), k(2)], 0, two_shards).writes
    cache.finish_store(writes[:1], ok=True)  # k(0)'s shard 0 is written, the others are not
    other = cache.begin_store(NS, [k(0)], 1, two_shards).writes  # another rank's shard
    cache.abandon(writes)
    # Only entries with a copy of this batch still in flight go; k(0) waits for shard 1.
    kept = cache.get(NS, k(0))
    assert kept is writes[0].entry and not kept.dead
    assert cache.get(NS, k(1)) is None and cache.get(NS, k(2)) is None
    assert writes[1].entry.dead and writes[2].entry.dead
    assert cache.stats().used_bytes == 6 * A  # k(1), k(2) still being written
    assert cache.finish_store(writes[1:], ok=True) == []
    assert cache.stats().used_bytes == 2 * A
    assert cache.finish_store(other, ok=True) == [kept]
    assert cache.lookup(NS, [k(0), k(1)]).hits == 1


def test_pending_entry_whose_other_shard_never_arrives_is_evicted_under_pressure() -> None:
    cache = ChunkCache(4 * A)
    half = cache.begin_store(NS, [k(0)], 0, two_shards).writes
    cache.finish_store(half, ok=True)
    store(cache, [k(1)], two_shards)
    res = cache.begin_store(NS, [k(2)], 0, two_shards)
    assert evicted_keys(res.evicted) == [k(0)]
    assert not res.evicted[0].committed
    assert cache.stats().used_bytes == 4 * A


# -- sizes -------------------------------------------------------------------------------------


def test_mixed_shard_sizes_share_the_arena_and_one_namespace_can_fill_it() -> None:
    def big(key: bytes) -> tuple[int, ...]:
        return (3 * A,)

    cache = ChunkCache(12 * A)
    store(cache, [k(i) for i in range(6)], two_shards, ns="tp2")
    assert cache.stats().used_bytes == 12 * A
    evicted = store(cache, [k(i) for i in range(4)], big, ns="tp1")
    assert len(evicted) == 6 and cache.stats().used_bytes == 12 * A
    assert len(cache.keys_in("tp1")) == 4 and cache.keys_in("tp2") == []
    store(cache, [k(i) for i in range(6)], two_shards, ns="tp2")
    assert cache.keys_in("tp1") == [] and len(cache.keys_in("tp2")) == 6
    # The same key in two namespaces is two entries.
    assert cache.lookup("tp1", [k(0)]).hits == 0


def test_fragmented_arena_keeps_evicting_until_the_extent_fits() -> None:
    cache = ChunkCache(4 * A)
    store(cache, [k(0), k(1), k(2), k(3)])  # offsets 0, A, 2A, 3A
    cache.lookup(NS, [k(1)])
    cache.lookup(NS, [k(3)])  # LRU order: k0, k2, k1, k3
    res = cache.begin_store("big", [k(9)], 0, lambda _: (2 * A,))
    # k0 and k2 free 2A, but not contiguously; evicting k1 joins the first three pages.
    assert evicted_keys(res.evicted) == [k(0), k(2), k(1)]
    assert res.writes[0].offset == 0
    assert cache.stats().used_bytes == 3 * A


def test_a_multi_shard_key_that_fits_only_partly_holds_nothing() -> None:
    clock = Clock()
    cache = ChunkCache(6 * A, clock=clock)
    store(cache, [k(i) for i in range(6)])
    cache.remove(NS, [k(0), k(2), k(4)])  # three free pages, none next to another
    cache.lookup(NS, [k(1), k(3), k(5)], pin_owner="s", lease=10.0)
    # Its first shard fits a hole, its second (two pages) fits nowhere: nothing is kept.
    res = cache.begin_store(NS, [k(9)], 0, lambda _: (A, 2 * A))
    assert res.refused == [0] and res.writes == [] and res.evicted == []
    s = cache.stats()
    assert (s.used_bytes, s.entries) == (3 * A, 3)
    # Once one pin lapses, evicting a neighbour makes the two pages it needs.
    cache.release(NS, [k(3)], "s")
    res = cache.begin_store(NS, [k(9)], 0, lambda _: (A, 2 * A))
    assert res.refused == [] and evicted_keys(res.evicted) == [k(3)]
    assert cache.stats().used_bytes == 5 * A
    assert sorted(w.offset for w in res.writes) == [0]
    entry = res.writes[0].entry
    assert entry.offsets[1] in (2 * A, 3 * A)
    assert cache.get(NS, k(9)) is entry


def test_a_key_larger_than_the_arena_is_refused_without_evicting() -> None:
    cache = ChunkCache(4 * A)
    store(cache, [k(0)])
    res = cache.begin_store(NS, [k(1)], 0, lambda _: (5 * A,))
    assert res.refused == [0] and res.evicted == []


# -- ARC through the index ---------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "victim"), [("lru", 1), ("arc", 4)])
def test_arc_keeps_reused_keys_that_lru_evicts(policy: str, victim: int) -> None:
    cache = ChunkCache(4 * A, policy=policy)
    store(cache, [k(0), k(1), k(2), k(3)])
    cache.lookup(NS, [k(0), k(1)])  # reused: ARC promotes them to T2
    assert evicted_keys(store(cache, [k(4)])) == [k(2)]
    assert evicted_keys(store(cache, [k(2)])) == [k(3)]  # ARC: a B1 ghost, back into T2
    assert evicted_keys(store(cache, [k(5)])) == [k(victim)]


@pytest.mark.parametrize(
    ("policy", "victims", "left"),
    [("lru", [2, 3, 4, 0, 1], [5, 6, 7, 8]), ("arc", [2, 3, 4, 1, 5], [6, 7, 8, 0])],
)
def test_arc_remembers_evicted_keys_as_ghosts_but_not_removed_ones(
    policy: str, victims: list[int], left: list[int]
) -> None:
    cache = ChunkCache(4 * A, policy=policy)
    store(cache, [k(0), k(1), k(2), k(3)])
    assert evicted_keys(store(cache, [k(4)])) == [k(0)]  # ARC: k(0) becomes a B1 ghost
    assert [e.key for e in cache.remove(NS, [k(1)])] == [k(1)]  # removed: no ghost
    assert store(cache, [k(0)]) == []  # ARC: a ghost hit, straight into T2
    gone = evicted_keys(store(cache, [k(1)]))  # a plain new key in T1
    for i in range(5, 9):
        gone += evicted_keys(store(cache, [k(i)]))
    assert gone == [k(i) for i in victims]
    assert [c.key for c in cache.committed_chunks()] == [k(i) for i in left]


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy"):
        ChunkCache(A, policy="fifo")


# -- removal -----------------------------------------------------------------------------------


def test_remove_returns_committed_entries_and_defers_busy_slots() -> None:
    cache = ChunkCache(8 * A)
    store(cache, [k(0), k(1)])
    pending = cache.begin_store(NS, [k(2)], 0, two_shards).writes
    load = cache.begin_reads(NS, [k(1)])
    removed = cache.remove(NS, [k(0), k(1), k(2), k(7)])
    assert evicted_keys(removed) == [k(0), k(1)]
    assert cache.lookup(NS, [k(0), k(1), k(2)]).pending == []
    s = cache.stats()
    assert (s.entries, s.committed, s.committed_bytes) == (0, 0, 0)
    assert s.used_bytes == A + 2 * A  # k(1) is being read, k(2) written
    cache.finish_reads([load])
    assert cache.finish_store(pending, ok=True) == []
    assert cache.stats().used_bytes == 0
    assert cache.remove("nope", [k(0)]) == []


def test_clear_namespace() -> None:
    cache = ChunkCache(8 * A)
    store(cache, [k(0), k(1)], ns="a")
    store(cache, [k(0)], ns="b")
    inflight = cache.begin_store("a", [k(2)], 0, one_shard).writes
    cache.lookup("a", [k(0)], pin_owner="o", lease=10.0)
    removed = cache.clear_namespace("a")
    assert sorted(evicted_keys(removed)) == [k(0), k(1)]
    assert cache.keys_in("a") == [] and cache.keys_in("b") == [k(0)]
    assert cache.release_owner("o") == 0
    assert cache.finish_store(inflight, ok=True) == []
    assert cache.stats().used_bytes == A
    assert cache.clear_namespace("a") == []
    store(cache, [k(0)], ns="a")
    assert cache.lookup("a", [k(0)]).hits == 1


# -- restart: committed_chunks and restore ------------------------------------------------------


def chunk(key: bytes, *extents: tuple[int, int], ns: str = NS) -> RestoredChunk:
    return RestoredChunk(
        ns, key, tuple(off for off, _ in extents), tuple(size for _, size in extents)
    )


def test_overlaps_tells_a_new_extent_from_sorted_taken_ones() -> None:
    taken = [(0, A), (2 * A, 4 * A), (6 * A, 7 * A)]
    assert not _overlaps(taken, A, 2 * A)  # between two: touching both, overlapping none
    assert not _overlaps(taken, 4 * A, 6 * A)
    assert not _overlaps(taken, 7 * A, 9 * A)
    assert not _overlaps([], 0, A)
    assert _overlaps(taken, 0, A)  # the same extent
    assert _overlaps(taken, A - 1, A + 1)  # the end of the one before
    assert _overlaps(taken, 3 * A, 3 * A + 1)  # inside one
    assert _overlaps(taken, A, 2 * A + 1)  # the start of the one after
    assert _overlaps(taken, 5 * A, 8 * A)  # one inside it
    assert _overlaps(taken, 2 * A, 2 * A + 1)  # starts where one starts


def test_committed_chunks_lists_committed_entries_least_recent_first() -> None:
    cache = ChunkCache(16 * A)
    store(cache, [k(0), k(1)], two_shards)
    store(cache, [k(2)], ns="other")
    cache.begin_store(NS, [k(3)], 0, two_shards)  # pending: not listed
    cache.lookup(NS, [k(0)])
    chunks = cache.committed_chunks()
    assert [(c.namespace, c.key) for c in chunks] == [(NS, k(1)), ("other", k(2)), (NS, k(0))]
    first = cache.get(NS, k(1))
    assert first is not None
    assert chunks[0] == RestoredChunk(NS, k(1), tuple(first.offsets), (A, A))
    assert all(isinstance(c.offsets, tuple) for c in chunks)
    assert ChunkCache(A).committed_chunks() == []


def test_restore_rebuilds_committed_entries_in_commit_order() -> None:
    cache = ChunkCache(8 * A)
    kept = cache.restore(
        [
            chunk(k(0), (4 * A, A), (6 * A, 2 * A)),
            chunk(k(1), (0, 100)),
            chunk(k(1), (A, A), ns="other"),
            chunk(k(2), (2 * A, A), (3 * A, A), ns="adjacent"),  # shards side by side
        ]
    )
    assert kept == 4
    assert cache.remove("adjacent", [k(2)])[0].offsets == []
    s = cache.stats()
    assert (s.entries, s.committed, s.pending, s.used_bytes) == (3, 3, 0, 5 * A)
    assert s.committed_bytes == A + 2 * A + 100 + A
    entry = cache.get(NS, k(0))
    assert entry is not None and entry.committed and not entry.dead
    assert (entry.offsets, entry.sizes, entry.written, entry.writing) == (
        [4 * A, 6 * A],
        (A, 2 * A),
        3,
        0,
    )
    assert cache.lookup(NS, [k(0), k(1)]).hits == 2
    assert cache.keys_in("other") == [k(1)]
    # The commit order seeds the eviction order (then the lookups touched what they hit).
    assert [(c.namespace, c.key) for c in cache.committed_chunks()] == [
        ("other", k(1)),
        (NS, k(1)),
        (NS, k(0)),
    ]
    cache.lookup("other", [k(1)])
    # New extents go around the restored ones.
    res = cache.begin_store(NS, [k(5), k(6), k(7)], 0, one_shard)
    assert sorted(w.offset for w in res.writes) == [2 * A, 3 * A, 5 * A]
    assert res.evicted == []
    cache.finish_store(res.writes, ok=True)
    assert evicted_keys(store(cache, [k(8)])) == [k(1)]
    assert evicted_keys(store(cache, [k(9)])) == [k(0)]  # both of its shards are freed
    assert cache.stats().used_bytes == 6 * A


def test_restore_skips_damaged_records_and_keeps_the_rest() -> None:
    cache = ChunkCache(8 * A + 100, boundary=4 * A)
    kept = cache.restore(
        [
            chunk(k(0), (0, A)),
            chunk(k(1), (A + 1, A)),  # unaligned
            chunk(k(2), (8 * A, A)),  # past the (aligned) end of the arena
            chunk(k(3), (-A, A)),  # before its start
            chunk(k(4), (0, 1)),  # overlaps k(0)
            chunk(k(5), (A, A), (A, A)),  # its two shards overlap each other
            chunk(k(6), (3 * A, 2 * A)),  # straddles the boundary at 4A
            chunk(k(7), (2 * A, A), (0, A)),  # its second shard overlaps k(0)
            chunk(k(8), (7 * A, A)),  # ends exactly at the end of the arena
            chunk(k(9), (A, 2 * A)),  # ends where the boundary is
        ]
    )
    assert kept == 3
    assert cache.keys_in(NS) == [k(0), k(8), k(9)]
    assert cache.stats().used_bytes == 4 * A
    assert cache.get(NS, k(7)) is None
    # The refused extents are free again: the two pieces have room for four more pages.
    res = cache.begin_store(NS, [k(i) for i in range(10, 14)], 0, one_shard)
    assert res.refused == [] and res.evicted == []
    assert sorted(w.offset for w in res.writes) == [3 * A, 4 * A, 5 * A, 6 * A]


def test_restore_needs_an_empty_cache() -> None:
    cache = ChunkCache(4 * A)
    assert cache.restore([]) == 0
    store(cache, [k(0)])
    with pytest.raises(ValueError, match="restore needs an empty cache"):
        cache.restore([chunk(k(1), (A, A))])
    assert cache.stats().entries == 1


# -- the index against a model -----------------------------------------------------------------

NS_SIZES: dict[str, tuple[int, ...]] = {"a": (4000, A), "b": (3 * A,)}
KEYS = [k(i) for i in range(6)]
CAP = 10 * A
OWNERS = ["o1", "o2"]


def footprint(sizes: tuple[int, ...]) -> int:
    return sum(-(-s // A) * A for s in sizes)


@dataclass
class Model:
    entry: Entry
    written: set[int] = field(default_factory=set)
    writing: set[int] = field(default_factory=set)
    committed: bool = False
    readers: int = 0
    pins: dict[str, float] = field(default_factory=dict)


class CacheMachine(RuleBasedStateMachine):
    """Every operation on a small arena with two shard layouts, checked against a model."""

    POLICY = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.cache = ChunkCache(CAP, policy=self.POLICY, clock=lambda: self.now)
        self.model: dict[tuple[str, bytes], Model] = {}
        self.stores: list[list[ShardWrite]] = []
        self.loads: list[Reads] = []

    def evictable(self, m: Model) -> bool:
        return not m.readers and not m.writing and all(exp <= self.now for exp in m.pins.values())

    def room(self, ns: str, keys: list[bytes]) -> int:
        """Free bytes plus the bytes a store of ``keys`` in ``ns`` may evict."""
        s = self.cache.stats()
        return (
            s.capacity
            - s.used_bytes
            + sum(
                footprint(m.entry.sizes)
                for (mns, mkey), m in self.model.items()
                if self.evictable(m) and not (mns == ns and mkey in keys)
            )
        )

    def live(self, ns: str, key: bytes, entry: Entry) -> Model | None:
        m = self.model.get((ns, key))
        return m if m is not None and m.entry is entry else None

    @rule(
        ns=st.sampled_from(sorted(NS_SIZES)),
        keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=4),
        owner=st.sampled_from([None, *OWNERS]),
        lease=st.sampled_from([0.0, 5.0, 100.0]),
    )
    def lookup(self, ns: str, keys: list[bytes], owner: str | None, lease: float) -> None:
        self._lookup(ns, keys, owner, lease)

    def _lookup(self, ns: str, keys: list[bytes], owner: str | None, lease: float) -> None:
        hits = 0
        while hits < len(keys) and (m := self.model.get((ns, keys[hits]))) and m.committed:
            hits += 1
        pending = [
            i for i, key in enumerate(keys) if (m := self.model.get((ns, key))) and not m.committed
        ]
        out = self.cache.lookup(ns, keys, pin_owner=owner, lease=lease)
        assert (out.hits, out.pending) == (hits, pending)
        if owner is not None and lease > 0:
            assert out.pinned == hits
            for key in keys[:hits]:
                pins = self.model[(ns, key)].pins
                pins[owner] = max(pins.get(owner, 0.0), self.now + lease)
        else:
            assert out.pinned == 0

    @precondition(lambda self: any(m.committed for m in self.model.values()))
    @rule(
        data=st.data(),
        owner=st.sampled_from(OWNERS),
        lease=st.sampled_from([0.0, 5.0, 100.0]),
    )
    def lookup_committed(self, data: st.DataObject, owner: str, lease: float) -> None:
        """A lookup that starts with committed keys, so that hits and pins are common."""
        ns = data.draw(
            st.sampled_from(sorted({n for (n, _), m in self.model.items() if m.committed}))
        )
        committed = sorted(key for (n, key), m in self.model.items() if n == ns and m.committed)
        head = data.draw(st.lists(st.sampled_from(committed), unique=True, min_size=1))
        tail = data.draw(st.lists(st.sampled_from([k for k in KEYS if k not in head]), unique=True))
        self._lookup(ns, head + tail, owner, lease)

    @rule(
        ns=st.sampled_from(sorted(NS_SIZES)),
        keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=4),
        data=st.data(),
    )
    def begin_store(self, ns: str, keys: list[bytes], data: st.DataObject) -> None:
        shard = data.draw(st.integers(0, len(NS_SIZES[ns]) - 1))
        writes = self._begin_store(ns, keys, shard)
        if writes:
            self.stores.append(writes)

    @rule(
        ns=st.sampled_from(sorted(NS_SIZES)),
        keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=3),
    )
    def store_every_shard(self, ns: str, keys: list[bytes]) -> None:
        """All ranks store and finish at once: the common path, so entries commit often."""
        for shard in range(len(NS_SIZES[ns])):
            self._finish_store(self._begin_store(ns, keys, shard), ok=True)

    def _begin_store(self, ns: str, keys: list[bytes], shard: int) -> list[ShardWrite]:
        sizes = NS_SIZES[ns]
        before = {key: self.model.get((ns, key)) for key in keys}
        room_before = self.room(ns, keys)
        res = self.cache.begin_store(ns, keys, shard, lambda _: sizes)

        for e in res.evicted:
            m = self.live(e.namespace, e.key, e)
            assert m is not None, "evicted an unknown entry"
            assert self.evictable(m), "evicted an entry that is busy or pinned"
            assert not (e.namespace == ns and e.key in keys), "evicted a key of the request"
            assert e.dead and e.offsets == [] and e.committed == m.committed
            del self.model[(e.namespace, e.key)]

        cut = res.refused[0] if res.refused else len(keys)
        assert res.refused == list(range(cut, len(keys)))
        writes = iter(res.writes)
        skipped = []
        for i, key in enumerate(keys[:cut]):
            m = before[key]
            if m is not None and (m.committed or shard in m.written | m.writing):
                skipped.append(i)
                continue
            w = next(writes)
            assert (w.index, w.shard) == (i, shard)
            assert w.offset == w.entry.offsets[shard] and w.size == sizes[shard]
            if m is None:
                assert w.entry.sizes == sizes and not w.entry.committed
                m = self.model[(ns, key)] = Model(w.entry)
            else:
                assert w.entry is m.entry
            m.writing.add(shard)
        assert next(writes, None) is None
        assert res.skipped == skipped

        if res.refused:
            assert before[keys[cut]] is None, "only a new key needs room"
            # Refused only if the evictable bytes could not make room, or all were evicted
            # and the arena is still too fragmented.
            room = self.room(ns, keys)
            assert room == self.cache.stats().capacity - self.cache.stats().used_bytes or (
                room < footprint(sizes)
            )
            if all(before[key] is not None for key in keys[:cut]) and room_before < footprint(
                sizes
            ):
                assert res.evicted == [], "evicted for a store that could not fit (no dry run)"
        return res.writes

    @precondition(lambda self: bool(self.stores))
    @rule(data=st.data(), ok=st.booleans())
    def finish_store(self, data: st.DataObject, ok: bool) -> None:
        self._finish_store(self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1))), ok)

    def _finish_store(self, writes: list[ShardWrite], ok: bool) -> None:
        expect = []
        for w in writes:
            m = self.live(w.entry.namespace, w.entry.key, w.entry)
            if m is None:
                continue
            m.writing.discard(w.shard)
            if ok:
                m.written.add(w.shard)
                if len(m.written) == len(m.entry.sizes):
                    m.committed = True
                    expect.append(m.entry)
        assert self.cache.finish_store(writes, ok) == expect

    @precondition(lambda self: bool(self.stores))
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        writes = self.stores[data.draw(st.integers(0, len(self.stores) - 1))]
        for w in writes:
            m = self.live(w.entry.namespace, w.entry.key, w.entry)
            if m is not None and not m.committed and w.shard in m.writing:
                del self.model[(w.entry.namespace, w.entry.key)]
        self.cache.abandon(writes)
        assert all(w.entry.dead or w.entry.committed for w in writes)

    @rule(
        ns=st.sampled_from(sorted(NS_SIZES)),
        keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=4),
    )
    def begin_load(self, ns: str, keys: list[bytes]) -> None:
        models = [self.model.get((ns, key)) for key in keys]
        res = self.cache.begin_reads(ns, keys)
        missing = [key for key, m in zip(keys, models, strict=True) if m is None or not m.committed]
        assert res.missing == missing
        if missing:
            assert res.entries == []
            return
        assert [e for e in res.entries] == [m.entry for m in models if m]
        for m in models:
            assert m is not None
            m.readers += 1
        self.loads.append(res)

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        reads = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        for e in reads.entries:
            m = self.live(e.namespace, e.key, e)
            if m is not None:
                m.readers -= 1
        self.cache.finish_reads([reads])

    @rule(
        ns=st.sampled_from(sorted(NS_SIZES)),
        keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=4),
    )
    def remove(self, ns: str, keys: list[bytes]) -> None:
        expect = []
        for key in keys:
            m = self.model.pop((ns, key), None)
            if m is not None and m.committed:
                expect.append(m.entry)
        assert self.cache.remove(ns, keys) == expect

    @rule(ns=st.sampled_from(sorted(NS_SIZES)))
    def clear_namespace(self, ns: str) -> None:
        gone = [key for key in self.model if key[0] == ns]
        # The model's entries stay referenced here, so that their ids stay theirs.
        entries = [self.model[key].entry for key in gone if self.model[key].committed]
        for key in gone:
            del self.model[key]
        assert {id(e) for e in self.cache.clear_namespace(ns)} == {id(e) for e in entries}

    @rule(owner=st.sampled_from(OWNERS))
    def release_owner(self, owner: str) -> None:
        held = [m.pins.pop(owner) for m in self.model.values() if owner in m.pins]
        n = self.cache.release_owner(owner)
        # Expired pins may already have been pruned by an eviction scan.
        assert sum(exp > self.now for exp in held) <= n <= len(held)

    @rule(
        ns=st.sampled_from(sorted(NS_SIZES)),
        keys=st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=4),
        owner=st.sampled_from(OWNERS),
    )
    def release(self, ns: str, keys: list[bytes], owner: str) -> None:
        held = [
            m.pins.pop(owner)
            for key in keys
            if (m := self.model.get((ns, key))) is not None and owner in m.pins
        ]
        n = self.cache.release(ns, keys, owner)
        assert sum(exp > self.now for exp in held) <= n <= len(held)

    @rule(dt=st.sampled_from([1.0, 3.0, 10.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def matches_model(self) -> None:
        s = self.cache.stats()
        assert s.used_bytes <= s.capacity == CAP
        assert s.entries == len(self.model)
        assert s.committed == sum(m.committed for m in self.model.values())
        committed = {key for key, m in self.model.items() if m.committed}
        assert {(ns, key) for ns in NS_SIZES for key in self.cache.keys_in(ns)} == committed
        assert s.committed_bytes == sum(self.model[key].entry.nbytes for key in committed)
        for (ns, key), m in self.model.items():
            e = self.cache.get(ns, key)
            assert e is m.entry and not e.dead
            assert e.committed == m.committed and e.readers == m.readers
            assert e.written == sum(1 << i for i in m.written)
            assert e.writing == sum(1 << i for i in m.writing)

    @invariant()
    def extents_are_disjoint_and_accounted(self) -> None:
        # Slots are held by live entries and by dead ones that a copy in flight still uses.
        holders = {id(m.entry): m.entry for m in self.model.values()}
        for writes in self.stores:
            holders.update((id(w.entry), w.entry) for w in writes)
        for reads in self.loads:
            holders.update((id(e), e) for e in reads.entries)
        extents = []
        for e in holders.values():
            assert len(e.offsets) == len(e.sizes)
            extents += [
                (off, -(-size // A) * A) for off, size in zip(e.offsets, e.sizes, strict=True)
            ]
        extents.sort()
        for (a_off, a_len), (b_off, _) in pairwise(extents):
            assert a_off + a_len <= b_off, "extents overlap"
        assert all(off + n <= CAP for off, n in extents)
        assert sum(n for _, n in extents) == self.cache.stats().used_bytes


TestCacheMachineLru = CacheMachine.TestCase
TestCacheMachineLru.settings = property_settings(120, stateful_step_count=50)


class ArcCacheMachine(CacheMachine):
    POLICY = "arc"


TestCacheMachineArc = ArcCacheMachine.TestCase
TestCacheMachineArc.settings = property_settings(120, stateful_step_count=50)

"""ChunkCache for schedulers: reservations, holds, watchers and acknowledged removals (pure)."""

from __future__ import annotations

import pytest

from offloadd.cache.index import ChunkCache

NS = "ns"
SIZE = 4096  # one aligned shard per key


def sizes(_key: bytes) -> tuple[int, ...]:
    return (SIZE,)


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def commit(cache: ChunkCache, keys: list[bytes]) -> None:
    res = cache.begin_store(NS, keys, 0, sizes)
    assert not res.refused
    cache.finish_store(res.writes, ok=True)


def test_reserve_then_store_without_allocating() -> None:
    cache = ChunkCache(4 * SIZE)
    res = cache.reserve(NS, [key(0), key(1)], "sched", sizes)
    assert res.reserved == [0, 1] and res.refused == []
    # Only reserved keys are written; others are skipped, never allocated.
    store = cache.begin_store(NS, [key(0), key(2)], 0, sizes, allocate=False)
    assert [w.index for w in store.writes] == [0]
    assert store.skipped == [1] and store.refused == []
    assert [e.key for e in cache.finish_store(store.writes, ok=True)] == [key(0)]
    assert cache.get(NS, key(2)) is None
    # Pending and committed keys are not reserved again.
    assert cache.reserve(NS, [key(0), key(1), key(3)], "other", sizes).reserved == [2]


def test_reserved_entries_are_not_evicted_until_committed() -> None:
    cache = ChunkCache(2 * SIZE)
    cache.reserve(NS, [key(0), key(1)], "sched", sizes)
    res = cache.begin_store(NS, [key(2)], 0, sizes)
    assert res.refused == [0]  # both slots reserved: nothing evictable
    store = cache.begin_store(NS, [key(0)], 0, sizes, allocate=False)
    cache.finish_store(store.writes, ok=True)
    res = cache.begin_store(NS, [key(2)], 0, sizes)
    assert res.refused == [] and [e.key for e in res.evicted] == [key(0)]


def test_release_reservations_frees_what_was_never_written() -> None:
    cache = ChunkCache(4 * SIZE)
    cache.reserve(NS, [key(0), key(1)], "sched", sizes)
    store = cache.begin_store(NS, [key(1)], 0, sizes, allocate=False)  # a copy in flight
    assert cache.release_reservations("sched") == 2
    assert cache.get(NS, key(0)) is None and cache.get(NS, key(1)) is None
    assert cache.stats().used_bytes == SIZE  # the shard being written keeps its extent
    assert cache.finish_store(store.writes, ok=True) == []  # never visible
    assert cache.stats().used_bytes == 0


def test_hold_protects_and_outlives_removal() -> None:
    cache = ChunkCache(2 * SIZE)
    commit(cache, [key(0), key(1)])
    assert cache.hold(NS, "sched", "req", [key(0), key(9)]) == [key(9)]
    res = cache.begin_store(NS, [key(2)], 0, sizes)
    assert [e.key for e in res.evicted] == [key(1)]  # the held key is skipped
    assert cache.begin_store(NS, [key(3)], 0, sizes).refused == [0]
    cache.finish_store(res.writes, ok=True)
    removed = cache.clear_namespace(NS)
    assert {e.key for e in removed} == {key(0), key(2)}
    assert cache.stats().used_bytes == SIZE  # held: its bytes stay until released
    load = cache.begin_reads_held("sched", [("req", [key(0)])])[0]
    assert load.missing == [] and load.entries[0].key == key(0)
    assert cache.begin_reads_held("sched", [("req", [key(2)])])[0].missing == [key(2)]
    assert cache.release_hold("sched", "req", [key(0)]) == 1
    assert cache.stats().used_bytes == SIZE  # still being read
    cache.finish_reads([load])
    assert cache.stats().used_bytes == 0


def test_holds_are_counted_per_request() -> None:
    cache = ChunkCache(2 * SIZE)
    commit(cache, [key(0)])
    cache.hold(NS, "sched", "req", [key(0)])
    cache.hold(NS, "sched", "req", [key(0)])
    cache.hold(NS, "sched", "other", [key(0)])
    assert cache.release_hold("sched", "req", [key(0)]) == 1
    assert cache.release_hold("sched", "other", [key(0)]) == 1
    commit(cache, [key(1)])
    assert cache.begin_store(NS, [key(2), key(3)], 0, sizes).refused == [1]  # still one hold
    assert cache.release_holds("sched") == 1
    assert cache.stats().held == 0


def test_a_watched_removal_keeps_its_bytes_until_every_watcher_acks() -> None:
    cache = ChunkCache(2 * SIZE)
    cache.watch(NS, "a")
    cache.watch(NS, "b")
    commit(cache, [key(0), key(1)])
    res = cache.begin_store(NS, [key(2)], 0, sizes)
    assert res.refused == [0]  # the victim frees only when acknowledged
    assert [e.key for e in res.evicted] == [key(0)]
    stats = cache.stats()
    assert stats.leaving == 1 and stats.used_bytes == 2 * SIZE
    seq = cache.seq
    # A watcher that has not acknowledged may still hold (and load) the removed key.
    assert cache.hold(NS, "b", "req", [key(0)]) == []
    cache.ack("a", seq)
    assert cache.stats().leaving == 1
    # Space already on its way: the next store waits instead of evicting more.
    again = cache.begin_store(NS, [key(2)], 0, sizes)
    assert again.refused == [0] and again.evicted == []
    cache.ack("b", seq)
    assert cache.stats().leaving == 0 and cache.stats().used_bytes == 2 * SIZE  # held
    cache.release_hold("b", "req", [key(0)])
    assert cache.begin_store(NS, [key(2)], 0, sizes).refused == []


def test_the_acker_frees_its_own_evictions_at_once() -> None:
    cache = ChunkCache(2 * SIZE)
    cache.watch(NS, "sched")
    commit(cache, [key(0), key(1)])
    res = cache.reserve(NS, [key(2)], "sched", sizes, acker="sched")
    assert res.reserved == [0] and [e.key for e in res.evicted] == [key(0)]
    assert cache.stats().leaving == 0


def test_unwatch_releases_what_waited_for_that_watcher() -> None:
    cache = ChunkCache(2 * SIZE)
    cache.watch(NS, "gone")
    commit(cache, [key(0)])
    cache.clear_namespace(NS)
    assert cache.stats().used_bytes == SIZE
    cache.unwatch("gone")
    assert cache.stats().used_bytes == 0


def test_ack_beyond_the_last_removal_does_not_cover_later_ones() -> None:
    cache = ChunkCache(2 * SIZE)
    cache.watch(NS, "a")
    cache.ack("a", 10**9)  # clamped to the current sequence number
    commit(cache, [key(0)])
    cache.clear_namespace(NS)
    assert cache.stats().leaving == 1


def test_reserve_rejects_bad_shard_sizes() -> None:
    cache = ChunkCache(2 * SIZE)
    with pytest.raises(ValueError, match="bad shard sizes"):
        cache.reserve(NS, [key(0)], "sched", lambda _key: (0,))


def test_reserve_refuses_the_key_without_room_and_every_later_one() -> None:
    cache = ChunkCache(2 * SIZE)
    res = cache.reserve(NS, [key(0), key(1), key(2), key(3)], "sched", sizes)
    assert (res.reserved, res.refused, res.evicted) == ([0, 1], [2, 3], [])
    assert cache.stats().stores_refused == 2


def test_a_store_without_allocating_writes_every_reserved_key() -> None:
    cache = ChunkCache(4 * SIZE)
    cache.reserve(NS, [key(0), key(1)], "sched", sizes)
    store = cache.begin_store(NS, [key(5), key(0), key(6), key(1)], 0, sizes, allocate=False)
    assert [w.index for w in store.writes] == [1, 3]
    assert store.skipped == [0, 2]


def test_released_reservations_leave_no_arc_ghost() -> None:
    cache = ChunkCache(3 * SIZE, policy="arc")
    commit(cache, [key(0), key(1)])
    cache.reserve(NS, [key(2)], "sched", sizes)
    assert cache.release_reservations("sched") == 1
    commit(cache, [key(2)])  # a new key, in T1 behind key(0) and key(1)
    evicted = []
    for i in range(3, 6):
        res = cache.begin_store(NS, [key(i)], 0, sizes)
        evicted += [e.key for e in res.evicted]
        cache.finish_store(res.writes, ok=True)
    assert evicted == [key(0), key(1), key(2)]


def test_hold_touches_what_it_holds() -> None:
    cache = ChunkCache(3 * SIZE)
    commit(cache, [key(0), key(1), key(2)])
    cache.hold(NS, "sched", "req", [key(0)])
    cache.release_hold("sched", "req", [key(0)])
    res = cache.begin_store(NS, [key(3), key(4), key(5)], 0, sizes)
    assert [e.key for e in res.evicted] == [key(1), key(2), key(0)]


def test_holds_count_down_to_the_last_release() -> None:
    cache = ChunkCache(SIZE)
    commit(cache, [key(0)])
    for _ in range(3):
        assert cache.hold(NS, "sched", "req", [key(0)]) == []
    assert cache.stats().held == 1
    for left in (2, 1):
        assert cache.release_hold("sched", "req", [key(0)]) == 1
        assert cache.begin_store(NS, [key(1)], 0, sizes).refused == [0], left
    assert cache.release_hold("sched", "req", [key(0), key(7)]) == 1
    assert cache.release_hold("sched", "req", [key(0)]) == 0
    assert cache.release_hold("sched", "nothing", [key(0)]) == 0
    assert cache.stats().held == 0
    assert [e.key for e in cache.begin_store(NS, [key(1)], 0, sizes).evicted] == [key(0)]


def test_holding_a_key_again_after_it_was_stored_again_keeps_the_newest() -> None:
    cache = ChunkCache(2 * SIZE)
    commit(cache, [key(0)])
    cache.hold(NS, "sched", "req", [key(0)])
    cache.hold(NS, "sched", "req", [key(0)])  # twice: two releases needed
    cache.remove(NS, [key(0)])
    assert cache.stats().used_bytes == SIZE  # held: its bytes stay
    commit(cache, [key(0)])  # stored again: a new entry
    assert cache.stats().used_bytes == 2 * SIZE
    cache.hold(NS, "sched", "req", [key(0)])  # the old entry's holds go, the new one is held
    assert cache.stats().used_bytes == SIZE
    load = cache.begin_reads_held("sched", [("req", [key(0)])])[0]
    assert load.entries == [cache.get(NS, key(0))]
    cache.finish_reads([load])
    assert cache.release_hold("sched", "req", [key(0)]) == 1
    assert cache.stats().held == 0
    assert cache.begin_store(NS, [key(1), key(2)], 0, sizes).evicted[0].key == key(0)


def test_begin_load_held_of_an_unknown_request_misses_every_key() -> None:
    cache = ChunkCache(2 * SIZE)
    commit(cache, [key(0)])
    load = cache.begin_reads_held("sched", [("unknown", [key(0), key(1)])])[0]
    assert (load.entries, load.missing) == ([], [key(0), key(1)])


def test_a_store_by_the_acker_frees_its_own_evictions_at_once() -> None:
    cache = ChunkCache(2 * SIZE)
    cache.watch(NS, "sched")
    commit(cache, [key(0), key(1)])
    res = cache.begin_store(NS, [key(2)], 0, sizes, acker="sched")
    assert res.refused == [] and [e.key for e in res.evicted] == [key(0)]
    assert cache.stats().leaving == 0
    # Anyone else's store waits for the acknowledgement.
    res = cache.begin_store(NS, [key(3)], 0, sizes)
    assert res.refused == [0] and [e.key for e in res.evicted] == [key(1)]
    assert cache.stats().leaving == 1


def test_clear_by_the_acker_acknowledges_its_own_removals() -> None:
    cache = ChunkCache(2 * SIZE)
    cache.watch(NS, "sched")
    commit(cache, [key(0)])
    assert [e.key for e in cache.clear_namespace(NS, acker="sched")] == [key(0)]
    assert cache.stats().leaving == 0 and cache.stats().used_bytes == 0


def test_an_acker_evicting_elsewhere_does_not_acknowledge_its_own_namespace() -> None:
    cache = ChunkCache(2 * SIZE)
    cache.watch(NS, "sched")
    commit(cache, [key(0)])
    cache.remove(NS, [key(0)])  # waits for the scheduler's acknowledgement
    res = cache.begin_store("other", [key(1)], 0, sizes)
    cache.finish_store(res.writes, ok=True)
    reserved = cache.reserve("other", [key(2)], "sched", sizes, acker="sched")
    assert [e.key for e in reserved.evicted] == [key(1)]  # unwatched: freed at once, nothing acked
    assert cache.stats().leaving == 1


def test_a_reservation_ends_when_its_entry_commits_or_goes() -> None:
    cache = ChunkCache(4 * SIZE)
    cache.reserve(NS, [key(0), key(1), key(2)], "sched", sizes)
    store = cache.begin_store(NS, [key(0)], 0, sizes, allocate=False)
    cache.finish_store(store.writes, ok=True)  # committed: no longer reserved
    cache.remove(NS, [key(1)])  # gone: no longer reserved either
    assert cache.release_reservations("sched") == 1  # key(2) only
    assert cache.get(NS, key(2)) is None and cache.lookup(NS, [key(0)]).hits == 1
    assert cache.release_reservations("sched") == 0


def test_releasing_unheld_keys_does_not_stop_at_them() -> None:
    cache = ChunkCache(2 * SIZE)
    commit(cache, [key(0)])
    cache.hold(NS, "sched", "req", [key(0)])
    assert cache.release_hold("sched", "req", [key(7), key(0)]) == 1
    assert cache.stats().held == 0


def test_keys_of_different_shapes_in_one_call_each_get_their_own_sizes() -> None:
    # The sizes of a run of keys are checked once; a key with other sizes is checked anew.
    two, one = (SIZE, SIZE), (SIZE,)

    def shapes(k: bytes) -> tuple[int, ...]:
        return two if k[0] else one

    cache = ChunkCache(16 * SIZE)
    keys = [key(0), key(1 << 56), key(1 << 56 | 1), key(1), key(2)]
    assert cache.reserve(NS, keys, "sched", shapes).reserved == [0, 1, 2, 3, 4]
    assert [len(cache._rows.offsets_of(cache._tables[NS][k])) for k in keys] == [1, 2, 2, 1, 1]
    with pytest.raises(ValueError, match=r"bad shard sizes \(4096, 0\)"):
        cache.reserve(NS, [key(3), key(4)], "sched", lambda k: one if k == key(3) else (SIZE, 0))


def test_clear_ends_the_namespace_reservations() -> None:
    cache = ChunkCache(4 * SIZE)
    cache.reserve(NS, [key(0), key(1)], "sched", sizes)
    store = cache.begin_store(NS, [key(0)], 0, sizes, allocate=False)  # begun before the reset
    cache.clear_namespace(NS)
    assert cache.finish_store(store.writes, ok=True) == []  # never commits after the Clear
    # The rows are reused by another scheduler's reservations: none is still "sched"'s.
    assert cache.reserve(NS, [key(2), key(3)], "other", sizes).reserved == [0, 1]
    assert cache.release_reservations("sched") == 0
    assert cache.get(NS, key(2)) is not None and cache.get(NS, key(3)) is not None


def watched_full_cache(slots: int) -> tuple[ChunkCache, list[int]]:
    """A cache of ``slots`` committed keys that mirrors "a" and "b" show; the list counts
    ``on_placed`` calls."""
    cache = ChunkCache(slots * SIZE)
    cache.watch(NS, "a")
    cache.watch(NS, "b")
    commit(cache, [key(i) for i in range(slots)])
    calls: list[int] = []
    cache.on_placed(lambda: calls.append(1))
    return cache, calls


def test_a_key_whose_room_waits_on_another_mirror_is_placed_when_it_acks() -> None:
    cache, calls = watched_full_cache(4)
    res = cache.reserve(NS, [key(10)], "a", sizes, acker="a")
    assert res.reserved == [0] and cache.stats().unplaced == 1
    assert cache.unplaced(NS, [key(10), key(11), key(0)]) == 1  # only the reserved one waits
    assert calls == []
    cache.ack("b", cache.seq)
    assert calls == [1]
    assert cache.unplaced(NS, [key(10)]) == 0 and cache.stats().unplaced == 0
    store = cache.begin_store(NS, [key(10)], 0, sizes, allocate=False)
    assert [w.index for w in store.writes] == [0]
    assert [e.key for e in cache.finish_store(store.writes, ok=True)] == [key(10)]
    assert cache.stats().refused == {}


def test_a_store_that_meets_a_key_still_unplaced_drops_it_as_refused_for_ack() -> None:
    cache, calls = watched_full_cache(4)
    cache.reserve(NS, [key(10)], "a", sizes, acker="a")
    store = cache.begin_store(NS, [key(10)], 0, sizes, allocate=False)
    assert store.writes == [] and store.skipped == [0]
    assert cache.stats().refused == {"ack": 1}
    assert cache.get(NS, key(10)) is None and cache.stats().unplaced == 0
    cache.ack("b", cache.seq)
    assert calls == []  # nothing waited any more


def test_unplaced_places_a_key_whose_room_is_free_already() -> None:
    cache, calls = watched_full_cache(4)
    cache.reserve(NS, [key(10)], "a", sizes, acker="a")
    cache.remove(NS, [key(2)])  # "a" and "b" must acknowledge this one too
    cache.unwatch("b")  # ... but "a" alone is left, and it has not
    cache.ack("a", cache.seq)
    assert calls == [1] and cache.unplaced(NS, [key(10)]) == 0


def test_a_key_waiting_on_held_room_is_placed_when_the_hold_ends() -> None:
    cache, calls = watched_full_cache(2)
    assert cache.reserve(NS, [key(10)], "a", sizes, acker="a").reserved == [0]
    # "b" still shows both victims and holds them: its acknowledgement frees nothing yet.
    assert cache.hold(NS, "b", "req", [key(0), key(1)]) == []
    cache.ack("b", cache.seq)
    assert calls == [] and cache.unplaced(NS, [key(10)]) == 1
    cache.release_hold("b", "req", [key(1)])
    assert calls == [1] and cache.unplaced(NS, [key(10)]) == 0


def test_a_key_waiting_on_read_room_is_placed_when_the_read_ends() -> None:
    cache, calls = watched_full_cache(2)
    assert cache.reserve(NS, [key(10)], "a", sizes, acker="a").reserved == [0]
    assert cache.hold(NS, "b", "req", [key(0), key(1)]) == []
    reads = cache.begin_reads_held("b", [("req", [key(0), key(1)])])[0]
    cache.release_hold("b", "req", [key(0), key(1)])  # the reads alone keep the room now
    cache.ack("b", cache.seq)
    assert calls == [] and cache.unplaced(NS, [key(10)]) == 1
    cache.finish_reads([reads])
    assert calls == [1] and cache.unplaced(NS, [key(10)]) == 0


def test_a_key_waiting_for_room_is_placed_when_a_dead_write_ends() -> None:
    cache = ChunkCache(3 * SIZE)
    cache.watch(NS, "a")
    cache.watch(NS, "b")
    commit(cache, [key(0), key(1)])
    writing = cache.begin_store(NS, [key(2)], 0, sizes)  # a rank's copy in flight
    calls: list[int] = []
    cache.on_placed(lambda: calls.append(1))
    assert cache.reserve(NS, [key(10)], "a", sizes, acker="a").reserved == [0]
    assert cache.hold(NS, "b", "req", [key(0), key(1)]) == []
    cache.ack("b", cache.seq)  # the victims' room is held still
    assert calls == [] and cache.unplaced(NS, [key(10)]) == 1
    cache.remove(NS, [key(2)])  # dead, but its copy runs: its room frees when that ends
    assert cache.unplaced(NS, [key(10)]) == 1
    assert cache.finish_store(writing.writes, ok=True) == []
    assert calls == [1] and cache.unplaced(NS, [key(10)]) == 0
    assert cache.stats().used_bytes == 3 * SIZE  # two held victims and key(10)


def test_a_steps_held_reads_are_taken_and_ended_in_one_call_each() -> None:
    cache = ChunkCache(8 * SIZE)
    commit(cache, [key(i) for i in range(4)])
    assert cache.hold_tokens(NS, "sched", [("a", [key(0), key(1)]), ("b", [key(2)])]) == []
    loads = [("a", [key(0), key(1)]), ("b", [key(2)]), ("c", [key(3)]), ("a", [key(0), key(3)])]
    a, b, c, partly = cache.begin_reads_held("sched", loads)
    assert (a.missing, b.missing, c.missing, partly.missing) == ([], [], [key(3)], [key(3)])
    assert c.rows == [] and partly.rows == []  # a load missing a key reads none
    entries = [cache.get(NS, key(i)) for i in range(3)]
    assert [e.readers for e in entries if e is not None] == [1, 1, 1]
    expected = [(e.offset(0), SIZE) for e in entries if e is not None]
    assert cache.read_extents(a.rows, 0) + cache.read_extents(b.rows, 0) == expected
    cache.finish_reads([a, b])
    assert [e.readers for e in entries if e is not None] == [0, 0, 0]
    with pytest.raises(ValueError, match=r"row \d+ is not being read"):
        cache.finish_reads([b])


def test_holds_of_many_tokens_are_charged_and_refunded_in_one_call_each() -> None:
    cache = ChunkCache(8 * SIZE)
    commit(cache, [key(i) for i in range(3)])
    holds = [("a", [key(0), key(1)]), ("b", [key(1), key(2)]), ("c", [key(9)])]
    assert cache.hold_tokens(NS, "sched", holds) == [key(9)]
    assert cache.protected_bytes("sched") == 4 * SIZE  # each token's hold of each key
    assert cache.release_hold_tokens("sched", [("a", [key(0), key(1)]), ("b", [key(2)])]) == 3
    assert cache.protected_bytes("sched") == SIZE and cache.stats().held == 1
    assert cache.release_hold_tokens("sched", [("b", [key(1)]), ("none", [key(0)])]) == 1
    assert cache.protected_bytes("sched") == 0 and cache.stats().held == 0
    assert len(cache.begin_store(NS, [key(5), key(6)], 0, sizes).writes) == 2


def test_a_load_by_key_reads_a_removal_not_yet_acknowledged() -> None:
    """A rank's load that arrives before its scheduler's hold (or whose hold was refused)
    finds the bytes the scheduler's mirror still shows; once every mirror acknowledged the
    removal, it misses."""
    cache = ChunkCache(2 * SIZE)
    cache.watch(NS, "sched")
    commit(cache, [key(0), key(1)])
    res = cache.begin_store(NS, [key(2)], 0, sizes)
    assert [e.key for e in res.evicted] == [key(0)]  # leaving: "sched" has not acknowledged
    reads = cache.begin_reads(NS, [key(0), key(1)])
    assert reads.missing == [] and len(reads.rows) == 2
    cache.ack("sched", cache.seq)
    assert cache.stats().used_bytes == 2 * SIZE  # being read: its extents stay
    cache.finish_reads([reads])
    assert cache.stats().leaving == 0
    assert cache.begin_reads(NS, [key(0)]).missing == [key(0)]

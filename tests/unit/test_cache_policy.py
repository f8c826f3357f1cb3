"""Eviction policies: LRU order and reverse touch, ARC promotion, ghosts and target."""

from __future__ import annotations

import pytest

from offloadd.cache.policy import ArcPolicy, EvictionPolicy, LruPolicy, make_policy


def test_lru_evicts_least_recent_first() -> None:
    p: LruPolicy[str] = LruPolicy()
    for k in "abcd":
        p.insert(k)
    assert list(p.candidates()) == ["a", "b", "c", "d"]
    p.touch(["b"])
    assert list(p.candidates()) == ["a", "c", "d", "b"]
    assert len(p) == 4 and "a" in p


def test_lru_touch_walks_in_reverse_so_the_prefix_head_is_most_recent() -> None:
    p: LruPolicy[str] = LruPolicy()
    for k in "abcde":
        p.insert(k)
    p.touch(["a", "b", "c"])
    # c, b, a are moved in that order: a is now the most recent.
    assert list(p.candidates()) == ["d", "e", "c", "b", "a"]
    p.touch(["zz"])  # unknown keys are ignored
    assert len(p) == 5


def test_lru_remove_and_evicted() -> None:
    p: LruPolicy[str] = LruPolicy()
    for k in "abc":
        p.insert(k)
    p.remove("b")
    p.evicted("a")
    p.remove("nope")
    assert list(p.candidates()) == ["c"]
    p.insert("a")  # LRU keeps no history: a plain new key
    assert list(p.candidates()) == ["c", "a"]


def test_candidates_may_be_abandoned() -> None:
    for name in ("lru", "arc"):
        p: EvictionPolicy[int] = make_policy(name)
        for k in range(10):
            p.insert(k)
        it = p.candidates()
        first = [next(it) for _ in range(3)]
        del it
        for k in first:
            p.evicted(k)
        assert len(p) == 7
        assert not set(first) & set(p.candidates())


def test_arc_touch_promotes_t1_to_t2() -> None:
    p: ArcPolicy[str] = ArcPolicy()
    for k in "abcd":
        p.insert(k)
    assert p.target == 0
    p.touch(["b"])
    # target 0: T1 (a, c, d) goes first, then T2 (b).
    assert list(p.candidates()) == ["a", "c", "d", "b"]
    p.touch(["c", "d"])  # reverse walk: d enters T2 first, then c
    assert list(p.candidates()) == ["a", "b", "d", "c"]
    p.touch(["b"])  # refresh within T2
    assert list(p.candidates()) == ["a", "d", "c", "b"]


def test_arc_b1_ghost_hit_raises_target_and_goes_to_t2() -> None:
    p: ArcPolicy[str] = ArcPolicy()
    for k in "abcd":
        p.insert(k)
    p.evicted("a")
    assert "a" not in p and p.is_ghost("a") and len(p) == 3
    p.insert("a")
    assert p.target == 1  # max(1, |B2|/|B1|) with B2 empty
    assert not p.is_ghost("a")
    # a went to T2, so with |T1| = 3 >= target, T1 comes first and a last.
    assert list(p.candidates()) == ["b", "c", "d", "a"]


def test_arc_b2_ghost_hit_lowers_target() -> None:
    p: ArcPolicy[str] = ArcPolicy()
    for k in "abcdef":
        p.insert(k)
    for k in "ab":  # two B1 ghosts to raise the target
        p.evicted(k)
    p.insert("a")
    p.insert("b")
    assert p.target == 2
    p.evicted("a")  # a was in T2, so it becomes a B2 ghost
    assert p.is_ghost("a")
    p.insert("a")
    assert p.target == 1
    p.evicted("b")
    p.insert("b")
    assert p.target == 0  # never below zero


def test_arc_candidate_order_follows_target() -> None:
    p: ArcPolicy[str] = ArcPolicy()
    for k in "abcdef":
        p.insert(k)
    p.touch(["e", "f"])  # T1 = a b c d, T2 = f e
    for k in "abc":
        p.evicted(k)  # B1 = a b c; T1 = d
    p.insert("a")  # target 1
    p.insert("b")  # target 2
    assert p.target == 2
    # |T1| = 1 < target: T2 first (f, e, a, b), then T1 (d).
    assert list(p.candidates()) == ["f", "e", "a", "b", "d"]
    for k in "ghi":
        p.insert(k)  # T1 = d g h i
    # T1 while its remaining size >= 2: d, g, h; then T2; then the rest of T1.
    assert list(p.candidates()) == ["d", "g", "h", "f", "e", "a", "b", "i"]


def test_arc_ghosts_are_trimmed_to_live_keys() -> None:
    p: ArcPolicy[int] = ArcPolicy()
    for k in range(4):
        p.insert(k)
    for k in range(3):
        p.evicted(k)
    # One live key left: at most one ghost per list, the newest.
    assert len(p) == 1
    assert [k for k in range(4) if p.is_ghost(k)] == [2]
    p.remove(3)
    assert not any(p.is_ghost(k) for k in range(4))


def test_arc_remove_keeps_no_ghost() -> None:
    p: ArcPolicy[str] = ArcPolicy()
    for k in "abc":
        p.insert(k)
    p.remove("a")
    assert not p.is_ghost("a")
    p.insert("a")
    assert p.target == 0
    assert list(p.candidates()) == ["b", "c", "a"]


def test_make_policy() -> None:
    assert isinstance(make_policy("lru"), LruPolicy)
    assert isinstance(make_policy("arc"), ArcPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy 'lfu'; expected one of arc, lru"):
        make_policy("lfu")


def test_lru_evicted_of_an_unknown_key_is_ignored() -> None:
    p: LruPolicy[str] = LruPolicy()
    p.insert("a")
    p.evicted("b")
    p.insert("a")  # a live key again: a touch
    assert list(p.candidates()) == ["a"] and "b" not in p


def test_arc_membership_and_a_live_key_inserted_again() -> None:
    p: ArcPolicy[str] = ArcPolicy()
    for k in "abc":
        p.insert(k)
    assert "a" in p and "b" in p and "z" not in p
    p.insert("a")  # a live key again counts as a touch: T1 -> T2
    assert list(p.candidates()) == ["b", "c", "a"]
    p.touch(["b"])
    assert "b" in p and len(p) == 3  # in T2 now
    p.insert("b")  # refreshed within T2
    assert list(p.candidates()) == ["c", "a", "b"]


def test_arc_target_moves_by_the_ratio_of_the_ghost_lists() -> None:
    p: ArcPolicy[str] = ArcPolicy()
    for k in "abcdefgh":
        p.insert(k)
    p.touch(["h"])
    p.evicted("h")  # B2 = h
    for k in "ab":
        p.evicted(k)  # B1 = a, b
    p.insert("a")  # |B2|/|B1| = 1/2: the target rises by 1, not by 2
    assert p.target == 1
    p.insert("h")  # a B2 hit: |B1|/|B2| = 1/1
    assert p.target == 0
    for k in "cdef":
        p.evicted(k)  # B1 = b..f, trimmed to the three live keys: d, e, f
    assert [k for k in "bcdef" if p.is_ghost(k)] == ["d", "e", "f"]
    p.insert("f")  # |B2| = 0: max(1, 0) = 1
    assert p.target == 1


def test_arc_b2_hit_lowers_the_target_by_the_ratio_of_the_ghost_lists() -> None:
    p: ArcPolicy[str] = ArcPolicy()
    for k in "abcdefghij":
        p.insert(k)
    for k in "ab":
        p.evicted(k)
        p.insert(k)  # two B1 hits: target 2, a and b in T2
    for k in "abcd":
        p.evicted(k)  # B2 = a, b; B1 = c, d
    assert p.target == 2
    p.insert("a")  # |B1|/|B2| = 2/2: lowered by 1
    assert p.target == 1


def test_arc_target_never_exceeds_the_live_keys_plus_one() -> None:
    p: ArcPolicy[str] = ArcPolicy()
    for k in "abcdefgh":
        p.insert(k)
    for k in "ab":
        p.evicted(k)
        p.insert(k)  # two B1 hits: target 2
    p.touch(["c"])
    for k in "abcd":
        p.evicted(k)  # B2 = a, b, c; B1 = d
    p.touch(["e"])
    p.evicted("e")  # B2 = b, c, e (trimmed to the three live keys f, g, h)
    assert (p.target, len(p)) == (2, 3)
    p.insert("d")  # a B1 hit: 2 + |B2|/|B1| = 5, capped at 3 live keys + 1
    assert p.target == 4

"""Eviction policies: LRU order and reverse touch, ARC promotion, ghosts and target."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from offloadd.cache.policy import RowArc, RowLru, make_row_policy
from tests.oracles import ArcPolicy, EvictionPolicy, LruPolicy, make_policy
from tests.strategies import property_settings


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


# -- the row policies against the key policies ----------------------------------------------

KEYS = [(ns, bytes([i])) for ns in (0, 1) for i in range(5)]


class RowPolicyMachine(RuleBasedStateMachine):
    """``RowLru``/``RowArc`` fed what ``LruPolicy``/``ArcPolicy`` are fed, rows recycled as
    the cache recycles them: the same order, the same ghosts, the same target."""

    NAME = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.keys: EvictionPolicy[tuple[int, bytes]] = make_policy(self.NAME)
        self.rows = make_row_policy(self.NAME)
        self.row_of: dict[tuple[int, bytes], int] = {}
        self.free: list[int] = []
        self.next_row = 0

    def live(self) -> list[tuple[int, bytes]]:
        return sorted(self.row_of)

    @rule(key=st.sampled_from(KEYS))
    def insert(self, key: tuple[int, bytes]) -> None:
        row = self.row_of.get(key)
        if row is None:
            if self.free:
                row = self.free.pop()
            else:
                row = self.next_row
                self.next_row += 1
                self.rows.grow(self.next_row)
            self.row_of[key] = row
        self.keys.insert(key)
        self.rows.insert(row, *key)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6))
    def touch(self, keys: list[tuple[int, bytes]]) -> None:
        live = [key for key in keys if key in self.row_of]  # rows are touched only when live
        self.keys.touch(live)
        self.rows.touch([self.row_of[key] for key in live])

    @precondition(lambda self: bool(self.row_of))
    @rule(data=st.data(), evict=st.booleans())
    def leave(self, data: st.DataObject, evict: bool) -> None:
        key = data.draw(st.sampled_from(self.live()))
        row = self.row_of.pop(key)
        if evict:
            self.keys.evicted(key)
            self.rows.evicted(row, *key)
        else:
            self.keys.remove(key)
            self.rows.remove(row)
        self.free.append(row)

    @precondition(lambda self: bool(self.row_of))
    @rule(count=st.integers(1, 4))
    def evict_first(self, count: int) -> None:
        """What the cache does: take victims from a partly read candidates()."""
        victims = list(itertools.islice(self.keys.candidates(), count))
        rows = list(itertools.islice(self.rows.candidates(), count))
        assert rows == [self.row_of[key] for key in victims]
        for key in victims:
            row = self.row_of.pop(key)
            self.keys.evicted(key)
            self.rows.evicted(row, *key)
            self.free.append(row)

    @rule(fresh=st.lists(st.sampled_from(KEYS), max_size=3), touches=st.integers(1, 3000))
    def store_then_touch_often(self, fresh: list[tuple[int, bytes]], touches: int) -> None:
        """New keys, then enough touches to compact the logs, with no read in between."""
        for key in fresh:
            self.insert(key)
        live = self.live()
        if live:
            for i in range(touches // len(live) + 1):
                batch = live[i % len(live) :] + live[: i % len(live)]
                self.keys.touch(batch)
                self.rows.touch([self.row_of[key] for key in batch])

    @invariant()
    def same_order(self) -> None:
        key_of = {row: key for key, row in self.row_of.items()}
        assert [key_of[row] for row in self.rows.candidates()] == list(self.keys.candidates())
        assert len(self.rows) == len(self.keys) == len(self.row_of)
        if isinstance(self.keys, ArcPolicy):
            assert isinstance(self.rows, RowArc)
            assert self.rows.target == self.keys.target
            assert [k for k in KEYS if self.rows.is_ghost(*k)] == [
                k for k in KEYS if self.keys.is_ghost(k)
            ]


class ArcRowPolicyMachine(RowPolicyMachine):
    NAME = "arc"


TestRowLru = RowPolicyMachine.TestCase
TestRowLru.settings = property_settings(150, stateful_step_count=60)
TestRowArc = ArcRowPolicyMachine.TestCase
TestRowArc.settings = property_settings(150, stateful_step_count=60)


def test_row_policies_by_name() -> None:
    assert isinstance(make_row_policy("lru"), RowLru)
    assert isinstance(make_row_policy("arc"), RowArc)
    with pytest.raises(ValueError, match="unknown eviction policy 'lfu'; expected one of arc, lru"):
        make_row_policy("lfu")


def test_a_row_log_is_compacted_and_keeps_its_order() -> None:
    p = RowLru()
    p.grow(3000)
    for row in range(3000):
        p.insert(row, 0, b"")
    for _ in range(5):
        p.touch(list(range(0, 3000, 2)))  # the even rows, 0 last: most recent
    for row in range(1, 3000, 2):
        p.remove(row)
    assert list(p.candidates()) == list(range(2998, -1, -2))
    assert len(p) == 1500


def test_a_row_log_stays_within_twice_its_members() -> None:
    p = RowLru()
    p.grow(100)
    for row in range(100):
        p.insert(row, 0, b"")
    for _ in range(200):
        p.touch(list(range(0, 100, 3)))
    assert len(p._order._log) < 2 * max(len(p), 1024)
    assert list(p.candidates())[-1] == 0 and len(p) == 100

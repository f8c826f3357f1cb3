"""The cache's one ledger of protected bytes: the per-engine budget is read from it (pure)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from offloadd.cache.index import ChunkCache

NS = "ns"
ENGINE = ("e", 0)
OWNERS = ("s1", "s2")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sized(key: bytes) -> tuple[int, ...]:
    return (8 * (1 + key[0] % 3),)  # 8, 16 or 24 bytes


def commit(cache: ChunkCache, keys: list[bytes]) -> None:
    res = cache.begin_store(NS, keys, 0, sized)
    cache.finish_store(res.writes, ok=True)


def protected_sum(cache: ChunkCache, owner: str) -> int:
    """What ``owner`` protects, read from the cache's own pins, holds and reservations."""
    total = 0
    for row, pins in cache._pins.items():
        if owner in pins:
            total += sum(cache._shapes[cache._shape.v[row]])
    for (holder, _token), held in cache._holds.items():
        if holder == owner:
            total += sum(sum(cache._shapes[cache._shape.v[row]]) for row, _ in held.values())
    for row, reserver in cache._reserved_by.items():
        if reserver == owner:
            total += sum(cache._shapes[cache._shape.v[row]])
    return total


def test_over_budget_nothing_is_taken_so_nothing_is_given_back() -> None:
    cache = ChunkCache(1 << 16, align=8, budget=32, clock=Clock())
    keys = [bytes([2, i]) for i in range(3)]  # 24 bytes each
    commit(cache, keys)
    assert cache.lookup(NS, keys, pin_owner="s1", lease=5, account=ENGINE).pinned == 1
    # The keys beyond the budget were never pinned, held or reserved: none to release.
    assert [cache.get(NS, key).pins is not None for key in keys] == [True, False, False]  # type: ignore[union-attr]
    assert cache.hold(NS, "s1", "t", keys[1:], account=ENGINE) == keys[1:]
    assert cache.stats().held == 0
    assert cache.reserve(NS, [b"\2new"], "s1", sized, account=ENGINE).reserved == []
    assert cache.get(NS, b"\2new") is None
    assert cache.protected_bytes("s1") == 24 and cache.room(ENGINE) == 8
    assert cache.release(NS, keys[1:], "s1") == 0
    # Without an account the same owner is bounded by nothing (the cache's own callers).
    assert cache.lookup(NS, keys, pin_owner="s1", lease=5).pinned == 3


Op = tuple[str, str, list[int], int]  # what, whose, which keys, how much later

OPS: st.SearchStrategy[list[Op]] = st.lists(
    st.tuples(
        st.sampled_from(
            ["pin", "release", "hold", "unhold", "reserve", "commit", "remove", "clear", "end"]
        ),
        st.sampled_from(OWNERS),
        st.lists(st.integers(0, 5), min_size=1, max_size=3),
        st.integers(0, 2),  # the clock moves on by this much
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_each_owners_bytes_are_the_sum_of_what_it_protects(ops: list[Op]) -> None:
    clock = Clock()
    cache = ChunkCache(1 << 12, align=8, budget=96, clock=clock)
    commit(cache, [bytes([i]) for i in range(4)])
    for op, owner, picks, later in ops:
        keys = [bytes([i]) for i in picks]
        clock.now += later
        if op == "pin":
            cache.lookup(NS, keys, pin_owner=owner, lease=3, account=ENGINE)
        elif op == "release":
            cache.release(NS, keys, owner)
        elif op == "hold":
            cache.hold(NS, owner, "t", keys, account=ENGINE)
        elif op == "unhold":
            cache.release_hold(owner, "t", keys)
        elif op == "reserve":
            cache.reserve(NS, keys, owner, sized, account=ENGINE)
        elif op == "commit":
            res = cache.begin_store(NS, keys, 0, sized, allocate=False)
            cache.finish_store(res.writes, ok=True)
        elif op == "remove":
            cache.remove(NS, keys)
        elif op == "clear":
            cache.clear_namespace(NS)
            commit(cache, [bytes([i]) for i in range(4)])
        else:
            cache.release_owner(owner)
            cache.release_holds(owner)
            cache.release_reservations(owner)
            assert cache.protected_bytes(owner) == 0
        for who in OWNERS:
            assert cache.protected_bytes(who) == protected_sum(cache, who)
        room = cache.room(ENGINE)  # expired pins dropped: the rest is within the budget
        assert room == 96 - sum(cache.protected_bytes(who) for who in OWNERS) >= 0

"""The cache's one ledger of protected bytes: the per-engine and per-tenant budgets are read
from it, and reservations end with their lease (pure)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from offloadd.cache.index import REFUSED_EXPIRED, REFUSED_TENANT, ChunkCache
from offloadd.cache.ledger import ENGINE as ENGINE_BOUND
from offloadd.cache.ledger import TENANT as TENANT_BOUND
from offloadd.cache.ledger import Ledger

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
    for row, pins in cache._guards.pins.items():
        if owner in pins:
            total += sum(cache._rows.shapes[cache._rows.shape.v[row]])
    for (holder, _token), held in cache._guards.holds.items():
        if holder == owner:
            total += sum(
                sum(cache._rows.shapes[cache._rows.shape.v[row]]) for row, _ in held.values()
            )
    for row, reserver in cache._guards.reserved_by.items():
        if reserver == owner:
            total += sum(cache._rows.shapes[cache._rows.shape.v[row]])
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


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_two_engines_of_one_tenant_stay_within_the_tenant_budget(ops: list[Op]) -> None:
    clock = Clock()
    cache = ChunkCache(1 << 12, align=8, budget=64, tenant_budget=96, clock=clock)
    commit(cache, [bytes([i]) for i in range(4)])
    engine_of = {"s1": ("e", 0), "s2": ("f", 0)}  # one owner in each engine of tenant "u"
    for op, owner, picks, later in ops:
        keys = [bytes([i]) for i in picks]
        clock.now += later
        engine = engine_of[owner]
        if op == "pin":
            cache.lookup(NS, keys, pin_owner=owner, lease=3, account=engine, tenant="u")
        elif op in ("hold", "unhold"):
            cache.hold(NS, owner, "t", keys, account=engine, tenant="u")
        elif op in ("reserve", "commit"):
            cache.reserve(NS, keys, owner, sized, account=engine, tenant="u")
        elif op in ("release", "remove", "clear", "end"):
            cache.release_owner(owner)
            cache.release_holds(owner)
            cache.release_reservations(owner)
        for who in OWNERS:
            assert cache.protected_bytes(who) == protected_sum(cache, who)
        tenant_room = cache.room(None, "u")
        assert tenant_room == 96 - sum(cache.protected_bytes(who) for who in OWNERS) >= 0
        for who, engine in engine_of.items():
            assert cache.room(engine) == 64 - cache.protected_bytes(who) >= 0


# ---------------------------------------------------------------- per tenant


def test_a_tenants_engines_share_one_tenant_budget() -> None:
    ledger = Ledger(budget=100, tenant_budget=150)
    ledger.charge("a1", 80, ("a", 0), "u1")
    assert ledger.room(("a", 0), "u1") == 20  # the engine's bound is the smaller
    assert ledger.binding(("a", 0), "u1") == ENGINE_BOUND
    # A second engine of the same user starts with only what the tenant has left.
    assert ledger.room(("b", 0), "u1") == 70
    assert ledger.binding(("b", 0), "u1") == TENANT_BOUND
    ledger.charge("b1", 70, ("b", 0), "u1")
    assert ledger.room(("b", 0), "u1") == 0 and ledger.tenant_used("u1") == 150
    # Another user's engine is bounded by its own budgets only.
    assert ledger.room(("c", 0), "u2") == 100
    # Refunds go to both accounts; an owner with nothing left is forgotten by both.
    ledger.refund("a1", 80)
    assert ledger.used(("a", 0)) == 0 and ledger.tenant_used("u1") == 70
    assert ledger.members(("a", 0), "u1") == ["b1"] and not ledger.bounded("a1")
    # Without budgets nothing is bounded, whatever is counted.
    free = Ledger()
    free.charge("x", 1 << 40, ("a", 0), "u1")
    assert free.room(("a", 0), "u1") == math.inf and not free.bounded("x")


def test_an_owner_named_with_new_accounts_moves_its_bytes_to_them() -> None:
    ledger = Ledger(budget=100, tenant_budget=100)
    ledger.charge("s", 30, ("a", 0), "u1")
    ledger.charge("s", 10, ("b", 0), "u2")
    assert ledger.used(("a", 0)) == 0 and ledger.tenant_used("u1") == 0
    assert ledger.used(("b", 0)) == 40 and ledger.tenant_used("u2") == 40
    ledger.charge("s", 5)  # no account: stays where it is
    assert ledger.tenant_used("u2") == 45


def test_two_engines_of_one_user_cannot_take_more_than_the_tenants_share() -> None:
    """Finding 4's attack in miniature: one user's two engines pin and reserve all they can;
    the other user's hits stay and its stores find room."""
    cache = ChunkCache(32 * 8, align=8, budget=16 * 8, tenant_budget=16 * 8, clock=Clock())
    victim = [bytes([0, i]) for i in range(8)]  # 8 bytes each
    commit(cache, victim)
    theirs = [bytes([0, 100 + i]) for i in range(8)]
    commit(cache, theirs)
    # Engine one pins its 8 keys (64 bytes) and reserves 8 more; engine two reserves too.
    assert cache.lookup(NS, theirs, pin_owner="a1", lease=60, account="a", tenant="u1").pinned == 8
    grab = [bytes([0, 200 + i]) for i in range(16)]
    taken = cache.reserve(NS, grab, "a1s", sized, account="a", tenant="u1").reserved
    more = [bytes([0, 232 + i]) for i in range(16)]
    taken2 = cache.reserve(NS, more, "a2s", sized, account="b", tenant="u1").reserved
    assert len(taken) == 8 and taken2 == []  # 16 keys' worth in all: the tenant's share
    assert cache.stats().refused[REFUSED_TENANT] == 16
    assert cache.room("b", "u1") == 0 and cache.room("v", "u2") == 16 * 8
    # The victim's committed keys are still there, and it can pin and store its share.
    assert cache.lookup(NS, victim, pin_owner="v1", lease=60, account="v", tenant="u2").hits == 8
    fresh = [bytes([0, 150 + i]) for i in range(8)]
    assert cache.reserve(NS, fresh, "v1s", sized, account="v", tenant="u2").reserved == list(
        range(8)
    )
    store = cache.begin_store(NS, fresh, 0, sized, allocate=False)
    assert len(cache.finish_store(store.writes, ok=True)) == 8


# ---------------------------------------------------------------- reservation leases


def test_a_reservation_not_stored_within_its_lease_is_dropped_and_freed() -> None:
    clock = Clock()
    cache = ChunkCache(1 << 12, align=8, budget=64, clock=clock, reservation_lease=2.0)
    keys = [bytes([0, i]) for i in range(4)]
    assert cache.reserve(NS, keys, "s", sized, account=ENGINE).reserved == [0, 1, 2, 3]
    # One is stored in time; one is being written when the lease ends; two never are.
    done = cache.begin_store(NS, keys[:1], 0, sized, allocate=False)
    cache.finish_store(done.writes, ok=True)
    late = cache.begin_store(NS, keys[1:2], 0, sized, allocate=False)
    clock.now = 1.9
    assert cache.room(ENGINE) == 64 - 24 and cache.stats().refused == {}
    clock.now = 2.0
    assert cache.room(ENGINE) == 64  # every lapsed reservation is refunded at once
    assert cache.stats().refused == {REFUSED_EXPIRED: 2}
    assert cache.get(NS, keys[2]) is None and cache.get(NS, keys[3]) is None
    assert cache.protected_bytes("s") == 0
    assert cache.stats().used_bytes == 16  # the committed key and the one being written
    # The store that had begun still commits; the ranks' late store of the others is skipped.
    assert [e.key for e in cache.finish_store(late.writes, ok=True)] == [keys[1]]
    again = cache.begin_store(NS, keys[2:], 0, sized, allocate=False)
    assert again.writes == [] and again.skipped == [0, 1]


def test_a_reservation_made_again_gets_a_lease_of_its_own() -> None:
    clock = Clock()
    cache = ChunkCache(1 << 12, align=8, clock=clock, reservation_lease=2.0)
    key = [bytes([0, 1])]
    cache.reserve(NS, key, "s", sized)
    cache.release_reservations("s")
    clock.now = 1.0
    cache.reserve(NS, key, "s", sized)  # the first one's heap item is stale from here on
    clock.now = 2.5
    assert cache.stats().refused == {} and cache.get(NS, key[0]) is not None
    clock.now = 3.0
    assert cache.stats().refused == {REFUSED_EXPIRED: 1} and cache.get(NS, key[0]) is None


def test_a_renewing_lease_stops_renewing_until_the_key_is_stored() -> None:
    # A scheduler that reserves its keys again each time their lease lapses (or after it left
    # and came back) keeps them for (1 + renewals) leases, then no longer.
    clock = Clock()
    cache = ChunkCache(1 << 12, align=8, clock=clock, reservation_lease=2.0, reservation_renewals=2)
    keys = [bytes([0, i]) for i in range(4)]
    for renewal in range(3):  # the first reservation and two renewals
        assert cache.reserve(NS, keys, "s", sized).reserved == [0, 1, 2, 3], renewal
        clock.now += 2.0
    assert cache.stats().refused == {REFUSED_EXPIRED: 12}  # each lapsed unstored
    assert cache.reserve(NS, keys, "s", sized).reserved == []  # reserved 3 times: no more
    assert cache.stats().refused == {REFUSED_EXPIRED: 16} and cache.stats().used_bytes == 0
    # Another owner of the namespace (the scheduler again, after it left) renews nothing.
    assert cache.reserve(NS, keys, "s2", sized).reserved == []
    # A scheduler that leaves before the lease lapses renews as much.
    other = [bytes([0, 9])]
    for _ in range(3):
        assert cache.reserve(NS, other, "s", sized).reserved == [0]
        assert cache.release_reservations("s") == 1
    assert cache.reserve(NS, other, "s", sized).reserved == []
    # Stored, a key counts afresh: evicted later, it is reserved again as a new one.
    done = cache.begin_store(NS, other, 0, sized)
    assert len(cache.finish_store(done.writes, ok=True)) == 1
    cache.remove(NS, other)
    assert cache.reserve(NS, other, "s", sized).reserved == [0]
    # A reservation its ranks store resets the count the same way.
    stored = cache.begin_store(NS, other, 0, sized, allocate=False)
    assert len(cache.finish_store(stored.writes, ok=True)) == 1
    cache.remove(NS, other)
    for _ in range(3):
        assert cache.reserve(NS, other, "s", sized).reserved == [0]
        cache.release_reservations("s")
    assert cache.reserve(NS, other, "s", sized).reserved == []


def test_without_a_renewal_bound_a_lease_renews_as_before() -> None:
    clock = Clock()
    cache = ChunkCache(1 << 12, align=8, clock=clock, reservation_lease=2.0)
    for _ in range(10):
        assert cache.reserve(NS, [b"\0k"], "s", sized).reserved == [0]
        clock.now += 2.0


def test_lapsed_reservations_make_room_for_another_store() -> None:
    clock = Clock()
    cache = ChunkCache(4 * 8, align=8, clock=clock, reservation_lease=5.0)
    cache.reserve(NS, [bytes([0, i]) for i in range(4)], "s", sized)  # the whole arena
    other = [bytes([0, 10 + i]) for i in range(4)]
    assert cache.begin_store(NS, other, 0, sized).refused == [0, 1, 2, 3]
    clock.now = 5.0
    res = cache.begin_store(NS, other, 0, sized)
    assert res.refused == [] and len(cache.finish_store(res.writes, ok=True)) == 4


def test_holding_a_steps_tokens_in_one_call_is_holding_them_in_turn() -> None:
    keys = [bytes([i % 3, i]) for i in range(8)]  # 8, 16 or 24 bytes each
    holds = [("t1", [*keys[:3], b"\0gone"]), ("t2", keys[2:6]), ("t1", keys[5:])]
    one_call, in_turn = (ChunkCache(1 << 16, align=8, budget=96, clock=Clock()) for _ in "ab")
    for cache in (one_call, in_turn):
        commit(cache, keys)
    lost = one_call.hold_tokens(NS, "s1", holds, account=ENGINE)
    lost_in_turn = [
        key for token, held in holds for key in in_turn.hold(NS, "s1", token, held, account=ENGINE)
    ]
    assert sorted(lost) == sorted(lost_in_turn)
    assert lost[0] == b"\0gone"  # the missing key first, then those beyond the budget
    assert len(lost) > 1  # the budget (96 bytes) refused some
    assert protected_sum(one_call, "s1") == protected_sum(in_turn, "s1") <= 96
    assert one_call._guards.holds == in_turn._guards.holds
    assert one_call.stats().held == in_turn.stats().held

"""The pure parts of issue 15: tenants from the kernel's identity, limits, protected bytes,
and the registry's rules about who may join or replace what."""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec
import pytest

from offloadd.cache.index import ChunkCache
from offloadd.server.connections import Tally, nofile_problem
from offloadd.server.limits import Limits, cache_bounds
from offloadd.server.peers import REMOTE, Peer
from offloadd.server.registry import RegistrationError, Registry
from offloadd.server.tenancy import Tenancy, Viewer
from offloadd.settings import LimitsSettings, TenancySettings
from protocol.errors import ErrorCode
from protocol.handles import CanonicalPage, KVRegion, ShmHandle
from protocol.messages import (
    DaemonStats,
    EngineState,
    HoldKeys,
    Lookup,
    Reserve,
    StepJobs,
    Store,
    TierState,
    UpdateHolds,
)
from tests.fakes import Clock
from tests.helpers import hello

A, B = Peer(1001, 1001, 10), Peer(1002, 1002, 20)
GROUPS = {"shared": 500}


def tenancy(**settings: object) -> Tenancy:
    return Tenancy(
        TenancySettings(**settings),  # type: ignore[arg-type]
        daemon_uid=999,
        gid_of=GROUPS.__getitem__,
    )


# ---------------------------------------------------------------- tenancy


def test_every_uid_is_its_own_tenant_by_default() -> None:
    plain = tenancy()
    assert plain.tenant_of(A) == "u1001" != plain.tenant_of(B)
    assert plain.tenant_of(REMOTE) == "remote"
    assert (
        tenancy(share_across_uids=True).tenant_of(A)
        == "*"
        == tenancy(share_across_uids=True).tenant_of(B)
    )
    assert tenancy(share_across_uids=True).tenant_of(REMOTE) == "remote"


def test_a_shared_group_counts_by_the_primary_gid() -> None:
    grouped = tenancy(shared_groups=("shared",))
    assert grouped.tenant_of(Peer(1001, 500, 1)) == "g500" == grouped.tenant_of(Peer(1002, 500, 2))
    assert grouped.tenant_of(Peer(1003, 1003, 3)) == "u1003"


def test_a_uid_range_names_its_tenant_before_every_other_rule() -> None:
    ranges = {"team-a": ["41000-41999"], "team-b": ["42000-42099", "43000-43000"]}
    ranged = tenancy(uid_ranges=ranges, shared_groups=("shared",), share_across_uids=False)
    assert ranged.tenant_of(Peer(41000, 500, 1)) == "team-a" == ranged.tenant_of(Peer(41999, 7, 2))
    assert (
        ranged.tenant_of(Peer(42050, 42050, 3)) == "team-b" == ranged.tenant_of(Peer(43000, 1, 4))
    )
    assert ranged.tenant_of(Peer(42100, 42100, 5)) == "u42100"  # between two ranges
    assert ranged.tenant_of(Peer(40999, 500, 6)) == "g500"  # outside: the other rules
    assert ranged.tenant_of(REMOTE) == "remote"
    everyone = tenancy(uid_ranges=ranges, share_across_uids=True)
    assert everyone.tenant_of(Peer(41000, 1, 1)) == "team-a"
    assert everyone.tenant_of(Peer(1000, 1, 1)) == "*"
    assert [ranged.range_of(uid) for uid in (0, 999, 41000, 42099, 42100, 2**32 - 2)] == [
        "", "", "team-a", "team-b", "", ""
    ]  # fmt: skip


def test_uid_ranges_only_admits_the_ranges_engines_alone() -> None:
    ranges = {"team-a": ["41000-41999"]}
    assert tenancy(uid_ranges=ranges).hello_problem(Peer(1000, 1000, 1)) == ""
    strict = tenancy(uid_ranges=ranges, uid_ranges_only=True)
    assert strict.hello_problem(Peer(41000, 10001, 1)) == ""
    assert strict.hello_problem(REMOTE) == ""  # a tcp endpoint's peers: its own tenant
    assert strict.hello_problem(Peer(1000, 1000, 1)).startswith(
        "uid 1000 is in none of tenancy.uid_ranges"
    )
    assert strict.hello_problem(Peer(0, 0, 1)).startswith("uid 0 (root) is in none")
    daemon = strict.hello_problem(Peer(999, 999, 1))
    assert daemon.startswith("uid 999 (the daemon's own user) is in none")
    assert strict.is_admin(Peer(999, 999, 1))  # still reads stats and lists the cache


def test_root_and_the_daemons_user_are_admins() -> None:
    plain = tenancy()
    assert plain.is_admin(Peer(0, 0, 1)) and plain.is_admin(Peer(999, 999, 1))
    assert not plain.is_admin(A) and not plain.is_admin(REMOTE)


def test_client_topics_only_when_allowed() -> None:
    assert tenancy().topic_problem("", "kv@pod@m") == ""
    assert tenancy().topic_problem("kv@pod@m", "kv@pod@m") == ""
    assert "client_topics" in tenancy().topic_problem("kv@other@m", "kv@pod@m")
    assert tenancy(client_topics=True).topic_problem("kv@other@m", "kv@pod@m") == ""


def _stats(*engines: str) -> DaemonStats:
    return DaemonStats(
        uptime_seconds=1.0, capacity_bytes=1, used_bytes=0, entries=0, committed_entries=0,
        lookups=0, hits=0, misses=0, stores_refused=0, evictions=0, bytes_stored=0,
        bytes_loaded=0, protocol_errors=0, sessions=len(engines),
        engines=[EngineState(e, 0, 1, True, [0]) for e in engines],
    )  # fmt: skip


def test_stats_list_the_engines_a_viewer_may_see() -> None:
    owners = {"a1": "u1001", "a2": "u1001", "b1": "u1002"}

    def tenant_of(engine: EngineState) -> str:
        return owners[engine.engine_id]

    stats = _stats("a1", "a2", "b1")

    def seen(viewer: Viewer | None) -> list[str]:
        return [e.engine_id for e in Tenancy.visible_stats(stats, viewer, tenant_of).engines]

    assert seen(Viewer("u1001")) == ["a1", "a2"]
    assert seen(Viewer("u1002")) == ["b1"]
    assert seen(Viewer("u1003", admin=True)) == ["a1", "a2", "b1"]
    assert seen(None) == []


# What anyone who may ask sees: nothing a tenant did (``engines`` are then the asker's own).
_NO_TENANTS = {
    "uptime_seconds", "capacity_bytes", "events_endpoint", "events_replay_endpoint",
    "copy_path", "version", "pid", "arena", "copy_engine", "engines", "tiers", "counters",
}  # fmt: skip


def test_only_admins_see_the_node_wide_counters() -> None:
    tier = TierState("disk", 100, 50, 5, True, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1.0, 2.0)
    busy = msgspec.structs.replace(
        _stats("a1", "b1"),
        **{
            info.name: 7
            for info in msgspec.structs.fields(DaemonStats)
            if info.type is int and info.name not in _NO_TENANTS
        },
        stores_refused_by_reason={"full": 3},
        tiers=[tier],
        version="1.2",
        pid=4242,
        capacity_bytes=1 << 30,
    )
    owners = {"a1": "u1001", "b1": "u1002"}
    admin = Tenancy.visible_stats(busy, Viewer("u0", admin=True), lambda e: owners[e.engine_id])
    assert admin == busy and admin.counters
    for viewer in (Viewer("u1001"), None):
        seen = Tenancy.visible_stats(busy, viewer, lambda e: owners[e.engine_id])
        assert not seen.counters
        assert (seen.version, seen.capacity_bytes, seen.pid) == ("1.2", 1 << 30, 4242)
        for info in msgspec.structs.fields(DaemonStats):
            if info.name not in _NO_TENANTS:
                assert not getattr(seen, info.name), info.name  # a counter of every tenant
        (shown,) = seen.tiers
        assert (shown.name, shown.capacity, shown.healthy) == ("disk", 100, True)
        assert msgspec.structs.astuple(shown)[2:] == (0, 0, True, *[0] * 9, 0.0, 0.0)
        assert [e.engine_id for e in seen.engines] == (["a1"] if viewer else [])


# ---------------------------------------------------------------- limits


def test_keys_are_bounded_in_number_and_length() -> None:
    limits = Limits(LimitsSettings(key_bytes=40, keys_per_request=3))
    assert limits.keys_problem([b"k" * 40] * 3) == ""
    assert "key_bytes" in limits.keys_problem([b"k" * 41])
    assert "keys_per_request" in limits.keys_problem([b"k"] * 4)


def test_leases_are_capped_and_must_be_numbers() -> None:
    limits = Limits(LimitsSettings(max_lease_seconds=60))
    assert limits.lease(0.0, 30.0) == 30.0  # the default
    assert limits.lease(1e12, 30.0) == 60.0
    assert limits.lease(math.inf, 30.0) == 60.0
    assert limits.lease(math.nan, 30.0) is None
    assert limits.lease(-1.0, 30.0) is None


def test_regions_and_sessions_per_user() -> None:
    limits = Limits(LimitsSettings(regions_per_session=2, sessions_per_uid=2))
    assert limits.session_problem(2, 1) == ""
    assert "regions_per_session" in limits.session_problem(3, 0)
    assert "sessions_per_uid" in limits.session_problem(1, 2)


def test_step_messages_are_bounded_in_lookups_jobs_and_keys() -> None:
    limits = Limits(LimitsSettings(lookups_per_message=2, jobs_per_message=2, keys_per_message=4))
    two = [Lookup(i, [b"k"]) for i in range(2)]
    assert limits.message_problem(Reserve(1, [b"k"], lookups=two, touch=[b"t"])) == ""
    assert "lookups_per_message = 2" in limits.message_problem(UpdateHolds(1, lookups=two * 2))
    # Keys count across every list and every nested lookup: 2 + 2 + 1 = 5.
    held = [HoldKeys("r1", [b"h", b"h"])]
    assert "keys_per_message = 4" in limits.message_problem(
        UpdateHolds(1, hold=held, lookups=two, touch=[b"t"])
    )
    store = Store(0, 1, [b"a", b"b"], [0, 1])
    assert limits.message_problem(StepJobs(1, [store, store])) == ""
    assert "jobs_per_message = 2" in limits.message_problem(StepJobs(1, [store] * 3))
    assert "keys_per_message" in limits.message_problem(
        StepJobs(1, [store, Store(0, 2, [b"c", b"d", b"e"], [2, 3, 4])])
    )
    assert limits.message_problem(Lookup(1, [b"k"] * 10)) == ""  # keys_per_request's job


def _canonical_region(fragments: int) -> KVRegion:
    runs = ((0, 0, 1, fragments, 1, 1),)  # 1-byte fragments tiling a page of ``fragments``
    page = CanonicalPage(fragments, runs)
    return KVRegion(ShmHandle("r", 0, fragments, fd=0), 1, fragments, fragments, ("l",), page)


def test_canonical_fragments_are_counted_before_they_are_walked() -> None:
    limits = Limits(LimitsSettings(fragments_per_page=8, fragments_per_hello=12))
    assert limits.fragments_problem([_canonical_region(8)]) == ""
    assert "fragments_per_page = 8" in limits.fragments_problem([_canonical_region(9)])
    both = limits.fragments_problem([_canonical_region(8), _canonical_region(8)])
    assert "regions 0-1" in both and "fragments_per_hello = 12" in both
    # The default bound costs a count, not a walk: 2**40 fragments are refused at once.
    assert "fragments_per_page" in Limits(LimitsSettings()).fragments_problem(
        [_canonical_region(1 << 40)]
    )


def test_connections_are_bounded_per_uid_and_per_socket() -> None:
    tally = Tally(per_socket=3, per_uid=2)
    assert tally.accepted(10, 1001) and tally.accepted(11, 1001)
    assert not tally.accepted(12, 1001) and "socket_connections_per_uid" in tally.problem(1001)
    assert tally.accepted(13, 1002)
    assert not tally.accepted(14, 1003) and "limits.socket_connections" in tally.problem(1003)
    tally.closed(12)  # the refused one, closed by libzmq: nothing counted
    tally.closed(10)
    assert tally.accepted(15, 1003)
    assert tally.accepted(11, 1003)  # fd 11 reused before its close was seen: B's is gone
    assert tally.counts == {1002: 1, 1003: 2}
    assert nofile_problem(3, 4096, 64, 65536) == ""
    assert "LimitNOFILE" in nofile_problem(3, 4096, 64, 16384)


def test_mapped_bytes_per_user() -> None:
    assert Limits(LimitsSettings(), memory=1 << 30).mapped_bytes == 1 << 30  # 0: the host's
    limits = Limits(LimitsSettings(mapped_bytes_per_uid=1 << 20), memory=1 << 30)
    assert limits.mapped_problem(1 << 20) == ""
    assert "limits.mapped_bytes_per_uid (1048576)" in limits.mapped_problem((1 << 20) + 1)


def test_the_cache_bounds_per_engine_and_per_tenant() -> None:
    default = cache_bounds(1000, LimitsSettings())
    assert default == {
        "budget": 500, "tenant_budget": 500, "reservation_lease": 5.0, "reservation_renewals": 3
    }  # fmt: skip
    tenant = cache_bounds(
        1000, LimitsSettings(protected_fraction=0.5, tenant_protected_fraction=0.75)
    )
    assert (tenant["budget"], tenant["tenant_budget"]) == (500, 750)


# ---------------------------------------------------------------- protected bytes

ENGINE, OTHER = ("e", 0), ("f", 0)


def sized(nbytes: int) -> Callable[[bytes], tuple[int, ...]]:
    return lambda _key: (nbytes,)


def cache_of(budget: int, clock: Clock, *keys_and_sizes: tuple[bytes, int]) -> ChunkCache:
    """A cache with ``budget`` per engine holding each key committed, with its size."""
    cache = ChunkCache(1 << 20, align=8, budget=budget, clock=clock)
    for key, nbytes in keys_and_sizes:
        res = cache.begin_store("ns", [key], 0, sized(nbytes))
        cache.finish_store(res.writes, ok=True)
    return cache


def used(cache: ChunkCache, engine: tuple[str, int]) -> int:
    return 100 - int(cache.room(engine))


def test_pins_beyond_the_budget_are_refused_and_leases_end() -> None:
    clock = Clock()
    cache = cache_of(100, clock, (b"a", 40), (b"b", 40), (b"c", 40))
    pinned = cache.lookup("ns", [b"a", b"b", b"c"], pin_owner="s1", lease=10, account=ENGINE)
    assert pinned.pinned == 2 and cache.get("ns", b"c").pins is None  # type: ignore[union-attr]
    assert used(cache, ENGINE) == 80
    # Pinning again what it holds costs nothing (the lease is extended).
    assert cache.lookup("ns", [b"a", b"b"], pin_owner="s1", lease=20, account=ENGINE).pinned == 2
    assert used(cache, OTHER) == 0  # per engine
    clock.now += 15  # past the first lease, within the second
    assert used(cache, ENGINE) == 80
    clock.now += 10
    assert used(cache, ENGINE) == 0
    assert cache.lookup("ns", [b"c"], pin_owner="s1", lease=10, account=ENGINE).pinned == 1


def test_released_pins_and_a_cleared_namespace_give_the_room_back() -> None:
    cache = cache_of(100, Clock(), (b"a", 40), (b"b", 40))
    cache.lookup("ns", [b"a", b"b"], pin_owner="s1", lease=10, account=ENGINE)
    cache.release("ns", [b"a"], "s1")
    assert used(cache, ENGINE) == 40
    cache.clear_namespace("ns")
    assert used(cache, ENGINE) == 0


def test_holds_count_like_the_cache_and_are_bounded() -> None:
    cache = cache_of(100, Clock(), (b"a", 60), (b"b", 60))
    assert cache.hold("ns", "s", "t1", [b"a", b"a"], account=ENGINE) == []
    assert used(cache, ENGINE) == 60  # one entry, held twice
    assert cache.hold("ns", "s", "t2", [b"b"], account=ENGINE) == [b"b"]
    cache.release_hold("s", "t1", [b"a"])
    assert used(cache, ENGINE) == 60  # one hold left
    cache.release_hold("s", "t1", [b"a"])
    assert used(cache, ENGINE) == 0


def test_reservations_end_on_commit_removal_or_the_sessions_end() -> None:
    cache = cache_of(100, Clock(), (b"d", 30))
    assert cache.room(ENGINE) == 100
    reserved = cache.reserve("ns", [b"a", b"b"], "sched", sized(30), account=ENGINE)
    assert reserved.reserved == [0, 1] and cache.room(ENGINE) == 40
    store = cache.begin_store("ns", [b"a"], 0, sized(30), allocate=False)
    cache.finish_store(store.writes, ok=True)  # committed: its reservation is over
    assert cache.room(ENGINE) == 70
    cache.remove("ns", [b"b"])  # the cache dropped it itself: counted no more
    assert cache.room(ENGINE) == 100
    cache.reserve("ns", [b"c"], "sched", sized(30), account=ENGINE)
    cache.lookup("ns", [b"d"], pin_owner="sched", lease=10, account=ENGINE)
    cache.release_reservations("sched")
    cache.release_owner("sched")
    assert cache.room(ENGINE) == 100


# ---------------------------------------------------------------- the registry


def test_a_session_is_replaced_only_by_the_same_uid() -> None:
    registry = Registry()
    registry.hello("s0", hello(rank=0, world_size=2), tenant="*", uid=1001)
    # Same tenant (every user shares), another uid: the rank is not taken over.
    with pytest.raises(RegistrationError) as refused:
        registry.hello("s9", hello(rank=0, world_size=2), tenant="*", uid=1002)
    assert refused.value.code == ErrorCode.NOT_PERMITTED
    # Nor is a session replaced by its routing id alone.
    with pytest.raises(RegistrationError):
        registry.hello("s0", hello(rank=1, world_size=2), tenant="*", uid=1002)
    # Another uid of the tenant may be another rank of the engine; the owner may replace.
    registry.hello("s1", hello(rank=1, world_size=2), tenant="*", uid=1002)
    outcome = registry.hello("s5", hello(rank=0, world_size=2), tenant="*", uid=1001)
    assert [old.session_id for old in outcome.replaced] == ["s0"]


def test_an_engine_belongs_to_its_tenant() -> None:
    registry = Registry()
    registry.hello("s0", hello(rank=0, world_size=2), tenant="u1001", uid=1001)
    with pytest.raises(RegistrationError, match="belongs to another user") as refused:
        registry.hello("s1", hello(rank=1, world_size=2), tenant="u1002", uid=1002)
    assert refused.value.code == ErrorCode.NOT_PERMITTED
    scheduler = hello(role="scheduler", world_size=2)
    with pytest.raises(RegistrationError, match="belongs to another user"):
        registry.hello("s2", scheduler, tenant="u1002", uid=1002)


def _namespace(tenant: str, uid: int, engine_id: str, *, private: bool = False) -> str:
    registry = Registry()
    extra = {"private_cache": True} if private else None
    outcome = registry.hello(
        "s", hello(rank=0, world_size=1, engine_id=engine_id, extra=extra), tenant=tenant, uid=uid
    )
    assert outcome.engine.namespace is not None
    return outcome.engine.namespace.name


def test_namespaces_are_per_tenant_and_private_ones_per_uid() -> None:
    assert _namespace("u1001", 1001, "e1") == _namespace("u1001", 1001, "e2")
    assert _namespace("u1001", 1001, "e1") != _namespace("u1002", 1002, "e1")
    assert _namespace("*", 1001, "e1") == _namespace("*", 1002, "e2")
    private = _namespace("*", 1001, "e1", private=True)
    assert private != _namespace("*", 1002, "e1", private=True)
    assert private != _namespace("*", 1001, "e2", private=True)

"""offloadd.server.registry: handshakes, agreement checks, sessions, readiness and namespaces.

The registry never opens a handle, so regions name shm paths that do not exist.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from offloadd.server.registry import (
    Engine,
    RegistrationError,
    Registry,
    group_of_key,
)
from protocol.config import (
    OffloadingConfig,
)
from protocol.errors import ErrorCode
from protocol.handles import KVRegion
from protocol.messages import Hello
from tests.helpers import (
    LAYERS,
    NUM_BLOCKS,
    PAGE,
    STRIDE,
    config,
    hello,
    region,
    register_engine,
)


def engine_of(reg: Registry, engine_id: str = "engine-a", dp: int = 0) -> Engine:
    engine = reg.engine((engine_id, dp))
    assert engine is not None
    return engine


def refused(reg: Registry, session_id: str, message: Hello) -> RegistrationError:
    with pytest.raises(RegistrationError) as info:
        reg.hello(session_id, message)
    return info.value


def snapshot(reg: Registry) -> tuple[Any, ...]:
    """What a refused Hello must leave untouched."""
    return (
        len(reg),
        sorted(
            (
                e.key,
                e.ready,
                tuple(sorted((r, s.session_id) for r, s in e.workers.items())),
                tuple(sorted(e.schedulers)),
                e.namespace.name if e.namespace else None,
            )
            for e in reg.engines()
        ),
        sorted((ns.name, tuple(sorted(ns.engines))) for ns in reg.namespaces()),
    )


# --- readiness ----------------------------------------------------------------------------


def test_engine_is_ready_only_when_every_rank_said_hello() -> None:
    reg = Registry()
    outcomes = [reg.hello(f"s{rank}", hello(rank=rank, world_size=3, dp=2)) for rank in (2, 0, 1)]
    assert [o.became_ready for o in outcomes] == [False, False, True]
    engine = engine_of(reg, dp=2)
    assert all(o.engine is engine for o in outcomes)
    assert engine.ready
    assert engine.missing_ranks() == []
    assert len(reg) == 3
    assert reg.session("s2") is outcomes[0].session
    assert outcomes[0].session.rank == 2
    assert outcomes[0].session.device_uuid == "GPU-2"
    assert outcomes[0].session.pid == 1002
    assert outcomes[0].session.num_blocks == NUM_BLOCKS


def test_engine_state_before_and_after_ready() -> None:
    reg = Registry()
    first = reg.hello("s1", hello(rank=1, world_size=2, dp=3))
    state = first.engine.state()
    assert state.engine_id == "engine-a"
    assert state.data_parallel_index == 3
    assert state.world_size == 2
    assert state.ready is False
    assert state.ranks_present == [1]
    assert state.namespace == ""
    assert state.schedulers == 0
    assert first.engine.missing_ranks() == [0]

    reg.hello("sched", hello(rank=0, world_size=2, dp=3, role="scheduler"))
    reg.hello("s0", hello(rank=0, world_size=2, dp=3))
    state = engine_of(reg, dp=3).state()
    assert state.ready is True
    assert state.ranks_present == [0, 1]
    assert state.schedulers == 1
    assert state.namespace != ""
    assert state.namespace == engine_of(reg, dp=3).namespace.name  # type: ignore[union-attr]
    assert state.namespace.startswith("org/model@")


def test_became_ready_is_reported_once() -> None:
    reg = Registry()
    outcomes = register_engine(reg, world_size=4)
    assert [o.became_ready for o in outcomes] == [False, False, False, True]
    # A scheduler arriving at a ready engine does not make it "become" ready again.
    late = reg.hello("sched", hello(rank=0, world_size=4, role="scheduler"))
    assert late.became_ready is False
    assert late.engine.ready


def test_world_size_one_is_ready_at_once() -> None:
    reg = Registry()
    outcome = reg.hello("solo", hello(rank=0, world_size=1))
    assert outcome.became_ready
    assert outcome.engine.namespace is not None
    assert len(reg.namespaces()) == 1


# --- config agreement ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "path", "ours", "theirs"),
    [
        ({"dtype": "fp8"}, "model.dtype", "'bfloat16'", "'fp8'"),
        ({"model": "org/other"}, "model.name", "'org/model'", "'org/other'"),
        ({"world_size": 4}, "parallel.world_size", "2", "4"),
        ({"tokens_per_hash": 32}, "cache.tokens_per_hash", "16", "32"),
        ({"blocks_per_chunk": 4}, "cache.blocks_per_chunk", "2", "4"),
        ({"tokens_per_block": 32}, "groups[0].tokens_per_block", "16", "32"),
        ({"extra": {"namespace": "x"}}, "extra_config", "{}", "{'namespace': 'x'}"),
        ({"replicated": True}, "replicated_layout", "False", "True"),
    ],
)
def test_disagreeing_rank_is_refused_naming_the_field_and_both_values(
    override: dict[str, Any], path: str, ours: str, theirs: str
) -> None:
    reg = Registry()
    reg.hello("s0", hello(rank=0, world_size=2))
    before = snapshot(reg)
    cfg_overrides = {"rank": 1, "world_size": 2, **override}
    error = refused(reg, "s1", hello(**cfg_overrides))
    assert error.code == ErrorCode.CONFIG_MISMATCH
    message = str(error)
    assert message.startswith(f"{path}:")
    assert f"has {ours}" in message
    assert f"sent {theirs}" in message
    assert snapshot(reg) == before
    assert reg.session("s1") is None
    assert engine_of(reg).missing_ranks() == [1]


def test_disagreeing_rank_does_not_disturb_a_ready_engine() -> None:
    reg = Registry()
    register_engine(reg)
    engine = engine_of(reg)
    old_rank1 = engine.workers[1]
    before = snapshot(reg)
    # Rank 1 again, under a new session id, with another dtype: must not replace the old one.
    error = refused(reg, "intruder", hello(rank=1, world_size=2, dtype="fp8"))
    assert error.code == ErrorCode.CONFIG_MISMATCH
    assert "model.dtype" in str(error)
    assert snapshot(reg) == before
    assert engine.ready
    assert engine.workers[1] is old_rank1
    assert reg.session("s1") is old_rank1
    assert engine.namespace is not None


def test_same_session_rehello_with_a_bad_config_keeps_the_old_session() -> None:
    reg = Registry()
    register_engine(reg)
    before = snapshot(reg)
    error = refused(reg, "s1", hello(rank=1, world_size=2, tokens_per_hash=8))
    assert "cache.tokens_per_hash" in str(error)
    assert snapshot(reg) == before


def test_layer_names_must_agree_without_pipeline_parallelism() -> None:
    reg = Registry()
    reg.hello("s0", hello(rank=0, world_size=2))
    error = refused(reg, "s1", hello(rank=1, world_size=2, groups=(("layer.0", "layer.9"),)))
    assert error.code == ErrorCode.CONFIG_MISMATCH
    assert str(error).startswith("groups[0].layer_names:")


# --- geometry -----------------------------------------------------------------------------


def test_regions_must_add_up_to_worker_kv_bytes_per_block() -> None:
    reg = Registry()
    error = refused(reg, "s0", hello(worker_kv_bytes_per_block=3 * STRIDE))
    assert error.code == ErrorCode.BAD_GEOMETRY
    assert "worker_kv_bytes_per_block" in str(error)
    assert str(3 * STRIDE) in str(error)
    assert str(2 * STRIDE) in str(error)
    assert len(reg) == 0


def test_worker_kv_bytes_per_block_counts_strides_not_pages() -> None:
    reg = Registry()
    cfg = config(worker_kv_bytes_per_block=2 * 96)
    padded = tuple(region((name,), page=PAGE, stride=96) for name in LAYERS)
    reg.hello("s0", hello(cfg, padded))
    assert len(reg) == 1


def test_num_blocks_must_agree_between_ranks() -> None:
    reg = Registry()
    reg.hello("s0", hello(rank=0, world_size=2))
    cfg = config(rank=1, world_size=2)
    fewer = tuple(region((name,), num_blocks=NUM_BLOCKS - 1) for name in LAYERS)
    before = snapshot(reg)
    error = refused(reg, "s1", hello(cfg, fewer))
    assert error.code == ErrorCode.CONFIG_MISMATCH
    assert str(error).startswith("num_blocks:")
    assert str(NUM_BLOCKS) in str(error)
    assert str(NUM_BLOCKS - 1) in str(error)
    assert snapshot(reg) == before


def _padded(page: int) -> tuple[KVRegion, ...]:
    # Same stride (so the same worker_kv_bytes_per_block), different page.
    return tuple(region((name,), page=page, stride=128) for name in LAYERS)


def test_page_sizes_must_agree_between_tensor_parallel_ranks() -> None:
    reg = Registry()
    reg.hello("s0", hello(config(rank=0, worker_kv_bytes_per_block=256), _padded(64)))
    before = snapshot(reg)
    error = refused(reg, "s1", hello(config(rank=1, worker_kv_bytes_per_block=256), _padded(96)))
    assert error.code == ErrorCode.CONFIG_MISMATCH
    assert str(error).startswith("geometry:")
    assert "64" in str(error)
    assert "96" in str(error)
    assert snapshot(reg) == before


def test_worker_bytes_must_agree_between_tensor_parallel_ranks() -> None:
    reg = Registry()
    reg.hello("s0", hello(rank=0, world_size=2))
    cfg = config(rank=1, world_size=2, worker_kv_bytes_per_block=2 * 128)
    error = refused(reg, "s1", hello(cfg, tuple(region((n,), page=128) for n in LAYERS)))
    assert error.code == ErrorCode.CONFIG_MISMATCH
    assert "worker_kv_bytes_per_block" in str(error)


def test_pipeline_stages_may_differ_in_pages_and_layers() -> None:
    reg = Registry()
    stage0 = config(
        rank=0, pp_size=2, tp_size=1, groups=(("layer.0",),), worker_kv_bytes_per_block=64
    )
    stage1 = config(
        rank=1, pp_size=2, tp_size=1, groups=(("layer.1",),), worker_kv_bytes_per_block=256
    )
    reg.hello("s0", hello(stage0, (region(("layer.0",), page=64),)))
    outcome = reg.hello("s1", hello(stage1, (region(("layer.1",), page=128, stride=256),)))
    assert outcome.became_ready
    namespace = outcome.engine.namespace
    assert namespace is not None
    # One shard per rank, each of that rank's own size.
    assert namespace.shard_sizes == [(64 * 2, 128 * 2)]


def test_pipeline_stages_must_still_agree_on_num_blocks() -> None:
    reg = Registry()
    stage0 = config(
        rank=0, pp_size=2, tp_size=1, groups=(("layer.0",),), worker_kv_bytes_per_block=64
    )
    stage1 = config(
        rank=1, pp_size=2, tp_size=1, groups=(("layer.1",),), worker_kv_bytes_per_block=64
    )
    reg.hello("s0", hello(stage0, (region(("layer.0",)),)))
    error = refused(reg, "s1", hello(stage1, (region(("layer.1",), num_blocks=3),)))
    assert error.code == ErrorCode.CONFIG_MISMATCH
    assert "num_blocks" in str(error)


def _first_bad(**bad: Any) -> tuple[KVRegion, ...]:
    """Region 0 built with ``bad``; region 1 fine."""
    return (region(("layer.0",), **bad), region(("layer.1",)))


GEOMETRY = ErrorCode.BAD_GEOMETRY
BAD_CASES = {
    "stride below page": (
        {},
        _first_bad(page=64, stride=32),
        GEOMETRY,
        "block_stride=32 is smaller than page_size=64",
    ),
    "handle too small": (
        {},
        _first_bad(handle_size=NUM_BLOCKS * PAGE - 1),
        GEOMETRY,
        f"need {NUM_BLOCKS * PAGE} bytes but the handle spans {NUM_BLOCKS * PAGE - 1}",
    ),
    "negative handle offset": ({}, _first_bad(offset=-1), GEOMETRY, "must not be negative"),
    "negative num_blocks": ({}, _first_bad(num_blocks=-1), GEOMETRY, "num_blocks=-1"),
    "zero page": ({}, _first_bad(page=0), GEOMETRY, "page_size=0"),
    "unknown layer": (
        {},
        (region(("layer.0",)), region(("layer.x",))),
        GEOMETRY,
        "['layer.x']",
    ),
    "num_blocks differs between regions": (
        {},
        (region(("layer.0",)), region(("layer.1",), num_blocks=8)),
        GEOMETRY,
        "num_blocks differs between regions: 16, 8",
    ),
    "group without a region": (
        {"groups": (("layer.0",), ("layer.1",))},
        (region(("layer.0",), stride=128),),
        GEOMETRY,
        "no region holds a layer of group 1",
    ),
    "rank past world_size": ({"rank": 2}, None, ErrorCode.BAD_REQUEST, "parallel.rank=2"),
    "negative rank": ({"rank": -1}, None, ErrorCode.BAD_REQUEST, "parallel.rank=-1"),
    "zero world_size": (
        {"world_size": 0},
        None,
        ErrorCode.BAD_REQUEST,
        "parallel.world_size=0",
    ),
    "zero blocks_per_chunk": (
        {"blocks_per_chunk": 0},
        None,
        ErrorCode.BAD_REQUEST,
        "cache.blocks_per_chunk=0",
    ),
}


@pytest.mark.parametrize(
    ("cfg_overrides", "regions", "code", "fragment"),
    list(BAD_CASES.values()),
    ids=list(BAD_CASES),
)
def test_bad_geometry_or_identity_is_refused(
    cfg_overrides: dict[str, Any],
    regions: tuple[KVRegion, ...] | None,
    code: ErrorCode,
    fragment: str,
) -> None:
    reg = Registry()
    reg.hello("other", hello(engine_id="engine-b", rank=0, world_size=1))
    before = snapshot(reg)
    error = refused(reg, "s0", hello(config(**cfg_overrides), regions))
    assert error.code == code
    assert fragment in str(error)
    assert snapshot(reg) == before
    assert reg.engine(("engine-a", 0)) is None


# --- replacing sessions -------------------------------------------------------------------


def test_rank_rehello_with_a_new_session_replaces_the_old_one() -> None:
    reg = Registry()
    register_engine(reg)
    old = reg.session("s1")
    assert old is not None
    outcome = reg.hello("s1-restarted", hello(rank=1, world_size=2))
    assert outcome.replaced == [old]
    assert reg.session("s1") is None
    assert reg.session("s1-restarted") is outcome.session
    assert len(reg) == 2
    engine = engine_of(reg)
    assert engine.workers[1] is outcome.session
    assert engine.ready
    assert engine.namespace is not None
    assert {s.session_id for s in engine.sessions()} == {"s0", "s1-restarted"}


def test_same_session_rehello_replaces_itself() -> None:
    reg = Registry()
    first = reg.hello("s0", hello(rank=0, world_size=2))
    second = reg.hello("s0", hello(rank=0, world_size=2))
    assert second.replaced == [first.session]
    assert second.session is not first.session
    assert reg.session("s0") is second.session
    assert len(reg) == 1
    assert engine_of(reg).workers == {0: second.session}


def test_session_that_changes_rank_frees_its_old_rank() -> None:
    reg = Registry()
    reg.hello("a", hello(rank=0, world_size=2))
    reg.hello("b", hello(rank=1, world_size=2))
    outcome = reg.hello("a", hello(rank=1, world_size=2))
    assert {s.session_id for s in outcome.replaced} == {"a", "b"}
    assert engine_of(reg).workers == {1: outcome.session}
    assert engine_of(reg).missing_ranks() == [0]
    assert reg.session("b") is None


def test_only_session_may_rehello_with_a_new_config() -> None:
    # Nothing else holds the engine, so the restarted rank defines it afresh.
    reg = Registry()
    reg.hello("s0", hello(rank=0, world_size=2))
    outcome = reg.hello("s0", hello(rank=0, world_size=1, dtype="fp8"))
    assert outcome.became_ready
    assert outcome.engine.config.model.dtype == "fp8"
    assert outcome.engine.world_size == 1


# --- schedulers ---------------------------------------------------------------------------


def test_scheduler_registers_without_regions() -> None:
    reg = Registry()
    outcome = reg.hello("sched", hello(rank=0, world_size=2, role="scheduler"))
    assert outcome.session.role == "scheduler"
    assert outcome.session.regions == ()
    assert outcome.session.layouts == []
    assert outcome.became_ready is False
    engine = outcome.engine
    assert engine.schedulers == {"sched": outcome.session}
    assert engine.workers == {}
    assert engine.state().schedulers == 1
    assert engine.missing_ranks() == [0, 1]
    # Workers that agree with the scheduler complete the engine.
    outcomes = register_engine(reg)
    assert outcomes[-1].became_ready
    assert engine_of(reg) is engine
    assert engine.state().schedulers == 1


def test_scheduler_with_regions_is_refused() -> None:
    reg = Registry()
    error = refused(reg, "sched", hello(config(), (region(("layer.0",)),), role="scheduler"))
    assert error.code == ErrorCode.BAD_REQUEST
    assert "scheduler" in str(error)
    assert len(reg) == 0


def test_scheduler_with_a_disagreeing_config_is_refused() -> None:
    reg = Registry()
    register_engine(reg)
    before = snapshot(reg)
    error = refused(reg, "sched", hello(rank=0, world_size=2, dtype="fp8", role="scheduler"))
    assert error.code == ErrorCode.CONFIG_MISMATCH
    assert "model.dtype" in str(error)
    assert "scheduler" in str(error)
    assert snapshot(reg) == before


def test_two_schedulers_coexist_and_do_not_replace_each_other() -> None:
    reg = Registry()
    reg.hello("sched-a", hello(rank=0, world_size=2, role="scheduler"))
    outcome = reg.hello("sched-b", hello(rank=0, world_size=2, role="scheduler"))
    assert outcome.replaced == []
    assert set(outcome.engine.schedulers) == {"sched-a", "sched-b"}


# --- removal ------------------------------------------------------------------------------


def test_removing_the_last_session_drops_the_engine() -> None:
    reg = Registry()
    reg.hello("s0", hello(rank=0, world_size=1))
    reg.hello("sched", hello(rank=0, world_size=1, role="scheduler"))
    first = reg.remove("s0")
    assert first is not None
    assert first.was_ready is True
    assert first.engine_dropped is False
    assert reg.engine(("engine-a", 0)) is not None
    last = reg.remove("sched")
    assert last is not None
    assert last.engine_dropped is True
    assert reg.engine(("engine-a", 0)) is None
    assert reg.engines() == []
    assert reg.namespaces() == []
    assert len(reg) == 0
    assert reg.remove("sched") is None
    assert reg.remove("never-seen") is None


def test_removing_a_rank_makes_a_ready_engine_wait_for_it() -> None:
    reg = Registry()
    register_engine(reg, world_size=3)
    engine = engine_of(reg)
    outcome = reg.remove("s1")
    assert outcome is not None
    assert outcome.session.session_id == "s1"
    assert outcome.engine is engine
    assert outcome.was_ready is True
    assert outcome.engine_dropped is False
    assert engine.ready is False
    assert engine.missing_ranks() == [1]
    assert engine.state().ranks_present == [0, 2]
    assert engine.namespace is None
    assert engine.state().namespace == ""
    assert reg.namespaces() == []
    # The rank comes back: ready again, same namespace name as before.
    back = reg.hello("s1-again", hello(rank=1, world_size=3))
    assert back.became_ready


def test_a_replaced_session_removed_later_does_not_evict_its_successor() -> None:
    reg = Registry()
    register_engine(reg)
    reg.hello("s1-new", hello(rank=1, world_size=2))
    assert reg.remove("s1") is None  # already forgotten when it was replaced
    assert engine_of(reg).ready


# --- namespaces ---------------------------------------------------------------------------


def _namespace(reg: Registry, engine_id: str, dp: int = 0) -> str:
    namespace = engine_of(reg, engine_id, dp).namespace
    assert namespace is not None
    return namespace.name


def test_engines_of_one_model_and_layout_share_a_namespace() -> None:
    reg = Registry()
    register_engine(reg, prefix="a", engine_id="engine-a", dp=0)
    register_engine(reg, prefix="b", engine_id="engine-b", dp=1)
    assert _namespace(reg, "engine-a", 0) == _namespace(reg, "engine-b", 1)
    (namespace,) = reg.namespaces()
    assert namespace.engines == {("engine-a", 0), ("engine-b", 1)}
    # The namespace outlives one of its engines.
    reg.remove("a0")
    assert namespace.engines == {("engine-b", 1)}
    assert reg.namespaces() == [namespace]


def test_namespace_does_not_depend_on_tuning_fields() -> None:
    reg = Registry()
    register_engine(reg, prefix="a", engine_id="engine-a")
    for rank in range(2):
        cfg = msgspec.structs.replace(
            config(engine_id="engine-b", rank=rank, extra={"offload_threads": 4}),
            enable_kv_cache_events=False,
            num_cpu_blocks=1000,
        )
        reg.hello(f"b{rank}", hello(cfg))
    assert _namespace(reg, "engine-a") == _namespace(reg, "engine-b")


@pytest.mark.parametrize(
    "override",
    [
        {"model": "org/other"},
        {"dtype": "fp8"},
        {"tokens_per_hash": 8},
        {"blocks_per_chunk": 4},
        {"extra": {"namespace": "tenant-1"}},
        {"extra": {"kv_cache_layout": "HND"}},
        {"replicated": True},
        {"world_size": 1},
    ],
)
def test_a_different_model_or_layout_gets_its_own_namespace(override: dict[str, Any]) -> None:
    reg = Registry()
    register_engine(reg, prefix="a", engine_id="engine-a")
    register_engine(reg, prefix="b", engine_id="engine-b", **override)
    assert _namespace(reg, "engine-a") != _namespace(reg, "engine-b")
    assert len(reg.namespaces()) == 2


def test_a_different_page_size_gets_its_own_namespace() -> None:
    reg = Registry()
    register_engine(reg, prefix="a", engine_id="engine-a")
    for rank in range(2):
        cfg = config(engine_id="engine-b", rank=rank, worker_kv_bytes_per_block=2 * 128)
        reg.hello(f"b{rank}", hello(cfg, tuple(region((n,), page=128) for n in LAYERS)))
    assert engine_of(reg, "engine-b").ready
    assert _namespace(reg, "engine-a") != _namespace(reg, "engine-b")


def test_same_salt_shares_and_private_cache_never_shares() -> None:
    reg = Registry()
    salt = {"namespace": "tenant-1"}
    register_engine(reg, prefix="a", engine_id="engine-a", extra=salt)
    register_engine(reg, prefix="b", engine_id="engine-b", extra=salt)
    assert _namespace(reg, "engine-a") == _namespace(reg, "engine-b")
    private = {"private_cache": True}
    register_engine(reg, prefix="c", engine_id="engine-c", extra=private)
    register_engine(reg, prefix="d", engine_id="engine-d", extra=private)
    names = {_namespace(reg, e) for e in ("engine-a", "engine-c", "engine-d")}
    assert len(names) == 3


def test_private_cache_differs_per_dp_index() -> None:
    reg = Registry()
    private = {"private_cache": True}
    register_engine(reg, prefix="a", dp=0, extra=private)
    register_engine(reg, prefix="b", dp=1, extra=private)
    assert _namespace(reg, "engine-a", 0) != _namespace(reg, "engine-a", 1)


def test_pipeline_namespace_does_not_depend_on_arrival_order() -> None:
    def stage(engine_id: str, rank: int) -> Hello:
        layer = LAYERS[rank]
        cfg = config(
            engine_id=engine_id,
            rank=rank,
            pp_size=2,
            tp_size=1,
            groups=((layer,),),
            worker_kv_bytes_per_block=64,
        )
        return hello(cfg, (region((layer,)),))

    reg = Registry()
    reg.hello("a0", stage("engine-a", 0))
    reg.hello("a1", stage("engine-a", 1))
    reg.hello("b1", stage("engine-b", 1))
    reg.hello("b0", stage("engine-b", 0))
    assert _namespace(reg, "engine-a") == _namespace(reg, "engine-b")


def _tenant_engine(reg: Registry, engine_id: str, tenant: str, **overrides: Any) -> str:
    """A two-rank engine of ``tenant`` (as the kernel says): its namespace."""
    for rank in range(2):
        message = hello(engine_id=engine_id, rank=rank, **overrides)
        reg.hello(f"{engine_id}-{rank}", message, tenant=tenant, uid=int(tenant[1:]))
    return _namespace(reg, engine_id)


def test_a_cluster_tenant_names_its_namespaces_alike_on_every_node() -> None:
    # alice is uid 1000 on one node and uid 1005 on another; bob is uid 1000 elsewhere.
    node_a = Registry(cluster_tenants={"u1000": "alice", "u1001": "bob"})
    node_b = Registry(cluster_tenants={"u1005": "alice"})
    node_c = Registry(cluster_tenants={"u1000": "bob"})
    unnamed = Registry()
    alice_a = _tenant_engine(node_a, "engine-a", "u1000")
    assert _tenant_engine(node_b, "engine-b", "u1005") == alice_a
    bob_c = _tenant_engine(node_c, "engine-c", "u1000")
    assert bob_c != alice_a
    assert _tenant_engine(node_a, "engine-e", "u1001") == bob_c
    plain = _tenant_engine(unnamed, "engine-d", "u1000")
    assert plain not in (alice_a, bob_c)
    # An unnamed tenant on a node with names keeps the namespace it has without them.
    assert _tenant_engine(node_b, "engine-f", "u1000") == plain
    assert node_a.tenant_of_namespace(alice_a) == "u1000"
    assert node_b.tenant_of_namespace(alice_a) == "u1005"


def test_the_tenant_of_a_namespace_outlives_its_engines_within_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("offloadd.server.registry.NAMESPACE_TENANTS", 2)
    reg = Registry()
    assert reg.tenant_of_namespace("model@0000000000000000") is None
    kept = _tenant_engine(reg, "engine-kept", "u1000", extra={"namespace": "kept"})
    left = []
    for index in range(4):
        engine_id = f"engine-{index}"
        left.append(
            _tenant_engine(reg, engine_id, f"u{2000 + index}", extra={"namespace": engine_id})
        )
        reg.remove(f"{engine_id}-0")
        reg.remove(f"{engine_id}-1")
        assert reg.namespace(left[-1]) is None  # its engine left; its chunks would stay
    # The namespace in use is never forgotten; of those left, the last two are remembered.
    assert reg.tenant_of_namespace(kept) == "u1000"
    assert [reg.tenant_of_namespace(name) for name in left] == [None, None, "u2002", "u2003"]


def test_namespace_survives_a_rank_restart() -> None:
    reg = Registry()
    register_engine(reg)
    name = _namespace(reg, "engine-a")
    reg.remove("s0")
    reg.hello("s0-again", hello(rank=0, world_size=2))
    assert _namespace(reg, "engine-a") == name


# --- shard sizes --------------------------------------------------------------------------

HYBRID_GROUPS = (("attn.0", "attn.1"), ("mamba.0",))


def _hybrid_hello(rank: int, *, replicated: bool = False) -> Hello:
    cfg = config(
        rank=rank,
        world_size=2,
        groups=HYBRID_GROUPS,
        blocks_per_chunk=3,
        worker_kv_bytes_per_block=48 + 80 + 200,
        replicated=replicated,
    )
    regions = (
        region(("attn.0",), page=48),
        region(("attn.1",), page=32, stride=80),
        region(("mamba.0",), page=200),
    )
    return hello(cfg, regions)


def test_shard_sizes_are_one_per_rank_per_group() -> None:
    reg = Registry()
    reg.hello("s0", _hybrid_hello(0))
    outcome = reg.hello("s1", _hybrid_hello(1))
    namespace = outcome.engine.namespace
    assert namespace is not None
    assert namespace.blocks_per_chunk == 3
    assert namespace.replicated is False
    # Pages, not strides: the padding of attn.1 is never stored.
    assert namespace.shard_sizes == [((48 + 32) * 3, (48 + 32) * 3), (200 * 3, 200 * 3)]
    key1 = b"\xab" * 8 + (1).to_bytes(4, "big")
    key0 = b"\xab" * 8 + (0).to_bytes(4, "big")
    assert namespace.shard_sizes_for_key(key1) == (600, 600)
    assert namespace.shard_sizes_for_key(key0) == (240, 240)


def test_replicated_layout_stores_a_single_shard() -> None:
    reg = Registry()
    reg.hello("s0", _hybrid_hello(0, replicated=True))
    outcome = reg.hello("s1", _hybrid_hello(1, replicated=True))
    namespace = outcome.engine.namespace
    assert namespace is not None
    assert namespace.replicated is True
    assert namespace.shard_sizes == [((48 + 32) * 3,), (200 * 3,)]


def test_session_layouts_map_groups_to_regions() -> None:
    reg = Registry()
    session = reg.hello("s0", _hybrid_hello(0)).session
    assert [layout.regions for layout in session.layouts] == [(0, 1), (2,)]
    assert [layout.pages for layout in session.layouts] == [(48, 32), (200,)]


@pytest.mark.parametrize(
    ("key", "group"),
    [
        (b"\x00" * 32 + b"\x00\x00\x00\x00", 0),
        (b"\xff" * 32 + b"\x00\x00\x00\x01", 1),
        (b"\x00" * 8 + b"\x00\x00\x01\x02", 258),
        (b"\x01\x02\x03\x04", 0x01020304),
        (b"\x00" * 8 + b"\xff\xff\xff\xff", 2**32 - 1),
    ],
)
def test_group_of_key_reads_the_last_four_bytes_big_endian(key: bytes, group: int) -> None:
    assert group_of_key(key) == group


# --- boundaries -----------------------------------------------------------------------------


def test_one_block_per_chunk_is_the_smallest_chunk() -> None:
    reg = Registry()
    outcomes = register_engine(reg, blocks_per_chunk=1)
    namespace = outcomes[-1].engine.namespace
    assert namespace is not None and namespace.blocks_per_chunk == 1
    assert namespace.shard_sizes == [(2 * PAGE, 2 * PAGE)]


def test_zero_worker_kv_bytes_per_block_skips_the_byte_count() -> None:
    # vLLM reports 0 when it has no blocks; the regions are then not added up.
    reg = Registry()
    outcomes = register_engine(reg, worker_kv_bytes_per_block=0)
    assert outcomes[-1].became_ready
    error = refused(Registry(), "s0", hello(rank=0, worker_kv_bytes_per_block=1))
    assert error.code == ErrorCode.BAD_GEOMETRY
    assert "worker_kv_bytes_per_block: the config says 1 but the regions hold 128" in str(error)


def _nested(depth: int, container: str) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value] if container == "list" else {"k": value}
    return value


@pytest.mark.parametrize("container", ["list", "dict"])
def test_extra_config_may_nest_32_levels_and_no_deeper(container: str) -> None:
    reg = Registry()
    # extra_config itself is the first level.
    assert register_engine(reg, extra={"deep": _nested(31, container)})[-1].became_ready
    error = refused(Registry(), "s0", hello(rank=0, extra={"deep": _nested(32, container)}))
    assert error.code == ErrorCode.BAD_REQUEST
    assert str(error) == "extra_config nests deeper than 32 levels"


def test_extra_config_lists_are_part_of_the_namespace() -> None:
    reg = Registry()
    register_engine(reg, prefix="a", engine_id="engine-a", extra={"namespace": "t", "l": [1, 2]})
    register_engine(reg, prefix="b", engine_id="engine-b", extra={"namespace": "t", "l": [2, 1]})
    register_engine(reg, prefix="c", engine_id="engine-c", extra={"namespace": "u", "l": [1, 2]})
    # Only the salt and the KV layout name a namespace; other keys are tuning knobs.
    assert _namespace(reg, "engine-a") == _namespace(reg, "engine-b")
    assert _namespace(reg, "engine-a") != _namespace(reg, "engine-c")


def test_namespace_name_is_stable_across_releases() -> None:
    # A changed name orphans every chunk a warm restart would find: change it on purpose only.
    reg = Registry()
    register_engine(reg)
    assert _namespace(reg, "engine-a") == "org/model@a82b8a2a9becbbf9"


def _with_dcp(cfg: OffloadingConfig, dcp: int) -> OffloadingConfig:
    parallel = msgspec.structs.replace(cfg.parallel, dcp_size=dcp)
    return msgspec.structs.replace(cfg, parallel=parallel)


def test_hybrid_engines_with_decode_context_parallelism() -> None:
    reg = Registry()
    for rank in range(2):
        base = _hybrid_hello(rank)
        reg.hello(f"d{rank}", msgspec.structs.replace(base, config=_with_dcp(base.config, 2)))
    engine = engine_of(reg)
    namespace = engine.namespace
    assert namespace is not None and engine.config.parallel.dcp_size == 2
    assert namespace.shard_sizes == [((48 + 32) * 3, (48 + 32) * 3), (200 * 3, 200 * 3)]
    # The same engine without dcp holds other bytes per chunk: another namespace.
    other = Registry()
    for rank in range(2):
        other.hello(f"s{rank}", _hybrid_hello(rank))
    assert _namespace(other, "engine-a") != namespace.name
    # A rank that disagrees on dcp is refused, naming the field.
    third = Registry()
    third.hello("s0", _hybrid_hello(0))
    base = _hybrid_hello(1)
    error = refused(third, "s1", msgspec.structs.replace(base, config=_with_dcp(base.config, 2)))
    assert error.code == ErrorCode.CONFIG_MISMATCH
    assert str(error).startswith("parallel.dcp_size: engine engine-a dp 0 has 1, worker rank 1")


def test_a_scheduler_from_the_same_process_replaces_its_old_session() -> None:
    reg = Registry()
    message = hello(rank=0, world_size=2, role="scheduler")
    first = reg.hello("sched-old", message, uid=1000, pid=4242)
    # Another process of the same user, and a peer whose pid the daemon cannot see (0), do not.
    assert reg.hello("sched-other", message, uid=1000, pid=4343).replaced == []
    assert reg.hello("sched-unseen", message, uid=1000, pid=0).replaced == []
    again = reg.hello("sched-new", message, uid=1000, pid=4242)
    assert again.replaced == [first.session]
    assert set(again.engine.schedulers) == {"sched-other", "sched-unseen", "sched-new"}
    assert reg.session("sched-old") is None
    # A scheduler of another engine in that process is not its predecessor.
    other_engine = hello(rank=0, world_size=2, role="scheduler", engine_id="engine-b")
    assert reg.hello("sched-b", other_engine, uid=1000, pid=4242).replaced == []

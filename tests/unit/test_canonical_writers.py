"""Who writes which canonical bytes (``offloadd.server.canonical``), and the registry's use of it.

Ranks whose runs cover the same canonical bytes are replicas (one of them writes each key);
ranks covering other bytes are other writers; anything else (bytes written from two places,
bytes nobody holds, a count vLLM disagrees with) is refused at registration.
"""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from offloadd.server.canonical import CanonicalMismatch, Role, canonical_plan, elected
from offloadd.server.registry import RegistrationError, Registry, elected_keys, store_part
from protocol.handles import CanonicalPage, KVRegion, ShmHandle
from protocol.messages import Hello
from tests.helpers import config, hello

P = 64  # a rank's page


def region(offset: int, writers: int, page_size: int = 2 * P) -> KVRegion:
    """A rank's region whose page lands at ``offset`` in a canonical page of ``page_size``."""
    page = CanonicalPage(page_size=page_size, runs=((0, offset, P, 1, P, P),), writers=writers)
    return KVRegion(
        handle=ShmHandle(path="/dev/shm/x", offset=0, size=16 * P),
        num_blocks=16,
        page_size=P,
        block_stride=P,
        layer_names=("l0",),
        canonical=page,
    )


def test_replicas_of_each_head_shard_are_grouped_in_canonical_order() -> None:
    # TP=4 over 2 KV heads: ranks 0, 1 hold head 0 (canonical [0, P)), ranks 2, 3 head 1.
    plan = canonical_plan({r: [region(P * (r // 2), 2)] for r in range(4)})
    assert plan.writers == 2
    assert [plan.roles[r] for r in range(4)] == [
        Role(0, 0, 2),
        Role(0, 1, 2),
        Role(1, 0, 2),
        Role(1, 1, 2),
    ]
    # Head shards listed out of rank order still get their canonical index.
    swapped = canonical_plan({0: [region(P, 1)], 1: [region(0, 1)]})
    assert (swapped.roles[0].writer, swapped.roles[1].writer) == (1, 0)


def test_one_replica_writes_each_key() -> None:
    roles = [Role(0, replica, 4) for replica in range(4)]
    keys = [hashlib.sha256(bytes([i])).digest() + bytes(4) for i in range(64)]
    writers = [[r for r, role in enumerate(roles) if elected(key, role)] for key in keys]
    assert all(len(who) == 1 for who in writers)
    assert {who[0] for who in writers} == {0, 1, 2, 3}  # writes rotate over the replicas
    assert all(elected(key, Role(1, 0, 1)) for key in keys)  # a lone rank writes every key


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([0, P // 2], "ranks 0 and 1 write overlapping canonical bytes"),
        ([0, 0], "vLLM says [1] ranks do"),  # replicas vLLM did not declare
    ],
)
def test_overlapping_or_undeclared_replicas_are_refused(offsets: list[int], message: str) -> None:
    with pytest.raises(CanonicalMismatch, match=message.replace("[", r"\[").replace("]", r"\]")):
        canonical_plan({r: [region(offset, 1)] for r, offset in enumerate(offsets)})


def test_gaps_and_inconsistent_replica_groups_are_refused() -> None:
    with pytest.raises(CanonicalMismatch, match=r"no rank holds canonical bytes \[64, 128\)"):
        canonical_plan({0: [region(0, 2)], 1: [region(0, 2)]})
    with pytest.raises(CanonicalMismatch, match=r"no rank holds canonical bytes \[0, 64\)"):
        canonical_plan({0: [region(P, 1)]})
    # Ranks 0 and 1 replicas in one region, not in the other.
    with pytest.raises(CanonicalMismatch, match="in region 0"):
        canonical_plan(
            {
                0: [region(0, 2, P), region(0, 1)],
                1: [region(0, 2, P), region(P, 1)],
            }
        )
    doubled = CanonicalPage(page_size=2 * P, runs=((0, 0, P // 2, 2, P // 2, 0),), writers=1)
    twice = KVRegion(
        handle=ShmHandle(path="/dev/shm/x", offset=0, size=16 * P),
        num_blocks=16,
        page_size=P,
        block_stride=P,
        layer_names=("l0",),
        canonical=doubled,
    )
    with pytest.raises(CanonicalMismatch, match="its runs write canonical byte 0 twice"):
        canonical_plan({0: [twice]})


def canonical_hello(rank: int, regions: list[KVRegion]) -> Hello:
    cfg = config(rank=rank, groups=(("l0",),), worker_kv_bytes_per_block=P)
    return hello(msgspec.structs.replace(cfg, canonical_layout=True), tuple(regions))


def test_the_registry_plans_writers_and_refuses_overlaps_when_the_last_rank_arrives() -> None:
    registry = Registry()
    registry.hello("s0", canonical_hello(0, [region(0, 2, P)]))
    outcome = registry.hello("s1", canonical_hello(1, [region(0, 2, P)]))
    engine = outcome.engine
    assert outcome.became_ready and engine.namespace is not None
    assert engine.namespace.writers == 1  # one canonical copy, whichever replica writes it
    assert engine.namespace.shard_sizes == [(2 * P,)]
    assert [store_part(engine, r) for r in (0, 1)] == [(0, 1), (0, 1)]
    keys = [hashlib.sha256(bytes([i])).digest() + bytes(4) for i in range(16)]
    mine = [elected_keys(engine, r, keys) for r in (0, 1)]
    assert sorted(mine[0] + mine[1]) == list(range(16))
    # An engine whose rank 1 overlaps rank 0's bytes never becomes ready.
    fresh = Registry()
    fresh.hello("s0", canonical_hello(0, [region(0, 1)]))
    with pytest.raises(RegistrationError, match="write overlapping canonical bytes"):
        fresh.hello("s1", canonical_hello(1, [region(P // 2, 1)]))
    (engine,) = fresh.engines()
    assert not engine.ready and engine.missing_ranks() == [1]


def test_canonical_under_prefill_context_parallelism_is_refused() -> None:
    cfg = config(rank=0, world_size=2, groups=(("l0",),), worker_kv_bytes_per_block=P)
    pcp = msgspec.structs.replace(cfg.parallel, tp_size=1, pcp_size=2)
    cfg = msgspec.structs.replace(cfg, canonical_layout=True, parallel=pcp)
    with pytest.raises(RegistrationError, match="under prefill context parallelism"):
        Registry().hello("s0", hello(cfg, (region(0, 1),)))

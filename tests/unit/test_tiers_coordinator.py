"""offloadd.server.tiers: write-through, probes, promotions and clears over a dict tier.

A real cache, arena (a small file in /dev/shm), registry, mirrors and announcer; the tier is
a dict that copies real bytes out of and into the arena (``DictTier``), the publishers a
recorder (the rig: ``tests.unit.tier_rig``). Each test runs its own event loop: the
coordinator's results come back to it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import pytest

from offloadd.cache.arena import Arena
from offloadd.server import storage
from offloadd.server import tiers as coordinator
from offloadd.server.storage import cluster_tenant_problems, tier_slots
from offloadd.settings import DiskSettings, MooncakeSettings, Settings, TenancySettings
from protocol.events import (
    LOCALITY_LOCAL,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockStored,
)
from tests.fakes import DictTier
from tests.unit.tier_rig import ARENA, CHUNK, events, keys_named, make_rig, until


@pytest.fixture
def arena() -> Iterator[Arena]:
    path = f"/dev/shm/od-test-tiers-{uuid.uuid4().hex[:8]}.arena"
    made = Arena(path, ARENA)
    yield made
    made.close()
    assert not os.path.exists(path)


def test_committed_chunks_are_written_through_and_their_readers_released(arena: Arena) -> None:
    async def main() -> None:
        rig = make_rig(arena)
        keys = keys_named(b"a", b"b", b"c")
        rig.store(keys)
        await until(lambda: rig.tiers.stats()[0].demotions == 3)
        for key in keys:
            assert rig.tier.chunks[(rig.namespace.name, key)] == rig.arena_bytes(key)
            entry = rig.cache.get(rig.namespace.name, key)
            assert entry is not None and entry.readers == 0
        # Announced as vLLM 0.33 announces a local storage tier's chunks.
        assert len(events(rig, BlockStored, MEDIUM_STORAGE, LOCALITY_LOCAL)) == 3
        assert rig.tiers.stats()[0].queued_bytes == 0
        assert await rig.tiers.drain(5.0) and rig.tier.closed

    asyncio.run(main())


def test_a_full_queue_holds_names_only_and_never_blocks(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coordinator, "BACKLOG_KEYS", 2)

    async def main() -> None:
        rig = make_rig(arena, queue_bytes=2 * CHUNK)
        rig.tier.gate.clear()  # the tier is slow: the first put waits
        keys = keys_named(b"a", b"b", b"c", b"d", b"e", b"f")
        for key in keys:
            rig.store([key])
        stats = rig.tiers.stats()[0]
        assert stats.queued_bytes == 2 * CHUNK
        assert stats.demotions_skipped == 2  # e and f: beyond the backlog of 2 names (c, d)
        # Queued chunks are held against eviction; the backlog holds nothing.
        held = [rig.cache.get(rig.namespace.name, k) for k in keys]
        assert [e.readers if e else None for e in held] == [1, 1, 0, 0, 0, 0]
        rig.evict(keys[3:4])  # d leaves the arena before its turn: skipped
        rig.tier.gate.set()
        await until(lambda: rig.tiers.stats()[0].demotions == 3)
        assert sorted(k for _, k in rig.tier.chunks) == sorted(keys[:3])
        assert rig.tiers.stats()[0].demotions_skipped == 3
        assert all(e is not None and e.readers == 0 for e in held[:3])
        assert rig.tier.puts[0] == [keys[0]]  # then the rest in batches
        await rig.tiers.drain(5.0)

    asyncio.run(main())


def test_a_lookup_promotes_the_prefix_found_below_and_a_later_lookup_hits(arena: Arena) -> None:
    async def main() -> None:
        rig = make_rig(arena)
        keys = keys_named(b"a", b"b", b"c", b"d")
        rig.store(keys, seed=5)
        await until(lambda: rig.tiers.stats()[0].demotions == 4)
        expected = {key: rig.arena_bytes(key) for key in keys}
        rig.evict(keys[1:])
        rig.tier.chunks.pop((rig.namespace.name, keys[3]))  # the prefix stops at d
        hits = rig.cache.lookup(rig.namespace.name, keys).hits
        assert hits == 1
        answered: list[list[int]] = []
        promoted = rig.tiers.probe(rig.namespace, keys, hits, answered.append)
        assert promoted == [1, 2]
        # Pending until the get ended; then committed, announced, byte for byte.
        assert rig.cache.lookup(rig.namespace.name, keys).pending == [1, 2]
        await until(lambda: rig.tiers.stats()[0].promotions == 2)
        assert rig.cache.lookup(rig.namespace.name, keys).hits == 3
        for key in keys[:3]:
            assert rig.arena_bytes(key) == expected[key]
        assert rig.tier.gets == [keys[1:3]]  # one batched get
        # CPU events for the 4 stored and the 2 promoted chunks, STORAGE ones for the 4 stored.
        assert len(events(rig, BlockStored, MEDIUM_CPU)) == 6
        assert len(events(rig, BlockStored, MEDIUM_STORAGE, LOCALITY_LOCAL)) == 4
        # Not written back to the tier they came from.
        assert sum(len(put) for put in rig.tier.puts) == 4
        stats = rig.tiers.stats()[0]
        assert (stats.hits, stats.promotion_failures) == (2, 0)
        assert answered == []  # an inline tier answers at once
        await rig.tiers.drain(5.0)

    asyncio.run(main())


def test_a_chunk_that_fails_verification_is_never_visible(arena: Arena) -> None:
    async def main() -> None:
        rig = make_rig(arena)
        keys = keys_named(b"a", b"b", b"c")
        rig.store(keys)
        await until(lambda: rig.tiers.stats()[0].demotions == 3)
        expected = rig.arena_bytes(keys[2])
        rig.evict(keys)
        rig.tier.corrupt.add(keys[1])
        assert rig.tiers.probe(rig.namespace, keys, 0, lambda _: None) == [0, 1, 2]
        await until(lambda: rig.tiers.stats()[0].promotion_failures == 1)
        assert rig.cache.get(rig.namespace.name, keys[1]) is None  # gone, not pending
        outcome = rig.cache.lookup(rig.namespace.name, keys)
        assert (outcome.hits, outcome.pending) == (1, [])
        assert rig.arena_bytes(keys[2]) == expected  # verified ones commit
        assert len(events(rig, BlockStored, MEDIUM_CPU)) == 3 + 2
        assert rig.cache.stats().used_bytes == 2 * 2 * 4096  # the failed one's extents freed
        await rig.tiers.drain(5.0)

    asyncio.run(main())


def test_clear_reaches_the_tiers_and_evictions_do_not(arena: Arena) -> None:
    async def main() -> None:
        rig = make_rig(arena)
        keys = keys_named(b"a", b"b")
        rig.store(keys)
        await until(lambda: rig.tiers.stats()[0].demotions == 2)
        rig.evict(keys[:1])
        assert len(rig.tier.chunks) == 2  # an eviction keeps the tier's copy
        removed = rig.cache.clear_namespace(rig.namespace.name)
        rig.announce.cleared(rig.engine, rig.namespace, removed)
        await until(lambda: not rig.tier.chunks)
        assert rig.tier.cleared == [rig.namespace.name]
        assert rig.tiers.probe(rig.namespace, keys, 0, lambda _: None) == []
        await rig.tiers.drain(5.0)

    asyncio.run(main())


def test_no_room_in_the_arena_promotes_nothing(arena: Arena) -> None:
    async def main() -> None:
        rig = make_rig(arena)
        keys = keys_named(b"a")
        rig.store(keys)
        await until(lambda: rig.tiers.stats()[0].demotions == 1)
        rig.evict(keys)
        # Fill the arena with pinned chunks of another namespace: nothing is evictable.
        other = keys_named(*(bytes([65 + i % 26, 97 + i // 26]) for i in range(128)))
        writes = rig.cache.begin_store("other", other, 0, lambda _: (ARENA // 128,)).writes
        assert rig.cache.stats().used_bytes == ARENA
        assert rig.tiers.probe(rig.namespace, keys, 0, lambda _: None) == []
        assert rig.cache.get(rig.namespace.name, keys[0]) is None
        rig.cache.finish_store(writes, ok=False)
        await rig.tiers.drain(5.0)

    asyncio.run(main())


def test_a_thread_tier_answers_later_or_counts_a_miss_after_its_timeout(arena: Arena) -> None:
    async def main() -> None:
        rig = make_rig(arena, inline=False, timeout=0.05)
        keys = keys_named(b"a", b"b")
        rig.store(keys)
        await until(lambda: rig.tiers.stats()[0].demotions == 2)
        # The cluster's chunks are announced as on remote storage.
        assert len(events(rig, BlockStored, MEDIUM_STORAGE, LOCALITY_REMOTE)) == 2
        assert events(rig, BlockStored, MEDIUM_STORAGE, LOCALITY_LOCAL) == []
        rig.evict(keys)
        answered: list[list[int]] = []
        assert rig.tiers.probe(rig.namespace, keys, 0, answered.append) is None
        await until(lambda: bool(answered))
        assert answered == [[0, 1]]
        await until(lambda: rig.tiers.stats()[0].promotions == 2)
        # A tier that does not answer in time: the lookup is answered, as a miss.
        rig.evict(keys)
        rig.tier.gate.clear()
        answered.clear()
        assert rig.tiers.probe(rig.namespace, keys, 0, answered.append) is None
        await until(lambda: bool(answered))
        assert answered == [[]]
        rig.tier.gate.set()
        await rig.tiers.drain(5.0)
        assert rig.cache.get(rig.namespace.name, keys[0]) is None  # its late answer: no effect

    asyncio.run(main())


def test_settings_turn_tiers_on_and_a_cluster_that_cannot_open_stays_off(
    arena: Arena,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert tier_slots(Settings(), arena) == []  # off by default
    settings = Settings(
        disk=DiskSettings(path=str(tmp_path / "disk"), capacity=1 << 20),
        mooncake=MooncakeSettings(master="127.0.0.1:1"),  # nobody there
    )
    slots = tier_slots(settings, arena)
    try:
        assert [(s.tier.name, s.inline, s.medium, s.locality) for s in slots] == [
            ("disk", True, "STORAGE", "LOCAL")
        ]
        assert "cluster tier OFF" in caplog.text  # the node serves on without it
    finally:
        for slot in slots:
            slot.tier.close()
    # A cluster that opens is announced as remote storage (vLLM 0.33's names).
    monkeypatch.setattr(storage, "_open_cluster", lambda *args: DictTier())
    cluster = tier_slots(Settings(mooncake=MooncakeSettings(master="127.0.0.1:1")), arena)
    assert [(s.inline, s.medium, s.locality) for s in cluster] == [(False, "STORAGE", "REMOTE")]


def test_a_lookups_contains_goes_before_queued_writes() -> None:
    worker = coordinator._Worker("test")
    release = threading.Event()
    order: list[str] = []
    busy = worker.submit(lambda: release.wait(10))
    later = [worker.submit(lambda: order.append("put")), worker.submit(lambda: order.append("get"))]
    urgent = worker.submit(lambda: order.append("contains"), urgent=True)
    release.set()
    worker.stop()
    futures: list[Future[Any]] = [busy, *later, urgent]
    for future in futures:
        future.result(10)
    assert order == ["contains", "put", "get"]


def test_a_mirrored_engine_hears_of_promotions_through_its_mirror_only(arena: Arena) -> None:
    async def main() -> None:
        rig = make_rig(arena, mirror=True)
        keys = keys_named(b"a", b"b")
        rig.store(keys)
        await until(lambda: rig.tiers.stats()[0].demotions == 2)
        rig.evict(keys)
        assert rig.tiers.probe(rig.namespace, keys, 0, lambda _: None) == [0, 1]
        await until(lambda: rig.tiers.stats()[0].promotions == 2)
        # A snapshot, 2 stored, 2 evicted, the 2 promoted; no events (its scheduler's job).
        changes = [(sorted(n.stored), sorted(n.removed)) for n in rig.notices]
        assert changes == [([], []), (keys, []), ([], keys), (keys, [])]
        assert rig.publishers.batches == []
        await rig.tiers.drain(5.0)

    asyncio.run(main())


def test_cluster_names_that_can_never_apply_are_told() -> None:
    tenants = {"alice": ["uid:1000"], "team": ["gid:2000"], "lab": ["gid:3000"]}
    groups = {"team": 2000}
    settings = Settings(
        tenancy=TenancySettings(shared_groups=("team",)),
        mooncake=MooncakeSettings(tenants=tenants),
    )
    [problem] = cluster_tenant_problems(settings, gid_of=groups.__getitem__)
    assert problem.startswith("lab: gid:3000 is not one of tenancy.shared_groups")
    everyone = msgspec.structs.replace(settings, tenancy=TenancySettings(share_across_uids=True))
    [problem] = cluster_tenant_problems(everyone, gid_of=groups.__getitem__)
    assert "share_across_uids" in problem
    assert cluster_tenant_problems(Settings()) == []
    # A range names its tenant whatever share_across_uids says; an unknown range nobody.
    ranged = Settings(
        tenancy=TenancySettings(share_across_uids=True, uid_ranges={"gpu-a": ["41000-41999"]}),
        mooncake=MooncakeSettings(tenants={"a": ["range:gpu-a"], "b": ["range:gpu-b"]}),
    )
    assert ranged.mooncake.cluster_tenants() == {"gpu-a": "a", "gpu-b": "b"}
    assert cluster_tenant_problems(ranged) == [
        "b: range:gpu-b is not one of tenancy.uid_ranges: this entry names nobody"
    ]

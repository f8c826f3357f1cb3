"""The tier coordinator's rig: a real cache, arena, registry, mirrors, announcer, committer and
``Tiers`` over a dict tier (``DictTier``), its publishers a recorder. Shared by the tests of the
tier coordinator and of the committer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from offloadd.cache.arena import Arena
from offloadd.cache.index import ChunkCache
from offloadd.cache.journal import Journal
from offloadd.server.announce import Announcer
from offloadd.server.commit import Committer
from offloadd.server.mirrors import Mirrors
from offloadd.server.registry import Engine, Namespace, Registry
from offloadd.server.tiers import Tiers, TierSlot
from offloadd.settings import EventSettings
from protocol.events import LOCALITY_LOCAL, LOCALITY_REMOTE, MEDIUM_STORAGE
from protocol.messages import KeysChanged, Reply
from tests.fakes import DictTier, FakePublishers
from tests.helpers import config, hello, ready

__all__ = ["ARENA", "CHUNK", "Rig", "events", "keys_named", "make_rig", "pattern", "until"]


ARENA = 1 << 20
CHUNK = 512  # two shards of 256 bytes (see tests.helpers.config)


@dataclass
class Rig:
    cache: ChunkCache
    arena: Arena
    announce: Announcer
    publishers: FakePublishers
    engine: Engine
    namespace: Namespace
    notices: list[KeysChanged]
    tier: DictTier
    tiers: Tiers
    committer: Committer
    registry: Registry

    def store(self, keys: list[bytes], seed: int = 1) -> None:
        """Store every shard of ``keys`` as ranks would, then commit (and announce) them."""
        cache, name = self.cache, self.namespace.name
        writes = []
        for shard in range(2):
            writes += cache.begin_store(
                name, keys, shard, self.namespace.shard_sizes_for_key
            ).writes
        for write in writes:
            self.arena.view(write.offset, write.size)[:] = pattern(
                write.entry.key, write.shard, seed
            )
        self.committer.commit(self.namespace, writes)

    def arena_bytes(self, key: bytes) -> list[bytes]:
        entry = self.cache.get(self.namespace.name, key)
        assert entry is not None and entry.committed
        return [
            bytes(self.arena.view(o, s)) for o, s in zip(entry.offsets, entry.sizes, strict=True)
        ]

    def evict(self, keys: list[bytes]) -> None:
        """Take ``keys`` out of the arena as an eviction would (tiers keep their copies)."""
        self.announce.removed(self.cache.remove(self.namespace.name, keys))


def pattern(key: bytes, shard: int, seed: int) -> bytes:
    return bytes((key[0] + shard * 7 + seed + i) % 256 for i in range(256))


def keys_named(*names: bytes) -> list[bytes]:
    return [name.ljust(8, b".") + bytes(4) for name in names]


def make_rig(arena: Arena, *, queue_bytes: int = 1 << 20, inline: bool = True,
             timeout: float = 0.05, mirror: bool = False,
             journal: Journal | None = None) -> Rig:  # fmt: skip
    registry = Registry()
    engine = ready(registry, "a")
    assert engine.namespace is not None
    cache = ChunkCache(ARENA)
    notices: list[KeysChanged] = []

    def send(session: str, message: Reply) -> None:
        if isinstance(message, KeysChanged):
            notices.append(message)

    mirrors = Mirrors(cache, registry, send)
    if mirror:  # a mirroring scheduler: it hears of commits and publishes the events itself
        scheduler = msgspec.structs.replace(
            hello(config(engine_id="a", rank=0), role="scheduler"), mirror=True
        )
        mirrors.start(registry.hello("a-sched", scheduler).session)
    publishers = FakePublishers()
    announce = Announcer(
        EventSettings(topic_template="kv@{engine_id}@{dp}", pod="pod"),
        registry,
        cache,
        mirrors,
        events=publishers,  # type: ignore[arg-type]
    )
    tier = DictTier()
    slot = TierSlot(
        tier,
        queue_bytes,
        inline=inline,
        lookup_timeout=timeout,
        medium=MEDIUM_STORAGE,  # as the disk (inline, local) and the cluster (remote)
        locality=LOCALITY_LOCAL if inline else LOCALITY_REMOTE,
    )
    committer = Committer(cache, announce, journal=journal)
    tiers = Tiers([slot], cache, arena, announce, committer, capacity=ARENA)
    announce.attach_tiers(tiers)
    return Rig(cache, arena, announce, publishers, engine, engine.namespace, notices, tier, tiers,
               committer, registry)  # fmt: skip


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Let the loop run until ``condition`` holds (the tier's results come back through it)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.002)


def events(rig: Rig, kind: type, medium: str, locality: str | None = None) -> list[object]:
    """The events of ``kind`` published with ``medium`` and ``locality``."""
    return [
        event
        for _topic, _dp, batch in rig.publishers.batches
        for event in batch.events
        if isinstance(event, kind)
        and (getattr(event, "medium", None), getattr(event, "locality", None)) == (medium, locality)
    ]

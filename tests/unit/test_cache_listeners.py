"""offloadd.cache.listeners: the cache tells of its own evictions and placements, in order.

What a ``begin_store`` or ``reserve`` evicted is heard once, with the cache whole and before
the call returns (so a tombstone is journaled before a byte is copied into the extents, and
the mirrors are told before the caller answers); removals a caller asks for are returned,
not heard. The announcer journals first, then tells the mirrors. Fakes that record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from offloadd.cache.index import CacheListener, ChunkCache, Entry
from offloadd.cache.listeners import Listeners
from offloadd.server.announce import Announcer
from offloadd.server.commit import Committer
from offloadd.server.registry import Registry
from offloadd.server.waiting import WaitingStores
from offloadd.settings import EventSettings
from tests.fakes import FakePublishers
from tests.helpers import ready

NS = "ns"
SIZE = 4096  # one aligned shard per key


def sizes(_key: bytes) -> tuple[int, ...]:
    return (SIZE,)


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + bytes(4)


def commit(cache: ChunkCache, keys: list[bytes], namespace: str = NS) -> None:
    writes = cache.begin_store(namespace, keys, 0, sizes).writes
    assert len(cache.finish_store(writes, ok=True)) == len(keys)


@dataclass
class Recorder:
    """A listener that writes what it hears, and what the cache shows right then, to ``log``."""

    cache: ChunkCache
    log: list[tuple[object, ...]]
    name: str = "listener"

    def removed(self, entries: Sequence[Entry]) -> None:
        gone = all(self.cache.get(e.namespace, e.key) is None for e in entries)
        self.log.append((self.name, "removed", [e.key for e in entries], gone, self.cache.seq))

    def placed(self) -> None:
        self.log.append((self.name, "placed"))


def full(slots: int) -> tuple[ChunkCache, list[tuple[object, ...]]]:
    cache = ChunkCache(slots * SIZE)
    commit(cache, [key(i) for i in range(slots)])
    log: list[tuple[object, ...]] = []
    listener: CacheListener = Recorder(cache, log)
    cache.listen(listener)
    return cache, log


def test_a_store_that_evicts_is_heard_once_before_it_returns() -> None:
    cache, log = full(2)
    store = cache.begin_store(NS, [key(10), key(11)], 0, sizes)
    log.append(("returned",))
    assert [e.key for e in store.evicted] == [key(0), key(1)]
    assert log == [("listener", "removed", [key(0), key(1)], True, 0), ("returned",)]


def test_a_reserve_that_evicts_is_heard_once_before_it_returns() -> None:
    cache, log = full(2)
    cache.watch(NS, "mirror")
    res = cache.reserve(NS, [key(10)], "sched", sizes, acker="mirror")
    log.append(("returned",))
    assert [e.key for e in res.evicted] == [key(0)]
    # The mirrors read the seq of the removal they are told of: the cache counts it already.
    assert log == [("listener", "removed", [key(0)], True, cache.seq), ("returned",)]
    assert cache.seq == 1


def test_nothing_is_heard_without_evictions_nor_for_removals_a_caller_asks_for() -> None:
    cache, log = full(4)
    assert cache.begin_store(NS, [key(0), key(1)], 0, sizes).writes == []  # committed: skipped
    assert cache.reserve(NS, [key(2)], "sched", sizes).reserved == []
    assert [e.key for e in cache.remove(NS, [key(0)])] == [key(0)]  # returned, not heard
    assert len(cache.clear_namespace(NS)) == 3
    assert log == []


def test_a_store_that_raises_after_evicting_still_tells_of_its_evictions() -> None:
    cache, log = full(1)
    bad = iter([(SIZE,), (0,)])
    with pytest.raises(ValueError, match="bad shard sizes"):
        cache.begin_store(NS, [key(10), key(11)], 0, lambda _key: next(bad))
    assert log == [("listener", "removed", [key(0)], True, 0)]  # gone all the same


def test_placements_are_heard_by_every_listener_in_the_order_added() -> None:
    cache = ChunkCache(4 * SIZE)
    cache.watch(NS, "a")
    cache.watch(NS, "b")
    commit(cache, [key(i) for i in range(4)])
    log: list[tuple[object, ...]] = []
    cache.listen(Recorder(cache, log, "first"))
    cache.on_placed(lambda: log.append(("replaced",)))
    cache.on_placed(lambda: log.append(("callback",)))  # instead of the one before
    cache.listen(Recorder(cache, log, "second"))
    res = cache.reserve(NS, [key(10)], "a", sizes, acker="a")  # its room waits on "b"
    assert res.reserved == [0] and cache.stats().unplaced == 1
    seq, gone = cache.seq, [e.key for e in res.evicted]  # one reservation more ahead
    assert log == [("first", "removed", gone, True, seq), ("second", "removed", gone, True, seq)]
    log.clear()
    cache.ack("b", seq)
    assert log == [("first", "placed"), ("callback",), ("second", "placed")]


def test_a_callback_given_none_hears_no_more() -> None:
    heard = Listeners()
    calls: list[int] = []
    heard.on_placed(lambda: calls.append(1))
    heard.placed()
    heard.on_placed(None)
    heard.placed()
    heard.removed([])
    assert calls == [1]


@dataclass
class OrderedJournal:
    log: list[tuple[object, ...]]

    def removed(self, entries: Sequence[Entry]) -> None:
        self.log.append(("journal", [e.key for e in entries]))


@dataclass
class OrderedMirrors:
    log: list[tuple[object, ...]]

    def changed(self, namespace: str, stored: list[bytes], removed: list[bytes]) -> None:
        self.log.append(("mirrors", namespace, stored, removed))


def test_the_committer_journals_an_eviction_then_the_announcer_tells_mirrors_and_engines() -> None:
    registry = Registry()
    engine = ready(registry, "a")
    assert engine.namespace is not None
    name = engine.namespace.name
    cache = ChunkCache(2 * SIZE)
    log: list[tuple[object, ...]] = []
    publishers = FakePublishers()
    announcer = Announcer(
        EventSettings(topic_template="kv@{engine_id}@{dp}", pod="pod"),
        registry,
        cache,
        OrderedMirrors(log),  # type: ignore[arg-type]
        events=publishers,  # type: ignore[arg-type]
    )
    # The committer listens from now on: no caller tells it of evictions.
    Committer(cache, announcer, journal=OrderedJournal(log))  # type: ignore[arg-type]
    commit(cache, [key(0), key(1)], name)
    pending = cache.begin_store(name, [key(2)], 0, sizes)  # evicts key(0)
    log.append(("returned",))
    assert log == [
        ("journal", [key(0)]),
        ("mirrors", name, [], [key(0)]),
        ("returned",),
    ]
    assert publishers.heard() == {"kv@a@0": ["BlockRemoved"]}
    # A pending entry evicted goes to the journal (which skips what it never recorded), and
    # to nobody else: nobody heard of it.
    del log[:]
    assert cache.finish_store(pending.writes, ok=False) == []  # pending, no copy: evictable
    stranger = cache.begin_store(name, [key(3), key(4)], 0, sizes)
    assert [(e.key, e.committed) for e in stranger.evicted] == [(key(1), True), (key(2), False)]
    assert log == [("journal", [key(1), key(2)]), ("mirrors", name, [], [key(1)])]
    assert publishers.heard() == {"kv@a@0": ["BlockRemoved", "BlockRemoved"]}  # key(1)'s


def test_the_waiting_stores_wake_when_the_cache_places_keys() -> None:
    cache = ChunkCache(4 * SIZE)
    waiting = WaitingStores(cache, None, Registry())  # type: ignore[arg-type]
    woken: list[str] = []
    waiting.wake = lambda: woken.append("wake")  # type: ignore[method-assign]
    waiting.removed([])  # evictions free no room a waiting store needs
    cache.watch(NS, "a")
    cache.watch(NS, "b")
    commit(cache, [key(i) for i in range(4)])
    cache.reserve(NS, [key(10)], "a", sizes, acker="a")
    assert woken == []
    cache.ack("b", cache.seq)
    assert woken == ["wake"]

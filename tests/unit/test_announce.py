"""offloadd.server.announce: which engine hears of which cache change, and the journal beside it.

Real registry, cache and mirrors; the publishers and the journal are fakes that record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from offloadd.cache.index import ChunkCache, Entry
from offloadd.server.announce import Announcer, topic_warnings
from offloadd.server.commit import Committer
from offloadd.server.mirrors import Mirrors
from offloadd.server.registry import Engine, Registry
from offloadd.settings import EventSettings
from protocol.events import AllBlocksCleared, BlockRemoved, BlockStored
from protocol.messages import Reply
from tests.fakes import FakePublishers
from tests.helpers import ready


@dataclass
class FakeJournal:
    removed_keys: list[bytes] = field(default_factory=list)

    def removed(self, entries: list[Entry]) -> None:
        self.removed_keys.extend(entry.key for entry in entries)


def entry(namespace: str, name: bytes, *, committed: bool = True) -> Entry:
    """A real cache entry of ``namespace``, committed or still pending."""
    cache = ChunkCache(1 << 20)
    (write,) = cache.begin_store(
        namespace, [name.ljust(8, b".") + bytes(4)], 0, lambda _: (64,)
    ).writes
    if not committed:
        return write.entry
    (made,) = cache.finish_store([write], ok=True)
    return made


def rig() -> tuple[Registry, Announcer, FakePublishers, FakeJournal, list[Engine]]:
    registry = Registry()
    engines = [ready(registry, "a"), ready(registry, "b"), ready(registry, "quiet", events=False)]
    cache = ChunkCache(1 << 20)
    sent: list[tuple[str, Reply]] = []
    mirrors = Mirrors(cache, registry, lambda session, message: sent.append((session, message)))
    publishers, journal = FakePublishers(), FakeJournal()
    announcer = Announcer(
        EventSettings(topic_template="kv@{engine_id}@{dp}", pod="pod"),
        registry,
        cache,
        mirrors,
        events=publishers,  # type: ignore[arg-type]
    )
    return registry, announcer, publishers, journal, engines


def committer(announcer: Announcer, journal: FakeJournal) -> Committer:
    """The journal's writer over ``announcer`` (removals are journaled, then told)."""
    return Committer(announcer._cache, announcer, journal=journal)  # type: ignore[arg-type]


def test_every_engine_of_the_namespace_that_wants_events_hears_of_a_commit() -> None:
    _registry, announcer, publishers, _journal, (a, _b, quiet) = rig()
    assert a.namespace is quiet.namespace  # one model, one layout: one shared cache
    assert a.namespace is not None
    announcer.chunks_committed(a.namespace, [entry(a.namespace.name, b"one")])
    assert publishers.heard() == {"kv@a@0": ["BlockStored"], "kv@b@0": ["BlockStored"]}
    (_topic, dp, batch) = publishers.batches[0]
    assert dp == 0 and batch.data_parallel_rank == 0
    assert isinstance(batch.events[0], BlockStored) and batch.events[0].medium == "CPU"


def test_removals_are_journaled_first_and_announced_only_for_committed_chunks() -> None:
    _registry, announcer, publishers, journal, (a, _b, _quiet) = rig()
    assert a.namespace is not None
    name = a.namespace.name
    gone = [entry(name, b"old"), entry(name, b"pending", committed=False)]
    committer(announcer, journal).removed([*gone, entry("nobody@0000", b"orphan")])
    assert len(journal.removed_keys) == 3  # the journal sees every entry
    assert publishers.heard() == {"kv@a@0": ["BlockRemoved"], "kv@b@0": ["BlockRemoved"]}
    removed = publishers.batches[0][2].events[0]
    assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 1


def test_a_clear_tells_the_clearing_engine_all_cleared_and_the_others_what_went() -> None:
    _registry, announcer, publishers, journal, (a, b, _quiet) = rig()
    assert a.namespace is not None
    removed = [entry(a.namespace.name, b"x"), entry(a.namespace.name, b"y", committed=False)]
    keys = committer(announcer, journal).cleared(b, a.namespace, removed)
    assert keys == [removed[0].key] and journal.removed_keys == [e.key for e in removed]
    assert publishers.heard() == {"kv@b@0": ["AllBlocksCleared"], "kv@a@0": ["BlockRemoved"]}
    assert isinstance(publishers.batches[0][2].events[0], AllBlocksCleared)


def test_a_ready_engine_is_sent_what_its_namespace_holds_and_closing_stops_it() -> None:
    _registry, announcer, publishers, journal, (a, _b, _quiet) = rig()
    namespace = a.namespace
    assert namespace is not None
    announcer.engine_ready(a)
    assert publishers.batches == []  # nothing held yet: nothing to say
    cache = announcer._cache
    held = [entry(namespace.name, name).key for name in (b"p", b"q")]
    for shard in range(2):  # every rank's shard written: the chunks commit
        writes = cache.begin_store(namespace.name, held, shard, namespace.shard_sizes_for_key)
        committed = cache.finish_store(writes.writes, ok=True)
    assert [e.key for e in committed] == held
    announcer.engine_ready(a)
    assert publishers.heard() == {"kv@a@0": ["BlockStored", "BlockStored"]}  # only to a
    assert announcer.endpoints_for(1) == ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:5559")
    announcer.events_closed()
    announcer.removed(committed)
    announcer.chunks_committed(namespace, committed)
    assert len(publishers.batches) == 1 and journal.removed_keys == []  # it journals nothing
    assert announcer.endpoints_for(0) == ("", "")


def test_topics_that_could_name_another_tenant_are_warned_about() -> None:
    assert topic_warnings(EventSettings().topic_template, client_topics=False) == []
    assert topic_warnings("kv@{pod}@{engine_id}", client_topics=False) == []  # ids are per tenant
    (shared,) = topic_warnings("kv@{pod}@{model}", client_topics=False)  # vLLM's own shape
    assert "neither {tenant} nor {engine_id}" in shared
    (chosen,) = topic_warnings(EventSettings().topic_template, client_topics=True)
    assert "tenancy.client_topics" in chosen

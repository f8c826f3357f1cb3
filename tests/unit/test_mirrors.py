"""offloadd.server.mirrors: snapshots and changes for key mirrors, the mirrors that stop
acknowledging removals, and the empty snapshot a stopping daemon sends.

Real registry and cache; what the mirrors are sent is recorded.
"""

from __future__ import annotations

import msgspec

from offloadd.cache.index import ChunkCache
from offloadd.server.mirrors import Mirrors
from offloadd.server.registry import Namespace, Registry
from protocol.messages import KeysChanged, Reply
from tests.helpers import hello, ready


def rig() -> tuple[ChunkCache, Mirrors, Namespace, list[tuple[str, Reply]]]:
    """Engines a and b share one namespace; each has a mirroring scheduler, started."""
    registry = Registry()
    engines = [ready(registry, "a"), ready(registry, "b")]
    cache = ChunkCache(1 << 20)
    sent: list[tuple[str, Reply]] = []
    mirrors = Mirrors(cache, registry, lambda session, message: sent.append((session, message)))
    for engine in engines:
        message = hello(engine_id=engine.key[0], rank=0, role="scheduler")
        outcome = registry.hello(
            f"sched-{engine.key[0]}", msgspec.structs.replace(message, mirror=True)
        )
        mirrors.start(outcome.session)
    namespace = engines[0].namespace
    assert namespace is not None and engines[1].namespace is namespace
    return cache, mirrors, namespace, sent


def commit(cache: ChunkCache, namespace: Namespace, *names: bytes) -> list[bytes]:
    keys = [name.ljust(8, b".") + bytes(4) for name in names]
    for shard in range(2):  # every rank's shard written: the chunks commit
        writes = cache.begin_store(namespace.name, keys, shard, namespace.shard_sizes_for_key)
        cache.finish_store(writes.writes, ok=True)
    return keys


def remove_all(cache: ChunkCache, mirrors: Mirrors, namespace: Namespace) -> list[bytes]:
    """Clear the namespace (its committed entries leave, watched) and tell the mirrors."""
    keys = [entry.key for entry in cache.clear_namespace(namespace.name)]
    mirrors.changed(namespace.name, [], keys)
    return keys


def test_a_mirror_that_leaves_a_removal_unacknowledged_is_overdue_after_its_ticks() -> None:
    cache, mirrors, namespace, _sent = rig()
    commit(cache, namespace, b"one", b"two")
    assert len(remove_all(cache, mirrors, namespace)) == 2
    assert cache.stats().leaving == 2  # their bytes wait for both mirrors
    assert mirrors.overdue(2) == []
    cache.ack("sched-a", cache.seq)  # a applied the removal, b stays silent
    assert mirrors.overdue(2) == []
    assert mirrors.overdue(2) == ["sched-b"]
    assert mirrors.overdue(2) == ["sched-b"]  # until the daemon ends its session
    mirrors.stop("sched-b")  # what ending the session does: its debts are forgiven
    assert cache.stats().leaving == 0
    assert mirrors.overdue(2) == []


def test_an_acknowledgement_settles_only_the_removals_it_covers() -> None:
    cache, mirrors, namespace, _sent = rig()
    commit(cache, namespace, b"first")
    remove_all(cache, mirrors, namespace)
    first = cache.seq
    mirrors.overdue(3)  # the second removal is sent a tick later
    commit(cache, namespace, b"second")
    remove_all(cache, mirrors, namespace)
    for session in ("sched-a", "sched-b"):
        cache.ack(session, first)
    assert mirrors.overdue(3) == [] and mirrors.overdue(3) == []
    # The first removal would be late now; the second, still owed, is not yet.
    assert mirrors.overdue(3) == []
    assert mirrors.overdue(3) == ["sched-a", "sched-b"]
    for session in ("sched-a", "sched-b"):
        cache.ack(session, cache.seq)
    assert mirrors.overdue(3) == [] and cache.stats().leaving == 0


def test_stored_keys_owe_nothing() -> None:
    cache, mirrors, namespace, _sent = rig()
    keys = commit(cache, namespace, b"kept")
    mirrors.changed(namespace.name, keys, [])
    assert [mirrors.overdue(1) for _ in range(3)] == [[], [], []]


def test_the_drain_tells_every_mirror_that_every_key_misses_and_then_nothing() -> None:
    cache, mirrors, namespace, sent = rig()
    keys = commit(cache, namespace, b"held")
    mirrors.changed(namespace.name, keys, [])
    remove_all(cache, mirrors, namespace)
    assert cache.stats().leaving == 1
    sent.clear()
    mirrors.drain()
    assert sorted(session for session, _ in sent) == ["sched-a", "sched-b"]
    for _session, message in sent:
        assert isinstance(message, KeysChanged)
        assert message.reset and not message.more and message.stored == []
    assert cache.stats().leaving == 0  # nobody mirrors the namespace any more
    assert not mirrors.watching("sched-a") and not mirrors.watching("sched-b")
    sent.clear()
    mirrors.changed(namespace.name, commit(cache, namespace, b"late"), [])  # a drained store
    assert sent == []
    assert mirrors.overdue(0) == []

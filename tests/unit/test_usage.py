"""What ``offloadd cache ls`` reports: per engine and namespace use (``offloadd.server.usage``)
and the committed chunks and bytes of each namespace (``ChunkCache.namespace_sizes``)."""

from __future__ import annotations

from offloadd.cache.index import ChunkCache
from offloadd.server.usage import Usage


def test_hits_misses_and_last_use_per_engine_and_namespace() -> None:
    now = [100.0]
    usage = Usage(clock=lambda: now[0])
    usage.looked_up(("a", 0), "ns1", 3, 1)
    now[0] = 200.0
    usage.looked_up(("b", 1), "ns1", 2, 0)
    usage.used(("a", 0), "ns1")
    a, b, ns = usage.engine(("a", 0)), usage.engine(("b", 1)), usage.namespace("ns1")
    assert a is not None and b is not None and ns is not None
    assert (a.hits, a.misses, a.last_use, a.namespace) == (3, 1, 200.0, "ns1")
    assert (b.hits, b.last_use) == (2, 200.0)
    assert (ns.hits, ns.misses, ns.last_use) == (5, 1, 200.0)
    assert list(ns.engines) == [("a", 0), ("b", 1)]
    assert usage.engine_keys("a") == {("a", 0): "ns1"}
    assert usage.engine(("c", 0)) is None and usage.namespace("ns2") is None


def test_only_the_most_recently_used_are_remembered() -> None:
    usage = Usage(clock=lambda: 1.0, remember=2)
    for name in ("x", "y"):
        usage.used((name, 0), name)
    usage.used(("x", 0), "x")  # x is now the newest
    usage.used(("z", 0), "z")  # y, the oldest, goes
    assert sorted(usage.engines()) == [("x", 0), ("z", 0)]
    assert usage.namespace("y") is None and usage.namespace("x") is not None


def test_namespace_sizes_count_committed_chunks_only() -> None:
    cache = ChunkCache(1 << 20)
    for namespace, keys in (("n1", [b"k1", b"k2"]), ("n2", [b"k3"])):
        reservation = cache.begin_store(namespace, keys, 0, lambda _key: (1000,))
        cache.finish_store(reservation.writes, True)
    pending = cache.begin_store("n2", [b"k4"], 0, lambda _key: (1000,))
    assert cache.namespace_sizes() == {"n1": (2, 2000), "n2": (1, 1000)}
    cache.clear_namespace("n1")
    cache.finish_store(pending.writes, False)
    assert cache.namespace_sizes() == {"n2": (1, 1000)}

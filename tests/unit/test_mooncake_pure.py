"""MooncakeTier's logic against an in-memory stand-in for Mooncake's client (no mooncake
needed): naming, companions, verification, and the back-off on an unreachable master."""

from __future__ import annotations

import ctypes
import os
import re
import sys
import uuid
from collections.abc import Iterator, Sequence

import pytest

from offloadd.cache.arena import Arena
from offloadd.checksum import checksum
from offloadd.settings import MooncakeSettings
from offloadd.tiers.base import ChunkAddress
from offloadd.tiers.mooncake import (
    ClusterKeys,
    MooncakeTier,
    MooncakeUnavailable,
    companion_size,
)
from offloadd.tiers.mooncake_client import default_metadata

KEY = bytes(range(32))
TENANTS = {"alice": ["uid:1000"]}


@pytest.fixture(autouse=True)
def key_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.getbasetemp() / "cluster.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, KEY)
    os.close(fd)
    return path


def settings(key_file: str, master: str = "") -> MooncakeSettings:
    return MooncakeSettings(key_file=key_file, tenants=TENANTS, master=master)


def object_names(namespace: str, key: bytes) -> tuple[str, str]:
    return ClusterKeys(KEY).space("alice", namespace).names(key)


RPC_FAIL = -900


class FakeStore:
    """The slice of ``MooncakeDistributedStore`` the tier calls, with its return codes."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.down = False  # every call answers RPC_FAIL
        self.health = 0  # what health_check answers
        self.calls: list[str] = []

    def _call(self, name: str) -> bool:
        self.calls.append(name)
        return not self.down

    def register_buffer(self, address: int, size: int) -> int:
        return 0

    def unregister_buffer(self, address: int) -> int:
        return 0

    def close(self) -> int:
        return 0

    def health_check(self) -> int:
        return self.health

    def batch_put_from_multi_buffers(
        self, keys: list[str], addresses: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        if not self._call("put"):
            return [RPC_FAIL] * len(keys)
        for key, parts, lengths in zip(keys, addresses, sizes, strict=True):
            if key not in self.objects:
                self.objects[key] = b"".join(
                    ctypes.string_at(a, n) for a, n in zip(parts, lengths, strict=True)
                )
        return [0] * len(keys)

    def batch_put_from(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        return self.batch_put_from_multi_buffers(
            keys, [[a] for a in addresses], [[n] for n in sizes]
        )

    def batch_get_into_multi_buffers(
        self, keys: list[str], addresses: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        if not self._call("get"):
            return [RPC_FAIL] * len(keys)
        codes = []
        for key, parts, lengths in zip(keys, addresses, sizes, strict=True):
            data = self.objects.get(key)
            if data is None:
                codes.append(-704)
            elif sum(lengths) < len(data):
                codes.append(-600)
            elif sum(lengths) > len(data):
                codes.append(-800)
            else:
                at = 0
                for address, length in zip(parts, lengths, strict=True):
                    ctypes.memmove(address, data[at : at + length], length)
                    at += length
                codes.append(len(data))
        return codes

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        if not self._call("exist"):
            return [RPC_FAIL] * len(keys)
        return [int(key in self.objects) for key in keys]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        if not self._call("remove"):
            return [RPC_FAIL] * len(keys)
        return [0 if self.objects.pop(key, None) is not None else -704 for key in keys]

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        if not self._call("remove"):
            return RPC_FAIL
        doomed = [key for key in self.objects if re.search(pattern, key)]
        for key in doomed:
            del self.objects[key]
        return len(doomed)


@pytest.fixture
def arena() -> Iterator[Arena]:
    made = Arena(f"/dev/shm/offloadd-test-mooncake-pure-{uuid.uuid4().hex}", 1 << 20)
    yield made
    made.close()


@pytest.fixture
def store() -> FakeStore:
    return FakeStore()


@pytest.fixture
def tier(arena: Arena, store: FakeStore, key_file: str) -> Iterator[MooncakeTier]:
    made = MooncakeTier(
        settings(key_file, master="fake:1"),
        arena,
        tenant_of=lambda namespace: "u1000",
        client=store,
        backoff=60.0,
    )
    yield made
    made.close()


def fill(arena: Arena, namespace: str, count: int, base: int = 0) -> list[ChunkAddress]:
    chunks = []
    for n in range(count):
        extents = ((base + n * 8192, 4096), (base + n * 8192 + 4096, 1000))
        for offset, size in extents:
            arena.view(offset, size)[:] = os.urandom(size)
        chunks.append(ChunkAddress(namespace, os.urandom(8), extents))
    return chunks


def moved(chunks: Sequence[ChunkAddress], base: int) -> list[ChunkAddress]:
    return [
        ChunkAddress(c.namespace, c.key, tuple((o + base, s) for o, s in c.extents)) for c in chunks
    ]


def read(arena: Arena, chunk: ChunkAddress) -> bytes:
    return b"".join(bytes(arena.view(o, s)) for o, s in chunk.extents)


def test_names_and_companions() -> None:
    keys = ClusterKeys(KEY)
    data, companion = object_names("ns/a b", b"\x01\x02")
    assert data.startswith("offloadd/v3/") and data.endswith("/0102")
    assert companion == data + ".sum" and "ns" not in data
    assert keys.space("bob", "ns/a b").names(b"\x01\x02")[0] != data  # tenants apart
    nonces = [b"n" * 12, b"m" * 12]
    raw = keys.encode_companion(data, [10, 20], [0xDEADBEEF_0BADF00D, 7], nonces)
    assert len(raw) == companion_size(2)
    assert keys.decode_companion(data, raw, [10, 20]) == [
        (0xDEADBEEF_0BADF00D, nonces[0]),
        (7, nonces[1]),
    ]
    assert keys.decode_companion(data, raw, [10, 21]) is None
    assert keys.decode_companion(data, raw, [10]) is None
    assert keys.decode_companion(data + "x", raw, [10, 20]) is None  # another chunk's companion
    assert keys.decode_companion(data, raw[:-1], [10, 20]) is None
    flipped = bytearray(raw)
    flipped[20] ^= 1  # a checksum changed: the MAC no longer matches
    assert keys.decode_companion(data, bytes(flipped), [10, 20]) is None
    assert ClusterKeys(bytes(32)).decode_companion(data, raw, [10, 20]) is None  # another key
    assert default_metadata("10.0.0.7:50051") == "http://10.0.0.7:8080/metadata"
    assert default_metadata("master") == "http://master:8080/metadata"


def test_missing_package_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, arena: Arena, key_file: str
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails
    with pytest.raises(MooncakeUnavailable, match=r"offloadd\[mooncake\].*libibverbs1"):
        MooncakeTier(settings(key_file, master="127.0.0.1:1"), arena)
    with pytest.raises(MooncakeUnavailable, match="master is empty"):
        MooncakeTier(settings(key_file), arena)


def test_round_trip_and_namespaces(tier: MooncakeTier, arena: Arena, store: FakeStore) -> None:
    chunks = fill(arena, "a", 3)
    assert tier.put(chunks, arena).stored == [True] * 3
    assert tier.contains("a", [c.key for c in chunks]) == [True] * 3
    assert tier.contains("b", [c.key for c in chunks]) == [False] * 3
    targets = moved(chunks, 1 << 19)
    assert tier.get(targets, arena) == [True] * 3
    assert [read(arena, t) for t in targets] == [read(arena, c) for c in chunks]
    stats = tier.stats()
    assert (stats.chunks, stats.used_bytes, stats.errors) == (3, 3 * 5096, 0)
    tier.clear("b")
    assert len(store.objects) == 6
    tier.clear("a")
    assert store.objects == {} and tier.stats().chunks == 0


def test_sums_cover_the_sealed_bytes(tier: MooncakeTier, arena: Arena, store: FakeStore) -> None:
    [chunk] = fill(arena, "a", 1)
    tier.put([chunk], arena)
    data, companion = object_names("a", chunk.key)
    sizes = [size for _, size in chunk.extents]
    sealed = ctypes.create_string_buffer(store.objects[data], len(store.objects[data]))
    sums, at = [], 0
    for size in sizes:
        sums.append(checksum(ctypes.addressof(sealed) + at, size + 16))
        at += size + 16
    shards = ClusterKeys(KEY).decode_companion(data, store.objects[companion], sizes)
    assert shards is not None and [total for total, _ in shards] == sums
    assert read(arena, chunk) not in store.objects[data]


def test_torn_data_is_dropped(tier: MooncakeTier, arena: Arena, store: FakeStore) -> None:
    [chunk, other] = fill(arena, "a", 2)
    tier.put([chunk, other], arena)
    data, companion = object_names("a", chunk.key)
    store.objects[data] = bytes(len(store.objects[data]))  # same size, other bytes
    assert tier.get(moved([chunk, other], 1 << 19), arena) == [False, True]
    assert data not in store.objects and companion not in store.objects
    assert tier.stats().errors == 1


def test_a_wrong_size_is_dropped(tier: MooncakeTier, arena: Arena, store: FakeStore) -> None:
    [chunk] = fill(arena, "a", 1)
    tier.put([chunk], arena)
    data, _ = object_names("a", chunk.key)
    store.objects[data] += b"x"
    assert tier.get(moved([chunk], 1 << 19), arena) == [False]
    assert store.objects == {}


def test_an_unfinished_put_is_invisible(tier: MooncakeTier, arena: Arena, store: FakeStore) -> None:
    [chunk] = fill(arena, "a", 1)
    tier.put([chunk], arena)
    data, companion = object_names("a", chunk.key)
    del store.objects[companion]  # the data written, its companion not yet
    assert tier.contains("a", [chunk.key]) == [False]
    assert tier.get(moved([chunk], 1 << 19), arena) == [False]
    assert data in store.objects  # left to its writer
    assert tier.stats().errors == 0


def test_data_gone_under_its_companion(tier: MooncakeTier, arena: Arena, store: FakeStore) -> None:
    [chunk] = fill(arena, "a", 1)
    tier.put([chunk], arena)
    data, companion = object_names("a", chunk.key)
    del store.objects[data]  # evicted, or in the segment of a daemon that left
    assert tier.get(moved([chunk], 1 << 19), arena) == [False]
    assert companion not in store.objects


def test_extents_outside_the_arena(tier: MooncakeTier, arena: Arena, store: FakeStore) -> None:
    chunk = ChunkAddress("a", b"k", ((arena.size - 10, 20),))
    assert tier.put([chunk], arena).stored == [False]
    assert tier.get([chunk], arena) == [False]
    assert store.calls == [] and tier.stats().errors == 2


def test_unreachable_master_backs_off(tier: MooncakeTier, arena: Arena, store: FakeStore) -> None:
    chunks = fill(arena, "a", 2)
    store.down = True
    assert tier.put(chunks, arena).stored == [False, False]
    assert not tier.healthy and tier.stats().errors == 1 and not tier.stats().healthy
    store.calls.clear()
    # Backing off: nothing reaches the client.
    assert tier.contains("a", [c.key for c in chunks]) == [False, False]
    assert tier.get(chunks, arena) == [False, False]
    tier.remove("a", [chunks[0].key])
    assert store.calls == []
    # Back-off over, but the client knows the master is unreachable: still no call.
    tier._retry_at = 0.0
    store.health = 2
    assert tier.contains("a", [chunks[0].key]) == [False]
    assert store.calls == []
    # The master is back: the next call goes through and the tier is healthy again.
    tier._retry_at = 0.0
    store.down, store.health = False, 0
    assert tier.put(chunks, arena).stored == [True, True]
    assert tier.healthy
    assert tier.get(moved(chunks, 1 << 19), arena) == [True, True]


def test_closed_tier_answers_false(arena: Arena, store: FakeStore, key_file: str) -> None:
    tier = MooncakeTier(settings(key_file, master="fake:1"), arena, client=store)
    tier.close()
    tier.close()
    chunks = fill(arena, "a", 1)
    assert tier.put(chunks, arena).stored == [False]
    assert tier.contains("a", [chunks[0].key]) == [False]
    assert store.calls == []

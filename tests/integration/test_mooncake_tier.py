"""The cluster tier against a real mooncake_master on loopback: two tiers over two arenas,
as two nodes would be, share chunks byte-exact; corrupted or missing objects are misses;
a dead master makes every call a quick miss, and after a restart puts reach the cluster
again."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from offloadd.cache.arena import Arena
from offloadd.checksum import checksum
from offloadd.settings import MooncakeSettings
from offloadd.tiers.base import ChunkAddress
from offloadd.tiers.mooncake import (
    ClusterKeys,
    MooncakeTier,
    MooncakeUnavailable,
    sealed_size,
)
from tests.integration.mooncake_peer import SHARDS, Node, cluster_key_file, settings
from tests.mooncake_master import MooncakeMaster, require_mooncake
from tests.ports import free_port

require_mooncake()

HANG_BOUND = 30.0  # a call against a dead master must return well within this
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as running:
        yield running.start()


@pytest.fixture(scope="module")
def nodes(master: MooncakeMaster) -> Iterator[list[Node]]:
    """Two nodes for the whole module (opening and closing a client takes seconds)."""
    made: list[Node] = []
    try:
        made.append(Node(master))
        made.append(Node(master))
        yield made
    finally:
        for node in made:
            node.close()


def moved(chunks: list[ChunkAddress], base: int) -> list[ChunkAddress]:
    """The same chunks at other offsets (where a cold arena would place them)."""
    out = []
    offset = base
    for chunk in chunks:
        extents = []
        for _, size in chunk.extents:
            extents.append((offset, size))
            offset += size
        out.append(ChunkAddress(chunk.namespace, chunk.key, tuple(extents)))
    return out


def raw(tier: MooncakeTier) -> Any:
    """The tier's Mooncake client, to tamper with objects behind its back."""
    return tier._client


def object_names(namespace: str, key: bytes) -> tuple[str, str]:
    """A chunk's object names as the test nodes' tier (tenant alice) names them."""
    with open(cluster_key_file(), "rb") as handle:
        keys = ClusterKeys(handle.read())
    return keys.space("alice", namespace).names(key)


def test_put_on_one_node_get_on_another(nodes: list[Node]) -> None:
    a, b = nodes
    namespace = f"model-{uuid.uuid4().hex}"
    chunks = a.chunks(namespace, 6)
    before_a, before_b = a.tier.stats(), b.tier.stats()
    write = a.tier.put(chunks, a.arena)
    assert write.stored == [True] * 6
    assert write.evicted == []
    missing = os.urandom(16)
    keys = [c.key for c in chunks]
    assert b.tier.contains(namespace, [*keys, missing]) == [True] * 6 + [False]
    assert b.tier.contains("another-namespace", keys) == [False] * 6
    targets = moved(chunks, base=1 << 20)
    assert b.tier.get(targets, b.arena) == [True] * 6
    for source, target in zip(chunks, targets, strict=True):
        assert b.read(target) == a.read(source)
    stats_a, stats_b = a.tier.stats(), b.tier.stats()
    assert stats_a.chunks - before_a.chunks == 6
    assert stats_a.used_bytes - before_a.used_bytes == 6 * sum(SHARDS)
    assert stats_a.bytes_written - before_a.bytes_written == 6 * sum(SHARDS)
    assert stats_b.bytes_read - before_b.bytes_read == 6 * sum(SHARDS)
    assert stats_a.write_seconds > 0 and stats_b.read_seconds > 0
    assert stats_a.errors == before_a.errors and stats_b.errors == before_b.errors
    assert stats_a.healthy and stats_b.healthy
    assert a.tier.put(chunks[:1], a.arena).stored == [True]  # already there: still True

    a.tier.remove(namespace, keys[:2])
    assert b.tier.contains(namespace, keys) == [False, False] + [True] * 4
    assert a.tier.stats().chunks - before_a.chunks == 4
    a.tier.clear(namespace)
    assert b.tier.contains(namespace, keys) == [False] * 6
    assert a.tier.stats().chunks == before_a.chunks


def test_missing_key_is_a_quick_miss(nodes: list[Node]) -> None:
    a, _ = nodes
    chunk = ChunkAddress("ns", os.urandom(16), ((0, 4096),))
    errors = a.tier.stats().errors
    started = time.monotonic()
    assert a.tier.get([chunk], a.arena) == [False]
    assert a.tier.contains("ns", [chunk.key]) == [False]
    assert time.monotonic() - started < HANG_BOUND
    assert a.tier.stats().errors == errors and a.tier.healthy


@pytest.mark.parametrize("target", ["data", "data-size", "companion", "data-only"])
def test_corrupted_objects_are_never_served(nodes: list[Node], target: str) -> None:
    a, b = nodes
    namespace = f"model-{uuid.uuid4().hex}"
    [chunk] = a.chunks(namespace, 1)
    assert a.tier.put([chunk], a.arena).stored == [True]
    data, companion = object_names(namespace, chunk.key)
    client = raw(a.tier)
    if target == "data":  # same size, one byte flipped
        tampered = bytearray(a.read(chunk))
        tampered[12345] ^= 0xFF
        assert client.upsert(data, bytes(tampered)) == 0
    elif target == "data-size":
        assert client.upsert(data, a.read(chunk)[:-1]) == 0
    elif target == "companion":
        size = len(client.get(companion))
        assert client.upsert(companion, os.urandom(size)) == 0
    else:  # bytes without a companion: an unfinished put is invisible
        assert client.remove(companion, True) == 0
    [target_chunk] = moved([chunk], base=4 << 20)
    errors = b.tier.stats().errors
    assert b.tier.get([target_chunk], b.arena) == [False]
    assert b.tier.contains(namespace, [chunk.key]) == [False]
    if target != "data-only":
        assert b.tier.stats().errors > errors  # counted, and the objects dropped
        assert client.batch_is_exist([data, companion]) == [0, 0]
    assert b.tier.healthy


def test_open_fails_fast_without_a_master() -> None:
    arena = Arena(f"/dev/shm/offloadd-test-mooncake-{uuid.uuid4().hex}", 1 << 20)
    try:
        dead = MooncakeSettings(
            master=f"127.0.0.1:{free_port()}",
            local_hostname="127.0.0.1",
            key_file=cluster_key_file(),
        )
        started = time.monotonic()
        with pytest.raises(MooncakeUnavailable, match="does not answer"):
            MooncakeTier(dead, arena)
        assert time.monotonic() - started < HANG_BOUND
    finally:
        arena.close()


def test_dead_master_then_restart() -> None:
    with MooncakeMaster() as master:
        master.start()
        a, b = Node(master), Node(master)
        try:
            namespace = f"model-{uuid.uuid4().hex}"
            chunks = a.chunks(namespace, 2)
            assert a.tier.put(chunks[:1], a.arena).stored == [True]

            master.kill()
            for _ in range(3):  # the first call fails, the next ones are skipped or fail
                started = time.monotonic()
                assert b.tier.contains(namespace, [chunks[0].key]) == [False]
                assert b.tier.get(moved(chunks[:1], 4 << 20), b.arena) == [False]
                assert a.tier.put(chunks[1:], a.arena).stored == [False]
                assert time.monotonic() - started < HANG_BOUND
            assert not a.tier.healthy and not b.tier.healthy
            assert a.tier.stats().errors >= 1 and not a.tier.stats().healthy

            master.start()  # a new master: every object is gone, clients reconnect
            deadline = time.monotonic() + 60
            while not a.tier.put(chunks[1:], a.arena).stored[0]:
                assert time.monotonic() < deadline, "puts never reached the restarted master"
                time.sleep(0.5)
            assert a.tier.healthy
            deadline = time.monotonic() + 30
            target = moved(chunks[1:], 4 << 20)
            while not b.tier.get(target, b.arena)[0]:
                assert time.monotonic() < deadline, "gets never reached the restarted master"
                time.sleep(0.5)
            assert b.read(target[0]) == a.read(chunks[1])
            assert b.tier.healthy
        finally:
            b.close()
            a.close()


def test_a_forged_object_with_right_checksums_is_a_miss(nodes: list[Node]) -> None:
    """An attacker without the key plants data and a companion (written with Mooncake's own
    client) whose shard sizes and xxh3 checksums are right, under the victim's names: a miss,
    counted, dropped."""
    a, b = nodes
    namespace = f"model-{uuid.uuid4().hex}"
    [chunk] = a.chunks(namespace, 1)
    data, companion = object_names(namespace, chunk.key)
    planted = a.read(chunk) + bytes(16 * len(SHARDS))  # plaintext where ciphertext goes
    assert len(planted) == sealed_size(chunk)
    at = 0
    sums = []
    buffer = bytearray(planted)
    address = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
    for size in SHARDS:
        sums.append(checksum(address + at, size + 16))
        at += size + 16
    forger = ClusterKeys(os.urandom(32))  # the companion format, under another key
    forged = forger.encode_companion(data, SHARDS, sums, [os.urandom(12)] * len(SHARDS))
    client = raw(a.tier)
    assert client.upsert(data, bytes(planted)) == 0
    assert client.upsert(companion, forged) == 0
    errors = b.tier.stats().errors
    [target] = moved([chunk], base=4 << 20)
    assert b.tier.get([target], b.arena) == [False]
    assert b.tier.stats().errors == errors + 1
    assert client.batch_is_exist([data, companion]) == [0, 0]  # dropped


def test_the_pool_holds_no_plaintext(nodes: list[Node]) -> None:
    a, b = nodes
    namespace = f"model-{uuid.uuid4().hex}"
    [chunk] = a.chunks(namespace, 1)
    assert a.tier.put([chunk], a.arena).stored == [True]
    data, companion = object_names(namespace, chunk.key)
    stored = raw(b.tier).get(data)
    assert len(stored) == sealed_size(chunk)
    plain = a.read(chunk)
    for offset, size in ((0, SHARDS[0]), (SHARDS[0], SHARDS[1])):
        assert plain[offset : offset + 64] not in stored
        assert plain[offset + size - 64 : offset + size] not in stored
    assert namespace.encode() not in companion.encode() + data.encode()
    [target] = moved([chunk], base=4 << 20)
    assert b.tier.get([target], b.arena) == [True]
    assert b.read(target) == plain


def test_an_unmapped_tenant_does_not_use_the_cluster(
    master: MooncakeMaster, nodes: list[Node]
) -> None:
    a, _ = nodes
    stranger = Node(master, tenant="u4242")
    other = Node(master, tenant="u1001")  # bob: a named tenant, but not alice
    try:
        namespace = f"model-{uuid.uuid4().hex}"
        chunks = a.chunks(namespace, 2)
        assert a.tier.put(chunks[:1], a.arena).stored == [True]
        key = chunks[0].key
        [target] = moved(chunks[:1], base=4 << 20)
        assert stranger.tier.contains(namespace, [key]) == [False]
        assert stranger.tier.get([target], stranger.arena) == [False]
        assert other.tier.contains(namespace, [key]) == [False]
        assert other.tier.get([target], other.arena) == [False]
        assert stranger.tier.put(chunks[1:], a.arena).stored == [False]
        assert stranger.tier.stats().errors == 0 and stranger.tier.stats().chunks == 0
        assert a.tier.contains(namespace, [chunks[1].key]) == [False]
        assert a.tier.contains(namespace, [key]) == [True]
    finally:
        other.close()
        stranger.close()


@pytest.mark.parametrize("problem", ["missing", "unset", "0644", "short"])
def test_the_tier_refuses_to_open_without_a_good_key(
    master: MooncakeMaster, tmp_path: Any, problem: str
) -> None:
    path = str(tmp_path / "cluster.key")
    if problem != "missing":
        with open(path, "wb") as handle:
            handle.write(os.urandom(31 if problem == "short" else 32))
        os.chmod(path, 0o644 if problem == "0644" else 0o600)
    arena = Arena(f"/dev/shm/offloadd-test-mooncake-{uuid.uuid4().hex}", 1 << 20)
    try:
        with pytest.raises(MooncakeUnavailable, match=r"mooncake\.key_file"):
            MooncakeTier(settings(master, key_file="" if problem == "unset" else path), arena)
    finally:
        arena.close()


# Last: a dead peer's segment stays in the master a while, and puts placed there fail.
def test_a_peer_that_left(master: MooncakeMaster, nodes: list[Node]) -> None:
    """Objects in the segment of a daemon that closed are misses: never garbage, no fault."""
    _, b = nodes
    peer = Node(master)
    try:
        namespace = f"model-{uuid.uuid4().hex}"
        chunks = peer.chunks(namespace, 8)
        assert peer.tier.put(chunks, peer.arena).stored == [True] * 8
        expected = [peer.read(chunk) for chunk in chunks]
    finally:
        peer.close()  # its segment, with whatever objects the master placed there, goes
    keys = [chunk.key for chunk in chunks]
    targets = moved(chunks, base=4 << 20)
    started = time.monotonic()
    found = b.tier.get(targets, b.arena)
    assert time.monotonic() - started < HANG_BOUND
    for ok, target, want in zip(found, targets, expected, strict=True):
        if ok:
            assert b.read(target) == want
    # What was not found is dropped: the next lookup does not offer it again.
    assert b.tier.contains(namespace, keys) == found
    assert b.tier.healthy


def test_a_peer_that_was_killed(master: MooncakeMaster, nodes: list[Node]) -> None:
    """A peer SIGKILLed (its segment gone without a word to the master): its objects are
    quick misses, dropped, never garbage; the tier stays healthy."""
    _, b = nodes
    namespace = f"model-{uuid.uuid4().hex}"
    peer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.mooncake_peer",
            master.address,
            master.metadata,
            namespace,
        ],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert peer.stdout is not None
        line = json.loads(peer.stdout.readline())
    finally:
        peer.kill()
        peer.wait()
        if peer.stdout is not None:
            peer.stdout.close()
    os.unlink(line["arena"])  # what the killed peer could not remove
    published = line["chunks"]
    chunks = [
        ChunkAddress(namespace, bytes.fromhex(key), tuple((o, s) for o, s in extents))
        for key, extents, _ in published
    ]
    targets = moved(chunks, base=4 << 20)
    started = time.monotonic()
    found = b.tier.get(targets, b.arena)
    assert time.monotonic() - started < HANG_BOUND
    for ok, target, (_, _, data) in zip(found, targets, published, strict=True):
        if ok:
            assert b.read(target) == bytes.fromhex(data)
    assert b.tier.contains(namespace, [c.key for c in chunks]) == found
    assert b.tier.healthy

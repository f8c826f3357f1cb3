"""The cluster tier through real daemons and a real ``mooncake_master`` on loopback.

``offloadd serve`` processes (their own arenas and sockets, as nodes would be) share one
master, one cluster key and a ``mooncake.tenants`` mapping that names this test's user
``alice``. An engine on daemon A stores; an engine on daemon B with a cold arena looks the
same keys up: B's lookup is answered from the cluster (on the tier's thread, deferred), the
keys are pending while B promotes them, then hit, and B's load returns A's bytes exactly.
The daemons' own wiring names each namespace's tenant: a daemon where this user has no
cluster name misses, and what someone without the key reads or plants is no use.
"""

from __future__ import annotations

import ctypes
import grp
import json
import os
import shutil
import struct
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from offloadd.checksum import checksum
from offloadd.client import OffloadClient
from offloadd.safety import write_secret
from offloadd.settings import MooncakeSettings
from offloadd.tiers.mooncake import ClusterKeys
from offloadd.tiers.mooncake_client import open_client
from protocol.messages import LookupResult, TierState
from tests.integration.harness import Rank, ServeProcess, chain_keys, chunk_block_ids, make_rank
from tests.mooncake_master import MooncakeMaster, require_mooncake

require_mooncake()

PAGE = 4096
BPC = 2
CHUNKS = 8
LOAD_SLOTS = list(range(CHUNKS, 2 * CHUNKS))
UID, GID = os.getuid(), os.getgid()
ALICE = {"alice": [f"uid:{UID}"]}


@pytest.fixture
def cluster_key() -> Iterator[str]:
    """One cluster key for the test's daemons: 32 random bytes, 0600, in a 0700 directory."""
    directory = tempfile.mkdtemp(prefix="od-key-", dir="/tmp")
    path = os.path.join(directory, "cluster.key")
    write_secret(path, os.urandom(32))
    yield path
    shutil.rmtree(directory, ignore_errors=True)


def config_toml(key_file: str, tenants: dict[str, list[str]], shared_groups: Sequence[str]) -> str:
    """The daemon's settings file: the cluster key and tenants (TOML strings as JSON writes)."""
    lines = ["[tenancy]", f"shared_groups = {json.dumps(list(shared_groups))}"]
    lines += ["[mooncake]", f"key_file = {json.dumps(key_file)}", "[mooncake.tenants]"]
    lines += [f"{name} = {json.dumps(members)}" for name, members in tenants.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as running:
        yield running.start()


@pytest.fixture
def nodes(
    master: MooncakeMaster, cluster_key: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., ServeProcess]]:
    """Daemons started with the cluster tier on one master (set through the environment), the
    cluster key, and ``tenants`` (default: this user is ``alice``) in a settings file."""
    for key, value in {
        "MASTER": master.address,
        "METADATA": master.metadata,
        "SEGMENT": "32MiB",
        "LOCAL_BUFFER": "8MiB",
        "LOCAL_HOSTNAME": "127.0.0.1",
    }.items():
        monkeypatch.setenv(f"OFFLOADD_MOONCAKE__{key}", value)
    started: list[tuple[ServeProcess, str]] = []

    def start(
        lookup_timeout: float = 5.0,
        tenants: dict[str, list[str]] = ALICE,
        shared_groups: Sequence[str] = (),
    ) -> ServeProcess:
        monkeypatch.setenv("OFFLOADD_MOONCAKE__LOOKUP_TIMEOUT", str(lookup_timeout))
        workdir = tempfile.mkdtemp(prefix="od-", dir="/tmp")
        config = os.path.join(workdir, "offloadd.toml")
        with open(config, "w") as handle:
            handle.write(config_toml(cluster_key, tenants, shared_groups))
        arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
        daemon = ServeProcess(workdir, arena, capacity="16MiB", persist=False, config=config)
        started.append((daemon, workdir))
        return daemon.start(log=True)

    yield start
    for daemon, workdir in started:
        daemon.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


def tier_state(client: OffloadClient) -> TierState:
    (state,) = client.stats().tiers
    return state


def poll(check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def rank_on(daemon: ServeProcess, seed: int) -> Rank:
    r = make_rank(daemon.endpoint, tp=1, page=PAGE, num_blocks=2 * CHUNKS * BPC)
    r.fill(seed)
    return r


def test_a_cold_daemon_gets_another_daemons_chunks_from_the_cluster(
    nodes: Callable[..., ServeProcess],
) -> None:
    # A loaded test machine: the lookup waits for the cluster, the answer is what counts.
    a, b = nodes(), nodes()
    on_a, on_b = rank_on(a, 1), rank_on(b, 2)
    try:
        assert on_a.client is not None and on_b.client is not None
        keys = chain_keys(CHUNKS, b"cluster")
        on_a.client.store(1, keys, chunk_block_ids(range(CHUNKS), BPC))
        (done,) = on_a.client.wait([1])
        assert done.ok, done
        client_a = on_a.client
        poll(lambda: tier_state(client_a).demotions == CHUNKS, timeout=120)

        client_b = on_b.client
        first = client_b.lookup(keys)  # deferred: the cluster answers on the tier's thread
        assert first.hits + len(first.pending) == CHUNKS, (first, b.log())
        answers: list[LookupResult] = []

        def settled() -> bool:
            answers.append(client_b.lookup(keys))
            return not answers[-1].pending

        poll(settled)
        assert answers[-1].hits == CHUNKS, b.log()
        client_b.load(2, keys, chunk_block_ids(LOAD_SLOTS, BPC))
        (done,) = client_b.wait([2])
        assert done.ok, done
        got = on_b.pages(chunk_block_ids(LOAD_SLOTS, BPC))
        want = on_a.pages(chunk_block_ids(range(CHUNKS), BPC))
        for layer_got, layer_want in zip(got, want, strict=True):
            assert layer_got.equal(layer_want)
        state = tier_state(client_b)
        assert (state.name, state.promotions, state.promotion_failures) == ("mooncake", 8, 0)
    finally:
        on_a.close()
        on_b.close()


def store_on(r: Rank, job_id: int, keys: list[bytes], slots: list[int]) -> None:
    assert r.client is not None
    r.client.store(job_id, keys, chunk_block_ids(slots, BPC))
    (done,) = r.client.wait([job_id])
    assert done.ok, done


def test_a_master_restart_keeps_local_hits_hangs_nobody_and_publishing_resumes(
    master: MooncakeMaster, nodes: Callable[..., ServeProcess]
) -> None:
    a, b = nodes(lookup_timeout=1.0), nodes(lookup_timeout=1.0)
    on_a, on_b = rank_on(a, 1), rank_on(b, 2)
    try:
        assert on_a.client is not None and on_b.client is not None
        client_a, client_b = on_a.client, on_b.client
        own = chain_keys(2, b"own")
        store_on(on_b, 1, own, [0, 1])
        shared = chain_keys(2, b"before")
        store_on(on_a, 1, shared, [0, 1])
        poll(lambda: tier_state(client_a).demotions >= 2, timeout=120)

        master.kill()
        # B serves its own hits; a lookup that needs the cluster is answered (a miss).
        assert client_b.lookup(own).hits == 2
        missed = client_b.lookup(shared)
        assert (missed.hits, missed.pending) == (0, [])
        assert client_b.lookup(own).hits == 2

        master.start()  # the same ports; every object is gone, the clients reconnect
        # A's new stores reach the cluster again once its client is back: each round
        # stores fresh keys until one round's chunks were written.
        job, written = 10, tier_state(client_a).demotions
        for round_ in range(120):
            fresh = chain_keys(2, b"after%d" % round_)
            slot = 2 + 2 * (round_ % 3)
            store_on(on_a, job + round_, fresh, [slot, slot + 1])
            poll(lambda: not tier_state(client_a).queued_bytes)
            now = tier_state(client_a).demotions
            if now >= written + 2:
                break
            written = now
            time.sleep(0.5)
        else:
            pytest.fail(f"no put reached the restarted master: {a.log()[-2000:]}")
        answers: list[LookupResult] = []

        def settled() -> bool:
            answers.append(client_b.lookup(fresh))
            return not answers[-1].pending and answers[-1].hits == 2

        poll(settled)
        client_b.load(2, fresh, chunk_block_ids(LOAD_SLOTS[:2], BPC))
        (done,) = client_b.wait([2])
        assert done.ok, done
        got = on_b.pages(chunk_block_ids(LOAD_SLOTS[:2], BPC))
        want = on_a.pages(chunk_block_ids([slot, slot + 1], BPC))
        for layer_got, layer_want in zip(got, want, strict=True):
            assert layer_got.equal(layer_want)
    finally:
        on_a.close()
        on_b.close()


def settle(client: OffloadClient, keys: list[bytes]) -> LookupResult:
    """The lookup's answer once nothing is pending (promotions done or failed)."""
    answers: list[LookupResult] = []

    def settled() -> bool:
        answers.append(client.lookup(keys))
        return not answers[-1].pending

    poll(settled)
    return answers[-1]


def forge(names: tuple[str, str], sizes: Sequence[int]) -> tuple[bytes, bytes]:
    """What someone who reaches Mooncake but has no cluster key plants under ``names``: bytes
    of the right sizes (a zero "tag" after each shard) and a companion in the right format
    whose every shard checksum (xxh3 over the stored bytes) is right, MAC'd under another key."""
    shards = [os.urandom(size) + bytes(16) for size in sizes]
    sums = []
    for shard in shards:
        buffer = ctypes.create_string_buffer(shard, len(shard))
        sums.append(checksum(ctypes.addressof(buffer), len(shard)))
    nonces = [os.urandom(12)] * len(sizes)
    companion = ClusterKeys(os.urandom(32)).encode_companion(names[0], sizes, sums, nonces)
    return b"".join(shards), companion


def shard_sizes(companion: bytes) -> list[int]:
    """The shard sizes a companion describes (magic, version, reserved, count; then per shard
    size, checksum, nonce; then the MAC)."""
    (count,) = struct.unpack_from("<I", companion, 8)
    return [struct.unpack_from("<Q", companion, 12 + 28 * index)[0] for index in range(count)]


def test_through_the_daemons_only_a_named_tenant_shares_and_only_sealed_verified_bytes(
    master: MooncakeMaster, cluster_key: str, nodes: Callable[..., ServeProcess]
) -> None:
    # A names this user alice by uid; B by group (a tenancy.shared_groups tenant, g<gid>):
    # the same cluster tenant under two local tenants, as on two nodes whose uids differ.
    # On C this user has no cluster name (alice is another uid there).
    group = grp.getgrgid(GID).gr_name
    a = nodes()
    b = nodes(tenants={"alice": [f"gid:{GID}"]}, shared_groups=[group])
    c = nodes(tenants={"alice": [f"uid:{UID + 1}"]})
    on_a, on_b, on_c = rank_on(a, 1), rank_on(b, 2), rank_on(c, 3)
    attacker: Any = None
    try:
        assert on_a.client is not None and on_b.client is not None and on_c.client is not None
        client_a, client_b, client_c = on_a.client, on_b.client, on_c.client
        namespace = client_a.wait_ready(10).namespace
        assert client_b.wait_ready(10).namespace == namespace  # named alike: the cluster name
        assert client_c.wait_ready(10).namespace != namespace
        keys = chain_keys(CHUNKS, b"named")
        store_on(on_a, 1, keys, list(range(CHUNKS)))
        poll(lambda: tier_state(client_a).demotions == CHUNKS, timeout=120)

        # C: this user is unmapped there: a miss, not a fault; its own stores stay local.
        missed = client_c.lookup(keys)
        assert (missed.hits, missed.pending) == (0, []), c.log()
        store_on(on_c, 1, chain_keys(2, b"c-own"), [0, 1])
        assert client_c.lookup(chain_keys(2, b"c-own")).hits == 2
        state_c = tier_state(client_c)
        assert (state_c.hits, state_c.demotions, state_c.errors, state_c.chunks) == (0, 0, 0, 0)

        # B: alice again, by group: A's chunks are hits, byte-exact.
        assert settle(client_b, keys).hits == CHUNKS, b.log()
        client_b.load(2, keys, chunk_block_ids(LOAD_SLOTS, BPC))
        (done,) = client_b.wait([2])
        assert done.ok, done
        got = on_b.pages(chunk_block_ids(LOAD_SLOTS, BPC))
        want = on_a.pages(chunk_block_ids(range(CHUNKS), BPC))
        for layer_got, layer_want in zip(got, want, strict=True):
            assert layer_got.equal(layer_want)

        # Someone who reaches Mooncake without the key: a raw get of A's chunk is ciphertext.
        attacker = open_client(
            MooncakeSettings(
                master=master.address,
                metadata=master.metadata,
                segment=32 << 20,
                local_buffer=8 << 20,
                local_hostname="127.0.0.1",
            )
        )
        with open(cluster_key, "rb") as handle:
            space = ClusterKeys(handle.read()).space("alice", namespace)
        data, companion = space.names(keys[0])
        assert namespace.split("@")[0] not in data
        stored = attacker.get(data)
        sizes = shard_sizes(attacker.get(companion))
        assert len(stored) == sum(sizes) + 16 * len(sizes) > 0
        for layer in on_a.pages(chunk_block_ids([0], BPC)):
            plain = layer.numpy().tobytes()
            assert plain[:64] not in stored and plain[-64:] not in stored

        # ... and what it plants with right sizes and right plain checksums is a miss on B,
        # counted, and dropped from the cluster.
        target = chain_keys(1, b"forged")
        forged_names = space.names(target[0])
        planted, forged = forge(forged_names, sizes)
        assert attacker.upsert(forged_names[0], planted) == 0
        assert attacker.upsert(forged_names[1], forged) == 0
        before = tier_state(client_b)
        answer = settle(client_b, target)
        assert answer.hits == 0, b.log()
        after = tier_state(client_b)
        assert after.promotion_failures == before.promotion_failures + 1
        assert after.errors == before.errors + 1
        assert after.promotions == before.promotions
        assert attacker.batch_is_exist(list(forged_names)) == [0, 0]
        assert (client_b.lookup(target).hits, client_b.lookup(target).pending) == (0, [])
    finally:
        if attacker is not None:
            attacker.close()
        for r in (on_a, on_b, on_c):
            r.close()

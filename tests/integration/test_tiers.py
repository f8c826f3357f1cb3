"""Tiers below the arena through a real daemon: the disk tier, and a tier answering off the loop.

A daemon whose arena holds 8 chunks stores a working set of 24 (the disk keeps all of them,
written through at commit); lookups report the chunks found on disk as pending, later hit
them, and loads return every byte. A corrupted file is a miss and never served; Clear
removes the tier copies. A tier probed on its own thread (as the cluster tier is) answers
the lookup later, and one that does not answer in time leaves the lookup answered as a miss.
``offloadd demo --phase load`` against a served daemon with a disk tier waits for its
pending keys and verifies every byte promoted from disk.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from offloadd.client import OffloadClient
from offloadd.server.tiers import TierSlot
from offloadd.settings import DiskSettings, MooncakeSettings
from offloadd.tiers import chunkfile
from protocol.messages import LookupResult, TierState
from tests.fakes import DictTier
from tests.integration.conftest import DaemonFactory
from tests.integration.harness import (
    Rank,
    ServeProcess,
    chain_keys,
    chunk_block_ids,
    make_rank,
)

PAGE = 4096
BPC = 2
KEY_BYTES = 3 * BPC * PAGE  # three layers, one shard (tp=1)
ARENA_CHUNKS = 8
WORKING_SET = 24
LOAD_SLOTS = list(range(WORKING_SET, WORKING_SET + ARENA_CHUNKS))  # chunks loaded back here


@pytest.fixture
def rank_factory() -> Iterator[Callable[[str], Rank]]:
    made: list[Rank] = []

    def make(endpoint: str) -> Rank:
        r = make_rank(endpoint, tp=1, page=PAGE, num_blocks=(WORKING_SET + ARENA_CHUNKS) * BPC)
        made.append(r)
        r.fill(7)
        return r

    yield make
    for r in made:
        r.close()


def client_of(r: Rank) -> OffloadClient:
    assert r.client is not None
    return r.client


def tier_state(client: OffloadClient) -> TierState:
    (state,) = client.stats().tiers
    return state


def poll(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def store(r: Rank, job_id: int, keys: list[bytes], slots: list[int], written: int) -> None:
    """Store ``keys`` from chunk ``slots`` and wait until the tier has ``written`` chunks."""
    client = client_of(r)
    client.store(job_id, keys, chunk_block_ids(slots, BPC))
    (done,) = client.wait([job_id])
    assert done.ok, done
    poll(lambda: tier_state(client).demotions >= written and not tier_state(client).queued_bytes)


def store_working_set(r: Rank, keys: list[bytes]) -> None:
    # Two chunks per job: the queue to the tier (a quarter of the arena) takes them all.
    for i in range(0, len(keys), 2):
        store(r, 100 + i, keys[i : i + 2], [i, i + 1], written=i + 2)


def lookup_until_settled(client: OffloadClient, keys: list[bytes]) -> LookupResult:
    """Look up until nothing is pending (promotions ended); returns the last answer."""
    answers: list[LookupResult] = []

    def settled() -> bool:
        answers.append(client.lookup(keys))
        return not answers[-1].pending

    poll(settled)
    return answers[-1]


def load_and_check(r: Rank, job_id: int, keys: list[bytes], slots: list[int]) -> None:
    """Load ``keys`` into the load slots; each must equal the pages it was stored from."""
    client = client_of(r)
    targets = LOAD_SLOTS[: len(keys)]
    client.load(job_id, keys, chunk_block_ids(targets, BPC))
    (done,) = client.wait([job_id])
    assert done.ok, done
    got = r.pages(chunk_block_ids(targets, BPC))
    want = r.pages(chunk_block_ids(slots, BPC))
    for layer_got, layer_want in zip(got, want, strict=True):
        assert layer_got.equal(layer_want)


def disk_daemon(daemon_factory: DaemonFactory, path: Path) -> str:
    daemon = daemon_factory(
        capacity=ARENA_CHUNKS * KEY_BYTES,
        disk=DiskSettings(path=str(path), capacity=64 << 20),
    )
    return daemon.endpoint


def test_welcome_names_only_the_tiers_that_opened(
    daemon_factory: DaemonFactory, rank_factory: Callable[[str], Rank], tmp_path: Path
) -> None:
    daemon = daemon_factory(
        capacity=ARENA_CHUNKS * KEY_BYTES,
        disk=DiskSettings(path=str(tmp_path / "disk"), capacity=64 << 20),
        mooncake=MooncakeSettings(master="127.0.0.1:1"),  # nobody there: the tier stays off
    )
    client = client_of(rank_factory(daemon.endpoint))
    assert client.welcome is not None and client.welcome.tiers == ["disk"]
    assert [tier.name for tier in client.stats().tiers] == ["disk"]


def test_a_working_set_three_times_the_arena_is_served_from_disk(
    daemon_factory: DaemonFactory, rank_factory: Callable[[str], Rank], tmp_path: Path
) -> None:
    r = rank_factory(disk_daemon(daemon_factory, tmp_path / "disk"))
    client = client_of(r)
    assert client.welcome is not None and client.welcome.tiers == ["disk"]
    keys = chain_keys(WORKING_SET, b"ws")
    store_working_set(r, keys)
    stats = client.stats()
    assert stats.committed_entries == ARENA_CHUNKS  # the arena kept the last 8 only
    assert (stats.tiers[0].name, stats.tiers[0].chunks) == ("disk", WORKING_SET)
    for window in range(0, WORKING_SET, ARENA_CHUNKS):
        part = keys[window : window + ARENA_CHUNKS]
        # Each window was evicted by the one before (or by the stores): it is on disk only,
        # promoted and pending meanwhile, and hits once committed.
        first = client.lookup(part)
        assert first.hits + len(first.pending) == ARENA_CHUNKS
        assert lookup_until_settled(client, part).hits == ARENA_CHUNKS
        load_and_check(r, 200 + window, part, list(range(window, window + ARENA_CHUNKS)))
    state = tier_state(client)
    assert state.promotions == WORKING_SET
    assert (state.promotion_failures, state.demotions_skipped, state.errors) == (0, 0, 0)
    assert state.bytes_read >= WORKING_SET * KEY_BYTES
    # Promoted chunks are not written back to the disk they came from.
    assert state.demotions == WORKING_SET


def test_a_corrupted_disk_copy_is_a_miss_and_never_served(
    daemon_factory: DaemonFactory, rank_factory: Callable[[str], Rank], tmp_path: Path
) -> None:
    path = tmp_path / "disk"
    r = rank_factory(disk_daemon(daemon_factory, path))
    client = client_of(r)
    keys = chain_keys(4, b"cor")
    store(r, 1, keys[:2], [0, 1], written=2)
    store(r, 2, keys[2:], [2, 3], written=4)
    others = chain_keys(ARENA_CHUNKS, b"other")
    for i in range(0, ARENA_CHUNKS, 2):
        store(r, 10 + i, others[i : i + 2], [8 + i, 9 + i], written=6 + i)
    # The arena holds the 8 others now; keys are on disk only (a lookup would promote them).
    stats = client.stats()
    assert stats.committed_entries == ARENA_CHUNKS and stats.tiers[0].chunks == 4 + ARENA_CHUNKS
    (namespace,) = {engine.namespace for engine in stats.engines}
    damaged = path / chunkfile.file_name(namespace, keys[1])
    with open(damaged, "r+b") as handle:
        handle.seek(chunkfile.ALIGN + 100)
        byte = handle.read(1)
        handle.seek(chunkfile.ALIGN + 100)
        handle.write(bytes([byte[0] ^ 0xFF]))
    result = lookup_until_settled(client, keys)
    assert result.hits == 1  # keys[1] failed its checksum: the prefix stops there
    state = tier_state(client)
    assert state.promotion_failures == 1
    assert state.chunks == 4 + ARENA_CHUNKS - 1  # the damaged file was dropped
    client.load(30, keys[:2], chunk_block_ids(LOAD_SLOTS[:2], BPC))
    (done,) = client.wait([30], raise_on_failure=False)
    assert not done.ok and done.failed_keys == [keys[1]]
    load_and_check(r, 31, keys[:1], [0])


def test_clear_removes_the_disk_copies(
    daemon_factory: DaemonFactory, rank_factory: Callable[[str], Rank], tmp_path: Path
) -> None:
    r = rank_factory(disk_daemon(daemon_factory, tmp_path / "disk"))
    client = client_of(r)
    keys = chain_keys(4, b"clr")
    store(r, 1, keys[:2], [0, 1], written=2)
    store(r, 2, keys[2:], [2, 3], written=4)
    (namespace,) = {engine.namespace for engine in client.stats().engines}
    files = [tmp_path / "disk" / chunkfile.file_name(namespace, key) for key in keys]
    assert all(file.exists() for file in files)
    assert client.clear() == 4
    poll(lambda: not any(file.exists() for file in files))
    assert tier_state(client).chunks == 0
    result = client.lookup(keys)
    assert (result.hits, result.pending) == (0, [])


def test_a_tier_probed_on_its_thread_answers_the_lookup_later(
    daemon_factory: DaemonFactory, rank_factory: Callable[[str], Rank]
) -> None:
    cluster = DictTier("cluster")
    slot = TierSlot(cluster, 1 << 20, inline=False, lookup_timeout=10.0)
    daemon = daemon_factory(capacity=ARENA_CHUNKS * KEY_BYTES, tiers=[slot])
    r = rank_factory(daemon.endpoint)
    client = client_of(r)
    keys = chain_keys(2 * ARENA_CHUNKS, b"cl")
    store_working_set(r, keys)
    first = keys[:ARENA_CHUNKS]
    answer = client.lookup(first)
    assert answer.pending == list(range(ARENA_CHUNKS))  # the deferred answer found them all
    assert lookup_until_settled(client, first).hits == ARENA_CHUNKS
    load_and_check(r, 50, first, list(range(ARENA_CHUNKS)))
    assert tier_state(client).promotions == ARENA_CHUNKS


def test_a_tier_that_does_not_answer_never_hangs_a_lookup(
    daemon_factory: DaemonFactory, rank_factory: Callable[[str], Rank]
) -> None:
    cluster = DictTier("cluster")
    slot = TierSlot(cluster, 1 << 20, inline=False, lookup_timeout=0.2)
    daemon = daemon_factory(capacity=ARENA_CHUNKS * KEY_BYTES, tiers=[slot])
    r = rank_factory(daemon.endpoint)
    client = client_of(r)
    keys = chain_keys(2 * ARENA_CHUNKS, b"dead")
    store_working_set(r, keys)
    cluster.gate.clear()  # the tier hangs in contains
    try:
        result = client.lookup(keys)
        assert (result.hits, result.pending) == (0, [])  # answered: a miss there
        assert client.lookup(keys[ARENA_CHUNKS:]).hits == ARENA_CHUNKS  # arena hits go on
    finally:
        cluster.gate.set()


def demo(endpoint: str, phase: str, seed: int) -> dict[str, int]:
    options = ["--endpoint", endpoint, "--json", "--phase", phase, "--seed", str(seed)]
    result = subprocess.run(
        [sys.executable, "-m", "offloadd", "demo", *options],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    summary: dict[str, int] = json.loads(result.stdout)
    return summary


def wait_written(endpoint: str, count: int) -> TierState:
    """Poll the daemon's stats until its tier wrote ``count`` chunks and has no queue."""
    with OffloadClient(endpoint, timeout=5, heartbeat=0) as watcher:
        states: list[TierState] = []

        def written() -> bool:
            states[:] = watcher.stats().tiers
            return states[0].demotions >= count and not states[0].queued_bytes

        poll(written)
        return states[0]


@pytest.fixture
def served_with_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[bool], ServeProcess]]:
    """``offloadd serve`` with a disk tier (set through the environment) and a 16 MiB arena:
    exactly the demo's 64 chunks (2 ranks x 128 KiB each)."""
    monkeypatch.setenv("OFFLOADD_DISK__PATH", str(tmp_path / "disk"))
    monkeypatch.setenv("OFFLOADD_DISK__CAPACITY", "256MiB")
    workdir = tempfile.mkdtemp(prefix="od-", dir="/tmp")
    made: list[ServeProcess] = []

    def start(persist: bool) -> ServeProcess:
        arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
        made.append(ServeProcess(workdir, arena, capacity="16MiB", persist=persist).start())
        return made[-1]

    yield start
    for daemon in made:
        daemon.cleanup()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("persist", [False, True], ids=["no-journal", "journal"])
def test_demo_load_verifies_chunks_promoted_from_disk(
    served_with_disk: Callable[[bool], ServeProcess], persist: bool
) -> None:
    # With a journal, promoted chunks are sealed and journaled like a rank's stores.
    daemon = served_with_disk(persist)
    assert demo(daemon.endpoint, "store", 5)["chunks_stored"] == 64
    wait_written(daemon.endpoint, 64)
    assert demo(daemon.endpoint, "store", 6)["chunks_stored"] == 64  # evicts seed 5
    wait_written(daemon.endpoint, 128)
    loaded = demo(daemon.endpoint, "load", 5)
    assert loaded["hits"] == 128 and loaded["mismatches"] == 0
    assert loaded["bytes_verified"] == 2 * 2 * 64 * 2 * 2 * (32 << 10)
    with OffloadClient(daemon.endpoint, timeout=5, heartbeat=0) as client:
        (state,) = client.stats().tiers
    assert state.promotions == 64 and state.promotion_failures == 0
    assert daemon.stop() == 0


def test_disk_chunks_are_served_after_a_kill_and_a_restart_on_a_new_arena(
    served_with_disk: Callable[[bool], ServeProcess],
) -> None:
    daemon = served_with_disk(False)
    assert demo(daemon.endpoint, "store", 5)["chunks_stored"] == 64
    wait_written(daemon.endpoint, 64)
    assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
    daemon.cleanup()  # the arena is gone: only the disk has the chunks
    daemon.arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    daemon.start()
    loaded = demo(daemon.endpoint, "load", 5)
    assert loaded["hits"] == 128 and loaded["mismatches"] == 0
    with OffloadClient(daemon.endpoint, timeout=5, heartbeat=0) as client:
        (state,) = client.stats().tiers
    assert (state.chunks, state.promotions) == (64, 64)
    assert daemon.stop() == 0

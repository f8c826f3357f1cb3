"""The cluster tier through two real daemons and a real ``mooncake_master`` on loopback.

Two ``offloadd serve`` processes (two arenas, two sockets, as two nodes would be) share one
master. An engine on daemon A stores; an engine on daemon B with a cold arena looks the
same keys up: B's lookup is answered from the cluster (on the tier's thread, deferred), the
keys are pending while B promotes them, then hit, and B's load returns A's bytes exactly.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from offloadd.client import OffloadClient
from protocol.messages import LookupResult, TierState
from tests.integration.harness import Rank, ServeProcess, chain_keys, chunk_block_ids, make_rank
from tests.mooncake_master import MooncakeMaster, require_mooncake

require_mooncake()

PAGE = 4096
BPC = 2
CHUNKS = 8
LOAD_SLOTS = list(range(CHUNKS, 2 * CHUNKS))


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as running:
        yield running.start()


@pytest.fixture
def nodes(
    master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., ServeProcess]]:
    """Daemons started with the cluster tier on one master (set through the environment)."""
    for key, value in {
        "MASTER": master.address,
        "METADATA": master.metadata,
        "SEGMENT": "32MiB",
        "LOCAL_BUFFER": "8MiB",
        "LOCAL_HOSTNAME": "127.0.0.1",
    }.items():
        monkeypatch.setenv(f"OFFLOADD_MOONCAKE__{key}", value)
    started: list[tuple[ServeProcess, str]] = []

    def start(lookup_timeout: float = 5.0) -> ServeProcess:
        monkeypatch.setenv("OFFLOADD_MOONCAKE__LOOKUP_TIMEOUT", str(lookup_timeout))
        workdir = tempfile.mkdtemp(prefix="od-", dir="/tmp")
        arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
        daemon = ServeProcess(workdir, arena, capacity="16MiB", persist=False)
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

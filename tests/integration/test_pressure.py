"""A full arena under concurrent stores from three engines (issue 7, item 5).

Most of a small arena is held by chunks that must not be evicted: some pinned by a lookup,
others being loaded (their copies held open by a gate). Six ranks of three engines (three
models, so three namespaces; tp=2 each) then store concurrently, each from its own thread,
while another thread samples the daemon's stats. The outcome the design promises: stores that
find no room are refused key by key (a suffix of each request), counted in ``stores_refused``
and listed in ``JobDone.failed_keys``; ``used_bytes`` never exceeds ``capacity_bytes``; the
pinned and loading chunks survive with their bytes; nothing reaches an INTERNAL error.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from offloadd.client import OffloadClient
from offloadd.transfer.types import Direction
from protocol.messages import DaemonStats, JobDone
from tests.fakes import FakeCopyEngine
from tests.integration.harness import (
    DaemonThread,
    Rank,
    chain_keys,
    chunk_block_ids,
    make_rank,
)

CAPACITY = 4 << 20
PAGE = 4096
BPC = 2
KEY_BYTES = 2 * BPC * PAGE * 3  # two ranks' shards of three layers
PINNED = 30  # chunks pinned by a lookup
LOADING = 40  # chunks being loaded while the others store
ROUNDS = 150  # store requests per rank
MAX_KEYS = 24  # keys per store request; more than the room left, so the tail is refused


@dataclass
class StoreOutcome:
    """What one rank's storing thread saw."""

    jobs: int = 0
    keys: int = 0
    refused: int = 0
    failures: list[str] = field(default_factory=list)


class StatsSampler(threading.Thread):
    """Polls stats as fast as the daemon answers; keeps the peaks."""

    def __init__(self, endpoint: str, stop: threading.Event) -> None:
        super().__init__(name="stats-sampler", daemon=True)
        self.client = OffloadClient(endpoint, heartbeat=0)
        self.stop = stop
        self.samples = 0
        self.max_used = 0
        self.over_capacity: list[DaemonStats] = []
        self.max_jobs_in_flight = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                stats = self.client.stats()
                self.samples += 1
                self.max_used = max(self.max_used, stats.used_bytes)
                self.max_jobs_in_flight = max(self.max_jobs_in_flight, stats.jobs_in_flight)
                if stats.used_bytes > stats.capacity_bytes:
                    self.over_capacity.append(stats)
        except BaseException as exc:
            self.error = exc
        finally:
            self.client.close()


def _store_rounds(rank: Rank, engine: str, outcome: StoreOutcome) -> None:
    """ROUNDS store requests of 1..MAX_KEYS new keys; both ranks of an engine store the same
    keys (the same random choices), as an engine's ranks do."""
    client = rank.client
    assert client is not None
    choices = random.Random(engine)
    for round_index in range(ROUNDS):
        count = choices.randint(1, MAX_KEYS)
        keys = chain_keys(count, salt=f"{engine}-{round_index}".encode())
        job = 1000 + round_index
        try:
            client.store(job, keys, chunk_block_ids(range(count), BPC))
            (done,) = client.wait([job], 30, raise_on_failure=False)
        except Exception as exc:  # any Error reply (INTERNAL included) fails the test
            outcome.failures.append(f"{engine} round {round_index}: {exc!r}")
            continue
        outcome.jobs += 1
        outcome.keys += count
        outcome.refused += len(done.failed_keys)
        problem = _refusal_problem(done, keys)
        if problem:
            outcome.failures.append(f"{engine} round {round_index}: {problem}")


def _refusal_problem(done: JobDone, keys: list[bytes]) -> str:
    if done.error:
        return f"job failed: {done.error}"
    if done.ok != (not done.failed_keys):
        return f"ok={done.ok} with {len(done.failed_keys)} failed keys"
    # A key that finds no room is refused with every later key of the request.
    if done.failed_keys and done.failed_keys != keys[len(keys) - len(done.failed_keys) :]:
        return "refused keys are not the tail of the request"
    return ""


def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.005)


@pytest.mark.timeout(120)
def test_full_arena_refuses_stores_and_keeps_pinned_and_loading_chunks(
    daemon_factory: Callable[..., DaemonThread],
    ranks: list[Rank],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="offloadd.server")
    gate = FakeCopyEngine(held=(Direction.LOAD,))  # stores must churn while loads wait
    daemon = daemon_factory(capacity=CAPACITY, copy_engine=gate)
    engines: dict[str, list[Rank]] = {}
    for name in ("a", "b", "c"):
        engines[name] = [
            make_rank(
                daemon.endpoint, rank=r, tp=2, engine_id=f"pressure-{name}", model=f"model/{name}"
            )
            for r in range(2)
        ]
        ranks.extend(engines[name])
    for seed, rank in enumerate(ranks):
        rank.fill(seed)
        assert rank.client is not None
        rank.client.wait_ready(10)
    a0, a1 = engines["a"]
    assert a0.client is not None and a1.client is not None

    # Engine A fills most of the arena: chunks it pins and chunks it is about to load.
    pinned = chain_keys(PINNED, salt=b"pinned")
    loading = chain_keys(LOADING, salt=b"loading")
    pinned_blocks = chunk_block_ids(range(PINNED), BPC)
    loading_blocks = chunk_block_ids(range(LOADING), BPC, base=2 * PINNED)
    for job, keys, blocks in ((1, pinned, pinned_blocks), (2, loading, loading_blocks)):
        for rank in engines["a"]:
            assert rank.client is not None
            rank.client.store(job, keys, blocks)
        for rank in engines["a"]:
            assert rank.client is not None
            rank.client.wait([job], 10)
    held = (PINNED + LOADING) * KEY_BYTES
    assert held > 0.8 * CAPACITY  # what is left is less than one large store request
    assert a0.client.lookup(pinned, pin=True, lease=600).pinned == PINNED
    gate.gate.clear()
    target = chunk_block_ids(range(LOADING), BPC, base=2 * (PINNED + LOADING))
    for rank in engines["a"]:
        assert rank.client is not None
        rank.client.load(3, loading, target)
    for _ in engines["a"]:
        assert gate.started.acquire(timeout=10), "a load did not reach the gate"
    start = a0.client.stats()
    assert start.jobs_in_flight == 2
    assert start.used_bytes == held

    # Six ranks store at once, each from its own thread, while stats are sampled.
    stop = threading.Event()
    sampler = StatsSampler(daemon.endpoint, stop)
    sampler.start()
    outcomes: dict[str, StoreOutcome] = {}
    threads = []
    for name, engine in engines.items():
        for index, rank in enumerate(engine):
            outcome = outcomes[f"{name}{index}"] = StoreOutcome()
            threads.append(
                threading.Thread(
                    target=_store_rounds, args=(rank, f"pressure-{name}", outcome), daemon=True
                )
            )
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a storing rank did not finish"
    storm_seconds = time.monotonic() - started
    _until(lambda: sampler.samples > 10, 10, "stats samples")
    stop.set()
    sampler.join(10)
    assert sampler.error is None, repr(sampler.error)

    failures = [failure for outcome in outcomes.values() for failure in outcome.failures]
    assert failures == []
    refused = sum(outcome.refused for outcome in outcomes.values())
    stats = a0.client.stats()
    assert refused > 0, "the arena never ran out of room"
    assert stats.stores_refused - start.stores_refused == refused
    assert stats.evictions > 0
    assert sampler.over_capacity == [], sampler.over_capacity[:1]
    assert sampler.max_used <= CAPACITY and stats.used_bytes <= stats.capacity_bytes

    # The chunks being loaded and the pinned ones survived the storm.
    assert stats.jobs_in_flight == 2
    assert a0.client.lookup(loading).hits == LOADING
    assert a0.client.lookup(pinned).hits == PINNED
    gate.gate.set()
    for rank in engines["a"]:
        assert rank.client is not None
        (done,) = rank.client.wait([3], 10)
        assert done.ok and not done.failed_keys
        for got, want in zip(rank.pages(target), rank.pages(loading_blocks), strict=True):
            assert torch.equal(got, want)
    assert a0.client.release(pinned) == PINNED
    for rank in engines["a"]:
        assert rank.client is not None
        rank.client.load(4, pinned, target[: len(pinned_blocks)])
        rank.client.wait([4], 10)
        pages = zip(
            rank.pages(target[: len(pinned_blocks)]), rank.pages(pinned_blocks), strict=True
        )
        for got, want in pages:
            assert torch.equal(got, want)

    # Refusals are logged (at DEBUG: they are expected under pressure); nothing escaped a
    # handler.
    daemon_records = [r for r in caplog.records if r.name.startswith("offloadd.server.")]
    assert not [r for r in daemon_records if "internal error" in r.getMessage()]
    assert not [r for r in daemon_records if r.levelno >= logging.ERROR]
    refusal_lines = [r for r in daemon_records if "refused (no room)" in r.getMessage()]
    assert refusal_lines
    total_keys = sum(outcome.keys for outcome in outcomes.values())
    jobs = sum(outcome.jobs for outcome in outcomes.values())
    print(
        f"\n[pressure] {jobs} store jobs of {total_keys} keys from 6 ranks in "
        f"{storm_seconds:.1f}s: {refused} keys refused ({len(refusal_lines)} refusal log lines), "
        f"{stats.evictions} evictions; {sampler.samples} stats samples, peak used "
        f"{sampler.max_used} of {CAPACITY} bytes, peak jobs in flight "
        f"{sampler.max_jobs_in_flight}; {PINNED} pinned and {LOADING} loading chunks intact"
    )

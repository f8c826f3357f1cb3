"""``offloadd demo``: simulated engines moving real bytes through a real daemon.

Each engine has ``tp`` ranks; each rank owns two shared-memory KV regions (two layers, with a
padded block stride) filled with deterministic pseudo-random bytes that depend only on the
seed and the rank, as identical models fed identical prompts would produce. Engine ``e``
stores the chunks ``i`` with ``i % engines == e``; then every engine looks all chunks up,
loads them into other (zeroed) block ids and compares every byte with what was stored.
Because the expected bytes come from the seed alone, ``--phase store`` in one run and
``--phase load`` in a later run against the same daemon verify the same bytes. Keys a
lookup reports pending (promoted from a tier below the arena) are waited for before loading.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from offloadd.bench._util import one_group_config
from offloadd.client import AsyncOffloadClient
from offloadd.endpoint import replay_beside
from offloadd.errors import DaemonUnavailable
from offloadd.shm import SharedKVTensor
from offloadd.status import fetch_stats
from offloadd.subscriber import Subscriber
from protocol.config import OffloadingConfig
from protocol.events import BlockRemoved, BlockStored

Phase = Literal["store", "load", "both"]

LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
TOKENS_PER_BLOCK = 16
BLOCKS_PER_CHUNK = 2
PAGE_SIZE = 32 << 10
BLOCK_STRIDE = PAGE_SIZE + (4 << 10)  # padded pages: only PAGE_SIZE bytes per block move
CHUNKS_PER_JOB = 16
PENDING_WAIT_SECONDS = 30.0  # how long a load waits for pending keys (tier promotions)


@dataclass
class DemoResult:
    """What ``--json`` prints."""

    phase: str
    engines: int
    tp: int
    chunks: int
    chunks_stored: int
    hits: int
    chunks_loaded: int
    bytes_verified: int
    mismatches: int
    seconds: float
    event_batches: int = 0
    events_stored: int = 0
    events_removed: int = 0


def demo_config(engine: int, rank: int, tp: int) -> OffloadingConfig:
    """The config a rank of demo engine ``engine`` sends (one attention group)."""
    return one_group_config(
        f"demo-engine-{engine}",
        model="offloadd/demo-model",
        layers=LAYERS,
        bytes_per_block=BLOCK_STRIDE * len(LAYERS),
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        rank=rank,
        tp=tp,
        dp=engine,
        tokens_per_block=TOKENS_PER_BLOCK,
        events=True,
        extra={"block_size": TOKENS_PER_BLOCK * BLOCKS_PER_CHUNK},
    )


def demo_keys(seed: int, chunks: int) -> list[bytes]:
    """A hash chain like vLLM's: each chunk key fingerprints the whole prefix (group 0)."""
    keys, parent = [], seed.to_bytes(8, "big")
    for index in range(chunks):
        parent = hashlib.sha256(parent + index.to_bytes(8, "big")).digest()
        keys.append(parent + (0).to_bytes(4, "big"))
    return keys


def source_pages(seed: int, rank: int, layer: int, chunks: int) -> torch.Tensor:
    """The bytes rank ``rank`` holds for ``layer`` in its source blocks (deterministic)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank * 101 + layer)
    blocks = chunks * BLOCKS_PER_CHUNK
    return torch.randint(0, 256, (blocks, PAGE_SIZE), generator=generator, dtype=torch.uint8)


def _batches(items: Sequence[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


class _Rank:
    """One simulated rank: its regions (source half, destination half) and client."""

    def __init__(self, engine: int, rank: int, tp: int, chunks: int, seed: int) -> None:
        self.engine, self.rank, self.chunks, self.seed = engine, rank, chunks, seed
        self.tp = tp
        blocks = 2 * chunks * BLOCKS_PER_CHUNK  # first half: source, second half: destination
        self.tensors = [
            SharedKVTensor.create(blocks, PAGE_SIZE, [layer], block_stride=BLOCK_STRIDE)
            for layer in LAYERS
        ]
        self.client: AsyncOffloadClient | None = None

    def fill_source(self) -> None:
        source = chunk_blocks(range(self.chunks), 0)
        for layer, kv in enumerate(self.tensors):
            kv.tensor[source, :PAGE_SIZE] = source_pages(self.seed, self.rank, layer, self.chunks)

    async def connect(self, endpoint: str) -> None:
        self.client = await AsyncOffloadClient.connect(
            endpoint,
            demo_config(self.engine, self.rank, self.tp),
            [kv.region for kv in self.tensors],
            name=f"demo engine {self.engine} rank {self.rank}",
        )

    def close(self) -> None:
        for kv in self.tensors:
            kv.close()


def chunk_blocks(chunks: Sequence[int] | range, base: int) -> list[int]:
    """Block ids of ``chunks`` starting at block ``base`` (chunk i -> bpc blocks)."""
    return [base + c * BLOCKS_PER_CHUNK + j for c in chunks for j in range(BLOCKS_PER_CHUNK)]


async def _store_phase(ranks: list[_Rank], keys: list[bytes], engines: int) -> int:
    async def store(rank: _Rank) -> int:
        assert rank.client is not None
        mine = [i for i in range(len(keys)) if i % engines == rank.engine]
        job_ids = []
        for job, batch in enumerate(_batches(mine, CHUNKS_PER_JOB)):
            await rank.client.store(job, [keys[i] for i in batch], chunk_blocks(batch, 0))
            job_ids.append(job)
        results = await rank.client.wait(job_ids, timeout=60)
        return sum(len(batch) for batch in _batches(mine, CHUNKS_PER_JOB)) - sum(
            len(r.failed_keys) for r in results
        )

    stored = await asyncio.gather(*(store(rank) for rank in ranks))
    return sum(count for rank, count in zip(ranks, stored, strict=True) if rank.rank == 0)


async def _settled(client: AsyncOffloadClient, keys: list[bytes]) -> None:
    """Look up until no key is pending: being stored, or promoted from a tier below the
    arena (a tiered daemon reports those pending first); gives up after a while."""
    deadline = time.monotonic() + PENDING_WAIT_SECONDS
    while (await client.lookup(keys)).pending and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def _load_phase(ranks: list[_Rank], keys: list[bytes]) -> tuple[int, int, int, int]:
    chunks = len(keys)
    destination_base = chunks * BLOCKS_PER_CHUNK
    hits = loaded = verified = mismatches = 0
    for rank in ranks:
        assert rank.client is not None
        if rank.rank == 0:
            await _settled(rank.client, keys)
            hits += (await rank.client.lookup(keys)).hits

    async def load(rank: _Rank) -> tuple[int, int, int]:
        assert rank.client is not None
        await _settled(rank.client, keys)
        lookup = await rank.client.lookup(keys, pin=True)
        present = list(range(lookup.hits))
        job_ids = []
        for job, batch in enumerate(_batches(present, CHUNKS_PER_JOB), start=1_000_000):
            blocks = chunk_blocks(batch, destination_base)
            await rank.client.load(job, [keys[i] for i in batch], blocks)
            job_ids.append(job)
        await rank.client.wait(job_ids, timeout=60)
        await rank.client.release(keys)
        destination = chunk_blocks(present, destination_base)
        expected_blocks = chunk_blocks(present, 0)
        checked = bad = 0
        for layer, kv in enumerate(rank.tensors):
            expected = source_pages(rank.seed, rank.rank, layer, chunks)[expected_blocks]
            got = kv.pages(destination)
            checked += got.numel()
            if present:
                bad += int((got != expected).view(len(present), -1).any(dim=1).sum())
        return len(present), checked, bad

    results = await asyncio.gather(*(load(rank) for rank in ranks))
    for rank, (count, checked, bad) in zip(ranks, results, strict=True):
        if rank.rank == 0:
            loaded += count
        verified += checked
        mismatches += bad
    return hits, loaded, verified, mismatches


class _EventWatcher:
    """Counts the KV events the daemon publishes while the demo runs."""

    def __init__(self, endpoint: str, replay: str | None) -> None:
        self.subscriber = Subscriber(endpoint, replay)
        self.batches = self.stored = self.removed = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.subscriber.connect()
        self._task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        async for received in self.subscriber:
            self.batches += 1
            for event in received.batch.events:
                if isinstance(event, BlockStored):
                    self.stored += 1
                elif isinstance(event, BlockRemoved):
                    self.removed += 1

    async def settle(self, expected_stored: int, timeout: float = 3.0) -> None:
        """Give in-flight events a moment to arrive (the stream is asynchronous)."""
        deadline = time.monotonic() + timeout
        while self.stored < expected_stored and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.subscriber.close()


async def run_demo(
    endpoint: str,
    *,
    engines: int,
    tp: int,
    chunks: int,
    seed: int,
    phase: Phase,
    events: tuple[str, str | None] | None = None,
) -> DemoResult:
    """Simulate the engines against the daemon at ``endpoint`` (watching ``events``)."""
    started = time.perf_counter()
    keys = demo_keys(seed, chunks)
    ranks = [_Rank(e, r, tp, chunks, seed) for e in range(engines) for r in range(tp)]
    watcher = _EventWatcher(*events) if events else None
    if watcher is not None:
        watcher.start()
    try:
        for rank in ranks:
            rank.fill_source()
        await asyncio.gather(*(rank.connect(endpoint) for rank in ranks))
        for rank in ranks:
            assert rank.client is not None
            await rank.client.wait_ready(timeout=30)
        stored = await _store_phase(ranks, keys, engines) if phase != "load" else 0
        hits = loaded = verified = mismatches = 0
        if phase != "store":
            hits, loaded, verified, mismatches = await _load_phase(ranks, keys)
        if watcher is not None:
            await watcher.settle(stored * engines)
    finally:
        for rank in ranks:
            if rank.client is not None:
                await rank.client.close()
            rank.close()
        if watcher is not None:
            await watcher.close()
    return DemoResult(
        phase=phase,
        engines=engines,
        tp=tp,
        chunks=chunks,
        chunks_stored=stored,
        hits=hits,
        chunks_loaded=loaded,
        bytes_verified=verified,
        mismatches=mismatches,
        seconds=round(time.perf_counter() - started, 3),
        event_batches=watcher.batches if watcher else 0,
        events_stored=watcher.stored if watcher else 0,
        events_removed=watcher.removed if watcher else 0,
    )


def demo_capacity(engines: int, tp: int, chunks: int) -> int:
    """An arena that holds every demo chunk with room to spare."""
    shard = PAGE_SIZE * len(LAYERS) * BLOCKS_PER_CHUNK
    needed = shard * tp * chunks
    return max(64 << 20, (needed * 5 // 4 + (1 << 20)) & ~((1 << 20) - 1))


@contextlib.contextmanager
def spawned_daemon(capacity: int) -> Iterator[tuple[str, tuple[str, str]]]:
    """A daemon subprocess on private endpoints and arena; yields (control, (events, replay))."""
    workdir = tempfile.mkdtemp(prefix="offloadd-demo-")
    endpoint = f"ipc://{workdir}/offloadd.sock"
    events = (f"ipc://{workdir}/events.sock", f"ipc://{workdir}/replay.sock")
    arena = f"/dev/shm/offloadd-demo-{os.getpid()}.arena"
    command = [
        sys.executable,
        "-m",
        "offloadd",
        "serve",
        "--endpoint",
        endpoint,
        "--arena",
        arena,
        "--capacity",
        str(capacity),
        "--log-level",
        "WARNING",
        "--no-persist",
        "--metrics-address",
        "",
        "--events-endpoint",
        events[0],
        "--events-replay-endpoint",
        events[1],
    ]
    process = subprocess.Popen(command)
    try:
        _wait_until_serving(endpoint, process)
        yield endpoint, events
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        # What a daemon that had to be killed left there too: no run leaves a directory.
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_until_serving(endpoint: str, process: subprocess.Popen[bytes]) -> None:
    from offloadd.client import OffloadClient

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"daemon exited with status {process.returncode} at start")
        client = OffloadClient(endpoint, timeout=0.5)
        try:
            client.stats()
            return
        except DaemonUnavailable:
            continue
        finally:
            client.close()
    raise RuntimeError("daemon did not start within 30s")


def daemon_events(endpoint: str) -> tuple[str, str | None] | None:
    """Where the daemon at ``endpoint`` publishes KV events, and its replay socket (None for
    none); None when it publishes no events. Raises DaemonUnavailable."""
    stats = fetch_stats(endpoint)
    if not stats.events_endpoint:
        return None
    return stats.events_endpoint, stats.events_replay_endpoint or None


def main(
    endpoint: str | None,
    *,
    engines: int,
    tp: int,
    chunks: int,
    seed: int,
    phase: Phase,
    as_json: bool,
    events: str | None = None,
) -> int:
    """Run the demo; returns the process exit status (non-zero on any mismatch)."""
    if engines < 1 or tp < 1 or chunks < 1:
        print("--engines, --tp and --chunks must be at least 1", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        watch: tuple[str, str | None] | None = None
        try:
            if endpoint is None:
                capacity = demo_capacity(engines, tp, chunks)
                endpoint, watch = stack.enter_context(spawned_daemon(capacity))
            elif events is None:
                watch = daemon_events(endpoint)
            if events == "none":
                watch = None
            elif events:
                watch = (events, replay_beside(events) or None)
            result = asyncio.run(
                run_demo(
                    endpoint,
                    engines=engines,
                    tp=tp,
                    chunks=chunks,
                    seed=seed,
                    phase=phase,
                    events=watch,
                )
            )
        except DaemonUnavailable as exc:
            print(f"offloadd demo: {exc}", file=sys.stderr)
            return 1
    if as_json:
        print(json.dumps(asdict(result)))
    else:
        _print_summary(result)
    expected_hits = chunks * engines if phase != "store" else 0
    ok = result.mismatches == 0 and result.hits == expected_hits
    return 0 if ok else 1


def _print_summary(result: DemoResult) -> None:
    print(
        f"offloadd demo: {result.engines} engines x TP={result.tp}, {result.chunks} chunks, "
        f"phase {result.phase}"
    )
    if result.phase != "load":
        print(f"  stored    {result.chunks_stored} chunks (shared namespace, split across engines)")
    if result.phase != "store":
        print(f"  lookups   {result.hits} hits of {result.chunks * result.engines} keys")
        print(f"  loaded    {result.chunks_loaded} chunks into other block ids")
        print(
            f"  verified  {result.bytes_verified / 2**20:.1f} MiB, "
            f"{result.mismatches} mismatched shards"
        )
    print(
        f"  events    {result.event_batches} batches: {result.events_stored} BlockStored, "
        f"{result.events_removed} BlockRemoved"
    )
    print(f"  took      {result.seconds:.2f}s")

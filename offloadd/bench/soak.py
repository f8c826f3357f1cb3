"""Soak: two engines of four ranks each against a daemon subprocess, mixed traffic, bounded time.

``python -m offloadd.bench.soak [--seconds 300] [--json FILE] [--seed S]``

The daemon is ``offloadd serve`` in a subprocess (its RSS and ``/proc/<pid>/fd`` are its
own), with a small arena so that eviction runs all the time. Two engines (``soak-a`` and
``soak-b``, tp=4 each, the same model and geometry, so one shared namespace: a chunk stored
by one engine is loaded by the other) are driven by one thread each, their eight ranks real
``OffloadClient``s on shared-memory regions. Every chunk's bytes are a function of (key,
rank, layer, block), so whichever engine loads a chunk can check every byte it got.

Operations, drawn at random by each engine's thread:

- ``store``: look up a new or extended sequence, store its missing chunks from all ranks;
- ``load``: look up (pinning) a sequence either engine stored, load the hits into every rank,
  compare every byte, release the pins;
- ``lookup``: random keys, some pinned and released at once;
- ``restart``: close a rank's client and connect a new one for the same rank (sometimes with
  its store still in flight: that sequence then becomes visible whole or not at all).

After a warm-up the workload pauses at a quiescent point and the daemon's RSS, open file
descriptors and ``stats().imports`` are sampled; they are sampled again at the end. The
daemon's bounded caches (replay buffer, finished jobs per session) are shrunk so that they are
full by then (``BOUNDED_CACHES``): what grows after the warm-up is a leak. Results
(a table on stdout, then JSON): throughput in the second half against the first half,
RSS, fds and imports at the end against the start, and byte mismatches against chunks checked.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from offloadd.bench._util import IMPORT_ROOT, Result, chain_keys, one_group_config, ratio
from offloadd.client import OffloadClient
from offloadd.errors import DaemonUnavailable
from offloadd.shm import SharedKVTensor
from protocol.config import (
    OffloadingConfig,
)

MiB = 1 << 20
LAYERS = ("layer.0", "layer.1", "layer.2")
PAGE = 4096
BLOCKS = 256  # per region: [0, 128) stores from, [128, 256) loads into
BPC = 2  # blocks per chunk
TP = 4
ENGINES = ("soak-a", "soak-b")
MAX_CHUNKS = 12  # chunks per sequence
RECENT = 40  # sequences loads pick from: about what a 32 MiB arena holds (older: evicted)
SHM_PREFIX = "od-soak"
OPERATIONS = {"store": 35, "load": 35, "lookup": 25, "restart": 0.5}
# The daemon's bounded caches, shrunk so that they fill up during the warm-up: growth after it
# is then a leak, not a buffer still filling (defaults: 10,000 event batches kept for replay,
# 4,096 finished jobs remembered per session).
BOUNDED_CACHES = {"OFFLOADD_EVENTS__BUFFER_STEPS": "1000", "OFFLOADD_SERVER__RECENT_JOBS": "256"}


def expected_page(key: bytes, rank: int, layer: int, block: int) -> bytes:
    """The bytes of one page of one chunk: every rank's shard differs, any loader can check."""
    return hashlib.shake_128(key + bytes((rank, layer, block))).digest(PAGE)


def make_config(engine_id: str, rank: int) -> OffloadingConfig:
    return one_group_config(
        engine_id,
        model="soak/model",
        layers=LAYERS,
        bytes_per_block=PAGE * len(LAYERS),
        blocks_per_chunk=BPC,
        rank=rank,
        tp=TP,
        events=True,
    )


def sequence_keys(name: str, count: int) -> list[bytes]:
    """Chained 32-byte hashes + u32be group 0: extending a sequence keeps its prefix."""
    return chain_keys(count, name.encode())


def chunk_blocks(chunks: int, base: int) -> list[int]:
    return [base + c * BPC + j for c in range(chunks) for j in range(BPC)]


class DaemonProcess:
    """``python -m offloadd serve`` on private ipc endpoints and a private arena."""

    def __init__(self, capacity: int) -> None:
        self.workdir = tempfile.mkdtemp(prefix="od-soak-", dir="/tmp")
        self.endpoint = f"ipc://{self.workdir}/d.sock"
        self.arena = f"/dev/shm/{SHM_PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:8]}.arena"
        command = [
            sys.executable, "-m", "offloadd", "serve",
            "--endpoint", self.endpoint, "--arena", self.arena,
            "--capacity", f"{capacity // MiB}MiB", "--no-persist",
            "--events-endpoint", f"ipc://{self.workdir}/events.sock",
            "--events-replay-endpoint", f"ipc://{self.workdir}/replay.sock",
            "--log-level", "WARNING",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD_")}
        env.update(BOUNDED_CACHES)
        env["PYTHONPATH"] = IMPORT_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.process = subprocess.Popen(command, env=env)
        self.monitor = OffloadClient(self.endpoint, timeout=0.5, heartbeat=0)
        try:
            deadline = time.monotonic() + 60
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the daemon exited with {self.process.returncode}")
                try:
                    self.monitor.stats()
                    break
                except DaemonUnavailable:
                    if time.monotonic() > deadline:
                        raise
            self.monitor.timeout = 30.0
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def rss(self) -> int:
        """Resident bytes (the pre-faulted arena included, as shared memory)."""
        with open(f"/proc/{self.pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def close(self) -> None:
        """SIGTERM, wait, SIGKILL if it hangs; remove the sockets and the arena. Idempotent."""
        self.monitor.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.arena)
        shutil.rmtree(self.workdir, ignore_errors=True)


class SoakRank:
    """One rank: three shared-memory regions and a client that may be replaced (restart)."""

    def __init__(self, endpoint: str, engine_id: str, rank: int) -> None:
        self.endpoint = endpoint
        self.engine_id = engine_id
        self.rank = rank
        self.tensors = [
            SharedKVTensor.create(BLOCKS, PAGE, [layer], prefix=SHM_PREFIX) for layer in LAYERS
        ]
        self.client = self.connect()
        self.next_job = 1

    def connect(self) -> OffloadClient:
        return OffloadClient.connect(
            self.endpoint,
            make_config(self.engine_id, self.rank),
            [kv.region for kv in self.tensors],
            name=f"{self.engine_id}/{self.rank}",
            timeout=30.0,
        )

    def job(self) -> int:
        self.next_job += 1
        return self.next_job

    def write_source(self, keys: Sequence[bytes], blocks: Sequence[int]) -> None:
        for index, key in enumerate(keys):
            for layer, kv in enumerate(self.tensors):
                for j in range(BPC):
                    page = bytearray(expected_page(key, self.rank, layer, j))
                    kv.tensor[blocks[index * BPC + j]] = torch.frombuffer(page, dtype=torch.uint8)

    def scribble(self, blocks: Sequence[int]) -> None:
        """Overwrite load targets, so that a load that wrote nothing cannot pass."""
        for kv in self.tensors:
            kv.tensor[list(blocks)] = 0xA5

    def mismatches(self, keys: Sequence[bytes], blocks: Sequence[int]) -> int:
        """Pages of ``keys`` in ``blocks`` whose bytes are not what was stored."""
        wrong = 0
        for index, key in enumerate(keys):
            for layer, kv in enumerate(self.tensors):
                for j in range(BPC):
                    got = kv.tensor[blocks[index * BPC + j]].numpy().tobytes()
                    wrong += got != expected_page(key, self.rank, layer, j)
        return wrong

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        for kv in self.tensors:
            kv.close()


@dataclass
class Shared:
    """Sequences either engine stored (one namespace), guarded by a lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sequences: list[tuple[str, int, str]] = field(default_factory=list)  # name, chunks, by

    def add(self, name: str, chunks: int, engine: str) -> None:
        with self.lock:
            self.sequences.append((name, chunks, engine))
            del self.sequences[:-RECENT]

    def pick(self, rng: random.Random) -> tuple[str, int, str] | None:
        with self.lock:
            return rng.choice(self.sequences) if self.sequences else None


@dataclass
class Pause:
    """Asks the engine threads to stop between operations (``requested``) until ``resumed``."""

    requested: threading.Event = field(default_factory=threading.Event)
    resumed: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.resumed.set()

    def release(self) -> None:
        self.requested.clear()
        self.resumed.set()


@dataclass
class EngineTally:
    """What one engine's thread did."""

    ops: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    chunks_stored: int = 0
    chunks_verified: int = 0
    bytes_verified: int = 0
    page_mismatches: int = 0
    cross_engine_loads: int = 0
    load_misses: int = 0  # sequences evicted before a load (counted, not an error)
    refused_keys: int = 0
    restarts_mid_job: int = 0
    torn_sequences: int = 0  # a sequence partly visible after a mid-job restart: must be 0
    errors: list[str] = field(default_factory=list)
    op_times: list[float] = field(default_factory=list)  # monotonic time of each finished op


class EngineDriver(threading.Thread):
    """Drives one engine's four ranks through random operations until told to stop."""

    def __init__(
        self,
        ranks: list[SoakRank],
        shared: Shared,
        seed: int,
        stop: threading.Event,
        pause: Pause,
    ) -> None:
        super().__init__(name=f"soak-{ranks[0].engine_id}", daemon=True)
        self.ranks = ranks
        self.engine_id = ranks[0].engine_id
        self.shared = shared
        self.rng = random.Random(seed)
        self.stop = stop
        self.pause = pause
        self.paused = threading.Event()
        self.tally = EngineTally()
        self.sequences = 0

    def run(self) -> None:
        names, weights = zip(*OPERATIONS.items(), strict=True)
        while not self.stop.is_set():
            if self.pause.requested.is_set():
                self.paused.set()
                self.pause.resumed.wait()  # quiescent while the daemon is sampled
                self.paused.clear()
                continue
            operation = self.rng.choices(names, weights)[0]
            try:
                getattr(self, operation)()
            except Exception as exc:
                self.tally.errors.append(f"{operation}: {exc!r}")
                if len(self.tally.errors) > 20:
                    return
            self.tally.ops[operation] += 1
            self.tally.op_times.append(time.monotonic())

    def _wait_all(self, jobs: list[tuple[SoakRank, int]]) -> list[Any]:
        results = []
        for rank, job in jobs:
            (done,) = rank.client.wait([job], 30, raise_on_failure=False)
            results.append(done)
        return results

    def store(self) -> None:
        rng, tally = self.rng, self.tally
        extend = self.shared.pick(rng) if rng.random() < 0.3 else None
        if extend is not None:  # a longer version of a sequence: its prefix may be cached
            name, chunks = extend[0], min(MAX_CHUNKS, extend[1] + rng.randint(1, 4))
        else:
            self.sequences += 1
            name, chunks = f"{self.engine_id}-{self.sequences}", rng.randint(1, MAX_CHUNKS)
        keys = sequence_keys(name, chunks)
        lookup = self.ranks[0].client.lookup(keys)
        tally.requests += 1
        missing = keys[lookup.hits :]
        if not missing:
            return
        blocks = chunk_blocks(len(missing), 0)
        jobs = []
        for rank in self.ranks:
            rank.write_source(missing, blocks)
            job = rank.job()
            rank.client.store(job, missing, blocks)
            jobs.append((rank, job))
        tally.requests += 2 * len(jobs)
        results = self._wait_all(jobs)
        refused = max(len(done.failed_keys) for done in results)
        tally.refused_keys += refused
        failed = [done.error for done in results if done.error]
        if failed:
            raise RuntimeError(f"store failed: {failed[0]}")
        tally.chunks_stored += len(missing) - refused
        if refused == 0:
            self.shared.add(name, chunks, self.engine_id)

    def load(self) -> None:
        rng, tally = self.rng, self.tally
        picked = self.shared.pick(rng)
        if picked is None:
            return
        name, chunks, by = picked
        keys = sequence_keys(name, chunks)
        first = self.ranks[0].client
        lookup = first.lookup(keys, pin=True, lease=60)
        tally.requests += 1
        if lookup.hits == 0:
            tally.load_misses += 1
            return
        hits = keys[: lookup.hits]
        blocks = chunk_blocks(len(hits), BLOCKS // 2)
        jobs = []
        for rank in self.ranks:
            rank.scribble(blocks)
            job = rank.job()
            rank.client.load(job, hits, blocks)
            jobs.append((rank, job))
        tally.requests += 2 * len(jobs)
        results = self._wait_all(jobs)
        failed = [done for done in results if not done.ok]
        if failed:  # pinned hits must load
            raise RuntimeError(f"load of pinned hits failed: {failed[0]}")
        for rank in self.ranks:
            tally.page_mismatches += rank.mismatches(hits, blocks)
        tally.chunks_verified += len(hits) * len(self.ranks)
        tally.bytes_verified += len(hits) * len(self.ranks) * len(LAYERS) * BPC * PAGE
        tally.cross_engine_loads += by != self.engine_id
        released = first.release(hits)
        tally.requests += 1
        if released != len(hits):
            raise RuntimeError(f"released {released} pins of {len(hits)}")

    def lookup(self) -> None:
        rng = self.rng
        picked = self.shared.pick(rng)
        keys = sequence_keys(picked[0], picked[1]) if picked else []
        keys += sequence_keys(f"absent-{rng.randrange(1 << 30)}", rng.randint(1, 4))
        rank = rng.choice(self.ranks)
        pin = rng.random() < 0.5
        result = rank.client.lookup(keys, pin=pin, lease=30)
        self.tally.requests += 1
        if pin and result.pinned:
            if rank.client.release(keys[: result.hits]) != result.pinned:
                raise RuntimeError("pins not released")
            self.tally.requests += 1

    def restart(self) -> None:
        rng, tally = self.rng, self.tally
        victim = rng.choice(self.ranks)
        if rng.random() < 0.5:
            victim.client.close()
            victim.client = victim.connect()
            tally.requests += 2
            victim.client.wait_ready(30)
            return
        # Mid-job: the victim's store is in flight when its session ends.
        self.sequences += 1
        name = f"{self.engine_id}-{self.sequences}"
        keys = sequence_keys(name, rng.randint(1, MAX_CHUNKS))
        blocks = chunk_blocks(len(keys), 0)
        jobs = []
        for rank in self.ranks:
            rank.write_source(keys, blocks)
            job = rank.job()
            rank.client.store(job, keys, blocks)
            jobs.append((rank, job))
        victim.client.close()
        victim.client = victim.connect()
        tally.requests += len(jobs) + 2
        self._wait_all([(rank, job) for rank, job in jobs if rank is not victim])
        victim.client.wait_ready(30)
        hits = self.ranks[0].client.lookup(keys).hits
        tally.requests += 1
        tally.restarts_mid_job += 1
        if hits not in (0, len(keys)):
            tally.torn_sequences += 1
        elif hits == len(keys):
            self.shared.add(name, len(keys), self.engine_id)


@dataclass
class Sample:
    """The daemon at a quiescent point."""

    at: float
    rss: int
    fds: int
    imports: int
    sessions: int


@dataclass
class SoakReport:
    """Everything a soak run measured."""

    seconds: float
    warmup: float
    start: Sample
    end: Sample
    max_rss: int
    tallies: list[EngineTally]
    daemon_alive: bool
    final_stats: Any

    @property
    def ops(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for tally in self.tallies:
            total.update(tally.ops)
        return total

    def total(self, name: str) -> int:
        return sum(getattr(tally, name) for tally in self.tallies)

    @property
    def errors(self) -> list[str]:
        return [error for tally in self.tallies for error in tally.errors]

    def rates(self) -> tuple[float, float]:
        """Operations per second in the first and second half of the measured window."""
        middle = (self.start.at + self.end.at) / 2
        times = [t for tally in self.tallies for t in tally.op_times if t >= self.start.at]
        first = sum(t < middle for t in times)
        half = (self.end.at - self.start.at) / 2
        return first / half, (len(times) - first) / half


def run_soak(
    seconds: float,
    *,
    seed: int = 0,
    capacity: int = 32 * MiB,
    warmup: float | None = None,
    progress: Any = None,
) -> SoakReport:
    """Run the soak for ``seconds`` (warm-up included) and report what it measured."""
    say = progress or (lambda message: None)
    warmup = warmup if warmup is not None else min(30.0, max(3.0, seconds * 0.2))
    daemon = DaemonProcess(capacity)
    ranks: list[SoakRank] = []
    stop, pause = threading.Event(), Pause()
    drivers: list[EngineDriver] = []
    try:
        for engine_id in ENGINES:
            engine = [SoakRank(daemon.endpoint, engine_id, rank) for rank in range(TP)]
            ranks.extend(engine)
            for rank in engine:
                rank.client.wait_ready(30)
        shared = Shared()
        drivers = [
            EngineDriver(ranks[i * TP : (i + 1) * TP], shared, seed * 100 + i, stop, pause)
            for i in range(len(ENGINES))
        ]
        began = time.monotonic()
        for driver in drivers:
            driver.start()
        say(f"soak: {len(ENGINES)} engines x {TP} ranks, daemon pid {daemon.pid}")
        max_rss = 0
        start: Sample | None = None
        deadline = began + seconds
        next_report = began + 10
        while time.monotonic() < deadline and all(d.is_alive() for d in drivers):
            if start is None and time.monotonic() >= began + warmup:
                start = _quiescent_sample(daemon, drivers, pause)
                say(f"start: rss {start.rss / MiB:.1f} MiB, fds {start.fds}, "
                    f"imports {start.imports}")  # fmt: skip
            rss = daemon.rss()
            max_rss = max(max_rss, rss)
            if time.monotonic() >= next_report:
                next_report += 10
                done = sum(sum(d.tally.ops.values()) for d in drivers)
                say(f"{done} operations, rss {rss / MiB:.1f} MiB, fds {daemon.fds()}")
            stop.wait(min(1.0, max(0.0, deadline - time.monotonic())))
        if start is None:
            start = _quiescent_sample(daemon, drivers, pause)
        stop.set()
        for driver in drivers:
            driver.join(60)
        end = _sample(daemon)
        max_rss = max(max_rss, end.rss)
        say(f"end: rss {end.rss / MiB:.1f} MiB, fds {end.fds}, imports {end.imports}")
        return SoakReport(
            seconds=seconds,
            warmup=warmup,
            start=start,
            end=end,
            max_rss=max_rss,
            tallies=[driver.tally for driver in drivers],
            daemon_alive=daemon.alive(),
            final_stats=daemon.monitor.stats(),
        )
    finally:
        stop.set()
        pause.release()
        for driver in drivers:
            driver.join(60)
        for rank in ranks:
            rank.close()
        daemon.close()
        for name in os.listdir("/dev/shm"):  # anything a crash left behind
            if name.startswith(f"{SHM_PREFIX}-{os.getpid()}-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", name))


def _sample(daemon: DaemonProcess) -> Sample:
    stats = daemon.monitor.stats()
    return Sample(time.monotonic(), daemon.rss(), daemon.fds(), stats.imports, stats.sessions)


def _quiescent_sample(daemon: DaemonProcess, drivers: list[EngineDriver], pause: Pause) -> Sample:
    """Sample between operations, when no rank is restarting and no job is in flight."""
    pause.resumed.clear()
    pause.requested.set()
    try:
        deadline = time.monotonic() + 60
        for driver in drivers:
            while driver.is_alive() and not driver.paused.wait(0.1):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{driver.name} did not pause")
        return _sample(daemon)
    finally:
        pause.release()


def results(report: SoakReport) -> list[Result]:
    """The benchmark's figures, each against its baseline from the same run."""
    ops = report.ops
    first, second = report.rates()
    params: dict[str, Any] = {
        "seconds": report.seconds,
        "warmup_seconds": report.warmup,
        "engines": len(ENGINES),
        "ranks_per_engine": TP,
        "namespace": "shared (same model and geometry)",
        "daemon_environment": BOUNDED_CACHES,
        "operations": dict(ops),
        "requests": report.total("requests"),
        "restarts_mid_job": report.total("restarts_mid_job"),
        "cross_engine_loads": report.total("cross_engine_loads"),
        "load_misses": report.total("load_misses"),
        "refused_keys": report.total("refused_keys"),
        "errors": report.errors[:5],
    }
    rss_start, rss_end = report.start.rss / MiB, report.end.rss / MiB
    checked = report.total("chunks_verified") * len(LAYERS) * BPC  # pages
    mismatches = report.total("page_mismatches") + report.total("torn_sequences")
    out = [
        Result("soak_ops_per_s", second, "ops/s", first, ratio(second, first),
               {**params, "baseline": "the first half of the measured window",
                "goal": "ratio >= 0.7"}),
        Result("soak_daemon_rss", rss_end, "MiB", rss_start, ratio(rss_end, rss_start),
               {"baseline": "after warm-up", "max_mib": report.max_rss / MiB,
                "goal": f"value <= {rss_start + min(20.0, rss_start / 10):.1f}"}),
        Result("soak_daemon_fds", report.end.fds, "fds", report.start.fds,
               ratio(report.end.fds, report.start.fds),
               {"baseline": "after warm-up", "goal": f"value <= {report.start.fds + 2}"}),
        Result("soak_daemon_imports", report.end.imports, "mappings", report.start.imports,
               ratio(report.end.imports, report.start.imports),
               {"baseline": "after warm-up", "goal": f"value <= {report.start.imports}"}),
        Result("soak_byte_mismatches", mismatches, "pages", checked, ratio(mismatches, checked),
               {"baseline": "pages checked (every page of every rank of every chunk loaded)",
                "bytes_checked": report.total("bytes_verified"),
                "torn_sequences": report.total("torn_sequences"), "goal": "value <= 0"}),
    ]  # fmt: skip
    for result in out:
        kind, op, limit = result.params["goal"].split()
        value = result.ratio if kind == "ratio" else result.value
        result.params["goal_met"] = value >= float(limit) if op == ">=" else value <= float(limit)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offloadd.bench.soak", description=__doc__)
    parser.add_argument("--seconds", type=float, default=300.0, help="run time (warm-up included)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capacity", type=int, default=32, help="arena MiB (small: evictions)")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    args = parser.parse_args(argv)
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[soak {time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    report = run_soak(args.seconds, seed=args.seed, capacity=args.capacity * MiB, progress=progress)
    figures = results(report)
    from offloadd.bench import format_table

    print(format_table(figures))
    document = [figure.as_json() for figure in figures]
    print(json.dumps(document, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=2)
            handle.write("\n")
    progress(
        f"{sum(report.ops.values())} operations, {report.total('requests')} requests, "
        f"{report.total('chunks_verified')} chunks checked, errors: {len(report.errors)}"
    )
    correct = not report.errors and report.daemon_alive and figures[-1].value == 0
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())

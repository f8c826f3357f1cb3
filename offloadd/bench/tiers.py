"""Tiers below the arena through real daemons: what a disk tier buys, what the cluster costs.

- ``tiers_hit_rate_disk4x``: chunk hit rate of a prefix-sharing workload on a daemon with a
  disk tier of 4x its arena (value) vs a daemon with the same arena and no tier (baseline).
  ``tiers_request_time_disk4x``: milliseconds per request of the same two (value: with disk).
  Both daemons run at once and get the same requests, interleaved one by one: DOCS
  documents (system prompts) of DOC_CHUNKS chunks each, drawn with Zipf-like popularity;
  each request is a whole document plus SUFFIX_CHUNKS chunks of its own. Per request:
  look up (with the disk, again until nothing is pending: the chunks found on disk are
  being promoted), load the hits (bytes checked on every VERIFY_EVERY-th request), store
  the rest. Hit rate = document chunks hit / document chunks asked for (first touches
  included, the same for both). The disk directory is under /var/tmp (a real disk, not
  /dev/shm); the disk tier runs as configured (direct I/O where the file system allows).
- ``mooncake_daemon_publish``: GiB/s from an engine on daemon A storing N chunks until A's
  cluster tier has written them all (its ``demotions`` counter, nothing queued); baseline:
  raw ``batch_put_from`` of the same chunk bytes by a Mooncake client of this process.
- ``mooncake_daemon_promote``: GiB/s from an engine on daemon B (cold arena) looking the
  same keys up (deferred, pending while B promotes them, then hits) to its load of all of
  them done; baseline: raw ``batch_get_into`` of the raw objects by a second client.

The cluster is a ``mooncake_master`` on 127.0.0.1 with two daemon subprocesses and two raw
clients in this process, all over loopback TCP. Reps alternate daemon and raw sides and each
pair is compared; every rep uses fresh keys and removes them after. Skipped when mooncake is
not installed (``pip install 'offloadd[mooncake]'``).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import itertools
import os
import random
import shutil
import tempfile
import time
import uuid

from offloadd.bench._util import Context, Result, ServerProcess, median, paired_ratio, ratio
from offloadd.bench.datapath import BLOCKS_PER_CHUNK, LAYERS, RankMemory, daemon_settings
from offloadd.bench.datapath import engine_config as _engine_config
from offloadd.client import OffloadClient

GiB = 1 << 30
SEED = 20261201
JOB_CHUNKS = 16  # chunks per store or load job

# The hit-rate workload.
HIT_PAGE = 16 << 10  # chunk: LAYERS * BLOCKS_PER_CHUNK pages = 256 KiB
ARENA_CHUNKS = 64
DISK_FACTOR = 4
DOCS = 40  # 40 * 8 document chunks: 5x the arena
DOC_CHUNKS = 8
SUFFIX_CHUNKS = 2
ZIPF = 0.9
VERIFY_EVERY = 8
PENDING_WAIT = 30.0  # seconds a request waits for its pending keys

# The cluster comparison.
CLUSTER_PAGE = 64 << 10  # chunk: 1 MiB


def _engine(endpoint: str, engine_id: str, page: int, memory: RankMemory, slots: int) -> OffloadClient:
    config = _engine_config(engine_id, 0, 1, page)
    client = OffloadClient.connect(
        endpoint,
        config,
        memory.regions(page, slots * BLOCKS_PER_CHUNK),
        name=f"bench {engine_id}",
        files=memory.files_by_path(),
    )
    try:
        client.wait_ready(30)
    except BaseException:
        client.close()
        raise
    return client


def _blocks(slots: range | list[int]) -> list[int]:
    return [s * BLOCKS_PER_CHUNK + b for s in slots for b in range(BLOCKS_PER_CHUNK)]


def _slot_bytes(memory: RankMemory, page: int, slot: int, layer: int) -> memoryview:
    span = BLOCKS_PER_CHUNK * page
    flat = memory.flat(layer)[slot * span : (slot + 1) * span]
    return memoryview(flat.numpy())


def _content(key: bytes, layer: int, nbytes: int) -> bytes:
    """What chunk ``key`` holds in ``layer``: derived from the key, so any load can be checked."""
    return hashlib.sha256(key + bytes([layer])).digest() * (nbytes // 32)


def _settle(client: OffloadClient, keys: list[bytes]) -> tuple[int, int]:
    """Look up until nothing is pending; (hits, lookups made)."""
    deadline = time.monotonic() + PENDING_WAIT
    for count in itertools.count(1):
        answer = client.lookup(keys)
        if not answer.pending or time.monotonic() > deadline:
            return answer.hits, count
        time.sleep(0.001)
    raise AssertionError("unreachable")


def _run_jobs(
    client: OffloadClient, kind: str, keys: list[bytes], slots: list[int], jobs: itertools.count[int]
) -> bool:
    """Store or load ``keys`` from/into chunk ``slots`` in jobs of JOB_CHUNKS; all ok?"""
    ids = []
    for start in range(0, len(keys), JOB_CHUNKS):
        job = next(jobs)
        part, where = keys[start : start + JOB_CHUNKS], _blocks(slots[start : start + JOB_CHUNKS])
        if kind == "store":
            client.store(job, part, where)
        else:
            client.load(job, part, where)
        ids.append(job)
    if not ids:
        return True
    return all(done.ok for done in client.wait(ids, timeout=120, raise_on_failure=False))


class _Workload:
    """The deterministic request stream: (document, its keys + this request's own keys)."""

    def __init__(self, requests: int) -> None:
        rng = random.Random(SEED)
        self.documents = [self._chain(b"doc%d" % d, DOC_CHUNKS) for d in range(DOCS)]
        weights = list(itertools.accumulate(1 / (rank + 1) ** ZIPF for rank in range(DOCS)))
        order = list(range(DOCS))
        rng.shuffle(order)  # popularity rank -> document
        self.requests: list[tuple[int, list[bytes]]] = []
        for index in range(requests):
            pick = bisect.bisect(weights, rng.random() * weights[-1])
            doc = order[min(pick, DOCS - 1)]
            suffix = self._chain(self.documents[doc][-1] + b"req%d" % index, SUFFIX_CHUNKS)
            self.requests.append((doc, self.documents[doc] + suffix))

    @staticmethod
    def _chain(salt: bytes, count: int) -> list[bytes]:
        keys, parent = [], hashlib.sha256(salt).digest()
        for index in range(count):
            parent = hashlib.sha256(parent + index.to_bytes(4, "big")).digest()
            keys.append(parent + bytes(4))
        return keys


class _HitSide:
    """One daemon of the hit-rate comparison and its engine."""

    def __init__(self, ctx: Context, label: str, disk: str | None, stack: contextlib.ExitStack) -> None:
        self.label = label
        chunk = LAYERS * BLOCKS_PER_CHUNK * HIT_PAGE
        settings = daemon_settings(ctx, ARENA_CHUNKS * chunk)
        if disk is not None:
            settings["disk"] = {"path": disk, "capacity": DISK_FACTOR * ARENA_CHUNKS * chunk}
        self.server = stack.enter_context(
            ServerProcess("daemon", {"settings": settings}, profile=ctx.profile_path(label))
        )
        endpoint = settings["server"]["endpoint"]  # type: ignore[index]
        self.slots = 2 * DOC_CHUNKS + SUFFIX_CHUNKS  # sources, then load targets
        self.memory = RankMemory(ctx, 0, self.slots * BLOCKS_PER_CHUNK * HIT_PAGE)
        stack.callback(self.memory.close)
        self.client = _engine(endpoint, f"bench-tiers-{label}", HIT_PAGE, self.memory, self.slots)
        stack.callback(self.client.close)
        self.jobs = itertools.count(1)
        self.hits = self.asked = self.lookups = self.verified = self.failed = 0
        self.seconds = 0.0

    def request(self, keys: list[bytes], verify: bool) -> None:
        started = time.perf_counter()
        hits, lookups = _settle(self.client, keys)
        hits = min(hits, DOC_CHUNKS)  # the suffix is new: never a hit
        targets = list(range(self.slots - DOC_CHUNKS, self.slots))[:hits]
        loaded = _run_jobs(self.client, "load", keys[:hits], targets, self.jobs)
        rest = list(range(hits, len(keys)))
        span = BLOCKS_PER_CHUNK * HIT_PAGE
        for slot in rest:
            for layer in range(LAYERS):
                _slot_bytes(self.memory, HIT_PAGE, slot, layer)[:] = _content(keys[slot], layer, span)
        stored = _run_jobs(self.client, "store", [keys[s] for s in rest], rest, self.jobs)
        self.seconds += time.perf_counter() - started
        if not (loaded and stored):
            self.failed += 1
        self.hits += hits
        self.asked += DOC_CHUNKS
        self.lookups += lookups
        if verify and loaded:
            for key, slot in zip(keys[:hits], targets, strict=True):
                for layer in range(LAYERS):
                    if _slot_bytes(self.memory, HIT_PAGE, slot, layer) != _content(key, layer, span):
                        raise RuntimeError(f"tiers bench ({self.label}): a loaded chunk differs")
                self.verified += 1


def run_hit_rate(ctx: Context) -> list[Result]:
    """``tiers_hit_rate_disk4x`` and ``tiers_request_time_disk4x``."""
    names = ("tiers_hit_rate_disk4x", "tiers_request_time_disk4x")
    if not any(ctx.wanted(name) for name in names):
        return []
    requests = 300 if ctx.quick else 1200
    workload = _Workload(requests)
    root = "/var/tmp" if os.path.isdir("/var/tmp") else None
    disk_dir = tempfile.mkdtemp(prefix=f"{ctx.scratch.tag}-disk-", dir=root)
    try:
        with contextlib.ExitStack() as stack:
            plain = _HitSide(ctx, "arena-only", None, stack)
            tiered = _HitSide(ctx, "disk4x", disk_dir, stack)
            ctx.progress(
                f"tiers: {requests} requests of {DOC_CHUNKS}+{SUFFIX_CHUNKS} chunks over "
                f"{DOCS} documents, arena {ARENA_CHUNKS} chunks, disk {DISK_FACTOR}x, {disk_dir}"
            )
            for index, (_, keys) in enumerate(workload.requests):
                verify = index % VERIFY_EVERY == 0
                for side in (plain, tiered) if index % 2 == 0 else (tiered, plain):
                    side.request(keys, verify)
            stats = {side.label: side.client.stats() for side in (plain, tiered)}
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    (disk_state,) = stats["disk4x"].tiers
    distinct_docs = len({doc for doc, _ in workload.requests})
    params = {
        "requests": requests,
        "documents": DOCS,
        "documents_asked": distinct_docs,
        "doc_chunks": DOC_CHUNKS,
        "suffix_chunks": SUFFIX_CHUNKS,
        "zipf": ZIPF,
        "chunk_bytes": LAYERS * BLOCKS_PER_CHUNK * HIT_PAGE,
        "arena_chunks": ARENA_CHUNKS,
        "disk_capacity_chunks": DISK_FACTOR * ARENA_CHUNKS,
        "working_set_chunks": distinct_docs * DOC_CHUNKS + requests * SUFFIX_CHUNKS,
        "arena_chunks_held": stats["arena-only"].committed_entries,
        "disk_chunks_held": disk_state.chunks,
        "disk_promotions": disk_state.promotions,
        "disk_promotion_failures": disk_state.promotion_failures,
        "disk_demotions": disk_state.demotions,
        "disk_demotions_skipped": disk_state.demotions_skipped,
        "lookups_per_request": tiered.lookups / requests,
        "chunks_verified": plain.verified + tiered.verified,
        "failed_requests": plain.failed + tiered.failed,
        "baseline": "same arena, no tier, same requests interleaved",
    }
    hit, base_hit = tiered.hits / tiered.asked, plain.hits / plain.asked
    per, base_per = 1000 * tiered.seconds / requests, 1000 * plain.seconds / requests
    ctx.progress(f"  hit rate {hit:.3f} vs {base_hit:.3f}; {per:.2f} ms vs {base_per:.2f} ms")
    results = [
        Result(names[0], hit, "hit rate", base_hit, ratio(hit, base_hit), dict(params)),
        Result(names[1], per, "ms/request", base_per, ratio(per, base_per), dict(params)),
    ]
    return [r for r in results if ctx.wanted(r.name)]


def run_cluster(ctx: Context) -> list[Result]:
    return []

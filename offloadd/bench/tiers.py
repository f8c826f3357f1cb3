"""Tiers below the arena through real daemons: what a disk tier buys, what the cluster costs.

- ``tiers_hit_rate_disk4x``: chunk hit rate of a prefix-sharing workload on a daemon with a
  disk tier of 4x its arena (value) vs a daemon with the same arena and no tier (baseline).
  ``tiers_request_time_disk4x``: milliseconds per request of the same two (value: with disk).
  The time includes waiting for promotions (lookups every PENDING_POLL seconds until none
  is pending). Both daemons run at once and get the same requests, interleaved one by one: DOCS
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
import functools
import hashlib
import itertools
import os
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable

from offloadd.bench._util import Context, Result, ServerProcess, median, paired_ratio, ratio
from offloadd.bench.datapath import BLOCKS_PER_CHUNK, LAYERS, RankMemory, daemon_settings
from offloadd.bench.datapath import engine_config as _engine_config
from offloadd.client import OffloadClient
from protocol.config import OffloadingConfig
from protocol.messages import TierState

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
PENDING_POLL = 0.001  # seconds between its lookups meanwhile
QUICK_REQUESTS, FULL_REQUESTS = 300, 1200
SMOKE_REQUESTS = 40  # --smoke: 400 chunks asked, still several times the arena

# The cluster comparison.
CLUSTER_PAGE = 64 << 10  # chunk: 1 MiB
QUICK_CHUNKS, FULL_CHUNKS = 64, 128  # per rep
SMOKE_CHUNKS = 8


def _engine(endpoint: str, engine_id: str, page: int, memory: RankMemory) -> OffloadClient:
    config = _engine_config(engine_id, 0, 1, page)
    client = OffloadClient.connect(
        endpoint,
        config,
        memory.regions(page),
        name=f"bench {engine_id}",
        files=memory.files_by_path(),
    )
    return _ready(client)


def _endpoint(settings: dict[str, object]) -> str:
    server = settings["server"]
    assert isinstance(server, dict)
    return str(server["endpoint"])


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
        time.sleep(PENDING_POLL)
    raise AssertionError("unreachable")


def _run_jobs(
    client: OffloadClient,
    kind: str,
    keys: list[bytes],
    slots: list[int],
    jobs: itertools.count[int],
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

    def __init__(
        self, ctx: Context, label: str, disk: str | None, stack: contextlib.ExitStack
    ) -> None:
        self.label = label
        chunk = LAYERS * BLOCKS_PER_CHUNK * HIT_PAGE
        settings = daemon_settings(ctx, ARENA_CHUNKS * chunk)
        if disk is not None:
            settings["disk"] = {"path": disk, "capacity": DISK_FACTOR * ARENA_CHUNKS * chunk}
        self.server = stack.enter_context(
            ServerProcess("daemon", {"settings": settings}, profile=ctx.profile_path(label))
        )
        endpoint = _endpoint(settings)
        self.slots = 2 * DOC_CHUNKS + SUFFIX_CHUNKS  # sources, then load targets
        self.memory = RankMemory(ctx, 0, self.slots * BLOCKS_PER_CHUNK * HIT_PAGE)
        stack.callback(self.memory.close)
        self.client = _engine(endpoint, f"bench-tiers-{label}", HIT_PAGE, self.memory)
        stack.callback(self.client.close)
        self.jobs = itertools.count(1)
        self.hits = self.asked = self.lookups = self.verified = self.failed = 0
        self.seconds = 0.0
        self.times: list[float] = []  # per request

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
                _slot_bytes(self.memory, HIT_PAGE, slot, layer)[:] = _content(
                    keys[slot], layer, span
                )
        stored = _run_jobs(self.client, "store", [keys[s] for s in rest], rest, self.jobs)
        elapsed = time.perf_counter() - started
        self.seconds += elapsed
        self.times.append(elapsed)
        if not (loaded and stored):
            self.failed += 1
        self.hits += hits
        self.asked += DOC_CHUNKS
        self.lookups += lookups
        if verify and loaded:
            for key, slot in zip(keys[:hits], targets, strict=True):
                for layer in range(LAYERS):
                    if _slot_bytes(self.memory, HIT_PAGE, slot, layer) != _content(
                        key, layer, span
                    ):
                        raise RuntimeError(f"tiers bench ({self.label}): a loaded chunk differs")
                self.verified += 1


def run_hit_rate(ctx: Context) -> list[Result]:
    """``tiers_hit_rate_disk4x`` and ``tiers_request_time_disk4x``."""
    names = ("tiers_hit_rate_disk4x", "tiers_request_time_disk4x")
    if not any(ctx.wanted(name) for name in names):
        return []
    requests = ctx.pick(FULL_REQUESTS, QUICK_REQUESTS, SMOKE_REQUESTS)
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
        # Chunks found on disk by the probe but evicted from it before their get: misses.
        "disk_promotion_failures": disk_state.promotion_failures,
        "disk_errors": disk_state.errors,
        "disk_demotions": disk_state.demotions,
        "disk_demotions_skipped": disk_state.demotions_skipped,
        "lookups_per_request": tiered.lookups / requests,
        "pending_poll_s": PENDING_POLL,
        "request_p50_ms": 1000 * median(tiered.times),
        "baseline_request_p50_ms": 1000 * median(plain.times),
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


def _salted(client_id: str, page: int, salt: str) -> OffloadingConfig:
    import msgspec

    from offloadd.server.registry import NAMESPACE_SALT_KEY

    config = _engine_config(client_id, 0, 1, page)
    return msgspec.structs.replace(config, extra_config={NAMESPACE_SALT_KEY: salt})


def _cluster_engine(endpoint: str, label: str, memory: RankMemory, salt: str) -> OffloadClient:
    """An engine in a namespace of its own (``salt``): each rep starts from an empty cluster."""
    client = OffloadClient.connect(
        endpoint,
        _salted(f"bench-cluster-{label}", CLUSTER_PAGE, salt),
        memory.regions(CLUSTER_PAGE),
        name=f"bench cluster {label}",
        files=memory.files_by_path(),
    )
    return _ready(client)


def _ready(client: OffloadClient) -> OffloadClient:
    """``client`` once its engine is ready; closed if it never gets there."""
    try:
        client.wait_ready(30)
    except BaseException:
        client.close()
        raise
    return client


def _cluster_state(client: OffloadClient) -> TierState:
    tiers = client.stats().tiers
    if not tiers:
        raise RuntimeError("the daemon runs without its cluster tier (see its log above)")
    return tiers[0]


def _published(client: OffloadClient, demotions: int) -> bool:
    """Whether the cluster tier wrote ``demotions`` chunks in all and has none queued."""
    state = _cluster_state(client)
    return bool(state.demotions >= demotions and not state.queued_bytes)


def _poll(check: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"mooncake daemon bench: {what} not done in {timeout:.0f}s")
        time.sleep(0.002)


def run_cluster(ctx: Context) -> list[Result]:
    """``mooncake_daemon_publish`` and ``mooncake_daemon_promote``."""
    names = ("mooncake_daemon_publish", "mooncake_daemon_promote")
    if not any(ctx.wanted(name) for name in names):
        return []
    from offloadd.bench.mooncake import TENANTS, _master, cluster_key, mooncake_installed
    from offloadd.cache.arena import Arena
    from offloadd.settings import MooncakeSettings
    from offloadd.tiers.mooncake import MooncakeTier

    binary, missing = mooncake_installed()
    if binary is None:
        ctx.skip("mooncake daemon", missing)
        return []
    count = ctx.pick(FULL_CHUNKS, QUICK_CHUNKS, SMOKE_CHUNKS)
    reps = ctx.pick(7, 3, 1)
    chunk = LAYERS * BLOCKS_PER_CHUNK * CLUSTER_PAGE
    total = count * chunk
    segment = max(2 * total, 64 << 20)  # mooncake refuses small segments
    with contextlib.ExitStack() as stack:
        master, metadata = stack.enter_context(_master(binary))  # 127.0.0.1 only
        key_file = cluster_key(ctx)  # the daemons' and the raw clients' (which need one to open)
        cluster = {
            "key_file": key_file,
            "tenants": TENANTS,
            "master": master,
            "metadata": metadata,
            "segment": segment,
            "local_buffer": 16 << 20,
            "local_hostname": "127.0.0.1",
            "lookup_timeout": 10.0,
        }
        endpoints = []
        for label in ("a", "b"):
            settings = daemon_settings(ctx, 2 * total + (8 << 20))
            settings["mooncake"] = cluster
            stack.enter_context(
                ServerProcess(
                    "daemon", {"settings": settings}, profile=ctx.profile_path(f"mooncake-{label}")
                )
            )
            endpoints.append(_endpoint(settings))
        raw_settings = MooncakeSettings(
            key_file=key_file,
            master=master,
            metadata=metadata,
            segment=segment,
            local_buffer=16 << 20,
            local_hostname="127.0.0.1",
        )
        raw_arenas, raws = [], []
        for label in ("a", "b"):
            arena = Arena(ctx.scratch.shm_path(f"mooncake-raw-{label}"), total + (1 << 20))
            stack.callback(arena.close)
            tier = MooncakeTier(raw_settings, arena)
            stack.callback(tier.close)
            raw_arenas.append(arena)
            raws.append(tier._client)
        memory_a = RankMemory(ctx, 0, count * BLOCKS_PER_CHUNK * CLUSTER_PAGE)
        stack.callback(memory_a.close)
        memory_b = RankMemory(ctx, 1, count * BLOCKS_PER_CHUNK * CLUSTER_PAGE)
        stack.callback(memory_b.close)
        # The raw objects carry the same bytes: chunk c is its pages, layer after layer.
        span = BLOCKS_PER_CHUNK * CLUSTER_PAGE
        for c in range(count):
            for layer in range(LAYERS):
                offset = c * chunk + layer * span
                raw_arenas[0].view(offset, span)[:] = _slot_bytes(memory_a, CLUSTER_PAGE, c, layer)
        ctx.progress(
            f"mooncake daemon: {count} chunks of {chunk >> 20} MiB through daemons A -> B "
            f"vs raw clients, {reps} reps"
        )
        times: dict[str, list[float]] = {"put": [], "raw_put": [], "get": [], "raw_get": []}
        stored_seconds, settle_seconds, first_seconds = [], [], []
        for rep in range(reps):
            salt = uuid.uuid4().hex
            keys = _Workload._chain(salt.encode(), count)
            raw_names = [f"bench-raw/{salt}/{i}" for i in range(count)]
            addresses = [[arena.address + i * chunk for i in range(count)] for arena in raw_arenas]
            with contextlib.ExitStack() as engines:
                on_a = _cluster_engine(endpoints[0], "a", memory_a, salt)
                engines.callback(on_a.close)
                on_b = _cluster_engine(endpoints[1], "b", memory_b, salt)
                engines.callback(on_b.close)
                jobs = itertools.count(1)
                order = ("daemon", "raw") if rep % 2 == 0 else ("raw", "daemon")
                for side in order:  # publish
                    if side == "daemon":
                        before = _cluster_state(on_a).demotions
                        started = time.perf_counter()
                        if not _run_jobs(on_a, "store", keys, list(range(count)), jobs):
                            raise RuntimeError("mooncake daemon bench: a store failed")
                        stored_seconds.append(time.perf_counter() - started)
                        _poll(functools.partial(_published, on_a, before + count), "publishing")
                        times["put"].append(time.perf_counter() - started)
                        state = _cluster_state(on_a)
                        if state.demotions_skipped or state.demotions != before + count:
                            raise RuntimeError(f"mooncake daemon bench: A published {state}")
                    else:
                        started = time.perf_counter()
                        codes = raws[0].batch_put_from(raw_names, addresses[0], [chunk] * count)
                        times["raw_put"].append(time.perf_counter() - started)
                        if any(code != 0 for code in codes):
                            raise RuntimeError(f"mooncake daemon bench: raw put: {codes}")
                for layer in range(LAYERS):
                    memory_b.flat(layer).zero_()
                raw_arenas[1].view(0, total)[:] = bytes(total)
                for side in order:  # promote
                    if side == "daemon":
                        started = time.perf_counter()
                        first = on_b.lookup(keys)  # deferred: the cluster answers
                        first_seconds.append(time.perf_counter() - started)
                        if len(first.pending) + first.hits != count:
                            raise RuntimeError(f"mooncake daemon bench: B's lookup: {first}")
                        hits, _ = _settle(on_b, keys)
                        settle_seconds.append(time.perf_counter() - started)
                        if hits != count:
                            raise RuntimeError(f"mooncake daemon bench: B hit {hits} of {count}")
                        if not _run_jobs(on_b, "load", keys, list(range(count)), jobs):
                            raise RuntimeError("mooncake daemon bench: a load on B failed")
                        times["get"].append(time.perf_counter() - started)
                    else:
                        started = time.perf_counter()
                        codes = raws[1].batch_get_into(raw_names, addresses[1], [chunk] * count)
                        times["raw_get"].append(time.perf_counter() - started)
                        if any(code != chunk for code in codes):
                            raise RuntimeError(f"mooncake daemon bench: raw get: {codes}")
                for layer in range(LAYERS):
                    if not memory_b.flat(layer).equal(memory_a.flat(layer)):
                        raise RuntimeError("mooncake daemon bench: B loaded other bytes than A")
                if raw_arenas[1].view(0, total) != raw_arenas[0].view(0, total):
                    raise RuntimeError("mooncake daemon bench: raw get returned other bytes")
                promoted = _cluster_state(on_b).promotions
                on_b.clear()
                on_a.clear()  # the rep's namespace only: its objects leave the cluster
                raws[0].batch_remove(raw_names, True)
    params = {
        "chunks": count,
        "chunk_bytes": chunk,
        "reps": reps,
        "protocol": "tcp",
        "segment_bytes": segment,
        "b_promotions_total": promoted,
        "store_into_arena_s": median(stored_seconds),
        "publish_after_store_s": median(
            p - s for p, s in zip(times["put"], stored_seconds, strict=True)
        ),
        "first_lookup_s": median(first_seconds),
        "lookup_until_hits_s": median(settle_seconds),
        "load_after_hits_s": median(
            g - s for g, s in zip(times["get"], settle_seconds, strict=True)
        ),
        "publish": "store jobs sent on A -> A's cluster tier wrote all (demotions, none queued)",
        "promote": "first lookup on B -> no key pending, all hit -> load of all done on B",
        "baseline": "raw batch_put_from / batch_get_into of the same bytes, two raw clients",
    }
    results = []
    for name, side, raw in ((names[0], "put", "raw_put"), (names[1], "get", "raw_get")):
        value = total / median(times[side]) / GiB
        base = total / median(times[raw]) / GiB
        paired = paired_ratio(times[raw], times[side])  # throughput: raw time / daemon time
        ctx.progress(f"  {name}: {value:.2f} GiB/s vs raw {base:.2f} GiB/s ({paired:.2f})")
        results.append(Result(name, value, "GiB/s", base, paired, dict(params)))
    return [r for r in results if ctx.wanted(r.name)]

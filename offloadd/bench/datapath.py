"""Data path over shared memory: store and load throughput through a real daemon.

The daemon runs in a subprocess (``offloadd.bench._servers daemon``), as in production: its event
loop and copy threads do not share a GIL with the ranks. The ranks are real ``OffloadClient``s
on real ``SharedKVTensor``-style files in /dev/shm, one thread each, speaking over ipc://
(``shm_*``: the daemon reaches such files with pread/pwrite on their descriptors), or on
memfds sealed against shrinking (``memfd_*``: the daemon maps those).

Geometry: each rank registers ``LAYERS`` regions (one per layer); a chunk is
``BLOCKS_PER_CHUNK`` blocks, so a rank's shard of a chunk is ``LAYERS * BLOCKS_PER_CHUNK``
pages. Block ids are a fixed random permutation, so no two pages of a shard are neighbours
in a region and every page is its own copy (the gather a real block table produces).

The daemon runs as ``offloadd serve`` does by default, its journal checksumming every shard
before the store commits (``cache.persist = true``); the rows ``..._nopersist`` run a second
daemon with ``cache.persist = false`` (``--no-persist``: no journal, no checksums), one rank.

Baseline: the very same ``(src, dst, nbytes)`` moves, from the same shm files into a
same-size pre-faulted shm arena, with ``ctypes.memmove`` in a loop on one thread of this
process (the daemon's CPU copy engine also copies on one thread per direction). Daemon and
baseline runs alternate, warm-up first; the median of the repetitions is reported.

``daemon_cpu_per_chunk_2MiB`` (the ``memfd`` group, one rank, its own 2 MiB configuration,
the chunk of 16 tokens of an 8B model): the daemon's CPU per chunk stored or loaded beyond
the copy of its bytes (the baseline's CPU for the same moves), in microseconds. On a GPU
node the copy is the DMA engine's; what is left is what the daemon's CPU costs per chunk.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from offloadd.bench._util import (
    Context,
    MiB,
    Result,
    ServerProcess,
    chain_keys,
    median,
    one_group_config,
    paired_ratio,
    process_cpu_seconds,
    ratio,
    size_name,
)
from offloadd.cache.arena import Arena
from offloadd.client import OffloadClient
from offloadd.settings import CacheSettings, EventSettings, ServerSettings, Settings
from offloadd.shm import SharedKVTensor
from protocol.config import (
    OffloadingConfig,
)
from protocol.handles import KVRegion, ShmHandle

SHARD_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20)
RANK_COUNTS = (1, 4)
NOPERSIST_RANKS = 1  # the ..._nopersist rows: one rank
LAYERS = 4
CPU_ROW = "daemon_cpu_per_chunk_2MiB"
CPU_ROW_SHARD = 2 << 20  # 16 tokens x 32 layers x 8 KV heads x 128 x K and V x bf16
BLOCKS_PER_CHUNK = 4
BYTES_PER_REP = 256 * MiB  # moved per repetition over all ranks (at least 8 chunks per rank)
# --smoke: one shard size, still every rank count and both journals, a few MiB each.
SMOKE_SHARD_SIZES = (256 << 10,)
SMOKE_BYTES_PER_REP = 4 * MiB
MAX_CHUNKS_PER_JOB = 16
MAX_JOB_BYTES = 16 * MiB
SEED = 1234

Triple = tuple[int, int, int]


def result_names(
    shard: int, ranks: int, kind: str = "shm", persist: bool = True
) -> tuple[str, str]:
    suffix = size_name(shard) + ("" if ranks == 1 else f"_{ranks}ranks")
    suffix += "" if persist else "_nopersist"
    return f"{kind}_store_{suffix}", f"{kind}_load_{suffix}"


def engine_config(engine_id: str, rank: int, tp: int, page: int) -> OffloadingConfig:
    return one_group_config(
        engine_id,
        model="bench/model",
        layers=[f"model.layers.{i}.attn" for i in range(LAYERS)],
        bytes_per_block=page * LAYERS,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        rank=rank,
        tp=tp,
    )


def chunk_keys(count: int, salt: bytes) -> list[bytes]:
    """Chained sha256 keys + u32 group 0, like vLLM's offload keys."""
    return chain_keys(count, salt)


class RankMemory:
    """One rank's layer files, filled once with random bytes, and a reference copy."""

    def __init__(self, ctx: Context, rank: int, bytes_per_layer: int, memfd: bool = False) -> None:
        self.files: list[SharedKVTensor] = []
        self.reference: list[torch.Tensor] = []
        generator = torch.Generator().manual_seed(SEED + rank)
        try:
            for layer in range(LAYERS):
                names = [f"model.layers.{layer}.attn"]
                if memfd:
                    kv = SharedKVTensor.memfd(bytes_per_layer // 4096, 4096, names)
                else:
                    kv = SharedKVTensor.create(
                        bytes_per_layer // 4096, 4096, names, prefix=f"{ctx.scratch.shm_prefix}-kv"
                    )
                self.files.append(kv)
                flat = kv.tensor.view(-1)
                flat.copy_(
                    torch.randint(0, 256, flat.shape, generator=generator, dtype=torch.uint8)
                )
                self.reference.append(flat.clone())
        except BaseException:
            self.close()
            raise

    def flat(self, layer: int) -> torch.Tensor:
        return self.files[layer].tensor.view(-1)

    def address(self, layer: int) -> int:
        return int(self.flat(layer).data_ptr())

    def files_by_path(self) -> dict[str, int]:
        """Descriptors the client passes as they are (memfds have no path to open)."""
        return {path: fd for kv in self.files for path, fd in kv.files.items()}

    def regions(self, page: int) -> list[KVRegion]:
        """One region per layer file, of ``page``-byte blocks, over the whole file: the daemon
        refuses a file larger than the end of the regions that use it (``TOO_LARGE``). The
        files are sized for the largest configuration of their rank count (``run``), so a
        smaller one registers blocks it does not use (its block ids are the first ones)."""
        regions = []
        for kv in self.files:
            nbytes = kv.tensor.numel()
            if nbytes % page:
                raise ValueError(f"{kv.path}: {nbytes} bytes is not a whole number of {page}")
            regions.append(
                KVRegion(
                    handle=ShmHandle(path=kv.path, offset=0, size=nbytes),
                    num_blocks=nbytes // page,
                    page_size=page,
                    block_stride=page,
                    layer_names=kv.region.layer_names,
                )
            )
        return regions

    def close(self) -> None:
        for kv in self.files:
            kv.close()
        self.files.clear()


@dataclass
class Layout:
    """One configuration: shard size, ranks, the chunks, their blocks and the jobs."""

    shard: int
    ranks: int
    page: int
    chunks: int
    num_blocks: int
    keys: list[bytes]
    blocks: list[int]  # blocks of chunk c: blocks[c*bpc:(c+1)*bpc]
    jobs: list[tuple[list[bytes], list[int]]]

    @classmethod
    def build(cls, shard: int, ranks: int, rep_bytes: int) -> Layout:
        page = shard // (LAYERS * BLOCKS_PER_CHUNK)
        chunks = max(8, rep_bytes // shard)
        num_blocks = chunks * BLOCKS_PER_CHUNK
        blocks = list(range(num_blocks))
        random.Random(SEED).shuffle(blocks)
        keys = chunk_keys(chunks, f"{shard}-{ranks}".encode())
        per_job = max(1, min(MAX_CHUNKS_PER_JOB, MAX_JOB_BYTES // shard))
        jobs = []
        for start in range(0, chunks, per_job):
            stop = min(chunks, start + per_job)
            ids = blocks[start * BLOCKS_PER_CHUNK : stop * BLOCKS_PER_CHUNK]
            jobs.append((keys[start:stop], ids))
        return cls(shard, ranks, page, chunks, num_blocks, keys, blocks, jobs)

    @property
    def total_bytes(self) -> int:
        return self.shard * self.chunks * self.ranks

    def baseline_moves(self, memory: Sequence[RankMemory], arena: int) -> list[Triple]:
        """The daemon's moves for a store (src = rank page, dst = arena), shard by shard."""
        moves: list[Triple] = []
        page, bpc = self.page, BLOCKS_PER_CHUNK
        for rank in range(self.ranks):
            bases = [memory[rank].address(layer) for layer in range(LAYERS)]
            for chunk in range(self.chunks):
                shard_base = arena + (rank * self.chunks + chunk) * self.shard
                ids = self.blocks[chunk * bpc : (chunk + 1) * bpc]
                for layer in range(LAYERS):
                    part = shard_base + layer * page * bpc
                    for j, block in enumerate(ids):
                        moves.append((bases[layer] + block * page, part + j * page, page))
        return moves


def copy_moves(moves: Sequence[Triple]) -> float:
    """The baseline: the daemon's copy loop, in this process."""
    memmove = ctypes.memmove
    started = time.perf_counter()
    for src, dst, nbytes in moves:
        memmove(dst, src, nbytes)
    return time.perf_counter() - started


class Ranks:
    """The connected clients of one engine, each driven from its own thread."""

    def __init__(self, endpoint: str, layout: Layout, memory: Sequence[RankMemory]) -> None:
        self.layout = layout
        self.clients: list[OffloadClient] = []
        self._pool = ThreadPoolExecutor(layout.ranks, thread_name_prefix="rank")
        self._job = 0
        engine_id = f"bench-shm-{size_name(layout.shard)}-{layout.ranks}"
        try:
            for rank in range(layout.ranks):
                config = engine_config(engine_id, rank, layout.ranks, layout.page)
                regions = memory[rank].regions(layout.page)
                self.clients.append(
                    OffloadClient.connect(
                        endpoint,
                        config,
                        regions,
                        name=f"bench rank {rank}",
                        files=memory[rank].files_by_path(),
                    )
                )
            for client in self.clients:
                client.wait_ready(30)
        except BaseException:
            self.close()
            raise

    def run(self, direction: str) -> float:
        """Every rank stores (or loads) every chunk, jobs pipelined; seconds to the last done."""
        first_job = self._job
        self._job += len(self.layout.jobs)

        def work(client: OffloadClient) -> None:
            ids = []
            for offset, (keys, blocks) in enumerate(self.layout.jobs):
                job_id = first_job + offset
                if direction == "store":
                    client.store(job_id, keys, blocks)
                else:
                    client.load(job_id, keys, blocks)
                ids.append(job_id)
            client.wait(ids, timeout=120)

        started = time.perf_counter()
        if len(self.clients) == 1:
            work(self.clients[0])
        else:
            for future in [self._pool.submit(work, client) for client in self.clients]:
                future.result()
        return time.perf_counter() - started

    def clear(self) -> None:
        cleared = self.clients[0].clear()
        if cleared != self.layout.chunks:
            raise RuntimeError(f"cleared {cleared} chunks, expected {self.layout.chunks}")

    def close(self) -> None:
        for client in self.clients:
            with contextlib.suppress(Exception):
                client.close()
        self.clients.clear()
        self._pool.shutdown(wait=True)


def _verify(layout: Layout, memory: Sequence[RankMemory], ranks: Ranks) -> None:
    """Zero the source pages, load them back from the daemon, compare with the reference."""
    used = layout.num_blocks * layout.page
    for rank in range(layout.ranks):
        for layer in range(LAYERS):
            memory[rank].flat(layer)[:used].zero_()
    ranks.run("load")
    for rank in range(layout.ranks):
        for layer in range(LAYERS):
            got = memory[rank].flat(layer)[:used]
            if not torch.equal(got, memory[rank].reference[layer][:used]):
                raise RuntimeError(
                    f"{size_name(layout.shard)} x{layout.ranks}: rank {rank} layer {layer} "
                    "differs after store + load"
                )


def per_rank(shard: int, ranks: int, rep_bytes: int = BYTES_PER_REP) -> int:
    """Bytes each rank moves per repetition (``rep_bytes`` over all ranks)."""
    return max(rep_bytes // ranks, 8 * shard)


def _rep_bytes(ctx: Context) -> int:
    return ctx.pick(BYTES_PER_REP, BYTES_PER_REP, SMOKE_BYTES_PER_REP)


def _configs(ctx: Context, kind: str) -> Iterator[tuple[int, int, bool]]:
    # The ..._nopersist rows are measured for /dev/shm files only.
    for persist in (True, False) if kind == "shm" else (True,):
        for ranks in RANK_COUNTS if persist else (NOPERSIST_RANKS,):
            shards = list(ctx.pick(SHARD_SIZES, SHARD_SIZES, SMOKE_SHARD_SIZES))
            if _has_cpu_row(CPU_ROW_SHARD, ranks, kind, persist):
                shards.append(CPU_ROW_SHARD)
            for shard in shards:
                names = result_names(shard, ranks, kind, persist)
                if _has_cpu_row(shard, ranks, kind, persist):
                    names = (CPU_ROW,)  # its own configuration: only its row is reported
                if any(ctx.wanted(name) for name in names):
                    yield shard, ranks, persist


def _has_cpu_row(shard: int, ranks: int, kind: str, persist: bool) -> bool:
    return (shard, ranks, kind, persist) == (CPU_ROW_SHARD, 1, "memfd", True)


def run(ctx: Context, kind: str = "shm") -> list[Result]:
    """``<kind>_store_<size>[_4ranks]`` and ``<kind>_load_<size>[_4ranks]``; ``kind`` is
    ``shm`` (files in /dev/shm) or ``memfd`` (sealed memfds)."""
    configs = list(_configs(ctx, kind))
    if not configs:
        return []
    reps = ctx.pick(21, 9, 2)
    rep_bytes = _rep_bytes(ctx)
    results: list[Result] = []
    # Each rank count gets rank files of its own, sized for its configurations alone: a rank
    # registers its files whole (``RankMemory.regions``), and the ranks of one engine must
    # agree on their regions, so rank 0 cannot keep the larger files a single rank moves.
    for ranks in sorted({n for _, n, _ in configs}, reverse=True):
        mine_all = [(shard, persist) for shard, n, persist in configs if n == ranks]
        size = max(per_rank(shard, ranks, rep_bytes) for shard, _ in mine_all)
        memory: list[RankMemory] = []
        try:
            for rank in range(ranks):
                ctx.progress(f"shm: filling {size >> 20} MiB of memory for rank {rank}")
                memory.append(RankMemory(ctx, rank, size // LAYERS, memfd=kind == "memfd"))
            for persist in sorted({p for _, p in mine_all}, reverse=True):
                mine = [shard for shard, p in mine_all if p == persist]
                capacity = ranks * max(per_rank(shard, ranks, rep_bytes) for shard in mine)
                capacity += 8 * MiB
                baseline_arena = Arena(ctx.scratch.shm_path("baseline.arena"), capacity)
                label = f"shm-{ranks}ranks" + ("" if persist else "-nopersist")
                with (
                    contextlib.closing(baseline_arena),
                    daemon(ctx, capacity, label, persist=persist) as (endpoint, server),
                ):
                    for shard in mine:
                        results += _measure(
                            ctx,
                            endpoint,
                            server,
                            shard,
                            ranks,
                            reps,
                            memory,
                            baseline_arena,
                            kind,
                            persist,
                        )
        finally:
            for rank_memory in memory:
                rank_memory.close()
    return [r for r in results if ctx.wanted(r.name)]


@contextlib.contextmanager
def daemon(
    ctx: Context, capacity: int, label: str, *, persist: bool = True
) -> Iterator[tuple[str, ServerProcess]]:
    """A daemon subprocess on private endpoints and arena; yields its endpoint and process."""
    settings = daemon_settings(ctx, capacity, persist=persist)
    profile = ctx.profile_path(f"daemon-{label}")
    with ServerProcess("daemon", {"settings": settings}, profile=profile) as process:
        server = settings["server"]
        assert isinstance(server, dict)
        yield str(server["endpoint"]), process


def daemon_settings(ctx: Context, capacity: int, *, persist: bool = True) -> dict[str, object]:
    """Settings (as JSON-ready dicts) for a daemon on private endpoints and arena."""
    import msgspec

    settings = Settings(
        server=ServerSettings(endpoint=ctx.scratch.endpoint("daemon")),
        cache=CacheSettings(
            arena=ctx.scratch.shm_path("daemon.arena"),
            capacity=capacity,
            journal=os.path.join(ctx.scratch.workdir, "state", "daemon.journal"),
            persist=persist,
        ),
        events=EventSettings(
            endpoint=ctx.scratch.endpoint("events"),
            replay_endpoint=ctx.scratch.endpoint("replay"),
            pod="bench",
        ),
    )
    decoded = msgspec.to_builtins(settings)
    assert isinstance(decoded, dict)
    if "metrics" in Settings.__struct_fields__:
        # On, as in production, but on a free port: runs may overlap with other daemons.
        decoded["metrics"] = {"address": "127.0.0.1:0"}
    return decoded


def _measure(
    ctx: Context,
    endpoint: str,
    server: ServerProcess,
    shard: int,
    ranks: int,
    reps: int,
    memory: Sequence[RankMemory],
    arena: Arena,
    kind: str = "shm",
    persist: bool = True,
) -> list[Result]:
    layout = Layout.build(shard, ranks, per_rank(shard, ranks, _rep_bytes(ctx)))
    store_moves = layout.baseline_moves(memory, arena.address)
    load_moves = [(dst, src, n) for src, dst, n in store_moves]
    store_name, load_name = result_names(shard, ranks, kind, persist)
    ctx.progress(
        f"shm {size_name(shard)} x{ranks} ranks: {layout.chunks} chunks/rank in "
        f"{len(layout.jobs)} jobs, {len(store_moves)} page copies, {reps} reps"
    )
    times: dict[str, list[float]] = {k: [] for k in ("ds", "bs", "dl", "bl")}
    cpu: dict[str, float] = {k: 0.0 for k in times}
    daemon_cpu = {"s": 0.0, "l": 0.0}  # the daemon's own share of cpu["ds"] and cpu["dl"]
    client_pid = os.getpid()
    with contextlib.closing(Ranks(endpoint, layout, memory)) as clients:
        # Warm-up: fault the daemon's mappings, check bytes end to end, warm the baseline.
        clients.run("store")
        _verify(layout, memory, clients)
        copy_moves(store_moves)
        copy_moves(load_moves)
        clients.clear()
        for rep in range(reps):
            daemon_first = rep % 2 == 0
            for direction, moves in (("store", store_moves), ("load", load_moves)):
                key = direction[0]
                for side in ("d", "b") if daemon_first else ("b", "d"):
                    if side == "d":
                        daemon_before = server.cpu_seconds()
                        before = daemon_before + process_cpu_seconds(client_pid)
                        times["d" + key].append(clients.run(direction))
                        daemon_after = server.cpu_seconds()
                        after = daemon_after + process_cpu_seconds(client_pid)
                        daemon_cpu[key] += daemon_after - daemon_before
                    else:
                        before = time.thread_time()
                        times["b" + key].append(copy_moves(moves))
                        after = time.thread_time()
                    cpu[side + key] += after - before
            clients.clear()
    params = {
        "shard_bytes": shard,
        "ranks": ranks,
        "page_bytes": layout.page,
        "layers": LAYERS,
        "blocks_per_chunk": BLOCKS_PER_CHUNK,
        "chunks_per_rank": layout.chunks,
        "jobs_per_rank": len(layout.jobs),
        "bytes_per_rep": layout.total_bytes,
        "page_copies_per_rep": len(store_moves),
        "reps": reps,
        "daemon": "subprocess",
        "persist": persist,
        "baseline": "ctypes.memmove of the same moves, one thread, same shm files",
        "rank_memory": "sealed memfds (mapped)" if kind == "memfd" else "/dev/shm files (fd)",
    }
    if shard >= 1 << 20:
        params["goal"] = "ratio >= 0.9"
    elif shard >= 256 << 10:
        params["goal"] = "ratio >= 0.8"
    params["ratio"] = "median over repetitions of daemon/baseline throughput, back to back"
    gbps = layout.total_bytes / 1e9
    moved = gbps * reps
    results = []
    chunks_moved = layout.chunks * reps  # keys: each of ranks shards of shard bytes
    for name, d, b in ((store_name, "ds", "bs"), (load_name, "dl", "bl")):
        value = gbps / median(times[d])
        base = gbps / median(times[b])
        # Throughput ratio = baseline time / daemon time, pair by pair.
        paired = paired_ratio(times[b], times[d])
        extra = {
            "best_ratio": min(times[b]) / min(times[d]),
            # CPU seconds per GB moved (daemon + clients vs the baseline thread): waiting
            # for a busy machine does not count, so this is the steadier overhead figure.
            "cpu_s_per_GB": cpu[d] / moved,
            "baseline_cpu_s_per_GB": cpu[b] / moved,
            # The daemon's CPU per chunk (issue 43's figure at this geometry's chunk), and
            # the baseline's copy of a chunk: what the bytes themselves cost.
            "daemon_cpu_us_per_chunk": daemon_cpu[d[1]] / chunks_moved * 1e6,
            "baseline_cpu_us_per_chunk": cpu[b] / chunks_moved * 1e6,
        }
        results.append(Result(name, value, "GB/s", base, paired, params | extra))
        ctx.progress(f"  {name}: {value:.2f} GB/s vs {base:.2f} GB/s ({paired:.2f})")
    if _has_cpu_row(shard, ranks, kind, persist):
        return [_cpu_row(daemon_cpu, cpu, chunks_moved, params)]
    return results


def _cpu_row(
    daemon_cpu: dict[str, float], cpu: dict[str, float], chunks: int, params: dict[str, object]
) -> Result:
    """``daemon_cpu_per_chunk_2MiB`` (see the module) from one configuration's runs."""
    per_chunk = 1e6 / (2 * chunks)  # stores and loads, ``chunks`` of each
    daemon = (daemon_cpu["s"] + daemon_cpu["l"]) * per_chunk
    copy = (cpu["bs"] + cpu["bl"]) * per_chunk
    extra = {
        "daemon_cpu_us_per_chunk": round(daemon, 1),
        "store_daemon_cpu_us": round(daemon_cpu["s"] * 2 * per_chunk, 1),
        "load_daemon_cpu_us": round(daemon_cpu["l"] * 2 * per_chunk, 1),
        "copy_cpu_us_per_chunk": round(copy, 1),
        "value": "daemon CPU per chunk minus its copy's (the baseline)",
        "ratio": "daemon CPU per chunk over its copy's",
        "goal": "value <= 20",
    }
    return Result(CPU_ROW, daemon - copy, "us", copy, ratio(daemon, copy), params | extra)

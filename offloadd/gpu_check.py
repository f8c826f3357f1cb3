"""check-gpu: the CUDA path end to end on a GPU host, checked byte for byte, with a baseline.

    offloadd check-gpu [--total 4GiB] [--layers 32] [--page 64KiB] [--pad 4KiB]
                       [--arena 72GiB] [--json FILE]

(``python -m offloadd check-gpu`` where the console script is not installed; the flags are
``offloadd.cli``'s, which hands ``main`` an ``Options``.)

What it does (within about a minute on an H200 at the defaults; the budget is 5 minutes):
1. Measures the baseline in this process: ``torch`` ``copy_`` of ``--total`` bytes between
   one CUDA tensor and one pinned host tensor, each direction, best of three.
2. Starts the real daemon (``offloadd.server.daemon.Daemon``) on a thread of this process with
   ``server.copy_engine = "cuda"``, an arena of ``--arena`` (default: ``--total`` plus
   slack; over 64 GiB it is pinned in two or more pieces, and the first chunks land in the
   last piece) and no events. It reads the daemon's copy path at once: the check FAILS
   unless the arena is pinned and copies are batched (``--allow-degraded`` reports only).
3. Starts two rank processes (spawn) on GPU 0, one engine with tp=2. Each allocates
   ``--layers`` KV tensors of ``num_blocks`` padded blocks (``--page`` bytes moved per block,
   ``--pad`` bytes of padding after each, filled with a marker), registers them over CUDA
   IPC (``offloadd.cuda_ipc.kv_region_from_tensor``) with the public client.
4. Warm-up, per rank: fills a few blocks, records an interprocess event and stores them at
   once with it as ``wait_event`` (no synchronize: the daemon's copy must wait for the
   fill), loads them back elsewhere and checks them; this also creates the daemon's lanes.
5. Throughput: each rank stores ``--total / 2`` bytes from shuffled block ids, several
   chunks per job, every Store carrying the rank's event; then zeroes other blocks, records
   the event again and loads the same keys into them (with ``wait_event`` when the Load
   message has it), and compares every page of every layer on the GPU (``torch.equal``)
   against the blocks it stored, and every padding byte against the marker.
6. Latency: both ranks store then load ``--latency-jobs`` single-chunk jobs one at a time,
   each waited for (a synchronize instead of an event): p50/p99 of the job's wall time
   (request to JobDone) and of what is not DMA in it (wall minus the copy seconds the daemon
   measured with events): the daemon's issue and completion overhead plus a round trip.
7. Prints store and load GB/s end to end (both ranks, wall clock from the first request to
   the last completion) and DMA GB/s (bytes over the copy seconds of the jobs) next to the
   baseline, the latency percentiles, and the copy path; the table comes last.

Exit status: 0 when every byte matched on a pinned, batched copy path; 1 otherwise; 2
without CUDA.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from offloadd.bench._util import chain_keys, one_group_config

TOKENS_PER_BLOCK = 16
RANKS = 2
PAD_MARKER = 0xA5
WARMUP_CHUNKS = 2


@dataclass(frozen=True)
class Options:
    """What ``offloadd check-gpu`` was asked (its flags, sizes in bytes; see its ``--help``)."""

    total: int = 4 << 30  # bytes stored (and loaded), both ranks
    layers: int = 32  # KV layers per rank
    page: int = 64 << 10  # bytes moved per block per layer
    pad: int = 4 << 10  # padding after each block's page, never copied
    arena: int = 0  # arena size; 0: --total plus slack
    blocks_per_chunk: int = 16  # GPU blocks per cached chunk
    chunks_per_job: int = 4  # chunks per store/load request
    latency_jobs: int = 200  # single-chunk jobs timed one by one
    contiguous: bool = False  # consecutive block ids (default: shuffled)
    allow_degraded: bool = False  # report, but do not fail, a degraded copy path
    timeout: float = 240.0  # seconds for everything
    json: str | None = None  # where to write the results as JSON


def _log(message: str) -> None:
    print(f"[check-gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0..100); nan for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# --- the baseline --------------------------------------------------------------------------


def baseline(total: int) -> dict[str, float]:
    """GB/s of one ``copy_`` of ``total`` bytes each way (pinned host, best of three)."""
    import torch

    device = torch.empty(total, dtype=torch.uint8, device="cuda")
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    device.random_(0, 256)
    rates: dict[str, float] = {}
    for name, dst, src in (("store", host, device), ("load", device, host)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            started = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
        rates[name] = total / best / 1e9
    del device, host
    torch.cuda.empty_cache()
    return rates


# --- the daemon ----------------------------------------------------------------------------


class DaemonThread:
    """The real daemon (cuda copy engine) on its own thread and event loop."""

    def __init__(self, capacity: int) -> None:
        from offloadd.settings import (
            CacheSettings,
            EventSettings,
            MetricsSettings,
            ServerSettings,
            Settings,
        )

        self.workdir = tempfile.mkdtemp(prefix="od-gpu-", dir="/tmp")
        self.endpoint = f"ipc://{self.workdir}/d.sock"
        self.settings = Settings(
            server=ServerSettings(endpoint=self.endpoint, drain_seconds=30.0, copy_engine="cuda"),
            cache=CacheSettings(
                arena=f"/dev/shm/offloadd-gpucheck-{uuid.uuid4().hex[:12]}.arena",
                capacity=capacity,
                persist=False,  # remove the arena (and any journal) at exit
            ),
            events=EventSettings(enabled=False),
            metrics=MetricsSettings(address=""),  # no HTTP port needed
        )
        self.error: BaseException | None = None
        self.copy_path: dict[str, bool] = {}
        self.engine_name = ""
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="offloadd-daemon", daemon=True)

    def start(self, timeout: float) -> DaemonThread:
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"the daemon did not start within {timeout:.0f}s")
        if self.error is not None:
            raise self.error
        return self

    def _run(self) -> None:
        from offloadd.server.daemon import Daemon

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                daemon = Daemon(self.settings)
                await daemon.start()
                self.copy_path = daemon.stats().copy_path
                copy = daemon._copy
                self.engine_name = f"{getattr(copy, 'name', '?')} ({getattr(copy, 'path', '?')})"
            except BaseException as exc:
                self.error = exc
                self._started.set()
                return
            self._started.set()
            try:
                await daemon.serve(self._stop)
            finally:
                await daemon.close()

        asyncio.run(main())

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        shutil.rmtree(self.workdir, ignore_errors=True)


# --- a rank ----------------------------------------------------------------------------------


def make_config(rank: int, layers: int, blocks_per_chunk: int, block_stride: int) -> Any:
    return one_group_config(
        "gpu-check",
        model="gpu-check/model",
        layers=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
        bytes_per_block=block_stride * layers,
        blocks_per_chunk=blocks_per_chunk,
        rank=rank,
        tp=RANKS,
        tokens_per_block=TOKENS_PER_BLOCK,
    )


def rank_main(rank: int, endpoint: str, params: dict[str, Any], barrier: Any, out: Any) -> None:
    """One rank: allocate, register, warm up, store, load, verify, time; results to ``out``."""
    try:
        out.put(("result", rank, _Rank(rank, endpoint, params, barrier).run()))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
        barrier.abort()


class _Rank:
    def __init__(self, rank: int, endpoint: str, params: dict[str, Any], barrier: Any) -> None:
        import torch

        from protocol.messages import Load, Store

        self.torch = torch
        self.rank = rank
        self.endpoint = endpoint
        self.params = params
        self.barrier = barrier
        self.timeout: float = params["timeout"]
        self.page: int = params["page"]
        self.stride: int = params["page"] + params["pad"]
        self.bpc: int = params["blocks_per_chunk"]
        self.Store, self.Load = Store, Load
        self.load_waits = "wait_event" in Load.__struct_fields__
        self.event: Any = None
        self.client: Any = None
        self.tensors: list[Any] = []

    def run(self) -> dict[str, Any]:
        torch = self.torch
        from offloadd.client import OffloadClient
        from offloadd.cuda_ipc import device_uuid, kv_region_from_tensor

        torch.cuda.set_device(0)
        params, bpc = self.params, self.bpc
        layers: int = params["layers"]
        moved: int = params["blocks_per_rank"]
        warm = WARMUP_CHUNKS * bpc
        latency = params["latency_jobs"] * bpc
        num_blocks = 2 * (moved + warm + latency)
        generator = torch.Generator(device="cuda").manual_seed(1234 + self.rank)
        for _ in range(layers):
            kv = torch.full((num_blocks, self.stride), PAD_MARKER, dtype=torch.uint8, device="cuda")
            kv[:, : self.page].random_(0, 256, generator=generator)
            self.tensors.append(kv)
        torch.cuda.synchronize()
        config = make_config(self.rank, layers, bpc, self.stride)
        names = config.groups[0].layer_names
        regions = [
            kv_region_from_tensor(kv[:, : self.page], self.page, [name])
            for kv, name in zip(self.tensors, names, strict=True)
        ]
        self.event = torch.cuda.Event(interprocess=True)
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(99 + self.rank))
        ids = list(range(num_blocks)) if params["contiguous"] else order.tolist()
        result: dict[str, Any] = {"regions": len(regions), "load_wait_event": self.load_waits}
        salt = b"gpu_check"  # the same keys on both ranks: each stores its shard of them
        with OffloadClient.connect(
            self.endpoint, config, regions, device_uuid=device_uuid(0), timeout=self.timeout
        ) as client:
            self.client = client
            client.wait_ready(self.timeout)
            # Warm-up: the fill is still running when the Store goes out; only its event
            # keeps the daemon from copying stale bytes.
            src, dst, ids = ids[:warm], ids[warm : 2 * warm], ids[2 * warm :]
            keys = chain_keys(WARMUP_CHUNKS, salt + b"-warm")
            index = torch.tensor(src, device="cuda")
            for kv in self.tensors:
                kv[index, : self.page] = torch.randint_like(kv[index, : self.page], 0, 256)
            self._jobs("store", keys, src, 10_000, per_job=warm)
            self.barrier.wait(self.timeout)  # a chunk commits once every rank stored its shard
            self._jobs("load", keys, dst, 20_000, per_job=warm)
            result["warmup_mismatched_layers"] = self._mismatched(src, dst)
            # Throughput.
            src, dst, ids = ids[:moved], ids[moved : 2 * moved], ids[2 * moved :]
            keys = chain_keys(moved // bpc, salt)
            per_job = bpc * params["chunks_per_job"]
            for phase, block_ids, base in (("store", src, 1_000_000), ("load", dst, 2_000_000)):
                torch.cuda.synchronize()
                self.barrier.wait(self.timeout)
                started = time.perf_counter()
                done = self._jobs(phase, keys, block_ids, base, per_job=per_job)
                result[f"{phase}_seconds"] = time.perf_counter() - started
                result[f"{phase}_copy_seconds"] = sum(d.seconds for d in done)
                result[f"{phase}_bytes"] = sum(d.nbytes for d in done)
                self.barrier.wait(self.timeout)
            result["mismatched_layers"] = self._mismatched(src, dst)
            result["verified_bytes"] = moved * layers * self.page
            result["padding_intact"] = all(
                bool((kv[:, self.page :] == PAD_MARKER).all()) for kv in self.tensors
            )
            # Latency: one single-chunk job at a time.
            if latency:
                src, dst = ids[:latency], ids[latency : 2 * latency]
                keys = chain_keys(params["latency_jobs"], salt + b"-latency")
                self._zero(dst)
                torch.cuda.synchronize()  # nothing left for the jobs to wait for
                for phase, block_ids, base in (("store", src, 3_000_000), ("load", dst, 4_000_000)):
                    self.barrier.wait(self.timeout)
                    walls, dma = [], []
                    for job in range(params["latency_jobs"]):
                        started = time.perf_counter()
                        (done,) = self._jobs(
                            phase, keys[job : job + 1], block_ids[job * bpc : (job + 1) * bpc],
                            base + job, per_job=bpc, prepare=False,
                        )  # fmt: skip
                        walls.append(time.perf_counter() - started)
                        dma.append(done.seconds)
                    result[f"latency_{phase}"] = {"wall": walls, "dma": dma}
                result["latency_mismatched_layers"] = self._mismatched(src, dst)
            torch.cuda.synchronize()
        return result

    def _jobs(
        self,
        phase: str,
        keys: list[bytes],
        block_ids: list[int],
        first_job: int,
        *,
        per_job: int,
        prepare: bool = True,
    ) -> list[Any]:
        """Submit ``phase`` jobs of ``per_job`` blocks over ``keys``; wait; the JobDones.

        ``prepare``: zero a load's blocks first, and make the daemon wait for this rank's
        stream (the IPC event; a synchronize for a Load that cannot carry it). Without it
        the caller has done both.
        """
        torch, client, bpc = self.torch, self.client, self.bpc
        event = b""
        if prepare:
            if phase == "load":
                self._zero(block_ids)
            if phase == "store" or self.load_waits:
                # The daemon's copy waits for everything this stream did so far.
                self.event.record()
                event = bytes(self.event.ipc_handle())
            else:
                torch.cuda.synchronize()  # the rank-side alternative to an event
        jobs = []
        for job, first in enumerate(range(0, len(block_ids), per_job)):
            chunk_keys = keys[first // bpc : (first + per_job) // bpc]
            chunk_ids = block_ids[first : first + per_job]
            job_id = first_job + job
            if phase == "store":
                client.store(job_id, chunk_keys, chunk_ids, wait_event=event)
            else:
                client.load(job_id, chunk_keys, chunk_ids, wait_event=event)
            jobs.append(job_id)
        done: list[Any] = client.wait(jobs, self.timeout)
        return done

    def _zero(self, block_ids: list[int]) -> None:
        index = self.torch.tensor(block_ids, device="cuda")
        for kv in self.tensors:
            kv[index, : self.page] = 0

    def _mismatched(self, src: list[int], dst: list[int]) -> list[int]:
        """Layers whose loaded pages differ from the stored ones."""
        torch = self.torch
        torch.cuda.synchronize()
        a, b = torch.tensor(src, device="cuda"), torch.tensor(dst, device="cuda")
        return [
            index
            for index, kv in enumerate(self.tensors)
            if not torch.equal(kv[a, : self.page], kv[b, : self.page])
        ]


# --- main ------------------------------------------------------------------------------------


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        lines.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(args: Options) -> int:
    """Run the check (the module docstring); the exit status."""
    from offloadd.settings import format_size

    total, page, pad = args.total, args.page, args.pad
    import torch

    if not torch.cuda.is_available():
        print(
            "check-gpu: CUDA is not available here (torch sees no GPU); nothing to check",
            file=sys.stderr,
        )
        return 2
    per_rank_bytes = total // RANKS
    block_bytes = page * args.layers
    unit = args.blocks_per_chunk * args.chunks_per_job
    blocks_per_rank = max(unit, per_rank_bytes // block_bytes // unit * unit)
    total = blocks_per_rank * block_bytes * RANKS
    deadline = time.monotonic() + args.timeout
    _log(
        f"{torch.cuda.get_device_name(0)}; moving {format_size(total)} each way, "
        f"{format_size(page)} pages padded to {format_size(page + pad)}"
    )
    base = baseline(total)
    _log(f"baseline copy_: store {base['store']:.1f} GB/s, load {base['load']:.1f} GB/s")
    shard = args.blocks_per_chunk * block_bytes
    extra = (WARMUP_CHUNKS + args.latency_jobs) * shard * RANKS
    capacity = max(args.arena, total + total // 8 + extra)
    capacity += 64 << 20
    daemon = DaemonThread(capacity)
    _log(f"starting the daemon (arena {format_size(capacity)})")
    daemon.start(max(120.0, deadline - time.monotonic()))
    path = daemon.copy_path
    degraded = [f"not {feature}" for feature, ok in path.items() if not ok] or (
        [] if path else ["no copy path reported"]
    )
    _log(f"daemon copies with {daemon.engine_name}; copy path {path}")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(RANKS)
    out = ctx.Queue()
    params = {
        "layers": args.layers,
        "page": page,
        "pad": pad,
        "blocks_per_chunk": args.blocks_per_chunk,
        "chunks_per_job": args.chunks_per_job,
        "blocks_per_rank": blocks_per_rank,
        "latency_jobs": args.latency_jobs,
        "contiguous": args.contiguous,
        "timeout": max(10.0, deadline - time.monotonic()),
    }
    procs = [
        ctx.Process(
            target=rank_main, args=(r, daemon.endpoint, params, barrier, out), name=f"rank{r}"
        )
        for r in range(RANKS)
    ]
    results: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    try:
        for proc in procs:
            proc.start()
        for _ in procs:
            remaining = deadline - time.monotonic()
            try:
                kind, rank, payload = out.get(timeout=max(1.0, remaining))
            except Exception:
                errors.append("timed out waiting for the ranks")
                break
            if kind == "result":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for proc in procs:
            proc.join(max(1.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        daemon.stop()
    if errors or len(results) != RANKS:
        for error in errors:
            print(error, file=sys.stderr)
        print("check-gpu: FAILED (see above)", file=sys.stderr)
        return 1
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "engine": daemon.engine_name,
        "copy_path": path,
        "total_bytes": total,
        "arena_bytes": capacity,
        "layers": args.layers,
        "page_bytes": page,
        "pad_bytes": pad,
        "baseline_gbps": base,
        "ranks": results,
    }
    rows = [("phase", "bytes", "seconds", "GB/s", "DMA GB/s", "copy_ GB/s", "ratio")]
    for phase in ("store", "load"):
        seconds = max(r[f"{phase}_seconds"] for r in results.values())
        copy_seconds = sum(r[f"{phase}_copy_seconds"] for r in results.values())
        moved = sum(r[f"{phase}_bytes"] for r in results.values())
        rate = moved / seconds / 1e9
        dma = moved / copy_seconds / 1e9 if copy_seconds else float("nan")
        report[f"{phase}_gbps"] = rate
        report[f"{phase}_dma_gbps"] = dma
        report[f"{phase}_ratio"] = rate / base[phase]
        rows.append(
            (
                phase,
                format_size(moved),
                f"{seconds:.3f}",
                f"{rate:.1f}",
                f"{dma:.1f}",
                f"{base[phase]:.1f}",
                f"{rate / base[phase]:.2f}",
            )
        )
    latency_rows: list[tuple[str, ...]] = [
        ("latency", "jobs", "p50 ms", "p99 ms", "p50 not-DMA ms", "p99 not-DMA ms")
    ]
    for phase in ("store", "load"):
        per_rank = [r[f"latency_{phase}"] for r in results.values() if f"latency_{phase}" in r]
        if not per_rank:
            continue
        walls = [w for figures in per_rank for w in figures["wall"]]
        dmas = [d for figures in per_rank for d in figures["dma"]]
        other = [w - d for w, d in zip(walls, dmas, strict=True)]
        stats = {
            "p50_ms": percentile(walls, 50) * 1e3,
            "p99_ms": percentile(walls, 99) * 1e3,
            "p50_not_dma_ms": percentile(other, 50) * 1e3,
            "p99_not_dma_ms": percentile(other, 99) * 1e3,
        }
        report[f"latency_{phase}"] = stats
        latency_rows.append((phase, str(len(walls)), *(f"{value:.3f}" for value in stats.values())))
    bad = {
        rank: r["mismatched_layers"] + r["warmup_mismatched_layers"]
        + r.get("latency_mismatched_layers", [])
        for rank, r in results.items()
    }  # fmt: skip
    bad = {rank: layers for rank, layers in bad.items() if layers}
    padding = all(r["padding_intact"] for r in results.values())
    verified = sum(r["verified_bytes"] for r in results.values())
    report["verified"] = not bad and padding
    report["degraded"] = degraded
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")
    load_waits = results[0]["load_wait_event"]
    print(
        f"check-gpu: {RANKS} ranks x {args.layers} layers, {format_size(page)} pages + "
        f"{format_size(pad)} padding, {'contiguous' if args.contiguous else 'shuffled'} "
        f"blocks, arena {format_size(capacity)}, {daemon.engine_name}; stores wait on the "
        f"ranks' IPC event, loads {'too' if load_waits else 'after a synchronize (no '}"
        f"{'' if load_waits else 'Load.wait_event yet)'}"
    )
    print(f"copy path: {'batched' if path.get('batched') else 'NOT batched'}, "
          f"{'arena pinned' if path.get('pinned') else 'arena NOT pinned'}")  # fmt: skip
    print(_table(rows))
    if len(latency_rows) > 1:
        print(_table(latency_rows))
    failed = False
    if bad:
        print(f"verify: MISMATCH in layers {bad}")
        failed = True
    if not padding:
        print("verify: padding bytes were written")
        failed = True
    if not failed:
        print(f"verify: {format_size(verified)} loaded back, every byte equal, padding intact")
    if degraded:
        print(f"copy path DEGRADED: {', '.join(degraded)}")
        failed = failed or not args.allow_degraded
    return 1 if failed else 0

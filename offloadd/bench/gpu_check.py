"""gpu_check: the CUDA path end to end on a GPU host, checked byte for byte, with a baseline.

    python -m offloadd.bench.gpu_check [--total 4GiB] [--layers 32] [--json FILE]

What it does (within about a minute on an H200; the budget is 5 minutes):
1. Measures the baseline in this process: ``torch`` ``copy_`` of ``--total`` bytes between
   one CUDA tensor and one pinned host tensor, each direction, best of three.
2. Starts the real daemon (``offloadd.daemon.Daemon``) on a thread of this process with the
   cuda copy engine, an arena of ``--total`` plus slack, and no events.
3. Starts two rank processes (spawn) on GPU 0, one engine with tp=2. Each allocates
   ``--layers`` KV tensors of shape ``(num_blocks, 2, 16, 8, 128)`` bf16 (64 KiB per layer
   per block, like a 16-token block of an 8-KV-head, 128-dim model), fills them with random
   bytes, registers them over CUDA IPC (``offloadd.cuda_ipc.kv_region_from_tensor``) with
   the public client, synchronizes its device (the rank-side alternative to an IPC event),
   and stores ``--total / 2`` bytes from shuffled block ids, several chunks per job.
4. Each rank zeroes other blocks, loads the same keys into them, and compares every byte
   of every layer on the GPU (``torch.equal``) against the blocks it stored.
5. Prints store and load GB/s (both ranks together, wall clock from the first request to the
   last completion) next to the baseline, as a ratio; the table comes last.

Exit status: 0 when every byte matched, 1 otherwise, 2 without CUDA.

Daemon wiring it needs: the daemon must open CUDA IPC handles, which it does when it runs
with ``server.copy_engine = "cuda"`` (settings) — it then builds the engine
(``offloadd.transfer.cuda.make_engine()``), the ``HandleTable`` with
``offloadd.cuda_ipc.CudaIpcOpener()`` and the arena pinned through
``offloadd.transfer.pinning.register_host_memory``. Until that setting exists this script
passes ``make_engine()`` as ``copy_engine`` and says so; Hello is then refused unless the
daemon builds its handle table with a cuda opener for a cuda engine.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import Any

PAGE_SHAPE = (2, 16, 8, 128)  # K and V, 16 tokens, 8 KV heads, head dim 128
PAGE_BYTES = 2 * 16 * 8 * 128 * 2  # bf16: 64 KiB per layer per block
TOKENS_PER_BLOCK = 16
RANKS = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu_check",
        description=(
            "offloadd's CUDA path end to end: a real daemon, two rank processes on one GPU "
            "registering CUDA KV tensors over IPC, stores and loads verified byte for byte, "
            "GB/s next to a torch copy_ baseline measured in the same run."
        ),
    )
    parser.add_argument(
        "--total", default="4GiB", help="bytes stored (and loaded), both ranks (default 4GiB)"
    )
    parser.add_argument("--layers", type=int, default=32, help="KV layers per rank (default 32)")
    parser.add_argument(
        "--blocks-per-chunk", type=int, default=16, help="GPU blocks per cached chunk (16)"
    )
    parser.add_argument(
        "--chunks-per-job", type=int, default=4, help="chunks per store/load request (4)"
    )
    parser.add_argument(
        "--contiguous", action="store_true", help="consecutive block ids (default: shuffled)"
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds for everything")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    return parser


def _log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


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
    """The real daemon on its own thread and event loop."""

    def __init__(self, capacity: int) -> None:
        import msgspec

        from offloadd.settings import Settings

        self.workdir = tempfile.mkdtemp(prefix="od-gpu-", dir="/tmp")
        self.endpoint = f"ipc://{self.workdir}/d.sock"
        fields = {
            f.name: f.type for f in msgspec.structs.fields(Settings)
        }  # sections present in this version of the settings
        server: dict[str, Any] = {"endpoint": self.endpoint, "drain_seconds": 30.0}
        self.wired = "copy_engine" in fields["server"].__struct_fields__
        if self.wired:
            server["copy_engine"] = "cuda"
        cache: dict[str, Any] = {
            "arena": f"/dev/shm/offloadd-gpucheck-{uuid.uuid4().hex[:12]}.arena",
            "capacity": capacity,
        }
        if "persist" in fields["cache"].__struct_fields__:
            cache["persist"] = False  # remove the arena (and any journal) at exit
        sections: dict[str, Any] = {
            "server": fields["server"](**server),
            "cache": fields["cache"](**cache),
            "events": fields["events"](enabled=False),
        }
        if "metrics" in fields:
            sections["metrics"] = fields["metrics"](address="")  # no HTTP port needed
        self.settings = Settings(**sections)
        self.error: BaseException | None = None
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.engine_name = ""
        self._thread = threading.Thread(target=self._run, name="offloadd-daemon", daemon=True)

    def start(self) -> DaemonThread:
        self._thread.start()
        if not self._started.wait(120):
            raise RuntimeError("the daemon did not start within 120s")
        if self.error is not None:
            raise self.error
        return self

    def _run(self) -> None:
        from offloadd.daemon import Daemon

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                if self.wired:
                    daemon = Daemon(self.settings)
                else:
                    from offloadd.transfer.cuda import make_engine

                    daemon = Daemon(self.settings, copy_engine=make_engine())
                await daemon.start()
                copy = getattr(daemon, "_copy", None)
                backend = getattr(copy, "_backend", None)
                self.engine_name = f"{getattr(copy, 'name', '?')} ({getattr(backend, 'name', '?')})"
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


def chain_keys(count: int) -> list[bytes]:
    """Chained 32-byte hashes + u32be group 0, like vLLM's OffloadKeys."""
    keys, parent = [], b"gpu_check"
    for index in range(count):
        parent = hashlib.sha256(parent + index.to_bytes(4, "big")).digest()
        keys.append(parent + (0).to_bytes(4, "big"))
    return keys


def make_config(rank: int, layers: int, blocks_per_chunk: int) -> Any:
    from protocol.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=TOKENS_PER_BLOCK, layer_names=names),),
        worker_kv_bytes_per_block=PAGE_BYTES * layers,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="gpu-check",
        model=OffloadingModelConfig(name="gpu-check/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(
            tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=blocks_per_chunk
        ),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=RANKS,
            tp_size=RANKS,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            is_parallelism_agnostic=True,
        ),
    )


def rank_main(rank: int, endpoint: str, params: dict[str, Any], barrier: Any, out: Any) -> None:
    """One rank: allocate, register, store, load, verify; results go to ``out``."""
    try:
        out.put(("result", rank, _rank(rank, endpoint, params, barrier)))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
        barrier.abort()


def _rank(rank: int, endpoint: str, params: dict[str, Any], barrier: Any) -> dict[str, Any]:
    import torch

    from offloadd.client import OffloadClient
    from offloadd.cuda_ipc import device_uuid, kv_region_from_tensor

    torch.cuda.set_device(0)
    layers: int = params["layers"]
    bpc: int = params["blocks_per_chunk"]
    moved: int = params["blocks_per_rank"]
    per_job = bpc * params["chunks_per_job"]
    num_blocks = 2 * moved
    generator = torch.Generator(device="cuda").manual_seed(1234 + rank)
    tensors = []
    for _ in range(layers):
        kv = torch.empty((num_blocks, *PAGE_SHAPE), dtype=torch.bfloat16, device="cuda")
        kv.view(torch.uint8).view(num_blocks, -1).random_(0, 256, generator=generator)
        tensors.append(kv)
    torch.cuda.synchronize()
    config = make_config(rank, layers, bpc)
    names = config.groups[0].layer_names
    regions = [
        kv_region_from_tensor(t, PAGE_BYTES, [n]) for t, n in zip(tensors, names, strict=True)
    ]
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(99 + rank))
    ids = list(range(num_blocks)) if params["contiguous"] else order.tolist()
    src_ids, dst_ids = ids[:moved], ids[moved:]
    keys = chain_keys(moved // bpc)
    timeout = params["timeout"]
    result: dict[str, Any] = {"regions": len(regions)}
    with OffloadClient.connect(
        endpoint, config, regions, device_uuid=device_uuid(0), timeout=timeout
    ) as client:
        client.wait_ready(timeout)
        for phase, block_ids in (("store", src_ids), ("load", dst_ids)):
            if phase == "load":
                for kv in tensors:
                    kv[torch.tensor(dst_ids, device="cuda")] = 0
            # Rank-side alternative to an IPC event: the daemon may read the blocks now.
            torch.cuda.synchronize()
            barrier.wait(timeout)
            started = time.perf_counter()
            jobs = []
            for job, first in enumerate(range(0, moved, per_job)):
                job_id = (1 if phase == "store" else 2) * 1_000_000 + job
                chunk_keys = keys[first // bpc : (first + per_job) // bpc]
                submit = client.store if phase == "store" else client.load
                submit(job_id, chunk_keys, block_ids[first : first + per_job])
                jobs.append(job_id)
            done = client.wait(jobs, timeout)
            result[f"{phase}_seconds"] = time.perf_counter() - started
            result[f"{phase}_copy_seconds"] = sum(d.seconds for d in done)
            result[f"{phase}_bytes"] = sum(d.nbytes for d in done)
            barrier.wait(timeout)
        src = torch.tensor(src_ids, device="cuda")
        dst = torch.tensor(dst_ids, device="cuda")
        # Bit patterns, not bf16 values: random bytes hold NaNs, which never compare equal.
        mismatched = [
            index
            for index, kv in enumerate(tensors)
            if not torch.equal(kv.view(torch.int16)[src], kv.view(torch.int16)[dst])
        ]
        torch.cuda.synchronize()
    result["mismatched_layers"] = mismatched
    result["verified_blocks"] = moved
    result["verified_bytes"] = moved * layers * PAGE_BYTES
    return result


# --- main ------------------------------------------------------------------------------------


def _table(rows: list[tuple[str, ...]]) -> str:
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from offloadd.settings import format_size, parse_size

    total = parse_size(args.total)
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available here (torch sees no GPU); nothing to check",
            file=sys.stderr,
        )
        return 2
    per_rank_bytes = total // RANKS
    block_bytes = PAGE_BYTES * args.layers
    unit = args.blocks_per_chunk * args.chunks_per_job
    blocks_per_rank = max(unit, per_rank_bytes // block_bytes // unit * unit)
    total = blocks_per_rank * block_bytes * RANKS
    deadline = time.monotonic() + args.timeout
    _log(f"{torch.cuda.get_device_name(0)}; moving {format_size(total)} each way")
    base = baseline(total)
    _log(f"baseline copy_: store {base['store']:.1f} GB/s, load {base['load']:.1f} GB/s")
    capacity = total + total // 8 + (64 << 20)
    daemon = DaemonThread(capacity)
    _log(f"starting the daemon (arena {format_size(capacity)})")
    daemon.start()
    if not daemon.wired:
        _log("settings have no server.copy_engine yet: passing make_engine() as copy_engine")
    _log(f"daemon copies with {daemon.engine_name}")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(RANKS)
    out = ctx.Queue()
    params = {
        "layers": args.layers,
        "blocks_per_chunk": args.blocks_per_chunk,
        "chunks_per_job": args.chunks_per_job,
        "blocks_per_rank": blocks_per_rank,
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
        print("gpu_check: FAILED (see above)", file=sys.stderr)
        return 1
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "engine": daemon.engine_name,
        "total_bytes": total,
        "layers": args.layers,
        "page_bytes": PAGE_BYTES,
        "baseline_gbps": base,
        "ranks": results,
    }
    rows = [("phase", "bytes", "seconds", "GB/s", "copy_ GB/s", "ratio")]
    for phase in ("store", "load"):
        seconds = max(r[f"{phase}_seconds"] for r in results.values())
        moved = sum(r[f"{phase}_bytes"] for r in results.values())
        rate = moved / seconds / 1e9
        report[f"{phase}_gbps"] = rate
        report[f"{phase}_ratio"] = rate / base[phase]
        rows.append(
            (
                phase,
                format_size(moved),
                f"{seconds:.3f}",
                f"{rate:.1f}",
                f"{base[phase]:.1f}",
                f"{rate / base[phase]:.2f}",
            )
        )
    bad = {rank: r["mismatched_layers"] for rank, r in results.items() if r["mismatched_layers"]}
    verified = sum(r["verified_bytes"] for r in results.values())
    report["verified"] = not bad
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")
    print(
        f"gpu_check: {RANKS} ranks x {args.layers} layers, {PAGE_BYTES >> 10} KiB pages, "
        f"{'contiguous' if args.contiguous else 'shuffled'} blocks, {daemon.engine_name}"
    )
    print(_table(rows))
    if bad:
        print(f"verify: MISMATCH in layers {bad}")
        return 1
    print(f"verify: {format_size(verified)} loaded back, every byte equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())

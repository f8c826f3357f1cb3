"""CPU cost per copy of a cuda store job, planning and marshalling, the driver call stubbed.

    python -m offloadd.bench.cuda_marshal [--copies 131072] [--json FILE]
    offloadd bench --only cuda_marshal

A store job of ``--copies`` copies (default 128k: 32 unpacked layers x 4096 shuffled blocks of
61 KiB pages, so nothing merges) is planned by the daemon's planner (``chunk_copies`` into a
``Copies``, as the daemon calls it: arrays per chunk), then taken to the driver call:
``move_arrays`` (merged once, cut at pinned pieces) and ``BatchCopier.copy`` through the real
ctypes prototype, whose C entry point is a stub that returns at once. No GPU is needed.

Baseline, measured the same way and interleaved: the previous path, planning into a list of
tuples, a list copy, a merge in Python, three Python lists, and the per-pointer helper
objects NVIDIA's Python bindings build inside ``cudaMemcpyBatchAsync`` (``CUdeviceptr`` per
pointer; left out when cuda-bindings is not installed, as the params say).

Goal: at most 0.1 µs per copy for planning and marshalling together (both run on the
daemon's threads for every copy of every job).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from offloadd.bench._util import Context, Result, ratio
from offloadd.transfer.batch import ABIS, BatchCopier, HostPieces, move_arrays
from offloadd.transfer.copies import Copies
from offloadd.transfer.engine import Direction, Triple
from offloadd.transfer.plan import Span, chunk_copies

PAGE = 61 * 1024
STRIDE = 64 * 1024
LAYERS = 32
BLOCKS_PER_CHUNK = 16
GOAL_US = 0.1


def plan(copies: int, out: list[Triple] | Copies) -> float:
    """Plan a store job of ``copies`` copies into ``out`` as the daemon does; the seconds."""
    blocks = max(BLOCKS_PER_CHUNK, copies // LAYERS // BLOCKS_PER_CHUNK * BLOCKS_PER_CHUNK)
    ids = list(range(4 * blocks))
    random.Random(7).shuffle(ids)
    ids = ids[:blocks]
    spans = tuple(
        Span(0x7F00_0000_0000 + layer * (1 << 32), STRIDE, PAGE, layer * PAGE * BLOCKS_PER_CHUNK)
        for layer in range(LAYERS)
    )
    shard = LAYERS * PAGE * BLOCKS_PER_CHUNK
    started = time.perf_counter()
    for chunk, first in enumerate(range(0, blocks, BLOCKS_PER_CHUNK)):
        chunk_copies(
            spans, ids[first : first + BLOCKS_PER_CHUNK], 0x10_0000_0000 + chunk * shard, out
        )
    return time.perf_counter() - started


def _stub_copier() -> BatchCopier:
    abi = ABIS[0]
    entry = abi.prototype()(lambda *args: 0)  # the driver call: returns CUDA_SUCCESS at once
    copier = BatchCopier(entry, abi)
    copier._keepalive = entry  # type: ignore[attr-defined]
    return copier


def _old_merge(moves: list[Triple]) -> list[Triple]:
    merged: list[Triple] = []
    for src, dst, nbytes in moves:
        if nbytes <= 0:
            continue
        if merged:
            last_src, last_dst, last_n = merged[-1]
            if last_src + last_n == src and last_dst + last_n == dst:
                merged[-1] = (last_src, last_dst, last_n + nbytes)
                continue
        merged.append((src, dst, nbytes))
    return merged


def _binding_pointer() -> Callable[[int], Any] | None:
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    pointer: Callable[[int], Any] = driver.CUdeviceptr
    return pointer


def measure(copies: int, repeats: int) -> dict[str, Any]:
    """Best-of-``repeats`` microseconds per copy, new and old path, planning and marshalling."""
    copier = _stub_copier()
    pieces = HostPieces(0x10_0000_0000, 64 << 30)
    pointer = _binding_pointer()

    def new() -> tuple[float, float, int]:
        moves = Copies()
        planning = plan(copies, moves)
        started = time.perf_counter()
        arrays = move_arrays(moves, Direction.STORE, pieces)
        copier.copy(0x1234, Direction.STORE, arrays)
        return planning, time.perf_counter() - started, len(moves)

    def old() -> tuple[float, float, int]:
        moves: list[Triple] = []
        planning = plan(copies, moves)
        started = time.perf_counter()
        merged = _old_merge(list(moves))
        srcs, dsts = [m[0] for m in merged], [m[1] for m in merged]
        sizes = [m[2] for m in merged]
        if pointer is not None:
            [pointer(a) for a in srcs]
            [pointer(a) for a in dsts]
        del sizes
        return planning, time.perf_counter() - started, len(moves)

    best: dict[str, tuple[float, float]] = {}
    count = 0
    for _ in range(repeats):  # interleaved, so noise hits both alike
        for name, path in (("new", new), ("old", old)):
            planning, marshalling, count = path()
            if name not in best or planning + marshalling < sum(best[name]):
                best[name] = (planning, marshalling)
    figures: dict[str, Any] = {"copies": count, "binding_helpers_in_old": pointer is not None}
    for name, (planning, marshalling) in best.items():
        figures[f"{name}_plan_us"] = planning / count * 1e6
        figures[f"{name}_marshal_us"] = marshalling / count * 1e6
        figures[f"{name}_us_per_copy"] = (planning + marshalling) / count * 1e6
    return figures


def run(ctx: Context) -> list[Result]:
    """The ``cuda_marshal`` group of ``offloadd bench``."""
    if not ctx.wanted("cuda_marshal_per_copy"):
        return []
    figures = measure(ctx.pick(128, 128, 8) * 1024, ctx.pick(15, 5, 2))
    ctx.progress(
        f"cuda_marshal: {figures['new_us_per_copy']:.3f} us/copy "
        f"(old path {figures['old_us_per_copy']:.3f})"
    )
    return [_result(figures)]


def _result(figures: dict[str, Any]) -> Result:
    new, old = figures["new_us_per_copy"], figures["old_us_per_copy"]
    params = dict(figures, goal=f"value <= {GOAL_US}")
    return Result("cuda_marshal_per_copy", new, "us/copy", old, ratio(new, old), params)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cuda_marshal", description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=128 * 1024, help="copies per job")
    parser.add_argument("--repeats", type=int, default=15, help="best of this many runs")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = parser.parse_args(argv)
    figures = measure(args.copies, args.repeats)
    result = _result(figures)
    met = result.value <= GOAL_US
    print(
        f"cuda_marshal: {figures['copies']} copies, planned and marshalled: {result.value:.3f} "
        f"us/copy (goal <= {GOAL_US}: {'ok' if met else 'MISSED'}; planning "
        f"{figures['new_plan_us']:.3f} + marshalling {figures['new_marshal_us']:.3f}); "
        f"old path {result.baseline:.3f} us/copy (planning {figures['old_plan_us']:.3f} + "
        f"marshalling {figures['old_marshal_us']:.3f}), {1 / result.ratio:.1f}x slower"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result.as_json(), handle, indent=2)
            handle.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

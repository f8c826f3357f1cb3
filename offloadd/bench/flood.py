"""``victim_store_under_flood`` and ``victim_lookup_under_flood``: what a flood from peers of
another tenant costs a victim's store and lookup round trips (issue 46), against the same
round trips on the same daemon with no flood, blocks of each in turn, in one run.

The flood: a subprocess (``_servers`` ``flooder``) with 4 sockets that never register nor
say Hello, each sending step messages of 4,096 empty Lookups (``limits.lookups_per_message``,
the most a message may carry) as fast as the daemon reads them, their answers unread. It runs
as the benchmark's own user: peers the daemon knows nothing of are a tenant of their own in
its lanes (they share one turn), so no second Unix user is needed. The victim: a rank of
another engine (``OffloadClient``, blocking) storing one chunk and waiting for its
``JobDone``, and its scheduler looking up 16 cached chunks. Before the fix each such message
was decoded and got 4,097 answers in one turn of the loop (70 ms here), and libzmq queued
1,000 of them per connection: the backlog did not drain within a minute. Now each is peeked
and refused once (``offloadd.server.peek``), and counts for its size in the lanes. After each
flood block the daemon's backlog drains (its protocol-error count stops moving) before an
idle block is timed. The goal bounds the delay (the flooder takes a core of a small machine),
it does not promise isolation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from offloadd.bench._util import (
    Context,
    Result,
    ServerProcess,
    one_group_config,
    paired_ratio,
    percentile,
    ratio,
)
from offloadd.bench.datapath import chunk_keys, daemon
from offloadd.client import OffloadClient
from offloadd.shm import SharedKVTensor

__all__ = ["NAMES", "run"]

NAMES = ("victim_store_under_flood", "victim_lookup_under_flood")
FLOOD_SOCKETS = 4
FLOOD_LOOKUPS = 4096
PAGE = 4096
BLOCKS = 64
LOOKUP_HITS = 16
LAYER = "model.layers.0.attn"


@contextlib.contextmanager
def _victim(ctx: Context, endpoint: str) -> Iterator[tuple[OffloadClient, OffloadClient]]:
    """A rank and the scheduler of one engine, ``LOOKUP_HITS`` chunks cached."""
    kv = SharedKVTensor.create(BLOCKS, PAGE, [LAYER], prefix=f"{ctx.scratch.shm_prefix}-flood")
    try:
        config = one_group_config(
            "bench-victim", model="bench/flood", layers=(LAYER,), bytes_per_block=PAGE
        )
        with OffloadClient.connect(endpoint, config, [kv.region], name="victim rank") as rank:
            rank.wait_ready(30)
            rank.store(1, chunk_keys(LOOKUP_HITS, b"cached"), list(range(LOOKUP_HITS)))
            rank.wait([1])
            with OffloadClient.connect(endpoint, config, role="scheduler") as scheduler:
                yield rank, scheduler
    finally:
        kv.close()


def _drained(rank: OffloadClient, deadline: float = 60.0) -> None:
    """Wait until the daemon has answered the flood's backlog (its error count is still)."""
    last, until = -1, time.monotonic() + deadline
    while time.monotonic() < until:
        errors = rank.stats().protocol_errors
        if errors == last:
            return
        last = errors
        time.sleep(0.05)
    raise RuntimeError("the flood's backlog did not drain")


def run(ctx: Context) -> list[Result]:
    """Both rows, from one daemon, one victim and one flooder."""
    if not any(ctx.wanted(name) for name in NAMES):
        return []
    blocks = ctx.pick(16, 6, 2)
    per_block = ctx.pick(100, 50, 10)
    ctx.progress(f"victim under a flood: {blocks} blocks of {per_block}, flood and idle in turn")
    with (
        daemon(ctx, 64 << 20, "flood", persist=False) as (endpoint, _),
        _victim(ctx, endpoint) as (rank, scheduler),
        ServerProcess(
            "flooder", {"endpoint": endpoint, "sockets": FLOOD_SOCKETS, "lookups": FLOOD_LOOKUPS}
        ) as flooder,
    ):
        cached = chunk_keys(LOOKUP_HITS, b"cached")
        clock = time.perf_counter_ns
        job = 1

        def store() -> None:
            nonlocal job
            job += 1
            rank.store(job, chunk_keys(1, job.to_bytes(8, "big")), [LOOKUP_HITS + job % 32])
            rank.wait([job], timeout=60)

        def lookup() -> None:
            hits = scheduler.lookup(cached).hits
            if hits != LOOKUP_HITS:
                raise RuntimeError(f"the victim's lookup found {hits} of {LOOKUP_HITS}")

        def timed(op: Callable[[], None], out: list[float]) -> None:
            for _ in range(per_block):
                started = clock()
                op()
                out.append((clock() - started) / 1e3)

        samples: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in NAMES}
        pairs: dict[str, list[tuple[float, float]]] = {n: [] for n in NAMES}
        sent = 0
        for index in range(blocks + 1):  # the first pair warms both paths up, not counted
            for name, op in zip(NAMES, (store, lookup), strict=True):
                busy: list[float] = []
                idle: list[float] = []
                if flooder.command("go") != "ok":
                    raise RuntimeError("the flooder did not start")
                timed(op, busy)
                flooded = int(flooder.command("stop"))
                _drained(rank)
                timed(op, idle)
                if index:
                    sent += flooded
                    samples[name][0].extend(busy)
                    samples[name][1].extend(idle)
                    pairs[name].append((percentile(busy, 50), percentile(idle, 50)))
        results = []
        for name in NAMES:
            busy, idle = samples[name]
            value, base = percentile(busy, 50), percentile(idle, 50)
            params = {
                "samples": len(busy),
                "block": per_block,
                "p99_us": percentile(busy, 99),
                "baseline_p99_us": percentile(idle, 99),
                "p99_ratio": ratio(percentile(busy, 99), percentile(idle, 99)),
                "paired_p50_ratio": paired_ratio(*zip(*pairs[name], strict=True)),
                "flood_messages": sent,
                "flood": f"{FLOOD_SOCKETS} sockets with no session, step messages of "
                f"{FLOOD_LOOKUPS} empty lookups as fast as the daemon reads, answers unread",
                "flood_process": "a second process of the benchmark's own user (no second "
                "Unix user: peers with no session are a tenant of their own in the lanes)",
                "victim": "a rank storing 1 chunk and waiting for its JobDone"
                if name == NAMES[0]
                else f"its scheduler looking up {LOOKUP_HITS} cached chunks",
                "baseline": "the same round trips on the same daemon, no flood, blocks in turn",
                "ratio": "pooled p50 under the flood / pooled p50 without",
                "goal": "ratio <= 20",
            }
            ctx.progress(
                f"  {name}: p50 {value:.0f} us vs {base:.0f} us alone "
                f"({ratio(value, base):.2f}), p99 {params['p99_us']:.0f} vs "
                f"{params['baseline_p99_us']:.0f} us"
            )
            results.append(Result(name, value, "us", base, ratio(value, base), params))
        return results

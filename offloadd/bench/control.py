"""Control path: lookup round trips, lookups per second, the 8-rank handshake, and lookup
round trips while another rank's large stores run (``lookup_rtt_under_stores``).

The daemon and the baseline echo server are both subprocesses of the same kind (uvloop +
zmq.asyncio, a ROUTER bound on ipc://), so the only difference is what happens between
receive and send: the echo sends the frame back, the daemon decodes, checks, looks the keys
up in its index and encodes a reply. Clients are the real ones: ``OffloadClient`` (blocking)
for round-trip latency, ``AsyncOffloadClient`` for throughput and the handshake; the echo
side uses bare pyzmq sockets of the same kind (blocking DEALER, asyncio DEALER with its own
context per client, as each async client has) with the very bytes of the daemon request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import uvloop
import zmq
import zmq.asyncio

from offloadd.bench._util import (
    Context,
    MiB,
    Result,
    ServerProcess,
    median,
    one_group_config,
    paired_ratio,
    percentile,
    process_cpu_seconds,
    ratio,
)
from offloadd.bench.datapath import chunk_keys, daemon
from offloadd.client import AsyncOffloadClient, OffloadClient
from offloadd.shm import SharedKVTensor
from protocol import PROTOCOL_VERSION
from protocol.config import (
    OffloadingConfig,
)
from protocol.handles import KVRegion
from protocol.messages import Hello, Lookup, encode

LOOKUP_KEYS = 32  # a prompt of 32 chunks
LOOKUP_HITS = 16  # of which the first 16 are cached
RATE_CLIENTS = 8  # lookups_per_s_8
PAGE = 4096
NUM_BLOCKS = 64
LAYER = "model.layers.0.attn"


def small_config(engine_id: str, rank: int = 0, tp: int = 1) -> OffloadingConfig:
    return one_group_config(
        engine_id, model="bench/control", layers=(LAYER,), bytes_per_block=PAGE, rank=rank, tp=tp
    )


@dataclass
class Servers:
    """The daemon and the echo server, both subprocesses of the same kind."""

    endpoint: str
    echo: str
    daemon: ServerProcess
    echo_server: ServerProcess


@contextlib.contextmanager
def _servers(ctx: Context, label: str) -> Iterator[Servers]:
    echo_endpoint = ctx.scratch.endpoint("echo")
    with (
        daemon(ctx, 64 << 20, label) as (endpoint, daemon_process),
        ServerProcess("echo", {"endpoint": echo_endpoint}) as echo_process,
    ):
        yield Servers(endpoint, echo_endpoint, daemon_process, echo_process)


@contextlib.contextmanager
def _kv_files(ctx: Context, count: int) -> Iterator[list[SharedKVTensor]]:
    files: list[SharedKVTensor] = []
    try:
        for _ in range(count):
            files.append(
                SharedKVTensor.create(
                    NUM_BLOCKS, PAGE, [LAYER], prefix=f"{ctx.scratch.shm_prefix}-ctl"
                )
            )
        yield files
    finally:
        for kv in files:
            kv.close()


# ------------------------------------------------------------------------- lookups


def run_lookup(ctx: Context) -> list[Result]:
    """``lookup_rtt_p50``, ``lookup_rtt_p99``, ``lookups_per_s_1``, ``lookups_per_s_8``."""
    names = ("lookup_rtt_p50", "lookup_rtt_p99", "lookups_per_s_1", "lookups_per_s_8")
    if not any(ctx.wanted(n) for n in names):
        return []
    keys = chunk_keys(LOOKUP_KEYS, b"lookup")
    payload = encode(Lookup(1_000_000, keys))
    results: list[Result] = []
    # One rank file for the engine that stores the keys, one for each client's engine.
    with _servers(ctx, "lookup") as servers, _kv_files(ctx, 1 + RATE_CLIENTS) as files:
        endpoint, echo = servers.endpoint, servers.echo
        regions = [kv.region for kv in files[1:]]
        with _cached_lookup(endpoint, files[0].region, "bench-lookup") as (scheduler, _):
            if any(ctx.wanted(n) for n in ("lookup_rtt_p50", "lookup_rtt_p99")):
                results += _rtt(ctx, scheduler, keys, servers, payload)
            for clients in (1, RATE_CLIENTS):
                if ctx.wanted(f"lookups_per_s_{clients}"):
                    results.append(
                        uvloop.run(_rate(ctx, endpoint, regions, keys, echo, payload, clients))
                    )
    return [r for r in results if ctx.wanted(r.name)]


def _rtt(
    ctx: Context, client: OffloadClient, keys: list[bytes], servers: Servers, payload: bytes
) -> list[Result]:
    samples = ctx.pick(20000, 4000, 1000)
    block = 500
    warm_up = ctx.pick(300, 300, 50)
    ctx.progress(f"lookup round trips: {samples} each, daemon and echo alternating")
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(servers.echo)
    clock = time.perf_counter_ns
    me = os.getpid()
    # CPU seconds (client process, server process) spent on the measured round trips.
    cpu = {"daemon": [0.0, 0.0], "echo": [0.0, 0.0]}
    try:

        def daemon_block(count: int, out: list[float]) -> None:
            client_cpu, server_cpu = process_cpu_seconds(me), servers.daemon.cpu_seconds()
            for _ in range(count):
                started = clock()
                client.lookup(keys)
                out.append((clock() - started) / 1e3)
            cpu["daemon"][0] += process_cpu_seconds(me) - client_cpu
            cpu["daemon"][1] += servers.daemon.cpu_seconds() - server_cpu

        def echo_block(count: int, out: list[float]) -> None:
            client_cpu, server_cpu = process_cpu_seconds(me), servers.echo_server.cpu_seconds()
            for _ in range(count):
                started = clock()
                sock.send(payload)
                sock.recv()
                out.append((clock() - started) / 1e3)
            cpu["echo"][0] += process_cpu_seconds(me) - client_cpu
            cpu["echo"][1] += servers.echo_server.cpu_seconds() - server_cpu

        warm: list[float] = []
        daemon_block(warm_up, warm)
        echo_block(warm_up, warm)
        cpu = {"daemon": [0.0, 0.0], "echo": [0.0, 0.0]}
        d: list[float] = []
        e: list[float] = []
        block_p50: list[tuple[float, float]] = []
        for index in range(samples // block):
            bd: list[float] = []
            be: list[float] = []
            if index % 2 == 0:
                daemon_block(block, bd)
                echo_block(block, be)
            else:
                echo_block(block, be)
                daemon_block(block, bd)
            d += bd
            e += be
            block_p50.append((percentile(bd, 50), percentile(be, 50)))
    finally:
        sock.close(linger=0)
        zctx.term()
    params = {
        "keys": len(keys),
        "hits": LOOKUP_HITS,
        "payload_bytes": len(payload),
        "samples": len(d),
        "client": "OffloadClient (blocking)",
        "baseline": "blocking DEALER -> uvloop zmq.asyncio ROUTER echo subprocess, ipc://",
        # CPU per round trip: where the extra latency is spent (busy time, not waiting).
        "client_cpu_us": cpu["daemon"][0] / len(d) * 1e6,
        "server_cpu_us": cpu["daemon"][1] / len(d) * 1e6,
        "baseline_client_cpu_us": cpu["echo"][0] / len(e) * 1e6,
        "baseline_server_cpu_us": cpu["echo"][1] / len(e) * 1e6,
    }
    results = []
    for q in (50, 99):
        value, base = percentile(d, q), percentile(e, q)
        extra: dict[str, object] = {}
        if q == 50:
            # p50 per block of samples, pair by pair: drifting noise cancels within a pair.
            paired = paired_ratio([p for p, _ in block_p50], [p for _, p in block_p50])
            extra = {"goal": "ratio <= 1.25", "ratio": "median of per-block p50 ratios"}
        else:
            paired = ratio(value, base)
            extra = {"ratio": "pooled p99 over all blocks"}
        results.append(Result(f"lookup_rtt_p{q}", value, "us", base, paired, params | extra))
        ctx.progress(f"  lookup_rtt_p{q}: {value:.0f} us vs echo {base:.0f} us ({paired:.2f})")
    return results


async def _rate(
    ctx: Context,
    endpoint: str,
    regions: list[KVRegion],
    keys: list[bytes],
    echo: str,
    payload: bytes,
    concurrency: int,
) -> Result:
    rounds = ctx.pick(5, 3, 2)
    seconds = ctx.pick(2.0, 1.0, 0.2)
    ctx.progress(f"lookups/s with {concurrency} clients: {rounds} rounds of {seconds:g}s each")
    workers: list[AsyncOffloadClient] = []
    clients: list[AsyncOffloadClient] = []
    contexts: list[zmq.asyncio.Context] = []
    sockets: list[zmq.asyncio.Socket] = []
    try:
        for index in range(concurrency):
            # An engine per client, each with its one rank (a scheduler's lookups need a ready
            # engine): the daemon takes a second scheduler Hello of one engine from the same
            # process as a restart and ends the first session (NOT_REGISTERED at its next
            # lookup), and vLLM has one scheduler per engine. Same model and geometry as
            # ``_cached_lookup``'s engine, so one namespace: every client finds its hits.
            config = small_config(f"bench-lookup-rate-{concurrency}-{index}")
            worker = await AsyncOffloadClient.connect(
                endpoint, config, [regions[index]], name=f"bench rank {index}"
            )
            workers.append(worker)
            await worker.wait_ready(30)
            client = await AsyncOffloadClient.connect(
                endpoint, config, role="scheduler", name=f"bench scheduler {index}"
            )
            clients.append(client)
            hits = (await client.lookup(keys)).hits
            if hits != LOOKUP_HITS:
                raise RuntimeError(f"scheduler {index} found {hits} hits, expected {LOOKUP_HITS}")
            zctx = zmq.asyncio.Context()
            contexts.append(zctx)
            sock = zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(echo)
            sockets.append(sock)

        async def daemon_loop(client: AsyncOffloadClient, deadline: float) -> int:
            count = 0
            while time.perf_counter() < deadline:
                await client.lookup(keys)
                count += 1
            return count

        async def echo_loop(sock: zmq.asyncio.Socket, deadline: float) -> int:
            count = 0
            while time.perf_counter() < deadline:
                await sock.send(payload)
                await sock.recv()
                count += 1
            return count

        async def daemon_round(duration: float) -> float:
            started = time.perf_counter()
            deadline = started + duration
            counts = await asyncio.gather(*(daemon_loop(c, deadline) for c in clients))
            return sum(counts) / (time.perf_counter() - started)

        async def echo_round(duration: float) -> float:
            started = time.perf_counter()
            deadline = started + duration
            counts = await asyncio.gather(*(echo_loop(s, deadline) for s in sockets))
            return sum(counts) / (time.perf_counter() - started)

        await daemon_round(0.2)
        await echo_round(0.2)
        d: list[float] = []
        e: list[float] = []
        for index in range(rounds):
            if index % 2 == 0:
                d.append(await daemon_round(seconds))
                e.append(await echo_round(seconds))
            else:
                e.append(await echo_round(seconds))
                d.append(await daemon_round(seconds))
    finally:
        for client in clients + workers:
            with contextlib.suppress(Exception):
                await client.close()
        for sock in sockets:
            sock.close(linger=0)
        for zctx in contexts:
            zctx.term()
    value, base = median(d), median(e)
    paired = paired_ratio(d, e)
    name = f"lookups_per_s_{concurrency}"
    ctx.progress(f"  {name}: {value:,.0f}/s vs echo {base:,.0f}/s ({paired:.2f})")
    params = {
        "clients": concurrency,
        "keys": len(keys),
        "payload_bytes": len(payload),
        "rounds": rounds,
        "round_seconds": seconds,
        "client": "AsyncOffloadClient, one loop (uvloop) in the benchmark process",
        "engines": "one per client (role scheduler), each with one idle rank",
        "baseline": "asyncio DEALERs (one context each) -> uvloop ROUTER echo subprocess",
        "ratio": "median of per-round ratios, rounds back to back",
        "goal": "ratio >= 0.7" if concurrency == 1 else "ratio >= 0.85",
    }
    return Result(name, value, "1/s", base, paired, params)


# ------------------------------------------------------------------------- under stores

STORE_PAGE = 256 << 10
STORE_BLOCKS = 16  # blocks per store job: 4 MiB
STORE_DEPTH = 4  # store jobs in flight, back to back


@contextlib.contextmanager
def _cached_lookup(
    endpoint: str, region: KVRegion, engine_id: str
) -> Iterator[tuple[OffloadClient, list[bytes]]]:
    """A scheduler whose lookup of ``LOOKUP_KEYS`` keys hits the first ``LOOKUP_HITS``."""
    keys = chunk_keys(LOOKUP_KEYS, b"lookup")
    config = small_config(engine_id)
    with OffloadClient.connect(endpoint, config, [region], name="worker") as worker:
        worker.wait_ready(30)
        worker.store(1, keys[:LOOKUP_HITS], list(range(LOOKUP_HITS)))
        worker.wait([1])
        with OffloadClient.connect(endpoint, config, role="scheduler") as scheduler:
            hits = scheduler.lookup(keys).hits
            if hits != LOOKUP_HITS:
                raise RuntimeError(f"lookup found {hits} hits, expected {LOOKUP_HITS}")
            yield scheduler, keys


def run_under_stores(ctx: Context) -> list[Result]:
    """``lookup_rtt_under_stores``: a scheduler's Lookup round trip while another rank keeps
    ``STORE_DEPTH`` stores of 4 MiB in flight, vs the same lookups on the same daemon idle,
    block by block in turn."""
    name = "lookup_rtt_under_stores"
    if not ctx.wanted(name):
        return []
    blocks = ctx.pick(40, 10, 2)
    block = ctx.pick(500, 300, 50)
    ctx.progress(f"lookups under stores: {blocks} blocks of {block}, busy and idle in turn")
    store_kv = SharedKVTensor.create(
        STORE_BLOCKS * STORE_DEPTH, STORE_PAGE, [LAYER], prefix=f"{ctx.scratch.shm_prefix}-st"
    )
    try:
        assert store_kv.tensor is not None
        store_kv.tensor.fill_(7)  # real pages, not holes of the file
        with (
            daemon(ctx, 256 * MiB, "under-stores") as (endpoint, _),
            _kv_files(ctx, 1) as files,
            _cached_lookup(endpoint, files[0].region, "bench-under-stores") as (scheduler, keys),
            ServerProcess(
                "storer",
                {
                    "endpoint": endpoint,
                    "region": msgspec.to_builtins(store_kv.region),
                    "engine_id": "bench-under-stores-writer",
                    "model": "bench/control-stores",
                    "layers": [LAYER],
                    "page": STORE_PAGE,
                    "blocks": STORE_BLOCKS,
                    "depth": STORE_DEPTH,
                },
            ) as storer,
        ):
            return [_under_stores(ctx, name, scheduler, keys, storer, blocks, block)]
    finally:
        store_kv.close()


def _under_stores(
    ctx: Context,
    name: str,
    scheduler: OffloadClient,
    keys: list[bytes],
    storer: ServerProcess,
    blocks: int,
    block: int,
) -> Result:
    clock = time.perf_counter_ns
    busy: list[float] = []
    idle: list[float] = []
    block_p50: list[tuple[float, float]] = []
    stored = {"jobs": 0, "bytes": 0, "seconds": 0.0}
    fewest_hits = LOOKUP_HITS

    def lookups(out: list[float]) -> None:
        nonlocal fewest_hits
        for _ in range(block):
            started = clock()
            hits = scheduler.lookup(keys).hits
            out.append((clock() - started) / 1e3)
            fewest_hits = min(fewest_hits, hits)

    def busy_block(out: list[float]) -> None:
        started = time.perf_counter()
        reply = storer.command("go")
        if reply != "ok":
            raise RuntimeError(f"storer: {reply}")
        lookups(out)
        reply = storer.command("stop")
        if reply.startswith("failed"):
            raise RuntimeError(f"storer: {reply}")
        jobs, nbytes = map(int, reply.split())
        stored["jobs"] += jobs
        stored["bytes"] += nbytes
        stored["seconds"] += time.perf_counter() - started

    busy_block([])  # warm-up: the arena's pages faulted, both paths warm
    lookups([])
    stored = {"jobs": 0, "bytes": 0, "seconds": 0.0}
    for index in range(blocks):
        bb: list[float] = []
        bi: list[float] = []
        if index % 2 == 0:
            busy_block(bb)
            lookups(bi)
        else:
            lookups(bi)
            busy_block(bb)
        busy += bb
        idle += bi
        block_p50.append((percentile(bb, 50), percentile(bi, 50)))
    value, base = percentile(busy, 50), percentile(idle, 50)
    params = {
        "keys": len(keys),
        "hits": LOOKUP_HITS,
        "fewest_hits": fewest_hits,
        "samples": len(busy),
        "block": block,
        "p99_us": percentile(busy, 99),
        "baseline_p99_us": percentile(idle, 99),
        "p99_ratio": ratio(percentile(busy, 99), percentile(idle, 99)),
        "paired_p50_ratio": paired_ratio([b for b, _ in block_p50], [i for _, i in block_p50]),
        "store_job_bytes": STORE_BLOCKS * STORE_PAGE,
        "stores_in_flight": STORE_DEPTH,
        "store_jobs": stored["jobs"],
        # Over the busy blocks, go to stop: the stores did run while the lookups were timed.
        "store_GBps": stored["bytes"] / stored["seconds"] / 1e9,
        "client": "OffloadClient (blocking), role scheduler",
        "load": "another engine's rank (subprocess, AsyncOffloadClient) storing back to back",
        "baseline": "the same lookups on the same daemon, no stores, blocks in turn",
        "ratio": "pooled p50 busy / pooled p50 idle",
        "goal": "ratio <= 2",
    }
    ctx.progress(
        f"  {name}: p50 {value:.0f} us vs idle {base:.0f} us ({ratio(value, base):.2f}), "
        f"p99 {params['p99_us']:.0f} vs {params['baseline_p99_us']:.0f} us, "
        f"stores {params['store_GBps']:.2f} GB/s"
    )
    return Result(name, value, "us", base, ratio(value, base), params)


# ------------------------------------------------------------------------- handshake

HANDSHAKE_RANKS = 8


def run_handshake(ctx: Context) -> list[Result]:
    """``handshake_8_ranks``: first Hello sent to every rank knowing the engine is ready."""
    if not ctx.wanted("handshake_8_ranks"):
        return []
    with _servers(ctx, "handshake") as servers, _kv_files(ctx, HANDSHAKE_RANKS) as files:
        regions = [kv.region for kv in files]
        return [uvloop.run(_handshake(ctx, servers.endpoint, servers.echo, regions))]


async def _handshake(ctx: Context, endpoint: str, echo: str, regions: list[KVRegion]) -> Result:
    reps = ctx.pick(21, 7, 2)
    ctx.progress(f"handshake of {HANDSHAKE_RANKS} ranks: {reps} reps, alternating with echo")
    hello = encode(
        Hello(
            request_id=1,
            protocol_version=PROTOCOL_VERSION,
            role="worker",
            config=small_config("bench-handshake-echo", 0, HANDSHAKE_RANKS),
            regions=(regions[0],),
            pid=os.getpid(),
            client_name="bench rank 0",
        )
    )

    async def daemon_once(rep: int) -> float:
        engine_id = f"bench-handshake-{rep}"
        clients: list[AsyncOffloadClient] = []

        async def one(rank: int) -> None:
            client = await AsyncOffloadClient.connect(
                endpoint,
                small_config(engine_id, rank, HANDSHAKE_RANKS),
                [regions[rank]],
                name=f"bench rank {rank}",
            )
            clients.append(client)
            await client.wait_ready(30)

        started = time.perf_counter()
        try:
            await asyncio.gather(*(one(rank) for rank in range(HANDSHAKE_RANKS)))
            return time.perf_counter() - started
        finally:
            for client in clients:
                await client.close()

    async def echo_once() -> float:
        contexts: list[zmq.asyncio.Context] = []
        sockets: list[zmq.asyncio.Socket] = []

        async def one() -> None:
            zctx = zmq.asyncio.Context()
            contexts.append(zctx)
            sock = zctx.socket(zmq.DEALER)
            sockets.append(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(echo)
            await sock.send(hello)
            await sock.recv()

        started = time.perf_counter()
        try:
            await asyncio.gather(*(one() for _ in range(HANDSHAKE_RANKS)))
            return time.perf_counter() - started
        finally:
            for sock in sockets:
                sock.close(linger=0)
            for zctx in contexts:
                zctx.term()

    await daemon_once(-1)
    await echo_once()
    d: list[float] = []
    e: list[float] = []
    for rep in range(reps):
        if rep % 2 == 0:
            d.append(await daemon_once(rep))
            e.append(await echo_once())
        else:
            e.append(await echo_once())
            d.append(await daemon_once(rep))
    value, base = median(d) * 1e3, median(e) * 1e3
    paired = paired_ratio(d, e)
    ctx.progress(f"  handshake_8_ranks: {value:.1f} ms vs echo {base:.1f} ms ({paired:.2f})")
    params = {
        "ranks": HANDSHAKE_RANKS,
        "reps": reps,
        "hello_bytes": len(hello),
        "client": "AsyncOffloadClient.connect + wait_ready, 8 concurrently, one loop",
        "baseline": "8 concurrent asyncio DEALERs (own context each): connect, send the "
        "Hello bytes, receive the echo",
        "ratio": "median of per-repetition ratios, back to back",
        "goal": "ratio <= 2",
    }
    return Result("handshake_8_ranks", value, "ms", base, paired, params)

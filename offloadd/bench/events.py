"""KV events: batches and events per second through ``EventPublisher`` -> ``Subscriber``.

The publisher runs in a subprocess (as in the daemon: uvloop, zmq.asyncio, PUB + replay
ROUTER on ipc://) and publishes a fixed batch of ``EVENTS_PER_BATCH`` ``BlockStored``
events, encoding it per batch as the daemon does. This process subscribes with the real
``Subscriber`` (decoding every batch, gap filling from replay) and checks that every seq
arrived exactly once, in order, with nothing lost.

Baseline: a bare PUB socket in the same kind of subprocess sending the same frames
``[topic, seq, payload]`` with a payload of the same bytes, and a bare SUB here that only
reads the seq (its seqs are checked the same way). Rounds alternate; the median is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import uvloop
import zmq
import zmq.asyncio

from offloadd.bench._servers import _event_batch
from offloadd.bench._util import Context, Result, ServerProcess, median, paired_ratio
from offloadd.subscriber import Subscriber
from protocol.events import encode_batch

EVENTS_PER_BATCH = 16
TOPIC = "kv@bench@bench/model"


class Tracker:
    """Seqs delivered by one subscriber, in arrival order, with arrival times."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.last_time = 0.0
        self.changed = asyncio.Event()

    def add(self, seq: int) -> None:
        self.seqs.append(seq)
        self.last_time = time.perf_counter()
        self.changed.set()

    async def until(self, seq: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.seqs or self.seqs[-1] < seq:
            self.changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                last = self.seqs[-1] if self.seqs else None
                raise TimeoutError(f"waited for seq {seq}, last delivered {last}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(remaining, 0.05))

    def check(self, start: int, stop: int, label: str) -> None:
        """Every seq in ``[start, stop)`` delivered once and in order."""
        got = [s for s in self.seqs if start <= s < stop]
        if got != list(range(start, stop)):
            missing = sorted(set(range(start, stop)) - set(got))
            raise RuntimeError(
                f"{label}: {len(got)} of {stop - start} seqs delivered in order; "
                f"{len(missing)} missing (first {missing[:5]})"
            )


class Side:
    """One publisher subprocess and the tracker of its subscriber here."""

    def __init__(self, server: ServerProcess, tracker: Tracker) -> None:
        self.server = server
        self.tracker = tracker
        self.sent = 0

    async def command(self, line: str) -> str:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.server.command, line)

    async def subscribe(self) -> None:
        """Probe until one probe arrives: PUB drops what it sends before that."""
        for _ in range(100):
            await self.command("probe")
            self.sent += 1
            with contextlib.suppress(TimeoutError):
                await self.tracker.until(self.sent - 1, 0.1)
                return
        raise TimeoutError(f"{self.server.mode}: the subscription never went live")

    async def round(self, batches: int) -> float:
        """Batches per second of one burst of ``batches``, checked for loss."""
        start = self.sent
        self.sent += batches
        started = time.perf_counter()
        await self.command(f"go {batches}")
        await self.tracker.until(self.sent - 1, 120)
        seconds = self.tracker.last_time - started
        self.tracker.check(start, self.sent, self.server.mode)
        return batches / seconds


async def _consume(subscriber: Subscriber, tracker: Tracker) -> None:
    async for received in subscriber:
        tracker.add(received.seq)


async def _consume_raw(sock: zmq.asyncio.Socket, tracker: Tracker) -> None:
    while True:
        frames = await sock.recv_multipart()
        tracker.add(int.from_bytes(frames[1], "big"))


def run(ctx: Context) -> list[Result]:
    """``events_per_s``."""
    if not ctx.wanted("events_per_s"):
        return []
    return [uvloop.run(_run(ctx))]


async def _run(ctx: Context) -> Result:
    rounds = ctx.pick(9, 5, 2)
    batches = ctx.pick(50_000, 20_000, 2_000)  # below the HWMs and queue bound (100k)
    endpoint = ctx.scratch.endpoint("events")
    replay = ctx.scratch.endpoint("replay")
    raw_endpoint = ctx.scratch.endpoint("rawpub")
    payload = encode_batch(_event_batch(EVENTS_PER_BATCH))
    args = {"events": EVENTS_PER_BATCH, "topic": TOPIC}
    ctx.progress(
        f"events: {rounds} rounds of {batches:,} batches x {EVENTS_PER_BATCH} events "
        f"({len(payload)} B), publisher and raw PUB alternating"
    )
    tasks: list[asyncio.Task[None]] = []
    zctx = zmq.asyncio.Context()
    raw_sub = zctx.socket(zmq.SUB)
    raw_sub.setsockopt(zmq.LINGER, 0)
    raw_sub.setsockopt(zmq.RCVHWM, 100_000)
    raw_sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with (
            ServerProcess(
                "publisher",
                args | {"endpoint": endpoint, "replay_endpoint": replay},
                profile=ctx.profile_path("publisher"),
            ) as publisher,
            ServerProcess("rawpub", args | {"endpoint": raw_endpoint}) as rawpub,
        ):
            async with Subscriber(endpoint, replay, ctx=zctx) as subscriber:
                daemon = Side(publisher, Tracker())
                raw = Side(rawpub, Tracker())
                tasks.append(asyncio.create_task(_consume(subscriber, daemon.tracker)))
                raw_sub.connect(raw_endpoint)
                tasks.append(asyncio.create_task(_consume_raw(raw_sub, raw.tracker)))
                await daemon.subscribe()
                await raw.subscribe()
                await daemon.round(min(batches, 2000))  # warm-up
                await raw.round(min(batches, 2000))
                d: list[float] = []
                r: list[float] = []
                for index in range(rounds):
                    order: list[tuple[Callable[[int], Awaitable[float]], list[float]]] = [
                        (daemon.round, d),
                        (raw.round, r),
                    ]
                    if index % 2:
                        order.reverse()
                    for measure, out in order:
                        out.append(await measure(batches))
                stats = (await daemon.command("stats")).split()
                lost = subscriber.lost
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for task in tasks:
            task.cancel()
        raw_sub.close(linger=0)
        zctx.term()
    dropped = int(stats[2])
    if lost or dropped:
        raise RuntimeError(f"events lost: subscriber lost {lost}, publisher dropped {dropped}")
    value = median(d) * EVENTS_PER_BATCH
    base = median(r) * EVENTS_PER_BATCH
    paired = paired_ratio(d, r)
    ctx.progress(
        f"  events_per_s: {value:,.0f}/s ({median(d):,.0f} batches/s) vs raw {base:,.0f}/s"
    )
    params = {
        "events_per_batch": EVENTS_PER_BATCH,
        "batches_per_s": median(d),
        "baseline_batches_per_s": median(r),
        "payload_bytes": len(payload),
        "batches_per_round": batches,
        "rounds": rounds,
        "lost": lost,
        "checked": "every seq delivered once, in order",
        "baseline": "bare PUB subprocess -> bare SUB, same frames and payload size",
        "ratio": "median of per-round ratios, rounds back to back",
    }
    return Result("events_per_s", value, "1/s", base, paired, params)

"""Subprocesses of the benchmarks: ``python -m offloadd.bench._servers MODE ARGS_JSON``.

Every mode runs on uvloop with zmq.asyncio, as ``offloadd serve`` does, prints ``ready`` on
stdout once it serves, answers line commands from stdin with one line each, and stops on
SIGTERM or when stdin closes.

- ``daemon``: the real ``Daemon`` with ``Settings`` decoded from ``args["settings"]``.
- ``echo``: a bare ROUTER that sends every message straight back (the round-trip floor).
- ``publisher``: an ``EventPublisher`` publishing a fixed KV-event batch (``probe``, ``go N``).
- ``rawpub``: a bare PUB socket sending same-size payloads with the same frames.
- ``storer``: a rank (``AsyncOffloadClient``) that, between ``go`` and ``stop``, keeps
  ``depth`` stores of ``blocks`` blocks each in flight, back to back, fresh keys every job;
  ``stop`` waits for those in flight and answers ``jobs bytes`` stored since ``go``.
- ``flooder``: ``sockets`` DEALERs with no registration and no session that, between ``go``
  and ``stop``, send step messages of ``lookups`` empty Lookups as fast as the daemon reads
  them, their answers unread; ``stop`` answers how many were sent since ``go``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import uvloop
import zmq
import zmq.asyncio

Handler = Callable[[list[str]], Awaitable[str]]


async def _serve_commands(handler: Handler | None, extra: list[asyncio.Task[Any]]) -> None:
    """Print ready, answer stdin commands, return on SIGTERM/SIGINT or end of stdin."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print("ready", flush=True)

    lines: asyncio.Queue[str] = asyncio.Queue()

    def read_stdin() -> None:  # a daemon thread, so that exit never waits for a read
        try:
            for line in sys.stdin:
                loop.call_soon_threadsafe(lines.put_nowait, line)
            loop.call_soon_threadsafe(lines.put_nowait, "")
        except RuntimeError:  # the loop is closed: the process is exiting
            return

    threading.Thread(target=read_stdin, name="stdin", daemon=True).start()

    async def commands() -> None:
        while True:
            line = await lines.get()
            if not line:
                stop.set()
                return
            words = line.split()
            reply = await handler(words) if handler is not None and words else "?"
            print(reply, flush=True)

    reader = asyncio.create_task(commands())
    try:
        await stop.wait()
    finally:
        reader.cancel()
        for task in extra:
            task.cancel()
        await asyncio.gather(reader, *extra, return_exceptions=True)


async def _daemon(args: dict[str, Any]) -> None:
    from offloadd.server.daemon import Daemon
    from offloadd.server.process import freeze_startup_heap
    from offloadd.settings import Settings

    settings = msgspec.json.decode(json.dumps(args["settings"]).encode(), type=Settings)
    stop = asyncio.Event()
    async with Daemon(settings) as daemon:
        freeze_startup_heap()  # as ``offloadd serve`` does
        serving = asyncio.create_task(daemon.serve(stop))
        try:
            await _serve_commands(None, [])
        finally:
            stop.set()
            await serving


async def _echo(args: dict[str, Any]) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(args["endpoint"])

    async def echo() -> None:
        # The daemon's receive loop without decoding, handling or encoding.
        while True:
            frames = await sock.recv_multipart()
            sock.send_multipart(frames, flags=zmq.DONTWAIT)

    try:
        await _serve_commands(None, [asyncio.create_task(echo())])
    finally:
        sock.close(linger=0)
        ctx.term()


def _event_batch(events: int) -> Any:
    import hashlib
    import time

    from offloadd.server.attribution import stored_events
    from protocol.events import KVEventBatch

    keys = [hashlib.sha256(i.to_bytes(4, "big")).digest() + bytes(4) for i in range(events)]
    return KVEventBatch(time.time(), stored_events(keys, raw_hashes=False), 0)


async def _publisher(args: dict[str, Any]) -> None:
    from offloadd.server.publisher import EventPublisher

    ctx = zmq.asyncio.Context()
    batch = _event_batch(args["events"])
    topic = args["topic"]
    publisher = EventPublisher(args["endpoint"], args["replay_endpoint"], ctx=ctx)
    async with publisher:

        async def handle(words: list[str]) -> str:
            match words:
                case ["probe"]:
                    publisher.publish(topic, batch)
                case ["go", count]:
                    for _ in range(int(count)):
                        publisher.publish(topic, batch)
                case ["stats"]:
                    while publisher.queued:
                        await asyncio.sleep(0.01)
            return f"{publisher.next_seq} {publisher.published} {publisher.dropped}"

        await _serve_commands(handle, [])
    ctx.term()


async def _rawpub(args: dict[str, Any]) -> None:
    from protocol.events import encode_batch

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 100_000)  # the publisher's default
    pub.bind(args["endpoint"])
    payload = encode_batch(_event_batch(args["events"]))
    topic = args["topic"].encode()
    state = {"seq": 0, "sent": 0, "dropped": 0}

    def send(count: int) -> None:
        for _ in range(count):
            seq = state["seq"]
            state["seq"] = seq + 1
            try:
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=zmq.DONTWAIT)
                state["sent"] += 1
            except zmq.Again:
                state["dropped"] += 1

    async def handle(words: list[str]) -> str:
        match words:
            case ["probe"]:
                send(1)
            case ["go", count]:
                send(int(count))
        return f"{state['seq']} {state['sent']} {state['dropped']}"

    try:
        await _serve_commands(handle, [])
    finally:
        pub.close(linger=0)
        ctx.term()


async def _storer(args: dict[str, Any]) -> None:
    from offloadd.bench._util import chain_keys, one_group_config
    from offloadd.client import AsyncOffloadClient
    from protocol.handles import KVRegion

    region = msgspec.convert(args["region"], KVRegion)
    page, blocks, depth = args["page"], args["blocks"], args["depth"]
    config = one_group_config(
        args["engine_id"], model=args["model"], layers=args["layers"], bytes_per_block=page
    )
    client = await AsyncOffloadClient.connect(
        args["endpoint"], config, [region], name="bench storer"
    )
    await client.wait_ready(30)
    state = {"job": 0, "jobs": 0}
    running: list[asyncio.Task[None]] = []
    stopping = asyncio.Event()

    async def lane(lane_index: int, accepted: asyncio.Future[None]) -> None:
        block_ids = list(range(lane_index * blocks, (lane_index + 1) * blocks))
        try:
            while not stopping.is_set():
                state["job"] += 1
                job = state["job"]
                await client.store(job, chain_keys(blocks, job.to_bytes(8, "big")), block_ids)
                if not accepted.done():
                    accepted.set_result(None)
                await client.wait([job])
                state["jobs"] += 1
        except Exception as exc:
            if not accepted.done():
                accepted.set_exception(exc)
            raise

    async def handle(words: list[str]) -> str:
        match words:
            case ["go"]:
                stopping.clear()
                state["jobs"] = 0
                accepted = [asyncio.get_running_loop().create_future() for _ in range(depth)]
                running[:] = [asyncio.create_task(lane(i, a)) for i, a in enumerate(accepted)]
                try:
                    await asyncio.gather(*accepted)  # every lane has a store in flight
                except Exception as exc:
                    return f"failed {exc!r}"
                return "ok"
            case ["stop"]:
                stopping.set()
                outcomes = await asyncio.gather(*running, return_exceptions=True)
                running.clear()
                failed = [o for o in outcomes if isinstance(o, BaseException)]
                if failed:
                    return f"failed {failed[0]!r}"
                return f"{state['jobs']} {state['jobs'] * blocks * page}"
        return "?"

    try:
        await _serve_commands(handle, [])
    finally:
        stopping.set()
        await asyncio.gather(*running, return_exceptions=True)
        await client.close()


async def _flooder(args: dict[str, Any]) -> None:
    from protocol.messages import Lookup, Reserve, encode

    ctx = zmq.asyncio.Context()
    socks = []
    for _ in range(args["sockets"]):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # a send waits for the daemon to read
        sock.setsockopt(zmq.RCVHWM, 1)  # answers unread: the daemon drops them
        sock.connect(args["endpoint"])
        socks.append(sock)
    frame = encode(Reserve(1, [], lookups=[Lookup(2 + i, []) for i in range(args["lookups"])]))
    state = {"sent": 0}
    running: list[asyncio.Task[None]] = []

    async def flood(sock: zmq.asyncio.Socket) -> None:
        while True:
            await sock.send(frame)
            state["sent"] += 1

    async def handle(words: list[str]) -> str:
        match words:
            case ["go"]:
                state["sent"] = 0
                running[:] = [asyncio.create_task(flood(sock)) for sock in socks]
                return "ok"
            case ["stop"]:
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                running.clear()
                return str(state["sent"])
        return "?"

    try:
        await _serve_commands(handle, [])
    finally:
        for task in running:
            task.cancel()
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


_MODES: dict[str, Callable[[dict[str, Any]], Awaitable[None]]] = {
    "daemon": _daemon,
    "echo": _echo,
    "publisher": _publisher,
    "rawpub": _rawpub,
    "storer": _storer,
    "flooder": _flooder,
}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    uvloop.run(_MODES[mode](args))


if __name__ == "__main__":
    main()

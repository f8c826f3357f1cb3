"""Subprocesses of the benchmarks: ``python -m offloadd.bench._servers MODE ARGS_JSON``.

Every mode runs on uvloop with zmq.asyncio, as ``offloadd serve`` does, prints ``ready`` on
stdout once it serves, answers line commands from stdin with one line each, and stops on
SIGTERM or when stdin closes.

- ``daemon``: the real ``Daemon`` with ``Settings`` decoded from ``args["settings"]``.
- ``echo``: a bare ROUTER that sends every message straight back (the round-trip floor).
- ``publisher``: an ``EventPublisher`` publishing a fixed KV-event batch (``probe``, ``go N``).
- ``rawpub``: a bare PUB socket sending same-size payloads with the same frames.
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
    from offloadd.settings import Settings

    settings = msgspec.json.decode(json.dumps(args["settings"]).encode(), type=Settings)
    stop = asyncio.Event()
    async with Daemon(settings) as daemon:
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


_MODES: dict[str, Callable[[dict[str, Any]], Awaitable[None]]] = {
    "daemon": _daemon,
    "echo": _echo,
    "publisher": _publisher,
    "rawpub": _rawpub,
}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    uvloop.run(_MODES[mode](args))


if __name__ == "__main__":
    main()

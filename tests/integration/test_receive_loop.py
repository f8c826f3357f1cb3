"""The daemon's receive loop: a request is never left unread behind a reply sent elsewhere,
and control requests go before the bulk work queued ahead of them."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid

import pytest
import zmq
import zmq.asyncio

from offloadd.client import OffloadClient
from offloadd.server.control import ControlSocket
from offloadd.server.gate import RequestGate
from offloadd.server.metrics import Counters, Metrics
from offloadd.settings import Settings
from protocol.messages import Lookup, Ok, Request, Store, encode
from tests.integration.harness import DaemonThread, make_config


def test_a_request_that_arrives_while_another_reply_is_sent_is_answered(
    daemon: DaemonThread,
) -> None:
    # zmq's file descriptor says "look again" once per change, and a send reads the change:
    # a reply sent from a copy completion (or any other callback) while a request arrives
    # must not leave that request unread until some later message wakes the loop.
    # Two engines: a second scheduler of one engine from this process would replace the first.
    config_a, config_b = make_config(tp=1, engine_id="a"), make_config(tp=1, engine_id="b")
    with (
        OffloadClient.connect(daemon.endpoint, config_a, role="scheduler", heartbeat=0) as a,
        OffloadClient.connect(daemon.endpoint, config_b, role="scheduler", heartbeat=0) as b,
    ):
        running = daemon.daemon
        assert running is not None and daemon._loop is not None
        control = running._control
        a_identity = a._core.identity
        held = threading.Event()

        def hold_the_loop() -> None:
            # Runs on the daemon's loop: wait until b's request is in the socket, reading its
            # events as a send would, then send a reply to a.
            held.set()
            sock = control._sock
            assert sock is not None
            deadline = time.monotonic() + 10
            while not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                assert time.monotonic() < deadline, "the request never arrived"
                time.sleep(0.01)
            control.send(a_identity, Ok(0))

        answered: list[int] = []
        asker = threading.Thread(target=lambda: answered.append(b.stats().sessions))
        daemon._loop.call_soon_threadsafe(hold_the_loop)
        assert held.wait(10)
        asker.start()
        asker.join(20)
        assert answered == [2]


@pytest.mark.asyncio
async def test_a_lookup_goes_before_the_stores_and_copy_ends_queued_ahead_of_it() -> None:
    # Counted in order, not timed: the Lookup another peer sends while a Store is handled is
    # dispatched before the Stores and copy ends queued ahead of it; a peer's own Lookup stays
    # behind its own Stores.
    seen: list[str] = []
    ctx = zmq.asyncio.Context()
    scheduler = ctx.socket(zmq.DEALER)

    def dispatch(identity: bytes, request: Request) -> None:
        seen.append(f"{identity.decode()} {type(request).__name__} {request.request_id}")
        if len(seen) == 1:  # the first Store, while the rest wait in the lanes
            for _ in range(2):
                control.run_bulk(lambda: seen.append("copy end"))
            scheduler.send(encode(Lookup(7, [b"k" * 32])), flags=zmq.DONTWAIT)

    control = ControlSocket(
        Settings(),
        f"inproc://lanes-{uuid.uuid4().hex}",
        RequestGate(),
        dispatch=dispatch,
        metrics=Metrics(),
        counters=Counters(),
    )
    worker = ctx.socket(zmq.DEALER)
    receiver: asyncio.Task[None] | None = None
    try:
        control.bind(ctx)
        for sock, name in ((worker, b"worker"), (scheduler, b"sched")):
            sock.setsockopt(zmq.IDENTITY, name)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(control.endpoint)
        for job in range(1, 5):
            store = Store(job, job, [bytes([job]) * 32], [job])
            worker.send(encode(store), flags=zmq.DONTWAIT)
        worker.send(encode(Lookup(100, [b"k" * 32])), flags=zmq.DONTWAIT)  # inproc: queued
        receiver = asyncio.create_task(control.receive_loop())
        deadline = time.monotonic() + 10
        while len(seen) < 8:
            assert time.monotonic() < deadline, f"only {seen}"
            await asyncio.sleep(0.001)
    finally:
        if receiver is not None:
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiver
        control.close()
        worker.close(linger=0)
        scheduler.close(linger=0)
        ctx.term()
    assert seen == [
        "worker Store 1",
        "sched Lookup 7",
        "worker Store 2",
        "worker Store 3",
        "worker Store 4",
        "worker Lookup 100",
        "copy end",
        "copy end",
    ]

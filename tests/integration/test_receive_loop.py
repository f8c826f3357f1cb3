"""The daemon's receive loop: a request is never left unread behind a reply sent elsewhere."""

from __future__ import annotations

import threading
import time

import zmq

from offloadd.client import OffloadClient
from protocol.messages import Ok
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

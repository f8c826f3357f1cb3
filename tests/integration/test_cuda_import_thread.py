"""A cuda daemon imports CUDA IPC handles off its event loop, in order per peer.

No GPU here: the daemon runs with ``server.copy_engine = "cuda"``, an injected copy engine,
and a stand-in for ``CudaIpcOpener`` whose imports block until the test lets them go. While
one rank's Hello is importing, another peer is answered at once, and the importing peer's
later requests wait: they are answered after its Welcome, in the order they were sent.
Closing the imports at the end of the session runs on the import thread too.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import msgspec
import pytest
import zmq

from offloadd.transfer import cuda_import
from protocol import PROTOCOL_VERSION
from protocol.handles import CudaIpcHandle, KVRegion
from protocol.messages import (
    Bye,
    EngineReady,
    GetStats,
    Hello,
    Lookup,
    LookupResult,
    Ok,
    Reply,
    StatsResult,
    Welcome,
    decode_reply,
    encode,
)
from tests.fakes import FakeCopyEngine
from tests.integration.harness import LAYERS, DaemonThread, chain_keys, make_config, with_token

BLOCKS = 64
PAGE = 4096


class SlowOpener:
    """Stands in for ``CudaIpcOpener``: each import blocks until ``release`` is set."""

    instances: ClassVar[list[SlowOpener]] = []

    def __init__(self, devices: object = None) -> None:
        self.release = threading.Event()
        self.opened_on: list[str] = []
        self.closed_on: list[str] = []
        SlowOpener.instances.append(self)

    def device_index(self, handle: CudaIpcHandle) -> int:
        return 0

    def open(self, handle: CudaIpcHandle) -> tuple[int, int, Callable[[], None]]:
        self.opened_on.append(threading.current_thread().name)
        assert self.release.wait(30), "the test never let the import finish"
        return 0x7F00_0000_0000, handle.storage_size, self._closed

    def _closed(self) -> None:
        self.closed_on.append(threading.current_thread().name)

    def duplicate(self, handle: CudaIpcHandle) -> None:
        return None


@pytest.fixture
def cuda_daemon(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[DaemonThread, SlowOpener]]:
    SlowOpener.instances.clear()
    monkeypatch.setattr(cuda_import, "CudaIpcOpener", SlowOpener)
    daemon = DaemonThread(copy_engine=FakeCopyEngine(name="refusing-cpu", held=()))
    server = msgspec.structs.replace(daemon.settings.server, copy_engine="cuda")
    daemon.settings = msgspec.structs.replace(daemon.settings, server=server)
    daemon.start()
    (opener,) = SlowOpener.instances
    yield daemon, opener
    opener.release.set()
    daemon.stop()


class Peer:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.identity = uuid.uuid4().bytes
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, self.identity)
        self.sock.connect(endpoint)

    def send(self, message: Any) -> None:
        if isinstance(message, Hello):  # registered first, as offloadd.client does
            message = with_token(self.endpoint, self.identity, message)
        self.sock.send(encode(message))

    def recv(self, timeout: float = 10.0) -> Reply:
        assert self.sock.poll(int(timeout * 1000)), "no reply"
        return decode_reply(self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def cuda_hello() -> Hello:
    regions = tuple(
        KVRegion(
            CudaIpcHandle(
                "GPU-00000000-0000-0000-0000-000000000000",
                b"\x02c" + bytes([index]) * 64,
                BLOCKS * PAGE,
                0,
                b"/torch_1_1",
                index,
                b"",
                False,
                0,
                BLOCKS * PAGE,
            ),
            num_blocks=BLOCKS,
            page_size=PAGE,
            block_stride=PAGE,
            layer_names=(layer,),
        )
        for index, layer in enumerate(LAYERS)
    )
    config = make_config(tp=1, bytes_per_block=PAGE * len(LAYERS))
    return Hello(1, PROTOCOL_VERSION, "worker", config, regions)


def test_imports_run_off_the_loop_and_hold_only_that_peers_requests(
    cuda_daemon: tuple[DaemonThread, SlowOpener],
) -> None:
    daemon, opener = cuda_daemon
    rank, other = Peer(daemon.endpoint), Peer(daemon.endpoint)
    try:
        rank.send(cuda_hello())
        rank.send(Lookup(2, chain_keys(1)))
        rank.send(GetStats(3))
        deadline = time.monotonic() + 10
        while not opener.opened_on and time.monotonic() < deadline:
            time.sleep(0.001)
        assert opener.opened_on, "the import never started"

        # The import is blocked: the loop still answers everyone else...
        other.send(GetStats(7))
        answer = other.recv()
        assert isinstance(answer, StatsResult) and answer.request_id == 7
        assert answer.stats.sessions == 0
        # ...and nothing of the importing peer's has been handled yet.
        assert not rank.sock.poll(0)

        opener.release.set()
        replies = [rank.recv() for _ in range(4)]
        assert isinstance(replies.pop(1), EngineReady)  # unasked, right after the Welcome
        assert [type(r) for r in replies] == [Welcome, LookupResult, StatsResult]
        assert [r.request_id for r in replies] == [1, 2, 3]  # type: ignore[union-attr]
        assert len(opener.opened_on) == len(LAYERS)
        assert all(name.startswith("offloadd-ipc") for name in opener.opened_on)

        rank.send(Bye(4))
        ok = rank.recv()
        assert isinstance(ok, Ok) and ok.request_id == 4
        while len(opener.closed_on) < len(LAYERS) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(opener.closed_on) == len(LAYERS)
        assert all(name.startswith("offloadd-ipc") for name in opener.closed_on)
    finally:
        rank.close()
        other.close()


def test_a_refused_import_answers_the_hello_then_the_held_requests(
    cuda_daemon: tuple[DaemonThread, SlowOpener],
) -> None:
    daemon, opener = cuda_daemon
    opener.release.set()
    hello = cuda_hello()
    bad = msgspec.structs.replace(
        hello, regions=(msgspec.structs.replace(hello.regions[0], num_blocks=BLOCKS * 2),)
    )
    rank = Peer(daemon.endpoint)
    try:
        rank.send(bad)
        rank.send(GetStats(2))
        error = rank.recv()
        assert error.request_id == 1 and type(error).__name__ == "Error"  # type: ignore[union-attr]
        stats = rank.recv()
        assert isinstance(stats, StatsResult) and stats.stats.imports == 0
    finally:
        rank.close()

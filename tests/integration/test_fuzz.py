"""Fuzzed frames at the daemon's sockets: nothing crashes, stalls or goes unanswered.

The control socket is a ROUTER. Every message a DEALER sends there, one frame or several, is
one request and gets exactly one reply: its result, or an ``Error`` that ``protocol_errors``
counts (a multi-frame message is one request and gets one MALFORMED). ``JobDone`` and
``EngineReady`` come unasked and are counted apart. No input may draw an INTERNAL error
(that code means a bug escaped a handler). The events replay socket answers a well-formed
request with the buffered batches and an end marker, and ignores (counts) anything else.

The bulk test pipelines 100,000 control frames from several DEALERs (unregistered peers and
registered ranks) and 20,000 replay frames while a valid two-rank engine stores, loads and
checks its bytes from another thread; the hypothesis test drives the same sockets with
generated frames. The focused tests below pin down the inputs that used to reach INTERNAL.
"""

from __future__ import annotations

import glob
import math
import multiprocessing
import os
import random
import shutil
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offloadd.peer import register
from offloadd.server.control import FRAME_SLACK
from offloadd.shm import SharedKVTensor
from protocol import PROTOCOL_VERSION
from protocol.config import OffloadingConfig, OffloadingGroupConfig
from protocol.errors import ErrorCode
from protocol.events import END_SEQ, decode_batch
from protocol.handles import CudaIpcHandle, KVRegion, ShmHandle
from protocol.messages import (
    Bye,
    Clear,
    DaemonStats,
    EngineReady,
    Error,
    GetStats,
    Hello,
    JobAccepted,
    JobDone,
    Load,
    Lookup,
    Ok,
    Ping,
    Release,
    Reply,
    Request,
    StatsResult,
    Store,
    Wait,
    WaitResult,
    Welcome,
    decode_reply,
    encode,
)
from tests.fakes import FakeCopyEngine
from tests.integration.harness import (
    LAYERS,
    DaemonThread,
    Rank,
    ServeProcess,
    chain_keys,
    chunk_block_ids,
    make_config,
    make_rank,
)

BULK_CONTROL_FRAMES = 100_000
BULK_REPLAY_FRAMES = 20_000
UNREGISTERED_SENDERS = 3
REGISTERED_SENDERS = 2
WINDOW = 48  # requests in flight per DEALER
REPLAY_WINDOW = 16  # well-formed replay requests in flight per DEALER
DEADLINE = 90.0  # the whole bulk run, set-up and checks included
STALL = 15.0  # no reply for this long while requests are outstanding: the daemon is stuck
SLOWEST_VALID_CYCLE = 5.0  # seconds; a starved event loop shows here (13s seen)
FUZZ_BLOCKS = 16  # blocks per region of a registered fuzz rank
PAGE = 4096

_OWN_PID_NS = os.stat("/proc/self/ns/pid").st_ino
_TAGS = (
    "hello", "lookup", "store", "load", "release", "wait", "stats", "clear", "ping", "bye",
    "welcome", "error", "done", "nonsense", "", "HELLO",
)  # fmt: skip
_REQUEST_TYPES: tuple[type[msgspec.Struct], ...] = (
    Hello, Lookup, Store, Load, Release, Wait, GetStats, Clear, Ping, Bye,
)  # fmt: skip
_FIELDS = sorted(
    {f.name for cls in _REQUEST_TYPES for f in msgspec.structs.fields(cls)} | {"config", "regions"}
)
_EXTREME_INTS = (0, -1, 1, 7, 2**31 - 1, 2**31, 2**32 + 5, 2**63 - 1, -(2**63), 2**64 - 1)
_EXTREME_FLOATS = (math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 0.0, -1.0, 1e-9)
_WRONG_VALUES: tuple[Any, ...] = (
    None, True, False, "text", "", b"\x00\xff", 1.5, -7, 2**64 - 1, -(2**63), [], {},
    [[1, [2, [3]]]], {"k": [None, b""]}, ["a", 1, None], math.nan,
)  # fmt: skip
_HUGE_HEADERS = (
    b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 billion items
    b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 billion pairs
    b"\xdb\xff\xff\xff\xff" + b"x" * 8,  # str32 claiming 4 GiB
    b"\xc6\xff\xff\xff\xff" + b"x" * 8,  # bin32 claiming 4 GiB
    b"\xc9\xff\xff\xff\xff\x01",  # ext32
    b"\xde\xff\xff" + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("lookup"),
)


# ---------------------------------------------------------------- frames


def _nested_list(depth: int, leaf: bytes = b"\xc0") -> bytes:
    return b"\x91" * depth + leaf


def _tagged_with_deep_field(tag: str, name: str, depth: int) -> bytes:
    # {"type": tag, "request_id": 9, name: [[[...]]]} built by hand: no encoder would nest so far.
    head = msgspec.msgpack.encode({"type": tag, "request_id": 9})
    assert head[0] == 0x82
    return b"\x83" + head[1:] + msgspec.msgpack.encode(name) + _nested_list(depth)


_DEEP_MARKER = "deep-value-goes-here"


def _with_deep_salt(hello: Hello, depth: int) -> bytes:
    """``hello`` encoded with ``extra_config["namespace"]`` nested ``depth`` lists deep.

    Spliced in by hand: encoding such a value takes as much stack as decoding it.
    """
    config = msgspec.structs.replace(hello.config, extra_config={"namespace": _DEEP_MARKER})
    frame = encode(msgspec.structs.replace(hello, config=config))
    marker = msgspec.msgpack.encode(_DEEP_MARKER)
    assert frame.count(marker) == 1
    return frame.replace(marker, _nested_list(depth, b"\x01"))


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame or b"\x00")
    for _ in range(rng.randint(1, 4)):
        operation = rng.random()
        position = rng.randrange(len(data))
        if operation < 0.6:
            data[position] = rng.randrange(256)
        elif operation < 0.8:
            data[position : position + 1] = b""
            if not data:
                data.append(rng.randrange(256))
        else:
            data.insert(position, rng.randrange(256))
    return bytes(data)


@dataclass
class FuzzRankSetup:
    """What a registered fuzz rank's requests may name: its keys and its config."""

    engine_id: str
    config: OffloadingConfig
    regions: tuple[KVRegion, ...]
    keys: list[bytes]
    empty_group: bool  # its config has a second group that no region holds


class Frames:
    """Random control messages of every hostile kind (``next(rng) -> (kind, frames)``)."""

    def __init__(
        self,
        region: KVRegion,
        *,
        max_frame_bytes: int,
        rank: FuzzRankSetup | None = None,
        valid_engine_id: str = "engine-a",
        seal: Callable[[Hello], Hello] | None = None,
    ) -> None:
        self.region = region  # a real shm file: Hellos naming it get as far as geometry
        self.rank = rank
        # Registers a Hello about to be sent as it is (its files' descriptors and a token).
        self.seal = seal
        self.max_frame_bytes = max_frame_bytes
        self.valid_engine_id = valid_engine_id
        self.keys = rank.keys if rank is not None else chain_keys(8, salt=b"fuzz-unregistered")
        kinds: list[tuple[str, float, Callable[[random.Random], list[bytes]]]] = [
            ("random_bytes", 10, self.random_bytes),
            ("truncated", 10, self.truncated),
            ("mutated", 18, self.mutated),
            ("wrong_types", 10, self.wrong_types),
            ("extreme_numbers", 10, self.extreme_numbers),
            ("deep_nesting", 3, self.deep_nesting),
            ("huge_header", 2, self.huge_header),
            ("multi_frame", 6, self.multi_frame),
            ("empty_frame", 3, self.empty_frame),
            ("absurd_hello", 6, self.absurd_hello),
        ]
        if rank is None:
            kinds.append(("before_hello", 12, lambda r: [encode(self.before_hello(r))]))
        else:
            kinds.append(("rank_request", 22, lambda r: [encode(self.rank_request(r))]))
        self._names = [k[0] for k in kinds]
        self._weights = [k[1] for k in kinds]
        self._makers = [k[2] for k in kinds]

    def next(self, rng: random.Random) -> tuple[str, list[bytes]]:
        index = rng.choices(range(len(self._names)), self._weights)[0]
        return self._names[index], self._makers[index](rng)

    # -- valid-looking requests -----------------------------------------------------------

    def template(self, rng: random.Random) -> bytes:
        """A well-formed request this socket might send (before mutation or truncation)."""
        if rng.random() < 0.2:
            return encode(self.hello(rng, sealed=False))
        if self.rank is None:
            return encode(self.before_hello(rng))
        return encode(self.rank_request(rng))

    def before_hello(self, rng: random.Random) -> Request:
        rid = rng.randrange(1, 1 << 32)
        keys = rng.sample(self.keys, rng.randint(1, 4))
        ids = chunk_block_ids(range(len(keys)), 2)
        makers: list[Callable[[], Request]] = [
            lambda: Lookup(rid, keys, pin=rng.random() < 0.5),
            lambda: Store(rid, rng.randrange(100), keys, ids),
            lambda: Load(rid, rng.randrange(100), keys, ids),
            lambda: Release(rid, keys),
            lambda: Wait(rid, [rng.randrange(100)], 0.1),
            lambda: Clear(rid),
            lambda: Bye(rid),
            lambda: GetStats(rid),
            lambda: Ping(rid, rng.choice(["", "00ff", "not-a-session"])),
        ]
        return rng.choice(makers)()

    def rank_request(self, rng: random.Random) -> Request:
        """A registered rank's request: mostly refused (ids out of range and the like)."""
        assert self.rank is not None
        rid = rng.randrange(1, 1 << 32)
        job = rng.randrange(1, 64)  # small: duplicates of in-flight ids happen
        count = rng.randint(1, 3)
        start = rng.randrange(len(self.keys) - count)
        keys = self.keys[start : start + count]
        good = chunk_block_ids(range(count), 2, base=rng.choice([0, 8]) if count <= 4 else 0)
        bad_id = rng.choice([FUZZ_BLOCKS, FUZZ_BLOCKS + 1, 10_000, -1, 2**63 - 1, -(2**63)])
        bad = [*good[:-1], bad_id]
        other_group = [k[:-4] + rng.choice([1, 2, 2**32 - 1]).to_bytes(4, "big") for k in keys]
        makers: list[tuple[float, Callable[[], Request]]] = [
            (6, lambda: Store(rid, job, keys, bad)),  # a block id out of range
            (6, lambda: Load(rid, job, keys, bad)),
            (3, lambda: Store(rid, job, keys, good[:-1])),  # one id short
            (3, lambda: Load(rid, job, keys, good[1:], skip=rng.choice([-1, 2, 2**63 - 1]))),
            (3, lambda: Store(rid, job, other_group, good)),  # a group the engine lacks
            (2, lambda: Store(rid, job, [k[: rng.randrange(5)] for k in keys], good)),
            (2, lambda: Store(rid, job, keys, good)),  # valid: accepted, then JobDone
            (2, lambda: Load(rid, job, keys, good)),  # valid (missing keys fail the job)
            (2, lambda: Wait(rid, [job], rng.choice(_EXTREME_FLOATS))),
            (2, lambda: Wait(rid, [rng.randrange(64, 1 << 40)], 1.0)),  # unknown job
            (3, lambda: Lookup(rid, keys, pin=True, lease_seconds=rng.choice(_EXTREME_FLOATS))),
            (2, lambda: Release(rid, keys)),
            (1, lambda: Clear(rid)),
            (1, lambda: GetStats(rid)),
            (1, lambda: Ping(rid)),
        ]
        if self.rank.empty_group:
            group_one = [k[:-4] + (1).to_bytes(4, "big") for k in keys]
            makers.append((2, lambda: Store(rid, job, group_one, good)))
        weights = [m[0] for m in makers]
        return rng.choices([m[1] for m in makers], weights)[0]()

    def hello(self, rng: random.Random, *, sealed: bool = True) -> Hello:
        """A Hello that must be refused, or (from a registered rank) its own Hello again."""
        if self.rank is not None and rng.random() < 0.1:
            hello = self._hello(rng.randrange(1, 1 << 32), self.rank.config, self.rank.regions)
        else:
            hello = self.absurd(rng)
        return self.seal(hello) if sealed and self.seal is not None else hello

    def absurd(self, rng: random.Random) -> Hello:
        rid = rng.randrange(1, 1 << 32)
        region = self.region
        handle = region.handle
        assert isinstance(handle, ShmHandle)
        engine = f"fz-absurd-{rng.randrange(1 << 20)}"
        config = make_config(engine_id=engine, model="fuzz/absurd", tp=1, bytes_per_block=0)
        parallel = config.parallel
        cache = config.cache

        def with_region(**changes: object) -> Hello:
            return self._hello(rid, config, (msgspec.structs.replace(region, **changes),))

        def with_handle(**changes: object) -> Hello:
            return with_region(handle=msgspec.structs.replace(handle, **changes))

        def with_config(**changes: object) -> Hello:
            return self._hello(rid, msgspec.structs.replace(config, **changes), (region,))

        huge = rng.choice([2**40, 2**62, 2**63 - 1])
        makers: list[Callable[[], Hello]] = [
            lambda: with_region(num_blocks=huge),
            lambda: with_region(num_blocks=-rng.randint(1, 1 << 40)),
            lambda: with_region(page_size=rng.choice([0, -1, -(2**63)])),
            lambda: with_region(block_stride=region.page_size - 1),
            lambda: with_region(page_size=huge, block_stride=huge),
            lambda: with_region(layer_names=("no.such.layer",)),
            lambda: with_handle(size=handle.size * 2),
            lambda: with_handle(offset=rng.choice([-1, 2**63 - 1])),
            lambda: with_handle(size=-1),
            lambda: with_handle(path="/etc/passwd"),
            lambda: with_handle(path="/dev/shm/../../etc/passwd"),
            lambda: with_handle(path=f"/dev/shm/od-test-absent-{rng.randrange(1 << 30)}"),
            lambda: with_handle(path="/dev/shm"),
            lambda: with_handle(path="/dev/shm/od-test-\x00nul"),
            lambda: self._hello(
                rid,
                config,
                (
                    msgspec.structs.replace(
                        region, handle=CudaIpcHandle("GPU-0", b"h", 1, 0, b"", 0, b"", False, 0, 1)
                    ),
                ),
            ),
            lambda: with_config(
                parallel=msgspec.structs.replace(parallel, world_size=rng.choice([0, -1]))
            ),
            lambda: with_config(
                parallel=msgspec.structs.replace(parallel, rank=rng.choice([1, -1, 2**63 - 1]))
            ),
            lambda: with_config(
                cache=msgspec.structs.replace(cache, blocks_per_chunk=rng.choice([0, -3]))
            ),
            lambda: with_config(worker_kv_bytes_per_block=rng.choice([1, 2**63 - 1])),
            lambda: with_config(groups=()),
            # A disagreeing rank of the valid engine: refused, and that engine is untouched.
            lambda: self._hello(
                rid,
                make_config(
                    engine_id=self.valid_engine_id,
                    tp=2,
                    rank=rng.randint(0, 1),
                    dtype="fp8",
                    bytes_per_block=0,
                ),
                (region,),
            ),
            lambda: msgspec.structs.replace(
                self._hello(rid, config, (region,)), protocol_version=rng.choice([0, 2**31])
            ),
            lambda: msgspec.structs.replace(
                self._hello(rid, config, ()), role="scheduler", regions=(region,)
            ),
            # A pid the daemon could watch (same pid namespace) that no process can have.
            lambda: msgspec.structs.replace(
                self._hello(rid, config, (region,)), pid=2**40, pid_namespace=_OWN_PID_NS
            ),
        ]
        return rng.choice(makers)()

    def _hello(self, rid: int, config: OffloadingConfig, regions: tuple[KVRegion, ...]) -> Hello:
        own = self.rank is not None and config is self.rank.config
        return Hello(
            request_id=rid,
            protocol_version=PROTOCOL_VERSION,
            role="worker",
            config=config,
            regions=regions,
            pid=os.getpid() if own else 0,
            pid_namespace=_OWN_PID_NS if own else 0,
            client_name="fuzz",
        )

    # -- kinds ----------------------------------------------------------------------------

    def random_bytes(self, rng: random.Random) -> list[bytes]:
        return [rng.randbytes(rng.choice([1, 2, 3, 5, 8, 16, 40, 100, 300, 1000]))]

    def truncated(self, rng: random.Random) -> list[bytes]:
        frame = self.template(rng)
        return [frame[: rng.randrange(len(frame))] or b"\x81"]

    def mutated(self, rng: random.Random) -> list[bytes]:
        return [_mutate(rng, self.template(rng))]

    def wrong_types(self, rng: random.Random) -> list[bytes]:
        message: dict[str, Any] = {"type": rng.choice(_TAGS)}
        for name in rng.sample(_FIELDS, rng.randint(0, 5)):
            message[name] = rng.choice(_WRONG_VALUES)
        if rng.random() < 0.3:  # a well-typed request_id, so the Error can echo it
            message["request_id"] = rng.randrange(1 << 32)
        return [msgspec.msgpack.encode(message)]

    def extreme_numbers(self, rng: random.Random) -> list[bytes]:
        def extreme() -> int:
            return rng.choice(_EXTREME_INTS)

        keys = [k for k in rng.sample(self.keys, 2)]
        message = rng.choice(
            [
                {"type": "store", "request_id": extreme(), "job_id": extreme(), "keys": keys,
                 "block_ids": [extreme() for _ in range(4)]},
                {"type": "load", "request_id": extreme(), "job_id": extreme(), "keys": keys,
                 "block_ids": [extreme() for _ in range(3)], "skip": extreme()},
                {"type": "wait", "request_id": extreme(), "job_ids": [extreme(), extreme()],
                 "timeout": rng.choice(_EXTREME_FLOATS)},
                {"type": "lookup", "request_id": extreme(), "keys": keys, "pin": True,
                 "lease_seconds": rng.choice(_EXTREME_FLOATS)},
                {"type": "ping", "request_id": extreme()},
                {"type": "stats", "request_id": extreme()},
            ]
        )  # fmt: skip
        return [msgspec.msgpack.encode(message)]

    def deep_nesting(self, rng: random.Random) -> list[bytes]:
        depth = rng.choice([50, 500, 900, 990, 1000, 1100, 5000, 100_000])
        if rng.random() < 0.5:
            return [_nested_list(depth)]
        tag, name = rng.choice([("lookup", "keys"), ("store", "block_ids"), ("hello", "config")])
        return [_tagged_with_deep_field(tag, name, depth)]

    def huge_header(self, rng: random.Random) -> list[bytes]:
        return [rng.choice(_HUGE_HEADERS)]

    def multi_frame(self, rng: random.Random) -> list[bytes]:
        first = self.template(rng) if rng.random() < 0.5 else rng.randbytes(rng.randint(0, 30))
        return [first, *(rng.randbytes(rng.randint(0, 30)) for _ in range(rng.randint(1, 4)))]

    def empty_frame(self, rng: random.Random) -> list[bytes]:
        return [b""] * rng.randint(1, 3)

    def absurd_hello(self, rng: random.Random) -> list[bytes]:
        hello = self.absurd(rng)
        if rng.random() < 0.04:
            # A namespace salt nested just short of what the decoder refuses.
            config = make_config(engine_id=f"fz-deep-{rng.randrange(1 << 20)}", tp=1)
            hello = self._hello(hello.request_id, config, (self.region,))
            if self.seal is not None:
                hello = self.seal(hello)
            return [_with_deep_salt(hello, rng.randrange(850, 1000))]
        return [encode(self.seal(hello) if self.seal is not None else hello)]

    def oversized(self, rng: random.Random) -> list[bytes]:
        return [b"\x00" * (self.max_frame_bytes + 1 + rng.randrange(4096))]


# ---------------------------------------------------------------- peers


@dataclass
class Tally:
    """What one control-socket DEALER sent and got back."""

    sent: int = 0
    answered: int = 0  # replies that echo a request (result or Error)
    unasked: int = 0  # JobDone, EngineReady
    undecodable: int = 0
    errors: Counter[int] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    internal: list[str] = field(default_factory=list)  # kinds that (likely) drew INTERNAL
    stalled: str = ""

    def add(self, other: Tally) -> None:
        self.sent += other.sent
        self.answered += other.answered
        self.unasked += other.unasked
        self.undecodable += other.undecodable
        self.errors.update(other.errors)
        self.kinds.update(other.kinds)
        self.internal.extend(other.internal)
        self.stalled = self.stalled or other.stalled


def _dealer(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, identity: bytes = b""
) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity or uuid.uuid4().bytes)
    sock.connect(endpoint)
    return sock


class ControlPeer:
    """A DEALER on the control socket that pipelines messages and accounts for replies.

    ``seal(hello)`` registers a Hello as ``offloadd.client`` would: the files of the test's
    own shared-memory regions it names (``/dev/shm/od-test*``) go over the registration
    socket, numbered into the handles, and the token into the Hello. Other paths get no
    descriptor (the daemon must refuse them without opening anything).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.endpoint = endpoint
        self.identity = uuid.uuid4().bytes
        self.sock = _dealer(ctx, endpoint, self.identity)
        self.files: dict[str, int] = {}
        self.tally = Tally()
        self._in_flight: list[str] = []  # kinds, in send order
        self.replies: deque[Reply] = deque(maxlen=64)  # the latest

    def seal(self, hello: Hello) -> Hello:
        order: dict[str, int] = {}
        regions = []
        for region in hello.regions:
            handle = region.handle
            if isinstance(handle, ShmHandle) and self._file(handle.path) is not None:
                index = order.setdefault(handle.path, len(order))
                region = msgspec.structs.replace(
                    region, handle=msgspec.structs.replace(handle, fd=index)
                )
            regions.append(region)
        registered = register(self.endpoint, self.identity, [self.files[p] for p in order])
        assert registered is not None
        return msgspec.structs.replace(hello, regions=tuple(regions), token=registered.token)

    def _file(self, path: str) -> int | None:
        if path not in self.files:
            if not path.startswith("/dev/shm/od-test") or "\x00" in path:
                return None
            try:
                self.files[path] = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                return None
        return self.files[path]

    def register(self, setup: FuzzRankSetup) -> Reply:
        """Say Hello as a one-rank engine; wait until it is ready unless it was refused."""
        hello = Hello(
            request_id=1,
            protocol_version=PROTOCOL_VERSION,
            role="worker",
            config=setup.config,
            regions=setup.regions,
            pid=os.getpid(),
            pid_namespace=_OWN_PID_NS,
            client_name="fuzz-rank",
        )
        self.sock.send(encode(self.seal(hello)))
        got: list[Reply] = []
        deadline = time.monotonic() + 10
        while not got or (isinstance(got[0], Welcome) and not isinstance(got[-1], EngineReady)):
            assert self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000)))
            got.append(decode_reply(self.sock.recv()))
        return got[0]

    def send(self, kind: str, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)
        self.tally.sent += 1
        self.tally.kinds[kind] += 1
        self._in_flight.append(kind)

    def outstanding(self) -> int:
        return self.tally.sent - self.tally.answered

    def drain(self, timeout: float) -> bool:
        """Read every reply available within ``timeout``; False if none came."""
        if not self.sock.poll(max(0, int(timeout * 1000))):
            return False
        while self.sock.poll(0):
            self._account(self.sock.recv())
        return True

    def settle(self, deadline: float) -> None:
        """Wait for the reply of every request sent so far."""
        while self.outstanding() > 0:
            if not self.drain(min(STALL, max(0.0, deadline - time.monotonic()))):
                self.tally.stalled = (
                    f"{self.outstanding()} of {self.tally.sent} requests unanswered "
                    f"(last kinds {self._in_flight[-5:]})"
                )
                return

    def _account(self, frame: bytes) -> None:
        tally = self.tally
        try:
            reply = decode_reply(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            tally.undecodable += 1
            return
        if isinstance(reply, JobDone | EngineReady):
            tally.unasked += 1
            return
        # Replies come in request order (a deferred Wait aside): good enough to name the
        # kind of input behind an INTERNAL error.
        kind = self._in_flight[tally.answered] if tally.answered < len(self._in_flight) else "?"
        tally.answered += 1
        if isinstance(reply, Error):
            tally.errors[reply.code] += 1
            if reply.code == ErrorCode.INTERNAL:
                tally.internal.append(kind)
        self.replies.append(reply)

    def close(self) -> None:
        self.sock.close(linger=0)
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()


class ControlDriver:
    """Feeds ``count`` fuzzed messages to one peer, ``WINDOW`` in flight at a time."""

    def __init__(self, peer: ControlPeer, frames: Frames, count: int, seed: int) -> None:
        self.peer = peer
        self.frames = frames
        self.count = count
        self.rng = random.Random(seed)
        self.oversized_at = {self.rng.randrange(count)} if frames.rank is None else set()

    @property
    def sock(self) -> zmq.Socket[bytes]:
        return self.peer.sock

    @property
    def done(self) -> bool:
        return self.peer.tally.sent == self.count and self.peer.outstanding() == 0

    def pump(self) -> None:
        peer, rng = self.peer, self.rng
        while peer.tally.sent < self.count and peer.outstanding() < WINDOW:
            if peer.tally.sent in self.oversized_at:
                peer.send("oversized", self.frames.oversized(rng))
            else:
                peer.send(*self.frames.next(rng))

    def readable(self) -> None:
        self.peer.drain(0)

    def stalled(self, why: str) -> None:
        self.peer.tally.stalled = f"{why}: {self.peer.outstanding()} requests unanswered"


@dataclass
class ReplayTally:
    """What one replay-socket DEALER sent and got back."""

    valid: int = 0  # well-formed requests: each must end with an end marker
    garbage: int = 0  # anything else: ignored
    end_markers: int = 0
    batches: int = 0
    bad_replies: list[list[bytes]] = field(default_factory=list)
    stalled: str = ""


class ReplayDriver:
    """Well-formed replay requests among garbage, ``REPLAY_WINDOW`` requests in flight."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, count: int, seed: int
    ) -> None:
        self.sock = _dealer(ctx, endpoint)
        self.count = count
        self.rng = random.Random(seed)
        self.tally = ReplayTally()

    @property
    def done(self) -> bool:
        tally = self.tally
        return tally.valid + tally.garbage == self.count and tally.end_markers >= tally.valid

    def pump(self) -> None:
        rng, tally = self.rng, self.tally
        while tally.valid + tally.garbage < self.count:
            if rng.random() < 0.3:
                if tally.valid - tally.end_markers >= REPLAY_WINDOW:
                    return
                # From a seq beyond the newest (just the end marker) or, rarely, from 0
                # (every buffered batch of the valid engine).
                start = 0 if rng.random() < 0.002 else rng.randrange(1 << 62, 1 << 64)
                self.sock.send_multipart([b"", start.to_bytes(8, "big")])
                tally.valid += 1
            else:
                self.sock.send_multipart(self._garbage())
                tally.garbage += 1

    def _garbage(self) -> list[bytes]:
        rng = self.rng
        seq = rng.randbytes(8)
        frames = rng.choice(
            [
                [seq],  # no empty delimiter
                [b"", seq[:7]],
                [b"", seq + b"\x00"],
                [b"x", seq],
                [b"", seq, b""],
                [b""],
                [b"", b""],
                [rng.randbytes(rng.randint(0, 64))],
                [rng.randbytes(rng.randint(0, 16)) for _ in range(rng.randint(3, 6))],
            ]
        )
        if len(frames) == 2 and frames[0] == b"" and len(frames[1]) == 8:  # valid by chance
            frames[1] += b"\x00"
        return frames

    def readable(self) -> None:
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            if frames == [b"", b"", END_SEQ, b""]:
                self.tally.end_markers += 1
            elif len(frames) == 4 and frames[0] == b"" and len(frames[2]) == 8:
                decode_batch(frames[3])
                self.tally.batches += 1
            else:
                self.tally.bad_replies.append(frames)

    def stalled(self, why: str) -> None:
        self.tally.stalled = f"{why}: {self.tally.valid - self.tally.end_markers} unanswered"


@dataclass(frozen=True)
class FuzzPlan:
    """What the fuzzing process sends, and where."""

    endpoint: str
    replay_endpoint: str
    max_frame_bytes: int
    control_messages: int
    replay_messages: int
    seed: int
    deadline_seconds: float


@dataclass
class FuzzOutcome:
    """What the fuzzing process reports back."""

    control: list[Tally] = field(default_factory=list)
    replay: list[ReplayTally] = field(default_factory=list)
    refused_registrations: int = 0  # Errors the daemon counted while the ranks registered
    seconds: float = 0.0
    failure: str = ""


def run_fuzzers(plan: FuzzPlan) -> FuzzOutcome:
    """Every DEALER multiplexed on one thread: the senders never compete with the daemon
    for a GIL, so the run measures the daemon."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    files: list[SharedKVTensor] = []
    drivers: list[ControlDriver | ReplayDriver] = []
    try:
        region = _scratch_region(files)
        senders = UNREGISTERED_SENDERS + REGISTERED_SENDERS
        refused_registrations = 0
        for index in range(senders):
            peer = ControlPeer(ctx, plan.endpoint)
            setup = None
            if index >= UNREGISTERED_SENDERS:
                setup, refused = _register_fuzz_rank(peer, index, files)
                refused_registrations += refused
            frames = Frames(
                region, max_frame_bytes=plan.max_frame_bytes, rank=setup, seal=peer.seal
            )
            count = plan.control_messages // senders
            drivers.append(ControlDriver(peer, frames, count, plan.seed + index))
        for index in range(2):
            count = plan.replay_messages // 2
            drivers.append(ReplayDriver(ctx, plan.replay_endpoint, count, plan.seed + 100 + index))
        started = time.monotonic()
        _multiplex(drivers, started + plan.deadline_seconds)
        return FuzzOutcome(
            control=[d.peer.tally for d in drivers if isinstance(d, ControlDriver)],
            replay=[d.tally for d in drivers if isinstance(d, ReplayDriver)],
            seconds=time.monotonic() - started,
            refused_registrations=refused_registrations,
        )
    finally:
        for driver in drivers:
            if isinstance(driver, ControlDriver):
                driver.peer.close()
            else:
                driver.sock.close(linger=0)
        ctx.destroy(linger=0)
        for kv in files:
            kv.close()


def _multiplex(drivers: list[ControlDriver | ReplayDriver], deadline: float) -> None:
    poller = zmq.Poller()
    by_socket = {}
    for driver in drivers:
        poller.register(driver.sock, zmq.POLLIN)
        by_socket[driver.sock] = driver
    last_reply = time.monotonic()
    while not all(driver.done for driver in drivers):
        for driver in drivers:
            driver.pump()
        events = poller.poll(1000)
        now = time.monotonic()
        for sock, _ in events:
            by_socket[sock].readable()
        if events:
            last_reply = now
        why = "deadline passed" if now > deadline else "stalled" if now - last_reply > STALL else ""
        if why:
            for driver in drivers:
                if not driver.done:
                    driver.stalled(why)
            return


def _register_fuzz_rank(
    peer: ControlPeer, index: int, files: list[SharedKVTensor]
) -> tuple[FuzzRankSetup, int]:
    """The first registered rank's config has a second group that no region holds; a daemon
    that refuses such a Hello gets a plain config instead. Returns the setup and how many
    Hellos were refused."""
    setup = _fuzz_rank(index, files, empty_group=index == UNREGISTERED_SENDERS)
    welcome = peer.register(setup)
    refused = 0
    if isinstance(welcome, Error) and setup.empty_group:
        assert welcome.code == ErrorCode.BAD_GEOMETRY, welcome
        refused = 1
        setup = _fuzz_rank(index, files)
        welcome = peer.register(setup)
    assert isinstance(welcome, Welcome), welcome
    return setup, refused


def _fuzz_process(plan: FuzzPlan, conn: Connection) -> None:
    """Entry point of the spawned fuzzing process."""
    try:
        outcome = run_fuzzers(plan)
    except BaseException:
        outcome = FuzzOutcome(failure=traceback.format_exc())
    conn.send(outcome)
    conn.close()


class ValidEngine(threading.Thread):
    """Two ranks that store, look up, load and compare bytes in a loop until stopped."""

    def __init__(self, ranks: list[Rank], stop: threading.Event) -> None:
        super().__init__(name="valid-engine", daemon=True)
        self.ranks = ranks
        self.stop = stop
        self.cycles = 0
        self.bytes_verified = 0
        self.slowest = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.wait(0.05):  # paced: the fuzzers get most of the daemon
                self.cycle()
        except BaseException as exc:
            self.error = exc

    def cycle(self) -> None:
        index = self.cycles
        keys = chain_keys(4, salt=b"valid-%d" % index)
        slots = [(4 * index + c) % 32 for c in range(4)]
        source = chunk_block_ids(slots, 2)
        target = chunk_block_ids(slots, 2, base=128)
        job = 2 * index + 1
        started = time.monotonic()
        for rank in self.ranks:
            assert rank.client is not None
            rank.client.store(job, keys, source)
        for rank in self.ranks:
            assert rank.client is not None
            rank.client.wait([job], 30)
        client0 = self.ranks[0].client
        assert client0 is not None
        assert client0.lookup(keys).hits == 4
        for rank in self.ranks:
            assert rank.client is not None
            for kv in rank.tensors:
                kv.tensor[target] = 0  # a load that wrote nothing cannot pass the check
            rank.client.load(job + 1, keys, target)
        for rank in self.ranks:
            assert rank.client is not None
            rank.client.wait([job + 1], 30)
            for got, want in zip(rank.pages(target), rank.pages(source), strict=True):
                assert torch.equal(got, want), f"cycle {index}: loaded bytes differ"
                self.bytes_verified += got.numel()
        self.slowest = max(self.slowest, time.monotonic() - started)
        self.cycles += 1


class StatsProbe(threading.Thread):
    """Asks for stats every 20 ms and keeps the slowest round trip (a stall shows here)."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, stop: threading.Event
    ) -> None:
        super().__init__(name="stats-probe", daemon=True)
        self.sock = _dealer(ctx, endpoint)
        self.stop = stop
        self.samples = 0
        self.slowest = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.wait(0.02):
                started = time.monotonic()
                self.sock.send(encode(GetStats(self.samples + 1)))
                assert self.sock.poll(int(STALL * 1000)), "stats not answered"
                reply = decode_reply(self.sock.recv())
                assert isinstance(reply, StatsResult), reply
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.samples += 1
        except BaseException as exc:
            self.error = exc
        finally:
            self.sock.close(linger=0)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def shm_files() -> Iterator[list[SharedKVTensor]]:
    created: list[SharedKVTensor] = []
    yield created
    for kv in created:
        kv.close()


def _fuzz_rank(
    index: int, shm_files: list[SharedKVTensor], *, empty_group: bool = False
) -> FuzzRankSetup:
    tensors = [
        SharedKVTensor.create(FUZZ_BLOCKS, PAGE, [layer], prefix="od-test") for layer in LAYERS
    ]
    shm_files.extend(tensors)
    engine_id = f"fz-rank-{index}"
    config = make_config(
        engine_id=engine_id, model="fuzz/model", tp=1, bytes_per_block=PAGE * len(LAYERS)
    )
    if empty_group:
        extra = OffloadingGroupConfig(tokens_per_block=16, layer_names=())
        config = msgspec.structs.replace(config, groups=(*config.groups, extra))
    return FuzzRankSetup(
        engine_id=engine_id,
        config=config,
        regions=tuple(kv.region for kv in tensors),
        keys=chain_keys(12, salt=b"fz-rank-%d" % index),
        empty_group=empty_group,
    )


def _scratch_region(shm_files: list[SharedKVTensor]) -> KVRegion:
    kv = SharedKVTensor.create(4, PAGE, ["layer.0"], prefix="od-test")
    shm_files.append(kv)
    return kv.region


def _stats(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> DaemonStats:
    """Every engine too: registered as the test's user (root or the daemon's: an admin)."""
    identity = uuid.uuid4().bytes
    sock = _dealer(ctx, endpoint, identity)
    try:
        registered = register(endpoint, identity)
        assert registered is not None
        sock.send(encode(GetStats(1, registered.token)))
        assert sock.poll(10_000), "the daemon does not answer stats"
        reply = decode_reply(sock.recv())
        assert isinstance(reply, StatsResult), reply
        return reply.stats
    finally:
        sock.close(linger=0)


def _valid_engine(daemon: DaemonThread, ranks: list[Rank]) -> list[Rank]:
    engine = [make_rank(daemon.endpoint, rank=r, tp=2, events=True) for r in range(2)]
    ranks.extend(engine)
    for seed, rank in enumerate(engine):
        rank.fill(100 + seed)
        assert rank.client is not None
        rank.client.wait_ready(10)
    return engine


def _report(message: str) -> None:
    print(f"\n[fuzz] {message}")


# ---------------------------------------------------------------- tests


@pytest.mark.timeout(180)
def test_100k_fuzzed_frames_while_a_valid_engine_checks_its_bytes(
    daemon: DaemonThread, ranks: list[Rank], zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    began = time.monotonic()
    engine = _valid_engine(daemon, ranks)
    plan = FuzzPlan(
        endpoint=daemon.endpoint,
        replay_endpoint=daemon.replay_endpoint,
        max_frame_bytes=daemon.settings.server.max_frame_bytes,
        control_messages=BULK_CONTROL_FRAMES,
        replay_messages=BULK_REPLAY_FRAMES,
        seed=1000,
        deadline_seconds=DEADLINE - 25,  # spawning, set-up and the checks take the rest
    )
    before = _stats(zctx, daemon.endpoint)
    stop = threading.Event()
    valid = ValidEngine(engine, stop)
    probe = StatsProbe(zctx, daemon.endpoint, stop)
    valid.start()
    probe.start()
    spawn = multiprocessing.get_context("spawn")  # never fork a process that runs threads
    receiver, sender = spawn.Pipe(duplex=False)
    process = spawn.Process(target=_fuzz_process, args=(plan, sender), name="fuzzer")
    try:
        process.start()
        sender.close()
        assert receiver.poll(DEADLINE + STALL), "the fuzzing process did not report"
        outcome: FuzzOutcome = receiver.recv()
        process.join(30)
    finally:
        stop.set()
        if process.is_alive():
            process.kill()
            process.join(10)
        receiver.close()
        if process.pid is not None:
            for leftover in glob.glob(f"/dev/shm/od-test-{process.pid}-*"):
                os.unlink(leftover)
    cycles_during_fuzz = valid.cycles
    for thread in (valid, probe):
        thread.join(60)
        assert not thread.is_alive(), f"{thread.name} did not stop"
    assert not outcome.failure, outcome.failure

    total = Tally()
    for tally in outcome.control:
        total.add(tally)
    assert not total.stalled, total.stalled
    assert total.internal == [], f"INTERNAL errors for inputs of kinds {Counter(total.internal)}"
    assert total.undecodable == 0
    assert total.sent >= BULK_CONTROL_FRAMES
    assert total.answered == total.sent, "every control message gets exactly one reply"
    for replay in outcome.replay:
        assert not replay.stalled, replay.stalled
        assert replay.bad_replies == []
        assert replay.end_markers == replay.valid, "one end marker per replay request"
    replay_valid = sum(r.valid for r in outcome.replay)
    replay_garbage = sum(r.garbage for r in outcome.replay)
    assert replay_valid + replay_garbage >= BULK_REPLAY_FRAMES

    # The valid engine was served throughout, and still is.
    assert valid.error is None, f"valid engine: {valid.error!r}"
    assert probe.error is None, f"stats probe: {probe.error!r}"
    assert cycles_during_fuzz >= 20, f"only {cycles_during_fuzz} valid cycles during the fuzz"
    # A flood must not starve the copy completions of others (a cycle takes well under 1s).
    assert valid.slowest < SLOWEST_VALID_CYCLE, f"a valid cycle took {valid.slowest:.1f}s"
    valid.cycle()
    after = _stats(zctx, daemon.endpoint)
    errors = sum(total.errors.values()) + outcome.refused_registrations
    assert after.protocol_errors - before.protocol_errors == errors
    (engine_a,) = [e for e in after.engines if e.engine_id == "engine-a"]
    assert engine_a.ready and engine_a.ranks_present == [0, 1]
    assert after.jobs_in_flight == 0
    if daemon.daemon is not None and daemon.daemon._events is not None:  # read-only peek
        assert daemon.daemon._events.stats().invalid_replay_requests == replay_garbage

    elapsed = time.monotonic() - began
    assert elapsed < DEADLINE, f"bulk fuzz took {elapsed:.0f}s"
    codes = {ErrorCode(code).name: n for code, n in sorted(total.errors.items())}
    seconds = outcome.seconds
    _report(
        f"control: {total.sent} messages from {len(outcome.control)} DEALERs in {seconds:.1f}s "
        f"({total.sent / seconds:,.0f}/s), {total.answered} answered, "
        f"{total.unasked} unasked (JobDone/EngineReady); errors {codes}; "
        f"protocol_errors +{after.protocol_errors - before.protocol_errors}"
    )
    _report(f"kinds: {dict(total.kinds)}")
    _report(
        f"replay: {replay_valid + replay_garbage} frames ({replay_valid} requests, "
        f"{replay_garbage} garbage), {sum(r.end_markers for r in outcome.replay)} end markers, "
        f"{sum(r.batches for r in outcome.replay)} batches replayed"
    )
    _report(
        f"valid engine: {valid.cycles} store/load cycles ({cycles_during_fuzz} during the fuzz), "
        f"{valid.bytes_verified / 2**20:.1f} MiB compared, slowest cycle {valid.slowest:.2f}s; "
        f"stats probe: {probe.samples} round trips, slowest {probe.slowest:.2f}s; "
        f"whole test {elapsed:.1f}s"
    )


# Hypothesis: generated frames, sent in batches on an unregistered and a registered DEALER.

_ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from(_EXTREME_INTS))
_floats = st.one_of(st.floats(), st.sampled_from(_EXTREME_FLOATS))
_keys = st.lists(st.binary(min_size=0, max_size=40), max_size=6)
_msgpack_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), _ints, _floats, st.text(max_size=12), st.binary(max_size=24)
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_requests = st.one_of(
    st.builds(Lookup, _ints, _keys, st.booleans(), _floats),
    st.builds(Store, _ints, _ints, _keys, st.lists(_ints, max_size=8)),
    st.builds(Load, _ints, _ints, _keys, st.lists(_ints, max_size=8), _ints),
    st.builds(Release, _ints, _keys),
    st.builds(Wait, _ints, st.lists(_ints, max_size=4), _floats),
    st.builds(GetStats, _ints),
    st.builds(Clear, _ints),
    st.builds(Ping, _ints, st.text(max_size=40)),
    st.builds(Bye, _ints),
)
_tagged = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    st.sampled_from(_TAGS),
    st.dictionaries(st.sampled_from(_FIELDS), _msgpack_values, max_size=6),
)


def _cut(frame: bytes, at: int) -> bytes:
    return frame[: at % max(1, len(frame))]


def _flip(frame: bytes, edits: list[tuple[int, int]]) -> bytes:
    data = bytearray(frame)
    for position, value in edits:
        data[position % len(data)] = value
    return bytes(data)


_messages = st.one_of(
    st.binary(max_size=200).map(lambda b: [b]),
    _tagged.map(lambda m: [msgspec.msgpack.encode(m)]),
    _requests.map(lambda r: [encode(r)]),
    st.builds(_cut, _requests.map(encode), st.integers(0, 10_000)).map(lambda b: [b]),
    st.builds(
        _flip,
        _requests.map(encode),
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    ).map(lambda b: [b]),
    st.integers(1, 3000).map(lambda d: [_nested_list(d)]),
    st.lists(st.binary(max_size=40), min_size=2, max_size=5),
)


@pytest.mark.timeout(120)
def test_generated_frames_each_get_one_reply(
    daemon: DaemonThread, zctx: zmq.Context[zmq.Socket[bytes]], shm_files: list[SharedKVTensor]
) -> None:
    unregistered = ControlPeer(zctx, daemon.endpoint)
    registered = ControlPeer(zctx, daemon.endpoint)
    setup = _fuzz_rank(0, shm_files)
    assert isinstance(registered.register(setup), Welcome)
    peers = (unregistered, registered)
    before = _stats(zctx, daemon.endpoint)

    @settings(
        max_examples=600,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(batch=st.lists(_messages, min_size=1, max_size=8), use_registered=st.booleans())
    def check(batch: list[list[bytes]], use_registered: bool) -> None:
        peer = peers[use_registered]
        answered = peer.tally.answered
        for frames in batch:
            peer.send("generated", frames)
        peer.settle(time.monotonic() + STALL)
        assert not peer.tally.stalled, peer.tally.stalled
        assert peer.tally.answered - answered == len(batch)
        assert peer.tally.internal == [], [frames[:1] for frames in batch]
        assert peer.tally.undecodable == 0
        if use_registered:  # a generated Bye or Hello may have ended its session: renew it
            peer.send("ping", [encode(Ping(1))])
            peer.settle(time.monotonic() + STALL)
            if peer.replies[-1] == Ok(1, 0):
                assert isinstance(peer.register(setup), Welcome)

    check()
    total = Tally()
    for peer in peers:
        total.add(peer.tally)
        peer.close()
    after = _stats(zctx, daemon.endpoint)
    assert after.protocol_errors - before.protocol_errors == sum(total.errors.values())
    codes = {ErrorCode(code).name: n for code, n in sorted(total.errors.items())}
    _report(f"hypothesis: {total.sent} messages, {total.answered} answered, errors {codes}")


def test_frame_above_the_socket_limit_drops_only_that_connection(
    daemon: DaemonThread, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    # Above max_frame_bytes (and a little slack, in which a frame is still answered TOO_LARGE)
    # zmq itself drops the connection before the daemon sees a byte (there is nobody to
    # answer); the daemon and its other peers carry on.
    limit = daemon.settings.server.max_frame_bytes + FRAME_SLACK
    sock = _dealer(zctx, daemon.endpoint)
    try:
        sock.send(b"\x00" * (limit + 1))
        before = _stats(zctx, daemon.endpoint)
        # The dropped DEALER reconnects by itself and is served again.
        deadline = time.monotonic() + 10
        while True:
            sock.send(encode(GetStats(5)))
            if sock.poll(200):
                reply = decode_reply(sock.recv())
                assert isinstance(reply, StatsResult)
                break
            assert time.monotonic() < deadline, "the peer was never served again"
    finally:
        sock.close(linger=0)
    assert _stats(zctx, daemon.endpoint).protocol_errors == before.protocol_errors


# ---------------------------------------------------------------- inputs that reached INTERNAL


def _ask(peer: ControlPeer, message: Request | bytes, expect: int = 1) -> list[Reply]:
    if isinstance(message, Hello):
        message = peer.seal(message)
    peer.send("focused", [message if isinstance(message, bytes) else encode(message)])
    peer.settle(time.monotonic() + 10)
    assert not peer.tally.stalled, peer.tally.stalled
    return list(peer.replies)[-expect:]


def _not_internal(reply: Reply) -> None:
    if isinstance(reply, Error):
        assert reply.code != ErrorCode.INTERNAL, reply


@pytest.mark.parametrize(
    "case", ["nul_in_shm_path", "pid_out_of_range", "deep_namespace_salt", "empty_group_store"]
)
def test_hostile_hello_fields_get_a_clear_error_and_leak_nothing(
    daemon: DaemonThread,
    zctx: zmq.Context[zmq.Socket[bytes]],
    shm_files: list[SharedKVTensor],
    case: str,
) -> None:
    baseline = _stats(zctx, daemon.endpoint)
    peer = ControlPeer(zctx, daemon.endpoint)
    try:
        kv = SharedKVTensor.create(4, PAGE, ["layer.0"], prefix="od-test")  # only this Hello's
        shm_files.append(kv)
        config = make_config(engine_id=f"hostile-{case}", tp=1, bytes_per_block=0)

        def hello(rid: int, cfg: OffloadingConfig, region: KVRegion, **extra: object) -> Hello:
            return Hello(rid, PROTOCOL_VERSION, "worker", cfg, (region,), **extra)  # type: ignore[arg-type]

        if case == "nul_in_shm_path":
            bad = msgspec.structs.replace(
                kv.region, handle=ShmHandle(kv.path + "\x00tail", 0, 4 * PAGE)
            )
            replies = [_ask(peer, hello(11, config, bad))[-1]]
        elif case == "pid_out_of_range":
            # pidfd_open() takes a C int: 2**40 is no process, in a namespace the daemon shares.
            message = hello(12, config, kv.region, pid=2**40, pid_namespace=_OWN_PID_NS)
            replies = [_ask(peer, message)[-1]]
        elif case == "deep_namespace_salt":
            # Nested just below what the decoder accepts: str() of it in the namespace
            # derivation used to raise RecursionError after the session was half-registered.
            replies = []
            for depth in range(940, 1000):
                named = msgspec.structs.replace(config, engine_id=f"hostile-deep-{depth}")
                sealed = peer.seal(hello(1000 + depth, named, kv.region))
                got = _ask(peer, _with_deep_salt(sealed, depth))
                replies.append(got[-1])
                if isinstance(got[-1], Welcome):  # accepted: say goodbye before the next one
                    _ask(peer, Bye(2000 + depth))
        else:  # empty_group_store
            groups = (*config.groups, OffloadingGroupConfig(tokens_per_block=16, layer_names=()))
            two_groups = msgspec.structs.replace(config, groups=groups)
            replies = [_ask(peer, hello(13, two_groups, kv.region))[-1]]
            if isinstance(replies[0], Welcome):
                key = chain_keys(1, salt=b"empty-group", group=1)[0]
                replies.append(_ask(peer, Store(14, 1, [key], [0, 1]))[-1])
                ok_key = chain_keys(1, salt=b"empty-group")[0]
                accepted = _ask(peer, Store(15, 2, [ok_key], [0, 1]))[-1]
                assert isinstance(accepted, JobAccepted), accepted
        for reply in replies:
            _not_internal(reply)
        assert peer.tally.internal == []
        if case != "deep_namespace_salt" and isinstance(replies[0], Welcome):
            _ask(peer, Bye(99))
    finally:
        peer.close()
    # Refused Hellos (and the session the daemon had started) release what they opened.
    deadline = time.monotonic() + 10
    while True:
        after = _stats(zctx, daemon.endpoint)
        hostile = [e.engine_id for e in after.engines if e.engine_id.startswith("hostile")]
        if after.imports == baseline.imports and after.sessions == baseline.sessions:
            break
        assert time.monotonic() < deadline, (
            f"imports {baseline.imports} -> {after.imports}, sessions {baseline.sessions} -> "
            f"{after.sessions}, engines left {hostile}"
        )
    assert hostile == [], f"engines left behind: {hostile}"


@pytest.mark.parametrize("ending", ["hello_again", "bye"])
def test_a_wait_pending_when_its_session_ends_is_still_answered(
    daemon_factory: Callable[..., DaemonThread],
    zctx: zmq.Context[zmq.Socket[bytes]],
    shm_files: list[SharedKVTensor],
    ending: str,
) -> None:
    gated = FakeCopyEngine()
    daemon = daemon_factory(copy_engine=gated)
    setup = _fuzz_rank(0, shm_files)
    peer = ControlPeer(zctx, daemon.endpoint)
    try:
        assert isinstance(peer.register(setup), Welcome)
        gated.gate.clear()
        peer.send("store", [encode(Store(10, 1, setup.keys[:1], [0, 1]))])
        peer.send("wait", [encode(Wait(11, [1], 30.0))])
        assert gated.started.acquire(timeout=10)
        if ending == "bye":
            peer.send("bye", [encode(Bye(12))])
        else:
            hello = Hello(12, PROTOCOL_VERSION, "worker", setup.config, setup.regions)
            peer.send("hello", [encode(peer.seal(hello))])
        peer.settle(time.monotonic() + 10)  # before the copy is let go
        assert not peer.tally.stalled, peer.tally.stalled
        (result,) = [r for r in peer.replies if getattr(r, "request_id", None) == 11]
        assert result == WaitResult(11, [], [1])  # abandoned with its session: never done
    finally:
        gated.gate.set()
        peer.close()


@pytest.mark.timeout(60)
def test_non_finite_floats_on_the_production_event_loop(
    zctx: zmq.Context[zmq.Socket[bytes]], shm_files: list[SharedKVTensor]
) -> None:
    """``offloadd serve`` runs on uvloop, whose call_later(nan) raises: Wait(timeout=nan)
    for a job in flight must be refused (or answered), never reach INTERNAL."""
    workdir = tempfile.mkdtemp(prefix="od-fuzz-", dir="/tmp")
    server = ServeProcess(workdir, f"/dev/shm/od-test-fuzz-{uuid.uuid4().hex[:12]}")
    peer: ControlPeer | None = None
    try:
        server.start()
        setup = _fuzz_rank(0, shm_files)
        peer = ControlPeer(zctx, server.endpoint)
        assert isinstance(peer.register(setup), Welcome)
        keys = setup.keys
        # Store and Wait go out together: the daemon reads the Wait before the copy's
        # completion can run on its loop, so the job is still in flight.
        for job, timeout in enumerate(
            [math.nan, math.inf, 1e308, -math.inf, math.nan, math.nan] * 3, start=1
        ):
            key = keys[job % len(keys)]
            peer.send("store", [encode(Store(10 * job, job, [key], [0, 1]))])
            peer.send("wait", [encode(Wait(10 * job + 1, [job], timeout))])
            peer.send("lookup", [encode(Lookup(10 * job + 2, [key], True, timeout))])
        peer.settle(time.monotonic() + 20)
        assert not peer.tally.stalled, peer.tally.stalled
        assert peer.tally.internal == [], f"INTERNAL for {Counter(peer.tally.internal)}"
        assert peer.tally.answered == peer.tally.sent
        # A Wait(-inf) is answered at once: the last stores may still be sealing. They must
        # end, not stay in flight.
        deadline = time.monotonic() + 10
        while _stats(zctx, server.endpoint).jobs_in_flight:
            assert time.monotonic() < deadline, "jobs stayed in flight"
            time.sleep(0.01)
        assert server.process is not None and server.process.poll() is None
    finally:
        if peer is not None:
            peer.close()
        server.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)

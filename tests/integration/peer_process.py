"""A rank (or a prying peer) in its own process, run as another Unix user by test_trust.py.

``python -m tests.integration.peer_process ENDPOINT [options]`` does what the options say, in
this order, and prints ONE JSON line of what happened; with ``--hold`` it then keeps its
session until its stdin closes. Nothing heavy is imported (no torch, no daemon).

``--user UID --group GID --groups G,G``: started as root, it becomes that user before doing
anything (setgroups, setgid, setuid: real, effective and saved ids, no capability left), as a
service manager starts a rank. Everything it runs is imported first, so it needs no read
access to the interpreter's own files (which may sit in root's home).

- ``--open PATH``: try to open PATH read-write (as this user): ``opened`` true, or the error.
- ``--path-hello PATH``: a registered Hello whose region names PATH with no descriptor (what
  an old client, or a hostile one, sends): ``path_hello`` is the Error code it gets.
- ``--engine E --rank R --tp T``: connect as that rank with this user's own 0600 files in
  /dev/shm (``connected`` true, or ``error``: the exception's class and message);
  ``--scheduler`` connects a scheduler instead; ``--private`` sets ``private_cache``.
- ``--store SALT``: store chunks 0..3 (keys ``chain_keys(4, SALT)``); ``stored`` the count.
- ``--lookup SALT``: ``hits`` for ``chain_keys(4, SALT)``.
- ``--stats``: ``engines``, the engine ids GetStats shows this user (registered, no session
  needed), and ``namespace`` of the connected engine.
- ``--claim-pid N``: the rank's Hello claims pid N (the daemon must watch the real one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import uuid

import msgspec
import zmq

import offloadd.client
from offloadd.client import OffloadClient
from offloadd.errors import OffloaddError
from offloadd.peer import register
from protocol import PROTOCOL_VERSION
from protocol.handles import KVRegion, ShmHandle
from protocol.messages import Error, Hello, decode_reply, encode
from tests.integration.configs import LAYERS, chain_keys, chunk_block_ids, make_config

PAGE = 4096
BLOCKS = 16


def _own_files() -> list[str]:
    paths = []
    for index in range(len(LAYERS)):
        path = f"/dev/shm/od-test-{os.getpid()}-{uuid.uuid4().hex[:8]}-{index}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, BLOCKS * PAGE)
            os.pwrite(fd, bytes((os.getpid() + i) % 251 for i in range(PAGE)) * BLOCKS, 0)
        finally:
            os.close(fd)
        paths.append(path)
    return paths


def _regions(paths: list[str]) -> list[KVRegion]:
    return [
        KVRegion(ShmHandle(path, 0, BLOCKS * PAGE), BLOCKS, PAGE, PAGE, (layer,))
        for path, layer in zip(paths, LAYERS, strict=True)
    ]


def _path_hello(endpoint: str, path: str) -> int:
    identity = uuid.uuid4().bytes
    registered = register(endpoint, identity)
    assert registered is not None
    config = make_config(engine_id=f"prying-{os.getpid()}", tp=1, bytes_per_block=0)
    region = KVRegion(ShmHandle(path, 0, PAGE), 1, PAGE, PAGE, (LAYERS[0],))
    hello = Hello(1, PROTOCOL_VERSION, "worker", config, (region,), token=registered.token)
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.connect(endpoint)
        sock.send(encode(hello))
        assert sock.poll(10_000), "no answer"
        reply = decode_reply(sock.recv())
    return reply.code if isinstance(reply, Error) else 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("--open")
    parser.add_argument("--path-hello")
    parser.add_argument("--engine")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--scheduler", action="store_true")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--store")
    parser.add_argument("--lookup")
    parser.add_argument("--stats", action="store_true")
    parser.add_argument("--claim-pid", type=int, default=0)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--user", type=int)
    parser.add_argument("--group", type=int)
    parser.add_argument("--groups", default="")
    args = parser.parse_args()
    if args.user is not None:
        os.setgroups([int(g) for g in args.groups.split(",") if g])
        os.setgid(args.group)
        os.setuid(args.user)
    out: dict[str, object] = {"uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid()}
    paths: list[str] = []
    client: OffloadClient | None = None
    try:
        if args.open:
            try:
                os.close(os.open(args.open, os.O_RDWR))
                out["opened"] = True
            except OSError as exc:
                out["opened"] = exc.strerror
        if args.path_hello:
            out["path_hello"] = _path_hello(args.endpoint, args.path_hello)
        if args.engine:
            extra: dict[str, object] | None = {"private_cache": True} if args.private else None
            config = make_config(
                engine_id=args.engine,
                rank=args.rank,
                tp=args.tp,
                bytes_per_block=PAGE * len(LAYERS),
                extra=extra,
            )
            regions: list[KVRegion] = []
            if not args.scheduler:
                paths = _own_files()
                regions = _regions(paths)
            if args.claim_pid:
                real = offloadd.client._ClientCore.hello

                def claim(*a: object, **k: object) -> Hello:
                    hello = real(*a, **k)  # type: ignore[arg-type]
                    return msgspec.structs.replace(hello, pid=args.claim_pid)

                offloadd.client._ClientCore.hello = claim  # type: ignore[method-assign]
            try:
                client = OffloadClient.connect(
                    args.endpoint,
                    config,
                    regions,
                    role="scheduler" if args.scheduler else "worker",
                    heartbeat=0,
                )
                out["connected"] = True
                if args.tp == 1 and not args.scheduler:
                    out["namespace"] = client.wait_ready(10).namespace
            except OffloaddError as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
        if client is not None and args.store:
            keys = chain_keys(4, args.store.encode())
            client.store(1, keys, chunk_block_ids(range(4), 2))
            client.wait([1], 10)
            out["stored"] = client.lookup(keys).hits
        if client is not None and args.lookup:
            out["hits"] = client.lookup(chain_keys(4, args.lookup.encode())).hits
        if args.stats:
            with OffloadClient(args.endpoint, heartbeat=0) as viewer:
                out["engines"] = sorted(e.engine_id for e in viewer.stats().engines)
        print(json.dumps(out), flush=True)
        if args.hold:
            sys.stdin.read()
    finally:
        if client is not None:
            with contextlib.suppress(OffloaddError):
                client.close()
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


if __name__ == "__main__":
    main()

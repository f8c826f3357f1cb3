"""A real daemon on its own thread and loop, and simulated ranks on shared-memory tensors."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from offloadd.client import OffloadClient
from offloadd.errors import DaemonUnavailable
from offloadd.peer import register
from offloadd.server.daemon import Daemon
from offloadd.server.tiers import TierSlot
from offloadd.settings import (
    CacheSettings,
    DiskSettings,
    EventSettings,
    LimitsSettings,
    MetricsSettings,
    MooncakeSettings,
    ServerSettings,
    Settings,
    TenancySettings,
)
from offloadd.shm import SharedKVTensor
from offloadd.transfer.engine import CopyEngine
from protocol.config import OffloadingConfig
from protocol.messages import Hello
from tests.integration.configs import (
    LAYERS,
    TOKENS_PER_BLOCK,
    chain_keys,
    chunk_block_ids,
    make_config,
)

__all__ = [
    "LAYERS",
    "TOKENS_PER_BLOCK",
    "DaemonThread",
    "Rank",
    "ServeProcess",
    "chain_keys",
    "chunk_block_ids",
    "make_config",
    "make_rank",
    "scrape_unix",
    "shm_leftovers",
    "with_token",
]


class DaemonThread:
    """Runs ``Daemon`` on a private endpoint and arena until ``stop()``."""

    def __init__(
        self,
        capacity: int = 64 << 20,
        copy_engine: CopyEngine | None = None,
        session_timeout: float = 30.0,
        *,
        limits: LimitsSettings | None = None,
        tenancy: TenancySettings | None = None,
        disk: DiskSettings | None = None,
        mooncake: MooncakeSettings | None = None,
        tiers: Sequence[TierSlot] | None = None,
        **server: object,
    ) -> None:
        self.workdir = tempfile.mkdtemp(prefix="od-", dir="/tmp")
        self.endpoint = str(server.pop("endpoint", f"ipc://{self.workdir}/d.sock"))
        self.arena_path = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
        self.settings = Settings(
            server=ServerSettings(
                endpoint=self.endpoint,
                drain_seconds=float(server.pop("drain_seconds", 5.0)),  # type: ignore[arg-type]
                session_timeout=session_timeout,
                **server,  # type: ignore[arg-type]
            ),
            cache=CacheSettings(arena=self.arena_path, capacity=capacity, persist=False),
            events=EventSettings(
                endpoint=f"ipc://{self.workdir}/ev.sock",
                replay_endpoint=f"ipc://{self.workdir}/replay.sock",
                pod="test-pod",
            ),
            metrics=MetricsSettings(address=""),
            limits=limits or LimitsSettings(),
            tenancy=tenancy or TenancySettings(),
            disk=disk or DiskSettings(),
            mooncake=mooncake or MooncakeSettings(),
        )
        self.tiers = tiers  # given to the daemon in place of the settings' tiers
        self.events_endpoint = self.settings.events.endpoint
        self.replay_endpoint = self.settings.events.replay_endpoint
        self.copy_engine = copy_engine
        self.daemon: Daemon | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="offloadd-test", daemon=True)

    def start(self) -> DaemonThread:
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("daemon did not start")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                daemon = Daemon(self.settings, copy_engine=self.copy_engine, tiers=self.tiers)
                await daemon.start()
            except BaseException as exc:
                self._error = exc
                self._started.set()
                return
            self.daemon = daemon
            self._started.set()
            try:
                await daemon.serve(self._stop)
            finally:
                await daemon.close()

        asyncio.run(main())

    def begin_stop(self) -> None:
        """Tell the daemon to stop (as SIGTERM does: it drains), without waiting for it."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            # A daemon that failed to start closes its loop as its thread ends, maybe between
            # the check and this call: it has stopped already.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)

    def stop(self) -> None:
        self.begin_stop()
        self._thread.join(30)
        shutil.rmtree(self.workdir, ignore_errors=True)


def with_token(endpoint: str, identity: bytes, hello: Hello, fds: Sequence[int] = ()) -> Hello:
    """``hello`` with a fresh registration token for the ZeroMQ routing id ``identity``, for
    tests that speak the wire themselves (``offloadd.client`` registers by itself)."""
    registered = register(endpoint, identity, fds)
    assert registered is not None, f"{endpoint} has no registration socket"
    return msgspec.structs.replace(hello, token=registered.token)


@dataclass
class Rank:
    """One simulated rank: shared-memory regions (one per layer) and a connected client."""

    tensors: list[SharedKVTensor]
    config: OffloadingConfig
    client: OffloadClient | None = None
    extra_files: list[SharedKVTensor] = field(default_factory=list)

    def fill(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for kv in self.tensors:
            kv.tensor.copy_(
                torch.randint(0, 256, kv.tensor.shape, generator=generator, dtype=torch.uint8)
            )

    def pages(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        return [kv.pages(block_ids) for kv in self.tensors]

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for kv in self.tensors:
            kv.close()


def make_rank(
    endpoint: str | None,
    *,
    num_blocks: int = 256,
    page: int = 4096,
    stride: int | None = None,
    connect: bool = True,
    memfd: bool = False,
    **config_args: object,
) -> Rank:
    """Regions for each layer of LAYERS (files in /dev/shm, or sealed memfds), filled later;
    connects unless told not to."""
    stride = stride or page
    tensors = [
        SharedKVTensor.memfd(num_blocks, page, [layer], block_stride=stride)
        if memfd
        else SharedKVTensor.create(num_blocks, page, [layer], block_stride=stride, prefix="od-test")
        for layer in LAYERS
    ]
    config = make_config(bytes_per_block=stride * len(LAYERS), **config_args)  # type: ignore[arg-type]
    rank = Rank(tensors, config)
    if connect:
        assert endpoint is not None
        files = {path: fd for kv in tensors for path, fd in kv.files.items()}
        regions = [kv.region for kv in tensors]
        try:
            rank.client = OffloadClient.connect(endpoint, config, regions, files=files)
        except BaseException:
            rank.close()  # a refused Hello must not leave its tensors in /dev/shm
            raise
    return rank


def scrape_unix(path: str, target: str = "/metrics") -> str:
    """The HTTP answer to a GET of ``target`` on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(path)
        conn.sendall(f"GET {target} HTTP/1.0\r\n\r\n".encode())
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def shm_leftovers() -> list[str]:
    """Test files still in /dev/shm (fixtures must remove what they create)."""
    return [name for name in os.listdir("/dev/shm") if name.startswith("od-test")]


@contextlib.contextmanager
def serve_process(capacity: str = "64MiB", *, persist: bool = True) -> Iterator[ServeProcess]:
    """A ``ServeProcess`` (not started) in a private work directory (``workdir``) and
    ``/dev/shm`` arena, killed and both removed when the block ends."""
    workdir = tempfile.mkdtemp(prefix="od-", dir="/tmp")
    arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    daemon = ServeProcess(workdir, arena, capacity, persist=persist)
    try:
        yield daemon
    finally:
        daemon.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


class ServeProcess:
    """``offloadd serve`` as a subprocess on a fixed endpoint and arena (restart tests).

    The journal and its key go in ``<workdir>/state``. ``start(runner=[...])`` runs another
    module in place of ``-m offloadd`` (e.g. one that injects journal faults); with
    ``log=True`` the daemon's stderr goes to ``log_path`` (appended across restarts);
    ``config``: a TOML settings file it reads (``--config``); ``beside=True``: the events,
    replay and metrics sockets where the daemon puts them by default ("auto": beside the
    control socket) instead of private paths and no metrics; ``log_level=None``: no
    ``--log-level`` flag (the config file's level counts).
    """

    def __init__(
        self,
        workdir: str,
        arena: str,
        capacity: str = "64MiB",
        *,
        persist: bool = True,
        config: str = "",
        beside: bool = False,
        log_level: str | None = "WARNING",
    ) -> None:
        self.workdir = workdir
        self.persist = persist
        self.config = config
        self.beside = beside
        self.log_level = log_level
        self.endpoint = f"ipc://{workdir}/d.sock"
        self.events_endpoint = f"ipc://{workdir}/" + ("d.sock.events" if beside else "ev.sock")
        self.replay_endpoint = f"ipc://{workdir}/" + ("d.sock.replay" if beside else "replay.sock")
        self.metrics_path = f"{workdir}/d.sock.metrics" if beside else ""
        self.arena = arena
        self.journal = f"{workdir}/state/d.journal"
        self.capacity = capacity
        self.log_path = f"{workdir}/daemon.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(
        self, runner: Sequence[str] = ("-m", "offloadd"), *, log: bool = False
    ) -> ServeProcess:
        command = [
            sys.executable, *runner, "serve",
            "--endpoint", self.endpoint, "--arena", self.arena, "--capacity", self.capacity,
            "--journal", self.journal,
        ]  # fmt: skip
        if not self.beside:
            command += [
                "--events-endpoint", self.events_endpoint,
                "--events-replay-endpoint", self.replay_endpoint,
                "--metrics-address", "",
            ]  # fmt: skip
        if self.log_level is not None:
            command += ["--log-level", self.log_level]
        if not self.persist:
            command.append("--no-persist")
        if self.config:
            command += ["--config", self.config]
        if log:
            with open(self.log_path, "ab") as stderr:
                self.process = subprocess.Popen(command, stderr=stderr)
        else:
            self.process = subprocess.Popen(command)
        deadline = time.monotonic() + 30
        while True:
            assert self.process.poll() is None, "daemon exited at start"
            try:
                with OffloadClient(self.endpoint, timeout=0.5, heartbeat=0) as client:
                    client.stats()
                return self
            except DaemonUnavailable:
                assert time.monotonic() < deadline, "daemon did not start"

    def log(self) -> str:
        """What the daemon wrote to ``log_path`` so far."""
        with open(self.log_path, errors="replace") as handle:
            return handle.read()

    def stop(self, signum: int = signal.SIGTERM) -> int:
        assert self.process is not None
        self.process.send_signal(signum)
        status = self.process.wait(30)
        self.process = None
        return status

    def cleanup(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(30)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.arena)

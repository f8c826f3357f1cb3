"""``offloadd serve`` as systemd runs it (sd_notify, watchdog, SIGTERM), ``offloadd status``,
and the metrics endpoint: real subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from offloadd.client import OffloadClient
from offloadd.errors import DaemonUnavailable
from tests.integration.harness import Rank, chain_keys, chunk_block_ids, make_rank
from tests.ports import free_port


def _clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without anything that would change how the daemon runs."""
    skip = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM", "LISTEN_FDS")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("OFFLOADD_") and key not in skip
    }
    env.update(extra)
    return env


class Served:
    """``python -m offloadd serve`` on a private endpoint, arena and event sockets."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.socket_path = f"{workdir}/d.sock"
        self.endpoint = f"ipc://{self.socket_path}"
        self.arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
        self.log_path = f"{workdir}/daemon.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        runner: tuple[str, ...] = ("-m", "offloadd"),
    ) -> Served:
        command = [
            sys.executable, *runner, "serve",
            "--endpoint", self.endpoint, "--arena", self.arena, "--capacity", "64MiB",
            "--no-persist",
            "--events-endpoint", f"ipc://{self.workdir}/ev.sock",
            "--events-replay-endpoint", f"ipc://{self.workdir}/replay.sock",
            *args,
        ]  # fmt: skip
        if "--metrics-address" not in args:
            command += ["--metrics-address", ""]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=log, env=env or _clean_env()
            )
        return self

    def wait_serving(self, timeout: float = 60) -> None:
        """Poll GetStats until the daemon answers."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"daemon exited at start:\n{self.log()}"
            try:
                with OffloadClient(self.endpoint, timeout=0.5, heartbeat=0) as client:
                    client.stats()
                return
            except DaemonUnavailable:
                assert time.monotonic() < deadline, "daemon did not start"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as log:
            return log.read()

    def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        status = self.process.wait(30)
        self.process = None
        return status

    def cleanup(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(30)
            self.process = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.arena)
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def served() -> Iterator[Served]:
    daemon = Served(tempfile.mkdtemp(prefix="od-", dir="/tmp"))
    yield daemon
    daemon.cleanup()


def _offloadd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "offloadd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=_clean_env(),
    )


# --- sd_notify ------------------------------------------------------------------------------


class NotifyListener:
    """The datagram socket systemd would own: collects what the daemon sends."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.messages: list[dict[str, str]] = []

    def wait_for(
        self,
        condition: Callable[[list[dict[str, str]]], bool],
        process: subprocess.Popen[bytes],
        timeout: float,
    ) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self.messages):
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"timed out; got {self.messages}"
            assert process.poll() is None or self._drain(), "daemon exited"
            self.sock.settimeout(min(remaining, 0.5))
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append(self._parse(data))

    def _drain(self) -> bool:
        """After the daemon exited, read what it left queued; True if anything was."""
        self.sock.setblocking(False)
        got = False
        with contextlib.suppress(BlockingIOError):
            while True:
                self.messages.append(self._parse(self.sock.recv(4096)))
                got = True
        return got

    @staticmethod
    def _parse(data: bytes) -> dict[str, str]:
        return dict(line.split("=", 1) for line in data.decode().splitlines())

    def count(self, key: str, value: str) -> int:
        return sum(message.get(key) == value for message in self.messages)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_systemd_notify_ready_watchdog_stopping(served: Served, abstract: bool) -> None:
    if abstract:
        name = f"offloadd-test-{uuid.uuid4().hex}"
        listener, notify_socket = NotifyListener("\0" + name), "@" + name
    else:
        notify_socket = f"{served.workdir}/notify.sock"
        listener = NotifyListener(notify_socket)
    try:
        env = _clean_env(NOTIFY_SOCKET=notify_socket, WATCHDOG_USEC="200000")
        served.start(env=env)
        assert served.process is not None
        listener.wait_for(lambda m: any("READY" in x for x in m), served.process, 60)
        ready = next(message for message in listener.messages if "READY" in message)
        assert ready["READY"] == "1"
        assert served.endpoint in ready["STATUS"]
        assert os.path.exists(served.socket_path)

        # Pings every WATCHDOG_USEC / 2 from the event loop.
        listener.wait_for(lambda m: listener.count("WATCHDOG", "1") >= 3, served.process, 10)

        served.process.send_signal(signal.SIGTERM)
        listener.wait_for(lambda m: listener.count("STOPPING", "1") >= 1, served.process, 30)
        assert served.process.wait(30) == 0
        served.process = None
    finally:
        listener.close()
    assert not os.path.exists(served.socket_path), "socket file left behind"
    assert not os.path.exists(served.arena), "arena left behind (--no-persist)"


def _wait_for_log(served: Served, text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while text not in served.log():
        assert served.process is not None, "daemon not started"
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{served.log()}"
        with contextlib.suppress(subprocess.TimeoutExpired):  # paced by the process's exit
            served.process.wait(0.05)
            raise AssertionError(f"daemon exited:\n{served.log()}")


@pytest.mark.timeout(120)
def test_a_second_sigterm_during_the_drain_forces_the_exit(
    served: Served, ranks: list[Rank]
) -> None:
    # Copies that never end (tests.integration.held_serve) and a grace of 600 s: only the
    # second signal can end this drain in time.
    env = _clean_env(OFFLOADD_SERVER__DRAIN_SECONDS="600")
    served.start(env=env, runner=("-m", "tests.integration.held_serve", "--copies", "wedged"))
    served.wait_serving()
    rank = make_rank(served.endpoint, rank=0, tp=1)
    ranks.append(rank)
    assert rank.client is not None
    rank.client.wait_ready(5)
    rank.client.store(1, chain_keys(1), chunk_block_ids([0], 2))
    assert rank.client.stats().jobs_in_flight == 1
    assert served.process is not None
    served.process.send_signal(signal.SIGTERM)
    _wait_for_log(served, "draining 1 in-flight jobs (up to 600s)")
    served.process.send_signal(signal.SIGTERM)
    status = served.process.wait(60)  # far inside the 600 s grace
    served.process = None
    log = served.log()
    assert status == 128 + signal.SIGTERM, log  # the documented status of a forced exit
    assert "SIGTERM again: exiting without waiting for the drain" in log
    assert "forced exit: drain cancelled with 1 jobs in flight" in log
    assert not os.path.exists(served.socket_path)  # the endpoint was still released


# --- offloadd status -------------------------------------------------------------------------


def test_status_reports_a_connected_engine(served: Served, ranks: list[Rank]) -> None:
    served.start()
    served.wait_serving()
    rank = make_rank(served.endpoint, rank=0, tp=1)
    ranks.append(rank)
    assert rank.client is not None
    rank.client.wait_ready(5)
    waiting = make_rank(served.endpoint, engine_id="engine-b", rank=0, tp=2)
    ranks.append(waiting)

    result = _offloadd("status", "--endpoint", served.endpoint, "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    engines = {engine["engine_id"]: engine for engine in stats["engines"]}
    assert engines["engine-a"]["ready"] is True
    assert engines["engine-a"]["ranks_present"] == [0]
    assert engines["engine-a"]["world_size"] == 1
    assert engines["engine-b"]["ready"] is False
    assert engines["engine-b"]["ranks_present"] == [0]
    assert stats["sessions"] == 2
    assert stats["capacity_bytes"] == 64 << 20

    text = _offloadd("status", "--endpoint", served.endpoint)
    assert text.returncode == 0, text.stderr
    assert "engine-a dp 0: ready, 1/1 ranks" in text.stdout
    assert "engine-b dp 0: waiting for ranks [1] (1/2 ranks present)" in text.stdout
    assert "of 64.0MiB" in text.stdout


def test_status_without_a_daemon_fails_clearly() -> None:
    endpoint = f"ipc:///tmp/od-nothing-{uuid.uuid4().hex[:12]}.sock"
    result = _offloadd("status", "--endpoint", endpoint, "--timeout", "0.5")
    assert result.returncode == 1
    assert result.stdout == ""
    assert (
        f"offloadd status: no daemon answers at {endpoint} "
        "(is it running? see systemctl status offloadd)" in result.stderr
    )


def test_status_says_where_the_events_are(served: Served) -> None:
    served.start()
    served.wait_serving()
    events, replay = f"ipc://{served.workdir}/ev.sock", f"ipc://{served.workdir}/replay.sock"
    text = _offloadd("status", "--endpoint", served.endpoint)
    assert text.returncode == 0, text.stderr
    assert f"  events     {events} (replay {replay})" in text.stdout.splitlines()
    stats = json.loads(_offloadd("status", "--endpoint", served.endpoint, "--json").stdout)
    assert (stats["events_endpoint"], stats["events_replay_endpoint"]) == (events, replay)


# --- empty values with a meaning, and events found through the daemon ------------------------


def test_serve_with_events_replay_and_metrics_off(served: Served) -> None:
    # "" is "off" for these three (an empty events endpoint used to die in zmq's bind).
    served.start("--events-endpoint", "", "--events-replay-endpoint", "", "--metrics-address", "")
    served.wait_serving()
    text = _offloadd("status", "--endpoint", served.endpoint)
    assert text.returncode == 0, text.stderr
    assert "  events     off" in text.stdout.splitlines()

    watched = _offloadd("events", "--daemon", served.endpoint)
    assert watched.returncode == 1
    assert watched.stderr.strip().splitlines() == [
        f"offloadd events: the daemon at {served.endpoint} publishes no KV events "
        '(events.enabled = false or events.endpoint = "")'
    ]
    assert served.stop() == 0
    assert "Traceback" not in served.log()


def test_a_malformed_value_stops_serve_with_one_line() -> None:
    result = _offloadd("serve", "--events-endpoint", "tcp://127.0.0.1")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "offloadd: events.endpoint: expected tcp://HOST:PORT (a port up to 65535), got "
        '\'tcp://127.0.0.1\'; "auto" for beside the control socket, or "" for no events '
        "(from --events-endpoint)"
    ]


def _first_event(*args: str) -> tuple[dict[str, object], str]:
    """Run ``offloadd events --json ARGS`` until its first event; (the event, its stderr)."""
    with subprocess.Popen(
        [sys.executable, "-m", "offloadd", "events", "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_clean_env(),
    ) as process:
        try:
            assert process.stdout is not None and process.stderr is not None
            line = process.stdout.readline()  # bounded by the test's timeout
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0
            stderr = process.stderr.read()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(30)
    assert line, stderr
    assert "Traceback" not in stderr
    record = json.loads(line)
    assert isinstance(record, dict)
    return record, stderr


def test_events_and_demo_ask_the_daemon_where_its_events_are(served: Served) -> None:
    served.start()
    served.wait_serving()
    events, replay = f"ipc://{served.workdir}/ev.sock", f"ipc://{served.workdir}/replay.sock"
    # Nothing listens on tcp 5557 here: the demo only sees events where the daemon says.
    demo = _offloadd("demo", "--endpoint", served.endpoint, "--phase", "store", "--json")
    assert demo.returncode == 0, demo.stderr
    summary = json.loads(demo.stdout)
    assert summary["chunks_stored"] == 64
    assert summary["events_stored"] > 0

    found = f"offloadd events: {events} (replay {replay}), from the daemon at {served.endpoint}"
    record, stderr = _first_event("--daemon", served.endpoint)
    assert record["type"] == "BlockStored" and record["replayed"] is True
    assert stderr.splitlines()[0] == found

    config = os.path.join(served.workdir, "offloadd.toml")
    with open(config, "w") as handle:
        handle.write(f'[server]\nendpoint = "{served.endpoint}"\n')
    record, stderr = _first_event("--config", config)
    assert record["type"] == "BlockStored" and record["seq"] == 0
    assert stderr.splitlines()[0] == found


def test_events_without_a_daemon_fails_clearly() -> None:
    endpoint = f"ipc:///tmp/od-nothing-{uuid.uuid4().hex[:12]}.sock"
    result = _offloadd("events", "--daemon", endpoint)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"offloadd events: no daemon answers at {endpoint}; give --daemon ENDPOINT, or "
        "--endpoint to subscribe to a publisher directly"
    ]


# --- metrics ---------------------------------------------------------------------------------


def _scrape(
    address: str, timeout: float = 10
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``{(sample name, labels): value}`` from ``/metrics``, polling until it answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
                text = response.read().decode()
            break
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline, f"no metrics at {address}"
            time.sleep(0.05)  # poll interval while the endpoint comes up
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_after_store_and_load(served: Served, ranks: list[Rank]) -> None:
    address = f"127.0.0.1:{free_port()}"
    served.start("--metrics-address", address)
    served.wait_serving()
    rank = make_rank(served.endpoint, rank=0, tp=1)
    ranks.append(rank)
    client = rank.client
    assert client is not None
    client.wait_ready(5)
    rank.fill(7)
    store = frozenset({("direction", "store"), ("engine", "engine-a"), ("dp", "0")})
    load = store - {("direction", "store")} | {("direction", "load")}
    before = _scrape(address, timeout=5)

    keys = chain_keys(4)
    client.store(1, keys, chunk_block_ids(range(4), 2))
    stored = sum(done.nbytes for done in client.wait([1], 10))
    assert client.lookup(keys).hits == 4
    client.load(2, keys, chunk_block_ids(range(4), 2, base=100))
    loaded = sum(done.nbytes for done in client.wait([2], 10))
    assert stored == loaded == 4 * 2 * 4096 * 3  # chunks x blocks x page x layers

    after = _scrape(address)
    bytes_total = "offloadd_bytes_total"
    assert after[bytes_total, store] - before.get((bytes_total, store), 0.0) == stored
    assert after[bytes_total, load] - before.get((bytes_total, load), 0.0) == loaded
    assert after["offloadd_copy_seconds_total", store] >= 0
    ok_store = frozenset({("direction", "store"), ("outcome", "ok")})
    assert after["offloadd_jobs_total", ok_store] == 1
    assert after["offloadd_lookup_keys_total", frozenset({("result", "hit")})] == 4
    assert after["offloadd_capacity_bytes", frozenset()] == 64 << 20
    assert after["offloadd_used_bytes", frozenset()] == stored
    assert after["offloadd_entries", frozenset({("state", "committed")})] == 4
    engine = frozenset({("engine", "engine-a"), ("dp", "0")})
    assert after["offloadd_engine_ready", engine] == 1
    assert after["offloadd_sessions", engine | {("role", "worker")}] == 1
    assert after["offloadd_pending_jobs", frozenset()] == 0
    assert after["offloadd_lookup_seconds_count", frozenset()] >= 1

"""Every ``offloadd_*`` series the Grafana dashboard and the alert rules query is one a real
daemon exports: ``python -m offloadd serve`` with a disk tier, fed by ``offloadd demo`` and
one undecodable request, scraped over HTTP."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy_series import (
    ROOT,
    dashboard_queries,
    rule_expressions,
    used_series,
)
from tests.ports import free_port

# Labels that Prometheus adds when it scrapes (the ServiceMonitor's relabeling), not the daemon.
SCRAPE_LABELS = {"node", "job", "instance", "namespace", "pod"}


def _env(**extra: str) -> dict[str, str]:
    skip = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM", "LISTEN_FDS")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("OFFLOADD_") and key not in skip
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@dataclass
class Daemon:
    workdir: str
    endpoint: str
    metrics: str
    arena: str
    process: subprocess.Popen[bytes]

    def log(self) -> str:
        with open(f"{self.workdir}/daemon.log", errors="replace") as log:
            return log.read()


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    workdir = tempfile.mkdtemp(prefix="od-dash-", dir="/tmp")
    arena = f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"
    endpoint, metrics = f"ipc://{workdir}/d.sock", f"127.0.0.1:{free_port()}"
    command = [
        sys.executable, "-m", "offloadd", "serve",
        "--endpoint", endpoint, "--arena", arena, "--capacity", "64MiB", "--no-persist",
        "--events-endpoint", f"ipc://{workdir}/ev.sock",
        "--events-replay-endpoint", f"ipc://{workdir}/replay.sock",
        "--metrics-address", metrics,
    ]  # fmt: skip
    # A disk tier, so that the offloadd_tier_* series have samples (tier="disk").
    env = _env(OFFLOADD_DISK__PATH=f"{workdir}/disk", OFFLOADD_DISK__CAPACITY="64MiB")
    with open(f"{workdir}/daemon.log", "ab") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=log, env=env, cwd=workdir, start_new_session=True
        )
    try:
        yield Daemon(workdir, endpoint, metrics, arena, process)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(arena)
        shutil.rmtree(workdir, ignore_errors=True)


def _scrape(daemon: Daemon, *, until: str, timeout: float = 60) -> str:
    """``/metrics`` once it answers with a line that begins with ``until`` (a pattern: a
    sample's name, or its name, labels and value) up to a word's end."""
    deadline = time.monotonic() + timeout
    while True:
        assert daemon.process.poll() is None, f"daemon exited:\n{daemon.log()}"
        try:
            with urllib.request.urlopen(f"http://{daemon.metrics}/metrics", timeout=5) as reply:
                text: str = reply.read().decode()
            if re.search(rf"^{until}\b", text, re.MULTILINE):
                return text
        except (urllib.error.URLError, ConnectionError):
            pass
        assert time.monotonic() < deadline, f"no {until} at {daemon.metrics}:\n{daemon.log()}"
        time.sleep(0.05)  # poll interval while the endpoint comes up


def _send_garbage(endpoint: str) -> None:
    """One undecodable frame: the daemon answers an Error and counts it (MALFORMED)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send(b"\xc1 not msgpack")
        assert sock.poll(10_000), "no answer to a malformed frame"
        sock.recv()
    finally:
        sock.close(linger=0)
        context.term()


# Exported by the cuda copy engine only: a cpu daemon declares it (HELP, TYPE) with no sample.
CUDA_ONLY = {"offloadd_copy_path"}
# The sample names of each kind of family in the exposition.
KIND_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


class Seen:
    """What the scrapes showed: sample names with their label sets, and declared names."""

    def __init__(self) -> None:
        self.samples: dict[str, list[dict[str, str]]] = {}
        self.declared: set[str] = set()

    def add(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            for suffix in KIND_SUFFIXES.get(family.type, ("",)):
                self.declared.add(family.name + suffix)
            for sample in family.samples:
                self.samples.setdefault(sample.name, []).append(dict(sample.labels))


def _demo_while_scraping(daemon: Daemon, seen: Seen) -> None:
    """Run the demo and scrape as it runs: the engine-labelled series (sessions, engine
    ready, bytes per engine) exist only while its engines are connected."""
    with open(f"{daemon.workdir}/demo.log", "wb") as log:
        demo = subprocess.Popen(
            [sys.executable, "-m", "offloadd", "demo", "--endpoint", daemon.endpoint],
            stdout=log, stderr=log, env=_env(), cwd=daemon.workdir,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        try:
            while demo.poll() is None:
                assert time.monotonic() < deadline, "demo did not finish"
                seen.add(_scrape(daemon, until="offloadd_uptime_seconds"))
                time.sleep(0.02)  # between scrapes
        finally:
            if demo.poll() is None:
                demo.kill()
            demo.wait(30)
    with open(f"{daemon.workdir}/demo.log", errors="replace") as log:
        assert demo.returncode == 0, log.read() + daemon.log()


def test_dashboard_and_rules_use_only_exported_series(daemon: Daemon) -> None:
    seen = Seen()
    seen.add(_scrape(daemon, until="offloadd_uptime_seconds"))
    _demo_while_scraping(daemon, seen)
    _send_garbage(daemon.endpoint)
    # Every code's series is there from the start, at 0: wait for the error to count.
    seen.add(_scrape(daemon, until=r'offloadd_protocol_errors_total\{code="MALFORMED"\} 1'))
    samples = seen.samples

    used = used_series()
    assert len(used) > 30, sorted(used)
    undeclared = sorted(used - seen.declared)
    assert not undeclared, (
        f"queried but not exported: {undeclared}; exported: {sorted(seen.declared)}"
    )
    without_samples = sorted(name for name in used - CUDA_ONLY if name not in samples)
    assert not without_samples, f"exported but never sampled here: {without_samples}"

    # Every label a query matches on an offloadd_* series is one that series carries.
    for query in dashboard_queries() + rule_expressions():
        for name, matchers in re.findall(r"\b(offloadd_[a-z_]+)\{([^}]*)\}", query):
            labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers)) - SCRAPE_LABELS
            carried = {label for sample in samples.get(name, []) for label in sample}
            assert labels <= carried or name in CUDA_ONLY, f"{name}: {labels - carried} in {query}"
    assert {"result": "hit"} in samples["offloadd_lookup_keys_total"], "the hit rate's numerator"
    assert {"code": "MALFORMED"} in samples["offloadd_protocol_errors_total"]
    assert {"tier": "disk"} in samples["offloadd_tier_healthy"]
    engines = {labels["engine"] for labels in samples["offloadd_sessions"]}
    assert len(engines) == 2, "the demo's two engines"

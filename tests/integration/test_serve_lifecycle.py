"""``offloadd serve`` as an operator runs it: what it leaves behind at exit, what a fresh
daemon's metrics already hold, and what SIGHUP does to it."""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from offloadd.client import OffloadClient
from protocol.errors import ErrorCode
from protocol.messages import REFUSAL_REASONS
from tests.deploy_series import rule_expressions
from tests.integration.harness import ServeProcess, scrape_unix


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="od-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _arena() -> str:
    return f"/dev/shm/offloadd-test-{uuid.uuid4().hex[:12]}.arena"


def _files(top: str) -> set[str]:
    """Every file under ``top`` (sockets included), relative to it."""
    return {
        os.path.relpath(os.path.join(directory, name), top)
        for directory, _dirs, names in os.walk(top)
        for name in names
    }


@pytest.mark.timeout(60)
def test_sigterm_leaves_only_the_arena_the_journal_and_its_key(workdir: str) -> None:
    serve = ServeProcess(workdir, _arena(), beside=True)  # every socket where "auto" puts it
    try:
        serve.start()
        sockets = {"d.sock", "d.sock.lock", "d.sock.peer", "d.sock.metrics"}
        sockets |= {"d.sock.events", "d.sock.replay"}
        assert sockets <= _files(workdir), "the test no longer sees every socket it means to"
        assert serve.stop(signal.SIGTERM) == 0
        assert _files(workdir) == {"state/d.journal", "state/d.journal.key"}
        assert os.path.exists(serve.arena)
    finally:
        serve.cleanup()  # and the arena


# A selector with one label matcher in an alert rule: name, label, values ("A|B" alternatives).
_SELECTOR = re.compile(r'(offloadd_\w+)\{(\w+)=~?"([^"]*)"\}')


@pytest.mark.timeout(60)
def test_a_fresh_daemon_exports_every_known_label_value_at_0(workdir: str) -> None:
    # increase() and rate() need a sample before the first event: a series born at 1 when
    # the first INTERNAL error happens makes increase() over it 0, and the alert never fires.
    serve = ServeProcess(workdir, _arena(), persist=False, beside=True)
    try:
        serve.start()
        reply = scrape_unix(serve.metrics_path)
    finally:
        serve.cleanup()
    status, _, body = reply.partition("\r\n\r\n")
    assert status.startswith("HTTP/1.0 200"), status
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }
    expected = {("offloadd_protocol_errors_total", ("code", code.name)) for code in ErrorCode}
    expected |= {("offloadd_stores_refused_keys_total", ("reason", r)) for r in REFUSAL_REASONS}
    expected |= {("offloadd_lookup_keys_total", ("result", r)) for r in ("hit", "miss")}
    for text in rule_expressions():  # and whatever the shipped alerts select by label
        for name, label, values in _SELECTOR.findall(text):
            expected |= {(name, (label, one)) for one in values.split("|") if one}
    for name, label in sorted(expected):
        assert samples.get((name, (label,))) == 0, f"{name}{{{label[0]}={label[1]!r}}}"
    for direction in ("store", "load"):
        for outcome in ("ok", "failed"):
            key = ("offloadd_jobs_total", (("direction", direction), ("outcome", outcome)))
            assert samples.get(key) == 0, key


def _log_line(serve: ServeProcess, start: str, timeout: float = 20) -> str:
    """The first line of the daemon's log that contains ``start``, once it is there."""
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in serve.log().splitlines() if start in line]
        if found:
            return found[0]
        assert serve.process is not None and serve.process.poll() is None, serve.log()
        assert time.monotonic() < deadline, f"no {start!r} in the log:\n{serve.log()}"
        time.sleep(0.02)  # poll interval


@pytest.mark.timeout(60)
def test_sighup_applies_the_files_log_level_and_keeps_serving(workdir: str) -> None:
    config = f"{workdir}/offloadd.toml"
    with open(config, "w") as handle:
        handle.write('[log]\nlevel = "WARNING"\n')
    serve = ServeProcess(workdir, _arena(), persist=False, config=config, log_level=None)
    try:
        serve.start(log=True)
        assert serve.process is not None
        with open(config, "w") as handle:
            handle.write('[log]\nlevel = "DEBUG"\n[cache]\npolicy = "arc"\n')
        serve.process.send_signal(signal.SIGHUP)
        line = _log_line(serve, "SIGHUP: read")
        assert f"SIGHUP: read {config} again: applied log.level 'WARNING' -> 'DEBUG'; " in line
        assert "until a restart: cache.policy 'lru' -> 'arc'" in line
        with OffloadClient(serve.endpoint, timeout=5, heartbeat=0) as client:
            assert client.stats().capacity_bytes == 64 << 20  # still serving
        assert serve.stop(signal.SIGTERM) == 0
        assert "SIGTERM: stopping" in serve.log()  # an INFO line: the WARNING level is gone
    finally:
        serve.cleanup()

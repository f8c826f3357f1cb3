"""Who may talk to the daemon: socket permissions and directories, CURVE on tcp, events and
metrics beside the control socket (tcp off loopback warned), engine ids and client strings
in logs."""

from __future__ import annotations

import grp
import logging
import os
import shutil
import stat
import tempfile
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq.auth

from offloadd.client import CurveKeys, OffloadClient
from offloadd.endpoint import EndpointClaim, EndpointRefused, check_tcp_security
from offloadd.errors import DaemonUnavailable, InvalidRequest
from offloadd.safety import engine_id_problem
from offloadd.server.metrics import Metrics, MetricsError
from offloadd.settings import (
    EventSettings,
    MetricsSettings,
    Settings,
    SettingsError,
    TenancySettings,
    load_settings,
)
from offloadd.shm import SharedKVTensor
from tests.integration.harness import LAYERS, DaemonThread, make_config, scrape_unix
from tests.ports import free_port


def test_ipc_socket_is_not_world_accessible(daemon: DaemonThread) -> None:
    mode = stat.S_IMODE(os.stat(daemon.endpoint[len("ipc://") :]).st_mode)
    assert mode == 0o660


def test_socket_mode_is_configurable() -> None:
    daemon = DaemonThread(socket_mode="0600").start()
    try:
        assert stat.S_IMODE(os.stat(daemon.endpoint[len("ipc://") :]).st_mode) == 0o600
    finally:
        daemon.stop()


OFF_LOOPBACK = (
    "tcp://0.0.0.0:5555",
    "tcp://10.1.2.3:5555",
    "tcp://*:5555",
    "tcp://eth0:5555",
    "tcp://localhost.example.com:5555",  # a name that merely starts like loopback
    "tcp://127.0.0.1.example.com:5555",
)
LOOPBACK = (
    "tcp://127.0.0.1:5555",
    "tcp://127.3.4.5:5555",
    "tcp://[::1]:5555",
    "tcp://localhost:5555",
)


def test_tcp_off_loopback_needs_curve_and_a_client_allow_list(keys: Path) -> None:
    secret, clients = str(keys / "server.key_secret"), str(keys / "clients")
    for endpoint in OFF_LOOPBACK:
        with pytest.raises(EndpointRefused, match="curve_secret_key_file"):
            check_tcp_security(endpoint, "")
        # CURVE alone admits any key: every host could store and load.
        with pytest.raises(EndpointRefused, match="curve_clients_dir"):
            check_tcp_security(endpoint, secret)
        check_tcp_security(endpoint, secret, clients)
    for loopback in LOOPBACK:
        check_tcp_security(loopback, "")  # tests and local tools
    check_tcp_security("ipc:///run/offloadd/offloadd.sock", "")


def test_a_curve_secret_others_can_read_is_refused(keys: Path) -> None:
    secret = keys / "server.key_secret"
    secret.chmod(0o640)
    with pytest.raises(EndpointRefused, match="chmod 600"):
        check_tcp_security("tcp://127.0.0.1:5555", str(secret))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = DaemonThread(endpoint=endpoint, curve_secret_key_file=str(secret))
    try:
        with pytest.raises(EndpointRefused, match="readable or writable by group or others"):
            daemon.start()
    finally:
        daemon.stop()


def test_a_client_allow_list_others_can_write_is_refused(keys: Path) -> None:
    (keys / "clients").chmod(0o777)
    with pytest.raises(EndpointRefused, match="curve_clients_dir"):
        check_tcp_security(
            "tcp://0.0.0.0:5555", str(keys / "server.key_secret"), str(keys / "clients")
        )


@pytest.fixture
def short_dir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="od-", dir="/tmp")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_a_socket_dir_others_can_write_is_refused(short_dir: str) -> None:
    shared = os.path.join(short_dir, "offloadd-shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)  # e.g. /tmp/offloadd-<uid> made by someone else first
    daemon = DaemonThread(endpoint=f"ipc://{shared}/d.sock")
    try:
        with pytest.raises(EndpointRefused, match=r"writable by others \(mode 0777\)"):
            daemon.start()
    finally:
        daemon.stop()
    assert os.listdir(shared) == []  # not even a lock file was made there
    os.chmod(shared, 0o770)
    with pytest.raises(EndpointRefused, match="writable by its group"):
        EndpointClaim(f"ipc://{shared}/d.sock")


def test_a_socket_dir_of_another_user_or_a_symlink_is_refused(short_dir: str) -> None:
    real = os.path.join(short_dir, "real")
    os.mkdir(real, 0o700)
    link = os.path.join(short_dir, "link")
    os.symlink(real, link)
    with pytest.raises(EndpointRefused, match="symbolic link"):
        EndpointClaim(f"ipc://{link}/d.sock")
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    os.chown(real, 65534, -1)
    with pytest.raises(EndpointRefused, match="belongs to uid 65534"):
        EndpointClaim(f"ipc://{real}/d.sock")


def test_the_default_socket_dir_is_checked_too(
    short_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = os.path.join(short_dir, "xdg")
    os.mkdir(runtime, 0o700)
    os.mkdir(os.path.join(runtime, "offloadd"), 0o777)
    os.chmod(os.path.join(runtime, "offloadd"), 0o777)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    with pytest.raises(EndpointRefused, match="offloadd is writable by others"):
        EndpointClaim(Settings().endpoint())


def test_events_ipc_sockets_get_the_control_sockets_mode_and_group() -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    daemon = DaemonThread(socket_mode="0640", socket_group=group).start()
    try:
        for endpoint in (daemon.endpoint, daemon.events_endpoint, daemon.replay_endpoint):
            info = os.stat(endpoint[len("ipc://") :])
            assert stat.S_IMODE(info.st_mode) == 0o640, endpoint
            assert info.st_gid == os.getgid()
    finally:
        daemon.stop()


def _another_group() -> int:
    """A group the socket is not created with that this process may chown to, else its own."""
    if os.geteuid() == 0:
        return next((g.gr_gid for g in grp.getgrall() if g.gr_gid != os.getgid()), os.getgid())
    return next((g for g in os.getgroups() if g != os.getgid()), os.getgid())


def test_events_sockets_may_have_a_mode_and_group_of_their_own() -> None:
    gid = _another_group()
    daemon = DaemonThread(socket_mode="0660")
    events = msgspec.structs.replace(
        daemon.settings.events, socket_mode="0600", socket_group=grp.getgrgid(gid).gr_name
    )
    daemon.settings = msgspec.structs.replace(daemon.settings, events=events)
    daemon.start()
    try:
        control = os.stat(daemon.endpoint[len("ipc://") :])
        assert (stat.S_IMODE(control.st_mode), control.st_gid) == (0o660, os.getgid())
        for endpoint in (daemon.events_endpoint, daemon.replay_endpoint):
            info = os.stat(endpoint[len("ipc://") :])
            assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o600, gid), endpoint
    finally:
        daemon.stop()


def test_metrics_on_a_unix_socket_get_the_control_sockets_mode(short_dir: str) -> None:
    path = os.path.join(short_dir, "run", "metrics.sock")
    with Metrics() as metrics:
        metrics.protocol_error("MALFORMED")
        metrics.start(f"unix:{path}", socket_mode="0600")
        assert metrics.address == f"unix:{path}"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        text = scrape_unix(path)
        assert text.startswith("HTTP/1.0 200")
        assert 'offloadd_protocol_errors_total{code="MALFORMED"} 1.0' in text
        with Metrics() as second, pytest.raises(MetricsError, match="in use"):
            second.start(f"unix:{path}")
    assert not os.path.exists(path)
    os.chmod(os.path.dirname(path), 0o777)
    with Metrics() as metrics, pytest.raises(MetricsError, match="writable by others"):
        metrics.start(f"unix:{path}")


def test_metrics_unix_addresses_are_checked() -> None:
    assert load_settings(environ={"OFFLOADD_METRICS__ADDRESS": "unix:/run/o/m.sock"})
    with pytest.raises(SettingsError, match="unix:/ABSOLUTE/PATH"):
        load_settings(environ={"OFFLOADD_METRICS__ADDRESS": "unix:relative.sock"})


@pytest.mark.parametrize(
    "engine_id",
    [str(uuid.uuid4()), f"{uuid.uuid4()}_dp3", "engine-a", "0", "org/model@pod-7:v1.2+x"],
)
def test_vllm_engine_ids_are_accepted(engine_id: str) -> None:
    assert engine_id_problem(engine_id) == ""


@pytest.mark.parametrize(
    "engine_id", ["", "a b", "x\ny", "e\x1b[31m", "é", "x" * 129, "a;rm -rf", "a\u2028b"]
)
def test_engine_ids_outside_the_safe_alphabet_are_refused_at_hello(
    daemon: DaemonThread, engine_id: str
) -> None:
    tensor = SharedKVTensor.create(16, 4096, ["layer.0"], prefix="od-test")
    try:
        config = make_config(engine_id=engine_id, tp=1, bytes_per_block=4096 * 3)
        with pytest.raises(InvalidRequest, match="letters, digits and"):
            OffloadClient.connect(daemon.endpoint, config, [tensor.region], heartbeat=0)
    finally:
        tensor.close()


def test_client_strings_are_escaped_in_the_daemons_log(
    daemon_factory: Callable[..., DaemonThread], caplog: pytest.LogCaptureFixture
) -> None:
    daemon = daemon_factory(tenancy=TenancySettings(client_topics=True))
    caplog.set_level(logging.INFO, logger="offloadd.server")
    name = "vllm\n2026-01-01 00:00:00,000 INFO offloadd.server.daemon: forged"
    topic = "kv\r\x1b[2Jtopic"
    tensors = [SharedKVTensor.create(16, 4096, [layer], prefix="od-test") for layer in LAYERS]
    try:
        config = make_config(tp=1, bytes_per_block=4096 * len(LAYERS))
        regions = [kv.region for kv in tensors]
        with OffloadClient.connect(
            daemon.endpoint, config, regions, name=name, events_topic=topic, heartbeat=0
        ):
            pass
    finally:
        for kv in tensors:
            kv.close()
    lines = [r.getMessage() for r in caplog.records if "connected" in r.getMessage()]
    assert len(lines) == 1
    assert "\n" not in lines[0] and "\r" not in lines[0] and "\x1b" not in lines[0]
    assert repr(name) in lines[0] and repr(topic) in lines[0]


def _beside_the_control_socket(daemon: DaemonThread, **metrics: str) -> DaemonThread:
    """``daemon`` with its events and metrics at their defaults ("auto")."""
    daemon.settings = msgspec.structs.replace(
        daemon.settings,
        events=EventSettings(pod="test-pod"),
        metrics=MetricsSettings(**metrics),
    )
    return daemon.start()


def test_events_and_metrics_default_to_sockets_beside_the_control_socket() -> None:
    daemon = _beside_the_control_socket(DaemonThread())
    control = daemon.endpoint[len("ipc://") :]
    try:
        # Events and replay: the control socket's mode and group (the ranks' and routers').
        for suffix in (".events", ".replay"):
            assert stat.S_IMODE(os.stat(control + suffix).st_mode) == 0o660, suffix
        # Metrics name every tenant's engines: the daemon's user (and root) only.
        metrics = control + ".metrics"
        assert stat.S_IMODE(os.stat(metrics).st_mode) == 0o600
        for target in ("/metrics", "/healthz", "/readyz"):
            assert scrape_unix(metrics, target).startswith("HTTP/1.0 200"), target
        assert "offloadd_build_info" in scrape_unix(metrics, "/metrics")
        with OffloadClient(daemon.endpoint, heartbeat=0) as client:
            stats = client.stats()
        assert stats.events_endpoint == f"ipc://{control}.events"
        assert stats.events_replay_endpoint == f"ipc://{control}.replay"
    finally:
        daemon.stop()


def test_a_metrics_socket_group_may_be_given() -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    daemon = _beside_the_control_socket(DaemonThread(), socket_mode="0640", socket_group=group)
    try:
        info = os.stat(daemon.endpoint[len("ipc://") :] + ".metrics")
        assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o640, os.getgid())
    finally:
        daemon.stop()


def test_events_and_metrics_off_loopback_are_logged_as_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    daemon = DaemonThread()
    events = EventSettings(endpoint="tcp://0.0.0.0:*", replay_endpoint="", pod="test-pod")
    daemon.settings = msgspec.structs.replace(
        daemon.settings, events=events, metrics=MetricsSettings(address="0.0.0.0:0")
    )
    caplog.set_level(logging.WARNING, logger="offloadd")
    daemon.start()
    try:
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("events.endpoint tcp://0.0.0.0:*" in line for line in warned), warned
        assert any("metrics on 0.0.0.0:0 are reachable" in line for line in warned), warned
        # Still served: the operator asked for it (Kubernetes' Prometheus scrapes the pod).
        assert daemon.daemon is not None
        port = daemon.daemon.metrics.address.rpartition(":")[2]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            assert answer.status == 200
    finally:
        daemon.stop()
    caplog.clear()
    on_loopback = DaemonThread()
    on_loopback.settings = msgspec.structs.replace(
        on_loopback.settings, metrics=MetricsSettings(address="127.0.0.1:0")
    )
    on_loopback.start()
    on_loopback.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def keys() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="od-keys-") as directory:
        root = Path(directory)
        (root / "clients").mkdir()
        zmq.auth.create_certificates(str(root), "server")
        zmq.auth.create_certificates(str(root), "allowed")
        zmq.auth.create_certificates(str(root), "stranger")
        (root / "allowed.key").rename(root / "clients" / "allowed.key")
        for secret in root.glob("*.key_secret"):
            secret.chmod(0o600)  # zmq.auth writes them as the umask allows; the daemon refuses that
        yield root


def test_curve_admits_only_listed_clients(keys: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = DaemonThread(
        endpoint=endpoint,
        curve_secret_key_file=str(keys / "server.key_secret"),
        curve_clients_dir=str(keys / "clients"),
    ).start()
    try:
        allowed = CurveKeys.load(str(keys / "server.key"), str(keys / "allowed.key_secret"))
        with OffloadClient(endpoint, curve=allowed, heartbeat=0) as client:
            assert client.stats().sessions == 0
        stranger = CurveKeys.load(str(keys / "server.key"), str(keys / "stranger.key_secret"))
        for curve in (stranger, None):
            with (
                OffloadClient(endpoint, curve=curve, timeout=1.0, heartbeat=0) as client,
                pytest.raises(DaemonUnavailable),
            ):
                client.stats()
    finally:
        daemon.stop()

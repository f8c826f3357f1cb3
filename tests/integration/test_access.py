"""Who may talk to the daemon: socket permissions, CURVE on tcp, loopback events."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from offloadd.client import CurveKeys, OffloadClient
from offloadd.endpoint import EndpointRefused, check_tcp_security
from offloadd.errors import DaemonUnavailable
from offloadd.settings import EventSettings
from tests.integration.harness import DaemonThread


def test_ipc_socket_is_not_world_accessible(daemon: DaemonThread) -> None:
    mode = stat.S_IMODE(os.stat(daemon.endpoint[len("ipc://") :]).st_mode)
    assert mode == 0o660


def test_socket_mode_is_configurable() -> None:
    daemon = DaemonThread(socket_mode="0600").start()
    try:
        assert stat.S_IMODE(os.stat(daemon.endpoint[len("ipc://") :]).st_mode) == 0o600
    finally:
        daemon.stop()


def test_tcp_off_loopback_needs_curve() -> None:
    with pytest.raises(EndpointRefused, match="curve_secret_key_file"):
        check_tcp_security("tcp://0.0.0.0:5555", "")
    with pytest.raises(EndpointRefused):
        check_tcp_security("tcp://10.1.2.3:5555", "")
    check_tcp_security("tcp://127.0.0.1:5555", "")  # loopback: tests and local tools
    check_tcp_security("tcp://0.0.0.0:5555", "/etc/offloadd/server.key_secret")
    check_tcp_security("ipc:///run/offloadd/offloadd.sock", "")


def test_events_bind_loopback_by_default() -> None:
    settings = EventSettings()
    assert settings.endpoint.startswith("tcp://127.0.0.1:")
    assert settings.replay_endpoint.startswith("tcp://127.0.0.1:")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def keys() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="od-keys-") as directory:
        root = Path(directory)
        (root / "clients").mkdir()
        zmq.auth.create_certificates(str(root), "server")
        zmq.auth.create_certificates(str(root), "allowed")
        zmq.auth.create_certificates(str(root), "stranger")
        (root / "allowed.key").rename(root / "clients" / "allowed.key")
        yield root


def test_curve_admits_only_listed_clients(keys: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
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

"""The cluster tier's Mooncake Store client: imported, checked and set up.

``open_client`` imports the ``mooncake`` package on demand (the daemon runs without the
extra), checks that the master's and the metadata server's ports accept a connection
(Mooncake's ``setup`` against a dead master blocks about 90 s before it fails), then sets up
the client (its transfer engine, over tcp or rdma) to contribute ``segment`` bytes of host
memory to the cluster pool. ``offloadd.tiers.mooncake`` is the tier that drives it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket
import urllib.parse
from typing import Any

from offloadd.settings import MooncakeSettings

__all__ = ["INSTALL_HINT", "MooncakeUnavailable", "default_metadata", "open_client"]

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT = 2.0
INSTALL_HINT = (
    "install the extra: pip install 'offloadd[mooncake]' "
    "(and the system library libibverbs1: apt-get install libibverbs1)"
)


class MooncakeUnavailable(Exception):
    """The cluster tier cannot open: the package is missing, or the master does not answer."""


def _load_store_class() -> Any:
    # Mooncake logs (glog) every connection at INFO to stderr; warnings and errors are
    # enough in a daemon's log unless the operator asks for more.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:  # imported here: the daemon runs without the extra
        store = importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise MooncakeUnavailable(f"mooncake is not importable ({exc}); {INSTALL_HINT}") from exc
    return store.MooncakeDistributedStore


def _host_port(address: str, default_port: int) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host:
        return address, default_port
    return host.strip("[]"), int(port)


def _check_listening(what: str, host: str, port: int) -> None:
    try:
        with socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT):
            pass
    except OSError as exc:
        raise MooncakeUnavailable(f"mooncake {what} {host}:{port} does not answer: {exc}") from exc


def default_metadata(master: str) -> str:
    """The metadata server a master with ``--enable_http_metadata_server`` serves."""
    host, _ = _host_port(master, 50051)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:8080/metadata"


def open_client(settings: MooncakeSettings) -> Any:
    """A set-up ``MooncakeDistributedStore`` contributing ``settings.segment`` bytes."""
    if not settings.master:
        raise MooncakeUnavailable("[mooncake] master is empty: the cluster tier is off")
    store_class = _load_store_class()
    metadata = settings.metadata or default_metadata(settings.master)
    # setup() against a master that is not there blocks about 90 s before it fails.
    _check_listening("master", *_host_port(settings.master, 50051))
    parsed = urllib.parse.urlsplit(metadata)
    if parsed.scheme == "http" and parsed.hostname:
        _check_listening("metadata server", parsed.hostname, parsed.port or 80)
    client = store_class()
    hostname = settings.local_hostname or socket.gethostname()
    code = client.setup(
        hostname,
        metadata,
        settings.segment,
        settings.local_buffer,
        settings.protocol,
        settings.rdma_devices,
        settings.master,
    )
    if code != 0:
        with contextlib.suppress(Exception):
            client.close()
        raise MooncakeUnavailable(
            f"mooncake setup failed with code {code} (master {settings.master}, "
            f"metadata {metadata}, local_hostname {hostname})"
        )
    logger.info(
        "mooncake tier: master %s, metadata %s, %s as %s, contributing %d bytes",
        settings.master,
        metadata,
        settings.protocol,
        hostname,
        settings.segment,
    )
    return client

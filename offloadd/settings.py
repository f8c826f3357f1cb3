"""Daemon settings: typed structs with defaults that work with no file at all.

Empty strings mean "derive a default": the control socket goes in the runtime directory
(``$RUNTIME_DIRECTORY`` under systemd, else ``$XDG_RUNTIME_DIR/offloadd``, else
``/tmp/offloadd-<uid>``) and the arena in ``/dev/shm``.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Literal

import msgspec


class ServerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The control socket and request limits."""

    endpoint: str = ""
    max_frame_bytes: int = 16 << 20
    shm_dirs: tuple[str, ...] = ("/dev/shm",)
    drain_seconds: float = 10.0
    recent_jobs: int = 4096  # finished jobs remembered per session for Wait
    # A session whose process the daemon cannot watch (pidfd) is reaped after this long
    # without any message; clients send heartbeats well within it.
    session_timeout: float = 30.0


class CacheSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The host chunk cache."""

    arena: str = ""
    capacity: int = 1 << 30
    policy: Literal["lru", "arc"] = "lru"
    pin_lease_seconds: float = 30.0
    # Keep the arena and a commit journal (<arena>.journal) across restarts, so a restarted
    # daemon serves what was committed before. False: both are removed at exit.
    persist: bool = True


class LogSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Logging."""

    level: str = "INFO"


class EventSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """KV-cache events: vLLM-compatible PUB socket and replay ROUTER.

    Loopback by default; listening on another address is an explicit setting.
    """

    enabled: bool = True
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str = "tcp://127.0.0.1:5558"  # "" disables replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark, in batches
    max_queue: int = 100_000  # batches waiting to be sent; more are dropped and counted
    topic_template: str = "kv@{pod}@{model}"  # placeholders: {pod} {model} {engine_id} {dp}
    pod: str = ""  # empty: the host name
    # vLLM's convention: the engine with dp index k publishes on endpoint port + k (and
    # replay port + k); otherwise one publisher serves every dp index.
    port_per_dp: bool = False

    def pod_name(self) -> str:
        """The ``{pod}`` of topics, defaulted to the host name."""
        return self.pod or socket.gethostname()


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the daemon reads at start."""

    server: ServerSettings = ServerSettings()
    cache: CacheSettings = CacheSettings()
    log: LogSettings = LogSettings()
    events: EventSettings = EventSettings()

    def endpoint(self) -> str:
        """The control endpoint, defaulted."""
        return self.server.endpoint or default_endpoint()

    def arena_path(self) -> str:
        """The arena file, defaulted."""
        return self.cache.arena or f"/dev/shm/offloadd-{os.getuid()}.arena"


def runtime_dir() -> str:
    """Where the control socket lives when no endpoint is given."""
    systemd_dir = os.environ.get("RUNTIME_DIRECTORY")
    if systemd_dir:
        return systemd_dir.split(":")[0]
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "offloadd")
    return f"/tmp/offloadd-{os.getuid()}"


def default_endpoint() -> str:
    """``ipc://<runtime dir>/offloadd.sock``."""
    return f"ipc://{os.path.join(runtime_dir(), 'offloadd.sock')}"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"8GiB"`` -> bytes. Binary units (K, KiB, KB all mean 1024); a bare number is bytes."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (try 512MiB or 8GiB)")
    unit = (match.group(2) or "").upper()[:1]
    if unit == "B":
        unit = ""
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(nbytes: int) -> str:
    """Bytes -> the largest binary unit that keeps it readable (``1.5GiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"

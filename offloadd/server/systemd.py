"""sd_notify without libsystemd: datagrams to ``$NOTIFY_SOCKET``.

The protocol is newline-separated ``KEY=value`` lines in one AF_UNIX datagram (sd_notify(3));
a socket name starting with ``@`` lives in the abstract namespace. Without ``NOTIFY_SOCKET``
(not under systemd) every call is a no-op, so the daemon calls it unconditionally.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

logger = logging.getLogger(__name__)


class Notifier:
    """Sends READY/STATUS/WATCHDOG/STOPPING/EXTEND_TIMEOUT_USEC to systemd."""

    def __init__(self, address: str | None = None, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        raw = address if address is not None else env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + raw[1:] if raw.startswith("@") else raw
        self._sock: socket.socket | None = None
        self._watchdog = _watchdog_seconds(env)
        self._warned = False

    @property
    def enabled(self) -> bool:
        """Whether a notify socket is configured."""
        return bool(self._address)

    @property
    def watchdog_seconds(self) -> float | None:
        """``WatchdogSec`` of this service (for us: WATCHDOG_PID unset or ours), else None."""
        return self._watchdog

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (``send(READY=1, STATUS="serving")``); False if not sent."""
        if not self._address:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message, self._address)
        except OSError as exc:
            if not self._warned:  # systemd gone or socket wrong: say so once, keep serving
                logger.warning("sd_notify to %r failed: %s", self._address, exc)
                self._warned = True
            return False
        return True

    def ready(self, status: str) -> None:
        """READY=1 with a status line."""
        self.send(READY=1, STATUS=status)

    def status(self, status: str) -> None:
        """A STATUS= line (shown by ``systemctl status``)."""
        self.send(STATUS=status)

    def extend_timeout(self, seconds: float) -> None:
        """Ask for more start/stop time while a long step (pre-faulting) runs."""
        self.send(EXTEND_TIMEOUT_USEC=int(seconds * 1_000_000))

    def watchdog(self) -> None:
        """WATCHDOG=1: the event loop is alive."""
        self.send(WATCHDOG=1)

    async def keep_alive(self, interval: float) -> None:
        """Ping the watchdog every ``interval / 2`` until cancelled. Run on the event loop
        itself, so a wedged loop stops the pings and systemd restarts the daemon."""
        while True:
            self.watchdog()
            await asyncio.sleep(interval / 2)

    def stopping(self, status: str = "stopping") -> None:
        """STOPPING=1."""
        self.send(STOPPING=1, STATUS=status)

    def close(self) -> None:
        """Close the datagram socket. Idempotent."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_seconds(env: dict[str, str] | os._Environ[str]) -> float | None:
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1_000_000 if value > 0 else None

"""Logging shared by the daemon and the libraries: formatters that no client string can
forge a line through, the handler the daemon installs, and a rate limiter for repeated lines.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import IO

from offloadd.safety import printable

# syslog priorities, which journald reads from a "<N>" line prefix (sd-daemon(3)).
_PRIORITIES = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


class EscapingFormatter(logging.Formatter):
    """Control characters and line breaks in a message are escaped as ``repr`` would: a
    string a client sent can never forge or split a log line (tracebacks keep their lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The message line, escaped."""
        record.message = printable(record.message)
        return super().formatMessage(record)


class JournalFormatter(EscapingFormatter):
    """``<priority>logger: message``, every line of a traceback prefixed alike."""

    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        """The record as journal lines."""
        priority = next(
            (p for level, p in sorted(_PRIORITIES.items()) if record.levelno <= level), 2
        )
        text = super().format(record)
        return "\n".join(f"<{priority}>{line}" for line in text.splitlines())


class _Handler(logging.StreamHandler[IO[str]]):
    """The handler ``configure_logging`` installs (so a second call can replace it)."""


PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class LogLimiter:
    """Logs a repeated message at most once per ``interval`` seconds, counting the rest."""

    def __init__(self, log: logging.Logger, interval: float = 10.0) -> None:
        self._log = log
        self._interval = interval
        self._last = -float("inf")
        self._suppressed = 0

    def __call__(self, level: int, msg: str, *args: object, exc_info: bool = False) -> None:
        """Log ``msg % args`` at ``level`` unless one was logged less than interval ago."""
        now = time.monotonic()
        if now - self._last < self._interval:
            self._suppressed += 1
            return
        if self._suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, self._suppressed)
        self._last = now
        self._suppressed = 0
        self._log.log(level, msg, *args, exc_info=exc_info)


def install_log_handler(
    level: str,
    kind: str,
    *,
    stream: IO[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> logging.Handler:
    """Send every logger's records at ``level`` and above to ``stream`` (stderr), formatted
    as ``kind`` says (``plain``, ``journal``, or ``auto``: journal under systemd).

    Calling it again replaces the handler it installed before; other handlers stay.
    """
    env = os.environ if environ is None else environ
    if kind == "auto":
        kind = "journal" if env.get("JOURNAL_STREAM") else "plain"
    handler = _Handler(stream or sys.stderr)
    handler.setFormatter(
        JournalFormatter() if kind == "journal" else EscapingFormatter(PLAIN_FORMAT)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        if isinstance(old, _Handler):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler

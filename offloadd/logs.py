"""Logging shared by the daemon and the libraries: formatters that no client string can
forge a line through, the handler the daemon installs, and a rate limiter for repeated lines.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
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


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log pipelines (Kubernetes): ``time`` (RFC 3339, UTC),
    ``level``, ``logger``, ``message``, and ``exc_info`` (the traceback) when there is one.
    JSON escapes every line break and control character, so no client string can split or
    forge a line."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        moment = datetime.fromtimestamp(record.created, UTC)
        line: dict[str, str] = {
            "time": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line["exc_info"] = record.exc_text
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        # ASCII only: U+2028 and the like, which some readers split lines at, are escaped too.
        return json.dumps(line)


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


class PerUidLog:
    """Lines a client's requests cause, limited per uid: each uid may have ``burst`` lines
    logged back to back, then one more per ``interval`` seconds (a token bucket each), so
    one user's flood neither fills the journal nor hides another user's lines. The lines
    held back are counted and their number said with that uid's next line. At most
    ``uids`` uids are remembered, the least recently heard from forgotten first."""

    def __init__(
        self,
        log: logging.Logger,
        *,
        burst: int = 64,
        interval: float = 1.0,
        uids: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._burst = burst
        self._interval = interval
        self._most = uids
        self._clock = clock
        self._buckets: OrderedDict[int, list[float]] = OrderedDict()  # uid: [tokens, at, held]

    def __call__(
        self, uid: int, level: int, msg: str, *args: object, exc_info: bool = False
    ) -> bool:
        """Log ``msg % args`` at ``level`` for ``uid`` unless its lines are held back (then
        False, and it is counted)."""
        if not self._log.isEnabledFor(level):
            return False
        now = self._clock()
        bucket = self._buckets.pop(uid, None)
        if bucket is None:
            bucket = [float(self._burst), now, 0.0]
            while len(self._buckets) >= self._most:
                self._buckets.popitem(last=False)
        self._buckets[uid] = bucket
        tokens = min(float(self._burst), bucket[0] + (now - bucket[1]) / self._interval)
        bucket[1] = now
        if tokens < 1.0:
            bucket[0] = tokens
            bucket[2] += 1
            return False
        bucket[0] = tokens - 1.0
        if bucket[2]:
            msg += " (%d more lines of uid %d held back)"
            args = (*args, int(bucket[2]), uid)
            bucket[2] = 0
        self._log.log(level, msg, *args, exc_info=exc_info)
        return True


def install_log_handler(
    level: str,
    kind: str,
    *,
    stream: IO[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> logging.Handler:
    """Send every logger's records at ``level`` and above to ``stream`` (stderr), formatted
    as ``kind`` says (``plain``, ``journal``, ``json``: one JSON object per line, or
    ``auto``: journal under systemd, else plain).

    Calling it again replaces the handler it installed before; other handlers stay.
    """
    env = os.environ if environ is None else environ
    if kind == "auto":
        kind = "journal" if env.get("JOURNAL_STREAM") else "plain"
    handler = _Handler(stream or sys.stderr)
    formatter: logging.Formatter
    if kind == "journal":
        formatter = JournalFormatter()
    elif kind == "json":
        formatter = JsonFormatter()
    else:
        formatter = EscapingFormatter(PLAIN_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        if isinstance(old, _Handler):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler

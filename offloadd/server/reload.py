"""What SIGHUP does to ``offloadd serve``: read the settings again and apply what can change
while serving; it never stops the daemon.

Contract of ``Reloader`` (the event loop's thread only):
- ``Reloader(settings, load, source=...)``: ``settings`` as the daemon loaded them at start
  (before ``"auto"`` endpoints were placed), ``load()`` loads them again as at start (the
  ``--config`` file ``source``, the environment, the flags) or raises ``SettingsError``.
- ``install()``: take SIGHUP through the running loop's ``add_signal_handler``.
- ``reload()``: load; apply the settings in ``LIVE`` (the log's level and format) that
  changed; log one line that says what was read, what it changed, and which changed settings
  wait for a restart (they are not applied: the running daemon goes on with what it started
  with, and the next reload names them again). Settings that do not load
  change nothing and are logged as an error. Under systemd it says RELOADING=1, then
  READY=1.

``changes(old, new)`` is the pure part: every setting that differs, in order.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec

from offloadd.server.systemd import Notifier
from offloadd.settings import (
    SETTINGS_SECTIONS,
    LogSettings,
    Settings,
    SettingsError,
    configure_logging,
)

__all__ = ["LIVE", "Reloader", "changes"]

logger = logging.getLogger(__name__)

# (section, key) of the settings a reload applies; every other one needs a restart.
LIVE = frozenset({("log", "level"), ("log", "format")})


def changes(old: Settings, new: Settings) -> list[tuple[str, str, Any, Any]]:
    """``(section, key, old value, new value)`` of every setting that differs."""
    found = []
    for section in SETTINGS_SECTIONS:
        before, after = getattr(old, section), getattr(new, section)
        for key in before.__struct_fields__:
            if getattr(before, key) != getattr(after, key):
                found.append((section, key, getattr(before, key), getattr(after, key)))
    return found


class Reloader:
    """Reloads the settings on SIGHUP; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        load: Callable[[], Settings] | None,
        *,
        source: str = "",
        apply_log: Callable[[LogSettings], object] = configure_logging,
        notifier: Notifier | None = None,
    ) -> None:
        self.settings = settings
        self._load = load
        self._source = source
        self._apply_log = apply_log
        self._notify = notifier or Notifier()

    def install(self) -> None:
        """Handle SIGHUP on the running loop (until it closes, which removes its handlers)."""
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)

    def reload(self) -> None:
        """Read the settings again and apply the live ones (see the module docstring)."""
        if self._load is None or not self._source:
            logger.info("SIGHUP: no settings file to read again (started without --config)")
            return
        self._notify.send(RELOADING=1, MONOTONIC_USEC=time.monotonic_ns() // 1000)
        try:
            self._reload(self._load)
        finally:
            self._notify.send(READY=1)

    def _reload(self, load: Callable[[], Settings]) -> None:
        try:
            new = load()
        except SettingsError as exc:
            logger.error("SIGHUP: %s not reloaded, nothing changed: %s", self._source, exc)
            return
        found = changes(self.settings, new)
        live = [change for change in found if change[:2] in LIVE]
        waiting = [change for change in found if change[:2] not in LIVE]
        said = []
        if live:
            said.append("applied " + _describe(live))
        if waiting:
            said.append("changed, but the daemon goes on without them until a restart: ")
            said[-1] += _describe(waiting)
        # The line goes out under whichever log level lets more through, the old or the new.
        louder = bool(live) and _threshold(new.log) < _threshold(self.settings.log)
        if louder:
            self._apply_log(new.log)
        logger.log(
            logging.WARNING if waiting else logging.INFO,
            "SIGHUP: read %s again: %s",
            self._source,
            "; ".join(said) or "nothing changed",
        )
        if live and not louder:
            self._apply_log(new.log)
        self.settings = _with_live(self.settings, new)  # what runs now: compared next time


def _with_live(running: Settings, new: Settings) -> Settings:
    """``running`` with the ``LIVE`` settings of ``new``."""
    for section, key in LIVE:
        part = msgspec.structs.replace(
            getattr(running, section), **{key: getattr(getattr(new, section), key)}
        )
        running = msgspec.structs.replace(running, **{section: part})
    return running


def _threshold(log: LogSettings) -> int:
    return logging.getLevelNamesMapping()[log.level.upper()]


def _describe(changed: list[tuple[str, str, Any, Any]]) -> str:
    return ", ".join(f"{section}.{key} {old!r} -> {new!r}" for section, key, old, new in changed)

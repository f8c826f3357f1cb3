"""offloadd.server.reload: what a SIGHUP applies, what it says, and what it leaves alone."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import msgspec
import pytest

from offloadd.server.reload import Reloader, changes
from offloadd.server.systemd import Notifier
from offloadd.settings import CacheSettings, LogSettings, Settings, SettingsError

START = Settings(log=LogSettings(level="WARNING"), cache=CacheSettings(capacity=1 << 30))


def with_(settings: Settings, **sections: dict[str, object]) -> Settings:
    for section, values in sections.items():
        part = msgspec.structs.replace(getattr(settings, section), **values)
        settings = msgspec.structs.replace(settings, **{section: part})
    return settings


class Loads:
    """What the file says now, and the log settings applied so far."""

    def __init__(self, settings: Settings | SettingsError) -> None:
        self.now = settings
        self.applied: list[LogSettings] = []

    def load(self) -> Settings:
        if isinstance(self.now, SettingsError):
            raise self.now
        return self.now

    def reloader(self) -> Reloader:
        return Reloader(
            START,
            self.load,
            source="/etc/offloadd/offloadd.toml",
            apply_log=self.applied.append,
            notifier=Notifier(address="", environ={}),
        )


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name.endswith("reload")]


def test_changes_lists_every_setting_that_differs_in_order() -> None:
    new = with_(START, cache={"policy": "arc", "capacity": 2 << 30}, log={"level": "DEBUG"})
    assert changes(START, new) == [
        ("cache", "capacity", 1 << 30, 2 << 30),
        ("cache", "policy", "lru", "arc"),
        ("log", "level", "WARNING", "DEBUG"),
    ]
    assert changes(START, START) == []


def test_a_new_log_level_is_applied_and_said(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    loads = Loads(with_(START, log={"level": "DEBUG"}))
    loads.reloader().reload()
    assert loads.applied == [LogSettings(level="DEBUG")]
    assert lines(caplog) == [
        (
            logging.INFO,
            "SIGHUP: read /etc/offloadd/offloadd.toml again: applied log.level 'WARNING' -> "
            "'DEBUG'",
        )
    ]


def test_settings_that_need_a_restart_are_named_not_applied(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    loads = Loads(with_(START, cache={"capacity": 2 << 30}, log={"format": "json"}))
    reloader = loads.reloader()
    reloader.reload()
    assert loads.applied == [LogSettings(level="WARNING", format="json")]
    expected = (
        logging.WARNING,
        "SIGHUP: read /etc/offloadd/offloadd.toml again: applied log.format 'auto' -> 'json'; "
        "changed, but the daemon goes on without them until a restart: cache.capacity "
        "1073741824 -> 2147483648",
    )
    assert lines(caplog) == [expected]
    # The daemon still runs the old capacity: the next reload says so again.
    caplog.clear()
    reloader.reload()
    assert lines(caplog) == [
        (
            logging.WARNING,
            "SIGHUP: read /etc/offloadd/offloadd.toml again: changed, but the daemon goes on "
            "without them until a restart: cache.capacity 1073741824 -> 2147483648",
        )
    ]
    assert len(loads.applied) == 1


def test_nothing_changed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    loads = Loads(START)
    loads.reloader().reload()
    assert loads.applied == []
    assert lines(caplog) == [
        (logging.INFO, "SIGHUP: read /etc/offloadd/offloadd.toml again: nothing changed")
    ]


def test_a_file_that_no_longer_loads_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    loads = Loads(SettingsError("log.level: expected one of CRITICAL, ... got 'LOUD'"))
    loads.reloader().reload()
    assert loads.applied == []
    assert lines(caplog) == [
        (
            logging.ERROR,
            "SIGHUP: /etc/offloadd/offloadd.toml not reloaded, nothing changed: log.level: "
            "expected one of CRITICAL, ... got 'LOUD'",
        )
    ]


def test_without_a_file_there_is_nothing_to_read(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    applied: list[LogSettings] = []
    Reloader(START, None, apply_log=applied.append, notifier=Notifier(address="")).reload()
    assert applied == []
    assert lines(caplog) == [
        (logging.INFO, "SIGHUP: no settings file to read again (started without --config)")
    ]


def test_the_line_goes_out_before_a_quieter_level_takes_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # INFO -> ERROR: said at INFO while INFO still shows, then applied.
    order: list[str] = []
    caplog.set_level(logging.DEBUG)
    start = with_(START, log={"level": "INFO"})
    reloader = Reloader(
        start,
        lambda: with_(start, log={"level": "ERROR"}),
        source="f.toml",
        apply_log=lambda log: order.append(f"applied {log.level}"),
        notifier=Notifier(address=""),
    )

    def logged(record: logging.LogRecord) -> bool:
        order.append("logged")
        return True

    log = logging.getLogger("offloadd.server.reload")
    log.addFilter(logged)
    try:
        reloader.reload()
    finally:
        log.removeFilter(logged)
    assert order == ["logged", "applied ERROR"]


def test_systemd_sees_the_reload_begin_and_end(tmp_path: Path) -> None:
    # Type=notify with ExecReload=: RELOADING=1 (with the monotonic time systemd asks for),
    # then READY=1 once the settings are applied.
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(tmp_path / "notify"))
        systemd.settimeout(5)
        notifier = Notifier(address=str(tmp_path / "notify"), environ={})
        loads = Loads(with_(START, log={"level": "DEBUG"}))
        reloader = Reloader(
            START, loads.load, source="f.toml", apply_log=loads.applied.append, notifier=notifier
        )
        reloader.reload()
        notifier.close()
        begun, ended = systemd.recv(4096).decode(), systemd.recv(4096).decode()
    assert begun.startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert int(begun.rpartition("=")[2]) > 0
    assert ended == "READY=1"

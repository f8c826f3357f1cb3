"""``offloadd status`` lines from a DaemonStats (no daemon needed)."""

from __future__ import annotations

from offloadd.status import describe
from protocol.messages import DaemonStats


def _stats(**fields: object) -> DaemonStats:
    base: dict[str, object] = {
        "uptime_seconds": 61.0,
        "capacity_bytes": 1 << 30,
        "used_bytes": 1 << 29,
        "entries": 3,
        "committed_entries": 2,
        "lookups": 4,
        "hits": 3,
        "misses": 1,
        "stores_refused": 0,
        "evictions": 0,
        "bytes_stored": 0,
        "bytes_loaded": 0,
        "protocol_errors": 0,
        "sessions": 0,
        "engines": [],
    }
    base.update(fields)
    return DaemonStats(**base)  # type: ignore[arg-type]


def test_status_shows_where_events_are_published() -> None:
    lines = describe(
        _stats(events_endpoint="tcp://127.0.0.1:5557", events_replay_endpoint=""), "ipc:///x"
    )
    assert "  events     tcp://127.0.0.1:5557 (replay none)" in lines
    assert lines[0] == "offloadd at ipc:///x: up 1m 1s"


def test_status_says_events_are_off() -> None:
    assert "  events     off" in describe(_stats(), "ipc:///x")

"""``offloadd status`` lines from a DaemonStats (no daemon needed)."""

from __future__ import annotations

from offloadd.status import describe
from protocol.messages import DaemonStats, TierState


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


def test_status_shows_each_tier_and_nothing_without_tiers() -> None:
    assert not any("disk" in line for line in describe(_stats(), "ipc:///x"))
    disk = TierState(
        "disk", 4 << 30, 1 << 30, 12, hits=5, promotions=4, promotion_failures=1,
        demotions=12, demotions_skipped=2, bytes_read=2_000_000_000, read_seconds=1.0,
    )  # fmt: skip
    cluster = TierState("mooncake", 1 << 30, 0, 0, healthy=False, errors=3)
    lines = describe(_stats(tiers=[disk, cluster]), "ipc:///x")
    text = "\n".join(lines)
    assert "  disk       1.0GiB of 4.0GiB (25.0%); 12 chunks" in text
    assert "promoted 4 chunks (1 failed verification, read 2.00 GB/s)" in text
    assert "written 12 chunks, skipped 2 (gone before their turn); 0B queued;" in text
    assert "  mooncake   UNREACHABLE; " in text and "3 errors" in text


def test_status_names_the_daemon_its_arena_and_copy_engine() -> None:
    stats = _stats(version="0.1.0", pid=4242, arena="/dev/shm/a.arena", copy_engine="cpu")
    lines = describe(stats, "ipc:///x")
    assert lines[1] == "  daemon     version 0.1.0, pid 4242, copy engine cpu"
    assert lines[2] == "  arena      /dev/shm/a.arena"
    assert (
        describe(_stats(), "ipc:///x")[1]
        == "  daemon     version unknown, pid unknown, copy engine unknown"
    )


def test_status_says_when_the_node_wide_counters_are_withheld() -> None:
    shown = describe(_stats(), "ipc:///x")
    assert any(line.startswith("  lookups    4 requests") for line in shown)
    tier = TierState("disk", 1 << 30, 0, 0, True)
    lines = describe(_stats(used_bytes=0, lookups=0, counters=False, tiers=[tier]), "ipc:///x")
    assert "  cache      1.0GiB; node-wide counters shown to root and the daemon's user only" in (
        lines
    )
    # Zeros that only mean "not yours to see" are not printed as counts.
    assert not [line for line in lines if line.startswith(("  lookups", "  sessions", "  disk"))]


def test_status_shows_waiting_stores_and_dropped_mirrors_only_when_there_are_some() -> None:
    assert not any(line.startswith("  mirrors") for line in describe(_stats(), "ipc:///x"))
    lines = describe(_stats(stores_waiting=3, mirrors_dropped=1), "ipc:///x")
    assert (
        "  mirrors    3 stores waiting for room a mirror must free; 1 dropped for not "
        "acknowledging removals in time (server.mirror_ack_timeout)"
    ) in lines
    assert "  mirrors    1 dropped" in "\n".join(describe(_stats(mirrors_dropped=1), "ipc:///x"))

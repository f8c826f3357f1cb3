"""``offloadd status``: ask a running daemon for its stats and print them for people (or JSON)."""

from __future__ import annotations

import sys
from typing import TextIO

import msgspec

from offloadd.client import OffloadClient
from offloadd.errors import DaemonUnavailable, OffloaddError
from offloadd.settings import format_size
from protocol.messages import DaemonStats, EngineState


def fetch_stats(endpoint: str, timeout: float = 3.0) -> DaemonStats:
    """GetStats from the daemon at ``endpoint`` (no Hello needed); raises DaemonUnavailable."""
    with OffloadClient(endpoint, timeout=timeout, heartbeat=0) as client:
        return client.stats()


def main(
    endpoint: str,
    *,
    as_json: bool = False,
    timeout: float = 3.0,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Print the daemon's state; 1 with a message on ``err`` when no daemon answers."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        stats = fetch_stats(endpoint, timeout)
    except DaemonUnavailable:
        print(
            f"offloadd status: no daemon answers at {endpoint} "
            "(is it running? see systemctl status offloadd)",
            file=err,
        )
        return 1
    except OffloaddError as exc:  # it answered, but not with stats
        print(f"offloadd status: {endpoint}: {exc}", file=err)
        return 1
    if as_json:
        out.write(msgspec.json.format(msgspec.json.encode(stats), indent=2).decode() + "\n")
    else:
        out.write("\n".join(describe(stats, endpoint)) + "\n")
    return 0


def describe(stats: DaemonStats, endpoint: str) -> list[str]:
    """The stats as lines for a terminal."""
    fill = stats.used_bytes / stats.capacity_bytes if stats.capacity_bytes else 0.0
    keys = stats.hits + stats.misses
    hit_rate = f" ({stats.hits / keys:.1%} hit)" if keys else ""
    pending = stats.entries - stats.committed_entries
    lines = [
        f"offloadd at {endpoint}: up {_duration(stats.uptime_seconds)}",
        f"  daemon     version {stats.version or 'unknown'}, pid {stats.pid or 'unknown'}, "
        f"copy engine {stats.copy_engine or 'unknown'}",
        f"  arena      {stats.arena or 'unknown'}",
        *(
            [
                f"  cache      {format_size(stats.used_bytes)} of "
                f"{format_size(stats.capacity_bytes)} ({fill:.1%}); "
                f"{stats.committed_entries} chunks, {pending} being stored",
                f"  lookups    {stats.lookups} requests, {keys} keys: {stats.hits} hits, "
                f"{stats.misses} misses{hit_rate}",
                f"  moved      stored {format_size(stats.bytes_stored)}, "
                f"loaded {format_size(stats.bytes_loaded)}",
                f"  refused    {_refused(stats)}; {stats.evictions} evictions; "
                f"{stats.protocol_errors} protocol errors",
            ]
            if stats.counters
            else [
                f"  cache      {format_size(stats.capacity_bytes)}; node-wide counters shown to "
                "root and the daemon's user only"
            ]
        ),
        *(_mirror_lines(stats) if stats.counters else []),
        *_copy_lines(stats),
        *(_tier_lines(stats) if stats.counters else []),
        *([f"  sessions   {stats.sessions}"] if stats.counters else []),
        f"  events     {_events_line(stats)}",
        f"  engines    {len(stats.engines)}" + ("" if stats.engines else " (none connected)"),
    ]
    lines += [f"    {_engine_line(engine)}" for engine in stats.engines]
    namespaces: dict[str, list[str]] = {}
    for engine in stats.engines:
        if engine.namespace:
            name = f"{engine.engine_id} dp {engine.data_parallel_index}"
            namespaces.setdefault(engine.namespace, []).append(name)
    lines.append(f"  namespaces {len(namespaces)}")
    lines += [
        f"    {namespace}: {', '.join(names)}" for namespace, names in sorted(namespaces.items())
    ]
    return lines


def _refused(stats: DaemonStats) -> str:
    """Refused keys, by reason when the daemon says why."""
    reasons = stats.stores_refused_by_reason
    if not reasons:
        return f"{stats.stores_refused} keys (no room)"
    parts = ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()))
    return f"{sum(reasons.values())} keys ({parts})"


def _mirror_lines(stats: DaemonStats) -> list[str]:
    """Stores waiting for a mirror's acknowledgement, mirrors dropped; nothing when neither."""
    parts = []
    if stats.stores_waiting:
        parts.append(f"{stats.stores_waiting} stores waiting for room a mirror must free")
    if stats.mirrors_dropped:
        parts.append(
            f"{stats.mirrors_dropped} dropped for not acknowledging removals in time "
            "(server.mirror_ack_timeout)"
        )
    return [f"  mirrors    {'; '.join(parts)}"] if parts else []


def _events_line(stats: DaemonStats) -> str:
    if not stats.events_endpoint:
        return "off"
    replay = stats.events_replay_endpoint or "none"
    return f"{stats.events_endpoint} (replay {replay})"


def _copy_lines(stats: DaemonStats) -> list[str]:
    """The cuda engine's copy path; nothing for engines without one."""
    path = stats.copy_path
    if not path:
        return []
    batched = "batched" if path.get("batched") else "NOT batched (one driver call per copy)"
    pinned = "arena pinned" if path.get("pinned") else "arena NOT pinned (pageable)"
    if all(path.values()):
        return [f"  copies     cuda: {batched}, {pinned}"]
    return [f"  copies     cuda DEGRADED: {batched}, {pinned}; see the daemon log"]


def _tier_lines(stats: DaemonStats) -> list[str]:
    """One block per tier below the arena; nothing when there are none."""
    lines = []
    for tier in stats.tiers:
        fill = f" ({tier.used_bytes / tier.capacity:.1%})" if tier.capacity else ""
        health = "" if tier.healthy else "UNREACHABLE; "
        lines += [
            f"  {tier.name:<10} {health}{format_size(tier.used_bytes)} of "
            f"{format_size(tier.capacity)}{fill}; {tier.chunks} chunks",
            f"    lookups found {tier.hits} keys; promoted {tier.promotions} chunks "
            f"({tier.promotion_failures} failed verification, "
            f"read {_rate(tier.bytes_read, tier.read_seconds)})",
            f"    written {tier.demotions} chunks, skipped {tier.demotions_skipped} "
            f"(gone before their turn); {format_size(tier.queued_bytes)} queued; "
            f"write {_rate(tier.bytes_written, tier.write_seconds)}; {tier.errors} errors",
        ]
    return lines


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "-"


def _engine_line(engine: EngineState) -> str:
    head = f"{engine.engine_id} dp {engine.data_parallel_index}: "
    present = f"{len(engine.ranks_present)}/{engine.world_size} ranks"
    if engine.ready:
        state = f"ready, {present}"
    else:
        missing = [r for r in range(engine.world_size) if r not in engine.ranks_present]
        state = f"waiting for ranks {missing} ({present} present)"
    if engine.schedulers:
        state += f", {engine.schedulers} scheduler{'s' if engine.schedulers > 1 else ''}"
    return head + state


def _duration(seconds: float) -> str:
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{seconds:.1f}s"

"""Soak, short variant (issue 7, item 6): ``offloadd.bench.soak`` for 20 seconds.

Two engines (tp=4 each, the same model and geometry, so one namespace shared by eight ranks)
run lookups, stores, loads with every byte checked, pins and releases, and rank restarts
(some with a store in flight) against ``offloadd serve`` in a subprocess. After the warm-up
and at the end the daemon's RSS, open fds and mapped imports must be flat, and not a single
page may differ. ``python -m offloadd.bench.soak --seconds 300`` is the long run.
"""

from __future__ import annotations

import os

import pytest

from offloadd.bench.soak import ENGINES, SHM_PREFIX, TP, results, run_soak

MiB = 1 << 20


@pytest.mark.timeout(120)
def test_two_engines_of_four_ranks_for_20_seconds() -> None:
    report = run_soak(20.0, seed=7, warmup=5.0)

    assert report.errors == []
    assert report.daemon_alive
    ops = report.ops
    assert sum(ops.values()) >= 500, ops
    assert min(ops["store"], ops["load"], ops["lookup"]) >= 50, ops
    assert ops["restart"] >= 2 and report.total("restarts_mid_job") >= 1, ops
    assert report.total("cross_engine_loads") >= 10  # the namespace is really shared

    # Every page of every rank that was loaded is the page that was stored; a store cut
    # short by a restart left its sequence wholly visible or not at all.
    assert report.total("chunks_verified") >= 200
    assert report.total("page_mismatches") == 0
    assert report.total("torn_sequences") == 0

    # The daemon does not grow: resident memory, file descriptors, mapped regions.
    start, end = report.start, report.end
    growth = end.rss - start.rss
    assert growth < min(20 * MiB, start.rss // 10), f"RSS {start.rss} -> {end.rss}"
    assert abs(end.fds - start.fds) <= 2, f"fds {start.fds} -> {end.fds}"
    assert end.imports == start.imports == len(ENGINES) * TP * 3
    assert end.sessions == start.sessions == len(ENGINES) * TP
    stats = report.final_stats
    assert stats.jobs_in_flight == 0
    assert sorted(e.engine_id for e in stats.engines if e.ready) == sorted(ENGINES)
    assert len({e.namespace for e in stats.engines}) == 1

    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{SHM_PREFIX}-{os.getpid()}-")]
    figures = {figure.name: figure for figure in results(report)}
    first, second = report.rates()
    print(
        f"\n[soak] {sum(ops.values())} operations ({dict(ops)}), "
        f"{report.total('requests')} requests, {report.total('restarts_mid_job')} restarts "
        f"mid-job, {report.total('cross_engine_loads')} cross-engine loads, "
        f"{report.total('load_misses')} loads after eviction, {report.total('refused_keys')} "
        f"refused keys; {report.total('chunks_verified')} chunks "
        f"({report.total('bytes_verified') / MiB:.0f} MiB) checked, 0 mismatches; "
        f"{first:.0f} -> {second:.0f} ops/s; RSS {start.rss / MiB:.1f} -> {end.rss / MiB:.1f} "
        f"MiB (max {report.max_rss / MiB:.1f}), fds {start.fds} -> {end.fds}, imports "
        f"{start.imports} -> {end.imports}; goals met: "
        f"{all(f.params['goal_met'] for n, f in figures.items() if n != 'soak_ops_per_s')}"
    )

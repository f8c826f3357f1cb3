"""offloadd.server.metrics: counters move by what the daemon reports; gauges come from its stats."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from offloadd import __version__
from offloadd.server.metrics import JOB_BYTES_BUCKETS, Metrics, MetricsError
from protocol.errors import ErrorCode
from protocol.messages import REFUSAL_REASONS, DaemonStats, TierState
from tests.helpers import fake_stats, value


def test_job_finished_moves_bytes_seconds_jobs_and_sizes() -> None:
    metrics = Metrics()
    metrics.job_finished("store", "engine-a", 0, nbytes=3_000_000, seconds=0.25, ok=True)
    metrics.job_finished("store", "engine-a", 0, nbytes=1_000, seconds=0.5, ok=False)
    metrics.job_finished("load", "engine-a", 1, nbytes=70_000_000, seconds=1.0, ok=True)
    metrics.job_finished("load", "engine-b", 0, nbytes=0, seconds=0.0, ok=False)

    store_a0 = {"direction": "store", "engine": "engine-a", "dp": "0"}
    assert value(metrics, "offloadd_bytes_total", **store_a0) == 3_001_000
    assert value(metrics, "offloadd_copy_seconds_total", **store_a0) == 0.75
    load_a1 = {"direction": "load", "engine": "engine-a", "dp": "1"}
    assert value(metrics, "offloadd_bytes_total", **load_a1) == 70_000_000
    assert value(metrics, "offloadd_copy_seconds_total", **load_a1) == 1.0
    # Nothing moved for engine-b, but its job counted as failed.
    load_b0 = {"direction": "load", "engine": "engine-b", "dp": "0"}
    assert value(metrics, "offloadd_bytes_total", **load_b0) == 0

    assert value(metrics, "offloadd_jobs_total", direction="store", outcome="ok") == 1
    assert value(metrics, "offloadd_jobs_total", direction="store", outcome="failed") == 1
    assert value(metrics, "offloadd_jobs_total", direction="load", outcome="ok") == 1
    assert value(metrics, "offloadd_jobs_total", direction="load", outcome="failed") == 1

    # Histogram of job sizes: only jobs that copied something.
    def bucket(direction: str, le: str) -> float | None:
        return value(metrics, "offloadd_job_bytes_bucket", direction=direction, le=le)

    assert bucket("store", "1e+06") == 1  # the 1000-byte job
    assert bucket("store", "5e+06") == 2
    assert bucket("load", "6e+07") == 0
    assert bucket("load", "8e+07") == 1
    assert bucket("load", "+Inf") == 1
    assert value(metrics, "offloadd_job_bytes_count", direction="load") == 1
    assert value(metrics, "offloadd_job_bytes_sum", direction="store") == 3_001_000


def test_jobs_of_one_copy_count_as_their_jobs_one_by_one() -> None:
    one_call, by_job = Metrics(), Metrics()
    copied, outcomes = [4096, 0, 2_000_000, 4096], [True, False, True, False]
    one_call.jobs_finished("load", "engine-a", 0, copied, seconds=0.5, failed=2)
    for nbytes, ok in zip(copied, outcomes, strict=True):
        by_job.job_finished("load", "engine-a", 0, nbytes=nbytes, seconds=0.125, ok=ok)

    labels = {"direction": "load", "engine": "engine-a", "dp": "0"}
    for name, sample_labels in (
        ("offloadd_bytes_total", labels),
        ("offloadd_copy_seconds_total", labels),
        ("offloadd_jobs_total", {"direction": "load", "outcome": "ok"}),
        ("offloadd_jobs_total", {"direction": "load", "outcome": "failed"}),
        ("offloadd_job_bytes_count", {"direction": "load"}),
        ("offloadd_job_bytes_sum", {"direction": "load"}),
        ("offloadd_job_bytes_bucket", {"direction": "load", "le": "1e+06"}),
    ):
        assert value(one_call, name, **sample_labels) == value(by_job, name, **sample_labels)
    assert value(one_call, "offloadd_job_bytes_count", direction="load") == 3
    assert value(one_call, "offloadd_jobs_total", direction="load", outcome="failed") == 2


def test_job_bytes_buckets_are_vllms() -> None:
    metrics = Metrics()
    metrics.job_finished("store", "e", 0, nbytes=1, seconds=0.0, ok=True)
    les = {
        sample.labels["le"]
        for family in metrics.registry.collect()
        if family.name == "offloadd_job_bytes"
        for sample in family.samples
        if sample.name.endswith("_bucket") and sample.labels["direction"] == "store"
    }
    assert {float(le) for le in les} == {*JOB_BYTES_BUCKETS, float("inf")}
    assert JOB_BYTES_BUCKETS == (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)


def test_lookup_seconds_histogram() -> None:
    metrics = Metrics()
    for seconds in (2e-6, 3e-5, 3e-5, 0.2, 5.0):
        metrics.lookup_finished(seconds)
    assert value(metrics, "offloadd_lookup_seconds_bucket", le="1e-05") == 1
    assert value(metrics, "offloadd_lookup_seconds_bucket", le="5e-05") == 3
    assert value(metrics, "offloadd_lookup_seconds_bucket", le="0.25") == 4
    assert value(metrics, "offloadd_lookup_seconds_bucket", le="1.0") == 4
    assert value(metrics, "offloadd_lookup_seconds_bucket", le="+Inf") == 5
    assert value(metrics, "offloadd_lookup_seconds_count") == 5


def test_protocol_errors_by_code() -> None:
    metrics = Metrics()
    metrics.protocol_error("MALFORMED")
    metrics.protocol_error("MALFORMED")
    metrics.protocol_error("NOT_REGISTERED")
    assert value(metrics, "offloadd_protocol_errors_total", code="MALFORMED") == 2
    assert value(metrics, "offloadd_protocol_errors_total", code="NOT_REGISTERED") == 1


def test_every_error_code_and_job_outcome_counts_from_0_before_the_first() -> None:
    metrics = Metrics()
    for code in ErrorCode:
        assert value(metrics, "offloadd_protocol_errors_total", code=code.name) == 0, code
    for direction in ("store", "load"):
        for outcome in ("ok", "failed"):
            labels = {"direction": direction, "outcome": outcome}
            assert value(metrics, "offloadd_jobs_total", **labels) == 0


def test_gauges_and_cache_counters_come_from_the_snapshot() -> None:
    stats = fake_stats()
    metrics = Metrics(lambda: stats, pending_jobs=lambda: 6)
    assert value(metrics, "offloadd_capacity_bytes") == 1 << 30
    assert value(metrics, "offloadd_used_bytes") == 3 << 20
    assert value(metrics, "offloadd_uptime_seconds") == 42.5
    assert value(metrics, "offloadd_entries", state="committed") == 7
    assert value(metrics, "offloadd_entries", state="pending") == 3
    assert value(metrics, "offloadd_pending_jobs") == 6
    assert value(metrics, "offloadd_lookup_keys_total", result="hit") == 12
    assert value(metrics, "offloadd_lookup_keys_total", result="miss") == 4
    assert value(metrics, "offloadd_lookups_total") == 5
    assert value(metrics, "offloadd_stores_refused_keys_total", reason="full") == 2
    # Every reason is exported from the start, so a rate (and an alert) over it is defined.
    for reason in REFUSAL_REASONS:
        if reason != "full":
            assert value(metrics, "offloadd_stores_refused_keys_total", reason=reason) == 0
    assert value(metrics, "offloadd_evictions_total") == 9
    assert value(metrics, "offloadd_sessions", engine="engine-a", dp="0", role="worker") == 2
    assert value(metrics, "offloadd_sessions", engine="engine-a", dp="0", role="scheduler") == 1
    assert value(metrics, "offloadd_sessions", engine="engine-b", dp="1", role="worker") == 1
    assert value(metrics, "offloadd_engine_ready", engine="engine-a", dp="0") == 1
    assert value(metrics, "offloadd_engine_ready", engine="engine-b", dp="1") == 0

    stats = fake_stats(engines=[], used_bytes=0)  # read afresh at every scrape
    assert value(metrics, "offloadd_used_bytes") == 0
    assert value(metrics, "offloadd_engine_ready", engine="engine-a", dp="0") is None


def test_waiting_stores_and_dropped_mirrors_come_from_the_snapshot() -> None:
    metrics = Metrics(lambda: fake_stats(stores_waiting=2, mirrors_dropped=1))
    assert value(metrics, "offloadd_stores_waiting") == 2
    assert value(metrics, "offloadd_mirrors_dropped_total") == 1
    assert value(Metrics(fake_stats), "offloadd_mirrors_dropped_total") == 0


def test_a_failing_snapshot_leaves_the_counters() -> None:
    def broken() -> DaemonStats:
        raise AssertionError("daemon not started")

    metrics = Metrics(broken)
    metrics.protocol_error("MALFORMED")
    assert value(metrics, "offloadd_capacity_bytes") is None
    assert value(metrics, "offloadd_protocol_errors_total", code="MALFORMED") == 1


def test_without_a_snapshot_there_are_no_gauges() -> None:
    metrics = Metrics()
    assert value(metrics, "offloadd_capacity_bytes") is None
    assert value(metrics, "offloadd_pending_jobs") is None


def test_instances_have_their_own_registries() -> None:
    first, second = Metrics(fake_stats), Metrics(fake_stats)
    first.protocol_error("MALFORMED")
    assert value(first, "offloadd_protocol_errors_total", code="MALFORMED") == 1
    assert value(second, "offloadd_protocol_errors_total", code="MALFORMED") == 0


@pytest.fixture
def loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_snapshot_runs_on_the_daemon_loop(loop_thread: asyncio.AbstractEventLoop) -> None:
    seen: list[threading.Thread] = []

    def snapshot() -> DaemonStats:
        seen.append(threading.current_thread())
        return fake_stats()

    with Metrics(snapshot, pending_jobs=lambda: 0) as metrics:
        metrics.start("127.0.0.1:0", loop=loop_thread)
        assert value(metrics, "offloadd_capacity_bytes") == 1 << 30
        assert "offloadd_pending_jobs 0.0" in scrape(metrics.address)
    assert len(seen) == 2
    assert all(thread is not threading.current_thread() for thread in seen)


@pytest.mark.asyncio
async def test_start_defaults_to_the_callers_loop() -> None:
    seen: list[asyncio.AbstractEventLoop] = []

    def snapshot() -> DaemonStats:
        seen.append(asyncio.get_running_loop())
        return fake_stats()

    with Metrics(snapshot) as metrics:
        metrics.start("127.0.0.1:0")
        text = await asyncio.to_thread(scrape, metrics.address)
    assert "offloadd_capacity_bytes" in text
    assert seen == [asyncio.get_running_loop()]


def test_a_stopped_loop_means_no_gauges() -> None:
    stopped = asyncio.new_event_loop()
    try:
        with Metrics(fake_stats, snapshot_timeout=0.2) as metrics:
            metrics.start("127.0.0.1:0", loop=stopped)
            assert value(metrics, "offloadd_capacity_bytes") is None
    finally:
        stopped.close()


# --- the HTTP endpoint -----------------------------------------------------------------------


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        body: bytes = response.read()
    return body.decode()


def test_endpoint_serves_and_closes() -> None:
    metrics = Metrics(fake_stats)
    metrics.start("127.0.0.1:0")
    try:
        address = metrics.address
        assert address.startswith("127.0.0.1:")
        metrics.job_finished("store", "engine-a", 0, nbytes=4096, seconds=0.001, ok=True)
        text = scrape(address)
        assert 'offloadd_bytes_total{direction="store",dp="0",engine="engine-a"} 4096.0' in text
        assert "offloadd_capacity_bytes 1.073741824e+09" in text
        with pytest.raises(MetricsError, match="already started"):
            metrics.start("127.0.0.1:0")
    finally:
        metrics.close()
    metrics.close()  # idempotent
    assert metrics.address == ""
    with pytest.raises(urllib.error.URLError):
        scrape(address)


def test_endpoint_errors() -> None:
    with Metrics() as metrics, pytest.raises(MetricsError, match="HOST:PORT"):
        metrics.start("9464")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        with Metrics() as metrics, pytest.raises(MetricsError, match=f"127.0.0.1:{port}"):
            metrics.start(f"127.0.0.1:{port}")
    finally:
        holder.close()


def test_each_tier_below_the_arena_has_its_figures() -> None:
    disk = TierState("disk", 4 << 30, 1 << 30, 12, promotions=4, demotions_skipped=2)
    cluster = TierState("mooncake", 1 << 30, 0, 0, healthy=False, errors=3)
    stats = fake_stats(tiers=[disk, cluster])
    metrics = Metrics(lambda: stats)
    assert value(metrics, "offloadd_tier_used_bytes", tier="disk") == 1 << 30
    assert value(metrics, "offloadd_tier_chunks", tier="disk") == 12
    assert value(metrics, "offloadd_tier_promotions_total", tier="disk") == 4
    assert value(metrics, "offloadd_tier_demotions_skipped_total", tier="disk") == 2
    assert value(metrics, "offloadd_tier_healthy", tier="mooncake") == 0
    assert value(metrics, "offloadd_tier_errors_total", tier="mooncake") == 3
    assert value(Metrics(fake_stats), "offloadd_tier_chunks", tier="disk") is None


# --- health ------------------------------------------------------------------------------------


def get(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_health_ready_and_unknown_paths(loop_thread: asyncio.AbstractEventLoop) -> None:
    reasons = ["starting"]
    with Metrics(fake_stats, ready=lambda: reasons[0], copy_engine="cpu") as metrics:
        metrics.start("127.0.0.1:0", loop=loop_thread)
        assert get(metrics.address, "/healthz") == (200, "ok\n")
        assert get(metrics.address, "/readyz") == (503, "starting\n")
        reasons[0] = ""
        assert get(metrics.address, "/readyz") == (200, "ready\n")
        status, body = get(metrics.address, "/nope")
        assert status == 404 and "/healthz" in body
        assert get(metrics.address, "/metrics?x=1")[0] == 200


def test_a_stalled_loop_is_not_healthy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("offloadd.server.metrics.HEALTH_SECONDS", 0.05)
    loop = asyncio.new_event_loop()
    release = threading.Event()
    loop.call_soon(release.wait)  # the loop's one callback never returns until released
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        with Metrics(fake_stats, ready=lambda: "") as metrics:
            metrics.start("127.0.0.1:0", loop=loop)
            assert get(metrics.address, "/healthz")[0] == 503
            assert get(metrics.address, "/readyz") == (503, "the event loop does not answer\n")
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_process_series_and_build_info() -> None:
    with Metrics(copy_engine="cuda") as metrics:
        metrics.start("127.0.0.1:0")
        text = scrape(metrics.address)
    assert "process_resident_memory_bytes" in text
    assert "process_open_fds" in text
    assert "python_info" in text
    assert f'offloadd_build_info{{copy_engine="cuda",version="{__version__}"}} 1.0' in text


def test_every_refusal_reason_the_daemon_counts_is_exported() -> None:
    from offloadd.cache import index
    from offloadd.server import jobs, waiting

    counted = {
        getattr(module, name)
        for module in (index, jobs, waiting)
        for name in dir(module)
        if name.startswith("REFUSED_")
    }
    assert counted == set(REFUSAL_REASONS)

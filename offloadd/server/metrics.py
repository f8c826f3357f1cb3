"""Prometheus metrics (``offloadd_*``) on a small HTTP endpoint, a unix socket by default.

The daemon owns one ``Metrics`` and tells it what happens, from its event loop:

- ``job_finished(direction, engine_id, dp, nbytes=, seconds=, ok=)`` once per store or load
  job (``direction`` is "store" or "load"; ``nbytes`` the bytes actually copied, 0 when the
  copy failed; ``seconds`` the copy time), or ``jobs_finished`` once for the jobs of one copy.
  Moves ``offloadd_bytes_total``, ``offloadd_copy_seconds_total`` (GB/s = rate(bytes) /
  rate(seconds)), ``offloadd_jobs_total`` and the ``offloadd_job_bytes`` histogram (jobs that
  copied something).
- ``lookup_finished(seconds)`` per Lookup request: the ``offloadd_lookup_seconds`` histogram.
- ``protocol_error(code)`` per Error reply, ``code`` the ErrorCode name.

A labelled counter whose label values are known at start has each of them from the start, at
0 (``offloadd_jobs_total``, ``offloadd_protocol_errors_total`` for every ErrorCode,
``offloadd_stores_refused_keys_total`` for every reason, ``offloadd_lookup_keys_total``): a
rate or ``increase()`` over them counts the first event, which a series born at 1 hides. Only
the ``engine`` and ``dp`` labels, not known before an engine copies, appear with it.

``Counters`` are the daemon's own counts that ``GetStats`` reports beside the cache's.

Everything else is read when Prometheus scrapes: ``snapshot()`` (the daemon's ``stats``)
gives the cache fill, entries, lookup keys, refused stores, stores waiting for their room,
evictions, schedulers dropped for a mirror that stopped acknowledging, sessions, engines and
the copy path (``offloadd_copy_engine_degraded``: 1 when the cuda engine lost batching or
the pinned arena), the tiers below the arena (``offloadd_tier_*{tier=...}``: fill, hits,
promotions, demotions, skipped, errors, bytes and seconds for GB/s, healthy), and
``pending_jobs()`` the copies in flight. Both are called on the daemon's event loop (the one
``start`` was called from), so they never race the handlers;
if the loop does not answer within ``snapshot_timeout`` the scrape carries the counters
above and no gauges.

Cardinality: ``engine`` and ``dp`` labels come from the engines that connect, which are few
per node (one per model replica) at any time; ``forget_engine(engine_id, dp)`` removes an
engine's label sets when its last session leaves, so a client cycling through engine ids
cannot grow the scrape (or the daemon) without bound. Each metric family lives in this
instance's own ``CollectorRegistry``, so several daemons (or tests) in one process don't
clash.

Process and platform series (``process_resident_memory_bytes``, ``process_open_fds``,
``process_start_time_seconds``, ``python_info``, ...) and ``offloadd_build_info{version,
copy_engine}`` are always there.

Health, on the same endpoint: ``/healthz`` answers 200 when the daemon's event loop ran a
callback within ``HEALTH_SECONDS`` (503 otherwise: a wedged loop serves nobody), ``/readyz``
200 when ``ready()`` says nothing is missing (arena open, sockets bound, tiers healthy; 503
with the reason), and every other path but ``/metrics`` is 404.

``start(address)`` serves them on ``HOST:PORT`` from a background thread, or on a
unix socket for ``unix:/PATH`` (created like the control socket: in a directory only the
daemon's user can change, then given ``socket_mode`` and ``socket_group``: by default 0600,
so that only the daemon's user and root read every tenant's engine ids and counters; a
loopback port is open to every local user, and a port off loopback, logged as a warning, to
whoever reaches it). ``close()`` stops it (idempotent).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any, TypeVar
from urllib.parse import urlsplit

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import MetricsHandler
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from offloadd import __version__
from offloadd.endpoint import EndpointRefused, bind_ipc, is_loopback
from offloadd.settings import UNIX_PREFIX, parse_address
from protocol.errors import ErrorCode
from protocol.messages import REFUSAL_REASONS, DaemonStats

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

DIRECTIONS = ("store", "load")
# Job sizes in bytes, like vLLM's KV-offload transfer-size buckets.
JOB_BYTES_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
LOOKUP_SECONDS_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
    0.5, 1.0,
)  # fmt: skip


HEALTH_SECONDS = 2.0  # /healthz: how long the event loop may take to run a callback
IDLE_SECONDS = 10.0  # a metrics connection that sends nothing for this long is closed


class MetricsError(Exception):
    """The metrics endpoint could not be started (bad address, port taken)."""


@dataclass
class Counters:
    """What the daemon counts itself for ``GetStats`` (the cache keeps its own counts)."""

    protocol_errors: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    jobs_failed: int = 0
    loads_missing: int = 0  # load jobs that found keys gone (their requests recompute)
    # Store keys the daemon refused before the cache saw them, by reason ("draining": asked
    # to reserve or store while stopping; "late": past the store's deadline); GetStats adds
    # them to the cache's reasons.
    refused: dict[str, int] = dataclasses.field(default_factory=dict)


class Metrics:
    """The daemon's Prometheus metrics; see the module docstring for who calls what."""

    def __init__(
        self,
        snapshot: Callable[[], DaemonStats] | None = None,
        *,
        pending_jobs: Callable[[], int] | None = None,
        snapshot_timeout: float = 5.0,
        ready: Callable[[], str] | None = None,
        copy_engine: str = "",
    ) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        Gauge(
            "offloadd_build_info",
            "Always 1: the daemon's version and the copy engine it runs",
            ["version", "copy_engine"],
            registry=self.registry,
        ).labels(__version__, copy_engine).set(1)
        self._ready = ready
        self._bytes = Counter(
            "offloadd_bytes",
            "Bytes copied between ranks and the host cache",
            ["direction", "engine", "dp"],
            registry=self.registry,
        )
        self._seconds = Counter(
            "offloadd_copy_seconds",
            "Seconds spent copying; rate(bytes) / rate(seconds) is the copy bandwidth",
            ["direction", "engine", "dp"],
            registry=self.registry,
        )
        jobs = Counter(
            "offloadd_jobs",
            "Store and load jobs finished",
            ["direction", "outcome"],
            registry=self.registry,
        )
        job_bytes = Histogram(
            "offloadd_job_bytes",
            "Bytes copied per job (jobs that copied anything)",
            ["direction"],
            buckets=JOB_BYTES_BUCKETS,
            registry=self.registry,
        )
        self._lookup_seconds = Histogram(
            "offloadd_lookup_seconds",
            "Time to answer a Lookup request",
            buckets=LOOKUP_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self._protocol_errors = Counter(
            "offloadd_protocol_errors",
            "Requests answered with an Error, by error code",
            ["code"],
            registry=self.registry,
        )
        # Label children are looked up once: a finished job costs a dict lookup and a few adds.
        self._jobs = {
            (direction, ok): jobs.labels(direction, "ok" if ok else "failed")
            for direction in DIRECTIONS
            for ok in (True, False)
        }
        self._job_bytes = {direction: job_bytes.labels(direction) for direction in DIRECTIONS}
        self._copies: dict[tuple[str, str, int], tuple[Counter, Counter]] = {}
        # Every code from the start, at 0 until it counts: a series that appears at 1 has no
        # earlier sample, so increase() over it (the INTERNAL alert) would miss that error.
        self._errors = {code.name: self._protocol_errors.labels(code.name) for code in ErrorCode}
        self._collector = _SnapshotCollector(snapshot, pending_jobs, snapshot_timeout)
        if snapshot is not None or pending_jobs is not None:
            self.registry.register(self._collector)
        self._server: socketserver.BaseServer | None = None
        self._thread: threading.Thread | None = None
        self._unix_path = ""

    # ----------------------------------------------------------------- events

    def job_finished(
        self, direction: str, engine_id: str, dp: int, *, nbytes: int, seconds: float, ok: bool
    ) -> None:
        """A store or load job finished (``nbytes`` copied, 0 if the copy failed)."""
        self.jobs_finished(direction, engine_id, dp, [nbytes], seconds=seconds, failed=int(not ok))

    def jobs_finished(
        self,
        direction: str,
        engine_id: str,
        dp: int,
        copied: Sequence[int],
        *,
        seconds: float,
        failed: int,
    ) -> None:
        """The jobs of one copy finished: ``copied`` the bytes of each (0 where nothing was),
        ``seconds`` the copy's, ``failed`` how many of them failed. One call per copy: a
        step's 256 loads cost three counter adds, not 768."""
        children = self._copies.get((direction, engine_id, dp))
        if children is None:
            labels = (direction, engine_id, str(dp))
            children = (self._bytes.labels(*labels), self._seconds.labels(*labels))
            self._copies[direction, engine_id, dp] = children
        moved, took = children
        total = sum(copied)
        if total:
            moved.inc(total)
        if seconds:
            took.inc(seconds)
        if len(copied) > failed:
            self._jobs[direction, True].inc(len(copied) - failed)
        if failed:
            self._jobs[direction, False].inc(failed)
        observe = self._job_bytes[direction].observe
        for nbytes in copied:
            if nbytes:
                observe(nbytes)

    def forget_engine(self, engine_id: str, dp: int) -> None:
        """The engine is gone: drop its label sets."""
        for direction in DIRECTIONS:
            if self._copies.pop((direction, engine_id, dp), None) is not None:
                labels = (direction, engine_id, str(dp))
                self._bytes.remove(*labels)
                self._seconds.remove(*labels)

    def lookup_finished(self, seconds: float) -> None:
        """A Lookup request was answered after ``seconds``."""
        self._lookup_seconds.observe(seconds)

    def protocol_error(self, code: str) -> None:
        """A request was answered with Error ``code`` (the ErrorCode name)."""
        child = self._errors.get(code)
        if child is None:
            child = self._errors[code] = self._protocol_errors.labels(code)
        child.inc()

    # ----------------------------------------------------------------- endpoint

    def start(
        self,
        address: str,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        socket_mode: str = "0600",
        socket_group: str = "",
        connections: int = 64,
    ) -> None:
        """Serve ``/metrics`` on ``HOST:PORT`` (port 0: any free port, see ``address``), or
        on the unix socket ``unix:/PATH`` with ``socket_mode`` and ``socket_group``.

        At most ``connections`` are served at once, each idle at most ``IDLE_SECONDS``; a
        newcomer beyond them is closed at once, so idle connections never take the daemon's
        descriptors (``limits.metrics_connections``).

        ``snapshot`` and ``pending_jobs`` will run on ``loop``, by default the loop running
        the caller (the daemon's, when the daemon calls this from its loop).
        """
        if self._server is not None:
            raise MetricsError("metrics endpoint already started")
        self._collector.loop = loop or _running_loop()
        if address.startswith(UNIX_PREFIX):
            self._start_unix(address[len(UNIX_PREFIX) :], socket_mode, socket_group, connections)
            logger.info("metrics on %s (HTTP)", self.address)
            return
        try:
            host, port = parse_address(address)
        except ValueError as exc:
            raise MetricsError(f"metrics address: {exc}") from None
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            server_class = type(
                "_HTTPServer",
                (_Bounded, ThreadingHTTPServer),
                {"address_family": family, "connections": connections},
            )
            server = server_class((host.strip("[]"), port), self._handler())
        except OSError as exc:
            raise MetricsError(
                f"cannot serve metrics on {address}: {exc.strerror or exc} "
                '(set metrics.address, or "" to turn metrics off)'
            ) from None
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="offloadd-metrics", daemon=True
        )
        self._thread.start()
        logger.info("metrics on http://%s/metrics", self.address)
        if not is_loopback(f"tcp://{address}"):
            logger.warning(
                "metrics on %s are reachable from other hosts: whoever reaches the port reads "
                "every tenant's engine ids and counters (metrics.address; firewall it, or use "
                '"auto", a unix socket only the daemon\'s user reads)',
                address,
            )

    def _handler(self) -> type[MetricsHandler]:
        """The HTTP handler: /metrics, /healthz, /readyz, 404 elsewhere."""
        return _handler_class(self.registry, self.healthy, self.readiness)

    def healthy(self) -> bool:
        """Whether the daemon's event loop runs callbacks (always, without a loop)."""
        loop = self._collector.loop
        if loop is None or _running_loop() is loop:
            return True
        done = threading.Event()
        try:
            loop.call_soon_threadsafe(done.set)
        except RuntimeError:  # the loop is closed
            return False
        return done.wait(HEALTH_SECONDS)

    def readiness(self) -> str:
        """What keeps the daemon from serving ("" when ready)."""
        if not self.healthy():
            return "the event loop does not answer"
        if self._ready is None:
            return ""
        try:
            return self._collector.on_loop_call(self._ready)
        except Exception as exc:
            return f"readiness check failed: {exc!r}"

    def _start_unix(self, path: str, mode: str, group: str, connections: int) -> None:
        handler = self._handler()
        server_class = type("_UnixServer", (_UnixHTTPServer,), {"connections": connections})
        if _live_socket(path):
            raise MetricsError(f"metrics socket {path} is in use by another process")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # stale: nobody answers on it
        try:
            server = bind_ipc(lambda: server_class(path, handler), path, mode, group)
        except (OSError, EndpointRefused) as exc:
            raise MetricsError(f"cannot serve metrics on unix:{path}: {exc}") from None
        self._server, self._unix_path = server, path
        self._thread = threading.Thread(
            target=server.serve_forever, name="offloadd-metrics", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        """``HOST:PORT`` (or ``unix:/PATH``) the endpoint listens on, "" when not started."""
        if self._server is None:
            return ""
        if self._unix_path:
            return UNIX_PREFIX + self._unix_path
        bound = self._server.server_address
        assert isinstance(bound, tuple)
        host, port = str(bound[0]), bound[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def close(self) -> None:
        """Stop the endpoint. Idempotent."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(5)
        if self._unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unix_path)
            self._unix_path = ""

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Bounded(socketserver.ThreadingMixIn):
    """At most ``connections`` served at once (a thread and a descriptor each); a newcomer
    beyond them is closed at once (counted in ``refused``). Idle ones end after the handler's
    ``timeout``."""

    connections = 64
    daemon_threads = True
    refused = 0
    _active = 0
    _lock = threading.Lock()  # shared by every server: each holds it for a count only

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = self._active >= self.connections
            if full:
                self.refused += 1
            else:
                self._active += 1
        if full:
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._active -= 1


class _UnixHTTPServer(_Bounded, socketserver.UnixStreamServer):
    pass


def _handler_class(
    registry: CollectorRegistry, healthy: Callable[[], bool], readiness: Callable[[], str]
) -> type[MetricsHandler]:
    metrics = MetricsHandler.factory(registry)

    class Handler(metrics):  # type: ignore[misc, valid-type]
        timeout = IDLE_SECONDS  # a connection that sends nothing for this long is closed

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if path == "/metrics":
                super().do_GET()
            elif path == "/healthz":
                ok = healthy()
                self._text(200 if ok else 503, "ok\n" if ok else "event loop stalled\n")
            elif path == "/readyz":
                reason = readiness()
                self._text(503 if reason else 200, (reason or "ready") + "\n")
            else:
                self._text(404, "not found: /metrics, /healthz or /readyz\n")

        def _text(self, status: int, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            return  # scrapes and probes are not news

    return Handler


def _live_socket(path: str) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as exc:
        return exc.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK)
    finally:
        probe.close()
    return True


class _SnapshotCollector:
    """Gauges and cache counters from the daemon's stats, read at scrape time."""

    def __init__(
        self,
        snapshot: Callable[[], DaemonStats] | None,
        pending_jobs: Callable[[], int] | None,
        timeout: float,
    ) -> None:
        self._snapshot = snapshot
        self._pending_jobs = pending_jobs
        self._timeout = timeout
        self.loop: asyncio.AbstractEventLoop | None = None  # where to call them; None: here

    def describe(self) -> Iterable[Metric]:
        """The families' names, without asking the daemon (called at registration)."""
        return self._families(None, None)

    def collect(self) -> Iterable[Metric]:
        """Ask the daemon (on its loop) and yield the families."""
        try:
            stats, pending = self._on_loop(self._read)
        except Exception as exc:
            logger.debug("metrics: no daemon snapshot for this scrape: %r", exc)
            return []
        return self._families(stats, pending)

    def _families(self, stats: DaemonStats | None, pending: int | None) -> list[Metric]:
        families = _stats_families(stats) if self._snapshot is not None else []
        if self._pending_jobs is not None:
            families.append(
                GaugeMetricFamily("offloadd_pending_jobs", "Copies in flight", value=pending)
            )
        return families

    def _read(self) -> tuple[DaemonStats | None, int | None]:
        stats = self._snapshot() if self._snapshot is not None else None
        pending = self._pending_jobs() if self._pending_jobs is not None else None
        return stats, pending

    def _on_loop(
        self, call: Callable[[], tuple[DaemonStats | None, int | None]]
    ) -> tuple[DaemonStats | None, int | None]:
        return self.on_loop_call(call)

    def on_loop_call(self, call: Callable[[], _T]) -> _T:
        """``call()`` run on the daemon's loop (here without one), its result or exception."""
        loop = self.loop
        if loop is None or _running_loop() is loop:
            return call()
        result: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def run() -> None:
            try:
                result.set_result(call())
            except BaseException as exc:
                result.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return result.result(self._timeout)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _stats_families(stats: DaemonStats | None) -> list[Metric]:
    """Families filled from ``stats``; empty ones (names only) when it is None."""
    families: list[Metric] = []
    for name, text, value in (
        ("offloadd_capacity_bytes", "Size of the host cache arena", "capacity_bytes"),
        ("offloadd_used_bytes", "Arena bytes holding chunks, committed or pending", "used_bytes"),
        ("offloadd_uptime_seconds", "Seconds since the daemon started", "uptime_seconds"),
    ):
        families.append(
            GaugeMetricFamily(name, text, value=getattr(stats, value) if stats else None)
        )
    entries = GaugeMetricFamily(
        "offloadd_entries", "Chunks in the cache: visible, or being stored", labels=["state"]
    )
    lookup_keys = CounterMetricFamily(
        "offloadd_lookup_keys", "Keys looked up, by whether they were cached", labels=["result"]
    )
    lookups = CounterMetricFamily("offloadd_lookups", "Lookup requests answered")
    refused = CounterMetricFamily(
        "offloadd_stores_refused_keys",
        "Keys a store or reservation could not place, by reason: full (nothing evictable), "
        "ack (its room waited on a mirror's acknowledgement), budget (beyond the engine's "
        "protected share), tenant (beyond its user's protected share), expired (reserved but "
        "not stored within limits.reservation_seconds), draining (asked while the daemon was "
        "stopping), late (the store's deadline passed before it started or its copy ended)",
        labels=["reason"],
    )
    evictions = CounterMetricFamily("offloadd_evictions", "Chunks evicted to make room")
    waiting = GaugeMetricFamily(
        "offloadd_stores_waiting",
        "Rank stores waiting for the room another engine's mirror must acknowledge freeing",
    )
    dropped = CounterMetricFamily(
        "offloadd_mirrors_dropped",
        "Schedulers ended because their key mirror did not acknowledge removals within "
        "server.mirror_ack_timeout",
    )
    loads_missing = CounterMetricFamily(
        "offloadd_loads_missing",
        "Load jobs that failed because keys they read were gone; the engine recomputes (or, "
        "under vLLM's kv_load_failure_policy fail, fails) those requests",
    )
    sessions = GaugeMetricFamily(
        "offloadd_sessions",
        "Connected sessions per engine, dp index and role (worker or scheduler)",
        labels=["engine", "dp", "role"],
    )
    ready = GaugeMetricFamily(
        "offloadd_engine_ready",
        "1 once every rank of the engine has said hello, else 0",
        labels=["engine", "dp"],
    )
    if stats is not None:
        entries.add_metric(["committed"], stats.committed_entries)
        entries.add_metric(["pending"], stats.entries - stats.committed_entries)
        lookup_keys.add_metric(["hit"], stats.hits)
        lookup_keys.add_metric(["miss"], stats.misses)
        lookups.add_metric([], stats.lookups)
        # Every reason from the start, at 0 until it counts: a rate over it is defined (and
        # an alert on it can fire) from the first refusal, not the second scrape after it.
        by_reason = dict.fromkeys(REFUSAL_REASONS, 0) | stats.stores_refused_by_reason
        for reason, count in sorted(by_reason.items()):
            refused.add_metric([reason], count)
        evictions.add_metric([], stats.evictions)
        waiting.add_metric([], stats.stores_waiting)
        dropped.add_metric([], stats.mirrors_dropped)
        loads_missing.add_metric([], stats.loads_missing)
        for engine in stats.engines:
            dp = str(engine.data_parallel_index)
            sessions.add_metric([engine.engine_id, dp, "worker"], len(engine.ranks_present))
            sessions.add_metric([engine.engine_id, dp, "scheduler"], engine.schedulers)
            ready.add_metric([engine.engine_id, dp], 1.0 if engine.ready else 0.0)
    degraded = GaugeMetricFamily(
        "offloadd_copy_engine_degraded",
        "1 when the cuda copy engine runs without its fast path (batched copies into a "
        "pinned arena), else 0",
    )
    copy_path = GaugeMetricFamily(
        "offloadd_copy_path",
        "1 when the cuda copy engine has this part of its fast path (batched, pinned), else 0",
        labels=["feature"],
    )
    if stats is not None:
        degraded.add_metric([], 0.0 if all(stats.copy_path.values()) else 1.0)
        for feature, ok in sorted(stats.copy_path.items()):
            copy_path.add_metric([feature], 1.0 if ok else 0.0)
    families += [entries, lookup_keys, lookups, refused, evictions, waiting, dropped, loads_missing]
    families += [sessions, ready]
    families += [degraded, copy_path]
    families += _tier_families(stats)
    return families


# (name, help, TierState field) of each tier figure; counters end in _total on the wire.
_TIER_GAUGES = (
    ("offloadd_tier_capacity_bytes", "Bytes the tier may fill", "capacity"),
    ("offloadd_tier_used_bytes", "Bytes the tier holds", "used_bytes"),
    ("offloadd_tier_chunks", "Chunks the tier holds", "chunks"),
    ("offloadd_tier_healthy", "1 while the tier's medium is reachable, else 0", "healthy"),
    ("offloadd_tier_queued_bytes", "Chunks waiting to be written to the tier", "queued_bytes"),
)
_TIER_COUNTERS = (
    ("offloadd_tier_hits", "Keys lookups found in the tier", "hits"),
    ("offloadd_tier_promotions", "Chunks promoted into the arena, verified", "promotions"),
    (
        "offloadd_tier_promotion_failures",
        "Chunks gone from the tier or failing verification when promoted (never served)",
        "promotion_failures",
    ),
    ("offloadd_tier_demotions", "Committed chunks written to the tier", "demotions"),
    (
        "offloadd_tier_demotions_skipped",
        "Chunks not written to the tier because its queue was full",
        "demotions_skipped",
    ),
    ("offloadd_tier_errors", "Faults of the tier's medium and failed calls", "errors"),
    ("offloadd_tier_written_bytes", "Bytes written to the tier", "bytes_written"),
    ("offloadd_tier_read_bytes", "Bytes read from the tier", "bytes_read"),
    (
        "offloadd_tier_write_seconds",
        "Seconds spent writing; rate(written_bytes) / rate(write_seconds) is GB/s",
        "write_seconds",
    ),
    ("offloadd_tier_read_seconds", "Seconds spent reading", "read_seconds"),
)


def _tier_families(stats: DaemonStats | None) -> list[Metric]:
    """Per tier below the arena (label ``tier``); families without samples when none."""
    families: list[Metric] = []
    tiers = stats.tiers if stats is not None else []
    for kind, table in ((GaugeMetricFamily, _TIER_GAUGES), (CounterMetricFamily, _TIER_COUNTERS)):
        for name, text, field in table:
            family = kind(name, text, labels=["tier"])
            for tier in tiers:
                family.add_metric([tier.name], float(getattr(tier, field)))
            families.append(family)
    return families

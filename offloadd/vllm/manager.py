"""The scheduler side: vLLM's ``OffloadingManager`` over the daemon, one per engine.

Design (see docs/vllm.md): vLLM calls ``lookup`` once per key inside ``schedule()``,
so lookups are answered from a local mirror of the namespace's committed keys (``KeyMirror``,
fed by the daemon's ``KeysChanged``), a set probe. A step costs at most one message to the
daemon inside ``schedule()``, whatever the batch, sent at ``on_schedule_end``: vLLM 0.33's
last manager call of the step, after every ``prepare_store`` and before the step's metadata
(the store and load specs) leaves the scheduler for the ranks. It is
- a ``Reserve`` of every key the step's ``prepare_store`` calls chose (answered locally:
  ``offloadd.vllm.stores``), carrying the step's holds, due releases and the mirror's
  acknowledgement, its reply awaited for ``STEP_TIMEOUT_SECONDS`` at most; keys the daemon
  did not reserve (another engine stores them, no room, no answer) are marked skipped in
  their specs then, so the ranks do not store them: those chunks are just not cached;
- else an ``UpdateHolds`` (holds to send or releases due), else an ``Ack`` (not awaited).
``complete_store`` waits for nothing: a key the ranks stored answers ``HIT_PENDING`` until
its commit reaches the mirror (a second at most).
A key the mirror shows stays loadable: the daemon keeps a removed key's bytes until this
scheduler acknowledged the removal, and this scheduler holds every key it hit before that.

A daemon with tiers below its arena (disk, cluster; ``Welcome.tiers``) may hold a key the
mirror lacks. Such a key answers ``RETRY`` and is asked of the daemon at ``on_schedule_end``
(one ``Lookup`` per request that has such keys, beside the step's message); the daemon
promotes what it finds into the arena and says which keys are on their way, which then
answer ``HIT_PENDING`` until their commit reaches the mirror (``offloadd.vllm.probes``).

Threads: vLLM calls every method but ``shutdown`` holding ``lock``; a background thread takes
the same lock to read notices, acknowledge them and keep the session alive while the engine
idles, so the socket is only ever used under ``lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from typing import cast

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from offloadd.client import OffloadClient
from offloadd.errors import DaemonUnavailable, OffloaddError, RequestFailed
from offloadd.vllm.mirror import KeyMirror
from offloadd.vllm.probes import Probe, TierProbes
from offloadd.vllm.stats import ManagerStats
from offloadd.vllm.stores import Stores
from offloadd.vllm.transfer_specs import OffloaddLoadSpec
from protocol.config import OffloadingConfig
from protocol.errors import ErrorCode
from protocol.messages import HoldKeys, KeysChanged

logger = logging.getLogger(__name__)

_SESSION_GONE = frozenset({ErrorCode.NOT_REGISTERED, ErrorCode.ENGINE_NOT_READY})
# The daemon is stopping (a planned restart): it takes no holds or reservations; as if away.
_LEAVING = frozenset({ErrorCode.SHUTTING_DOWN})

_PROBE_RESULTS = {
    Probe.PENDING: LookupResult.HIT_PENDING,
    Probe.MISS: LookupResult.MISS,
    Probe.RETRY: LookupResult.RETRY,
}

TICK_SECONDS = 0.02  # background: read notices and acknowledge them this often
KEEPALIVE_SECONDS = 1.0  # background: prove the session (and reconnect) when idle this long
KEEPALIVE_TIMEOUT_SECONDS = 0.3  # the lock is held meanwhile: keep it short
# An exchange inside a step waits at most this long: a daemon that is away costs one step at
# most this plus a keepalive holding the lock (STEP_BOUND_SECONDS), then nothing is asked of
# it until the background thread has a new session.
STEP_TIMEOUT_SECONDS = 0.3
STEP_BOUND_SECONDS = STEP_TIMEOUT_SECONDS + KEEPALIVE_TIMEOUT_SECONDS


class OffloaddManager(OffloadingManager):
    """vLLM's scheduler-side manager backed by offloadd; see the module docstring."""

    def __init__(
        self,
        config: OffloadingConfig,
        *,
        endpoint: str,
        optional: bool,
        record_events: bool,
        timeout: float = 10.0,
    ) -> None:
        self._config = config
        self._endpoint = endpoint
        self._timeout = timeout
        self._lock = threading.Lock()
        self._mirror = KeyMirror(record_events=record_events)
        self._probes = TierProbes()
        self._stats = ManagerStats(config)
        self._acked = 0
        self._stores = Stores()  # what this scheduler stores, until the mirror shows it
        self._holds: dict[str, list[bytes]] = {}  # not yet sent to the daemon
        # The load specs of those holds: a hold the daemon does not take is a lost hold, and
        # its spec is told so before it leaves the scheduler (the ranks load by key then).
        self._unsent_loads: dict[str, list[OffloaddLoadSpec]] = {}
        self._welcome: object = None  # the session the mirror belongs to
        self._releases: dict[str, list[bytes]] = {}
        self._last_request = time.monotonic()
        self._client: OffloadClient | None = None
        self._stop = threading.Event()
        try:
            self._client = self._connect()
        except DaemonUnavailable:
            if not optional:
                raise DaemonUnavailable(
                    f"offloadd: no daemon answers at {endpoint}; start it "
                    "(offloadd serve / systemctl start offloadd), point offloadd_endpoint at it, "
                    'or set "offloadd_optional": true to run without offload until it appears'
                ) from None
            logger.warning("offloadd: no daemon at %s; running without offload for now", endpoint)
        self._thread = threading.Thread(
            target=self._background, name="offloadd-mirror", daemon=True
        )
        self._thread.start()

    @property
    def lock(self) -> threading.Lock:
        """Held by vLLM around every call, and by the background thread."""
        return self._lock

    # -- lookups and loads ---------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT for a committed key (from the mirror); HIT_PENDING while this engine stores it
        (until its commit reaches the mirror) or the daemon promotes it from a lower tier;
        RETRY while that is being asked."""
        if key in self._mirror.keys:
            return LookupResult.HIT
        if self._stores.pending(key):
            return LookupResult.HIT_PENDING
        client = self._client
        if client is None or client.welcome is None or not client.welcome.tiers:
            return LookupResult.MISS
        return _PROBE_RESULTS[self._probes.lookup(req_context.req_id, key)]

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> OffloaddLoadSpec:
        """Hold the keys for the request (sent before the ranks load them)."""
        token = req_context.req_id
        self._holds.setdefault(token, []).extend(keys)
        self._stats.loading(len(keys))
        spec = OffloaddLoadSpec(list(keys), token)
        self._unsent_loads.setdefault(token, []).append(spec)
        return spec

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Release the request's holds (sent with the next message)."""
        self._releases.setdefault(req_context.req_id, []).extend(keys)
        self._stats.loaded(len(keys))

    # -- stores --------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """The keys worth storing, answered here: the step's ``Reserve`` at
        ``on_schedule_end`` marks those the daemon gives no room skipped in the spec."""
        candidates: list[bytes] = []
        if self._client is not None:
            candidates = self._stores.candidates(keys, self._mirror.keys)
            self._stats.allocated(len(candidates))
        spec = self._stores.queue(req_context.req_id, candidates)
        return PrepareStoreOutput(cast("list[OffloadKey]", candidates), spec, [])

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """The ranks stored ``keys``; waits for nothing: each answers HIT_PENDING until its
        commit reaches the mirror."""
        self._stores.complete(req_context.req_id, keys, self._mirror.keys)

    # -- per step --------------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Chunk-level offload: prefix hits are not stored again."""
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """The step's one message: its reservations, holds, releases and acknowledgement,
        before its specs reach the ranks; then ask the daemon about the step's keys missing
        from the mirror (tiers)."""
        if self._stores.queued_keys():
            self._reserve_step()
        else:
            self._flush()
        self._ask_tiers()

    def has_pending_work(self) -> bool:
        """While stored keys wait for their commit notices (a second at most), vLLM keeps
        stepping, so their events (``take_events``, called each step) are not held back
        until the next request; so do changes the background thread applied meanwhile."""
        return self._stores.committing() or self._mirror.has_events

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The namespace's stored and removed chunks, as vLLM publishes them for this engine."""
        for removed, keys in self._mirror.take_events():
            yield OffloadingEvent(
                keys=cast("list[OffloadKey]", keys), medium=Medium.CPU, removed=removed
            )

    def reset_cache(self) -> None:
        """Drop every chunk of the engine's namespace in the daemon, and forget what this
        scheduler was storing or asking the tiers: vLLM flushes those jobs, and the daemon's
        Clear ends this scheduler's open reservations, so none of them commits after it."""
        self._stores.reset()
        self._probes = TierProbes()
        if self._client is None:
            return
        try:
            count = self._client.clear()
        except OffloaddError as exc:
            self._failed("clear", exc)
            return
        self._after_request()
        logger.info("offloadd: cache reset, %d chunks dropped", count)

    # -- metrics (vLLM's vllm:kv_offload_* series; offloadd.vllm.stats) ---------------------------

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """Loads come from host memory (a tier's keys are promoted there first), as for
        vLLM's CPU spec: ``vllm:prompt_tokens_cached_by_source{source="host"}``."""
        return CacheHitSource.HOST

    def get_stats(self) -> OffloadingConnectorStats:
        """Usage and allocation sizes since the last call (vLLM calls it every step)."""
        if self._stats.capacity_bytes is None and self._client is not None:
            try:
                self._stats.capacity_bytes = self._client.stats().capacity_bytes
            except OffloaddError as exc:
                self._failed("stats", exc)
            else:
                self._after_request()
        return self._stats.take(storing_chunks=self._stores.storing)

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """``vllm:kv_offload_config_info``: the daemon's capacity in this engine's chunks."""
        return self._stats.config_info()

    def shutdown(self) -> None:
        """Stop the background thread and end the session."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # -- internals -------------------------------------------------------------------------------

    def _connect(self, timeout: float | None = None) -> OffloadClient:
        client = OffloadClient.connect(
            self._endpoint,
            self._config,
            role="scheduler",
            name=f"vllm scheduler {self._config.engine_id}",
            mirror=True,
            timeout=self._timeout if timeout is None else timeout,
        )
        # Asked inside vLLM's steps from now on: a daemon that went away must not stall one.
        client.timeout = min(self._timeout, STEP_TIMEOUT_SECONDS)
        return client

    def _reserve_step(self) -> None:
        """One ``Reserve`` for every store of the step, with its holds, releases and ack;
        what it did not reserve (or a daemon that did not answer) is not stored."""
        keys = self._stores.queued_keys()
        client = self._client
        if client is None:
            skipped = self._stores.settle(())
            logger.warning("offloadd: no daemon; %d keys of the step not stored", skipped)
            return
        holds, releases = self._take_holds(), self._take_releases()
        try:
            reply = client.reserve(keys, holds=holds, release=releases, ack=self._mirror.seq)
        except OffloaddError as exc:
            self._stores.settle(())
            self._failed(f"reserve of {len(keys)} keys", exc, holds)
            return
        self._acked = self._mirror.seq
        self._holds_taken(holds, set(reply.missing))
        self._after_request()  # the notices first: a new session forgets the old one's
        self._stores.settle(reply.reserved)

    def _flush(self) -> None:
        client = self._client
        if client is None:
            return
        holds, releases = self._take_holds(), self._take_releases()
        if not (holds or releases or self._mirror.seq > self._acked):
            return
        try:
            if holds or releases:
                result = client.update_holds(holds, releases, ack=self._mirror.seq)
                self._holds_taken(holds, set(result.missing))
            else:
                client.ack(self._mirror.seq)
        except OffloaddError as exc:
            self._failed("update holds", exc, holds)
            return
        self._acked = self._mirror.seq
        self._after_request()

    def _ask_tiers(self) -> None:
        """One Lookup per request whose keys answered RETRY: the daemon promotes what its
        tiers hold and says which keys are on their way."""
        self._probes.forget_expired()
        for keys in self._probes.take_queued():
            client = self._client
            if client is None:
                return
            try:
                result = client.lookup(keys)
            except OffloaddError as exc:
                self._failed("lookup in the tiers", exc)
                return
            self._after_request()
            self._probes.answered(keys, result.hits, result.pending)

    def _take_holds(self) -> list[HoldKeys]:
        holds = [HoldKeys(token, keys) for token, keys in self._holds.items()]
        self._holds = {}
        return holds

    def _holds_taken(self, holds: Sequence[HoldKeys], missing: Collection[bytes] = ()) -> None:
        """The daemon took ``holds`` but ``missing`` keys: a spec with one of those lost its
        hold."""
        for hold in holds:
            for spec in self._unsent_loads.pop(hold.token, []):
                if any(key in missing for key in spec.keys):
                    self._hold_lost(spec)

    def _holds_lost(self, holds: Sequence[HoldKeys]) -> None:
        for hold in holds:
            for spec in self._unsent_loads.pop(hold.token, []):
                self._hold_lost(spec)

    @staticmethod
    def _hold_lost(spec: OffloaddLoadSpec) -> None:
        """Nothing keeps the keys for this load: the ranks ask for them by key, from whatever
        daemon answers, and fail loudly only if they are gone."""
        logger.warning(
            "offloadd: hold %r refused; its ranks load %d keys by key", spec.hold, len(spec.keys)
        )
        spec.hold = ""

    def _take_releases(self) -> list[HoldKeys]:
        releases = [HoldKeys(token, keys) for token, keys in self._releases.items()]
        self._releases = {}
        return releases

    def _after_request(self) -> None:
        """Apply what arrived with the last exchange (notices come before its reply)."""
        self._last_request = time.monotonic()
        self._take_notices()

    def _take_notices(self) -> None:
        """Apply the notices that arrived, those of a new session only after forgetting the
        old one's (the background thread may read a new session's snapshot first)."""
        client = self._client
        if client is None:
            return
        if client.welcome is not self._welcome:
            # The client said Hello again by itself (the daemon restarted or reaped us): the
            # old session's keys, reservations and answers mean nothing to the new one.
            self._welcome = client.welcome
            self._forget_session()
        self._apply(client.take_notices())

    def _forget_session(self) -> None:
        """Every key misses until the new session's snapshot."""
        self._mirror.clear()
        self._stores.forget()
        self._probes = TierProbes()
        self._acked = 0

    def _apply(self, notices: list[KeysChanged]) -> None:
        self._mirror.apply(notices)
        for notice in notices:
            self._stores.committed(notice.stored)
        if len(self._probes):
            # A key that left the arena may be in a tier now: an earlier miss is stale.
            self._probes.forget(key for notice in notices for key in notice.removed)

    def _failed(self, what: str, exc: Exception, holds: Sequence[HoldKeys] = ()) -> None:
        """Log a failed exchange; the holds it carried are lost. A daemon that is away, or a
        session it no longer knows (``NOT_REGISTERED``) or whose engine waits for its ranks
        (``ENGINE_NOT_READY``), empties the mirror: every lookup misses until the (new)
        session's snapshot. A daemon that is stopping (``SHUTTING_DOWN``) counts as away:
        the background thread connects again once a daemon takes the Hello."""
        self._holds_lost(holds)
        if isinstance(exc, RequestFailed) and exc.code not in _SESSION_GONE | _LEAVING:
            logger.warning("offloadd: %s refused: %s", what, exc)
            return
        logger.warning("offloadd: %s failed: %s; every key misses for now", what, exc)
        if isinstance(exc, RequestFailed) and exc.code in _SESSION_GONE:
            self._forget_session()
        else:
            self._disconnect()

    def _disconnect(self) -> None:
        """The daemon stopped answering: every key misses until a new session's snapshot."""
        client, self._client = self._client, None
        if client is not None:
            client.close(goodbye=False)
        self._forget_session()
        self._holds_lost(self._take_holds())
        self._last_request = time.monotonic()  # the background thread reconnects after a pause

    def _background(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            if self._client is None:
                self._try_reconnect()
                continue
            if not self._lock.acquire(blocking=False):
                continue  # vLLM is scheduling: it reads notices itself
            try:
                self._tick()
            except Exception:
                logger.exception("offloadd: background tick failed")
            finally:
                self._lock.release()

    def _tick(self) -> None:
        client = self._client
        assert client is not None
        client.poll(0)
        self._take_notices()
        if time.monotonic() - self._last_request > KEEPALIVE_SECONDS:
            # A real exchange: a daemon that restarted is noticed here (and said Hello to
            # again, which sends a fresh snapshot), not at the next step's holds.
            self._flush_or_ping()
        elif self._mirror.seq > self._acked:
            client.ack(self._mirror.seq)
            self._acked = self._mirror.seq

    def _flush_or_ping(self) -> None:
        client = self._client
        assert client is not None
        try:
            client.keepalive(KEEPALIVE_TIMEOUT_SECONDS)
        except OffloaddError as exc:
            self._failed("keepalive", exc)
            return
        self._after_request()

    def _try_reconnect(self) -> None:
        if time.monotonic() - self._last_request < KEEPALIVE_SECONDS:
            return
        self._last_request = time.monotonic()
        try:
            client = self._connect(STEP_TIMEOUT_SECONDS)
        except OffloaddError:
            return
        with self._lock:
            self._client = client
            self._after_request()
        logger.info("offloadd: connected to %s; offloading from now on", self._endpoint)

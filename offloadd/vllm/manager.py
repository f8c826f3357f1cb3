"""The scheduler side: vLLM's ``OffloadingManager`` over the daemon, one per engine.

Design (see docs/vllm.md, docs/design.md): vLLM calls ``lookup`` once per key inside
``schedule()``, so lookups are answered from a local mirror of the namespace's committed keys
(``KeyMirror``, fed by the daemon's ``KeysChanged``), a set probe. A step costs at most one
message to the daemon inside ``schedule()``, whatever the batch, and nothing inside
``schedule()`` waits for the daemon. The message is sent at ``on_schedule_end`` (vLLM 0.33's
last manager call of the step, after every ``prepare_store`` and before the step's metadata,
the store and load specs, leaves the scheduler for the ranks), without blocking (zmq
``NOBLOCK``; a message that cannot go now counts as "do not store / miss"):
- a ``Reserve`` of every key the step's ``prepare_store`` calls chose (answered locally:
  ``offloadd.vllm.stores``), carrying the step's holds, due releases, the mirror's
  acknowledgement and its tier probes (``lookups``);
- else an ``UpdateHolds`` (holds, releases or probes to send), else an ``Ack``.
Its answers are read later without blocking: at the next ``on_schedule_end`` or by the
link's thread (which alone reads what arrives while steps have nothing to send or wait
for: ``_quiet``). The ranks store every key of the spec with ``Store(reserved=True)``,
which the daemon writes only where this engine's scheduler reserved it (never allocating),
so a key the late ``Reserved`` did not reserve is simply not cached (``Stores.answered``
takes it out of HIT_PENDING). Should the daemon read a rank's Store before the step's
Reserve (both queued while it stalls: the Reserve leaves first, on another socket), those
keys are skipped likewise and the reservation ends by its lease
(``limits.reservation_seconds``): bounded, never wrong.

A key the mirror answered as a hit stays loadable until its load completes, whatever
happens to its hold (``offloadd.vllm.mirror``): the daemon keeps a removed key's bytes until
this scheduler acknowledged the removal, and the acknowledgement never covers the removal of
a key being loaded (``KeyMirror.ackable``). So a hold the daemon did not take (``missing``:
no room in the engine's share) needs no answer, and neither does a hold late behind its
rank's ``Load(hold=token)``: the rank's load reads by key (the removed key's bytes too). A
step that cannot be sent (no daemon, send refused, or ``MAX_UNANSWERED_STEPS`` unanswered)
marks its stores skipped before the specs leave; its holds go with the next message, and a
new session is sent the holds of every load not complete (``KeyMirror.loads``). The step's
Reserve is posted (``Reserve.posted``): its evictions wait for this scheduler's
acknowledgement, since its next step may look a key up before it read their removal.
``complete_store`` waits for nothing: a key the ranks stored answers ``HIT_PENDING`` until
its commit reaches the mirror (a second at most).

A refused step (an ``Error`` answer) is logged and counted (``refused_steps``,
``refused_keys``); ``SHUTTING_DOWN``, a step unanswered for ``ANSWER_TIMEOUT_SECONDS`` or a
keepalive whose session the daemon forgot (``Ok(0)``: it restarted) mean the daemon is away:
the session is dropped (every key misses) and the link connects again.

A daemon with tiers below its arena (disk, cluster; ``Welcome.tiers``) may hold a key the
mirror lacks. Such a key answers ``RETRY`` and is asked of the daemon in the step's message
(one ``Lookup`` per request that has such keys, inside the one message); the daemon promotes
what it finds into the arena and says which keys are on their way, which then answer
``HIT_PENDING`` until their commit reaches the mirror (``offloadd.vllm.probes``).

Threads: vLLM calls every method but ``shutdown`` holding ``lock``. The one other thread is
the engine's ``SessionLink`` (``offloadd.vllm.link``): its heartbeat needs no lock; every
``TICK_SECONDS`` it takes the same lock (never blocking for it) to read notices and answers,
acknowledge them and post a keepalive while the engine idles (``_tick``), so the socket is
only ever used under ``lock``; without a session it connects again by the link's policy, off
the lock. Bound on ``schedule()``'s waits: none on the daemon; the lock may be held by one
tick, which only reads what already arrived and sends without blocking (no round trip).
Only ``reset_cache`` (vLLM's cache reset) and the first ``get_stats`` (the daemon's
capacity, once) still wait for a reply, ``STEP_TIMEOUT_SECONDS`` at most.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
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
from offloadd.errors import DaemonUnavailable, OffloaddError, RequestFailed, error_from_reply
from offloadd.vllm.link import SessionLink
from offloadd.vllm.mirror import KeyMirror
from offloadd.vllm.prefix_use import PrefixUse
from offloadd.vllm.probes import Probe, TierProbes
from offloadd.vllm.stats import ManagerStats
from offloadd.vllm.stores import StepStores, Stores
from offloadd.vllm.transfer_specs import OffloaddLoadSpec
from protocol.config import OffloadingConfig
from protocol.errors import ErrorCode
from protocol.messages import Error, HoldKeys, HoldResult, KeysChanged, Ok, Reply, Reserved
from protocol.messages import LookupResult as DaemonLookupResult

logger = logging.getLogger(__name__)

_SESSION_GONE = frozenset({ErrorCode.NOT_REGISTERED, ErrorCode.ENGINE_NOT_READY})
# The daemon is stopping (a planned restart): it takes no holds or reservations; as if away.
_LEAVING = frozenset({ErrorCode.SHUTTING_DOWN})

_PROBE_RESULTS = {
    Probe.PENDING: LookupResult.HIT_PENDING,
    Probe.MISS: LookupResult.MISS,
    Probe.RETRY: LookupResult.RETRY,
}

TICK_SECONDS = 0.02  # the link: read notices and answers, acknowledge them this often
KEEPALIVE_SECONDS = 1.0  # the link: prove the session when idle this long
# A step message or keepalive unanswered this long: the daemon is away (stopped, frozen,
# far behind); the session is dropped and every key misses until a new one. The daemon's own
# bound on a silent mirror (mirror_ack_timeout's default): 1 s dropped live sessions under load.
ANSWER_TIMEOUT_SECONDS = 5.0
# Steps sent and not answered yet, at most: beyond, a step is not sent (its stores skipped,
# its holds lost), so a stalled daemon is not handed a backlog of stale reservations.
MAX_UNANSWERED_STEPS = 8
# The exchanges still awaited (cache reset, the capacity once) wait at most this long.
STEP_TIMEOUT_SECONDS = 0.3
# What a step waits for the daemon, at most, whatever the daemon does: nothing (no step
# message is awaited, the link's thread never waits holding the lock).
STEP_BOUND_SECONDS = 0.0


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
        self._link = SessionLink(endpoint, f"scheduler {config.engine_id}", tick=TICK_SECONDS)
        self._lock = self._link.lock
        self._mirror = KeyMirror(record_events=record_events)
        self._probes = TierProbes()
        self._reset_due = False  # a cache reset no daemon has taken yet
        self._stats = ManagerStats(config)
        self._acked = 0
        self._stores = Stores()  # what this scheduler stores, until the mirror shows it
        self._prefix_use = PrefixUse()  # keys its requests use from the GPU, to touch
        self._holds: dict[str, list[bytes]] = {}  # not yet sent to the daemon
        self._welcome: object = None  # the session the mirror belongs to
        self._releases: dict[str, list[bytes]] = {}
        # Posted requests whose answer is due: request id -> what applies it.
        self._due: dict[int, Callable[[Reply], None]] = {}
        self._unanswered_steps: dict[int, float] = {}  # step messages (and pings): sent at
        self.refused_steps = 0  # step messages the daemon refused (an Error answer)
        self.refused_keys = 0  # keys of sent steps it did not reserve
        self.unsent_steps = 0  # steps not sent (no daemon, too many unanswered)
        self._last_request = time.monotonic()
        self._capacity_asked = -KEEPALIVE_SECONDS  # get_stats asks it once, a second apart
        self._client: OffloadClient | None = None
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
        self._link.start(
            client=lambda: self._client,
            connect=self._connect_again,
            adopt=self._adopt,
            idle=self._tick,
        )

    @property
    def lock(self) -> threading.Lock:
        """Held by vLLM around every call, and by the link's thread."""
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
        self._mirror.start_loading(token, keys)
        self._stats.loading(len(keys))
        return OffloaddLoadSpec(list(keys), token)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Release the request's holds (sent with the next message); the keys' removals
        may be acknowledged from now on."""
        token = req_context.req_id
        self._releases.setdefault(token, []).extend(keys)
        self._mirror.finish_loading(token, keys)
        self._stats.loaded(len(keys))

    # -- stores --------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """The keys worth storing, answered here; the step's ``Reserve`` goes at
        ``on_schedule_end`` (a key the daemon gives no room is not cached)."""
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
        self._prefix_use.started(req_context.req_id, req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._prefix_use.finished(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Apply what arrived, then post the step's one message: its reservations, holds,
        releases, acknowledgement, tier probes and the cached keys its new requests use
        (``PrefixUse``: touched, they go with the next message that goes anyway), before its
        specs reach the ranks. Waits for nothing. A quiet step touches no socket
        (``_quiet``)."""
        self._prefix_use.scheduled(context.new_req_ids, self._mirror.keys)
        if self._quiet():
            return
        self._read()
        self._send_step()

    def _quiet(self) -> bool:
        """Nothing to send, and nothing on its way that a lookup waits for (this scheduler's
        stores not yet in the mirror, tier probes asked). What still arrives meanwhile
        (other engines' keys, removals to acknowledge) waits for the background thread's
        tick. Why: a step's first zmq call, with the caches cold from vLLM's own work, was
        the manager's largest cost in a decode step (20-40 us of its 70-90 here)."""
        return not (
            self._stores.has_queued
            or self._holds
            or self._releases
            or self._probes.has_queued
            or self._probes.awaiting
            or self._stores.awaiting_commits
        )

    def steps_answered(self) -> bool:
        """Apply what has arrived (never waits); True once every step message sent has its
        answer applied. Not vLLM's: a benchmark driving the manager by hand waits on it
        where vLLM's ranks would run the step before storing."""
        self._read()
        return not self._unanswered_steps

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
        Clear ends this scheduler's open reservations, so none of them commits after it.
        The Clear is waited for (``offloadd_timeout`` at most): a chunk it left behind would be
        a stale hit. A dropped session connects again for it; with no daemon answering, the
        next session clears before it offloads anything."""
        self._stores.reset()
        self._probes = TierProbes()
        # vLLM completes none of the loads the reset flushed: their holds are released now.
        for token, keys in self._mirror.forget_loads().items():
            self._releases.setdefault(token, []).extend(keys)
        self._reset_due = True
        client = self._client
        if client is None:  # a dropped session: the daemon still holds the namespace's chunks
            try:
                client = self._client = self._connect()
            except OffloaddError as exc:
                logger.warning("offloadd: cache reset waits for the daemon: %s", exc)
                return  # the next session clears before it offloads (_connect_again)
        self._clear(client)

    def _clear(self, client: OffloadClient) -> None:
        """The reset's Clear, under the lock (vLLM's ``reset_prefix_cache``); ``_reset_due``
        until it is done."""
        try:
            count = _cleared(client, self._timeout)
        except OffloaddError as exc:
            self._failed("clear", exc)
            return
        self._reset_due = False
        self._after_request()
        logger.info("offloadd: cache reset, %d chunks dropped", count)

    # -- metrics (vLLM's vllm:kv_offload_* series; offloadd.vllm.stats) ---------------------------

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """Loads come from host memory (a tier's keys are promoted there first), as for
        vLLM's CPU spec: ``vllm:prompt_tokens_cached_by_source{source="host"}``."""
        return CacheHitSource.HOST

    def get_stats(self) -> OffloadingConnectorStats:
        """Usage and allocation sizes since the last call (vLLM calls it every step)."""
        now = time.monotonic()
        if (
            self._stats.capacity_bytes is None
            and self._client is not None
            and now >= self._capacity_asked + KEEPALIVE_SECONDS
        ):
            self._capacity_asked = now
            try:
                self._stats.capacity_bytes = self._client.stats().capacity_bytes
            except DaemonUnavailable as exc:
                # A busy daemon's late answer says nothing of the session (the step
                # messages and keepalives judge that): asked again a second later.
                logger.debug("offloadd: the daemon's capacity not known yet: %s", exc)
            except OffloaddError as exc:
                self._failed("stats", exc)
            else:
                self._after_request()
        return self._stats.take(storing_chunks=self._stores.storing)

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """``vllm:kv_offload_config_info``: the daemon's capacity in this engine's chunks."""
        return self._stats.config_info()

    def shutdown(self) -> None:
        """Stop the link's thread and end the session."""
        self._link.close()
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
            heartbeat=0,  # the link sends them
        )
        # The few exchanges still awaited (cache reset, the capacity once) wait this long.
        client.timeout = min(self._timeout, STEP_TIMEOUT_SECONDS)
        return client

    def _read(self) -> None:
        """Apply the notices and answers already here (never waits); give a daemon that
        left a step unanswered too long up."""
        client = self._client
        if client is None:
            return
        client.poll(0)
        self._take_notices()
        oldest = next(iter(self._unanswered_steps.values()), None)
        if oldest is not None and time.monotonic() - oldest > ANSWER_TIMEOUT_SECONDS:
            self._failed(
                "step",
                DaemonUnavailable(f"no answer within {ANSWER_TIMEOUT_SECONDS:.1f}s"),
            )

    def _send_step(self) -> None:
        """The step's one message, posted; see the module docstring."""
        client = self._client
        stores = self._stores.take() if self._stores.has_queued else None
        self._probes.forget_expired()
        probes = self._probes.take_queued()
        if client is None or len(self._unanswered_steps) >= MAX_UNANSWERED_STEPS:
            self._unsent(stores, probes, "no daemon" if client is None else "daemon behind")
            if client is None:
                self._releases = {}  # nothing is held without a session
            return
        holds, releases = self._take_holds(), self._take_releases()
        ack = self._mirror.ackable
        try:
            if stores is not None:
                ids = client.post_reserve(
                    stores.keys,
                    holds=holds,
                    release=releases,
                    ack=ack,
                    lookups=probes,
                    touch=self._prefix_use.take(),
                )
            elif holds or releases or probes:
                ids = client.post_update_holds(
                    holds, releases, ack=ack, lookups=probes, touch=self._prefix_use.take()
                )
            elif ack > self._acked:
                client.ack(ack)
                ids = []
            else:
                return
        except OffloaddError as exc:
            self._requeue(holds, releases)
            self._unsent(stores, probes, str(exc))
            self._failed("step", exc)
            return
        self._acked = ack
        self._last_request = now = time.monotonic()
        if not ids:
            return
        if stores is not None and client.welcome is not None:
            reserve = (client.welcome.session_id, ids[0])
            for _token, spec in stores.specs:
                spec.reserve = reserve
        self._unanswered_steps[ids[0]] = now
        self._due[ids[0]] = functools.partial(self._step_answered, stores=stores)
        for lookup_id, keys in zip(ids[1:], probes, strict=True):
            self._due[lookup_id] = functools.partial(self._probe_answered, keys=keys)

    def _unsent(self, stores: StepStores | None, probes: list[list[bytes]], why: str) -> None:
        """The step could not go: its specs skip its stores (they have not left yet); its
        holds and releases wait for the next message (its loads read by key meanwhile)."""
        if stores is None and not self._holds and not probes:
            return
        self.unsent_steps += 1
        skipped = self._stores.skip(stores) if stores is not None else 0
        for keys in probes:
            self._probes.unanswered(keys)
        if skipped:
            logger.warning("offloadd: %s; %d keys of the step not stored", why, skipped)

    def _step_answered(self, reply: Reply, *, stores: StepStores | None) -> None:
        """A step's late answer: keys it did not reserve are stored by nobody; holds it did
        not take load by key (nothing to do: the ranks' Load falls back by itself)."""
        if isinstance(reply, Error):
            self.refused_steps += 1
            if stores is not None:
                self.refused_keys += self._stores.answered(stores, ())
            self._failed(
                f"step of {len(stores.keys) if stores else 0} keys", error_from_reply(reply)
            )
            return
        missing: Collection[bytes] = ()
        if isinstance(reply, Reserved):
            assert stores is not None
            self.refused_keys += self._stores.answered(stores, reply.reserved)
            missing = reply.missing
        elif isinstance(reply, HoldResult):
            missing = reply.missing
        if missing:
            logger.info(
                "offloadd: %d keys not held by the daemon (no room in the engine's share); "
                "their ranks load them by key",
                len(missing),
            )

    def _probe_answered(self, reply: Reply, *, keys: list[bytes]) -> None:
        if isinstance(reply, DaemonLookupResult):
            self._probes.answered(keys, reply.hits, reply.pending)
            return
        self._probes.unanswered(keys)
        if isinstance(reply, Error):
            logger.warning("offloadd: lookup in the tiers refused: %s", reply.message)

    def _take_answers(self) -> None:
        client = self._client
        if client is None:
            return
        for reply in client.take_answers():
            request_id = getattr(reply, "request_id", -1)
            self._unanswered_steps.pop(request_id, None)
            due = self._due.pop(request_id, None)
            if due is not None:
                due(reply)
            if self._client is not client:
                return  # the session was given up: its other answers mean nothing

    def _take_holds(self) -> list[HoldKeys]:
        holds = [HoldKeys(token, keys) for token, keys in self._holds.items()]
        self._holds = {}
        return holds

    def _requeue(self, holds: Sequence[HoldKeys], releases: Sequence[HoldKeys]) -> None:
        """A message that did not go: its holds and releases go with the next one (before
        this step's own, which came later)."""
        for queue, items in ((self._holds, holds), (self._releases, releases)):
            later = dict(queue)
            queue.clear()
            for item in items:
                queue.setdefault(item.token, []).extend(item.keys)
            for token, keys in later.items():
                queue.setdefault(token, []).extend(keys)

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
        self._take_answers()

    def _forget_session(self) -> None:
        """Every key misses until the new session's snapshot; the loads not complete are
        held again in it (the old session's holds and releases ended with it)."""
        self._mirror.clear()
        self._holds = self._mirror.loads()
        self._releases = {}
        self._stores.forget()
        self._probes = TierProbes()
        self._acked = 0
        self._due.clear()
        self._unanswered_steps.clear()

    def _apply(self, notices: list[KeysChanged]) -> None:
        self._mirror.apply(notices)
        for notice in notices:
            self._stores.committed(notice.stored)
        if len(self._probes):
            # A key that left the arena may be in a tier now: an earlier miss is stale.
            self._probes.forget(key for notice in notices for key in notice.removed)

    def _failed(self, what: str, exc: Exception) -> None:
        """Log a failed exchange. A daemon that is away, or a
        session it no longer knows (``NOT_REGISTERED``) or whose engine waits for its ranks
        (``ENGINE_NOT_READY``), or that is stopping (``SHUTTING_DOWN``), ends the session and
        empties the mirror: every lookup misses until a new session's snapshot (the link
        connects again, off the lock, once a daemon takes the Hello)."""
        if isinstance(exc, RequestFailed) and exc.code not in _SESSION_GONE | _LEAVING:
            logger.warning("offloadd: %s refused: %s", what, exc)
            return
        logger.warning("offloadd: %s failed: %s; every key misses for now", what, exc)
        self._disconnect()  # the link connects again (a new session)

    def _disconnect(self) -> None:
        """The daemon stopped answering: every key misses until a new session's snapshot."""
        client, self._client = self._client, None
        if client is not None:
            client.close(goodbye=False)
        self._forget_session()  # the link connects again after a pause

    def _tick(self) -> None:
        """The link's idle work, under the lock; never waits: reads what arrived, posts what
        is due."""
        self._read()
        client = self._client
        if client is None:
            return
        try:
            if time.monotonic() - self._last_request > KEEPALIVE_SECONDS:
                # A daemon that restarted answers Ok(0) (it does not know this session):
                # noticed here, not at the next step's holds.
                self._post_ping(client)
            elif self._mirror.ackable > self._acked:
                client.ack(self._mirror.ackable)
                self._acked = self._mirror.ackable
        except OffloaddError as exc:
            self._failed("keepalive", exc)

    def _post_ping(self, client: OffloadClient) -> None:
        request_id = client.post_ping()
        self._last_request = now = time.monotonic()
        self._unanswered_steps[request_id] = now
        self._due[request_id] = self._pinged

    def _pinged(self, reply: Reply) -> None:
        if isinstance(reply, Ok) and reply.count == 0:
            self._failed("keepalive", DaemonUnavailable("the daemon no longer knows this session"))

    def _connect_again(self, timeout: float) -> OffloadClient:
        """The link's new session (off the lock); first the cache reset the last session
        could not pass on (``_reset_due``)."""
        client = self._connect(timeout)
        if self._reset_due:
            try:
                logger.info(
                    "offloadd: cache reset, %d chunks dropped", _cleared(client, self._timeout)
                )
            except OffloaddError as exc:
                logger.warning("offloadd: cache reset still waits for the daemon: %s", exc)
                client.close(goodbye=False)
                raise
        return client

    def _adopt(self, client: OffloadClient) -> bool:
        """Under the lock: the link's new session, unless ``reset_cache`` connected first."""
        if self._client is not None:
            return False
        self._reset_due = False
        self._client = client
        self._after_request()
        return True


def _cleared(client: OffloadClient, timeout: float) -> int:
    """A cache reset's Clear, waited for up to ``timeout`` (a reset is rare, and a chunk it
    left would be a stale hit), not the step's bound; how many chunks it dropped."""
    step_timeout, client.timeout = client.timeout, timeout
    try:
        return client.clear()
    finally:
        client.timeout = step_timeout

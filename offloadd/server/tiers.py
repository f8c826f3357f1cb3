"""The tiers below the arena as the daemon sees them: write-through, probes, promotions.

``Tiers`` keeps every tier's blocking calls on that tier's own worker thread (``_Worker``:
one call at a time, as ``offloadd.tiers.base`` promises the tiers) and everything else on the
daemon's loop: the cache, the announcements, the queues. A call's result comes back to the
loop through ``call_soon_threadsafe``. A slow or dead tier therefore never blocks the loop.

Contract of ``Tiers`` (the event loop's thread only):
- ``committed(namespace, entries, source)`` (the ``Announcer`` calls it for every commit,
  promotions included): each chunk is queued for every tier but ``source`` ("demote early,
  evict free": a chunk later evicted from the arena is already below it). A queued chunk is
  held against eviction (a cache reader, ``begin_reads``) until its ``put`` ended. Beyond a
  tier's queue bound (``queue_bytes``, at most a quarter of the arena) only the chunk's name
  waits (in a backlog of at most ``BACKLOG_KEYS``, holding nothing); as the queue drains,
  backlog chunks still in the arena are queued, and those evicted meanwhile, or beyond the
  backlog, are skipped and counted. Nothing is ever waited for. Each ``put`` takes
  everything queued (up to ``BATCH_CHUNKS``).
- ``cleared(namespace)``: the engine cleared its namespace: queued chunks of it are dropped
  and every tier forgets it (after the calls already on its thread). Plain evictions from
  the arena never remove tier copies: that is the point of them.
- ``probe(namespace, keys, hits, pending, answer)``: a lookup whose arena hits stop at
  ``hits``: the keys after them that the arena does not have are looked for in the tiers, in
  order (a key in any tier counts; the walk stops at the first key in none); the keys found
  are promoted and their indices returned, to be reported pending. A tier whose ``contains``
  may run on the loop (``TierSlot.inline``, the disk's in-memory index) answers at once; one
  that may not (the cluster) is asked on its thread: ``probe`` returns None and calls
  ``answer(indices)`` later, within ``lookup_timeout`` (what it has not heard by then counts
  as a miss).
- A promotion reserves the chunk's entry in the cache (every shard, under an owner of its
  own), ``get``s every chunk pending for that tier in one call, then commits the chunks the
  tier verified through the same ``offloadd.server.commit.Committer`` as a rank's store
  (sealed, journaled, then announced: mirrors, CPU events, the other tiers) and drops the
  others, which were never visible. No room in the arena: the key and every later key are
  not promoted (misses).
- Events: a tier with a ``medium`` (vLLM 0.33's ``"STORAGE"``, with a ``locality``: the
  disk ``"LOCAL"``, the cluster ``"REMOTE"``) has its stores and evictions announced to the
  engines that want events (``Announcer.tier_stored``/``tier_removed``).
- ``stats()``: one ``TierState`` per tier. ``drain(grace)`` waits for the calls in flight,
  then closes the tiers; True when all ended (the arena may be unmapped then).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from offloadd.cache.arena import Arena
from offloadd.cache.index import ChunkCache, Entry, Reads, ShardWrite
from offloadd.logs import LogLimiter
from offloadd.server.announce import Announcer
from offloadd.server.commit import Committer
from offloadd.server.registry import Namespace
from offloadd.tiers.base import ChunkAddress, Tier, TierWrite
from protocol.messages import TierState

__all__ = ["BATCH_CHUNKS", "TierSlot", "Tiers"]

logger = logging.getLogger(__name__)

BATCH_CHUNKS = 256  # chunks per put or get call
MAX_PROBES = 8  # contains calls waiting on a thread tier; beyond, lookups count it a miss
BACKLOG_KEYS = 1 << 16  # names of chunks waiting for room in a tier's queue

T = TypeVar("T")


@dataclass(frozen=True)
class TierSlot:
    """How the daemon uses one tier: its queue bound, how it is probed, its event medium."""

    tier: Tier
    queue_bytes: int
    inline: bool = False  # contains may be called on the loop (cheap, thread-safe)
    lookup_timeout: float = 0.05  # seconds a lookup waits for a thread tier's contains
    medium: str = ""  # announce its stores and evictions with this medium ("" : none)
    locality: str | None = None  # ... and this locality


class _Worker:
    """One daemon thread running a tier's calls one at a time, in order, except that urgent
    calls (a lookup's ``contains``, which a client waits for) go before the others. Never
    joined at exit: a call stuck in the medium must not keep the process alive."""

    def __init__(self, name: str) -> None:
        self._ready = threading.Condition()
        self._urgent: deque[tuple[Future[Any], Callable[[], Any]]] = deque()
        self._calls: deque[tuple[Future[Any], Callable[[], Any]]] = deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"offloadd-tier-{name}", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], T], *, urgent: bool = False) -> Future[T]:
        future: Future[T] = Future()
        with self._ready:
            (self._urgent if urgent else self._calls).append((future, call))
            self._ready.notify()
        return future

    def stop(self) -> None:
        """End the thread once the calls submitted so far ran."""
        with self._ready:
            self._stopping = True
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not (self._urgent or self._calls or self._stopping):
                    self._ready.wait()
                if self._urgent:
                    future, call = self._urgent.popleft()
                elif self._calls:
                    future, call = self._calls.popleft()
                else:
                    return  # stopping, and nothing left
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)


@dataclass(eq=False)
class _Demotion:
    namespace: str
    entry: Entry
    reading: Reads
    nbytes: int


@dataclass(eq=False)
class _Promotion:
    namespace: Namespace
    owner: str  # the cache reservation's owner, one per promotion
    keys: list[bytes]
    writes: dict[bytes, list[ShardWrite]]
    addresses: list[ChunkAddress]


@dataclass(eq=False)
class _Slot:
    """A tier and what the loop keeps for it."""

    config: TierSlot
    worker: _Worker
    limit: int  # queued bytes at most
    demotions: deque[_Demotion] = field(default_factory=deque)
    backlog: deque[tuple[str, bytes]] = field(default_factory=deque)  # no reader held
    queued_bytes: int = 0  # waiting and being written
    promotions: list[_Promotion] = field(default_factory=list)
    putting: bool = False
    getting: bool = False
    probes: int = 0  # contains calls on the thread
    calls: int = 0  # calls submitted and not ended
    hits: int = 0
    promoted: int = 0
    promotion_failures: int = 0
    demoted: int = 0
    skipped: int = 0
    errors: int = 0

    @property
    def name(self) -> str:
        return self.config.tier.name


class _Probe:
    """One lookup's walk through the tiers; see ``Tiers.probe``."""

    def __init__(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        candidates: list[int],
        answer: Callable[[list[int]], None],
        acker: str | None,
    ) -> None:
        self.namespace = namespace
        self.keys = keys
        self.acker = acker  # the requester, when it applies the promotion's evictions first
        self.candidates = candidates  # indices after the hits that the arena does not have
        self.found: dict[int, int] = {}  # key index -> position of the tier that holds it
        self.answer = answer
        self.timer: asyncio.TimerHandle | None = None
        self.done = False

    def unresolved(self) -> list[int]:
        """Candidates no tier asked so far holds (the next tier is asked about these)."""
        return [i for i in self.candidates if i not in self.found]


class Tiers:
    """The tiers below the arena; see the module docstring."""

    def __init__(
        self,
        slots: Sequence[TierSlot],
        cache: ChunkCache,
        arena: Arena,
        announce: Announcer,
        committer: Committer,
        *,
        capacity: int | None = None,
    ) -> None:
        self._cache = cache
        self._arena = arena
        self._announce = announce
        self._committer = committer
        # A queued chunk cannot be evicted: a quarter of the arena at most waits for a tier.
        bound = (capacity if capacity is not None else arena.size) // 4
        self._slots = [
            _Slot(slot, _Worker(slot.tier.name), min(slot.queue_bytes, bound)) for slot in slots
        ]
        self._loop = asyncio.get_running_loop()
        self._owners = itertools.count()
        self._closing = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._log = LogLimiter(logger)

    @property
    def names(self) -> list[str]:
        """The tiers, in order."""
        return [slot.name for slot in self._slots]

    # ----------------------------------------------------------------- write-through

    def committed(self, namespace: str, entries: list[Entry], source: str = "") -> None:
        """Queue chunks that just committed for every tier but ``source``."""
        if self._closing or not entries:
            return
        for slot in self._slots:
            if slot.name == source:
                continue
            for entry in entries:
                if slot.backlog or not self._queue(slot, namespace, entry.key):
                    # In order: behind the backlog, or into it (names only).
                    if len(slot.backlog) < BACKLOG_KEYS:
                        slot.backlog.append((namespace, entry.key))
                    else:
                        slot.skipped += 1
            self._next_put(slot)

    def _queue(self, slot: _Slot, namespace: str, key: bytes) -> bool:
        """Queue the committed chunk ``key`` if the queue has room for it."""
        entry = self._cache.get(namespace, key)
        if entry is None or not entry.committed:
            slot.skipped += 1  # evicted (or removed) before its turn
            return True
        nbytes = entry.nbytes
        if slot.queued_bytes + nbytes > slot.limit and slot.queued_bytes:
            return False
        # A reader keeps the chunk's extents (and bytes) until the put ended.
        reading = self._cache.begin_reads(namespace, [key])
        if reading.missing:
            slot.skipped += 1
            return True
        slot.queued_bytes += nbytes
        slot.demotions.append(_Demotion(namespace, entry, reading, nbytes))
        return True

    def _next_put(self, slot: _Slot) -> None:
        if slot.putting or self._closing:
            return
        while slot.backlog and self._queue(slot, *slot.backlog[0]):
            slot.backlog.popleft()
        if not slot.demotions:
            return
        batch: list[_Demotion] = []
        while slot.demotions and len(batch) < BATCH_CHUNKS:
            demotion = slot.demotions.popleft()
            if demotion.entry.dead:  # cleared meanwhile: nothing to keep
                self._release_demotions(slot, [demotion])
                continue
            batch.append(demotion)
        if not batch:
            return
        chunks = [_address(d.namespace, d.entry) for d in batch]
        slot.putting = True
        put = functools.partial(slot.config.tier.put, chunks, self._arena)
        self._submit(slot, put, self._put_done, slot, batch)

    def _put_done(self, slot: _Slot, batch: list[_Demotion], future: Future[TierWrite]) -> None:
        slot.putting = False
        try:
            write = future.result()
            stored = list(write.stored)
            evicted = list(write.evicted)
            if len(stored) != len(batch):
                raise ValueError(f"put answered {len(stored)} results for {len(batch)} chunks")
        except Exception as exc:
            slot.errors += 1
            self._log(
                logging.ERROR, "tier %s: put of %d chunks failed: %s", slot.name, len(batch), exc
            )
            stored, evicted = [False] * len(batch), []
        self._release_demotions(slot, batch)
        slot.demoted += sum(stored)
        medium = slot.config.medium
        if medium:
            by_namespace: dict[str, list[bytes]] = {}
            for demotion, ok in zip(batch, stored, strict=True):
                if ok and not demotion.entry.dead:
                    by_namespace.setdefault(demotion.namespace, []).append(demotion.entry.key)
            for name, keys in by_namespace.items():
                self._announce.tier_stored(name, keys, medium, slot.config.locality)
            gone: dict[str, list[bytes]] = {}
            for name, key in evicted:
                gone.setdefault(name, []).append(key)
            for name, keys in gone.items():
                self._announce.tier_removed(name, keys, medium, slot.config.locality)
        self._next_put(slot)

    def _release_demotions(self, slot: _Slot, demotions: list[_Demotion]) -> None:
        for demotion in demotions:
            slot.queued_bytes -= demotion.nbytes
        self._cache.finish_reads(d.reading for d in demotions)

    def cleared(self, namespace: str) -> None:
        """The engine cleared ``namespace``: drop its queued chunks, clear it in every tier."""
        if self._closing:
            return
        for slot in self._slots:
            slot.backlog = deque(item for item in slot.backlog if item[0] != namespace)
            dropped = [d for d in slot.demotions if d.namespace == namespace]
            if dropped:
                slot.demotions = deque(d for d in slot.demotions if d.namespace != namespace)
                self._release_demotions(slot, dropped)
            # After the put in flight (one thread, in order): what it wrote goes too.
            clear = functools.partial(slot.config.tier.clear, namespace)
            self._submit(slot, clear, self._call_done, slot, "clear")

    def _call_done(self, slot: _Slot, what: str, future: Future[object]) -> None:
        try:
            future.result()
        except Exception as exc:
            slot.errors += 1
            self._log(logging.ERROR, "tier %s: %s failed: %s", slot.name, what, exc)

    # ----------------------------------------------------------------- lookups

    def probe(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        hits: int,
        answer: Callable[[list[int]], None],
        *,
        acker: str | None = None,
    ) -> list[int] | None:
        """Look for the keys after ``hits`` in the tiers; see the module docstring.

        ``acker``: the requesting scheduler, whose own mirror need not acknowledge the
        evictions that make room for the promotion (``ChunkCache.reserve``'s ``acker``).
        """
        if self._closing or hits >= len(keys):
            return []
        get = self._cache.get
        name = namespace.name
        candidates = [i for i in range(hits, len(keys)) if get(name, keys[i]) is None]
        if not candidates:
            return []
        walk = _Probe(namespace, keys, candidates, answer, acker)
        return self._advance(walk, 0)

    def _advance(self, walk: _Probe, position: int) -> list[int] | None:
        """Ask the tiers from ``position`` on; the promoted indices, or None if deferred."""
        for index in range(position, len(self._slots)):
            slot = self._slots[index]
            wanted = walk.unresolved()
            if not wanted:
                break
            keys = [walk.keys[i] for i in wanted]
            if slot.config.inline:
                try:
                    held = slot.config.tier.contains(walk.namespace.name, keys)
                except Exception as exc:
                    slot.errors += 1
                    self._log(logging.ERROR, "tier %s: contains failed: %s", slot.name, exc)
                    continue
                for i, present in zip(wanted, held, strict=False):
                    if present:
                        walk.found[i] = index
                continue
            if slot.probes >= MAX_PROBES:
                continue  # its thread is behind: a miss there, rather than a queue
            slot.probes += 1
            contains = functools.partial(slot.config.tier.contains, walk.namespace.name, keys)
            context = (walk, index, wanted)
            self._submit(slot, contains, self._probe_done, slot, context, urgent=True)
            walk.timer = self._loop.call_later(
                slot.config.lookup_timeout, self._probe_timed_out, walk, index
            )
            return None
        return self._finish(walk)

    def _probe_done(
        self,
        slot: _Slot,
        context: tuple[_Probe, int, list[int]],
        future: Future[list[bool]],
    ) -> None:
        slot.probes -= 1
        walk, index, wanted = context
        try:
            held = future.result()
        except Exception as exc:
            slot.errors += 1
            self._log(logging.ERROR, "tier %s: contains failed: %s", slot.name, exc)
            held = []
        if walk.done:
            return  # timed out: answered as a miss already
        if walk.timer is not None:
            walk.timer.cancel()
        for i, present in zip(wanted, held, strict=False):
            if present:
                walk.found[i] = index
        result = self._advance(walk, index + 1)
        if result is not None:
            walk.answer(result)

    def _probe_timed_out(self, walk: _Probe, index: int) -> None:
        if walk.done:
            return
        self._log(
            logging.WARNING,
            "tier %s: no answer to a lookup in %.3fs; counted a miss",
            self._slots[index].name,
            self._slots[index].config.lookup_timeout,
        )
        result = self._advance(walk, index + 1)
        if result is not None:
            walk.answer(result)

    def _finish(self, walk: _Probe) -> list[int]:
        """Walk the prefix: promote the keys found, up to the first key no tier has."""
        walk.done = True
        candidates = set(walk.candidates)
        seen: set[bytes] = set()
        runs: list[tuple[int, list[int]]] = []  # (tier position, key indices), in key order
        for i in range(walk.candidates[0], len(walk.keys)):
            if i not in candidates:
                continue  # the arena has it (pending or committed)
            where = walk.found.get(i)
            if where is None:
                break
            if walk.keys[i] in seen:
                continue  # a repeated key: promoted once
            seen.add(walk.keys[i])
            if runs and runs[-1][0] == where:
                runs[-1][1].append(i)
            else:
                runs.append((where, [i]))
        promoted: list[int] = []
        for where, indices in runs:
            slot = self._slots[where]
            slot.hits += len(indices)
            keys = [walk.keys[i] for i in indices]
            taken = self._promote(slot, walk.namespace, keys, walk.acker)
            promoted.extend(indices[:taken])
            if taken < len(indices):
                break  # no room: later keys gain nothing
        return promoted

    # ----------------------------------------------------------------- promotions

    def _promote(
        self, slot: _Slot, namespace: Namespace, keys: list[bytes], acker: str | None
    ) -> int:
        """Reserve ``keys`` in the arena and queue their get; how many leading keys got room."""
        cache, name = self._cache, namespace.name
        if any(cache.get(name, key) is not None for key in keys):
            return 0  # stored meanwhile: the arena answers next time
        owner = f"offloadd-tier-{slot.name}-{next(self._owners)}"
        reservation = cache.reserve(name, keys, owner, namespace.shard_sizes_for_key, acker=acker)
        taken = len(reservation.reserved)
        keys = keys[:taken]
        if not keys:
            return 0
        writes: dict[bytes, list[ShardWrite]] = {key: [] for key in keys}
        shards = max(len(namespace.shard_sizes_for_key(key)) for key in keys)
        for shard in range(shards):
            sized = [key for key in keys if len(namespace.shard_sizes_for_key(key)) > shard]
            begun = cache.begin_store(
                name, sized, shard, namespace.shard_sizes_for_key, allocate=False
            )
            for write in begun.writes:
                writes[sized[write.index]].append(write)
        addresses = [_address(name, writes[key][0].entry) for key in keys]
        slot.promotions.append(_Promotion(namespace, owner, keys, writes, addresses))
        self._next_get(slot)
        return taken

    def _next_get(self, slot: _Slot) -> None:
        if slot.getting or not slot.promotions:
            return
        batch: list[_Promotion] = []
        count = 0
        while slot.promotions and (
            not batch or count + len(slot.promotions[0].keys) <= BATCH_CHUNKS
        ):
            promotion = slot.promotions.pop(0)
            batch.append(promotion)
            count += len(promotion.keys)
        chunks = [address for promotion in batch for address in promotion.addresses]
        slot.getting = True
        get = functools.partial(slot.config.tier.get, chunks, self._arena)
        self._submit(slot, get, self._get_done, slot, batch)

    def _get_done(self, slot: _Slot, batch: list[_Promotion], future: Future[list[bool]]) -> None:
        slot.getting = False
        total = sum(len(p.keys) for p in batch)
        try:
            verified = list(future.result())
            if len(verified) != total:
                raise ValueError(f"get answered {len(verified)} results for {total} chunks")
        except Exception as exc:
            slot.errors += 1
            self._log(logging.ERROR, "tier %s: get of %d chunks failed: %s", slot.name, total, exc)
            verified = [False] * total
        results = iter(verified)
        for promotion in batch:
            good = [key for key in promotion.keys if next(results)]
            self._seal_then_commit(slot, promotion, set(good))
        self._next_get(slot)

    def _seal_then_commit(self, slot: _Slot, promotion: _Promotion, good: set[bytes]) -> None:
        sealed = [w for key in promotion.keys if key in good for w in promotion.writes[key]]
        if not sealed:
            self._commit(slot, promotion, good)
            return
        loop = self._loop
        slot.calls += 1
        self._idle.clear()

        def then() -> None:
            loop.call_soon_threadsafe(self._sealed, slot, promotion, good)

        self._committer.seal(sealed, then)

    def _sealed(self, slot: _Slot, promotion: _Promotion, good: set[bytes]) -> None:
        self._call_ended(slot)
        self._commit(slot, promotion, good)

    def _commit(self, slot: _Slot, promotion: _Promotion, good: set[bytes]) -> None:
        """Commit the verified chunks (journaled, announced); the others never show."""
        bad = [w for key in promotion.keys if key not in good for w in promotion.writes[key]]
        ok = [w for key in promotion.keys if key in good for w in promotion.writes[key]]
        self._committer.fail(bad)
        outcome = self._committer.commit(promotion.namespace, ok, source=slot.name)
        # Entries that did not commit (unverified, cleared meanwhile, refused by the journal)
        # leave with the owner.
        self._cache.release_reservations(promotion.owner)
        failed = len(promotion.keys) - len(good)
        if failed:
            slot.promotion_failures += failed
            self._log(
                logging.WARNING,
                "tier %s: %d chunks were gone or failed verification; dropped, never served",
                slot.name,
                failed,
            )
        slot.promoted += len(outcome.committed)

    # ----------------------------------------------------------------- threads

    def _submit(
        self,
        slot: _Slot,
        call: Callable[[], T],
        done: Callable[..., None],
        *args: object,
        urgent: bool = False,
    ) -> None:
        """Run ``call`` on the slot's thread, then ``done(*args, future)`` on the loop."""
        loop = self._loop
        slot.calls += 1
        self._idle.clear()

        def back(future: Future[T]) -> None:
            # A closed loop: the daemon is gone, nobody to tell.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._ended, slot, done, args, future)

        slot.worker.submit(call, urgent=urgent).add_done_callback(back)

    def _ended(
        self, slot: _Slot, done: Callable[..., None], args: tuple[object, ...], future: Future[T]
    ) -> None:
        self._call_ended(slot)
        done(*args, future)

    def _call_ended(self, slot: _Slot) -> None:
        slot.calls -= 1
        if not any(s.calls for s in self._slots):
            self._idle.set()

    # ----------------------------------------------------------------- figures, end

    def stats(self) -> list[TierState]:
        """One ``TierState`` per tier, in order."""
        states = []
        for slot in self._slots:
            try:
                tier = slot.config.tier.stats()
            except Exception as exc:
                self._log(logging.ERROR, "tier %s: stats failed: %s", slot.name, exc)
                states.append(TierState(slot.name, 0, 0, 0, healthy=False, errors=slot.errors))
                continue
            states.append(
                TierState(
                    name=slot.name,
                    capacity=tier.capacity,
                    used_bytes=tier.used_bytes,
                    chunks=tier.chunks,
                    healthy=tier.healthy,
                    errors=tier.errors + slot.errors,
                    hits=slot.hits,
                    promotions=slot.promoted,
                    promotion_failures=slot.promotion_failures,
                    demotions=slot.demoted,
                    demotions_skipped=slot.skipped,
                    queued_bytes=slot.queued_bytes,
                    bytes_written=tier.bytes_written,
                    bytes_read=tier.bytes_read,
                    write_seconds=tier.write_seconds,
                    read_seconds=tier.read_seconds,
                )
            )
        return states

    async def drain(self, grace: float) -> bool:
        """Take no more work, wait up to ``grace`` for the calls in flight, close the tiers.

        True when every tier closed in time; False means a tier's thread may still read or
        write the arena, which must then stay mapped.
        """
        if self._closing:
            return self._idle.is_set()
        self._closing = True
        for slot in self._slots:
            dropped = list(slot.demotions)
            slot.demotions.clear()
            slot.skipped += len(slot.backlog)
            slot.backlog.clear()
            self._release_demotions(slot, dropped)
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            busy = [slot.name for slot in self._slots if slot.calls]
            logger.warning("tiers %s still busy after %.0fs; not closed", busy, grace)
            return False
        for slot in self._slots:
            # Promotions still queued (never got): their entries never become visible.
            for promotion in slot.promotions:
                self._commit(slot, promotion, set())
            slot.promotions.clear()
            tier = slot.config.tier
            self._submit(slot, tier.close, self._call_done, slot, "close")
            slot.worker.stop()
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            logger.warning("a tier did not close within %.0fs", grace)
            return False
        return True


def _address(namespace: str, entry: Entry) -> ChunkAddress:
    return ChunkAddress(namespace, entry.key, tuple(zip(entry.offsets, entry.sizes, strict=True)))

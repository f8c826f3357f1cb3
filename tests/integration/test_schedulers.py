"""Schedulers ahead of their ranks: reservations, holds, key mirrors and acknowledged removals.

A real daemon, a scheduler client (``mirror=True``) and rank clients on shared-memory tensors;
every load is checked byte for byte against the pages that were stored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from offloadd.client import OffloadClient
from offloadd.errors import InvalidRequest, RequestFailed
from offloadd.settings import LimitsSettings
from protocol.config import OffloadingGroupConfig
from protocol.errors import ErrorCode
from protocol.messages import Error, HoldKeys, KeysChanged, Reserved, Segment
from tests.fakes import FakeCopyEngine
from tests.integration.harness import (
    LAYERS,
    DaemonThread,
    Rank,
    chain_keys,
    chunk_block_ids,
    make_config,
    make_rank,
)

PAGE = 1024
BPC = 2
# One key: 3 layers x BPC pages of PAGE bytes, one shard (TP=1), 4 KiB aligned.
KEY_BYTES = 3 * BPC * PAGE
KEY_FOOTPRINT = -(-KEY_BYTES // 4096) * 4096


@pytest.fixture
def daemon() -> Iterator[DaemonThread]:
    d = DaemonThread(capacity=64 << 20).start()
    yield d
    d.stop()


def scheduler(endpoint: str, **config_args: Any) -> OffloadClient:
    config = make_config(tp=1, bytes_per_block=3 * PAGE, **config_args)
    return OffloadClient.connect(endpoint, config, role="scheduler", mirror=True)


def rank(endpoint: str, seed: int = 1, **config_args: Any) -> Rank:
    r = make_rank(endpoint, tp=1, page=PAGE, num_blocks=64, **config_args)
    r.fill(seed)
    return r


def mirror_of(client: OffloadClient, notices: list[KeysChanged] | None = None) -> set[bytes]:
    """Apply the client's key changes to a set, as the vLLM manager does."""
    keys: set[bytes] = set()
    for notice in notices if notices is not None else client.take_notices():
        if notice.reset:
            keys.clear()
        keys.update(notice.stored)
        keys.difference_update(notice.removed)
    return keys


def wait_for(condition: object, client: OffloadClient, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        client.poll(0.05)


def store_reserved(r: Rank, job_id: int, keys: list[bytes], chunks: list[int]) -> None:
    assert r.client is not None
    r.client.store(job_id, keys, chunk_block_ids(chunks, BPC), reserved=True)
    r.client.wait([job_id])


def test_reserve_store_commit_reaches_the_mirror(daemon: DaemonThread) -> None:
    r = rank(daemon.endpoint)
    sched = scheduler(daemon.endpoint)
    try:
        sched.wait_ready()
        keys = chain_keys(4, b"a")
        assert sched.reserve(keys).reserved == [0, 1, 2, 3]
        # Reserved (pending) keys are not reserved twice, by anyone.
        assert sched.reserve(keys).reserved == []
        store_reserved(r, 1, keys, [0, 1, 2, 3])
        notices: list[KeysChanged] = []

        def mirrored() -> int:
            notices.extend(sched.take_notices())
            return len(mirror_of(sched, notices))

        wait_for(lambda: mirrored() == 4, sched)
        assert notices[0].reset
        assert mirror_of(sched, notices) == set(keys)
        # Committed keys are not reserved again.
        assert sched.reserve(keys).reserved == []
    finally:
        sched.close()
        r.close()


def test_a_posted_step_is_answered_later_with_its_lookups(daemon: DaemonThread) -> None:
    """The vLLM scheduler's step message: posted, its Reserved and each lookup's answer read
    later by id (what the step reserved is stored; an unreserved key is not)."""
    r = rank(daemon.endpoint)
    sched = scheduler(daemon.endpoint)
    try:
        sched.wait_ready()
        keys = chain_keys(3, b"p")
        assert sched.reserve(keys[:1]).reserved == [0]
        store_reserved(r, 1, keys[:1], [0])
        reserve_id, first, second = sched.post_reserve(keys[1:2], lookups=[keys[:1], keys[2:]])
        answers: dict[int, Any] = {}

        def answered() -> bool:
            answers.update((getattr(a, "request_id", -1), a) for a in sched.take_answers())
            return len(answers) == 3

        wait_for(answered, sched)
        assert answers[reserve_id] == Reserved(reserve_id, [0], [])
        assert (answers[first].hits, answers[second].hits) == (1, 0)
        assert sched.take_answers() == []
        assert r.client is not None
        r.client.store(2, keys[1:], chunk_block_ids([1, 2], BPC), reserved=True)
        (done,) = r.client.wait([2])
        assert done.ok and done.nbytes == KEY_BYTES  # keys[2] was never reserved: skipped
    finally:
        sched.close()
        r.close()


def test_reserved_store_skips_keys_nobody_reserved(daemon: DaemonThread) -> None:
    r = rank(daemon.endpoint)
    sched = scheduler(daemon.endpoint)
    try:
        sched.wait_ready()
        keys = chain_keys(3, b"b")
        assert sched.reserve(keys[:1]).reserved == [0]
        assert r.client is not None
        r.client.store(7, keys, chunk_block_ids([0, 1, 2], BPC), reserved=True)
        (done,) = r.client.wait([7])
        assert done.ok and done.failed_keys == []
        assert done.nbytes == KEY_BYTES  # one key written, two skipped
        assert r.client.lookup(keys).hits == 1
    finally:
        sched.close()
        r.close()


def test_a_store_read_before_its_reserve_waits_for_it(daemon: DaemonThread) -> None:
    """The daemon reads the scheduler's socket and the rank's in turns, so a daemon behind
    may read the rank's Store first: naming the Reserve, it waits for it and stores what it
    reserved (skipping every key as unreserved lost the chunks: they were never stored)."""
    r = rank(daemon.endpoint)
    sched = scheduler(daemon.endpoint)
    try:
        sched.wait_ready()
        assert r.client is not None and sched.welcome is not None
        keys = chain_keys(3, b"w")
        reserve = sched._core.reserve(keys[:2], [], [], 0, [])  # numbered, not sent yet
        blocks = chunk_block_ids([0, 1, 2], BPC)
        r.client.store(
            1, keys, blocks, reserved=True, reserve=(sched.welcome.session_id, reserve.request_id)
        )
        r.client.poll(0.2)
        assert daemon.daemon is not None
        stats = daemon.daemon.stats()
        assert stats.stores_waiting == 1 and stats.committed_entries == 0
        sched._post_awaited(reserve)
        (done,) = r.client.wait([1])
        assert done.ok and done.nbytes == 2 * KEY_BYTES  # keys[2] was never reserved: skipped
        r.client.load(2, keys[:2], chunk_block_ids([10, 11], BPC))
        r.client.wait([2])
        loaded, stored = (r.pages(chunk_block_ids(c, BPC)) for c in ([10, 11], [0, 1]))
        for got, want in zip(loaded, stored, strict=True):
            assert got.equal(want)
        # A Reserve already read, or a session the daemon does not know: no wait.
        more = chain_keys(2, b"x")
        assert sched.reserve(more[:1]).reserved == [0]
        for job_id, named in ((3, (sched.welcome.session_id, 1)), (4, ("no such session", 99))):
            r.client.store(job_id, more, chunk_block_ids([4, 5], BPC), reserved=True, reserve=named)
        done_3, done_4 = r.client.wait([3, 4], timeout=1.0)
        assert done_3.nbytes == KEY_BYTES and done_4.nbytes == 0
        assert daemon.daemon.stats().stores_waiting == 0
    finally:
        sched.close()
        r.close()


def test_held_keys_load_byte_exact_even_after_clear(daemon: DaemonThread) -> None:
    r = rank(daemon.endpoint, seed=3)
    sched = scheduler(daemon.endpoint)
    try:
        sched.wait_ready()
        keys = chain_keys(2, b"c")
        sched.reserve(keys)
        store_reserved(r, 1, keys, [0, 1])
        result = sched.update_holds([HoldKeys("req-1", keys)])
        assert result.held == 2 and result.missing == []
        assert sched.clear() == 2  # the keys are gone from the index, not from the arena
        expected = r.pages(chunk_block_ids([0, 1], BPC))
        assert r.client is not None
        r.client.load(2, keys, chunk_block_ids([10, 11], BPC), hold="req-1")
        r.client.wait([2])
        for got, want in zip(r.pages(chunk_block_ids([10, 11], BPC)), expected, strict=True):
            assert got.equal(want)
        # A key nobody holds under that token fails the load; nothing is copied.
        r.client.load(3, chain_keys(1, b"other"), chunk_block_ids([20], BPC), hold="req-1")
        (done,) = r.client.wait([3], raise_on_failure=False)
        assert not done.ok
        assert sched.update_holds(release=[HoldKeys("req-1", keys)]).held == 0
        assert daemon.daemon is not None and daemon.daemon.stats().used_bytes == 0
    finally:
        sched.close()
        r.close()


def test_segments_store_partial_chunks_and_load_mid_chunk(daemon: DaemonThread) -> None:
    r = rank(daemon.endpoint, seed=4)
    sched = scheduler(daemon.endpoint)
    try:
        sched.wait_ready()
        keys = chain_keys(3, b"d")
        sched.reserve(keys)
        # Chunk 0 starts at its second block (a null block left out), then two full chunks.
        blocks = [1, 2, 3, 4, 5]
        assert r.client is not None
        r.client.store(1, keys, blocks, segments=[Segment(3, 1, 5)], reserved=True)
        r.client.wait([1])
        # Load from the middle of chunk 0 and stop in the middle of chunk 2.
        r.client.load(2, keys, [30, 31, 32, 33], segments=[Segment(3, 1, 4)])
        r.client.wait([2])
        for got, want in zip(r.pages([30, 31, 32, 33]), r.pages([1, 2, 3, 4]), strict=True):
            assert got.equal(want)
        with pytest.raises(Exception, match="span 2 chunks"):
            r.client.load(3, keys, [40, 41, 42], segments=[Segment(3, 1, 3)])
    finally:
        sched.close()
        r.close()


def test_a_removal_waits_for_every_mirror_and_stays_holdable() -> None:
    # Room for 4 keys: engine A's fifth key evicts one that engine B still mirrors.
    # A tiny arena the engines may reserve whole (limits.protected_fraction).
    d = DaemonThread(
        capacity=4 * KEY_FOOTPRINT, limits=LimitsSettings(protected_fraction=1.0)
    ).start()
    ra, rb = rank(d.endpoint, seed=5, engine_id="a"), rank(d.endpoint, seed=5, engine_id="b")
    sa, sb = scheduler(d.endpoint, engine_id="a"), scheduler(d.endpoint, engine_id="b")
    try:
        sa.wait_ready()
        sb.wait_ready()
        keys = chain_keys(5, b"e")
        assert sa.reserve(keys[:4]).reserved == [0, 1, 2, 3]
        store_reserved(ra, 1, keys[:4], [0, 1, 2, 3])
        wait_for(lambda: d.daemon is not None and d.daemon.stats().committed_entries == 4, sa)
        seen_b: list[KeysChanged] = []

        def mirror_b() -> set[bytes]:
            seen_b.extend(sb.take_notices())
            return mirror_of(sb, seen_b)

        wait_for(lambda: mirror_b() == set(keys[:4]), sb)
        # B has not acknowledged the removal: A's key is reserved, placed when its room is
        # acknowledged (not refused); the victim waits.
        assert sa.reserve(keys[4:]).reserved == [0]
        assert d.daemon is not None
        stats = d.daemon.stats()
        # One more reservation's worth is evicted ahead (B must acknowledge that too).
        assert stats.committed_entries == 2 and stats.used_bytes == 4 * KEY_FOOTPRINT
        victim = keys[0]
        # B still shows the victim: it can hold it and load the right bytes.
        assert sb.update_holds([HoldKeys("r", [victim])]).missing == []
        assert rb.client is not None
        rb.client.load(1, [victim], chunk_block_ids([10], BPC), hold="r")
        rb.client.wait([1])
        for got, want in zip(
            rb.pages(chunk_block_ids([10], BPC)), ra.pages(chunk_block_ids([0], BPC)), strict=True
        ):
            assert got.equal(want)
        # B applies the removal and acknowledges it; releasing the hold frees the space.
        wait_for(lambda: victim not in mirror_b(), sb)
        sb.update_holds(release=[HoldKeys("r", [victim])], ack=max(n.seq for n in seen_b))
        assert d.daemon.stats().used_bytes == 3 * KEY_FOOTPRINT  # 2 committed, keys[4] placed
        store_reserved(ra, 2, keys[4:], [4])  # the reserved key gets its room now
        wait_for(lambda: d.daemon is not None and d.daemon.stats().committed_entries == 3, sa)
        assert d.daemon.stats().stores_refused_by_reason == {}
    finally:
        for client in (sa, sb):
            client.close()
        for r in (ra, rb):
            r.close()
        d.stop()


class Shared:
    """Engines "a" and "b" on a 4-key arena that "a" filled and "b"'s mirror shows; "a" has
    reserved a fifth key whose room waits for "b"'s acknowledgement."""

    def __init__(self, mirror_ack_timeout: float = 5.0) -> None:
        self.d = DaemonThread(
            capacity=4 * KEY_FOOTPRINT,
            limits=LimitsSettings(protected_fraction=1.0),
            mirror_ack_timeout=mirror_ack_timeout,
        ).start()
        self.ra = rank(self.d.endpoint, seed=5, engine_id="a")
        self.rb = rank(self.d.endpoint, seed=5, engine_id="b")
        self.sa = scheduler(self.d.endpoint, engine_id="a")
        self.sb = scheduler(self.d.endpoint, engine_id="b")
        self.seen_b: list[KeysChanged] = []
        self.keys = chain_keys(5, b"w")
        self.sa.wait_ready()
        self.sb.wait_ready()
        assert self.sa.reserve(self.keys[:4]).reserved == [0, 1, 2, 3]
        store_reserved(self.ra, 1, self.keys[:4], [0, 1, 2, 3])
        wait_for(lambda: self.mirror_b() == set(self.keys[:4]), self.sb)
        assert self.sa.reserve(self.keys[4:]).reserved == [0]
        stats = self.stats()
        # Reserved, without extents yet: two victims' room ("b" still shows them) is in use.
        assert (stats.entries, stats.committed_entries) == (3, 2)
        assert stats.used_bytes == 4 * KEY_FOOTPRINT

    def stats(self) -> Any:
        assert self.d.daemon is not None
        return self.d.daemon.stats()

    def mirror_b(self) -> set[bytes]:
        self.seen_b.extend(self.sb.take_notices())
        return mirror_of(self.sb, self.seen_b)

    def ack_b(self) -> None:
        wait_for(lambda: self.keys[0] not in self.mirror_b(), self.sb)
        self.sb.ack(max(n.seq for n in self.seen_b))

    def close(self) -> None:
        for client in (self.sa, self.sb):
            client.close()
        for r in (self.ra, self.rb):
            r.close()
        self.d.stop()


def test_a_store_waits_for_the_room_another_mirror_must_acknowledge() -> None:
    s = Shared()
    try:
        assert s.ra.client is not None
        s.ra.client.store(2, s.keys[4:], chunk_block_ids([4], BPC), reserved=True)
        # Accepted, but nothing is copied before "b" acknowledges: the store waits.
        s.ra.client.poll(0.2)
        stats = s.stats()
        assert stats.jobs_in_flight == 1 and stats.committed_entries == 2
        assert stats.stores_waiting == 1
        assert stats.stores_refused_by_reason == {}
        s.ack_b()
        (done,) = s.ra.client.wait([2])
        assert done.ok and done.failed_keys == []
        stats = s.stats()
        assert stats.committed_entries == 3 and stats.used_bytes == 3 * KEY_FOOTPRINT
        assert stats.stores_waiting == 0 and stats.mirrors_dropped == 0
        assert stats.stores_refused_by_reason == {}
        s.ra.client.load(3, s.keys[4:], chunk_block_ids([8], BPC))
        s.ra.client.wait([3])
        for got, want in zip(
            s.ra.pages(chunk_block_ids([8], BPC)),
            s.ra.pages(chunk_block_ids([4], BPC)),
            strict=True,
        ):
            assert got.equal(want)
    finally:
        s.close()


def test_a_waiting_store_past_its_deadline_when_its_room_comes_never_starts() -> None:
    s = Shared()
    try:
        assert s.ra.client is not None
        deadline = time.monotonic() + 0.2
        s.ra.client.store(
            2, s.keys[4:], chunk_block_ids([4], BPC), reserved=True, deadline=deadline
        )
        s.ra.client.poll(0.2)
        assert s.stats().stores_waiting == 1
        while time.monotonic() <= deadline:  # the rank may give it up now
            s.ra.client.poll(0.05)
        s.ack_b()
        (done,) = s.ra.client.wait([2], raise_on_failure=False)
        assert not done.ok and "deadline" in done.error and done.failed_keys == s.keys[4:]
        stats = s.stats()
        assert stats.stores_waiting == 0 and stats.jobs_in_flight == 0
        assert stats.committed_entries == 2 and stats.stores_refused_by_reason == {"late": 1}
    finally:
        s.close()


def test_a_waiting_store_of_a_rank_that_leaves_never_starts() -> None:
    s = Shared()
    try:
        assert s.ra.client is not None
        s.ra.client.store(2, s.keys[4:], chunk_block_ids([4], BPC), reserved=True)
        wait_for(lambda: s.stats().jobs_in_flight == 1, s.sb)
        s.ra.close()
        wait_for(lambda: s.stats().jobs_in_flight == 0, s.sb)  # unbooked with its session
        assert s.stats().stores_waiting == 0
        s.ack_b()
        # The reservation got its room, but no copy ever began: still pending, nothing refused.
        wait_for(lambda: s.stats().used_bytes == 3 * KEY_FOOTPRINT, s.sb)
        stats = s.stats()
        assert (stats.entries, stats.committed_entries) == (3, 2)
        assert stats.stores_refused_by_reason == {}
    finally:
        s.close()


def test_a_store_whose_room_is_never_acknowledged_waits_out_the_silent_mirror() -> None:
    """ "b" never acknowledges: it is dropped after mirror_ack_timeout, the room it held frees,
    and the waiting store is placed and commits (nothing refused)."""
    s = Shared(mirror_ack_timeout=0.5)
    try:
        assert s.ra.client is not None
        s.ra.client.store(2, s.keys[4:], chunk_block_ids([4], BPC), reserved=True)
        (done,) = s.ra.client.wait([2], timeout=10.0)
        assert done.ok and done.failed_keys == []
        stats = s.stats()
        assert stats.committed_entries == 3 and stats.jobs_in_flight == 0
        assert stats.stores_refused_by_reason == {}
        assert schedulers_of(s.d, "b") == 0 and stats.mirrors_dropped == 1  # for its silence
    finally:
        s.close()


def test_a_scheduler_that_leaves_frees_its_reservations_and_holds(daemon: DaemonThread) -> None:
    r = rank(daemon.endpoint)
    sched = scheduler(daemon.endpoint)
    try:
        sched.wait_ready()
        keys = chain_keys(3, b"f")
        sched.reserve(keys[:1])
        store_reserved(r, 1, keys[:1], [0])
        sched.update_holds([HoldKeys("r", keys[:1])])
        sched.reserve(keys[1:])
        assert daemon.daemon is not None
        assert daemon.daemon.stats().entries == 3
        sched.close()
        wait_for(lambda: daemon.daemon is not None and daemon.daemon.stats().entries == 1, r.client)  # type: ignore[arg-type]
        assert daemon.daemon.stats().used_bytes == KEY_FOOTPRINT
    finally:
        sched.close()
        r.close()


def test_only_schedulers_reserve(daemon: DaemonThread) -> None:
    r = rank(daemon.endpoint)
    try:
        assert r.client is not None
        with pytest.raises(InvalidRequest, match="only schedulers"):
            r.client.reserve(chain_keys(1))
    finally:
        r.close()


def test_mirror_snapshot_of_a_warm_namespace(daemon: DaemonThread) -> None:
    r = rank(daemon.endpoint)
    try:
        assert r.client is not None
        keys = chain_keys(3, b"g")
        r.client.store(1, keys, chunk_block_ids([0, 1, 2], BPC))
        r.client.wait([1])
        sched = scheduler(daemon.endpoint)
        try:
            wait_for(lambda: bool(sched._core.notices), sched)
            (first, *_rest) = sched._core.notices
            assert first.reset and not first.more
            assert set(first.stored) == set(keys)
            assert msgspec.structs.asdict(first)["removed"] == []
        finally:
            sched.close()
    finally:
        r.close()


def test_two_groups_by_group_id_partial_chunks_and_mid_chunk_loads(daemon: DaemonThread) -> None:
    """Keys name vLLM's group ids (here 0 and 3, not positions 0 and 1); each group's run of
    blocks may start mid-chunk and end with a partial chunk, on store and on load."""
    groups = (
        OffloadingGroupConfig(tokens_per_block=16, layer_names=LAYERS[:2], group_id=0),
        OffloadingGroupConfig(tokens_per_block=16, layer_names=LAYERS[2:], group_id=3),
    )
    r = make_rank(daemon.endpoint, tp=1, page=PAGE, num_blocks=64, connect=False)
    try:
        r.config = msgspec.structs.replace(r.config, groups=groups)
        r.client = OffloadClient.connect(daemon.endpoint, r.config, [kv.region for kv in r.tensors])
        r.fill(9)
        full, window = chain_keys(2, b"full", group=0), chain_keys(2, b"swa", group=3)
        # Group 0: sub-blocks 1..3 (a null first block left out); group 3: a chunk and a half.
        r.client.store(
            1, full + window, [1, 2, 3, 10, 11, 12], segments=[Segment(2, 1, 3), Segment(2, 0, 3)]
        )
        (done,) = r.client.wait([1])
        assert done.ok and done.nbytes == (3 * 2 + 3 * 1) * PAGE
        assert r.client.lookup(full).hits == 2 and r.client.lookup(window).hits == 2
        with pytest.raises(InvalidRequest, match="names group 1"):
            r.client.lookup(chain_keys(1, b"x", group=1))
        # Load from the middle of each group's first chunk.
        segments = [Segment(2, 1, 3), Segment(2, 1, 2)]
        r.client.load(2, full + window, [40, 41, 42, 50, 51], segments=segments)
        r.client.wait([2])
    except BaseException:
        r.close()
        raise
    try:
        layer0, layer1, layer2 = r.tensors
        for kv in (layer0, layer1):
            assert kv.pages([40, 41, 42]).equal(kv.pages([1, 2, 3]))
        assert layer2.pages([50, 51]).equal(layer2.pages([11, 12]))
    finally:
        r.close()


def acking(client: OffloadClient, notices: list[KeysChanged]) -> list[KeysChanged]:
    """What a live mirror does: read its notices and acknowledge them; all read so far."""
    client.poll(0)
    new = client.take_notices()
    if new:
        notices.extend(new)
        client.ack(max(notice.seq for notice in new))
    return notices


def schedulers_of(d: DaemonThread, engine_id: str) -> int:
    assert d.daemon is not None
    (engine,) = [e for e in d.daemon.stats().engines if e.engine_id == engine_id]
    return engine.schedulers


def test_a_mirror_that_stops_acknowledging_is_dropped_and_evictions_go_on() -> None:
    """Removed keys keep their bytes until every mirror acknowledged them: a scheduler that
    stops acknowledging (wedged, its process alive) is dropped after mirror_ack_timeout, the
    removals it owed free their room, and it says Hello again at its next request."""
    d = DaemonThread(
        capacity=4 * KEY_FOOTPRINT,
        limits=LimitsSettings(protected_fraction=1.0),
        mirror_ack_timeout=0.5,
    ).start()
    ra, rb = rank(d.endpoint, seed=6, engine_id="a"), rank(d.endpoint, seed=6, engine_id="b")
    sa, sb = scheduler(d.endpoint, engine_id="a"), scheduler(d.endpoint, engine_id="b")
    seen_a: list[KeysChanged] = []
    try:
        sa.wait_ready()
        sb.wait_ready()
        assert d.daemon is not None
        keys = chain_keys(8, b"s")
        assert sa.reserve(keys[:4]).reserved == [0, 1, 2, 3]
        store_reserved(ra, 1, keys[:4], [0, 1, 2, 3])
        wait_for(lambda: d.daemon is not None and d.daemon.stats().committed_entries == 4, sa)
        # From here on b reads and acknowledges nothing; a does, as a live mirror.
        assert sa.reserve(keys[4:5]).reserved == [0]  # placed once its room is acknowledged
        assert d.daemon.stats().used_bytes == 4 * KEY_FOOTPRINT  # the victims wait for b

        def b_dropped() -> bool:
            acking(sa, seen_a)
            return schedulers_of(d, "b") == 0

        wait_for(b_dropped, sa)
        assert schedulers_of(d, "a") == 1  # the mirror that acknowledges stays
        assert d.daemon.stats().mirrors_dropped == 1
        store_reserved(ra, 2, keys[4:5], [4])  # its room came with b's debts forgiven
        wait_for(lambda: d.daemon is not None and d.daemon.stats().committed_entries == 3, sa)
        # Evictions go on without b: three more keys fit only by evicting.
        evictions = d.daemon.stats().evictions
        assert sa.reserve(keys[5:8]).reserved == [0, 1, 2]
        store_reserved(ra, 3, keys[5:8], [5, 6, 7])
        wait_for(lambda: d.daemon is not None and d.daemon.stats().committed_entries == 4, sa)
        assert d.daemon.stats().evictions > evictions
        assert d.daemon.stats().stores_refused_by_reason == {}
        # b is alive: its next request is answered NOT_REGISTERED, it says Hello again and
        # is sent a fresh snapshot of what the namespace holds now.
        sb.take_notices()
        assert sb.update_holds([HoldKeys("r", keys[7:8])]).held == 1
        assert schedulers_of(d, "b") == 1
        wait_for(lambda: any(n.reset for n in sb._core.notices), sb)
        snapshot = [n for n in sb.take_notices() if n.reset]
        assert set(snapshot[-1].stored) == set(keys[4:8])
    finally:
        for client in (sa, sb):
            client.close()
        for r in (ra, rb):
            r.close()
        d.stop()


def test_a_stopping_daemon_empties_the_mirrors_and_refuses_holds_and_reservations() -> None:
    """The drain (SIGTERM, here the daemon's stop event): every mirror is sent an empty
    snapshot, new reservations, holds and jobs are refused SHUTTING_DOWN (their store keys
    counted, reason "draining"), the job in flight still finishes, and nothing reaches the
    mirror after the empty snapshot."""
    copies = FakeCopyEngine()
    # A drain longer than the test's slowest run: the job it holds must still be in flight.
    d = DaemonThread(copy_engine=copies, drain_seconds=60.0).start()
    r = rank(d.endpoint, seed=8)
    sched = scheduler(d.endpoint)
    notices: list[KeysChanged] = []
    try:
        sched.wait_ready()
        keys = chain_keys(4, b"t")
        assert sched.reserve(keys[:2]).reserved == [0, 1]
        store_reserved(r, 1, keys[:2], [0, 1])
        # Until the first store's commit reached the mirror: no notice of it comes later.
        wait_for(lambda: mirror_of(sched, acking(sched, notices)) == set(keys[:2]), sched)
        assert sched.update_holds([HoldKeys("before", keys[:1])]).held == 1
        assert sched.reserve(keys[2:3]).reserved == [0]
        copies.gate.clear()  # the next store is accepted; its copy waits
        assert r.client is not None
        r.client.store(2, keys[2:3], chunk_block_ids([2], BPC), reserved=True)
        copies.started.acquire(timeout=10)
        notices.clear()
        d.begin_stop()
        wait_for(lambda: any(n.reset for n in acking(sched, notices)), sched)
        (reset,) = notices
        assert reset.stored == [] and not reset.more
        for refused_call in (
            lambda: sched.reserve(keys[3:]),
            lambda: sched.update_holds([HoldKeys("during", keys[:1])]),
            lambda: r.client.store(3, keys[3:], chunk_block_ids([3], BPC)),
        ):
            with pytest.raises(RequestFailed) as refused:
                refused_call()
            assert refused.value.code == ErrorCode.SHUTTING_DOWN
        assert d.daemon is not None
        assert d.daemon.stats().stores_refused_by_reason == {"draining": 2}
        copies.gate.set()
        (done,) = r.client.wait([2], 30)  # the drain finished it: committed, journaled
        assert done.ok and done.nbytes == KEY_BYTES
        d.stop()
        sched.poll(0.2)
        assert sched.take_notices() == []  # its commit reached no mirror
    finally:
        copies.gate.set()
        sched.close()
        r.close()
        d.stop()


def test_a_posted_reserves_evictions_wait_for_its_own_scheduler_and_stay_loadable() -> None:
    """A posted Reserve's evictions are not acknowledged for its scheduler: its next step
    may look a key up before it read the removal. Until the scheduler
    acknowledges, a rank's load by key (its hold late, refused or lost) reads the bytes."""
    d = DaemonThread(
        capacity=4 * KEY_FOOTPRINT, limits=LimitsSettings(protected_fraction=1.0)
    ).start()
    r = rank(d.endpoint, seed=6)
    sched = scheduler(d.endpoint)
    try:
        sched.wait_ready()
        keys = chain_keys(6, b"u")
        assert sched.reserve(keys[:4]).reserved == [0, 1, 2, 3]
        store_reserved(r, 1, keys[:4], [0, 1, 2, 3])
        assert d.daemon is not None
        wait_for(lambda: d.daemon is not None and d.daemon.stats().committed_entries == 4, sched)
        seen: list[KeysChanged] = []

        def mirror() -> set[bytes]:
            seen.extend(sched.take_notices())
            return mirror_of(sched, seen)

        wait_for(lambda: mirror() == set(keys[:4]), sched)
        # Posted, as the vLLM plugin's step: it evicts keys[0], the oldest.
        (reserve_id,) = sched.post_reserve(keys[4:5])
        answers: list[object] = []

        def answered() -> bool:
            answers.extend(sched.take_answers())
            return any(getattr(a, "request_id", None) == reserve_id for a in answers)

        wait_for(answered, sched)
        (reserved,) = [a for a in answers if isinstance(a, Reserved)]
        assert reserved.reserved == [0]
        assert d.daemon.stats().used_bytes == 4 * KEY_FOOTPRINT  # kept: not acknowledged
        assert r.client is not None
        r.client.load(2, keys[:1], chunk_block_ids([10], BPC))  # by key, no hold
        r.client.wait([2])
        for got, want in zip(
            r.pages(chunk_block_ids([10], BPC)), r.pages(chunk_block_ids([0], BPC)), strict=True
        ):
            assert got.equal(want)
        # Acknowledged: the room goes to the reserved key, and keys[0] is gone.
        wait_for(lambda: keys[0] not in mirror(), sched)
        sched.update_holds(ack=sched_seq(sched, seen))
        r.client.load(3, keys[:1], chunk_block_ids([20], BPC))
        (done,) = r.client.wait([3], raise_on_failure=False)
        assert not done.ok and done.failed_keys == keys[:1]
    finally:
        sched.close()
        r.close()
        d.stop()


def sched_seq(client: OffloadClient, seen: list[KeysChanged]) -> int:
    """The newest seq of the notices the scheduler applied (what its mirror acknowledges)."""
    seen.extend(client.take_notices())
    return max(notice.seq for notice in seen)


def test_a_touched_key_outlives_an_older_use_when_room_is_needed() -> None:
    """Keys a scheduler's requests used from the GPU (``touch``) count as used in the shared
    cache: the next eviction takes the least recently used key instead. A touched key the
    cache does not hold is skipped, not refused."""
    d = DaemonThread(
        capacity=4 * KEY_FOOTPRINT, limits=LimitsSettings(protected_fraction=1.0)
    ).start()
    r = rank(d.endpoint, seed=7)
    sched = scheduler(d.endpoint)
    try:
        sched.wait_ready()
        keys = chain_keys(6, b"t")
        assert sched.reserve(keys[:4]).reserved == [0, 1, 2, 3]
        store_reserved(r, 1, keys[:4], [0, 1, 2, 3])
        seen: list[KeysChanged] = []

        def mirror() -> set[bytes]:
            seen.extend(sched.take_notices())
            return mirror_of(sched, seen)

        wait_for(lambda: mirror() == set(keys[:4]), sched)
        (touch_id,) = sched.post_update_holds(touch=[keys[0], keys[5]])
        answers: list[object] = []

        def answered() -> bool:
            answers.extend(sched.take_answers())
            return any(getattr(a, "request_id", None) == touch_id for a in answers)

        wait_for(answered, sched)
        assert not any(isinstance(a, Error) for a in answers)
        assert sched.reserve(keys[4:5]).reserved == [0]  # evicts one key: keys[1], not keys[0]
        wait_for(lambda: len(mirror()) == 3, sched)
        assert mirror() == {keys[0], keys[2], keys[3]}
    finally:
        sched.close()
        r.close()
        d.stop()


def test_a_renewing_lease_stops_renewing() -> None:
    """A scheduler that reserves the same keys again as each reservation lapses (or again
    after it left) keeps them for 1 + limits.reservation_renewals leases, then no longer;
    what its ranks store within a lease is stored as ever."""
    limits = LimitsSettings(reservation_seconds=0.2, reservation_renewals=2)
    daemon = DaemonThread(capacity=64 << 20, limits=limits).start()
    r = rank(daemon.endpoint)
    sched = scheduler(daemon.endpoint)
    try:
        sched.wait_ready()
        assert daemon.daemon is not None
        stats = daemon.daemon.stats
        keys = chain_keys(4, b"renew")
        for lease in range(1, 4):  # the reservation and its 2 renewals
            assert sched.reserve(keys).reserved == [0, 1, 2, 3], lease
            expired = 4 * lease  # each lapses unstored (the daemon's stats expire them)

            def lapsed(expired: int = expired) -> bool:
                return stats().stores_refused_by_reason.get("expired") == expired

            wait_for(lapsed, sched)
        assert sched.reserve(keys).reserved == []
        assert stats().stores_refused_by_reason.get("expired") == 16
        assert stats().entries == 0
        # Leaving and coming back renews nothing.
        sched.close()
        sched = scheduler(daemon.endpoint)
        sched.wait_ready()
        assert sched.reserve(keys).reserved == []
        # Other keys are reserved, and stored, as ever.
        fresh = chain_keys(2, b"fresh")
        assert sched.reserve(fresh).reserved == [0, 1]
        store_reserved(r, 1, fresh, [0, 1])
        assert r.client is not None and r.client.lookup(fresh).hits == 2
    finally:
        sched.close()
        r.close()
        daemon.stop()

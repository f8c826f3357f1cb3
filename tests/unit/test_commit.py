"""offloadd.server.commit: a chunk is visible only when written, sealed and journaled.

No sockets. A real cache, arena, journal (its writes fail on cue: ``FaultyIO``), announcer and
tier coordinator over a dict tier (``tests.unit.tier_rig``); a rank's store goes through
``Jobs`` with a copy engine whose copies the test ends (``tests.fakes.FakeCopyEngine``).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from offloadd.cache.arena import Arena
from offloadd.cache.index import Entry, ShardWrite
from offloadd.cache.journal import Journal
from offloadd.server.commit import Commit, Committer
from offloadd.server.jobs import Jobs
from offloadd.server.metrics import Counters, Metrics
from offloadd.server.registry import Namespace
from offloadd.server.state import Job, SessionState
from offloadd.settings import ServerSettings
from offloadd.transfer.types import Direction
from protocol.events import MEDIUM_CPU, BlockStored
from protocol.messages import JobDone, Reply
from tests.fakes import MOVES, FakeCopyEngine, FakeHandles, FakeImport
from tests.journal_faults import FaultyIO
from tests.unit.tier_rig import ARENA, Rig, events, keys_named, make_rig, pattern, until


@dataclass
class Disk:
    """The journal's file; its writes fail with ENOSPC while ``full``."""

    path: str
    full: bool = False

    def open(self, arena: Arena) -> tuple[Journal, list[bytes]]:
        """Open (replay) the journal; the keys it restored."""
        io = FaultyIO(full=lambda: self.full)
        journal, chunks = Journal.open(self.path, arena, io=io, retry_seconds=3600.0)
        journal.compact(chunks)
        return journal, [chunk.key for chunk in chunks]


@pytest.fixture
def arena() -> Iterator[Arena]:
    path = f"/dev/shm/od-test-commit-{uuid.uuid4().hex[:8]}.arena"
    made = Arena(path, ARENA, unlink_on_close=False)  # kept for a restart
    yield made
    made.close()
    os.unlink(path)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    yield Disk(str(tmp_path / "state" / "a.journal"))


@dataclass
class Ranks:
    """The engine's two ranks storing through ``Jobs``, each its own shard."""

    rig: Rig
    jobs: Jobs
    copies: FakeCopyEngine
    states: list[SessionState]
    sent: list[Reply] = field(default_factory=list)

    async def store(self, key: bytes) -> list[JobDone]:
        """Both ranks store their shard of ``key``; their JobDones once both copies ended."""
        cache, name = self.rig.cache, self.rig.namespace.name
        sizes = self.rig.namespace.shard_sizes_for_key
        for shard, state in enumerate(self.states):
            writes = cache.begin_store(name, [key], shard, sizes).writes
            for write in writes:
                self.rig.arena.view(write.offset, write.size)[:] = pattern(key, shard, 1)
            job = Job(len(self.copies.futures), state, Direction.STORE, [key], [], 256)
            job.writes = list(writes)
            self.jobs.submit(state, job.job_id, job, MOVES)
        for future in self.copies.futures[-2:]:
            future.set_result(0.01)
        await until(lambda: self.jobs.in_flight == 0)
        return [reply for reply in self.sent[-2:] if isinstance(reply, JobDone)]


def ranks_of(rig: Rig) -> Ranks:
    copies = FakeCopyEngine(name="fake", manual=True, refusal=RuntimeError("no lane"))
    states = [
        SessionState(f"rank{r}".encode(), rig.engine.workers[r], [FakeImport()])  # type: ignore[list-item]
        for r in range(2)
    ]
    sent: list[Reply] = []
    jobs = Jobs(
        ServerSettings(),
        rig.registry,
        rig.cache,
        copies,
        FakeHandles(),  # type: ignore[arg-type]
        rig.committer,
        metrics=Metrics(),
        counters=Counters(),
        send=lambda _identity, reply: sent.append(reply),
    )
    return Ranks(rig, jobs, copies, states, sent)


async def demoted_then_evicted(rig: Rig, ranks: Ranks, key: bytes) -> None:
    """Store ``key`` through the ranks, wait for the tier's copy, evict it from the arena."""
    assert all(done.ok for done in await ranks.store(key))
    await until(lambda: rig.tiers.stats()[0].queued_bytes == 0 and len(rig.tier.puts) > 0)
    assert (rig.namespace.name, key) in rig.tier.chunks
    rig.evict([key])


async def promote(rig: Rig, key: bytes) -> None:
    """A lookup finds ``key`` in the tier; wait until its promotion ended either way."""
    name = rig.namespace.name
    assert rig.tiers.probe(rig.namespace, [key], 0, lambda _: None) == [0]
    await until(lambda: not rig.cache.lookup(name, [key]).pending)


def test_a_journal_that_refuses_takes_back_a_rank_store_and_a_promotion(
    arena: Arena,
    disk: Disk,
) -> None:
    async def main() -> None:
        journal, _ = disk.open(arena)
        rig = make_rig(arena, journal=journal)
        ranks = ranks_of(rig)
        name = rig.namespace.name
        promoted, stored = keys_named(b"below", b"stored")
        await demoted_then_evicted(rig, ranks, promoted)
        announced = len(events(rig, BlockStored, MEDIUM_CPU))
        assert announced == 1 and rig.cache.stats().used_bytes == 0
        disk.full = True

        done = await ranks.store(stored)
        assert [d.ok for d in done] == [True, False]  # the second shard made it visible
        assert done[1].failed_keys == [stored] and "not committed" in done[1].error
        assert "No space left" in done[1].error
        await promote(rig, promoted)

        for key in (stored, promoted):  # never visible, nothing left pending
            assert rig.cache.get(name, key) is None
        assert rig.cache.stats().used_bytes == 0  # every extent freed
        assert len(events(rig, BlockStored, MEDIUM_CPU)) == announced  # nothing announced
        assert rig.tiers.stats()[0].promotions == 0
        assert [key for put in rig.tier.puts for key in put] == [promoted]  # nor written down
        await rig.tiers.drain(5.0)
        journal.close()

    asyncio.run(main())


def test_a_rank_store_and_a_promotion_commit_through_the_one_committer(
    arena: Arena,
    disk: Disk,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, list[bytes]]] = []
    original = Committer.commit

    def recorded(
        self: Committer,
        namespace: Namespace | None,
        writes: Sequence[ShardWrite],
        *,
        ok: bool = True,
        source: str = "",
    ) -> Commit:
        outcome = original(self, namespace, writes, ok=ok, source=source)
        calls.append((source, [entry.key for entry in outcome.committed]))
        return outcome

    monkeypatch.setattr(Committer, "commit", recorded)

    async def main() -> None:
        journal, _ = disk.open(arena)
        rig = make_rig(arena, journal=journal)
        ranks = ranks_of(rig)
        (key,) = keys_named(b"both")
        await demoted_then_evicted(rig, ranks, key)
        assert calls == [("", []), ("", [key])]  # the ranks' jobs; the second shard commits
        await promote(rig, key)
        assert calls[2:] == [("disk", [key])]
        assert rig.arena_bytes(key) == [pattern(key, shard, 1) for shard in range(2)]
        assert len(events(rig, BlockStored, MEDIUM_CPU)) == 2  # the store, the promotion
        entry = rig.cache.get(rig.namespace.name, key)
        assert entry is not None
        await rig.tiers.drain(5.0)
        journal.close()
        # Journaled, like the rank's store: a restart finds the promoted copy's bytes.
        arena.close()
        reopened = Arena(arena.path, ARENA, unlink_on_close=False)  # the file a restart finds
        again, restored = disk.open(reopened)
        assert restored == [key]
        again.close()
        reopened.close()

    asyncio.run(main())


@dataclass
class Steps:
    """A journal and an announcer that log the committer's calls into one list, in order."""

    log: list[str] = field(default_factory=list)
    refuse: bool = False

    failed = "injected"

    def submit_seal(self, writes: Sequence[ShardWrite], then: Callable[[], object]) -> None:
        self.log.append("seal")
        then()

    def committed(self, entries: Sequence[Entry], chunks: object) -> list[Entry]:
        self.log.append("journal")
        return list(entries) if self.refuse else []

    def should_compact(self) -> bool:
        return False

    def chunks_committed(self, namespace: Namespace, entries: list[Entry], *, source: str) -> None:
        self.log.append(f"announce {len(entries)}")


def test_sealed_then_visible_then_journaled_then_announced(arena: Arena) -> None:
    async def main() -> None:
        rig = make_rig(arena)
        for refuse in (False, True):
            steps = Steps(refuse=refuse)
            committer = Committer(rig.cache, steps, journal=steps)  # type: ignore[arg-type]
            (key,) = keys_named(b"refused" if refuse else b"kept")
            name, sizes = rig.namespace.name, rig.namespace.shard_sizes_for_key
            writes = [
                w for s in range(2) for w in rig.cache.begin_store(name, [key], s, sizes).writes
            ]

            def sealed_then(log: list[str] = steps.log) -> None:
                log.append("sealed")

            committer.seal(writes, sealed_then)
            outcome = committer.commit(rig.namespace, writes)
            assert steps.log == ["seal", "sealed", "journal", f"announce {0 if refuse else 1}"]
            entry = rig.cache.get(name, key)
            if refuse:
                assert entry is None and outcome.committed == [] and outcome.reason == "injected"
                assert [lost.key for lost in outcome.lost] == [key] and outcome.lost[0].dead
            else:
                assert entry is not None and entry.committed and outcome.committed == [entry]
        # Without a journal the seal is the caller's own thread, at once.
        unjournaled = Committer(rig.cache, rig.announce, journal=None)
        sealed: list[bool] = []
        unjournaled.seal([], lambda: sealed.append(True))
        assert sealed == [True]
        await rig.tiers.drain(5.0)

    asyncio.run(main())

"""A journal that cannot lie, against a real daemon with real ranks.

The daemon runs with its journal writes failing on cue (ENOSPC, a torn record left behind)
while two ranks store real bytes through shared memory into a small arena (stores evict, so
tombstones and commits interleave). A store whose commit cannot be journaled must say
ok=False and stay invisible; after a SIGKILL and a restart every chunk the daemon serves must
be byte-exact. Torn and forged records appended while the daemon is down, and changed arena
bytes, must cost hits, never correctness, and never the start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from offloadd.errors import NotReady
from tests.integration.harness import (
    Rank,
    ServeProcess,
    chain_keys,
    chunk_block_ids,
    make_rank,
    serve_process,
)

CHUNKS = 40
KEYS = chain_keys(CHUNKS, salt=b"journal-faults")
SCRATCH = [250, 251]
CAPACITY = "512KiB"  # 10 chunks of 2 shards x 24 KiB


@pytest.fixture
def serve() -> Iterator[ServeProcess]:
    with serve_process(CAPACITY) as daemon:
        yield daemon


def _faulty(*faults: str) -> list[str]:
    return ["-m", "tests.integration.faulty_serve", *faults]


def _engine(serve: ServeProcess, ranks: list[Rank]) -> list[Rank]:
    engine = [make_rank(serve.endpoint, rank=r, tp=2) for r in range(2)]
    ranks.extend(engine)
    for seed, rank in enumerate(engine):
        rank.fill(100 + seed)
    assert engine[0].client is not None
    engine[0].client.wait_ready(10)
    return engine


def _store(engine: list[Rank], index: int) -> bool:
    """Store chunk ``index`` (its own blocks) from both ranks; whether both jobs said ok."""
    ok = True
    for rank in engine:
        assert rank.client is not None
        rank.client.store(1000 + index, KEYS[index : index + 1], chunk_block_ids([index], 2))
    for rank in engine:
        assert rank.client is not None
        (done,) = rank.client.wait([1000 + index], 10, raise_on_failure=False)
        ok = ok and done.ok
        if not done.ok:
            assert done.failed_keys == [KEYS[index]] and "journal" in done.error
    return ok


def _hits(engine: list[Rank]) -> set[int]:
    client = engine[0].client
    assert client is not None
    return {index for index, key in enumerate(KEYS) if client.lookup([key]).hits}


def _reconnect(engine: list[Rank]) -> None:
    """After a restart each rank's next request says Hello again; the engine is whole then."""
    for rank in engine:
        assert rank.client is not None
        with contextlib.suppress(NotReady):
            rank.client.lookup(KEYS[:1])
    assert engine[0].client is not None
    engine[0].client.wait_ready(10)


def _verify_every_hit(engine: list[Rank]) -> set[int]:
    """Load every chunk the daemon has into scratch blocks and compare every byte."""
    hits = _hits(engine)
    for job, index in enumerate(sorted(hits), start=5000):
        for rank in engine:
            assert rank.client is not None
            rank.client.load(job, KEYS[index : index + 1], SCRATCH)
            rank.client.wait([job], 10)
            stored = rank.pages(chunk_block_ids([index], 2))
            for got, want in zip(rank.pages(SCRATCH), stored, strict=True):
                assert torch.equal(got, want), f"chunk {index} came back with other bytes"
    return hits


# What the daemon logs when the journal named a chunk whose bytes had changed.
MISMATCH = "no longer hold the bytes"


def _restart(serve: ServeProcess, engine: list[Rank]) -> set[int]:
    assert serve.stop(signal.SIGKILL) == -signal.SIGKILL
    serve.start(log=True)
    _reconnect(engine)
    hits = _verify_every_hit(engine)
    # Byte-exact even without the checksums: the journal itself named no reused extent.
    assert MISMATCH not in serve.log()
    return hits


def _every_third(first: int) -> str:
    return ",".join(str(n) for n in range(first, 200, 3))


@pytest.mark.parametrize(
    "faults",
    [
        pytest.param(("--fail-writes", "2", "--partial", "0"), id="first-commit"),
        pytest.param(("--fail-writes", _every_third(2), "--partial", "5"), id="writes-2-5-8"),
        pytest.param(("--fail-writes", _every_third(3), "--partial", "30"), id="writes-3-6-9"),
        pytest.param(("--fail-writes", _every_third(4), "--partial", "1"), id="writes-4-7-10"),
    ],
)
def test_enospc_on_journal_writes_never_serves_a_wrong_byte(
    serve: ServeProcess, ranks: list[Rank], faults: tuple[str, ...]
) -> None:
    # Write 1 is the journal's rewrite at start; then one per commit and per eviction, and a
    # rewrite on the commit after each failure. Together the "every third" runs fail each
    # write position at least once.
    serve.start(runner=_faulty(*faults))
    engine = _engine(serve, ranks)
    refused = [index for index in range(CHUNKS) if not _store(engine, index)]
    assert refused, "no store met a failing journal append"
    before = _verify_every_hit(engine)
    assert before and not set(refused) & before  # a refused store is never visible
    after = _restart(serve, engine)
    assert after <= before
    assert after, "nothing came back after the restart"


def test_a_crash_before_the_journal_is_rewritten_serves_no_wrong_byte(
    serve: ServeProcess, ranks: list[Rank]
) -> None:
    # Writes: 1 the rewrite at start, 2-11 the commits of chunks 0-9 (the arena is full
    # then), 12 chunk 10's eviction of chunk 0, 13 chunk 10's commit: it fails, leaving a
    # torn record. No rewrite is tried, so the tombstones that follow (a Clear) go to that
    # file: they must land after the last good record, not after the torn one, or a restart
    # would find chunks 1-9 again in extents that later stores overwrote.
    serve.start(runner=_faulty("--fail-writes", "13", "--partial", "5", "--retry-seconds", "3600"))
    engine = _engine(serve, ranks)
    assert all(_store(engine, index) for index in range(10))
    assert not _store(engine, 10)
    assert _verify_every_hit(engine) == set(range(1, 10))
    client = engine[0].client
    assert client is not None
    assert client.clear() == 9
    assert not any(_store(engine, index) for index in range(11, 21))  # over the cleared bytes
    assert _verify_every_hit(engine) == set()
    assert _restart(serve, engine) == set()


def test_a_full_disk_fails_stores_until_space_returns(
    serve: ServeProcess, ranks: list[Rank]
) -> None:
    flag = Path(serve.journal).parent.parent / "disk-full"
    serve.start(runner=_faulty("--full-flag", str(flag)))
    engine = _engine(serve, ranks)
    stored = [index for index in range(8) if _store(engine, index)]
    assert stored == list(range(8))
    flag.touch()
    assert not any(_store(engine, index) for index in range(8, 20))
    client = engine[0].client
    assert client is not None
    # Refused chunks are taken back: only the 8 committed chunks hold space.
    assert client.stats().committed_entries == 8
    flag.unlink()
    # The journal is rewritten; then many stores, evicting what was there before the disk
    # filled up, its tombstones after the last good record.
    assert all(_store(engine, index) for index in range(20, CHUNKS))
    before = _verify_every_hit(engine)
    assert not before & set(range(8, 20))
    assert _restart(serve, engine) == before


def _journal_frame(payload: bytes, mac: bytes = bytes(16)) -> bytes:
    return len(payload).to_bytes(4, "big") + mac + payload


def test_torn_and_forged_records_cost_hits_never_bytes(
    serve: ServeProcess, ranks: list[Rank]
) -> None:
    serve.start()
    engine = _engine(serve, ranks)
    assert all(_store(engine, index) for index in range(6))
    before = _verify_every_hit(engine)
    assert serve.stop(signal.SIGKILL) == -signal.SIGKILL
    size = os.path.getsize(serve.journal)
    # A forged record naming chunk 0's extents as chunk 30's, then a torn one.
    forged = msgspec.msgpack.encode(["+", "any", KEYS[30], [0, 4096], [24576, 24576], [0, 0]])
    with open(serve.journal, "ab") as journal:
        journal.write(_journal_frame(forged) + _journal_frame(b"\x93\x01\x02\x03")[:9])
    serve.start(log=True)  # starts: what it cannot authenticate is a torn tail
    _reconnect(engine)
    assert _verify_every_hit(engine) == before
    assert "torn, forged or unreadable" in serve.log()
    assert os.path.getsize(serve.journal) <= size  # the tail is gone


def test_changed_arena_bytes_drop_only_that_chunk(serve: ServeProcess, ranks: list[Rank]) -> None:
    serve.start()
    engine = _engine(serve, ranks)
    assert all(_store(engine, index) for index in range(4))
    assert serve.stop(signal.SIGKILL) == -signal.SIGKILL
    with open(serve.arena, "r+b") as arena:  # the first extent allocated: chunk 0's shard 0
        arena.seek(100)
        byte = arena.read(1)[0]
        arena.seek(100)
        arena.write(bytes([byte ^ 0x40]))
    serve.start(log=True)
    _reconnect(engine)
    assert _verify_every_hit(engine) == {1, 2, 3}
    assert MISMATCH in serve.log()


def test_a_journal_where_ranks_name_files_is_refused(serve: ServeProcess) -> None:
    command = [
        sys.executable, "-m", "offloadd", "serve", "--endpoint", serve.endpoint,
        "--arena", serve.arena, "--capacity", CAPACITY, "--journal", serve.arena + ".journal",
        "--events-endpoint", serve.events_endpoint, "--events-replay-endpoint", "",
        "--metrics-address", "",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "inside server.shm_dirs" in result.stderr
    assert not os.path.exists(serve.arena + ".journal")

"""A rank's step as one StepJobs against a real daemon: its jobs are checked together
(``requests._checked_together``) and, when one of them is bad, each alone: the bad job is
refused with its own code and message, every other job of the step moves its bytes exactly."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from offloadd.settings import LimitsSettings
from offloadd.transfer.types import Direction
from protocol.errors import ErrorCode
from protocol.messages import JobDone, Load, Store
from tests.fakes import FakeCopyEngine
from tests.integration.conftest import DaemonFactory
from tests.integration.harness import Rank, chain_keys, chunk_block_ids, make_rank

BPC = 2
STEP = 8  # good loads in a step, two keys each
DESTINATION = 100  # their blocks start here; the stores' at 0
IN_FLIGHT_JOB = 99


def _source(i: int) -> list[int]:
    return chunk_block_ids([2 * i, 2 * i + 1], BPC)


def _destination(i: int) -> list[int]:
    return chunk_block_ids([2 * i, 2 * i + 1], BPC, DESTINATION)


def _stored(daemon_factory: DaemonFactory, ranks: list[Rank], **settings: object) -> Rank:
    """A rank whose STEP pairs of keys are stored (pair i from chunks 2i and 2i+1)."""
    daemon = daemon_factory(**settings)
    rank = make_rank(daemon.endpoint, rank=0, tp=1)
    ranks.append(rank)
    rank.fill(11)
    assert rank.client is not None
    rank.client.wait_ready(5)
    for i in range(STEP):
        rank.client.store(i + 1, _pair(i), _source(i))
    rank.client.wait(list(range(1, STEP + 1)), 10)
    return rank


def _pair(i: int) -> list[bytes]:
    return chain_keys(2, salt=b"step-%d" % i)


def _loads() -> list[Load]:
    return [Load(0, 100 + i, _pair(i), _destination(i)) for i in range(STEP)]


def _bad_block_id() -> Load:
    return Load(0, 200, _pair(0), [*_destination(0)[:-1], 10_000])


def _unknown_group() -> Load:
    return Load(0, 200, [key[:-4] + (7).to_bytes(4, "big") for key in _pair(0)], _destination(0))


def _too_many_keys() -> Load:
    keys = _pair(0) + _pair(1)[:1]  # keys_per_request is 2 here
    return Load(0, 200, keys, chunk_block_ids(range(3), BPC, 200))


def _one_job_too_many() -> Load:
    return Load(0, 200, _pair(0), chunk_block_ids([0, 1], BPC, 200))  # jobs_per_session: STEP


def _in_flight_id() -> Load:
    return Load(0, IN_FLIGHT_JOB, _pair(0), chunk_block_ids([0, 1], BPC, 200))


BAD = {
    "block id out of range": (_bad_block_id, ErrorCode.BAD_REQUEST, "block id 10000"),
    "key of no group": (_unknown_group, ErrorCode.BAD_REQUEST, "names group 7"),
    "too many keys": (_too_many_keys, ErrorCode.TOO_LARGE, "keys_per_request"),
    "one job too many": (_one_job_too_many, ErrorCode.TOO_LARGE, "jobs_per_session"),
    "job id in flight": (_in_flight_id, ErrorCode.DUPLICATE_JOB, "still running"),
}
LIMITS = {
    "too many keys": LimitsSettings(keys_per_request=2),
    "one job too many": LimitsSettings(jobs_per_session=STEP),
}


def _assert_loaded(rank: Rank, loads: list[Load], done: list[JobDone]) -> None:
    for i, (load, result) in enumerate(zip(loads, done, strict=True)):
        assert result.ok and result.job_id == load.job_id, result
        for got, want in zip(rank.pages(_destination(i)), rank.pages(_source(i)), strict=True):
            assert torch.equal(got, want)


def test_a_step_of_good_loads_moves_every_byte(
    daemon_factory: DaemonFactory, ranks: list[Rank]
) -> None:
    rank = _stored(daemon_factory, ranks)
    assert rank.client is not None
    loads = _loads()
    rank.client.post_jobs(loads)
    _assert_loaded(rank, loads, rank.client.wait([load.job_id for load in loads], 10))


@pytest.mark.parametrize("bad", list(BAD))
def test_a_bad_job_in_a_step_is_refused_alone(
    bad: str, daemon_factory: DaemonFactory, ranks: list[Rank]
) -> None:
    make_bad, code, says = BAD[bad]
    held = FakeCopyEngine(held=(Direction.LOAD,))
    settings: dict[str, object] = {"copy_engine": held}
    if bad in LIMITS:
        settings["limits"] = LIMITS[bad]
    rank = _stored(daemon_factory, ranks, **settings)
    client = rank.client
    assert client is not None
    if bad == "job id in flight":
        held.gate.clear()
        client.load(IN_FLIGHT_JOB, _pair(1), chunk_block_ids([0, 1], BPC, 220))
        assert held.started.acquire(timeout=10)
    loads = _loads()
    at = STEP if bad == "one job too many" else 3  # the jobs after a bad one run too
    step = [*loads[:at], make_bad(), *loads[at:]]
    client.post_jobs(step)
    refused = _refusal(client.wait, step[at].job_id, code)
    assert says in refused.error, refused.error
    held.gate.set()
    _assert_loaded(rank, loads, client.wait([load.job_id for load in loads], 10))


def _refusal(wait: Callable[..., list[JobDone]], job_id: int, code: ErrorCode) -> JobDone:
    """The JobDone of the refused job (for a job id in flight: the refusal, which comes
    first, not the running job's end)."""
    (done,) = wait([job_id], 10, raise_on_failure=False)
    assert (done.ok, done.code) == (False, code), done
    return done


def test_a_step_of_loads_of_many_shapes_moves_every_byte(
    daemon_factory: DaemonFactory, ranks: list[Rank]
) -> None:
    """Loads planned together (``requests._start_loads``) whose chunks are not alike: some
    start mid-chunk, some load one key, one names a key never stored and fails alone."""
    rank = _stored(daemon_factory, ranks)
    client = rank.client
    assert client is not None
    loads, wanted = [], []
    for i in range(STEP):
        keys, blocks, source = _pair(i), _destination(i), _source(i)
        if i % 3 == 1:  # starts at the second block of the first chunk
            blocks, source = blocks[1:], source[1:]
            loads.append(Load(0, 100 + i, keys, blocks, skip=1))
        elif i % 3 == 2:  # the pair's first key only
            blocks, source = blocks[:BPC], source[:BPC]
            loads.append(Load(0, 100 + i, keys[:1], blocks))
        else:
            loads.append(Load(0, 100 + i, keys, blocks))
        wanted.append((blocks, source))
    missing = Load(0, 200, chain_keys(2, salt=b"never stored"), chunk_block_ids([0, 1], BPC, 220))
    step = [*loads[:4], missing, *loads[4:]]
    client.post_jobs(step)
    (failed,) = client.wait([missing.job_id], 10, raise_on_failure=False)
    assert not failed.ok and failed.failed_keys == missing.keys, failed
    done = client.wait([load.job_id for load in loads], 10)
    assert all(result.ok for result in done), done
    for blocks, source in wanted:
        for got, want in zip(rank.pages(blocks), rank.pages(source), strict=True):
            assert torch.equal(got, want)


def test_a_steps_loads_reach_the_copy_engine_ahead_of_its_stores(
    daemon_factory: DaemonFactory, ranks: list[Rank]
) -> None:
    """Loads first: a request's first token waits for them, a store can wait. A step that
    lists its stores first hands its loads to the copy engine first, and every byte of both
    moves."""
    engine = FakeCopyEngine()
    rank = _stored(daemon_factory, ranks, copy_engine=engine)
    client = rank.client
    assert client is not None
    engine.manual = True  # from here the test hands each copy over, in the order it came
    stores = [Store(0, 300 + i, chain_keys(2, salt=b"new-%d" % i), _source(i)) for i in range(2)]
    loads = _loads()
    client.post_jobs([*stores, *loads])
    while len(engine.handed) < 2:
        client.poll(0.05)
    assert [direction for direction, _moves, _event in engine.handed] == [
        Direction.LOAD,
        Direction.STORE,
    ]
    for future, (direction, _, _event), moves in zip(
        engine.futures, engine.handed, engine.moves, strict=True
    ):
        future.set_result(engine.inner.submit(direction, moves).result(10))
    ids = [store.job_id for store in stores] + [load.job_id for load in loads]
    done = client.wait(ids, 10)
    assert all(result.ok for result in done), done
    _assert_loaded(rank, loads, done[len(stores) :])
    engine.manual = False
    check = [Load(0, 400 + i, store.keys, _destination(i)) for i, store in enumerate(stores)]
    client.post_jobs(check)
    assert all(result.ok for result in client.wait([load.job_id for load in check], 10))
    for i in range(len(stores)):
        for got, want in zip(rank.pages(_destination(i)), rank.pages(_source(i)), strict=True):
            assert torch.equal(got, want)

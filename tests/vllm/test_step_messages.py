"""A scheduling step costs each rank, and the scheduler inside ``schedule()``, at most one
message to the daemon, whatever the batch.

vLLM's real Scheduler and worker connectors drive ``OffloaddSpec`` against a real daemon: N
requests prefill in one step, so their N stores reach every rank in the next one; later N
requests sharing those prompts load them in one step. The messages each rank's client puts
on its socket are counted per step (not timed), with how many were out when the rank's
forward pass and its ``get_finished`` began (a step's jobs leave once vLLM submitted them
all: before the forward pass in a step of stores only), and so are those the scheduler's
client sends from the thread in ``schedule()`` while it is there (its background thread's acks
and keepalives are not the step's); every loaded page is checked byte for byte against the
bytes its prefix determines. Inside ``schedule()`` nothing may wait for the daemon: every
socket wait (a ``poll`` with a timeout) there counts as an awaited round trip, and there are
none. With a daemon whose disk tier holds keys its arena lost, the step's tier probes travel
in that one message too, and the chunks they promote load with their bytes.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from offloadd.cache.index import Entry
from offloadd.server.daemon import Daemon
from offloadd.settings import DiskSettings
from offloadd.vllm import step_hook
from offloadd.vllm.manager import OffloaddManager
from offloadd.vllm.worker import OffloaddWorker
from protocol.messages import JobDone, JobsDone, TierState
from tests.integration.harness import DaemonThread
from tests.vllm.harness import NUM_LAYERS, VllmHarness, sampled_token

pytestmark = pytest.mark.timeout(600)

BLOCK = 16
TP = 2


def _prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


@pytest.fixture
def daemon() -> Iterator[DaemonThread]:
    d = DaemonThread(capacity=64 << 20).start()
    yield d
    d.stop()


class _ScheduleSocket:
    """The scheduler client's socket: counts what the thread in ``schedule()`` sends there,
    its waits for an answer there (a poll that may block: an awaited round trip), and every
    call it makes there (``touched``)."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.inside: int | None = None  # the thread in schedule(), while it is there
        self.sent = 0
        self.awaited = 0
        self.touched = 0

    def _in_schedule(self) -> bool:
        inside = threading.get_ident() == self.inside
        self.touched += inside
        return inside

    def send(self, *args: Any, **kwargs: Any) -> Any:
        out = self._sock.send(*args, **kwargs)
        if self._in_schedule():
            self.sent += 1
        return out

    def poll(self, timeout: int | None = None, *args: Any, **kwargs: Any) -> Any:
        if self._in_schedule() and timeout != 0:
            self.awaited += 1
        return self._sock.poll(timeout, *args, **kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        self._in_schedule()
        return self._sock.recv(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _Counts:
    """Per step and rank: messages sent, stores and loads submitted, and the messages sent
    by the rank's first forward pass and by its ``get_finished``; per step: the scheduler's
    messages inside ``schedule()``; per rank: the frames that brought its loads' ends."""

    def __init__(self, h: VllmHarness) -> None:
        self.workers: list[OffloaddWorker] = []
        self.jobs: list[dict[str, int]] = []
        self.load_end_frames: list[int] = []
        self._before: list[int] = []
        # this step, per rank: messages sent when its forward pass / get_finished began
        self._at: list[dict[str, int]] = []
        self.early: list[list[dict[str, int]]] = []  # one entry per step
        for index, state in enumerate(h.ranks):
            worker = state.offloading_worker
            assert isinstance(worker, OffloaddWorker)
            self.workers.append(worker)
            jobs = {"store": 0, "load": 0}
            self.jobs.append(jobs)
            finished = worker.get_finished
            self._count_load_ends(worker)

            def get_finished(_f: Any = finished, _i: int = index) -> Any:
                self._mark(_i, "finished")
                return _f()

            setattr(worker, "get_finished", get_finished)  # noqa: B010 (an instance's method)
            for kind in ("store", "load"):
                original = getattr(worker, f"submit_{kind}")

                def counted(
                    *args: Any, _kind: str = kind, _f: Any = original, _i: int = index, **kw: Any
                ) -> Any:
                    self.jobs[_i][_kind] += 1
                    return _f(*args, **kw)

                setattr(worker, f"submit_{kind}", counted)
        # (messages, stores, loads) of each rank, one entry per step
        self.steps: list[list[tuple[int, int, int]]] = []
        self.scheduler: list[int] = []  # the scheduler's messages inside schedule(), per step
        self.touched: list[int] = []  # its socket calls inside schedule(), per step
        self.awaited: list[int] = []  # its waits for an answer inside schedule(), per step
        manager = h.offloading_manager
        assert isinstance(manager, OffloaddManager) and manager._client is not None
        self._socket = _ScheduleSocket(manager._client._sock)
        manager._client._sock = self._socket  # type: ignore[assignment]
        schedule = h.scheduler.schedule

        def counted_schedule(*args: Any, **kwargs: Any) -> Any:
            self._socket.inside = threading.get_ident()
            try:
                return schedule(*args, **kwargs)
            finally:
                self._socket.inside = None

        setattr(h.scheduler, "schedule", counted_schedule)  # noqa: B010 (an instance's method)
        forward = h._forward

        def marked_forward(state: Any, *args: Any) -> None:
            self._mark(state.rank, "forward")
            forward(state, *args)

        setattr(h, "_forward", marked_forward)  # noqa: B010 (an instance's method)

    def _count_load_ends(self, worker: OffloaddWorker) -> None:
        client = worker._client
        assert client is not None
        core = client._core
        decode = core.decode
        self.load_end_frames.append(0)
        rank = len(self.load_end_frames) - 1

        def counted(frame: bytes) -> Any:
            reply = decode(frame)
            dones = reply.dones if isinstance(reply, JobsDone) else [reply]
            jobs = [worker._jobs.get(d.job_id) for d in dones if isinstance(d, JobDone)]
            if any(job is not None and job.load for job in jobs):
                self.load_end_frames[rank] += 1
            return reply

        setattr(core, "decode", counted)  # noqa: B010 (an instance's method)

    def _mark(self, rank: int, moment: str) -> None:
        self._at[rank].setdefault(moment, self._sent(self.workers[rank]) - self._before[rank])

    def step(self, h: VllmHarness) -> None:
        before = self._before = [self._sent(w) for w in self.workers]
        self._at = [{} for _ in self.workers]
        for jobs in self.jobs:
            jobs["store"] = jobs["load"] = 0
        self._socket.sent = self._socket.awaited = self._socket.touched = 0
        h.step()
        self.early.append(self._at)
        self.scheduler.append(self._socket.sent)
        self.touched.append(self._socket.touched)
        self.awaited.append(self._socket.awaited)
        self.steps.append(
            [
                (self._sent(w) - b, j["store"], j["load"])
                for w, b, j in zip(self.workers, before, self.jobs, strict=True)
            ]
        )

    @staticmethod
    def _sent(worker: OffloaddWorker) -> int:
        client = worker._client
        assert client is not None
        return client.sent - worker.idle_messages  # the background's keepalives are no step's

    def run(self, h: VllmHarness, seconds: float = 120.0) -> None:
        # Bounded in time, not steps: on a fast machine a step takes microseconds, and the
        # daemon's notices (JobDone) arrive in their own time.
        deadline = time.monotonic() + seconds
        while h.has_work():
            assert time.monotonic() < deadline, f"still busy after {seconds} s"
            self.step(h)


def _settle(h: VllmHarness, chunks: int) -> None:
    manager = h.offloading_manager
    assert isinstance(manager, OffloaddManager)
    deadline = time.monotonic() + 60
    while len(manager._mirror.keys) < chunks:
        assert time.monotonic() < deadline, f"mirror has {len(manager._mirror.keys)} chunks"
        time.sleep(0.01)


def _harness(tmp_path: Path, daemon: DaemonThread, n: int) -> VllmHarness:
    extra = {
        "spec_name": "OffloaddSpec",
        "spec_module_path": "offloadd.vllm",
        "offloadd_endpoint": daemon.endpoint,
        "block_size": BLOCK,
    }
    return VllmHarness(
        tmp_path,
        extra,
        tensor_parallel_size=TP,
        num_blocks=4 * n + 16,
        max_num_batched_tokens=n * (2 * BLOCK + 8),
        max_num_seqs=n,
        max_model_len=8 * BLOCK,
    )


def _load_and_check(
    h: VllmHarness,
    counts: _Counts,
    prompts: list[list[int]],
    stored: Collection[int] | None = None,
) -> list[int]:
    """N requests sharing the prompts' 2 chunks: each loads both, with their bytes (with
    ``stored``: those prompts' loaders; the others may load less, or nothing). Every page
    loaded is checked against its prefix's bytes, and every output. Returns each loader's
    tokens from the connector."""
    stored = set(range(len(prompts))) if stored is None else set(stored)
    h.reset_prefix_cache()  # drop the GPU prefix cache and zero every rank's KV
    loaders = [
        h.add_request(p[: 2 * BLOCK] + _prompt(10_000 + i, 5), 2) for i, p in enumerate(prompts)
    ]
    counts.run(h)
    external = [h.external_tokens(req) for req in loaders]
    for index, (req, prompt) in enumerate(zip(loaders, prompts, strict=True)):
        if index in stored:
            assert external[index] == 2 * BLOCK, (index, external)
        assert h.assert_loaded_pages(req) == external[index] // BLOCK * NUM_LAYERS * TP
        tokens = prompt[: 2 * BLOCK] + _prompt(10_000 + index, 5)
        expected = []
        for _ in range(2):
            expected.append(sampled_token(tokens))
            tokens.append(expected[-1])
        assert h.outputs[req] == expected
    return external


def _assert_bounds(counts: _Counts) -> None:
    worst = max(sent for step in counts.steps for sent, _, _ in step)
    assert worst <= 1, [
        (index, step) for index, step in enumerate(counts.steps) if any(s > 1 for s, _, _ in step)
    ]
    # The scheduler: one message inside schedule() in the steps that store or load, at most
    # one in any step, and never a wait for its answer there.
    assert max(counts.scheduler) <= 1, counts.scheduler
    assert sum(counts.scheduler) >= 2, counts.scheduler
    assert sum(counts.awaited) == 0, counts.awaited


def _sent_by(counts: _Counts, moment: str, *, stores_only: bool) -> list[int]:
    """Per rank and step that submitted jobs (stores only, if ``stores_only``), the messages
    out when ``moment`` ("forward", "finished") began."""
    out = []
    for index, step in enumerate(counts.steps):
        for (_, stores, loads), at in zip(step, counts.early[index], strict=True):
            submitted = (stores and not loads) if stores_only else (stores or loads)
            if submitted and moment in at:
                out.append(at[moment])
    return out


def _store_then_load(tmp_path: Path, daemon: DaemonThread, n: int) -> _Counts:
    """N requests store their 2 chunks each, then N others load them: counted per step."""
    prompts = [_prompt(seed, 2 * BLOCK + 3) for seed in range(n)]  # 2 chunks each
    with _harness(tmp_path, daemon, n) as h:
        counts = _Counts(h)
        for prompt in prompts:
            h.add_request(prompt, max_tokens=3)
        counts.run(h)
        # Every rank got the N requests' 2N chunks as N stores in one step.
        assert any(all(store == n for _, store, _ in step) for step in counts.steps)
        _settle(h, 2 * n)
        _load_and_check(h, counts, prompts)
        assert any(all(load == n for _, _, load in step) for step in counts.steps)
        _assert_bounds(counts)
        # A step's loads end together: one frame brings them all (JobsDone), not one each.
        for rank, frames in enumerate(counts.load_end_frames):
            steps = sum(1 for step in counts.steps if step[rank][2])
            assert 0 < frames <= steps, (rank, frames, steps)
    return counts


@pytest.mark.parametrize("n", [1, 64, 256])
def test_one_message_per_rank_per_step(tmp_path: Path, daemon: DaemonThread, n: int) -> None:
    counts = _store_then_load(tmp_path, daemon, n)
    # A step's jobs leave once vLLM submitted them all, not at get_finished: before the
    # forward pass in a step of stores only, before get_finished in every step.
    before_finished = _sent_by(counts, "finished", stores_only=False)
    assert before_finished and set(before_finished) == {1}, counts.early
    before_forward = _sent_by(counts, "forward", stores_only=True)
    assert before_forward and set(before_forward) == {1}, counts.early


def test_a_quiet_step_touches_no_socket(tmp_path: Path, daemon: DaemonThread) -> None:
    """Once the stores' commits reached the mirror, decode steps have nothing to send and
    nothing on its way: ``schedule()`` makes no call on the scheduler's socket. A step
    that stores again reads and sends, and its keys still reach the mirror."""
    n = 4
    with _harness(tmp_path, daemon, n) as h:
        manager = h.offloading_manager
        assert isinstance(manager, OffloaddManager)
        counts = _Counts(h)
        for seed in range(n):
            h.add_request(_prompt(seed, 2 * BLOCK + 3), max_tokens=60)
        deadline = time.monotonic() + 60
        while len(manager._mirror.keys) < 2 * n or manager._stores.awaiting_commits:
            assert time.monotonic() < deadline, (len(manager._mirror.keys), counts.touched)
            counts.step(h)
        assert max(counts.touched) > 0  # the store step's message, its answer and commits
        quiet = len(counts.touched)
        for _ in range(5):
            counts.step(h)
        assert counts.touched[quiet:] == [0] * 5, counts.touched
        # A new request's store: read and sent inside schedule() again, and committed.
        h.add_request(_prompt(99, 2 * BLOCK + 3), max_tokens=2)
        counts.run(h)
        assert sum(counts.scheduler[quiet + 5 :]) >= 1, counts.scheduler
        _settle(h, 2 * n + 2)


def test_without_the_hook_jobs_leave_at_get_finished(
    tmp_path: Path,
    daemon: DaemonThread,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # No OffloadingConnectorWorker found calling get_worker (another vLLM, say): the
    # worker falls back to sending at get_finished, still one message per step.
    monkeypatch.setattr(step_hook, "calling_connector_worker", lambda spec: None)
    with caplog.at_level(logging.INFO, logger=step_hook.__name__):
        counts = _store_then_load(tmp_path, daemon, 4)
    assert any("no vLLM OffloadingConnectorWorker found" in r.message for r in caplog.records)
    before_finished = _sent_by(counts, "finished", stores_only=False)
    assert before_finished and set(before_finished) == {0}, counts.early


class _Handed:
    """The chunks the daemon's commits handed its tiers to write (a rank store's commit;
    a promotion, from the disk, is not written back to it), key by key: what a wave really
    committed, which is less than it asked to store where a store went unreserved (the
    step's answer came late) or its reservation expired, as a loaded machine may have it."""

    def __init__(self, daemon: Daemon) -> None:
        tiers = daemon._tiers
        assert tiers is not None
        self.keys: list[bytes] = []  # appended on the daemon's loop, read here
        committed = tiers.committed

        def spy(namespace: str, entries: list[Entry], source: str = "") -> None:
            if not source:
                self.keys.extend(entry.key for entry in entries)
            committed(namespace, entries, source)

        setattr(tiers, "committed", spy)  # noqa: B010 (an instance's method)


def _asked(manager: OffloaddManager) -> dict[str, list[bytes]]:
    """Each request's keys as vLLM asks the manager to store them (``prepare_store``)."""
    asked: dict[str, list[bytes]] = {}
    prepare = manager.prepare_store

    def spy(keys: Any, req_context: Any) -> Any:
        asked.setdefault(req_context.req_id, []).extend(keys)
        return prepare(keys, req_context)

    setattr(manager, "prepare_store", spy)  # noqa: B010 (an instance's method)
    return asked


def _demoted(daemon: Daemon, manager: OffloaddManager, handed: _Handed, wave: int) -> TierState:
    """Wait until the wave's stores have all ended (every step answered, no copy running,
    no reservation open: nothing more of it commits) and every chunk they committed left
    the disk tier's queue: written there (``demotions``) or skipped (evicted before its
    turn, ``demotions_skipped``), nothing queued."""
    deadline = time.monotonic() + 60
    while True:
        with manager.lock:
            answered = manager.steps_answered()
        stats = daemon.stats()
        (tier,) = stats.tiers
        ended = answered and stats.jobs_in_flight == 0 and stats.entries == stats.committed_entries
        left = tier.demotions + tier.demotions_skipped == len(handed.keys)
        if ended and left and tier.queued_bytes == 0:
            return tier
        assert time.monotonic() < deadline, (
            f"wave {wave}: {len(handed.keys)} chunks committed; steps answered {answered}; "
            f"manager refused_keys {manager.refused_keys} unsent_steps {manager.unsent_steps} "
            f"refused_steps {manager.refused_steps}",
            tier,
            stats,
        )
        time.sleep(0.02)


def test_keys_only_in_the_disk_tier_are_asked_in_the_one_message(tmp_path: Path) -> None:
    """N requests whose chunks the arena evicted to its disk tier: the steps that look them
    up send their tier probes inside the one message; the chunks promoted load right.

    A loaded machine may leave some of a wave's stores uncached (a step's answer too late
    for its ranks' stores, a reservation expired): the waits count what each wave really
    committed, and only the prompts whose chunks reached the disk must load."""
    n = 16
    chunk = 8192  # one key's shards, both ranks together (4 KiB each)
    disk = DiskSettings(path=str(tmp_path / "disk"), capacity=64 << 20)
    d = DaemonThread(capacity=2 * n * chunk, disk=disk).start()
    try:
        assert d.daemon is not None
        daemon = d.daemon
        handed = _Handed(daemon)
        first = [_prompt(seed, 2 * BLOCK + 3) for seed in range(n)]
        second = [_prompt(500 + seed, 2 * BLOCK + 3) for seed in range(n)]
        with _harness(tmp_path, d, n) as h:
            manager = h.offloading_manager
            assert isinstance(manager, OffloaddManager)
            asked = _asked(manager)
            counts = _Counts(h)
            waves: list[list[str]] = []
            on_disk: set[bytes] = set()
            for wave, prompts in enumerate((first, second)):  # the second evicts the first
                waves.append([h.add_request(prompt, max_tokens=1) for prompt in prompts])
                counts.run(h)
                # On disk before the next wave evicts them.
                tier = _demoted(daemon, manager, handed, wave)
                if wave == 0:
                    # Nothing was evicted yet (the arena holds 2N chunks), so none was
                    # skipped: every chunk the first wave committed is on disk.
                    assert tier.demotions_skipped == 0, (tier, daemon.stats())
                    on_disk = set(handed.keys)
            # The first wave's prompts whose chunks were stored (both reached the disk).
            stored = [
                index
                for index, req in enumerate(waves[0])
                if len(asked.get(req, ())) == 2 and on_disk.issuperset(asked[req])
            ]
            # At least half the first wave's chunks go to disk and back: what the test
            # shows (a step's tier probes, many requests' worth, inside its one message)
            # needs many; a loaded machine may lose some stores (of either wave), not most.
            assert len(stored) >= n // 2, (len(stored), tier, daemon.stats())
            loaders = _load_and_check(h, counts, first, stored)
            (tier,) = daemon.stats().tiers
            assert tier.promotions >= n and tier.promotion_failures == 0, (tier, loaders)
            _assert_bounds(counts)
    finally:
        d.stop()

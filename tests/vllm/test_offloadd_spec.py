"""Stock vLLM 0.33 offloading through a real offloadd daemon.

vLLM's real Scheduler and OffloadingConnector (scheduler role, and one worker-role connector
per rank) load ``OffloaddSpec`` through ``spec_module_path``; the ranks' KV caches are
allocated by vLLM's own code on files in /dev/shm (or memfds); a simulated forward pass writes bytes
derived from each token prefix, and every loaded page on every rank is checked against them.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from offloadd.errors import DaemonUnavailable
from offloadd.settings import DiskSettings
from offloadd.vllm.manager import OffloaddManager
from offloadd.vllm.worker import LoadFailed
from tests.fakes import FakeCopyEngine
from tests.integration.harness import DaemonThread
from tests.vllm.harness import NUM_LAYERS, VllmHarness
from tests.vllm.prompts import A_PROMPT, b_prompt, compute, extra_for, prompt_of, settle

BLOCK = 16


@pytest.fixture
def daemon() -> Iterator[DaemonThread]:
    d = DaemonThread(capacity=64 << 20).start()
    yield d
    d.stop()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("chunk_tokens", [16, 32])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_shared_prefix_round_trip_and_reset(
    tmp_path: Path, daemon: DaemonThread, tp: int, chunk_tokens: int, async_scheduling: bool
) -> None:
    extra = extra_for(daemon, block_size=chunk_tokens)
    with VllmHarness(
        tmp_path, extra, tensor_parallel_size=tp, async_scheduling=async_scheduling
    ) as h:
        a = compute(h, A_PROMPT)
        assert h.external_tokens(a) == 0
        stored = 96 // chunk_tokens  # 100 prompt tokens: whole chunks only
        settle(h, stored)
        h.reset_prefix_cache()  # drop the GPU prefix cache and zero every rank's KV
        b = compute(h, b_prompt(85))
        aligned = 85 - 85 % chunk_tokens
        call = h.match_call(b)
        assert (call.num_computed_tokens, call.num_matched) == (0, aligned)
        assert h.assert_loaded_pages(b) == aligned // BLOCK * NUM_LAYERS * tp
        (_, start, count), *_ = h.forward_ranges[b]
        assert (start, count) == (aligned, len(b_prompt(85)) - aligned)
        # reset_cache: the daemon drops the namespace, and every key misses.
        assert h.scheduler.reset_prefix_cache(reset_connector=True)
        assert daemon.daemon is not None
        assert daemon.daemon.stats().committed_entries == 0
        c = compute(h, b_prompt(85, seed=2))
        assert h.external_tokens(c) == 0


def test_a_reset_reaches_the_daemon_after_the_session_was_dropped(
    tmp_path: Path, daemon: DaemonThread
) -> None:
    """A scheduler whose session was dropped (a late answer) still clears the daemon's
    chunks on reset_cache: left there, they would be stale hits once it reconnects."""
    with VllmHarness(tmp_path, extra_for(daemon, block_size=BLOCK)) as h:
        compute(h, A_PROMPT)
        settle(h, 96 // BLOCK)
        manager = h.offloading_manager
        assert isinstance(manager, OffloaddManager)
        with manager._lock:
            manager._disconnect()  # as after an answer ANSWER_TIMEOUT_SECONDS late
        assert h.scheduler.reset_prefix_cache(reset_connector=True)
        assert daemon.daemon is not None
        assert daemon.daemon.stats().committed_entries == 0
        assert manager._client is not None  # connected again for the reset


def test_load_starting_mid_chunk(tmp_path: Path, daemon: DaemonThread) -> None:
    with VllmHarness(tmp_path, extra_for(daemon, block_size=32)) as h:
        compute(h, A_PROMPT)
        settle(h, 3)
        h.reset_prefix_cache()
        compute(h, A_PROMPT[:20], max_tokens=1)  # block 0 back in the GPU prefix cache only
        b = compute(h, b_prompt(70))
        call = h.match_call(b)
        assert (call.num_computed_tokens, call.num_matched) == (16, 48)
        (job,) = h.load_jobs[b]
        assert list(job.dst.block_indices) == [1]
        assert h.assert_loaded_pages(b) == 3 * NUM_LAYERS


def test_a_steps_loads_are_reported_by_its_own_get_finished_within_the_load_wait(
    tmp_path: Path, daemon: DaemonThread
) -> None:
    """``offloadd_load_wait_ms``: vLLM submits a step's asynchronous loads after the forward
    pass it launched and asks for them at once on a CPU host; get_finished waits for them
    (here up to a minute: always met), so a loaded request runs a step sooner."""
    extra = extra_for(daemon, block_size=BLOCK, offloadd_load_wait_ms=60_000)
    with VllmHarness(tmp_path, extra) as h:
        compute(h, A_PROMPT)
        settle(h, 96 // BLOCK)
        h.reset_prefix_cache()
        worker = h.ranks[0].offloading_worker
        submitted: list[int] = []
        reported: list[list[int]] = []
        submit_load, get_finished = worker.submit_load, worker.get_finished

        def record_submit(job_id: int, *args: Any, **kwargs: Any) -> bool:
            submitted.append(job_id)
            return bool(submit_load(job_id, *args, **kwargs))

        def record_finished() -> Any:
            results = get_finished()
            reported.append([result.job_id for result in results])
            return results

        worker.submit_load, worker.get_finished = record_submit, record_finished
        b = compute(h, b_prompt(85))
        (job,) = submitted
        first_call = next(i for i, jobs in enumerate(reported) if job in jobs)
        assert first_call == 0  # the get_finished right after its submit
        assert h.assert_loaded_pages(b) == 80 // BLOCK * NUM_LAYERS


def test_two_dp_engines_share_one_cache(tmp_path: Path, daemon: DaemonThread) -> None:
    extra = extra_for(daemon)
    with (
        # One model directory: the same model, so the two engines' bytes are interchangeable.
        VllmHarness(tmp_path, extra, data_parallel_size=2, data_parallel_index=0) as h0,
        VllmHarness(tmp_path, extra, data_parallel_size=2, data_parallel_index=1) as h1,
    ):
        compute(h0, A_PROMPT)
        settle(h1, 6)  # engine 1's mirror hears of engine 0's chunks
        b = compute(h1, b_prompt(70))
        assert h1.external_tokens(b) == 64
        assert h1.assert_loaded_pages(b) == 4 * NUM_LAYERS
        assert daemon.daemon is not None
        namespaces = {engine.namespace for engine in daemon.daemon.stats().engines}
        assert len(namespaces) == 1


def test_arena_smaller_than_the_working_set(tmp_path: Path) -> None:
    # One chunk: 2 layers x 16 tokens x (K+V) of the tiny model's page; room for 8 of them.
    d = DaemonThread(capacity=8 * 4096).start()
    try:
        with VllmHarness(tmp_path, extra_for(d), num_blocks=64) as h:
            page = h.page(0, 0, 0).numel()
            assert 2 * page <= 4096, "the capacity above assumes one aligned extent per chunk"
            prompts = [prompt_of(64, seed) for seed in range(6)]  # 24 chunks through 8 slots
            for prompt in prompts:
                compute(h, prompt)
            assert d.daemon is not None
            stats = d.daemon.stats()
            assert stats.evictions > 0
            assert stats.used_bytes <= stats.capacity_bytes
            # Whatever still hits is loaded with the right bytes; misses just recompute.
            h.reset_prefix_cache()
            loaded = 0
            for seed, prompt in enumerate(reversed(prompts)):
                b = compute(h, prompt[:48] + prompt_of(5, seed=100 + seed))
                loaded += h.assert_loaded_pages(b)
                h.reset_prefix_cache()
            assert loaded > 0
    finally:
        d.stop()


def test_chunks_evicted_to_the_disk_tier_are_promoted_and_loaded(tmp_path: Path) -> None:
    """A daemon with a disk tier: chunks evicted from its 8-chunk arena are found on disk,
    reported HIT_PENDING while promoted, then hit and loaded with the right bytes."""
    disk = DiskSettings(path=str(tmp_path / "disk"), capacity=64 << 20)
    d = DaemonThread(capacity=8 * 4096, disk=disk).start()
    try:
        with VllmHarness(tmp_path, extra_for(d), num_blocks=64) as h:
            assert d.daemon is not None
            daemon = d.daemon

            def written(chunks: int) -> bool:
                (tier,) = daemon.stats().tiers
                return tier.demotions >= chunks and tier.queued_bytes == 0

            prompts = [prompt_of(64, seed) for seed in range(6)]  # 24 chunks through 8 slots
            for i, prompt in enumerate(prompts):
                compute(h, prompt)
                # Each prompt's chunks reach the disk before the next one evicts them (a
                # busy machine could otherwise outrun the writes: those chunks are skipped).
                deadline = time.monotonic() + 20
                while not written(4 * (i + 1)):
                    assert time.monotonic() < deadline, daemon.stats().tiers
                    time.sleep(0.02)
            assert daemon.stats().tiers[0].demotions_skipped == 0
            assert daemon.stats().evictions > 0
            manager = h.offloading_manager
            assert isinstance(manager, OffloaddManager)
            first = prompts[0]
            h.reset_prefix_cache()  # drop the GPU prefix cache and zero every rank's KV
            b = compute(h, first[:48] + prompt_of(5, seed=100))
            # The first request's chunks had left the arena: promoted from disk, then loaded.
            assert h.external_tokens(b) == 48
            assert h.assert_loaded_pages(b) == 3 * NUM_LAYERS
            (tier,) = daemon.stats().tiers
            assert tier.promotions >= 3 and tier.promotion_failures == 0
    finally:
        d.stop()


def test_events_one_cpu_block_stored_per_chunk(tmp_path: Path, daemon: DaemonThread) -> None:
    with (
        VllmHarness(tmp_path, extra_for(daemon), kv_events=True) as h,
        h.subscribe_kv_events() as events,
    ):
        compute(h, A_PROMPT)
        settle(h, 6)
        cpu: list[int | bytes] = []
        gpu = 0
        deadline = time.monotonic() + 10
        while len(cpu) < 6:
            assert time.monotonic() < deadline, f"CPU events stopped at {len(cpu)}"
            h.step()  # take_events runs in update_from_output
            got = events.receive(timeout=0.5)
            for event in got[1].events if got else ():
                if isinstance(event, BlockStored) and event.medium == "CPU":
                    cpu.extend(event.block_hashes)
                elif isinstance(event, BlockStored):
                    gpu += len(event.block_hashes)
        assert len(cpu) == len(set(cpu)) == 6  # one per chunk, none doubled
        h.scheduler.reset_prefix_cache(reset_connector=True)
        compute(h, prompt_of(20, seed=5))  # steps again: take_events runs
        removed = [
            e
            for batch in events.drain(timeout=1.0)
            for e in batch.events
            if isinstance(e, BlockRemoved) and e.medium == "CPU"
        ]
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(cpu)


def test_no_daemon_is_a_clear_error(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    extra: dict[str, object] = {"spec_name": "OffloaddSpec", "spec_module_path": "offloadd.vllm"}
    extra |= {"offloadd_endpoint": endpoint, "offloadd_timeout": 0.5}
    with pytest.raises(DaemonUnavailable, match=r"nobody\.sock"):
        VllmHarness(tmp_path, extra)


def test_stores_carry_a_deadline_only_on_a_shared_clock(
    tmp_path: Path, daemon: DaemonThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that does not read the rank's clock (another time namespace) gets no
    deadlines: its stores run as before, given up only after offloadd_load_timeout."""
    from offloadd.server import sessions
    from protocol.messages import Store

    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(sessions, "shared_clock", lambda monotonic: False)
        extra = extra_for(daemon, offloadd_store_timeout=5.0)
        with VllmHarness(tmp_path / str(shared), extra) as h:
            worker = h.ranks[0].offloading_worker
            client = worker._client
            assert client is not None and client.welcome.shared_clock is shared
            sent: list[Store] = []
            post = client.post_jobs

            def post_jobs(jobs: list[Store], sent: list[Store] = sent, post: Any = post) -> None:
                sent.extend(job for job in jobs if isinstance(job, Store))
                post(jobs)

            client.post_jobs = post_jobs
            start = time.monotonic()
            compute(h, prompt_of(100, seed=40 + shared))
            assert sent, "no store was sent"
            if shared:
                assert all(start < job.deadline <= time.monotonic() + 5.0 for job in sent)
            else:
                assert all(job.deadline == 0.0 for job in sent)
            stored = {key for job in sent for key in job.keys}
            manager = h.offloading_manager
            assert isinstance(manager, OffloaddManager)
            bound = time.monotonic() + 30  # committed either way
            while not stored <= manager._mirror.keys:
                assert time.monotonic() < bound, "the stores were not committed"
                time.sleep(0.01)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("offloadd_store_timeout", 0),
        ("offloadd_store_timeout", -1.0),
        ("offloadd_store_timeout", "nan"),
        ("offloadd_store_timeout", "inf"),
        ("offloadd_load_wait_ms", -1),
        ("offloadd_load_wait_ms", "nan"),
        ("offloadd_load_wait_ms", "inf"),
    ],
)
def test_a_bound_that_is_not_a_finite_number_is_a_clear_error(
    tmp_path: Path, name: str, value: object
) -> None:
    extra: dict[str, object] = {"spec_name": "OffloaddSpec", "spec_module_path": "offloadd.vllm"}
    extra |= {"offloadd_endpoint": f"ipc://{tmp_path}/d.sock", name: value}
    with pytest.raises(ValueError, match=f"{name} must be"):
        VllmHarness(tmp_path, extra)


def test_optional_daemon_starts_offloading_when_it_appears(tmp_path: Path) -> None:
    d = DaemonThread(capacity=64 << 20)
    extra = {
        "spec_name": "OffloaddSpec",
        "spec_module_path": "offloadd.vllm",
        "offloadd_endpoint": d.endpoint,
        "offloadd_optional": True,
        "offloadd_timeout": 0.5,
    }
    try:
        with VllmHarness(tmp_path, extra) as h:
            a = compute(h, A_PROMPT)  # no daemon: runs, every lookup misses, nothing stored
            assert h.external_tokens(a) == 0
            d.start()
            manager = h.offloading_manager
            deadline = time.monotonic() + 15
            while manager._client is None or not all(
                r.offloading_worker._connected() for r in h.ranks
            ):
                assert time.monotonic() < deadline, "plugin did not connect"
                time.sleep(0.05)
            assert d.daemon is not None
            deadline = time.monotonic() + 10
            while not any(e.ready for e in d.daemon.stats().engines):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            h.reset_prefix_cache()
            compute(h, A_PROMPT)  # now stored
            settle(h, 6)
            h.reset_prefix_cache()
            b = compute(h, b_prompt(85))
            assert h.external_tokens(b) == 80
            assert h.assert_loaded_pages(b) == 5 * NUM_LAYERS
    finally:
        d.stop()


def test_a_load_that_never_finishes_stops_the_engine(tmp_path: Path) -> None:
    """vLLM cannot recompute a failed load: the worker raises instead of reporting success."""
    copies = FakeCopyEngine()
    d = DaemonThread(copy_engine=copies).start()
    try:
        with VllmHarness(tmp_path, extra_for(d, offloadd_load_timeout=1.0)) as h:
            compute(h, A_PROMPT)
            settle(h, 6)
            h.reset_prefix_cache()
            copies.gate.clear()  # the daemon accepts the load but its copy never ends
            h.add_request(b_prompt(85), max_tokens=2)
            deadline = time.monotonic() + 10
            with pytest.raises(LoadFailed, match="did not finish"):
                while time.monotonic() < deadline:
                    h.step()
                    time.sleep(0.01)
            copies.gate.set()
    finally:
        copies.gate.set()
        d.stop()


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_other_kv_cache_layouts(tmp_path: Path, daemon: DaemonThread, layout: str) -> None:
    """Token-major pages, and one packed tensor for every layer (BLHNC)."""
    with VllmHarness(
        tmp_path, extra_for(daemon), kv_cache_layout=layout, tensor_parallel_size=2
    ) as h:
        compute(h, A_PROMPT)
        settle(h, 6)
        h.reset_prefix_cache()
        b = compute(h, b_prompt(70))
        assert h.external_tokens(b) == 64
        assert h.assert_loaded_pages(b) == 4 * NUM_LAYERS * 2


def test_kv_on_memfds_round_trips_through_the_daemons_mapping(
    tmp_path: Path, daemon: DaemonThread
) -> None:
    """A CPU host's fast path: KV on memfds the ranks keep open. The plugin passes their
    descriptors, and the daemon maps them, sealed against shrinking (which only a mapping
    needs), instead of reaching them with pread/pwrite."""
    with VllmHarness(tmp_path, extra_for(daemon), kv_memory="memfd", tensor_parallel_size=2) as h:
        compute(h, A_PROMPT)
        settle(h, 6)
        for rank in h.ranks:
            assert rank.buffer.memfd is not None
            assert fcntl.fcntl(rank.buffer.memfd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        h.reset_prefix_cache()
        b = compute(h, b_prompt(70))
        assert h.external_tokens(b) == 64
        assert h.assert_loaded_pages(b) == 4 * NUM_LAYERS * 2


def test_our_config_carries_every_field_of_vllms() -> None:
    import dataclasses

    import msgspec
    from vllm.v1.kv_offload import config as vllm_config

    from protocol import config as ours

    for name in (
        "OffloadingGroupConfig",
        "OffloadingModelConfig",
        "OffloadingCacheConfig",
        "OffloadingParallelConfig",
        "OffloadingConfig",
    ):
        theirs = [f.name for f in dataclasses.fields(getattr(vllm_config, name))]
        mine = [f.name for f in msgspec.structs.fields(getattr(ours, name))]
        assert set(theirs) <= set(mine), (name, set(theirs) - set(mine))


def test_the_daemon_sees_exactly_the_config_vllm_built(
    tmp_path: Path, daemon: DaemonThread
) -> None:
    with VllmHarness(tmp_path, extra_for(daemon, block_size=32)) as h:
        spec = h.ranks[0].offloading_spec
        assert daemon.daemon is not None
        (engine,) = daemon.daemon.registry.engines()
        assert engine.workers[0].config == spec.offloadd_config
        vllm_side = spec.config
        assert engine.config.groups[0].group_id == vllm_side.groups[0].group_id
        assert engine.config.cache.blocks_per_chunk == 2
        assert engine.config.kv_cache_layout == vllm_side.kv_cache_layout
        assert daemon.daemon.stats().sessions == 2  # the scheduler and the rank
    # vLLM's shutdown says Bye for the scheduler and every rank.
    assert daemon.daemon.stats().sessions == 0

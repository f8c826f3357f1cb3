"""The vLLM plugin's pure parts: the key mirror, the scheduler's stores (skipped keys,
commits pending), a store spec without its skipped keys, and finding a CPU tensor's shared
file."""

from __future__ import annotations

import fcntl
import mmap
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from offloadd.transfer.plan import group_layouts
from offloadd.vllm.load_failures import LoadFailures
from offloadd.vllm.mirror import KeyMirror
from offloadd.vllm.regions import NotShareable, kv_regions, open_region_files, shared_file_of
from offloadd.vllm.stores import Stores
from offloadd.vllm.worker import segments_for, without_skipped
from protocol.config import OffloadingGroupConfig
from protocol.handles import KVRegion, ShmHandle
from protocol.messages import KeysChanged, Segment

K = [bytes([i]) * 8 + b"\0\0\0\0" for i in range(6)]


def test_mirror_applies_changes_in_order_and_reports_runs() -> None:
    mirror = KeyMirror(record_events=True)
    mirror.apply([KeysChanged(0, [K[0], K[1]], [], reset=True)])
    mirror.apply([KeysChanged(3, [K[2]], [K[0]]), KeysChanged(4, [K[0]], [])])
    assert mirror.keys == {K[0], K[1], K[2]}
    assert mirror.seq == 4
    # Removed then stored again: both reported, in that order.
    assert mirror.take_events() == [
        (False, [K[0], K[1], K[2]]),
        (True, [K[0]]),
        (False, [K[0]]),
    ]
    assert mirror.take_events() == []


def test_mirror_reset_reports_only_the_difference_and_restarts_seq() -> None:
    mirror = KeyMirror(record_events=True)
    mirror.apply([KeysChanged(9, [K[0], K[1]], [], reset=True)])
    mirror.take_events()
    # A restarted daemon's snapshot, in two parts; its seq starts low again.
    mirror.apply([KeysChanged(1, [K[1]], [], reset=True, more=True)])
    assert mirror.keys == {K[0], K[1]}  # unchanged until the snapshot is complete
    mirror.apply([KeysChanged(1, [K[2]], [], more=False)])
    assert mirror.keys == {K[1], K[2]}
    assert mirror.seq == 1
    assert mirror.take_events() == [(True, [K[0]]), (False, [K[2]])]


def test_a_stopping_daemons_empty_snapshot_empties_the_mirror() -> None:
    mirror = KeyMirror(record_events=True)
    mirror.apply([KeysChanged(2, [K[0], K[1]], [], reset=True)])
    mirror.take_events()
    mirror.apply([KeysChanged(5, [], [], reset=True)])  # what Mirrors.drain sends
    assert mirror.keys == set() and mirror.seq == 5
    # vLLM publishes their removal.
    assert [(removed, sorted(keys)) for removed, keys in mirror.take_events()] == [
        (True, [K[0], K[1]])
    ]


def test_mirror_without_events_records_none() -> None:
    mirror = KeyMirror(record_events=False)
    mirror.apply([KeysChanged(0, [K[0]], [], reset=True), KeysChanged(1, [], [K[0]])])
    assert mirror.keys == set()
    assert mirror.take_events() == []


def test_mirror_ignores_removal_of_unknown_and_double_store() -> None:
    mirror = KeyMirror(record_events=True)
    mirror.apply(
        [KeysChanged(0, [], [K[3]]), KeysChanged(0, [K[4]], []), KeysChanged(0, [K[4]], [])]
    )
    assert mirror.take_events() == [(False, [K[4]])]


def test_shared_file_of_a_dev_shm_tensor() -> None:
    fd, path = tempfile.mkstemp(prefix="od-test-", dir="/dev/shm")
    try:
        os.ftruncate(fd, 3 * 4096)
        with mmap.mmap(fd, 3 * 4096, mmap.MAP_SHARED) as mapping:
            tensor = torch.frombuffer(mapping, dtype=torch.int8).view(3, 4096)
            found, offset = shared_file_of(tensor[1].data_ptr(), 4096)
            assert (found, offset) == (path, 4096)
            del tensor
    finally:
        os.close(fd)
        os.unlink(path)


def test_the_rank_opens_its_own_mapped_files_and_no_impostor() -> None:
    fd, path = tempfile.mkstemp(prefix="od-test-", dir="/dev/shm")
    try:
        os.ftruncate(fd, 2 * 4096)
        with mmap.mmap(fd, 2 * 4096, mmap.MAP_SHARED) as mapping:
            tensor = torch.frombuffer(mapping, dtype=torch.int8).view(2, 4096)
            found, offset = shared_file_of(tensor.data_ptr(), 2 * 4096)
            region = KVRegion(ShmHandle(found, offset, 2 * 4096), 2, 4096, 4096, ("a",))
            files = open_region_files([region, region])
            try:
                assert list(files) == [path]
                assert os.fstat(files[path]).st_ino == os.fstat(fd).st_ino
            finally:
                for opened in files.values():
                    os.close(opened)
            # Another file put in its place under the same name is not the mapped one.
            os.unlink(path)
            with open(path, "wb") as impostor:
                impostor.truncate(2 * 4096)
            with pytest.raises(NotShareable, match="no longer the file"):
                open_region_files([region])
            del tensor
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_memfd_tensor_is_named_by_inode_and_reached_through_its_open_descriptor() -> None:
    fd = os.memfd_create("od-test-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 2 * 4096)
        label = f"memfd:od-test-kv (inode {os.fstat(fd).st_ino})"
        with mmap.mmap(fd, 2 * 4096, mmap.MAP_SHARED) as mapping:
            tensor = torch.frombuffer(mapping, dtype=torch.int8).view(2, 4096)
            assert shared_file_of(tensor[1].data_ptr(), 4096) == (label, 4096)
            region = KVRegion(ShmHandle(label, 0, 2 * 4096), 2, 4096, 4096, ("a",))
            files = open_region_files([region, region])
            try:
                assert list(files) == [label] and files[label] != fd
                assert os.fstat(files[label]).st_ino == os.fstat(fd).st_ino
                assert fcntl.fcntl(files[label], fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
            finally:
                for opened in files.values():
                    os.close(opened)
            del tensor
    finally:
        os.close(fd)


def test_a_memfd_that_cannot_be_sealed_is_taken_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fd = os.memfd_create("od-test-unsealable", os.MFD_CLOEXEC)  # sealed with F_SEAL_SEAL
    try:
        os.ftruncate(fd, 4096)
        with mmap.mmap(fd, 4096, mmap.MAP_SHARED) as mapping:
            tensor = torch.frombuffer(mapping, dtype=torch.int8)
            label, offset = shared_file_of(tensor.data_ptr(), 4096)
            region = KVRegion(ShmHandle(label, offset, 4096), 1, 4096, 4096, ("a",))
            with caplog.at_level("WARNING", logger="offloadd.vllm.regions"):
                files = open_region_files([region])
            for opened in files.values():
                os.close(opened)
            assert "MFD_ALLOW_SEALING" in caplog.text
            del tensor
    finally:
        os.close(fd)


def test_a_mapped_memfd_without_a_descriptor_is_refused_saying_what_to_keep() -> None:
    maps = "7f0000004000-7f0000005000 rw-s 00000000 00:01 999999999 /memfd:kv (deleted)\n"
    label = "memfd:kv (inode 999999999)"
    region = KVRegion(ShmHandle(label, 0, 4096), 1, 4096, 4096, ("a",))
    with pytest.raises(NotShareable, match="keep the descriptor memfd_create returned open"):
        open_region_files([region], maps)


def test_private_memory_is_refused_with_a_fix() -> None:
    tensor = torch.zeros(4, 4096, dtype=torch.int8)
    with pytest.raises(NotShareable, match="MAP_SHARED file"):
        shared_file_of(tensor.data_ptr(), tensor.numel())


def test_maps_parsing_checks_bounds_and_deleted_files() -> None:
    maps = (
        "7f0000000000-7f0000002000 rw-s 00001000 00:1a 42 /dev/shm/kv\n"
        "7f0000002000-7f0000003000 rw-s 00000000 00:1a 43 /dev/shm/gone (deleted)\n"
        "7f0000003000-7f0000004000 rw-p 00000000 00:00 0 \n"
        "7f0000004000-7f0000005000 rw-s 00000000 00:01 77 /memfd:kv (deleted)\n"
    )
    assert shared_file_of(0x7F0000001000, 0x1000, maps) == ("/dev/shm/kv", 0x2000)
    with pytest.raises(NotShareable, match="runs past"):
        shared_file_of(0x7F0000001000, 0x2000, maps)
    with pytest.raises(NotShareable, match="was removed"):
        shared_file_of(0x7F0000002000, 16, maps)
    with pytest.raises(NotShareable, match="not a shared file mapping"):
        shared_file_of(0x7F0000003000, 16, maps)
    with pytest.raises(NotShareable, match="not mapped"):
        shared_file_of(0x1000, 16, maps)
    assert shared_file_of(0x7F0000004010, 16, maps) == ("memfd:kv (inode 77)", 0x10)


class _Buffer:
    """An int8 (num_blocks, stride) tensor over a /dev/shm file, as vLLM's canonical views."""

    def __init__(self, num_blocks: int, stride: int) -> None:
        self.fd, self.path = tempfile.mkstemp(prefix="od-test-", dir="/dev/shm")
        os.ftruncate(self.fd, num_blocks * stride)
        self.mapping = mmap.mmap(self.fd, num_blocks * stride, mmap.MAP_SHARED)
        self.tensor = torch.frombuffer(self.mapping, dtype=torch.int8).view(num_blocks, stride)

    def close(self) -> None:
        del self.tensor
        self.mapping.close()
        os.close(self.fd)
        os.unlink(self.path)


def _group(layers: tuple[str, ...]) -> OffloadingGroupConfig:
    return OffloadingGroupConfig(tokens_per_block=16, layer_names=layers)


def test_regions_of_aliased_layers_and_a_packed_tensor() -> None:
    per_layer, packed = _Buffer(8, 4096), _Buffer(8, 8192)
    try:
        tensors = [SimpleNamespace(tensor=per_layer.tensor), SimpleNamespace(tensor=packed.tensor)]
        caches = SimpleNamespace(
            tensors=tensors,
            group_data_refs=[
                # Two layers aliasing one tensor: one region holding both.
                [SimpleNamespace(tensor_idx=0, page_size_bytes=4096)] * 2,
                # A packed tensor that one group (two layers, one ref) uses with its page.
                [SimpleNamespace(tensor_idx=1, page_size_bytes=6000)],
                # ... and another group with a smaller page: a second region, same handle.
                [SimpleNamespace(tensor_idx=1, page_size_bytes=2000)],
            ],
        )
        groups = [_group(("a.0", "a.1")), _group(("b.0", "b.1")), _group(("c.0",))]
        regions = kv_regions(caches, groups)
        assert [(r.layer_names, r.page_size, r.block_stride) for r in regions] == [
            (("a.0", "a.1"), 4096, 4096),
            (("b.0", "b.1"), 6000, 8192),
            (("c.0",), 2000, 8192),
        ]
        assert regions[1].handle == regions[2].handle == ShmHandle(packed.path, 0, 8 * 8192)
        layouts = group_layouts(regions, groups)
        assert [layout.regions for layout in layouts] == [(0,), (1,), (2,)]
    finally:
        per_layer.close()
        packed.close()


def test_regions_need_refs_for_every_group() -> None:
    caches = SimpleNamespace(tensors=[], group_data_refs=[[]])
    with pytest.raises(ValueError, match="refs for 1 groups"):
        kv_regions(caches, [_group(("a",)), _group(("b",))])


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stores_leave_what_the_daemon_did_not_reserve_when_its_answer_comes() -> None:
    stores = Stores(clock=_Clock())
    a = stores.queue("a", stores.candidates([K[0], K[1], K[2]], committed={K[2]}))
    # K[1] is queued already: another request of the step does not store it twice.
    b = stores.queue("b", stores.candidates([K[1], K[3], K[4]], committed=set()))
    assert (a.keys, b.keys) == ([K[0], K[1]], [K[3], K[4]])
    assert stores.queued_keys() == [K[0], K[1], K[3], K[4]]
    step = stores.take()  # the Reserve leaves; its answer comes later
    assert step.keys == [K[0], K[1], K[3], K[4]] and stores.queued_keys() == []
    assert all(stores.pending(k) for k in step.keys)
    assert stores.answered(step, [1, 2]) == 2  # the daemon reserved K[1] and K[3]
    assert (a.skipped, b.skipped) == (set(), set())  # the specs left: the daemon skips them
    assert [stores.pending(k) for k in K[:5]] == [False, True, False, True, False]
    # A refused key is no one's here: a later step may store it.
    assert stores.candidates([K[0], K[1]], committed=set()) == [K[0]]


def test_a_step_not_sent_skips_its_stores_in_the_specs() -> None:
    stores = Stores(clock=_Clock())
    spec = stores.queue("a", stores.candidates([K[0], K[1]], committed=set()))
    assert stores.skip(stores.take()) == 2
    assert spec.skipped == {0, 1}
    assert not stores.pending(K[0])
    assert stores.storing == 0


def test_a_stored_key_pends_until_its_commit_or_the_wait_runs_out() -> None:
    clock = _Clock()
    stores = Stores(clock=clock, commit_wait=1.0)
    assert not stores.has_queued and not stores.awaiting_commits
    stores.queue("a", stores.candidates([K[0], K[1], K[2]], committed=set()))
    assert stores.has_queued and not stores.awaiting_commits  # not sent yet
    stores.answered(stores.take(), [0, 1])  # K[2] refused
    assert not stores.has_queued and stores.awaiting_commits  # in flight
    stores.complete("a", [K[0], K[1], K[2]], committed=set())
    assert stores.storing == 0 and stores.awaiting_commits  # their commits due
    # Stored, the commit notices not here yet: pending, not a miss.
    assert stores.pending(K[0]) and stores.pending(K[1])
    assert not stores.pending(K[2])
    assert stores.candidates([K[0], K[1]], committed=set()) == []
    stores.committed([K[0]])
    assert not stores.pending(K[0])
    assert stores.committing()
    clock.now += 1.5  # K[1]'s commit never came (the daemon refused it)
    assert not stores.committing() and not stores.awaiting_commits
    assert not stores.pending(K[1])
    assert stores.candidates([K[1]], committed=set()) == [K[1]]


def test_an_answer_after_the_job_completed_ends_the_refused_keys_wait() -> None:
    stores = Stores(clock=_Clock())
    stores.queue("a", [K[0], K[1]])
    step = stores.take()
    stores.complete("a", [K[0], K[1]], committed=set())  # before the Reserved came
    assert stores.pending(K[0]) and stores.pending(K[1])
    stores.answered(step, [1])  # K[0] was never reserved: it is not coming
    assert not stores.pending(K[0]) and stores.pending(K[1])


def test_a_skipped_key_completed_leaves_a_later_reservation_in_flight() -> None:
    stores = Stores(clock=_Clock())
    stores.queue("a", [K[0]])
    stores.skip(stores.take())  # a's K[0] skipped
    stores.queue("b", stores.candidates([K[0]], committed=set()))
    stores.answered(stores.take(), [0])  # b's reserved
    stores.complete("a", [K[0]], committed=set())  # vLLM completes a's job, skipped key too
    assert stores.storing == 1  # still b's, in flight
    stores.complete("b", [K[0]], committed={K[0]})  # committed already: not pending
    assert stores.storing == 0 and not stores.pending(K[0])


def test_stores_forget_and_reset() -> None:
    stores = Stores(clock=_Clock())
    stores.queue("a", [K[0]])
    stores.take()
    queued = stores.queue("b", [K[1]])
    stores.forget()  # a new session: nothing in flight, the step's queue is still sent
    assert not stores.pending(K[0]) and stores.pending(K[1])
    stores.reset()
    assert queued.skipped == {0} and not stores.pending(K[1])
    assert stores.queued_keys() == []


def _group_key(group: int, name: int) -> bytes:
    return bytes([name]) * 8 + group.to_bytes(4, "big")


def test_segments_for_reads_each_groups_keys_and_blocks_in_config_order() -> None:
    # bpc 2. Group 7: 5 blocks from block index 3 (sub-block 1): 3 keys; group 2: none;
    # group 4: 2 blocks from index 4 (sub-block 0): 1 key.
    gpu = GPULoadStoreSpec(list(range(7)), [5, 0, 2], [3, 0, 4])
    keys = [_group_key(7, 0), _group_key(7, 1), _group_key(7, 2), _group_key(4, 3)]
    assert segments_for(keys, gpu, 2, [7, 2, 4]) == [Segment(3, 1, 5), Segment(1, 0, 2)]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        # A key of another group where group 7's are due: the groups found are named.
        (
            [_group_key(7, 0), _group_key(4, 1), _group_key(7, 2), _group_key(4, 3)],
            "group 7: 5 blocks from sub-block 1 need 3 keys of that group at position 0; "
            "the keys name groups [4, 7]",
        ),
        # Too few keys for group 4's chunk.
        (
            [_group_key(7, 0), _group_key(7, 1), _group_key(7, 2)],
            "group 4: 2 blocks from sub-block 0 need 1 keys of that group at position 3; "
            "the keys name groups []",
        ),
        # Keys beyond the chunks the blocks fill.
        (
            [_group_key(7, 0), _group_key(7, 1), _group_key(7, 2), _group_key(4, 3)] * 2,
            "8 keys for blocks that fill 4 chunks",
        ),
    ],
)
def test_segments_for_refuses_keys_that_do_not_match_the_blocks(
    keys: list[bytes], message: str
) -> None:
    gpu = GPULoadStoreSpec(list(range(7)), [5, 0, 2], [3, 0, 4])
    with pytest.raises(ValueError) as refused:
        segments_for(keys, gpu, 2, [7, 2, 4])
    assert str(refused.value) == message


def test_without_skipped_splits_segments_at_the_holes() -> None:
    bpc = 4
    keys = [b"k%d" % i for i in range(5)]
    # Group A: 3 keys, from sub-block 2, 9 blocks (2 + 4 + 3); group B: 2 keys, 8 blocks.
    segments = [Segment(3, 2, 9), Segment(2, 0, 8)]
    block_ids = list(range(100, 117))
    assert without_skipped(keys, block_ids, segments, bpc, set()) == (keys, block_ids, segments)
    out_keys, out_blocks, out_segments = without_skipped(keys, block_ids, segments, bpc, {1, 3})
    assert out_keys == [keys[0], keys[2], keys[4]]
    assert out_segments == [Segment(1, 2, 2), Segment(1, 0, 3), Segment(1, 0, 4)]
    assert out_blocks == [100, 101, 106, 107, 108, 113, 114, 115, 116]
    # Skipping the first key of a segment starts the next one at sub-block 0.
    out_keys, out_blocks, out_segments = without_skipped(keys, block_ids, segments, bpc, {0})
    assert out_segments == [Segment(2, 0, 7), Segment(2, 0, 8)]
    assert out_blocks == block_ids[2:]


def test_the_mirror_never_acknowledges_the_removal_of_a_key_being_loaded() -> None:
    """The daemon keeps a removed key's bytes until the mirror acknowledges the removal: the
    acknowledgement stays below the first notice that removed a key still loading, until
    that load completes, whatever happened to its hold."""
    a, b, c = b"a" * 12, b"b" * 12, b"c" * 12
    mirror = KeyMirror(record_events=False)
    mirror.apply([KeysChanged(3, [a, b, c], [], reset=True)])
    mirror.start_loading("r1", [a, b])
    mirror.apply([KeysChanged(5, [], [c])])  # no loading key: acknowledged in full
    assert mirror.ackable == 5
    mirror.apply([KeysChanged(7, [], [b]), KeysChanged(9, [], [a])])
    assert b not in mirror.keys and mirror.seq == 9
    assert mirror.ackable == 5  # before the notice that removed b
    assert mirror.loads() == {"r1": [a, b]}  # what a new session is sent to hold again
    mirror.finish_loading("r1", [a, b])
    assert mirror.ackable == 9 and mirror.loads() == {}


A_KEY = b"a" * 12


def _removed_while_loading(key: bytes) -> KeyMirror:
    """A mirror whose key, loading for request "r1", was removed at seq 4 (held back at 3)."""
    mirror = KeyMirror(record_events=False)
    mirror.apply([KeysChanged(3, [key], [], reset=True)])
    mirror.start_loading("r1", [key])
    mirror.apply([KeysChanged(4, [], [key])])
    assert mirror.ackable == 3
    return mirror


def test_a_snapshot_ends_the_barriers_of_the_session_before() -> None:
    mirror = _removed_while_loading(A_KEY)
    mirror.apply([KeysChanged(1, [A_KEY], [], reset=True)])  # a restarted daemon, its own seq
    assert mirror.ackable == 1
    mirror.apply([KeysChanged(2, [], [A_KEY])])  # still loading: held back again
    assert mirror.ackable == 1


def test_load_failures_are_reported_by_request_or_by_block() -> None:
    failures = LoadFailures()
    assert not failures.can_report(expedited=False)  # vLLM's connector not found: raise
    failures.reporting = True
    failures.failed("r1", [4, 5], expedited=False)
    failures.failed("r2", [7], expedited=True)
    assert failures.take() == ({"r1"}, {7}) and failures.take() == (set(), set())
    assert failures.count == 2
    failures.groups = 2  # vLLM refuses block ids with several KV cache groups
    assert failures.can_report(expedited=False) and not failures.can_report(expedited=True)


def test_a_cache_reset_forgets_the_loads_vllm_will_never_complete() -> None:
    mirror = _removed_while_loading(A_KEY)
    assert mirror.forget_loads() == {"r1": [A_KEY]}
    assert mirror.ackable == 4 and mirror.loads() == {}

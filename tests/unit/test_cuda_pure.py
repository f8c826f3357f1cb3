"""The CUDA path without a GPU: handles, UUIDs, allocator checks, the import table with a fake
opener, pinning with a fake cudart, the arena's pin hook, and the cuda engine's scheduling
on a fake backend. Address planning (mid-chunk loads, packed/unpacked) is test_plan.py's.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from offloadd import cuda_ipc
from offloadd.cache import arena as arena_module
from offloadd.cache.arena import Arena
from offloadd.cuda_ipc import (
    CudaIpcError,
    allocator_problem,
    check_ipc_capable,
    export_tensor,
    handle_kind,
    kv_region_from_tensor,
    span_bytes,
)
from offloadd.transfer.batch import HostPieces, move_arrays, src_access_order
from offloadd.transfer.cuda import CudaCopyEngine, CudaCopyError, make_engine
from offloadd.transfer.cuda_import import CudaIpcOpener, DeviceMap, open_ipc_handle
from offloadd.transfer.engine import CpuCopyEngine
from offloadd.transfer.handles import HandleError, HandleTable
from offloadd.transfer.pinning import (
    CUDA_HOST_REGISTER_PORTABLE,
    HostRegistration,
    register_host_memory,
    split_pieces,
)
from offloadd.transfer.types import Direction, MoveArrays, Triple
from protocol.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from protocol.handles import CudaIpcHandle, normalize_uuid
from protocol.messages import Hello, decode_request, encode

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UUID0 = "GPU-6B41ACFA-D2B9-4C7A-9E2F-000000000000"
UUID1 = "0a1b2c3d-0000-4000-8000-111111111111"
IPC = b"\x02c" + bytes(range(64))  # torch's shareable handle: version, kind, cudaIpcMemHandle
EVENT = bytes(range(100, 164))


def make_config() -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",)),),
        worker_kv_bytes_per_block=2 * 16 * 8 * 128 * 2,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="engine-a",
        model=OffloadingModelConfig(name="test/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            is_parallelism_agnostic=True,
        ),
    )


def cuda_handle(
    *,
    uuid: str = UUID0,
    handle: bytes = IPC,
    storage_offset: int = 0,
    storage_size: int = 1 << 20,
    offset: int = 0,
    size: int = 1 << 20,
) -> CudaIpcHandle:
    return CudaIpcHandle(
        device_uuid=uuid,
        handle=handle,
        storage_size=storage_size,
        storage_offset=storage_offset,
        ref_counter_handle=b"/torch_123_456",
        ref_counter_offset=3,
        event_handle=EVENT,
        event_sync_required=True,
        offset=offset,
        size=size,
    )


# --- export: a fake CUDA tensor --------------------------------------------------------------


class FakeStorage:
    def __init__(self, shared: tuple[Any, ...]) -> None:
        self.shared = shared

    def _share_cuda_(self) -> tuple[Any, ...]:
        return self.shared


@dataclass
class FakeCudaTensor:
    """Duck-types the parts of a CUDA tensor ``export_tensor`` reads."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int = 2
    offset_elements: int = 0
    shared: tuple[Any, ...] = (
        0,
        IPC,
        1 << 22,
        4096,
        b"/torch_123_456",
        7,
        EVENT,
        True,
    )
    is_cuda: bool = True
    device: str = "cuda:0"

    def untyped_storage(self) -> FakeStorage:
        return FakeStorage(self.shared)

    def element_size(self) -> int:
        return self.itemsize

    def storage_offset(self) -> int:
        return self.offset_elements

    def stride(self, dim: int | None = None) -> Any:
        return self.strides if dim is None else self.strides[dim]

    def dim(self) -> int:
        return len(self.shape)

    def get_device(self) -> int:
        return 0


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device 0 has UUID0; the allocator settings are clean."""
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda index: normalize_uuid(UUID0))
    # torch parses its allocator settings once per process; the environment decides here.
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)


def test_export_takes_the_share_cuda_fields_as_plain_values(fake_gpu: None) -> None:
    # (num_blocks=10, 2, 16, 8, 128) bf16 with each block padded by 512 elements.
    shape = (10, 2, 16, 8, 128)
    row = 2 * 16 * 8 * 128
    tensor = FakeCudaTensor(shape, (row + 512, 16 * 8 * 128, 8 * 128, 128, 1), offset_elements=64)
    handle = export_tensor(tensor)  # type: ignore[arg-type]
    assert handle == CudaIpcHandle(
        device_uuid=normalize_uuid(UUID0),
        handle=IPC,
        storage_size=1 << 22,
        storage_offset=4096,
        ref_counter_handle=b"/torch_123_456",
        ref_counter_offset=7,
        event_handle=EVENT,
        event_sync_required=True,
        offset=64 * 2,
        size=(9 * (row + 512) + row) * 2,  # padding after the last block is not spanned
    )


def test_kv_region_and_hello_round_trip_through_the_wire(fake_gpu: None) -> None:
    row = 2 * 16 * 8 * 128
    tensor = FakeCudaTensor((10, 2, 16, 8, 128), (row + 512, 16 * 8 * 128, 8 * 128, 128, 1))
    region = kv_region_from_tensor(tensor, row * 2, ["layer.0"])  # type: ignore[arg-type]
    assert (region.num_blocks, region.page_size, region.block_stride) == (
        10,
        row * 2,
        2 * (row + 512),
    )
    assert region.layer_names == ("layer.0",)
    hello = Hello(
        request_id=1,
        protocol_version=1,
        role="worker",
        config=make_config(),
        regions=(region,),
        device_uuid=region.handle.device_uuid,  # type: ignore[union-attr]
    )
    decoded = decode_request(encode(hello))
    assert decoded == hello
    assert isinstance(decoded, Hello)
    assert isinstance(decoded.regions[0].handle, CudaIpcHandle)
    assert decoded.regions[0].handle.handle == IPC
    assert decoded.regions[0].handle.event_handle == EVENT


def test_kv_region_refuses_a_page_larger_than_the_stride(fake_gpu: None) -> None:
    tensor = FakeCudaTensor((4, 64), (64, 1), itemsize=1)
    with pytest.raises(ValueError, match="block_stride=64 is smaller than page_size=65"):
        kv_region_from_tensor(tensor, 65, ["l"])  # type: ignore[arg-type]


def test_export_refuses_expandable_segment_memory_even_when_settings_look_clean(
    fake_gpu: None,
) -> None:
    shared = (0, b"\x02e" + b"\x00" * 40, 1 << 20, 0, b"/r", 0, EVENT, False)
    tensor = FakeCudaTensor((4, 64), (64, 1), itemsize=1, shared=shared)
    with pytest.raises(CudaIpcError, match=r"expandable_segment allocation.*expandable_segments"):
        export_tensor(tensor)  # type: ignore[arg-type]


def test_export_refuses_when_the_environment_enables_expandable_segments(
    fake_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    with pytest.raises(CudaIpcError, match=r"PYTORCH_CUDA_ALLOC_CONF.*expandable_segments:False"):
        export_tensor(FakeCudaTensor((4, 64), (64, 1), itemsize=1))  # type: ignore[arg-type]


def test_export_refuses_host_tensors() -> None:
    with pytest.raises(CudaIpcError, match="not CUDA memory"):
        export_tensor(torch.zeros(4))


@pytest.mark.parametrize(
    ("conf", "problem"),
    [
        ("", None),
        ("expandable_segments:False", None),
        ("max_split_size_mb:128", None),
        ("expandable_segments:True", "expandable_segments:True"),
        (" expandable_segments : True ", "expandable_segments:True"),
        ("roundup_power2_divisions:[64:8,256:4],expandable_segments:True", "expandable"),
        ("garbage_collection_threshold:0.6,expandable_segments:true", "expandable"),
        ("backend:cudaMallocAsync", "cudaMallocAsync"),
        ("backend:native", None),
    ],
)
def test_allocator_problem(conf: str, problem: str | None) -> None:
    found = allocator_problem(conf)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_check_ipc_capable_names_the_variable_and_the_fix() -> None:
    check_ipc_capable({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    with pytest.raises(CudaIpcError) as info:
        check_ipc_capable({"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    message = str(info.value)
    assert "PYTORCH_ALLOC_CONF" in message
    assert "expandable_segments:False" in message


def test_torch_settings_override_the_environment(
    fake_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(
        torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:False"
    )
    check_ipc_capable()  # set back to False at run time: fine
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(
        torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:True"
    )
    with pytest.raises(CudaIpcError, match="allocator settings"):
        check_ipc_capable()


@pytest.mark.parametrize(
    ("handle", "kind"),
    [
        (bytes(64), "cuda_malloc"),
        (b"\x02c" + bytes(64), "cuda_malloc"),
        (b"\x02e" + bytes(10), "expandable_segment"),
        (b"\x02c" + bytes(10), "unknown"),
        (b"", "unknown"),
    ],
)
def test_handle_kind(handle: bytes, kind: str) -> None:
    assert handle_kind(handle) == kind


@pytest.mark.parametrize(
    ("shape", "stride", "size", "expected"),
    [
        ((10, 4), (4, 1), 2, 80),  # contiguous
        ((10, 4), (6, 1), 2, (9 * 6 + 4) * 2),  # padded rows
        ((0, 4), (4, 1), 2, 0),
        ((3, 2, 5), (20, 5, 1), 1, 50),
        ((4,), (3,), 4, (3 * 3 + 1) * 4),
    ],
)
def test_span_bytes(
    shape: tuple[int, ...], stride: tuple[int, ...], size: int, expected: int
) -> None:
    assert span_bytes(shape, stride, size) == expected


def test_span_bytes_matches_torch_for_a_padded_view() -> None:
    base = torch.zeros(10, 40, dtype=torch.bfloat16)
    view = base[2:, :32]
    span = span_bytes(view.shape, view.stride(), view.element_size())
    first = view.storage_offset() * 2
    assert first + span == (9 * 40 + 32) * 2  # ends at the last element of the last row


# --- UUIDs ----------------------------------------------------------------------------------


def test_device_map_finds_a_uuid_in_any_spelling() -> None:
    devices = DeviceMap([UUID0, UUID1])
    assert devices.index(UUID0) == 0
    assert devices.index(normalize_uuid(UUID0)) == 0
    assert devices.index("GPU-" + UUID1.upper()) == 1
    assert len(devices) == 2


def test_device_map_names_the_unknown_uuid_and_the_visible_devices() -> None:
    devices = DeviceMap([UUID0, UUID1])
    with pytest.raises(CudaIpcError) as info:
        devices.index("GPU-ffffffff-0000-0000-0000-000000000000")
    message = str(info.value)
    assert "GPU-ffffffff-0000-0000-0000-000000000000" in message
    assert f"0={normalize_uuid(UUID0)}" in message
    assert f"1={UUID1}" in message
    with pytest.raises(CudaIpcError, match="none"):
        DeviceMap([]).index(UUID0)


def test_device_map_refuses_missing_and_duplicate_uuids() -> None:
    with pytest.raises(CudaIpcError, match="no UUID"):
        DeviceMap([UUID0, ""])
    with pytest.raises(CudaIpcError, match="share UUID"):
        DeviceMap([UUID0, "gpu-" + UUID0[4:].lower()])


# --- daemon side import with a fake torch ----------------------------------------------------


class FakeTorch:
    """What the import touches: cuda.init/device/Event.from_ipc_handle, _new_shared_cuda,
    _release_ipc_counter_cuda."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.events: list[tuple[Any, bytes]] = []  # opened IPC events: (device, handle)
        self.synced: list[bytes] = []  # IPC events waited for on the host
        self.destroyed: list[bytes] = []  # IPC events destroyed
        self.released: list[tuple[bytes, int]] = []  # IPC counters released
        fake = self

        class Storage:
            def __init__(self, args: tuple[Any, ...]) -> None:
                self.args = args

            def data_ptr(self) -> int:
                return 0x7F0000000000 + int(self.args[3])

            def nbytes(self) -> int:
                return int(self.args[2])

            @staticmethod
            def _new_shared_cuda(*args: Any) -> Storage:
                fake.calls.append(args)
                return Storage(args)

            @staticmethod
            def _release_ipc_counter_cuda(handle: bytes, offset: int) -> None:
                fake.released.append((handle, offset))

        class Event:
            def __init__(self, handle: bytes) -> None:
                self.handle = handle

            @classmethod
            def from_ipc_handle(cls, device: Any, handle: bytes) -> Event:
                fake.events.append((device, handle))
                return cls(handle)

            def synchronize(self) -> None:
                fake.synced.append(self.handle)

            def __del__(self) -> None:  # torch's CUDAEvent destructor: cudaEventDestroy
                fake.destroyed.append(self.handle)

        self.UntypedStorage = Storage
        self.cuda = types.SimpleNamespace(
            init=lambda: None,
            device=lambda index: contextlib.nullcontext(),
            Event=Event,
        )
        self.device = lambda kind, index: (kind, index)


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> FakeTorch:
    fake = FakeTorch()
    monkeypatch.setattr(cuda_ipc, "load_torch", lambda: fake)
    return fake


def test_open_passes_the_local_device_and_the_eight_fields_in_order(fake_torch: FakeTorch) -> None:
    handle = cuda_handle(storage_offset=8192, storage_size=4 << 20, offset=1024, size=1 << 20)
    address, keepalive = open_ipc_handle(handle, 3)
    # torch is not asked to sync on the event: it would wait on the device's current stream
    # and, in some versions, never destroy the event it opened.
    assert fake_torch.calls == [
        (3, IPC, 4 << 20, 8192, b"/torch_123_456", 3, EVENT, False),
    ]
    assert address == 0x7F0000000000 + 8192 + 1024
    assert keepalive is not None
    # The producer's "ready" event: opened on the local device, waited for, destroyed.
    assert fake_torch.events == [(("cuda", 3), EVENT)]
    assert fake_torch.synced == [EVENT] and fake_torch.destroyed == [EVENT]


def test_open_refuses_expandable_handles_and_regions_outside_the_storage(
    fake_torch: FakeTorch,
) -> None:
    with pytest.raises(CudaIpcError, match="expandable_segment"):
        open_ipc_handle(cuda_handle(handle=b"\x02e" + bytes(30)), 0)
    with pytest.raises(CudaIpcError, match="outside"):
        open_ipc_handle(cuda_handle(storage_size=4096, offset=0, size=4097), 0)
    assert fake_torch.calls == []


def test_opener_maps_the_uuid_to_the_local_ordinal(fake_torch: FakeTorch) -> None:
    opener = CudaIpcOpener(DeviceMap([UUID1, UUID0]))
    handle = cuda_handle(uuid=UUID0)
    assert opener.device_index(handle) == 1
    address, size, close = opener.open(handle)
    assert fake_torch.calls[0][0] == 1
    assert (address, size) == (0x7F0000000000, 1 << 20)
    close()
    with pytest.raises(CudaIpcError, match="not visible"):
        opener.open(cuda_handle(uuid="GPU-12345678-0000-0000-0000-000000000000"))


# --- HandleTable with a fake CUDA opener -----------------------------------------------------


@dataclass
class FakeOpener:
    """Hands out fake addresses; records opens and closes."""

    devices: DeviceMap = field(default_factory=lambda: DeviceMap([UUID0, UUID1]))
    opened: list[CudaIpcHandle] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)
    fail: Exception | None = None

    def device_index(self, handle: CudaIpcHandle) -> int:
        return self.devices.index(handle.device_uuid)

    duplicates: list[CudaIpcHandle] = field(default_factory=list)

    def duplicate(self, handle: CudaIpcHandle) -> None:
        self.duplicates.append(handle)

    def open(self, handle: CudaIpcHandle) -> tuple[int, int, Callable[[], None]]:
        if self.fail is not None:
            raise self.fail
        self.opened.append(handle)
        address = 0x100000000 * len(self.opened)
        return address, handle.storage_size, lambda: self.closed.append(address)


@pytest.fixture
def opener() -> FakeOpener:
    return FakeOpener()


def test_one_mapping_per_handle_refcounted_and_closed_on_last_release(opener: FakeOpener) -> None:
    table = HandleTable(cuda=opener)
    first = table.open(cuda_handle(offset=0, size=4096))
    second = table.open(cuda_handle(uuid="gpu-" + UUID0[4:].lower(), offset=4096, size=4096))
    assert len(opener.opened) == 1 and len(table) == 1
    assert [h.offset for h in opener.duplicates] == [4096]  # its own export reference
    assert second.address == first.address + 4096
    assert (first.device, second.device) == (0, 0)
    table.retain(first)  # a copy in flight
    table.release(first)
    table.release(second)
    assert opener.closed == []
    table.release(first)
    assert opener.closed == [0x100000000]
    assert len(table) == 0


def test_another_storage_or_gpu_is_another_mapping(opener: FakeOpener) -> None:
    table = HandleTable(cuda=opener)
    a = table.open(cuda_handle())
    b = table.open(cuda_handle(storage_offset=1 << 20))  # another storage in the segment
    c = table.open(cuda_handle(uuid=UUID1))
    assert len(opener.opened) == 3 and len(table) == 3
    assert c.device == 1
    for imported in (a, b, c):
        table.release(imported)
    assert len(opener.closed) == 3


def test_cuda_region_past_the_end_is_refused_and_not_leaked(opener: FakeOpener) -> None:
    table = HandleTable(cuda=opener)
    with pytest.raises(HandleError, match="outside"):
        table.open(cuda_handle(storage_size=8192, offset=4096, size=8192))
    assert len(table) == 0
    assert opener.closed == [0x100000000]
    good = table.open(cuda_handle(storage_size=8192, offset=0, size=8192))
    with pytest.raises(HandleError, match="outside"):
        table.open(cuda_handle(storage_size=8192, offset=1, size=8192))
    assert len(table) == 1  # the good import keeps its mapping
    table.release(good)
    assert len(table) == 0


def test_opener_failures_become_handle_errors(opener: FakeOpener) -> None:
    table = HandleTable(cuda=opener)
    with pytest.raises(HandleError, match="not visible"):
        table.open(cuda_handle(uuid="GPU-99999999-0000-0000-0000-000000000000"))
    opener.fail = RuntimeError("CUDA error: invalid argument")
    with pytest.raises(HandleError, match=r"cannot open the CUDA IPC handle.*invalid argument"):
        table.open(cuda_handle())
    assert len(table) == 0


def test_table_close_closes_cuda_imports(opener: FakeOpener) -> None:
    table = HandleTable(cuda=opener)
    imported = table.open(cuda_handle())
    table.retain(imported)
    table.open(cuda_handle(uuid=UUID1))
    table.close()
    assert len(table) == 0
    assert len(opener.closed) == 2


def test_without_an_opener_cuda_handles_are_still_refused() -> None:
    with pytest.raises(HandleError, match="CUDA IPC handles need the cuda copy engine"):
        HandleTable().open(cuda_handle())


# --- pinning with a fake cudart --------------------------------------------------------------


class FakeError:
    """Like torch's pybind ``cudaError`` enum: the code is ``.value``."""

    def __init__(self, value: int) -> None:
        self.value = value


@dataclass
class FakeCudart:
    fail_at: int | None = None  # index of the register call that fails
    registered: list[tuple[int, int, int]] = field(default_factory=list)
    unregistered: list[int] = field(default_factory=list)

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> FakeError:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            return FakeError(2)  # cudaErrorMemoryAllocation
        self.registered.append((ptr, size, flags))
        return FakeError(0)

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


GiB = 1 << 30


@pytest.mark.parametrize(
    ("size", "piece"), [(10 * GiB, 4 * GiB), (8 * GiB, 4 * GiB), (4096, GiB), (GiB + 4096, GiB)]
)
def test_pieces_cover_the_range_exactly_once(size: int, piece: int) -> None:
    base = 0x7F0000000000
    cudart = FakeCudart()
    progress: list[float] = []
    registration = register_host_memory(
        base, size, piece=piece, cudart=cudart, progress=progress.append
    )
    assert registration is not None
    position = base
    for ptr, length, flags in cudart.registered:
        assert ptr == position and 0 < length <= piece
        assert flags == CUDA_HOST_REGISTER_PORTABLE
        position += length
    assert position == base + size
    assert len(progress) == len(cudart.registered)
    assert progress == sorted(progress) and progress[-1] == 1.0
    registration.close()
    assert sorted(cudart.unregistered) == [p for p, _, _ in cudart.registered]
    registration.close()  # idempotent
    assert len(cudart.unregistered) == len(cudart.registered)


def test_a_failed_piece_rolls_back_and_returns_none(caplog: pytest.LogCaptureFixture) -> None:
    cudart = FakeCudart(fail_at=2)
    with caplog.at_level(logging.WARNING, logger="offloadd.transfer.pinning"):
        registration = register_host_memory(0x10000000, 10 * GiB, piece=GiB, cudart=cudart)
    assert registration is None
    assert len(cudart.registered) == 2
    assert sorted(cudart.unregistered) == [p for p, _, _ in cudart.registered]
    assert "pageable (slower)" in caplog.text


def test_split_pieces_validates_its_inputs() -> None:
    assert split_pieces(0, 3 * 4096, 8192) == [(0, 8192), (8192, 4096)]
    with pytest.raises(ValueError, match="multiple"):
        split_pieces(0, 4096, 1000)
    with pytest.raises(ValueError, match="positive"):
        split_pieces(0, 0, 4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_nothing_is_pinned() -> None:
    assert register_host_memory(0x10000000, 4096) is None


# --- the arena's pin hook and parallel pre-fault --------------------------------------------


@pytest.fixture
def arena_path() -> Iterator[str]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm")
    path = f"/dev/shm/offloadd-test-{os.getpid()}-{uuid.uuid4().hex[:10]}.arena"
    yield path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def test_pin_hook_gets_the_mapping_and_is_closed_before_unmapping(arena_path: str) -> None:
    events: list[str] = []
    seen: list[tuple[int, int]] = []

    class Pinned:
        def close(self) -> None:
            events.append("unpinned")
            # Still mapped: the hook may need the pages (cudaHostUnregister does).
            assert not arena._mmap.closed

    def pin(address: int, size: int) -> Pinned:
        seen.append((address, size))
        return Pinned()

    arena = Arena(arena_path, 1 << 20, pin=pin)
    assert seen == [(arena.address, 1 << 20)]
    assert isinstance(arena.pinned, Pinned)
    arena.close()
    assert events == ["unpinned"]
    arena.close()
    assert events == ["unpinned"]


def test_pin_hook_with_register_host_memory_and_a_fake_cudart(arena_path: str) -> None:
    cudart = FakeCudart()
    arena = Arena(
        arena_path,
        1 << 20,
        pin=lambda address, size: register_host_memory(
            address, size, piece=256 << 10, cudart=cudart
        ),
    )
    assert isinstance(arena.pinned, HostRegistration)
    assert [length for _, length, _ in cudart.registered] == [256 << 10] * 4
    arena.close()
    assert len(cudart.unregistered) == 4


def test_a_failing_pin_hook_removes_the_new_arena(arena_path: str) -> None:
    def pin(address: int, size: int) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        Arena(arena_path, 1 << 20, pin=pin)
    assert not os.path.exists(arena_path)
    Arena(arena_path, 1 << 20).close()  # the lock was released too


def test_parallel_prefault_reports_progress_and_keeps_data(
    arena_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(arena_module, "_PREFAULT_STEP", 64 << 10)
    monkeypatch.setattr(arena_module, "_PREFAULT_THREADS", 4)
    monkeypatch.setattr("offloadd.cache.arena.os.cpu_count", lambda: 4)
    first = Arena(arena_path, 1 << 20, unlink_on_close=False)
    ctypes.memmove(first.address + 700_000, b"kept", 4)
    first.close()
    progress: list[float] = []
    second = Arena(arena_path, 1 << 20, progress=progress.append)
    try:
        assert len(progress) == 16
        assert progress == sorted(progress) and progress[-1] == 1.0
        assert ctypes.string_at(second.address + 700_000, 4) == b"kept"
    finally:
        second.close()


def test_prefault_falls_back_to_touching_pages(
    arena_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(arena_module, "_PREFAULT_STEP", 256 << 10)
    monkeypatch.setattr(arena_module, "_populate", lambda address, length: False)
    for threads in (1, 4):
        monkeypatch.setattr(arena_module, "_PREFAULT_THREADS", threads)
        monkeypatch.setattr("offloadd.cache.arena.os.cpu_count", lambda: 4)
        progress: list[float] = []
        arena = Arena(arena_path, 1 << 20, progress=progress.append)
        arena.close()
        assert progress[-1] == 1.0 and len(progress) == 4


# --- batch arrays ------------------------------------------------------------------------------


def test_move_arrays_merge_neighbours_contiguous_on_both_sides() -> None:
    moves: list[Triple] = [
        (1000, 5000, 100),
        (1100, 5100, 50),  # contiguous on both sides: merged
        (1150, 6000, 10),  # source contiguous, destination not
        (2000, 6010, 0),  # empty: dropped
        (3000, 7000, 8),
    ]
    arrays = move_arrays(moves, Direction.STORE)
    assert arrays.triples() == [(1000, 5000, 150), (1150, 6000, 10), (3000, 7000, 8)]
    assert all(a.dtype == np.uint64 and a.flags.c_contiguous for a in arrays)
    assert move_arrays([], Direction.LOAD).triples() == []
    assert move_arrays([(1, 2, 0)], Direction.LOAD).triples() == []
    with pytest.raises(ValueError, match="negative"):
        move_arrays([(0, 0, -1)], Direction.STORE)


def test_access_order_per_direction() -> None:
    assert src_access_order(Direction.STORE) == 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    assert src_access_order(Direction.LOAD) == 3  # CU_MEMCPY_SRC_ACCESS_ORDER_ANY


def test_cpu_engine_accepts_and_ignores_the_cuda_keywords() -> None:
    engine = CpuCopyEngine()
    src = ctypes.create_string_buffer(b"abcdef", 6)
    dst = ctypes.create_string_buffer(6)
    try:
        future = engine.submit(
            Direction.STORE,
            [(ctypes.addressof(src), ctypes.addressof(dst), 6)],
            device=3,
            wait_event=EVENT,
        )
        assert future.result(5) >= 0.0
        assert dst.raw == b"abcdef"
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_make_engine_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        make_engine()


# --- the cuda engine on a fake backend -------------------------------------------------------


class FakeEvent:
    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend
        self.device: int | None = None
        self.at = 0.0

    def record(self, stream: FakeStream) -> None:
        self.device = stream.device
        self.at = time.perf_counter()
        stream.ops.append(("record", self))

    def query(self) -> bool:
        raise AssertionError("completion is event driven: nothing polls an event")

    def synchronize(self) -> None:
        assert self.device is not None
        self.backend.synchronized.append((threading.current_thread().name, self.device))
        self.backend.released[self.device].wait()
        if self.backend.broken_query:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1000.0 + 0.25


@dataclass
class FakeStream:
    device: int
    ops: list[tuple[str, object]] = field(default_factory=list)

    def wait_event(self, event: object) -> None:
        self.ops.append(("wait", event))


@dataclass
class FakeBackend:
    """Copies with memmove at enqueue time; an event completes when its device is released."""

    devices: int = 2
    released: list[threading.Event] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)
    bound: list[tuple[str, int]] = field(default_factory=list)
    copies: list[tuple[Direction, list[int], list[int], list[int]]] = field(default_factory=list)
    ipc_opened: list[tuple[int, bytes]] = field(default_factory=list)
    fail_copy: bool = False
    fail_bind: bool = False
    broken_query: bool = False
    synchronized: list[tuple[str, int]] = field(default_factory=list)
    name: str = "fake"
    batched: bool = True

    def __post_init__(self) -> None:
        for _ in range(self.devices):
            released = threading.Event()
            released.set()
            self.released.append(released)

    def bind_thread(self, device: int) -> None:
        if self.fail_bind and threading.current_thread().name.startswith("offloadd-cuda"):
            raise RuntimeError("cudaSetDevice(0) failed: cudaErrorDevicesUnavailable")
        self.bound.append((threading.current_thread().name, device))

    def stream(self, device: int) -> FakeStream:
        stream = FakeStream(device)
        self.streams.append(stream)
        return stream

    def timing_event(self, device: int) -> FakeEvent:
        return FakeEvent(self)

    def ipc_event(self, device: int, handle: bytes) -> object:
        self.ipc_opened.append((device, handle))
        return ("ipc", device, handle)

    def copy(self, stream: FakeStream, direction: Direction, arrays: MoveArrays) -> None:
        if self.fail_copy:
            raise CudaCopyError("cuMemcpyBatchAsync of 1 copies failed: CUDA_ERROR_INVALID_VALUE")
        srcs, dsts, sizes = (a.tolist() for a in arrays)
        self.copies.append((direction, srcs, dsts, sizes))
        stream.ops.append(("copy", len(sizes)))
        for src, dst, nbytes in arrays.triples():
            ctypes.memmove(dst, src, nbytes)


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def engine(backend: FakeBackend) -> Iterator[CudaCopyEngine]:
    engine = CudaCopyEngine(backend)
    yield engine
    for released in backend.released:
        released.set()
    engine.close()


def buffers(
    count: int, size: int
) -> tuple[ctypes.Array[ctypes.c_char], ctypes.Array[ctypes.c_char]]:
    data = bytes((i * 7 + 3) % 256 for i in range(count * size))
    src = ctypes.create_string_buffer(data, len(data))
    dst = ctypes.create_string_buffer(count * size)
    return src, dst


def test_engine_copies_one_batch_per_job_and_reports_seconds(
    engine: CudaCopyEngine, backend: FakeBackend
) -> None:
    src, dst = buffers(8, 64)
    base_s, base_d = ctypes.addressof(src), ctypes.addressof(dst)
    # Pages back to back on both sides: one copy after merging.
    moves = [(base_s + i * 64, base_d + i * 64, 64) for i in range(8)]
    future = engine.submit(Direction.STORE, moves, device=1)
    seconds = future.result(5)
    assert seconds > 0.0
    assert dst.raw == src.raw
    assert len(backend.copies) == 1  # one driver call per job
    direction, srcs, _dsts, sizes = backend.copies[0]
    assert direction is Direction.STORE and srcs == [base_s] and sizes == [8 * 64]
    # The issuing thread and the completion thread each make the device current, once.
    assert sorted(name for name, d in backend.bound if d == 1) == [
        "offloadd-cuda1-store-done",
        "offloadd-cuda1-store_0",
    ]


def test_jobs_of_a_lane_resolve_in_submission_order(
    engine: CudaCopyEngine, backend: FakeBackend
) -> None:
    src, dst = buffers(4, 32)
    order: list[int] = []
    backend.released[0].clear()
    futures: list[Future[float]] = []
    for index in range(4):
        move = (ctypes.addressof(src) + index * 32, ctypes.addressof(dst) + index * 32, 32)
        future = engine.submit(Direction.LOAD, [move], device=0)

        def finished(_future: Future[float], index: int = index) -> None:
            order.append(index)

        future.add_done_callback(finished)
        futures.append(future)
    time.sleep(0.05)
    assert order == []  # nothing resolves while the device holds its events
    backend.released[0].set()
    for future in futures:
        future.result(5)
    assert order == [0, 1, 2, 3]
    assert len(backend.streams) == 1  # one stream per lane


def test_lanes_of_different_devices_do_not_wait_for_each_other(
    engine: CudaCopyEngine, backend: FakeBackend
) -> None:
    src, dst = buffers(2, 16)
    backend.released[0].clear()
    held = engine.submit(
        Direction.STORE, [(ctypes.addressof(src), ctypes.addressof(dst), 16)], device=0
    )
    other = engine.submit(
        Direction.STORE, [(ctypes.addressof(src) + 16, ctypes.addressof(dst) + 16, 16)], device=1
    )
    assert other.result(5) >= 0.0
    assert not held.done()
    backend.released[0].set()
    assert held.result(5) >= 0.0


def test_store_waits_on_the_ipc_event_before_copying(
    engine: CudaCopyEngine, backend: FakeBackend
) -> None:
    src, dst = buffers(1, 16)
    move = [(ctypes.addressof(src), ctypes.addressof(dst), 16)]
    for _ in range(3):
        engine.submit(Direction.STORE, move, device=0, wait_event=EVENT).result(5)
    engine.submit(Direction.STORE, move, device=0).result(5)
    assert backend.ipc_opened == [(0, EVENT)]  # opened once, reused
    ops = [op for op, _ in backend.streams[0].ops]
    assert ops[:4] == ["wait", "record", "copy", "record"]
    assert ops[4:] == ["wait", "record", "copy", "record"] * 2 + ["record", "copy", "record"]


def test_a_load_waits_on_the_ipc_event_too(engine: CudaCopyEngine, backend: FakeBackend) -> None:
    src, dst = buffers(1, 16)
    move = [(ctypes.addressof(src), ctypes.addressof(dst), 16)]
    assert engine.submit(Direction.LOAD, move, device=1, wait_event=EVENT).result(5) >= 0.0
    assert backend.ipc_opened == [(1, EVENT)]
    assert [op for op, _ in backend.streams[0].ops] == ["wait", "record", "copy", "record"]


def test_completion_blocks_on_each_end_event_once_and_never_polls(
    engine: CudaCopyEngine, backend: FakeBackend
) -> None:
    # FakeEvent.query raises: a poller would fail every job. Each job's end event is waited
    # for exactly once, on the lane's completion thread, and the job resolves right after.
    src, dst = buffers(3, 32)
    backend.released[0].clear()
    futures = [
        engine.submit(
            Direction.LOAD,
            [(ctypes.addressof(src) + i * 32, ctypes.addressof(dst) + i * 32, 32)],
            device=0,
        )
        for i in range(3)
    ]
    deadline = time.monotonic() + 5
    while not backend.synchronized and time.monotonic() < deadline:
        time.sleep(0.001)
    assert backend.synchronized == [("offloadd-cuda0-load-done", 0)]  # blocked on job 0 only
    assert not any(f.done() for f in futures)
    backend.released[0].set()
    assert [f.result(5) >= 0.0 for f in futures] == [True] * 3
    assert backend.synchronized == [("offloadd-cuda0-load-done", 0)] * 3
    assert dst.raw == src.raw


def test_the_engine_splits_a_run_at_the_pinned_piece_cut(backend: FakeBackend) -> None:
    src, dst = buffers(4, 4096)
    arena = ctypes.addressof(dst)
    cut = arena + 2 * 4096
    engine = CudaCopyEngine(backend, host_pieces=HostPieces(cut - (1 << 30), 1 << 30))
    try:
        moves = [(ctypes.addressof(src) + i * 4096, arena + i * 4096, 4096) for i in range(4)]
        engine.submit(Direction.STORE, moves, device=0).result(5)
    finally:
        engine.close()
    (_direction, srcs, dsts, sizes) = backend.copies[0]
    assert dsts == [arena, cut] and sizes == [8192, 8192]
    assert srcs == [ctypes.addressof(src), ctypes.addressof(src) + 8192]
    assert dst.raw == src.raw


def test_a_refused_copy_fails_its_job_only(engine: CudaCopyEngine, backend: FakeBackend) -> None:
    src, dst = buffers(1, 16)
    move = [(ctypes.addressof(src), ctypes.addressof(dst), 16)]
    backend.fail_copy = True
    failed = engine.submit(Direction.LOAD, move, device=0)
    with pytest.raises(CudaCopyError, match="CUDA_ERROR_INVALID_VALUE"):
        failed.result(5)
    # The end event was still recorded, so the job resolved after the stream drained.
    assert [op for op, _ in backend.streams[0].ops] == ["record", "record"]
    backend.fail_copy = False
    assert engine.submit(Direction.LOAD, move, device=0).result(5) >= 0.0


def test_a_failed_device_binding_fails_the_job_and_is_retried(
    engine: CudaCopyEngine, backend: FakeBackend
) -> None:
    src, dst = buffers(1, 16)
    move = [(ctypes.addressof(src), ctypes.addressof(dst), 16)]
    backend.fail_bind = True
    with pytest.raises(RuntimeError, match="cudaSetDevice"):
        engine.submit(Direction.STORE, move, device=0).result(5)
    backend.fail_bind = False
    assert engine.submit(Direction.STORE, move, device=0).result(5) >= 0.0
    assert dst.raw == src.raw


def test_an_event_error_fails_the_job(engine: CudaCopyEngine, backend: FakeBackend) -> None:
    src, dst = buffers(1, 16)
    backend.broken_query = True
    future = engine.submit(
        Direction.STORE, [(ctypes.addressof(src), ctypes.addressof(dst), 16)], device=0
    )
    with pytest.raises(RuntimeError, match="illegal memory access"):
        future.result(5)


def test_empty_job_completes(engine: CudaCopyEngine, backend: FakeBackend) -> None:
    assert engine.submit(Direction.STORE, [], device=0).result(5) >= 0.0
    assert backend.copies == []


def test_device_is_required(engine: CudaCopyEngine) -> None:
    with pytest.raises(ValueError, match="device"):
        engine.submit(Direction.STORE, [(1, 2, 3)])


def test_close_waits_for_outstanding_jobs(backend: FakeBackend) -> None:
    engine = CudaCopyEngine(backend)
    src, dst = buffers(1, 16)
    backend.released[1].clear()
    future = engine.submit(
        Direction.LOAD, [(ctypes.addressof(src), ctypes.addressof(dst), 16)], device=1
    )
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(0.1)
    assert closer.is_alive() and not future.done()
    backend.released[1].set()
    closer.join(5)
    assert not closer.is_alive()
    assert future.result(0) >= 0.0
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(Direction.LOAD, [], device=1)
    engine.close()


def test_many_jobs_on_both_directions_and_devices(
    engine: CudaCopyEngine, backend: FakeBackend
) -> None:
    size = 256
    src, dst = buffers(64, size)
    futures: dict[tuple[int, Direction], list[Future[float]]] = {}
    for index in range(64):
        device = index % 2
        direction = Direction.STORE if index % 4 < 2 else Direction.LOAD
        move = (ctypes.addressof(src) + index * size, ctypes.addressof(dst) + index * size, size)
        futures.setdefault((device, direction), []).append(
            engine.submit(direction, [move], device=device)
        )
    for lane in futures.values():
        for future in lane:
            future.result(5)
    assert dst.raw == src.raw
    assert len(backend.streams) == 4


# --- the GPU check script --------------------------------------------------------------------


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "offloadd", "check-gpu", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_gpu_check_shows_help() -> None:
    result = run_script("--help")
    assert result.returncode == 0, result.stderr
    assert "offloadd check-gpu" in result.stdout and "--total" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_gpu_check_without_cuda_exits_2_with_a_message() -> None:
    result = run_script("--total", "1GiB")
    assert result.returncode == 2
    assert "CUDA" in result.stderr


def test_a_second_export_of_a_mapped_storage_releases_its_ipc_counter(
    fake_torch: FakeTorch,
) -> None:
    # Two layers in one allocation, exported twice: torch counted a reference per export.
    opener = CudaIpcOpener(DeviceMap([UUID0]))
    table = HandleTable(cuda=opener)
    first = table.open(cuda_handle(offset=0, size=4096))
    second_handle = msgspec.structs.replace(
        cuda_handle(offset=4096, size=4096), ref_counter_offset=9
    )
    second = table.open(second_handle)
    assert len(fake_torch.calls) == 1  # one import
    assert fake_torch.released == [(b"/torch_123_456", 9)]  # the second export's reference
    table.release(first)
    table.release(second)


def test_an_unwritable_counter_file_is_reported_once(
    fake_torch: FakeTorch, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"/offloadd-test-counter-{uuid.uuid4().hex[:8]}"
    path = cuda_ipc.counter_path(name.encode())
    with open(path, "wb"):
        pass
    try:
        monkeypatch.setattr("offloadd.transfer.cuda_import.os.access", lambda p, mode: p != path)
        opener = CudaIpcOpener(DeviceMap([UUID0]))
        handle = msgspec.structs.replace(cuda_handle(), ref_counter_handle=name.encode())
        with caplog.at_level(logging.WARNING, logger="offloadd.transfer.cuda_import"):
            for _ in range(3):
                opener.open(handle)[2]()
        assert caplog.text.count("cannot write torch's IPC reference counter") == 1
        assert path in caplog.text
    finally:
        os.unlink(path)


def test_export_opens_the_counter_file_to_the_ranks_group(fake_gpu: None) -> None:
    name = f"/offloadd-test-counter-{uuid.uuid4().hex[:8]}"
    path = cuda_ipc.counter_path(name.encode())
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        shared = (0, IPC, 1 << 22, 4096, name.encode(), 7, EVENT, True)
        export_tensor(FakeCudaTensor((4, 64), (64, 1), itemsize=1, shared=shared))  # type: ignore[arg-type]
        assert os.stat(path).st_mode & 0o777 == 0o660
    finally:
        os.unlink(path)

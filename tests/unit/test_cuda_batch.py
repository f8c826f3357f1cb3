"""The batched copy call without a GPU: address arrays, merging at pinned-piece cuts, the ctypes
ABI marshalled through a real C prototype, that ABI held against NVIDIA's own cuda-bindings
declarations (and the binding called for real, expecting its no-driver answer), and the torch
backend's loud fallback and event flags on a fake torch and driver.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import logging
import os
import re
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from offloadd.transfer import libcuda
from offloadd.transfer.batch import (
    ABIS,
    CUDA_ERROR_NOT_SUPPORTED,
    SIZE_MAX,
    BatchAbi,
    BatchCopier,
    HostPieces,
    MemcpyAttributes,
    move_arrays,
)
from offloadd.transfer.cuda import PER_COPY, CudaCopyError, TorchCudaBackend
from offloadd.transfer.types import Direction, MoveArrays, Triple

V2, V1 = ABIS


# --- merging at the pinned-piece cuts ---------------------------------------------------------


def test_copies_are_never_merged_across_a_pinned_piece_cut() -> None:
    origin, piece = 0x7F0000001000, 1 << 20
    cut = origin + piece
    # Two shards back to back around the cut, from contiguous GPU blocks: one run on both
    # sides, which one copy would carry across two registrations.
    gpu = 0x10000000
    store: list[Triple] = [
        (gpu, cut - 8192, 4096),
        (gpu + 4096, cut - 4096, 4096),
        (gpu + 8192, cut, 4096),
        (gpu + 12288, cut + 4096, 4096),
    ]
    assert move_arrays(store, Direction.STORE).triples() == [(gpu, cut - 8192, 16384)]
    split = move_arrays(store, Direction.STORE, HostPieces(origin, piece)).triples()
    assert split == [(gpu, cut - 8192, 8192), (gpu + 8192, cut, 8192)]
    # A load has the host on the source side.
    load = [(dst, src, n) for src, dst, n in store]
    assert move_arrays(load, Direction.LOAD, HostPieces(origin, piece)).triples() == [
        (cut - 8192, gpu, 8192),
        (cut, gpu + 8192, 8192),
    ]


# --- the C call, marshalled for real -------------------------------------------------------------


@dataclass
class Recorded:
    """What the fake driver entry point saw, read back through the raw pointers."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    answer: int = 0
    fail_at: int | None = None


def fake_entry(abi: BatchAbi, recorded: Recorded) -> Any:
    """A C function pointer with the driver's prototype whose body is Python."""

    def body(*args: Any) -> int:
        dsts, srcs, sizes, count, attrs, attr_index, num_attrs = args[:7]
        stream = args[-1]

        def read(address: int) -> list[int]:
            return list((ctypes.c_uint64 * count).from_address(address))

        call = {
            "dsts": read(dsts),
            "srcs": read(srcs),
            "sizes": read(sizes),
            "count": count,
            "order": attrs.contents.srcAccessOrder,
            "attr_index": attr_index[0],
            "num_attrs": num_attrs,
            "stream": stream,
            "args": len(args),
        }
        if abi.fail_index:
            if recorded.fail_at is not None:
                args[7][0] = recorded.fail_at
            call["fail_index_given"] = bool(args[7])
        recorded.calls.append(call)
        return recorded.answer

    return abi.prototype()(body)


@pytest.mark.parametrize("abi", ABIS, ids=lambda a: a.symbol)
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_the_batch_call_passes_the_arrays_by_address(abi: BatchAbi, direction: Direction) -> None:
    recorded = Recorded()
    lib = types.SimpleNamespace(**{abi.symbol: fake_entry(abi, recorded)})
    copier = BatchCopier.resolve(lib)
    assert copier is not None and copier.abi == abi
    moves: list[Triple] = [(0x1000 * (i + 1), 0x90000000 + 0x4000 * i, 61 * 1024) for i in range(5)]
    arrays = move_arrays(moves, direction)
    assert copier.copy(0xABC0, direction, arrays) == (0, None)
    (call,) = recorded.calls
    assert call["srcs"] == [m[0] for m in moves]
    assert call["dsts"] == [m[1] for m in moves]
    assert call["sizes"] == [m[2] for m in moves]
    assert (call["count"], call["attr_index"], call["num_attrs"]) == (5, 0, 1)
    assert call["order"] == (1 if direction is Direction.STORE else 3)
    assert call["stream"] == 0xABC0
    assert call["args"] == (9 if abi.fail_index else 8)
    if abi.fail_index:
        assert call["fail_index_given"]


def test_a_refused_batch_reports_the_driver_code_and_the_failed_copy() -> None:
    recorded = Recorded(answer=1, fail_at=3)  # CUDA_ERROR_INVALID_VALUE at copy 3
    copier = BatchCopier.resolve(types.SimpleNamespace(cuMemcpyBatchAsync=fake_entry(V1, recorded)))
    assert copier is not None
    arrays = move_arrays([(i << 20, (i + 64) << 20, 4096) for i in range(8)], Direction.LOAD)
    assert copier.copy(0x1, Direction.LOAD, arrays) == (1, 3)
    recorded.fail_at = SIZE_MAX  # "no specific copy"
    assert copier.copy(0x1, Direction.LOAD, arrays) == (1, None)


def test_resolve_prefers_the_v2_entry_point_and_needs_one() -> None:
    both = types.SimpleNamespace(
        cuMemcpyBatchAsync=fake_entry(V1, Recorded()),
        cuMemcpyBatchAsync_v2=fake_entry(V2, Recorded()),
    )
    copier = BatchCopier.resolve(both)
    assert copier is not None and copier.abi == V2 and copier.name == "cuMemcpyBatchAsync_v2"
    assert BatchCopier.resolve(types.SimpleNamespace()) is None  # a driver before CUDA 12.8
    assert BatchCopier.resolve(ctypes.CDLL(None)) is None  # a real library without the symbol


# --- the ABI against NVIDIA's cuda-bindings (the ``test`` extra installs them) -------------------


def _bindings_dir() -> str:
    spec = importlib.util.find_spec("cuda.bindings")
    assert spec is not None and spec.submodule_search_locations, "install offloadd[test]"
    return next(iter(spec.submodule_search_locations))


def _declared_parameters() -> list[tuple[str, str]]:
    with open(os.path.join(_bindings_dir(), "cydriver.pxd")) as handle:
        text = handle.read()
    found = re.search(r"cdef CUresult cuMemcpyBatchAsync\(([^)]*)\)", text)
    assert found, "cydriver.pxd declares no cuMemcpyBatchAsync"
    parameters = []
    for parameter in found.group(1).split(","):
        kind, name = parameter.strip().rsplit(" ", 1)
        parameters.append((kind.replace(" ", ""), name))
    return parameters


def _contains(path: str, needle: bytes) -> bool:
    with open(path, "rb") as handle:
        return needle in handle.read()


# How each declared C parameter is passed here: the three copy arrays as raw addresses.
_AS_PASSED: dict[tuple[str, str], Any] = {
    ("CUdeviceptr*", "dsts"): ctypes.c_void_p,
    ("CUdeviceptr*", "srcs"): ctypes.c_void_p,
    ("size_t*", "sizes"): ctypes.c_void_p,
    ("size_t", "count"): ctypes.c_size_t,
    ("CUmemcpyAttributes*", "attrs"): ctypes.POINTER(MemcpyAttributes),
    ("size_t*", "attrsIdxs"): ctypes.POINTER(ctypes.c_size_t),
    ("size_t", "numAttrs"): ctypes.c_size_t,
    ("size_t*", "failIdx"): ctypes.POINTER(ctypes.c_size_t),
    ("CUstream", "hStream"): ctypes.c_void_p,
}


def test_the_prototype_matches_the_installed_bindings_declaration() -> None:
    parameters = _declared_parameters()
    has_fail_index = any(name == "failIdx" for _, name in parameters)
    abi = V1 if has_fail_index else V2
    assert abi.prototype()._argtypes_ == tuple(_AS_PASSED[p] for p in parameters)
    # The symbol NVIDIA's binding loads for that declaration: "_v2" from CUDA 13 on.
    binaries = glob.glob(os.path.join(_bindings_dir(), "**", "*driver*.so"), recursive=True)
    loads_v2 = any(_contains(path, b"cuMemcpyBatchAsync_v2\0") for path in binaries)
    assert loads_v2 == (abi.symbol == "cuMemcpyBatchAsync_v2")


def test_the_attribute_struct_and_enums_match_the_bindings() -> None:
    from cuda.bindings import driver

    theirs = driver.CUmemcpyAttributes()
    theirs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_ANY
    theirs.srcLocHint.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    theirs.srcLocHint.id = 7
    theirs.dstLocHint.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
    theirs.dstLocHint.id = 9
    theirs.flags = driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    ours = MemcpyAttributes(3)
    ours.srcLocHint.type, ours.srcLocHint.id = 1, 7
    ours.dstLocHint.type, ours.dstLocHint.id = 2, 9
    ours.flags = 1
    assert ctypes.string_at(theirs.getPtr(), ctypes.sizeof(ours)) == bytes(ours)
    orders = driver.CUmemcpySrcAccessOrder
    assert int(orders.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM) == 1
    assert int(orders.CU_MEMCPY_SRC_ACCESS_ORDER_ANY) == 3
    assert int(driver.CUresult.CUDA_ERROR_NOT_SUPPORTED) == CUDA_ERROR_NOT_SUPPORTED


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-driver answer")
def test_the_real_binding_takes_the_same_arrays_and_answers_without_a_driver() -> None:
    from cuda.bindings import driver

    arrays = move_arrays([(1 << 20, 3 << 20, 64), (2 << 20, 5 << 20, 64)], Direction.LOAD)
    attrs = driver.CUmemcpyAttributes()
    attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_ANY
    args: list[Any] = [
        [driver.CUdeviceptr(int(a)) for a in arrays.dsts],
        [driver.CUdeviceptr(int(a)) for a in arrays.srcs],
        arrays.sizes.tolist(),
        len(arrays),
        [attrs],
        [0],
        1,
        driver.CUstream(0x1234),
    ]
    try:
        result = driver.cuMemcpyBatchAsync(*args)
    except Exception as exc:  # no libcuda.so.1 here: the binding cannot even load it
        assert re.search(r"libcuda|driver|not found", str(exc), re.IGNORECASE), exc
    else:
        assert result[0] != driver.CUresult.CUDA_SUCCESS


# --- the torch backend on a fake torch and driver -------------------------------------------------


@dataclass
class FakeDriver:
    lib: Any
    memcpys: list[tuple[int, int, int, int]] = field(default_factory=list)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        self.memcpys.append((dst, src, nbytes, stream))
        return libcuda.CUDA_SUCCESS

    def error_name(self, code: int) -> str:
        return {1: "CUDA_ERROR_INVALID_VALUE", 801: "CUDA_ERROR_NOT_SUPPORTED"}.get(code, "?")


def fake_torch(events: list[dict[str, Any]]) -> Any:
    def event(**kwargs: Any) -> object:
        events.append(kwargs)
        return object()

    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        init=lambda: None,
        Event=event,
        Stream=lambda device: types.SimpleNamespace(cuda_stream=0x5000 + device),
    )
    return types.SimpleNamespace(cuda=cuda)


def backend_with(lib: Any, **kwargs: Any) -> tuple[TorchCudaBackend, FakeDriver]:
    driver = FakeDriver(lib)
    backend = TorchCudaBackend(torch=fake_torch([]), driver=driver, **kwargs)  # type: ignore[arg-type]
    return backend, driver


ARRAYS = move_arrays([(1 << 20, 9 << 20, 4096), (5 << 20, 11 << 20, 4096)], Direction.STORE)
STREAM = types.SimpleNamespace(cuda_stream=0x77)


def test_batched_backend_issues_one_call() -> None:
    recorded = Recorded()
    backend, driver = backend_with(
        types.SimpleNamespace(cuMemcpyBatchAsync_v2=fake_entry(V2, recorded))
    )
    assert backend.batched and backend.name == "cuMemcpyBatchAsync_v2" and not backend.degraded
    backend.copy(STREAM, Direction.STORE, ARRAYS)
    assert len(recorded.calls) == 1 and recorded.calls[0]["stream"] == 0x77
    assert driver.memcpys == []


def test_a_driver_without_the_batch_api_is_a_loud_degraded_fallback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="offloadd.transfer.cuda"):
        backend, driver = backend_with(types.SimpleNamespace())
    assert not backend.batched and backend.name == PER_COPY
    assert "CUDA 12.8" in backend.degraded
    assert "DEGRADED" in caplog.text
    backend.copy(STREAM, Direction.STORE, ARRAYS)
    assert driver.memcpys == [(9 << 20, 1 << 20, 4096, 0x77), (11 << 20, 5 << 20, 4096, 0x77)]


def test_not_supported_answers_switch_to_per_copy_loudly(caplog: pytest.LogCaptureFixture) -> None:
    recorded = Recorded(answer=CUDA_ERROR_NOT_SUPPORTED)
    backend, driver = backend_with(
        types.SimpleNamespace(cuMemcpyBatchAsync=fake_entry(V1, recorded))
    )
    assert backend.batched
    with caplog.at_level(logging.ERROR, logger="offloadd.transfer.cuda"):
        backend.copy(STREAM, Direction.STORE, ARRAYS)
    assert not backend.batched and "NOT_SUPPORTED" in backend.degraded
    assert "DEGRADED" in caplog.text
    assert len(driver.memcpys) == 2  # the job still ran, one copy at a time
    backend.copy(STREAM, Direction.STORE, ARRAYS)
    assert len(recorded.calls) == 1 and len(driver.memcpys) == 4


def test_other_refusals_fail_the_job_with_the_copy_index() -> None:
    recorded = Recorded(answer=1, fail_at=1)
    backend, _ = backend_with(types.SimpleNamespace(cuMemcpyBatchAsync=fake_entry(V1, recorded)))
    with pytest.raises(CudaCopyError, match=r"2 copies failed at copy 1: CUDA_ERROR_INVALID_VALUE"):
        backend.copy(STREAM, Direction.STORE, ARRAYS)
    assert backend.batched  # a bad job is not a reason to stop batching


def test_batching_turned_off_on_purpose_is_not_batched_but_logs_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="offloadd.transfer.cuda"):
        backend, _ = backend_with(types.SimpleNamespace(), batch=False)
    assert not backend.batched and backend.degraded
    assert caplog.text == ""


def test_timing_events_sleep_instead_of_spinning() -> None:
    events: list[dict[str, Any]] = []
    backend = TorchCudaBackend(torch=fake_torch(events), driver=FakeDriver(types.SimpleNamespace()))  # type: ignore[arg-type]
    backend.timing_event(0)
    assert events == [{"enable_timing": True, "blocking": True}]


def test_move_arrays_scale_without_a_python_object_per_copy() -> None:
    # 128k copies of 61 KiB pages from shuffled blocks: three arrays, nothing merged.
    rng = np.random.default_rng(0)
    blocks = rng.permutation(1 << 17)
    moves = [
        (0x7F00_0000_0000 + int(b) * 65536, 0x10_0000_0000 + i * 62464, 62464)
        for i, b in enumerate(blocks)
    ]
    arrays = move_arrays(moves, Direction.STORE)
    assert isinstance(arrays, MoveArrays) and len(arrays) == 1 << 17
    assert arrays.srcs.ctypes.data != 0 and arrays.sizes.sum() == 62464 << 17

"""The CUDA path across two real processes: export in a rank, import and copy here.

A rank process (spawn) allocates CUDA KV tensors (unpadded, padded, and two layers sharing
one allocation), fills them with random bytes, exports them with ``kv_region_from_tensor``
and records an interprocess event. This process imports them through ``HandleTable`` +
``CudaIpcOpener``, stores some blocks into a pinned arena with ``CudaCopyEngine`` (waiting
on the rank's event), loads them back into other blocks, and the rank checks every byte,
padding included; once with the arena pinned in one piece, once in 1 MiB pieces with the
slots of neighbouring blocks back to back across the cuts (copies must be split there: one
DMA over two registrations fails). Skipped without CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import traceback
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import pytest
import torch

from offloadd.cache.arena import Arena
from offloadd.transfer.batch import HostPieces
from offloadd.transfer.cuda import make_engine
from offloadd.transfer.cuda_import import CudaIpcOpener
from offloadd.transfer.handles import HandleTable
from offloadd.transfer.pinning import HostRegistration, register_host_memory
from offloadd.transfer.types import Direction, Triple
from protocol.handles import KVRegion

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_BLOCKS = 64
PAGE_SHAPE = (2, 16, 8, 128)
PAGE = 2 * 16 * 8 * 128 * 2  # bf16
PADDED_PAGE = 3000
PADDED_STRIDE = 4096
PAD = 0xEE
SRC = [3, 0, 17, 42, 43, 44, 9, 60]
DST = [5, 63, 18, 30, 31, 32, 1, 2]


def _byte_rows(tensor: torch.Tensor, stride: int) -> torch.Tensor:
    """``(NUM_BLOCKS, stride)`` uint8 rows over a KV tensor's memory."""
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    flat.set_(
        tensor.untyped_storage(),
        tensor.storage_offset() * tensor.element_size(),
        (NUM_BLOCKS, stride),
        (stride, 1),
    )
    return flat


def rank_main(conn: Connection) -> None:
    """The rank: allocate, fill, export, then verify what the test process copied."""
    try:
        from offloadd.cuda_ipc import kv_region_from_tensor

        torch.cuda.set_device(0)
        generator = torch.Generator(device="cuda").manual_seed(7)
        unpadded = torch.empty((NUM_BLOCKS, *PAGE_SHAPE), dtype=torch.bfloat16, device="cuda")
        unpadded.view(torch.uint8).view(NUM_BLOCKS, -1).random_(0, 256, generator=generator)
        padded_base = torch.full((NUM_BLOCKS, PADDED_STRIDE), PAD, dtype=torch.uint8, device="cuda")
        padded_base[:, :PADDED_PAGE].random_(0, 256, generator=generator)
        padded = padded_base[:, :PADDED_PAGE]
        shared = torch.empty((2, NUM_BLOCKS, PAGE), dtype=torch.uint8, device="cuda")
        shared.random_(0, 256, generator=generator)
        tensors = [
            (unpadded, PAGE, PAGE),
            (padded, PADDED_PAGE, PADDED_STRIDE),
            (shared[0], PAGE, PAGE),
            (shared[1], PAGE, PAGE),
        ]
        regions = [
            kv_region_from_tensor(t, page, [f"layer.{i}"]) for i, (t, page, _) in enumerate(tensors)
        ]
        ready = torch.cuda.Event(interprocess=True)
        ready.record()
        before = [_byte_rows(t, stride).clone() for t, _, stride in tensors]
        conn.send((msgspec.msgpack.encode(regions), bytes(ready.ipc_handle())))
        assert conn.recv() == "verify"
        torch.cuda.synchronize()
        problems = []
        for index, (t, page, stride) in enumerate(tensors):
            rows = _byte_rows(t, stride)
            if not torch.equal(rows[DST, :page], before[index][SRC, :page]):
                problems.append(f"region {index}: loaded pages differ from the stored ones")
            if page < stride and not torch.equal(rows[:, page:], before[index][:, page:]):
                problems.append(f"region {index}: padding was written")
            untouched = [b for b in range(NUM_BLOCKS) if b not in DST]
            if not torch.equal(rows[untouched], before[index][untouched]):
                problems.append(f"region {index}: blocks outside the load changed")
        conn.send(problems)
        assert conn.recv() == "exit"
    except BaseException:
        conn.send(["rank failed:\n" + traceback.format_exc()])


@pytest.fixture
def rank() -> Iterator[Connection]:
    ctx = torch.multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=rank_main, args=(child,), daemon=True)
    process.start()
    yield parent
    with contextlib.suppress(BrokenPipeError, OSError):
        parent.send("exit")
    process.join(30)
    if process.is_alive():
        process.kill()


PIECE = 1 << 20  # pinned pieces this small put several cuts under one test's slots


@pytest.fixture(params=[0, PIECE], ids=["one-piece", "1MiB-pieces"])
def pinned_arena(request: pytest.FixtureRequest) -> Iterator[tuple[Arena, int]]:
    """The pinned arena and its piece size (0: one piece)."""
    piece = request.param or (64 << 30)
    path = f"/dev/shm/offloadd-test-{os.getpid()}-{uuid.uuid4().hex[:10]}.arena"
    arena = Arena(
        path, 16 << 20, pin=lambda address, size: register_host_memory(address, size, piece=piece)
    )
    yield arena, request.param
    arena.close()


def _slot(slot: int, size: int, piece: int) -> int:
    """``slot``, or the next cut when ``size`` bytes there would span two pinned pieces (as
    the daemon's allocator never places a shard)."""
    if piece and slot // piece != (slot + size - 1) // piece:
        return (slot // piece + 1) * piece
    return slot


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "per-copy"])
def test_store_and_load_through_cuda_ipc(
    rank: Connection, pinned_arena: tuple[Arena, int], batch: bool
) -> None:
    arena, piece = pinned_arena
    assert rank.poll(120), "the rank did not report"
    message: Any = rank.recv()
    assert not isinstance(message, list), message
    encoded, event_handle = message
    regions = msgspec.msgpack.decode(encoded, type=list[KVRegion])
    assert isinstance(arena.pinned, HostRegistration), "the arena should be pinned on a GPU host"

    table = HandleTable(cuda=CudaIpcOpener())
    engine = make_engine(
        batch=batch, host_pieces=HostPieces(arena.address, piece) if piece else None
    )
    assert engine.batched == batch, "the driver has no cuMemcpyBatchAsync (CUDA >= 12.8)"
    imports = [table.open(region.handle) for region in regions]
    try:
        assert len(table) == 3  # the two layers of one allocation share a mapping
        device = imports[0].device
        assert all(imported.device == device for imported in imports)
        stores: list[Triple] = []
        loads: list[Triple] = []
        slot = 0
        for region, imported in zip(regions, imports, strict=True):
            for src, dst in zip(SRC, DST, strict=True):
                slot = _slot(slot, region.page_size, piece)
                host = arena.address + slot
                stores.append(
                    (imported.address + src * region.block_stride, host, region.page_size)
                )
                loads.append((host, imported.address + dst * region.block_stride, region.page_size))
                slot += region.page_size
        assert slot <= arena.size
        ctypes.memset(arena.address, 0, slot)
        stored = engine.submit(Direction.STORE, stores, device=device, wait_event=event_handle)
        assert stored.result(60) > 0.0
        loaded = engine.submit(Direction.LOAD, loads, device=device)
        assert loaded.result(60) > 0.0
        rank.send("verify")
        assert rank.poll(60)
        problems = rank.recv()
        assert problems == []
    finally:
        engine.close()
        for imported in imports:
            table.release(imported)
        assert len(table) == 0
        table.close()

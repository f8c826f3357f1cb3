"""The asyncio client against a real daemon, on both event loops."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from offloadd.client import AsyncOffloadClient
from offloadd.errors import DaemonUnavailable, JobError, NotReady
from offloadd.shm import SharedKVTensor
from tests.integration.harness import LAYERS, DaemonThread, chain_keys, make_config


@pytest.fixture
def tensors() -> Iterator[list[list[SharedKVTensor]]]:
    made = [
        [SharedKVTensor.create(64, 2048, [layer], prefix="od-test") for layer in LAYERS]
        for _ in range(2)
    ]
    for seed, rank in enumerate(made):
        generator = torch.Generator().manual_seed(seed)
        for kv in rank:
            kv.tensor.copy_(
                torch.randint(0, 256, kv.tensor.shape, generator=generator, dtype=torch.uint8)
            )
    yield made
    for rank in made:
        for kv in rank:
            kv.close()


@pytest.mark.asyncio
async def test_async_round_trip(daemon: DaemonThread, tensors: list[list[SharedKVTensor]]) -> None:
    clients = []
    try:
        for rank, kvs in enumerate(tensors):
            config = make_config(rank=rank, tp=2, bytes_per_block=2048 * len(LAYERS))
            if rank == 0:
                first = await AsyncOffloadClient.connect(
                    daemon.endpoint, config, [kv.region for kv in kvs]
                )
                clients.append(first)
                with pytest.raises(NotReady):
                    await first.lookup(chain_keys(1))
            else:
                clients.append(
                    await AsyncOffloadClient.connect(
                        daemon.endpoint, config, [kv.region for kv in kvs]
                    )
                )
        for client in clients:
            state = await client.wait_ready(5)
            assert state.ranks_present == [0, 1]
        keys = chain_keys(8)
        for client in clients:
            await client.store(1, keys, list(range(16)))
        for client in clients:
            (done,) = await client.wait([1], 10)
            assert done.ok and done.nbytes == 16 * 2048 * len(LAYERS)
        lookup = await clients[0].lookup(keys, pin=True, lease=30)
        assert (lookup.hits, lookup.pinned) == (8, 8)
        assert await clients[0].release(keys) == 8
        for client in clients:
            await client.load(2, keys, list(range(32, 48)))
            await client.wait([2], 10)
        for kvs in tensors:
            for kv in kvs:
                assert torch.equal(kv.pages(range(32, 48)), kv.pages(range(16)))
        # A load of keys that are not cached fails the job and lists them.
        missing = chain_keys(2, salt=b"missing")
        await clients[1].load(3, missing, [50, 51, 52, 53])
        with pytest.raises(JobError) as failed:
            await clients[1].wait([3], 10)
        assert failed.value.results[0].failed_keys == missing
        assert (await clients[0].stats()).sessions == 2
    finally:
        for client in clients:
            await client.close()
            await client.close()  # idempotent


@pytest.mark.asyncio
async def test_async_client_reports_missing_daemon() -> None:
    client = AsyncOffloadClient("ipc:///tmp/od-nobody-here.sock", timeout=0.3)
    try:
        with pytest.raises(DaemonUnavailable):
            await client.stats()
    finally:
        await client.close()

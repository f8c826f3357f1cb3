"""``offloadd cache ls`` and ``offloadd cache clear`` against a real daemon with two engines:
the listing, each kind of clear, the KV events it publishes, and engines that keep working
(misses, never errors). A group member being refused is in test_trust.py (it needs a second
Unix user)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from offloadd.cli import main
from offloadd.subscriber import Received, Subscriber
from protocol.events import AllBlocksCleared, BlockRemoved, BlockStored, hash_for_wire
from tests.integration.harness import DaemonThread, Rank, chain_keys, chunk_block_ids, make_rank

BPC = 2
CHUNK = BPC * 4096 * 3  # blocks per chunk * page * layers, one rank


def _engine(endpoint: str, ranks: list[Rank], engine_id: str, dp: int, model: str) -> Rank:
    rank = make_rank(endpoint, tp=1, engine_id=engine_id, dp=dp, model=model, events=True)
    ranks.append(rank)
    rank.fill(dp)
    assert rank.client is not None
    rank.client.wait_ready(5)
    return rank


def _store(rank: Rank, keys: list[bytes], job: int) -> None:
    assert rank.client is not None
    rank.client.store(job, keys, chunk_block_ids(range(len(keys)), BPC))
    rank.client.wait([job], 10)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _ls(capsys: pytest.CaptureFixture[str], endpoint: str) -> dict[str, Any]:
    status, out, err = _cli(capsys, "cache", "ls", "--json", "--endpoint", endpoint)
    assert status == 0, err
    listing: dict[str, Any] = json.loads(out)
    return listing


@pytest.mark.asyncio
async def test_cache_ls_and_clear_with_two_engines(
    daemon: DaemonThread, ranks: list[Rank], capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = daemon.endpoint
    received: list[Received] = []
    subscriber = Subscriber(daemon.events_endpoint, daemon.replay_endpoint)
    subscriber.connect()

    async def pump() -> None:
        async for batch in subscriber:
            received.append(batch)

    def events(dp: int, kind: type) -> list[Any]:
        return [
            event
            for batch in received
            if batch.batch.data_parallel_rank == dp
            for event in batch.batch.events
            if isinstance(event, kind)
        ]

    async def until(condition: Any) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, "events did not arrive"
            await asyncio.sleep(0.01)

    task = asyncio.create_task(pump())
    try:
        # Two engines of two models: two namespaces.
        a = await asyncio.to_thread(_engine, endpoint, ranks, "engine-a", 0, "test/model-a")
        b = await asyncio.to_thread(_engine, endpoint, ranks, "engine-b", 1, "test/model-b")
        keys_a, keys_b = chain_keys(4, b"a"), chain_keys(3, b"b")
        await asyncio.to_thread(_store, a, keys_a, 1)
        await asyncio.to_thread(_store, b, keys_b, 1)
        assert a.client is not None and b.client is not None
        assert a.client.lookup([*keys_a, *chain_keys(2, b"x")]).hits == 4  # 4 hits, 2 misses
        assert b.client.lookup(keys_b).hits == 3
        await until(lambda: len(events(0, BlockStored)) == 4 and len(events(1, BlockStored)) == 3)

        listing = await asyncio.to_thread(_ls, capsys, endpoint)
        engines = {e["engine_id"]: e for e in listing["engines"]}
        assert set(engines) == {"engine-a", "engine-b"}
        assert engines["engine-a"]["hits"] == 4 and engines["engine-a"]["misses"] == 2
        assert engines["engine-b"]["hits"] == 3 and engines["engine-b"]["connected"]
        namespaces = {n["name"]: n for n in listing["namespaces"]}
        ns_a, ns_b = engines["engine-a"]["namespace"], engines["engine-b"]["namespace"]
        assert ns_a != ns_b and set(namespaces) == {ns_a, ns_b}
        assert namespaces[ns_a]["chunks"] == 4 and namespaces[ns_a]["nbytes"] == 4 * CHUNK
        assert namespaces[ns_b]["chunks"] == 3 and namespaces[ns_b]["engines"] == ["engine-b/1"]
        assert namespaces[ns_a]["hits"] == 4 and namespaces[ns_a]["tenant"] == "u0"
        assert time.time() - 60 < namespaces[ns_a]["last_use"] <= time.time()

        status, out, _ = await asyncio.to_thread(
            _cli, capsys, "cache", "ls", "--endpoint", endpoint
        )
        assert status == 0
        head = out.splitlines()[0].split()
        assert head[:4] == ["NAMESPACE", "TENANT", "CHUNKS", "BYTES"]
        assert any(line.startswith(ns_a) and " 4 " in line for line in out.splitlines())

        # An unknown engine: refused, nothing dropped.
        status, _, err = await asyncio.to_thread(
            _cli, capsys, "cache", "clear", "--engine", "nobody", "--endpoint", endpoint
        )
        assert status == 1 and "no engine 'nobody'" in err

        # engine-a's chunks: its namespace goes, b's stays; a hears each removal, b nothing.
        status, out, err = await asyncio.to_thread(
            _cli, capsys, "cache", "clear", "--engine", "engine-a", "--endpoint", endpoint
        )
        assert status == 0, err
        assert "dropped 4 chunks" in out
        await until(lambda: events(0, BlockRemoved))
        removed = [h for e in events(0, BlockRemoved) for h in e.block_hashes]
        assert removed == [hash_for_wire(key[:-4]) for key in keys_a]
        assert not events(0, AllBlocksCleared) and not events(1, BlockRemoved)
        # Engines see misses, never errors, and store again.
        assert a.client.lookup(keys_a).hits == 0
        assert b.client.lookup(keys_b).hits == 3
        await asyncio.to_thread(_store, a, keys_a[:2], 2)
        assert a.client.lookup(keys_a).hits == 2

        # By namespace, then everything.
        status, out, _ = await asyncio.to_thread(
            _cli, capsys, "cache", "clear", "--namespace", ns_b, "--endpoint", endpoint
        )
        assert status == 0 and "dropped 3 chunks" in out
        await until(lambda: len(events(1, BlockRemoved)) == 1)
        status, out, _ = await asyncio.to_thread(
            _cli, capsys, "cache", "clear", "--all", "--endpoint", endpoint
        )
        assert status == 0 and "dropped 2 chunks" in out
        assert a.client.lookup(keys_a).hits == 0 and b.client.lookup(keys_b).hits == 0
        listing = await asyncio.to_thread(_ls, capsys, endpoint)
        assert all(n["chunks"] == 0 and n["nbytes"] == 0 for n in listing["namespaces"])
        assert daemon.daemon is not None
        assert daemon.daemon.stats().protocol_errors == 1  # the unknown engine's, no engine's
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        subscriber.close()

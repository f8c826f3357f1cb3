"""Test doubles shared by the unit and integration tests: a copy engine the test drives, a clock
it sets, event publishers and a tier that record what they are handed, imported handles and a
handle table that count references (with a move list to submit)."""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from offloadd.cache.arena import Arena
from offloadd.tiers.base import ChunkAddress, Tier, TierStats, TierWrite
from offloadd.transfer.engine import CpuCopyEngine
from offloadd.transfer.types import Direction, Triple
from protocol.events import KVEventBatch

__all__ = [
    "MOVES",
    "Clock",
    "DictTier",
    "FakeCopyEngine",
    "FakeHandles",
    "FakeImport",
    "FakePublishers",
]

MOVES: list[Triple] = [(0, 4096, 64)]  # one move for a job the copy engine is handed


@dataclass(eq=False)
class FakeImport:
    """An imported handle: its device and its reference count."""

    device: int = -1
    refs: int = 1


class FakeHandles:
    """A handle table that counts the references ``Jobs`` takes and lets go of."""

    def retain(self, imported: FakeImport) -> None:
        imported.refs += 1

    def release(self, imported: FakeImport) -> None:
        imported.refs -= 1


class Clock:
    """A monotonic clock that moves only when the test sets ``now``."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeCopyEngine:
    """A ``CopyEngine`` the test drives; by default it copies with a real ``CpuCopyEngine``.

    - While ``refuse`` is set, ``submit`` raises ``refusal`` (by default what the cuda engine
      raises without a device index), as an engine that cannot start a job does.
    - Copies of the directions in ``held`` (both by default) start on a thread of their own
      and wait while ``gate`` is clear (it starts set), to catch jobs mid-flight; ``started``
      is released as each reaches the gate. Other directions copy at once.
    - With ``manual``, nothing is copied: each ``submit`` appends a future to ``futures`` for
      the test to resolve, and what it was handed to ``handed`` (direction, moves, event;
      ``moves`` keeps each as it came, to copy it with ``inner``).
    """

    def __init__(
        self,
        *,
        name: str = "fake-cpu",
        manual: bool = False,
        held: Collection[Direction] = (Direction.STORE, Direction.LOAD),
        refusal: Exception | None = None,
    ) -> None:
        self.name = name
        self.manual = manual
        self.held = frozenset(held)
        self.refusal = refusal or ValueError(
            "the cuda engine needs the local device index of the rank's memory"
        )
        self.inner = CpuCopyEngine()
        self.refuse = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Semaphore(0)
        self.futures: list[Future[float]] = []
        self.handed: list[tuple[Direction, list[Triple], bytes | None]] = []
        self.moves: list[Sequence[Triple]] = []  # each as handed over (a rank's windows kept)

    def submit(
        self,
        direction: Direction,
        moves: Sequence[Triple],
        *,
        device: int = -1,
        wait_event: bytes | None = None,
    ) -> Future[float]:
        """Refuse, hand the test a future, hold the copy at the gate, or copy at once."""
        if self.refuse.is_set():
            raise self.refusal
        if self.manual:
            future: Future[float] = Future()
            self.futures.append(future)
            self.handed.append((direction, list(moves), wait_event))
            self.moves.append(moves)
            return future
        if direction not in self.held:
            return self.inner.submit(direction, moves)
        result: Future[float] = Future()

        def wait_then_copy() -> None:
            self.started.release()
            self.gate.wait(30)
            inner = self.inner.submit(direction, moves)
            try:
                result.set_result(inner.result())
            except BaseException as exc:
                result.set_exception(exc)

        threading.Thread(target=wait_then_copy, daemon=True).start()
        return result

    def close(self) -> None:
        """Open the gate, then drain the real engine."""
        self.gate.set()
        self.inner.close()


@dataclass
class FakePublishers:
    """Event publishers that keep every batch, with its topic and data-parallel rank."""

    batches: list[tuple[str, int, KVEventBatch]] = field(default_factory=list)

    def publish(self, topic: str, dp: int, batch: KVEventBatch) -> bool:
        self.batches.append((topic, dp, batch))
        return True

    def endpoints_for(self, dp: int) -> tuple[str, str]:
        return f"tcp://127.0.0.1:{5557 + dp}", f"tcp://127.0.0.1:{5558 + dp}"

    def heard(self) -> dict[str, list[str]]:
        """Event type names per topic, in order."""
        heard: dict[str, list[str]] = {}
        for topic, _dp, batch in self.batches:
            heard.setdefault(topic, []).extend(type(event).__name__ for event in batch.events)
        return heard


class DictTier(Tier):
    """A tier in a dict: chunks copied out of the arena on put and back on get.

    ``stats`` counts ``chunk_bytes`` per chunk held (two shards of 256 bytes, as
    ``tests.helpers.config`` lays them out).
    """

    chunk_bytes = 512

    def __init__(self, name: str = "disk") -> None:
        self.name = name
        self.chunks: dict[tuple[str, bytes], list[bytes]] = {}
        self.corrupt: set[bytes] = set()  # keys whose get fails verification
        self.gate = threading.Event()  # put and contains wait for it
        self.gate.set()
        self.puts: list[list[bytes]] = []
        self.gets: list[list[bytes]] = []
        self.cleared: list[str] = []
        self.closed = False

    def put(self, chunks: Sequence[ChunkAddress], arena: Arena) -> TierWrite:
        self.gate.wait(10)
        self.puts.append([c.key for c in chunks])
        for chunk in chunks:
            shards = [bytes(arena.view(offset, size)) for offset, size in chunk.extents]
            self.chunks[(chunk.namespace, chunk.key)] = shards
        return TierWrite([True] * len(chunks))

    def get(self, chunks: Sequence[ChunkAddress], arena: Arena) -> list[bool]:
        self.gets.append([c.key for c in chunks])
        verified = []
        for chunk in chunks:
            shards = self.chunks.get((chunk.namespace, chunk.key))
            sizes = [size for _, size in chunk.extents]
            if shards is None or [len(s) for s in shards] != sizes:
                verified.append(False)
                continue
            for (offset, size), shard in zip(chunk.extents, shards, strict=True):
                data = b"\xff" * size if chunk.key in self.corrupt else shard
                arena.view(offset, size)[:] = data
            verified.append(chunk.key not in self.corrupt)
        return verified

    def contains(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        self.gate.wait(10)
        return [(namespace, key) in self.chunks for key in keys]

    def remove(self, namespace: str, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.chunks.pop((namespace, key), None)

    def clear(self, namespace: str) -> None:
        self.cleared.append(namespace)
        for name, key in list(self.chunks):
            if name == namespace:
                del self.chunks[(name, key)]

    def stats(self) -> TierStats:
        return TierStats(self.name, 1 << 30, len(self.chunks) * self.chunk_bytes, len(self.chunks))

    def close(self) -> None:
        self.closed = True

"""Removed chunks that a scheduler's key mirror may still show: kept until acknowledged.

A scheduler that mirrors its namespace's committed keys (vLLM's manager answers ``lookup``
from that mirror) learns of a removal only when its ``KeysChanged`` arrives. Until then it may
report the key as a hit and hold it for a load, so the removed entry's bytes must stay where
they are. Contract of ``Watchers``:

- ``watch(namespace, watcher)``: ``watcher`` mirrors ``namespace`` from the current sequence
  number on (it is sent a snapshot that no longer lists earlier removals).
- ``leave(entry)``: a committed entry of a watched namespace was removed; it gets the next
  sequence number and waits. Returns False when nobody watches (the entry may go at once).
- ``ack(watcher, seq)``: the watcher applied every change up to ``seq``; returns the waiting
  entries every watcher of their namespace has now acknowledged.
- ``find(namespace, key)``: the newest waiting entry for ``key`` (to hold it for a load).
- ``unwatch(watcher)``: the watcher is gone; returns the entries nobody waits for any more.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offloadd.cache.index import Entry

__all__ = ["Watchers"]


class Watchers:
    """Acknowledgements of mirroring schedulers; see the module docstring."""

    def __init__(self) -> None:
        self.seq = 0
        self._acked: dict[str, dict[str, int]] = {}  # namespace -> watcher -> acked seq
        self._namespace_of: dict[str, str] = {}
        self._waiting: dict[str, deque[Entry]] = {}  # namespace -> entries in seq order
        self._by_key: dict[str, dict[bytes, Entry]] = {}

    def watched(self, namespace: str) -> bool:
        """Whether any scheduler mirrors ``namespace``."""
        return namespace in self._acked

    def only(self, namespace: str, watcher: str | None) -> bool:
        """Whether nobody but ``watcher`` (None: nobody) mirrors ``namespace``."""
        acked = self._acked.get(namespace)
        return acked is None or (watcher is not None and acked.keys() == {watcher})

    def watch(self, namespace: str, watcher: str) -> None:
        """Start acknowledging ``namespace`` for ``watcher`` (one namespace per watcher)."""
        self.unwatch(watcher)
        self._acked.setdefault(namespace, {})[watcher] = self.seq
        self._namespace_of[watcher] = namespace

    def unwatch(self, watcher: str) -> list[Entry]:
        """Forget ``watcher``; the entries that no longer wait for anyone."""
        namespace = self._namespace_of.pop(watcher, None)
        if namespace is None:
            return []
        acked = self._acked[namespace]
        del acked[watcher]
        if not acked:
            del self._acked[namespace]
        return self._release(namespace)

    def leave(self, entry: Entry) -> bool:
        """Make a removed committed ``entry`` wait for acknowledgement, if watched."""
        if entry.namespace not in self._acked:
            return False
        self.seq += 1
        entry.leave_seq = self.seq
        self._waiting.setdefault(entry.namespace, deque()).append(entry)
        self._by_key.setdefault(entry.namespace, {})[entry.key] = entry
        return True

    def ack(self, watcher: str, seq: int) -> list[Entry]:
        """Record ``watcher``'s acknowledgement; the entries that stop waiting."""
        namespace = self._namespace_of.get(watcher)
        if namespace is None:
            return []
        acked = self._acked[namespace]
        acked[watcher] = max(acked[watcher], min(seq, self.seq))
        return self._release(namespace)

    def find(self, namespace: str, key: bytes) -> Entry | None:
        """The newest entry of ``key`` waiting for acknowledgement, if any."""
        return self._by_key.get(namespace, {}).get(key)

    def waiting(self) -> int:
        """Entries waiting for acknowledgement."""
        return sum(len(entries) for entries in self._waiting.values())

    def _release(self, namespace: str) -> list[Entry]:
        waiting = self._waiting.get(namespace)
        if not waiting:
            return []
        acked = self._acked.get(namespace)
        floor = min(acked.values()) if acked else self.seq
        released: list[Entry] = []
        while waiting and waiting[0].leave_seq <= floor:
            entry = waiting.popleft()
            entry.leave_seq = 0
            by_key = self._by_key[namespace]
            if by_key.get(entry.key) is entry:
                del by_key[entry.key]
            released.append(entry)
        if not waiting:
            del self._waiting[namespace]
            del self._by_key[namespace]
        return released

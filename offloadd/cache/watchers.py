"""Removed chunks that a scheduler's key mirror may still show: kept until acknowledged.

A scheduler that mirrors its namespace's committed keys (vLLM's manager answers ``lookup``
from that mirror) learns of a removal only when its ``KeysChanged`` arrives. Until then it may
report the key as a hit and hold it for a load, so the removed entry's bytes must stay where
they are. Entries are the cache's row numbers. Contract of ``Watchers``:

- ``watch(namespace, watcher)``: ``watcher`` mirrors ``namespace`` from the current sequence
  number on (it is sent a snapshot that no longer lists earlier removals).
- ``leave(namespace, key, row)``: the committed entry ``row`` of a watched namespace was
  removed; it gets the next sequence number and waits. Returns False when nobody watches (the
  entry may go at once). The row must stay the entry's until it is released.
- ``ack(watcher, seq)``: the watcher applied every change up to ``seq``; returns the waiting
  rows every watcher of their namespace has now acknowledged.
- ``find(namespace, key)``: the newest waiting row for ``key`` (to hold it for a load).
- ``unwatch(watcher)``: the watcher is gone; returns the rows nobody waits for any more.
- ``acked(watcher)``: the sequence number it acknowledged last (None: it watches nothing).
"""

from __future__ import annotations

from collections import deque

__all__ = ["Watchers"]


class Watchers:
    """Acknowledgements of mirroring schedulers; see the module docstring."""

    def __init__(self) -> None:
        self.seq = 0
        self._acked: dict[str, dict[str, int]] = {}  # namespace -> watcher -> acked seq
        self._namespace_of: dict[str, str] = {}
        # namespace -> (seq, key, row) in seq order; key -> newest waiting row
        self._waiting: dict[str, deque[tuple[int, bytes, int]]] = {}
        self._by_key: dict[str, dict[bytes, int]] = {}

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

    def unwatch(self, watcher: str) -> list[int]:
        """Forget ``watcher``; the rows that no longer wait for anyone."""
        namespace = self._namespace_of.pop(watcher, None)
        if namespace is None:
            return []
        acked = self._acked[namespace]
        del acked[watcher]
        if not acked:
            del self._acked[namespace]
        return self._release(namespace)

    def leave(self, namespace: str, key: bytes, row: int) -> bool:
        """Make the removed committed ``row`` wait for acknowledgement, if watched."""
        if namespace not in self._acked:
            return False
        self.seq += 1
        self._waiting.setdefault(namespace, deque()).append((self.seq, key, row))
        self._by_key.setdefault(namespace, {})[key] = row
        return True

    def ack(self, watcher: str, seq: int) -> list[int]:
        """Record ``watcher``'s acknowledgement; the rows that stop waiting."""
        namespace = self._namespace_of.get(watcher)
        if namespace is None:
            return []
        acked = self._acked[namespace]
        acked[watcher] = max(acked[watcher], min(seq, self.seq))
        return self._release(namespace)

    def acked(self, watcher: str) -> int | None:
        """The last sequence number ``watcher`` acknowledged; None when it watches nothing."""
        namespace = self._namespace_of.get(watcher)
        return None if namespace is None else self._acked[namespace][watcher]

    def find(self, namespace: str, key: bytes) -> int | None:
        """The newest row of ``key`` waiting for acknowledgement, if any."""
        return self._by_key.get(namespace, {}).get(key)

    def waiting(self) -> int:
        """Rows waiting for acknowledgement."""
        return sum(len(rows) for rows in self._waiting.values())

    def _release(self, namespace: str) -> list[int]:
        waiting = self._waiting.get(namespace)
        if not waiting:
            return []
        acked = self._acked.get(namespace)
        floor = min(acked.values()) if acked else self.seq
        released: list[int] = []
        by_key = self._by_key[namespace]
        while waiting and waiting[0][0] <= floor:
            _seq, key, row = waiting.popleft()
            if by_key.get(key) == row:
                del by_key[key]
            released.append(row)
        if not waiting:
            del self._waiting[namespace]
            del self._by_key[namespace]
        return released

"""The scheduler's copy of its namespace's committed keys, fed by the daemon's KeysChanged.

Pure logic (no vLLM, no sockets): ``apply`` takes the notices in the order they arrived and
keeps ``keys`` exact; a ``reset`` snapshot (after a (re)connect) replaces the set, and only the
difference is reported as events. ``seq`` is what the scheduler acknowledges: the daemon
keeps a removed key's bytes until then, so a key in ``keys`` is always loadable once held.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.messages import KeysChanged

__all__ = ["KeyMirror"]


class KeyMirror:
    """Committed keys of one namespace, with the stored/removed changes not yet taken."""

    def __init__(self, *, record_events: bool) -> None:
        self.keys: set[bytes] = set()
        self.seq = 0
        self._record = record_events
        self._events: list[tuple[bool, list[bytes]]] = []  # (removed, keys) runs in order
        self._snapshot: dict[bytes, None] | None = None  # a reset snapshot, in arrival order

    def apply(self, notices: Iterable[KeysChanged]) -> None:
        """Apply notices in arrival order."""
        for notice in notices:
            # A snapshot starts a session (perhaps of a restarted daemon): its seq restarts too.
            self.seq = notice.seq if notice.reset else max(self.seq, notice.seq)
            if notice.reset:
                self._snapshot = {}
            if self._snapshot is not None:
                self._snapshot.update(dict.fromkeys(notice.stored))
                for key in notice.removed:
                    self._snapshot.pop(key, None)
                if not notice.more:
                    self._replace(self._snapshot)
                    self._snapshot = None
                continue
            for key in notice.stored:
                if key not in self.keys:
                    self.keys.add(key)
                    self._event(False, key)
            for key in notice.removed:
                if key in self.keys:
                    self.keys.discard(key)
                    self._event(True, key)

    def clear(self) -> None:
        """Forget every key (the daemon is gone): each one is reported removed."""
        self._replace({})
        self._snapshot = None

    @property
    def has_events(self) -> bool:
        """Whether changes wait to be taken."""
        return bool(self._events)

    def take_events(self) -> list[tuple[bool, list[bytes]]]:
        """Changes since the last call as ``(removed, keys)`` runs, in the order they
        happened (a key removed and stored again shows in both, in that order)."""
        events, self._events = self._events, []
        return events

    def _replace(self, keys: dict[bytes, None]) -> None:
        for key in self.keys.difference(keys):
            self._event(True, key)
        for key in keys:
            if key not in self.keys:
                self._event(False, key)
        self.keys = set(keys)

    def _event(self, removed: bool, key: bytes) -> None:
        if not self._record:
            return
        if self._events and self._events[-1][0] == removed:
            self._events[-1][1].append(key)
        else:
            self._events.append((removed, [key]))

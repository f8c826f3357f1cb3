"""The scheduler's copy of its namespace's committed keys, fed by the daemon's KeysChanged.

Pure logic (no vLLM, no sockets): ``apply`` takes the notices in the order they arrived and
keeps ``keys`` exact; a ``reset`` snapshot (after a (re)connect) replaces the set, and only the
difference is reported as events. ``seq`` is how far the notices are applied.

``ackable`` is what the scheduler may acknowledge: the daemon keeps a removed key's bytes
until every mirror acknowledged its removal, so a key the mirror answered as a hit stays
loadable while its removal is not acknowledged. Keys being loaded (``loading``, from vLLM's
``prepare_load`` to its ``complete_load``) hold the acknowledgement back: a notice that
removes one is a barrier, and ``ackable`` stays below it (at the seq the mirror had before
that notice: its removals all come after) until those loads end. Whatever happens to the
load's hold (refused for room, late behind the rank's load, lost with a step that could not
be sent), the rank's load by key finds the bytes.
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
        self._loading: dict[bytes, int] = {}  # keys of loads not complete yet, counted
        self._loads: dict[str, list[bytes]] = {}  # request -> the keys it is loading
        # (the seq before a notice that removed loading keys, those keys still loading)
        self._barriers: list[tuple[int, set[bytes]]] = []

    @property
    def ackable(self) -> int:
        """The highest seq the scheduler may acknowledge: ``seq``, or below the first notice
        that removed a key still being loaded."""
        return self._barriers[0][0] if self._barriers else self.seq

    def start_loading(self, token: str, keys: Iterable[bytes]) -> None:
        """Request ``token`` was promised a load of ``keys`` (vLLM's ``prepare_load``)."""
        keys = list(keys)
        self._loads.setdefault(token, []).extend(keys)
        loading = self._loading
        for key in keys:
            loading[key] = loading.get(key, 0) + 1

    def loads(self) -> dict[str, list[bytes]]:
        """Every load not complete yet: request -> keys (what a new session holds again)."""
        return {token: list(keys) for token, keys in self._loads.items()}

    def forget_loads(self) -> dict[str, list[bytes]]:
        """vLLM's cache reset flushed every load in flight without completing it: none
        holds the acknowledgement back any more. Returns what they were loading."""
        loads, self._loads = self._loads, {}
        self._loading = {}
        self._barriers = []
        return loads

    def finish_loading(self, token: str, keys: Iterable[bytes]) -> None:
        """That load ended (``complete_load``): its keys' removals may be acknowledged."""
        keys = list(keys)
        mine = self._loads.get(token)
        if mine == keys:  # the request's one load (the usual case): no search
            del self._loads[token]
        elif mine is not None:
            for key in keys:
                if key in mine:
                    mine.remove(key)
            if not mine:
                del self._loads[token]
        loading = self._loading
        done: list[bytes] = []
        for key in keys:
            count = loading.get(key, 0)
            if count > 1:
                loading[key] = count - 1
            elif count:
                del loading[key]
                done.append(key)
        if done and self._barriers:
            for _seq, keys_left in self._barriers:
                keys_left.difference_update(done)
            self._barriers = [barrier for barrier in self._barriers if barrier[1]]

    def apply(self, notices: Iterable[KeysChanged]) -> None:
        """Apply notices in arrival order."""
        for notice in notices:
            if notice.removed and self._loading and not notice.reset:
                held_back = {key for key in notice.removed if key in self._loading}
                if held_back:
                    self._barriers.append((self.seq, held_back))
            # A snapshot starts a session (perhaps of a restarted daemon): its seq restarts too.
            self.seq = notice.seq if notice.reset else max(self.seq, notice.seq)
            if notice.reset:
                self._barriers = []  # the new session acknowledges from its own seq
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

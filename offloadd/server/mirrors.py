"""Key mirrors of schedulers: each mirroring scheduler hears every change of its namespace.

vLLM's offloading manager answers ``lookup`` once per key inside ``schedule()``; a round trip
per key would cost more than the step. So a scheduler that says ``Hello(mirror=True)`` keeps a
copy of its namespace's committed keys: the daemon sends it a snapshot (``KeysChanged`` with
``reset``) when its engine is ready, then every commit and removal, in order, on its own
socket. Removed entries keep their bytes until every mirror acknowledged the removal (the
cache's ``watch``/``ack``), so a key a mirror still shows can be held and loaded.

Contract of ``Mirrors`` (called by the daemon on its loop, no I/O of its own but ``send``):
- ``start(session)``: the session's engine is ready: watch its namespace, send the snapshot.
- ``stop(session)``: the session left or its engine stopped being ready: unwatch (the removals
  it owed an acknowledgement for stop waiting for it).
- ``changed(namespace, stored, removed)``: tell every mirror of ``namespace``; call it right
  after the cache change, before anything else is sent, so that order and ``seq`` agree.
- ``overdue(ticks)``: called once per tick of the daemon's reaper; the mirrors that still owe
  the acknowledgement of a removal sent more than ``ticks`` ticks ago. A mirror that never
  acknowledges would keep every removed key's bytes, and so block evictions for every engine
  of its namespace: the daemon ends such a session. Time is counted in ticks, not seconds, so
  a daemon that was stopped (SIGSTOP) or stalled counts the stall as one tick and reads the
  acknowledgements queued meanwhile before it judges anyone.
- ``drain()``: the daemon is stopping: every mirror is sent an empty snapshot (every key
  misses; the daemon takes no holds any more) and unwatched; nothing more is sent or started.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from offloadd.cache.index import ChunkCache
from offloadd.server.registry import Registry, Session
from protocol.messages import KeysChanged, Reply

__all__ = ["Mirrors"]

SNAPSHOT_KEYS_PER_MESSAGE = 1 << 15


class Mirrors:
    """Snapshots and change notices for mirroring schedulers; see the module docstring."""

    def __init__(
        self,
        cache: ChunkCache,
        registry: Registry,
        send: Callable[[str, Reply], None],
    ) -> None:
        self._cache = cache
        self._registry = registry
        self._send = send  # (session_id, message)
        self._watching: dict[str, str] = {}  # session id -> namespace name
        # session id -> (seq, tick) of the removal notices it has not acknowledged yet, one
        # per tick (the newest seq sent in it), oldest first
        self._owed: dict[str, deque[tuple[int, int]]] = {}
        self._tick = 0
        self.draining = False

    def start(self, session: Session) -> None:
        """Watch the session's (ready) namespace and send it a full snapshot."""
        engine = self._registry.engine(session.engine_key)
        if session.role != "scheduler" or not session.mirror or self.draining:
            return
        if engine is None or engine.namespace is None:
            return
        name = engine.namespace.name
        self._cache.watch(name, session.session_id)
        self._watching[session.session_id] = name
        self._owed.pop(session.session_id, None)  # the snapshot lists no earlier removal
        keys = self._cache.keys_in(name)
        seq = self._cache.seq
        step = SNAPSHOT_KEYS_PER_MESSAGE
        for start in range(0, max(len(keys), 1), step):
            part = keys[start : start + step]
            more = start + step < len(keys)
            self._send(session.session_id, KeysChanged(seq, part, [], start == 0, more))

    def stop(self, session_id: str) -> None:
        """Stop watching for ``session_id`` (removed entries stop waiting for it)."""
        self._owed.pop(session_id, None)
        if self._watching.pop(session_id, None) is not None:
            self._cache.unwatch(session_id)

    def stop_engine(self, sessions: Sequence[Session]) -> None:
        """The engine of ``sessions`` stopped being ready: its mirrors go stale, unwatch."""
        for session in sessions:
            self.stop(session.session_id)

    def changed(self, namespace: str, stored: list[bytes], removed: list[bytes]) -> None:
        """Send ``stored`` and ``removed`` keys of ``namespace`` to its mirrors."""
        if not (stored or removed):
            return
        seq = self._cache.seq
        message = KeysChanged(seq, stored, removed)
        for session_id, name in self._watching.items():
            if name == namespace:
                self._send(session_id, message)
                if removed:
                    self._owe(session_id, seq)

    def _owe(self, session_id: str, seq: int) -> None:
        owed = self._owed.setdefault(session_id, deque())
        if owed and owed[-1][1] == self._tick:
            owed[-1] = (seq, self._tick)  # one entry per tick: the newest seq sent in it
        else:
            owed.append((seq, self._tick))

    def overdue(self, ticks: int) -> list[str]:
        """One tick passed: the mirrors owing an acknowledgement sent over ``ticks`` ago."""
        self._tick += 1
        late = []
        for session_id, owed in list(self._owed.items()):
            acked = self._cache.acked(session_id)
            while owed and acked is not None and owed[0][0] <= acked:
                owed.popleft()
            if not owed:
                del self._owed[session_id]
            elif self._tick - owed[0][1] > ticks:
                late.append(session_id)
        return late

    def drain(self) -> None:
        """Tell every mirror that every key misses, unwatch them all, send nothing more."""
        self.draining = True
        for session_id in list(self._watching):
            self._send(session_id, KeysChanged(self._cache.seq, [], [], True, False))
            self.stop(session_id)

    def watching(self, session_id: str) -> bool:
        """Whether ``session_id`` mirrors a namespace now."""
        return session_id in self._watching

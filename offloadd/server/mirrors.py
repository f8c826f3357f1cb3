"""Key mirrors of schedulers: each mirroring scheduler hears every change of its namespace.

vLLM's offloading manager answers ``lookup`` once per key inside ``schedule()``; a round trip
per key would cost more than the step. So a scheduler that says ``Hello(mirror=True)`` keeps a
copy of its namespace's committed keys: the daemon sends it a snapshot (``KeysChanged`` with
``reset``) when its engine is ready, then every commit and removal, in order, on its own
socket. Removed entries keep their bytes until every mirror acknowledged the removal (the
cache's ``watch``/``ack``), so a key a mirror still shows can be held and loaded.

Contract of ``Mirrors`` (called by the daemon on its loop, no I/O of its own but ``send``):
- ``start(session)``: the session's engine is ready: watch its namespace, send the snapshot.
- ``stop(session)``: the session left or its engine stopped being ready: unwatch.
- ``changed(namespace, stored, removed)``: tell every mirror of ``namespace``; call it right
  after the cache change, before anything else is sent, so that order and ``seq`` agree.
"""

from __future__ import annotations

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

    def start(self, session: Session) -> None:
        """Watch the session's (ready) namespace and send it a full snapshot."""
        engine = self._registry.engine(session.engine_key)
        if session.role != "scheduler" or not session.mirror:
            return
        if engine is None or engine.namespace is None:
            return
        name = engine.namespace.name
        self._cache.watch(name, session.session_id)
        self._watching[session.session_id] = name
        keys = self._cache.keys_in(name)
        seq = self._cache.seq
        step = SNAPSHOT_KEYS_PER_MESSAGE
        for start in range(0, max(len(keys), 1), step):
            part = keys[start : start + step]
            more = start + step < len(keys)
            self._send(session.session_id, KeysChanged(seq, part, [], start == 0, more))

    def stop(self, session_id: str) -> None:
        """Stop watching for ``session_id`` (removed entries stop waiting for it)."""
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
        message = KeysChanged(self._cache.seq, stored, removed)
        for session_id, name in self._watching.items():
            if name == namespace:
                self._send(session_id, message)

    def watching(self, session_id: str) -> bool:
        """Whether ``session_id`` mirrors a namespace now."""
        return session_id in self._watching

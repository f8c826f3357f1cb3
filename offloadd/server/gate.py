"""Per-peer request holding while a Hello is handled off the event loop.

The daemon handles every request to completion on its loop, so a peer's requests are
answered in the order they came. A cuda daemon imports a Hello's CUDA IPC handles on a
worker thread instead (each import opens a handle and waits for the producer's event, and
80 regions would stall every other rank); until that Hello is done, the same peer's later
requests must wait, or they would run before the session they belong to exists.

Contract (loop thread only):
- ``close(peer)``: hold this peer's requests from now on.
- ``hold(peer, frames) -> bool``: True when the frames were queued (the peer is closed, or
  still has queued frames); False when they may be handled now.
- ``open(peer)``: stop holding; then ``next(peer)`` gives the queued frames one at a time,
  in arrival order, until it returns None. It returns None at once while the peer is closed
  again (a queued frame was another off-loop Hello), and the rest stays queued for later.
"""

from __future__ import annotations

from collections import deque


class RequestGate:
    """Queues a peer's frames while its Hello is in progress; see the module docstring."""

    def __init__(self) -> None:
        self._queued: dict[bytes, deque[list[bytes]]] = {}
        self._closed: set[bytes] = set()

    def __len__(self) -> int:
        """Peers with requests held or a Hello in progress."""
        return len(self._queued)

    def close(self, peer: bytes) -> None:
        """Hold ``peer``'s requests until ``open``."""
        self._closed.add(peer)
        self._queued.setdefault(peer, deque())

    def hold(self, peer: bytes, frames: list[bytes]) -> bool:
        """Queue ``frames`` if ``peer`` must wait; False if they may be handled now."""
        queued = self._queued.get(peer)
        if queued is None:
            return False
        queued.append(frames)
        return True

    def open(self, peer: bytes) -> None:
        """The Hello is done: ``next`` releases what was held."""
        self._closed.discard(peer)

    def next(self, peer: bytes) -> list[bytes] | None:
        """The next held frames of an open ``peer``, or None (then nothing more is held)."""
        if peer in self._closed:
            return None
        queued = self._queued.get(peer)
        if not queued:
            self._queued.pop(peer, None)
            return None
        return queued.popleft()

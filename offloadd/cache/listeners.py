"""Who hears of the cache's own changes: the entries it evicted, the keys it placed.

The cache is pure: it knows no journal, mirror or event stream. What must follow one of its
own decisions (a tombstone journaled, a removal told to the key mirrors and the engines, a
waiting store started) is a listener's work, done in the order the cache tells it.

Contract of ``CacheListener`` (the daemon's ``Announcer`` and ``WaitingStores`` are ones):
- ``removed(entries)``: a ``begin_store`` or ``reserve`` evicted ``entries`` for room. Heard
  once per such call that evicted anything (its ``evicted``, pending entries too), when the
  cache's state is whole and before the call returns: so before its caller copies a byte
  into their extents or waits for a mirror's acknowledgement. Removals a caller asks for
  (``remove``, ``clear_namespace``) are returned to it instead, never heard here: it knows
  what they mean (a Clear has events of its own; a commit the journal refused was never
  announced).
- ``placed()``: reserved keys that waited *unplaced* got their extents (an acknowledgement,
  or a hold, read or write that ended, made their room).
- Listeners hear in the order they were added (``ChunkCache.listen``). Neither call may
  change the cache (reading it is fine); a listener that must act on it schedules that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from offloadd.cache.records import Entry

__all__ = ["CacheListener", "Listeners"]


class CacheListener(Protocol):
    """Hears the cache's evictions and placements; see the module docstring."""

    def removed(self, entries: Sequence[Entry]) -> None: ...

    def placed(self) -> None: ...


class _Placed:
    """A listener of placements only (``ChunkCache.on_placed``)."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback

    def removed(self, entries: Sequence[Entry]) -> None:
        """Evictions are not its concern."""

    def placed(self) -> None:
        """Call the callback."""
        self._callback()


class Listeners:
    """The cache's listeners, each told in the order it was added."""

    def __init__(self) -> None:
        self._all: list[CacheListener] = []
        self._callback: _Placed | None = None

    def add(self, listener: CacheListener) -> None:
        """``listener`` hears from now on, after those added before it."""
        self._all.append(listener)

    def on_placed(self, callback: Callable[[], None] | None) -> None:
        """``callback()`` hears placements, instead of the last one given (None: none)."""
        if self._callback is not None:
            self._all.remove(self._callback)
        self._callback = None if callback is None else _Placed(callback)
        if self._callback is not None:
            self._all.append(self._callback)

    def removed(self, entries: Sequence[Entry]) -> None:
        """Tell every listener of ``entries`` evicted (nothing when there are none)."""
        if entries:
            for listener in self._all:
                listener.removed(entries)

    def placed(self) -> None:
        """Tell every listener that waiting keys were placed."""
        for listener in self._all:
            listener.placed()

"""Who used which namespace, and when: the hits, misses and last use ``offloadd cache ls`` shows.

Pure logic, no I/O (the clock is injected). Contract of ``Usage`` (the event loop's thread):
- ``looked_up(engine, namespace, hits, misses)``: an engine's lookup found ``hits`` keys and
  missed ``misses``; ``used(engine, namespace)``: it stored or loaded. Both stamp the engine
  and the namespace with ``clock()`` (wall time: an operator reads it as a date).
- What engines and namespaces did is remembered after they leave (their chunks stay), for
  the ``remember`` most recently used of each; older ones are forgotten.
- ``engine_keys(engine_id)``: the engines of that id (any dp index) ever seen, with the
  namespace each used last; ``engines()``: every one remembered;
  ``engine(key)``, ``namespace(name)``: their ``Use`` or None.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["REMEMBERED", "Usage", "Use"]

EngineKey = tuple[str, int]
K = TypeVar("K")
REMEMBERED = 4096


@dataclass(slots=True)
class Use:
    """What one engine or namespace did since the daemon started."""

    namespace: str = ""  # an engine's namespace (the latest it used)
    hits: int = 0
    misses: int = 0
    last_use: float = 0.0
    engines: dict[EngineKey, None] = field(default_factory=dict)  # a namespace's engines


class Usage:
    """Per engine and per namespace use; see the module docstring."""

    def __init__(
        self, *, clock: Callable[[], float] = time.time, remember: int = REMEMBERED
    ) -> None:
        self._clock = clock
        self._remember = remember
        self._engines: dict[EngineKey, Use] = {}
        self._namespaces: dict[str, Use] = {}

    def looked_up(self, engine: EngineKey, namespace: str, hits: int, misses: int) -> None:
        """An engine's lookup in ``namespace`` found ``hits`` keys and missed ``misses``."""
        for use in self._touch(engine, namespace):
            use.hits += hits
            use.misses += misses

    def used(self, engine: EngineKey, namespace: str) -> None:
        """An engine stored or loaded in ``namespace``."""
        self._touch(engine, namespace)

    def engine(self, key: EngineKey) -> Use | None:
        """What engine ``key`` did, if remembered."""
        return self._engines.get(key)

    def namespace(self, name: str) -> Use | None:
        """What the engines of namespace ``name`` did, if remembered."""
        return self._namespaces.get(name)

    def engines(self) -> list[EngineKey]:
        """Every remembered engine."""
        return list(self._engines)

    def engine_keys(self, engine_id: str) -> dict[EngineKey, str]:
        """The remembered engines named ``engine_id``, each with its latest namespace."""
        return {key: use.namespace for key, use in self._engines.items() if key[0] == engine_id}

    def _touch(self, engine: EngineKey, namespace: str) -> tuple[Use, Use]:
        now = self._clock()
        by_engine = _latest(self._engines, engine, self._remember)
        by_namespace = _latest(self._namespaces, namespace, self._remember)
        by_engine.namespace = namespace
        by_engine.last_use = by_namespace.last_use = now
        by_namespace.engines[engine] = None
        return by_engine, by_namespace


def _latest(table: dict[K, Use], key: K, most: int) -> Use:
    """``table[key]`` (made if new) moved to the end, the oldest dropped beyond ``most``."""
    use = table.pop(key, None)
    if use is None:
        use = Use()
        if len(table) >= most:
            del table[next(iter(table))]
    table[key] = use
    return use

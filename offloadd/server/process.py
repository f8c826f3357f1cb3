"""The daemon's own process: ``offloadd serve``'s event loop, and its collector.

``run`` serves a daemon on uvloop (asyncio without it) and returns its exit status. Once the
daemon is built (modules imported, the index replayed from the journal) and before it serves,
the process freezes its heap for the collector (``freeze_startup_heap``; the bench's daemon
process does the same), as vLLM's EngineCore does (``freeze_gc_heap``): otherwise a full
collection walks all of it, 30-80 ms on a 2-core host, inside whichever request crossed the
collector's threshold (a step's Store or Load). A daemon served inside another process
(tests) leaves that process's collector alone.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable

from offloadd.server.daemon import serve
from offloadd.settings import Settings

__all__ = ["freeze_startup_heap", "run"]


def run(
    settings: Settings, *, reload: Callable[[], Settings] | None = None, source: str = ""
) -> int:
    """Blocking entry point for ``offloadd serve`` (uvloop when installed): its exit status.
    ``reload()`` loads the settings again from ``source`` (the ``--config`` file) on SIGHUP."""
    main = serve(settings, ready=freeze_startup_heap, reload=reload, source=source)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but keep serving without
        return asyncio.run(main)
    return uvloop.run(main)


def freeze_startup_heap() -> None:
    """Keep the collector off every object alive now, for good."""
    gc.collect()  # what startup left as garbage is freed, not frozen
    gc.freeze()

"""How ``offloadd serve`` stops: the first SIGTERM or SIGINT drains, a second one forces.

Contract of ``Shutdown`` (the event loop's thread only):
- ``install(loop)``: take SIGTERM and SIGINT through ``loop.add_signal_handler``.
- ``signalled(signum)``: the first sets ``stop`` (the daemon stops taking jobs and drains
  its copies for up to ``server.drain_seconds``); a second, while ``stop`` is set, sets
  ``force`` (the drain is cancelled, nothing waits for copies still running) and records
  the signal; later ones change nothing.
- ``unless_forced(drain, force)``: run ``drain`` until it ends or ``force`` is set (then it
  is cancelled); True when it ended by itself.
- ``exit_status(forced)``: 0 after a drain that ended by itself, else 128 + the number of
  the signal that forced the exit (143 for SIGTERM, 130 for SIGINT), as a shell reports a
  process that a signal ended; 1 when ``force`` was set by a caller, not a signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Coroutine
from typing import Any

__all__ = ["Shutdown", "unless_forced"]

logger = logging.getLogger(__name__)


class Shutdown:
    """The stop and force events a daemon serves under; see the module docstring."""

    def __init__(
        self, stop: asyncio.Event | None = None, force: asyncio.Event | None = None
    ) -> None:
        self.stop = stop or asyncio.Event()
        self.force = force or asyncio.Event()
        self.forced_by: signal.Signals | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Handle SIGTERM and SIGINT on ``loop``."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.signalled, signum)

    def signalled(self, signum: signal.Signals) -> None:
        """One signal arrived: stop, or force the exit when stopping already."""
        if not self.stop.is_set():
            logger.info("%s: stopping (a second signal forces the exit)", signum.name)
            self.stop.set()
        elif not self.force.is_set():
            logger.warning("%s again: exiting without waiting for the drain", signum.name)
            self.forced_by = signum
            self.force.set()

    def exit_status(self, forced: bool) -> int:
        """The exit status of a daemon that stopped; ``forced``: its drain was cut short."""
        if not forced:
            return 0
        return 128 + self.forced_by if self.forced_by is not None else 1


async def unless_forced(drain: Coroutine[Any, Any, None], force: asyncio.Event) -> bool:
    """Run ``drain`` to its end, or cancel it once ``force`` is set; True if it ended."""
    task = asyncio.ensure_future(drain)
    forced = asyncio.ensure_future(force.wait())
    try:
        await asyncio.wait({task, forced}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        forced.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(asyncio.CancelledError):
            await forced
    return not task.cancelled()

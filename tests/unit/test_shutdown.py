"""``offloadd.server.shutdown``: the first signal stops, a second forces; pure, no signals sent."""

from __future__ import annotations

import asyncio
import signal

import pytest

from offloadd.server.shutdown import Shutdown, unless_forced


@pytest.mark.asyncio
async def test_the_first_signal_stops_the_second_forces_and_names_the_exit_status() -> None:
    stopping = Shutdown()
    assert stopping.exit_status(forced=False) == 0
    stopping.signalled(signal.SIGTERM)
    assert stopping.stop.is_set() and not stopping.force.is_set()
    stopping.signalled(signal.SIGINT)
    assert stopping.force.is_set()
    stopping.signalled(signal.SIGTERM)  # later ones change nothing
    assert stopping.exit_status(forced=True) == 128 + signal.SIGINT
    assert Shutdown().exit_status(forced=True) == 1  # forced by a caller, not a signal


@pytest.mark.asyncio
async def test_unless_forced_cancels_the_drain_once_forced() -> None:
    force, cancelled = asyncio.Event(), asyncio.Event()

    async def endless() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    async def quick() -> None:
        return None

    assert await unless_forced(quick(), force) is True
    loop = asyncio.get_running_loop()
    loop.call_soon(force.set)
    assert await asyncio.wait_for(unless_forced(endless(), force), 5) is False
    assert cancelled.is_set()

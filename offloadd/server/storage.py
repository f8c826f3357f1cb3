"""The host side of the cache as the daemon opens it at start: the arena and its journal.

Both report their progress to systemd (``STATUS=`` lines, and more start-up time while they
work), since pre-faulting a large arena or verifying the chunks of a previous run takes
seconds to minutes.

- ``open_arena(settings, notify, cuda=)``: create (or reopen) the arena file (the default
  one in its own 0700 directory, created here), pre-fault it
  and, on a cuda daemon, register it as pinned memory in pieces of ``PIN_PIECE``.
- ``open_journal(settings, arena, cache, notify)``: with ``cache.persist``, replay the
  previous run's journal into ``cache`` (warm restart), compact it so that it names exactly
  what the cache holds, and return it; without, remove any journal left behind (it names
  chunks of an arena that is not kept) and return None.
"""

from __future__ import annotations

import contextlib
import logging
import os

from offloadd.cache.arena import Arena
from offloadd.cache.index import ChunkCache
from offloadd.cache.journal import Journal, discard
from offloadd.server.systemd import Notifier
from offloadd.settings import Settings, default_arena_dir
from offloadd.transfer.pinning import DEFAULT_PIECE as PIN_PIECE

__all__ = ["PIN_PIECE", "open_arena", "open_journal"]

logger = logging.getLogger(__name__)


def open_arena(settings: Settings, notify: Notifier, *, cuda: bool) -> Arena:
    """The arena, pre-faulted (and pinned on a cuda daemon); see the module docstring."""

    def prefault_progress(fraction: float) -> None:
        notify.status(f"pre-faulting the arena: {fraction:.0%}")
        notify.extend_timeout(30)

    def pin_arena(address: int, size: int) -> object:
        from offloadd.transfer.pinning import register_host_memory

        def progress(fraction: float) -> None:
            notify.status(f"registering the arena as pinned memory: {fraction:.0%}")
            notify.extend_timeout(60)

        return register_host_memory(address, size, piece=PIN_PIECE, progress=progress)

    notify.status("preparing the arena")
    if not settings.cache.arena:
        # Checked by Arena like any directory: another user's (pre-created) one is refused.
        with contextlib.suppress(FileExistsError):
            os.mkdir(default_arena_dir(), 0o700)
    return Arena(
        settings.arena_path(),
        settings.cache.capacity,
        progress=prefault_progress,
        unlink_on_close=not settings.cache.persist,
        pin=pin_arena if cuda else None,
    )


def open_journal(
    settings: Settings, arena: Arena, cache: ChunkCache, notify: Notifier
) -> Journal | None:
    """Find the chunks a previous daemon committed in this arena (warm restart)."""
    if not settings.cache.persist:
        with contextlib.suppress(OSError):  # it names chunks of an arena not kept
            discard(settings.journal_path())
        return None

    def progress(fraction: float) -> None:
        notify.status(f"verifying the chunks of the previous run: {fraction:.0%}")
        notify.extend_timeout(30)

    journal, chunks = Journal.open(
        settings.journal_path(),
        arena,
        shm_dirs=settings.server.shm_dirs,
        progress=progress,
    )
    try:
        kept = cache.restore(chunks)  # checksums verified: only their bounds are left to check
        if kept != len(chunks):
            logger.warning("journal: %d damaged chunk records skipped", len(chunks) - kept)
        # Always: the file must name exactly what the cache holds before extents get reused.
        journal.compact(cache.committed_chunks())
    except BaseException:
        journal.close()
        raise
    if kept:
        logger.info("warm start: %d committed chunks from the previous run", kept)
    return journal

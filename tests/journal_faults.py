"""Journal file I/O that fails on cue: a full disk, a torn write, a failing truncate."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable

from offloadd.cache.journal import JournalIO


class FaultyIO(JournalIO):
    """Counts ``write`` calls (1-based) and fails the chosen ones with ENOSPC.

    A failing write first writes ``partial`` bytes of its data, as a write cut short by a
    full disk leaves a torn record behind. ``full()`` (when given) fails every write while it
    returns True; ``fail_truncates`` fails every ``ftruncate`` too.
    """

    def __init__(
        self,
        fail_writes: Iterable[int] = (),
        *,
        partial: int = 7,
        full: Callable[[], bool] | None = None,
        fail_truncates: bool = False,
    ) -> None:
        self.writes = 0
        self.failed = 0
        self.fsyncs = 0
        self.fail_writes = set(fail_writes)
        self.partial = partial
        self.full = full
        self.fail_truncates = fail_truncates

    def write(self, fd: int, data: memoryview) -> int:
        self.writes += 1
        if self.writes in self.fail_writes or (self.full is not None and self.full()):
            self.failed += 1
            torn = min(self.partial, len(data) - 1)
            if torn > 0:
                os.write(fd, data[:torn])
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        self.fsyncs += 1
        os.fsync(fd)

    def truncate(self, fd: int, size: int) -> None:
        if self.fail_truncates:
            raise OSError(errno.EIO, "Input/output error (injected)")
        os.ftruncate(fd, size)

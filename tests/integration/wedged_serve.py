"""``python -m tests.integration.wedged_serve serve ...``: the daemon, with copies that never
end, as behind a device that stopped answering: a drain then lasts its whole grace."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future

from offloadd import cli
from offloadd.transfer.engine import CpuCopyEngine
from offloadd.transfer.types import Direction, Triple

_never = threading.Event()


def _wedged_submit(
    self: CpuCopyEngine,
    direction: Direction,
    moves: Sequence[Triple],
    *,
    device: int = -1,
    wait_event: bytes | None = None,
) -> Future[float]:
    result: Future[float] = Future()
    threading.Thread(target=_never.wait, name="wedged-copy").start()  # non-daemon, as the engine's
    return result


if __name__ == "__main__":
    CpuCopyEngine.submit = _wedged_submit  # type: ignore[method-assign]
    sys.exit(cli.main(sys.argv[1:]))

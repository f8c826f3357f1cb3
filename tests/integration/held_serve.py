"""``python -m tests.integration.held_serve --copies MODE [--gate PATH] serve ...``: the daemon,
with its copies held, for the tests of a drain.

- ``--copies gated --gate PATH``: copies accepted while the file PATH exists wait until it is
  gone (at most a minute), then run: jobs stay in flight across a signal for as long as the
  test keeps PATH, and then finish normally.
- ``--copies wedged``: copies never end, as behind a device that stopped answering: a drain
  then lasts its whole grace (or until a second signal)."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from offloadd import cli
from offloadd.transfer import engine
from offloadd.transfer.engine import CpuCopyEngine
from offloadd.transfer.types import Direction, Triple

GATE_SECONDS = 60.0

Submit = Callable[..., Future[float]]


def _wait_while(path: str) -> None:
    deadline = time.monotonic() + GATE_SECONDS
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def gated(gate: str) -> Submit:
    """``CpuCopyEngine.submit``, with the copy queued behind a wait on ``gate`` when it exists."""
    submit = CpuCopyEngine.submit

    def gated_submit(
        self: CpuCopyEngine,
        direction: Direction,
        moves: Sequence[Triple],
        *,
        device: int = -1,
        wait_event: bytes | None = None,
    ) -> Future[float]:
        if os.path.exists(gate):
            # The engine's one thread per direction runs this first, the copy after it.
            self._pools[direction].submit(_wait_while, gate)
        return submit(self, direction, moves, device=device, wait_event=wait_event)

    return gated_submit


_never = threading.Event()


def wedged_submit(
    self: CpuCopyEngine,
    direction: Direction,
    moves: Sequence[Triple],
    *,
    device: int = -1,
    wait_event: bytes | None = None,
) -> Future[float]:
    """A copy that never ends: its future never resolves, its thread never exits."""
    result: Future[float] = Future()
    threading.Thread(target=_never.wait, name="wedged-copy").start()  # non-daemon, as the engine's
    return result


def main() -> int:
    # No abbreviations: the daemon's own options pass through untouched.
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--copies", choices=("gated", "wedged"), required=True)
    parser.add_argument("--gate")
    args, rest = parser.parse_known_args()
    engine.INLINE_LOAD_BYTES = -1  # held copies: no load is copied at once, past the hold
    if args.copies == "gated":
        if args.gate is None:
            parser.error("--copies gated needs --gate PATH")
        CpuCopyEngine.submit = gated(args.gate)  # type: ignore[method-assign]
    else:
        CpuCopyEngine.submit = wedged_submit  # type: ignore[method-assign]
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m tests.integration.gated_serve --gate PATH serve ...``: the daemon, with copies
that wait while the file PATH exists (at most a minute): jobs it accepted stay in flight
across a signal for as long as the test keeps PATH, and then finish normally."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future

from offloadd import cli
from offloadd.transfer.engine import CpuCopyEngine
from offloadd.transfer.types import Direction, Triple

GATE_SECONDS = 60.0


def _wait_while(path: str) -> None:
    deadline = time.monotonic() + GATE_SECONDS
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gate", required=True)
    args, rest = parser.parse_known_args()
    gate = args.gate
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

    CpuCopyEngine.submit = gated_submit  # type: ignore[method-assign]
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())

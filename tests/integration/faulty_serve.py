"""``python -m tests.integration.faulty_serve [FAULTS] serve ...``: the daemon, with journal
writes failing on cue (see ``tests.journal_faults.FaultyIO``).

FAULTS: ``--fail-writes 3,7`` (1-based write calls that fail with ENOSPC), ``--partial N``
(bytes a failing write leaves behind, a torn record), ``--full-flag PATH`` (every write fails
while PATH exists: a disk that is full for a while), ``--retry-seconds S`` (how long after a
failure the journal waits before it tries a rewrite; default 0, at the next commit).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from offloadd import cli
from offloadd.cache.journal import Journal
from tests.journal_faults import FaultyIO


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-writes", default="")
    parser.add_argument("--partial", type=int, default=7)
    parser.add_argument("--full-flag", default="")
    parser.add_argument("--retry-seconds", type=float, default=0.0)
    args, rest = parser.parse_known_args()
    flag = args.full_flag
    io = FaultyIO(
        [int(n) for n in args.fail_writes.split(",") if n],
        partial=args.partial,
        full=(lambda: os.path.exists(flag)) if flag else None,
    )
    opener = Journal.open

    def open_with_faults(*positional: Any, **options: Any) -> Any:
        options.update(io=io, retry_seconds=args.retry_seconds)
        return opener(*positional, **options)

    Journal.open = open_with_faults  # type: ignore[method-assign]
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())

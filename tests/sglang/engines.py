"""SGLang engines for the tests: each its own process (``tests/sglang/hicache_engine.py``)
with SGLang's own pools and backend factory, run against a daemon's endpoint."""

from __future__ import annotations

import json
import subprocess
import sys

PAGES = 8  # pages of the prefix each engine stores or loads


def engine(
    role: str, endpoint: str, *, allocator: str = "shm", timeout: float = 5.0
) -> dict[str, object]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.sglang.hicache_engine",
            role,
            "--endpoint",
            endpoint,
            "--allocator",
            allocator,
            "--pages",
            str(PAGES),
            "--timeout",
            str(timeout),
        ],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return answer

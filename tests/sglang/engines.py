"""SGLang engines for the tests, each its own process run against a daemon's endpoint:
``engine`` (``tests/sglang/hicache_engine.py``: SGLang's pools and backend factory, the
storage interface called as the controller calls it) and ``tree_engine``
(``tests/sglang/tree_engine.py``: SGLang's own HiCache tree and controller)."""

from __future__ import annotations

import json
import subprocess
import sys

PAGES = 8  # pages of the prefix each engine stores or loads


def engine(
    role: str, endpoint: str, *, allocator: str = "shm", timeout: float = 5.0
) -> dict[str, object]:
    return finish(
        start("tests.sglang.hicache_engine", role, endpoint, timeout, "--allocator", allocator)
    )


def tree_engine(role: str, endpoint: str, *, timeout: float = 5.0) -> dict[str, object]:
    return finish(start("tests.sglang.tree_engine", role, endpoint, timeout))


def start(
    module: str, role: str, endpoint: str, timeout: float, *extra: str
) -> subprocess.Popen[str]:
    """An engine process (``module``) in ``role``; ``finish`` reads its answer."""
    return subprocess.Popen(
        [
            sys.executable, "-m", module, role,
            "--endpoint", endpoint, "--pages", str(PAGES), "--timeout", str(timeout), *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def finish(process: subprocess.Popen[str]) -> dict[str, object]:
    """The JSON line an engine printed last; it must have exited 0."""
    try:
        out, err = process.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    assert process.returncode == 0, err[-3000:]
    answer: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return answer

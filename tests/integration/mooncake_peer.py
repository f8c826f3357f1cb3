"""A peer daemon's share in its own process, for tests that SIGKILL it: opens a node on the
master named by argv (address, metadata), publishes 8 chunks, prints them as one JSON line
(``{"arena": path, "chunks": [[key hex, extents, bytes hex], ...]}``), then waits to be
killed; the test removes the arena file it leaves."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

from tests.integration.test_mooncake_tier import Node


def main() -> None:
    master = SimpleNamespace(address=sys.argv[1], metadata=sys.argv[2])
    node = Node(master)  # type: ignore[arg-type]
    chunks = node.chunks(sys.argv[3], 8)
    assert all(node.tier.put(chunks, node.arena).stored)
    published = [[c.key.hex(), c.extents, node.read(c).hex()] for c in chunks]
    print(json.dumps({"arena": node.arena.path, "chunks": published}), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()

"""One daemon's share of the cluster tier (``Node``: an arena and a tier over it), for the
cluster tier's tests.

Run as a script, a peer daemon's share in its own process, for tests that SIGKILL it: opens a
node on the master named by argv (address, metadata), publishes 8 chunks, prints them as one
JSON line (``{"arena": path, "chunks": [[key hex, extents, bytes hex], ...]}``), then waits to
be killed; the test removes the arena file it leaves."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import uuid
from types import SimpleNamespace

from offloadd.cache.arena import Arena
from offloadd.safety import write_secret
from offloadd.settings import MooncakeSettings
from offloadd.tiers.base import ChunkAddress
from offloadd.tiers.mooncake import MooncakeTier
from tests.mooncake_master import MooncakeMaster

ARENA = 8 << 20
SHARDS = (64 << 10, 100_000, 4096)  # one chunk: three shards of uneven sizes


TENANT = "u1000"  # every namespace's local tenant, named "alice" in the cluster
# One cluster key for every node of a test run (written 0600 where only this user reads it).
KEY_FILE = os.path.join(
    os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"offloadd-test-cluster-{os.getuid()}.key"
)


def cluster_key_file() -> str:
    """The shared cluster key's path, created once (0600, 32 random bytes)."""
    if not os.path.exists(KEY_FILE):
        # Never replaced once there: a node started meanwhile may have read it already.
        with contextlib.suppress(FileExistsError):
            write_secret(KEY_FILE, os.urandom(32))
    return KEY_FILE


def settings(master: MooncakeMaster, **overrides: object) -> MooncakeSettings:
    fields: dict[str, object] = {
        "master": master.address,
        "metadata": master.metadata,
        "segment": 32 << 20,
        "local_buffer": 8 << 20,
        "local_hostname": "127.0.0.1",
        "key_file": cluster_key_file(),
        "tenants": {"alice": ["uid:1000"], "bob": ["uid:1001"]},
    }
    fields.update(overrides)
    return MooncakeSettings(**fields)  # type: ignore[arg-type]


class Node:
    """One daemon's share: an arena and a tier over it."""

    def __init__(self, master: MooncakeMaster, tenant: str | None = TENANT) -> None:
        self.arena = Arena(f"/dev/shm/offloadd-test-mooncake-{uuid.uuid4().hex}", ARENA)
        try:
            self.tier = MooncakeTier(
                settings(master),
                self.arena,
                tenant_of=lambda namespace: tenant,
                backoff=0.5,
                backoff_max=2.0,
            )
        except BaseException:
            self.arena.close()
            raise

    def chunks(self, namespace: str, count: int, base: int = 0) -> list[ChunkAddress]:
        """``count`` chunks laid out from ``base``, filled with random bytes."""
        chunks = []
        offset = base
        for _ in range(count):
            extents = []
            for size in SHARDS:
                self.arena.view(offset, size)[:] = os.urandom(size)
                extents.append((offset, size))
                offset += size
            chunks.append(ChunkAddress(namespace, os.urandom(16), tuple(extents)))
        return chunks

    def read(self, chunk: ChunkAddress) -> bytes:
        return b"".join(bytes(self.arena.view(o, s)) for o, s in chunk.extents)

    def close(self) -> None:
        self.tier.close()
        self.arena.close()


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

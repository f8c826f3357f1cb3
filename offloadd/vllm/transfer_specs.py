"""What the scheduler hands the ranks for one store or load (pickled by vLLM with the step).

The daemon addresses chunks by key, so a spec is the chunk keys in vLLM's order (group-major,
chunk order within a group); the GPU side (``GPULoadStoreSpec``) says which blocks hold them.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import LoadStoreSpec

__all__ = ["OffloaddLoadSpec", "OffloaddStoreSpec"]


class OffloaddStoreSpec(LoadStoreSpec):
    """Keys to store, in vLLM's order; those at the ``skipped`` positions got no room in
    the daemon (the ranks store the others only). The keys stay as vLLM was told, because
    the GPU side's blocks follow them by position; the scheduler fills ``skipped`` at the
    end of its step, before vLLM hands the spec to the ranks, and ``reserve``: its session
    id and the request id of the step's ``Reserve`` (the ranks' Store names it, so that a
    daemon reading the Store first waits for it)."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys
        self.skipped: set[int] = set()
        self.reserve: tuple[str, int] = ("", 0)

    def __repr__(self) -> str:
        return f"OffloaddStoreSpec({len(self.keys)} keys, {len(self.skipped)} skipped)"


class OffloaddLoadSpec(LoadStoreSpec):
    """Keys the scheduler holds until the load completes, under token ``hold``: vLLM's
    request id (a failed load is reported to vLLM for that request)."""

    def __init__(self, keys: list[bytes], hold: str) -> None:
        self.keys = keys
        self.hold = hold

    def __repr__(self) -> str:
        return f"OffloaddLoadSpec({len(self.keys)} keys, hold={self.hold!r})"

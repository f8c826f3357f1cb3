"""What the scheduler hands the ranks for one store or load (pickled by vLLM with the step).

The daemon addresses chunks by key, so a spec is the chunk keys in vLLM's order (group-major,
chunk order within a group); the GPU side (``GPULoadStoreSpec``) says which blocks hold them.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import LoadStoreSpec

__all__ = ["OffloaddLoadSpec", "OffloaddStoreSpec"]


class OffloaddStoreSpec(LoadStoreSpec):
    """Keys the scheduler reserved room for."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys

    def __repr__(self) -> str:
        return f"OffloaddStoreSpec({len(self.keys)} keys)"


class OffloaddLoadSpec(LoadStoreSpec):
    """Keys the scheduler holds for request ``hold`` until the load completes."""

    def __init__(self, keys: list[bytes], hold: str) -> None:
        self.keys = keys
        self.hold = hold

    def __repr__(self) -> str:
        return f"OffloaddLoadSpec({len(self.keys)} keys, hold={self.hold!r})"

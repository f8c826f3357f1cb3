"""Memory-handle descriptors: how a rank names the memory of one KV region on the wire.

A handle is an opaque token the daemon opens once (refcounted per process) to get a base
address; the region then lives at ``offset`` for ``size`` bytes from that base. Never pickle:
every field is a plain int, str or bytes.
"""

from __future__ import annotations

import msgspec


class ShmHandle(msgspec.Struct, frozen=True, tag="shm"):
    """A region inside a shared-memory file (tmpfs or a memfd), for hosts without a GPU.

    The daemon never opens ``path`` (it names the file in logs only): the rank passes the
    file's descriptor over the registration socket (``protocol.peer``) and ``fd`` is its
    position among the descriptors of that registration. ``-1``: no descriptor, refused.
    """

    path: str
    offset: int
    size: int
    fd: int = -1


class CudaIpcHandle(msgspec.Struct, frozen=True, tag="cuda"):
    """A region inside a CUDA allocation exported with torch's ``storage._share_cuda_()``.

    ``device_uuid`` names the GPU (ordinals differ between processes with different
    ``CUDA_VISIBLE_DEVICES``); ``offset`` is the tensor's byte offset inside the storage the
    handle opens, ``size`` the bytes the region spans from there.
    """

    device_uuid: str
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    offset: int
    size: int


MemoryHandle = ShmHandle | CudaIpcHandle


class KVRegion(msgspec.Struct, frozen=True):
    """One KV tensor a rank registers: ``num_blocks`` blocks, ``block_stride`` bytes apart.

    ``page_size`` bytes of each block are moved (the unpadded page); ``block_stride`` is the
    padded distance between blocks (equal to ``page_size`` when there is no padding, the whole
    block row for packed layouts). ``layer_names`` are the layers this region holds, which tie
    it to the KV-cache groups of the config.
    """

    handle: MemoryHandle
    num_blocks: int
    page_size: int
    block_stride: int
    layer_names: tuple[str, ...]

    def required_bytes(self) -> int:
        """Bytes from the region's start that block ``num_blocks - 1`` reaches."""
        if self.num_blocks == 0:
            return 0
        return (self.num_blocks - 1) * self.block_stride + self.page_size


def region_problem(region: KVRegion) -> str | None:
    """Why ``region``'s geometry is unusable, or None when it is consistent."""
    if region.num_blocks < 0:
        return f"num_blocks={region.num_blocks} is negative"
    if region.page_size <= 0:
        return f"page_size={region.page_size} must be positive"
    if region.block_stride < region.page_size:
        return f"block_stride={region.block_stride} is smaller than page_size={region.page_size}"
    handle = region.handle
    if handle.offset < 0 or handle.size < 0:
        return "handle offset and size must not be negative"
    if region.required_bytes() > handle.size:
        return (
            f"{region.num_blocks} blocks of stride {region.block_stride} need "
            f"{region.required_bytes()} bytes but the handle spans {handle.size}"
        )
    return None


def normalize_uuid(uuid: str) -> str:
    """A GPU UUID in one spelling: lower case, without nvidia-smi's ``GPU-`` prefix."""
    text = uuid.strip().lower()
    return text[4:] if text.startswith("gpu-") else text

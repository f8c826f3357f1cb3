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


class CanonicalPage(msgspec.Struct, frozen=True):
    """Where a rank's page of a region goes in the canonical (parallelism-free) page.

    vLLM's ``CanonicalPageMapping`` as sent on the wire: ``page_size`` bytes of canonical page
    per block; each run ``(local_offset, canonical_offset, fragment_size, num_fragments,
    local_stride, canonical_stride)`` puts fragment ``i`` of the rank's page at
    ``local_offset + i * local_stride`` into the canonical page at ``canonical_offset + i *
    canonical_stride``. ``writers`` ranks hold these exact bytes (MLA: every TP rank);
    ``agnostic``: the canonical bytes are the same under any parallel config (vLLM's
    ``parallelism_agnostic``), so engines of other parallel sizes may share them.
    """

    page_size: int
    runs: tuple[tuple[int, int, int, int, int, int], ...]
    writers: int = 1
    agnostic: bool = False


class KVRegion(msgspec.Struct, frozen=True):
    """One KV tensor a rank registers: ``num_blocks`` blocks, ``block_stride`` bytes apart.

    ``page_size`` bytes of each block are moved (the unpadded page); ``block_stride`` is the
    padded distance between blocks (equal to ``page_size`` when there is no padding, the whole
    block row for packed layouts). ``layer_names`` are the layers this region holds, which tie
    it to the KV-cache groups of the config. ``canonical`` is set by an engine in vLLM's
    canonical layout: where this rank's page lies in the canonical page of each block.
    """

    handle: MemoryHandle
    num_blocks: int
    page_size: int
    block_stride: int
    layer_names: tuple[str, ...]
    canonical: CanonicalPage | None = None

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
    canonical = region.canonical
    if canonical is not None:
        problem = _canonical_problem(region.page_size, canonical)
        if problem:
            return problem
    if region.required_bytes() > handle.size:
        return (
            f"{region.num_blocks} blocks of stride {region.block_stride} need "
            f"{region.required_bytes()} bytes but the handle spans {handle.size}"
        )
    return None


def _canonical_problem(page_size: int, canonical: CanonicalPage) -> str | None:
    """Why the runs do not cover the local page exactly once inside the canonical page."""
    if canonical.page_size < page_size or canonical.writers < 1:
        return (
            f"canonical page of {canonical.page_size} bytes for a page of {page_size}, "
            f"{canonical.writers} writers"
        )
    local: list[tuple[int, int]] = []
    for run in canonical.runs:
        lo, co, size, count, lstride, cstride = run
        if size <= 0 or count <= 0 or min(lo, co, lstride, cstride) < 0:
            return f"canonical run {run} is not positive"
        if co + (count - 1) * cstride + size > canonical.page_size:
            return f"canonical run {run} ends past the canonical page of {canonical.page_size}"
        if count > 1 and (lstride < size or cstride < size):
            return f"canonical run {run} overlaps itself"
        local.extend((lo + i * lstride, lo + i * lstride + size) for i in range(count))
    local.sort()
    end = 0
    for start, stop in local:
        if start != end:
            return f"canonical runs do not tile the page of {page_size} bytes at byte {end}"
        end = stop
    if end != page_size:
        return f"canonical runs cover {end} bytes of a page of {page_size}"
    return None


def normalize_uuid(uuid: str) -> str:
    """A GPU UUID in one spelling: lower case, without nvidia-smi's ``GPU-`` prefix."""
    text = uuid.strip().lower()
    return text[4:] if text.startswith("gpu-") else text

"""CUDA IPC of KV tensors, the rank's half: export, never pickled.

Rank side:
- ``export_tensor(tensor)`` turns a CUDA tensor into a ``CudaIpcHandle``: the eight fields
  of torch's ``storage._share_cuda_()`` as plain ints/bytes, the GPU's UUID (ordinals differ
  between processes with different ``CUDA_VISIBLE_DEVICES``), the tensor's byte offset
  inside its storage and the bytes the tensor spans from there.
- ``kv_region_from_tensor(tensor, page_size, layer_names)`` describes a KV tensor whose
  dim 0 is ``num_blocks`` as a ``KVRegion`` (block stride = ``stride(0)`` in bytes).
- The exporting process must keep the tensor alive for as long as the daemon may copy into
  it (a KV cache lives as long as its worker, so this holds by construction).
- Allocations made with ``expandable_segments:True`` (CUDA VMM memory) or by the
  ``cudaMallocAsync`` backend cannot be exported this way; ``check_ipc_capable()`` and
  ``export_tensor`` refuse them with a message that says how to fix the worker's settings.

The daemon side (importing the handles) is ``offloadd.transfer.cuda_import``.

torch is imported inside the functions, so this module imports on machines without CUDA.

Reference counting: every export (``_share_cuda_``) takes a reference in a counter file torch
keeps in ``/dev/shm``, which the importer must release. The daemon releases it when the
import closes, and at once for an export whose storage it maps already
(``CudaIpcOpener.duplicate``, as torch's own rebuild does). That needs a shared ``/dev/shm``
and write access to the file: ``export_tensor`` makes it group-writable (torch creates it
0600), so the rank's primary group must be one the daemon is in; the daemon warns once per
file it cannot write.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from protocol.handles import CudaIpcHandle, KVRegion, normalize_uuid, region_problem

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FIX_ALLOCATOR = (
    "export the KV cache from a worker whose CUDA allocator uses plain cudaMalloc segments: "
    "set PYTORCH_CUDA_ALLOC_CONF (and PYTORCH_ALLOC_CONF) without expandable_segments:True "
    "(or with expandable_segments:False) and without backend:cudaMallocAsync for the "
    "workers, and do not allocate the KV cache under vLLM's sleep mode (CuMemAllocator)"
)

# torch's shareable handle: a version byte, a kind byte, then the payload
# (c10/cuda/CUDACachingAllocator.cpp, shareIpcHandle). Older torch sent the bare 64-byte
# cudaIpcMemHandle_t.
_KIND_CUDA_MALLOC = ord("c")
_KIND_EXPANDABLE = ord("e")
_LEGACY_HANDLE_SIZE = 64


class CudaIpcError(Exception):
    """A tensor cannot be exported, or a handle cannot be imported; the message says why."""


def load_torch() -> Any:
    # Typed as Any: the private sharing APIs have no useful stubs, and importing here keeps
    # this module importable where torch has no CUDA.
    import torch

    return torch


# --- pure helpers --------------------------------------------------------------------------


def allocator_problem(conf: str) -> str | None:
    """Why an allocator config string (``PYTORCH_CUDA_ALLOC_CONF`` syntax) prevents IPC."""
    for item in conf.split(","):
        key, _, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if key == "expandable_segments" and value.lower() in ("true", "1"):
            return "the CUDA allocator uses expandable_segments:True (CUDA VMM memory)"
        if key == "backend" and value == "cudaMallocAsync":
            return "the CUDA allocator uses backend:cudaMallocAsync"
    return None


def handle_kind(handle: bytes) -> str:
    """``"cuda_malloc"``, ``"expandable_segment"`` or ``"unknown"`` for a torch IPC handle."""
    if len(handle) == _LEGACY_HANDLE_SIZE:
        return "cuda_malloc"
    if len(handle) >= 2:
        if handle[1] == _KIND_CUDA_MALLOC and len(handle) == _LEGACY_HANDLE_SIZE + 2:
            return "cuda_malloc"
        if handle[1] == _KIND_EXPANDABLE:
            return "expandable_segment"
    return "unknown"


def span_bytes(shape: Sequence[int], stride: Sequence[int], element_size: int) -> int:
    """Bytes from a strided tensor's first element to the end of its last one.

    For a ``(num_blocks, ...)`` KV tensor whose blocks are padded this is
    ``(num_blocks - 1) * block_stride + row_bytes``: the padding after the last block is not
    part of the tensor, so it is not part of the region either.
    """
    if any(n == 0 for n in shape):
        return 0
    if any(s < 0 for s in stride):
        raise ValueError(f"negative strides {tuple(stride)} are not supported")
    last = sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    return (last + 1) * element_size


# --- rank side -----------------------------------------------------------------------------


def device_uuid(index: int) -> str:
    """The UUID of local device ``index``, as ``DeviceMap`` spells it."""
    return normalize_uuid(str(load_torch().cuda.get_device_properties(index).uuid))


def check_ipc_capable(environ: Mapping[str, str] | None = None) -> None:
    """Raise CudaIpcError when this process's CUDA allocator cannot export IPC handles.

    Looks at the allocator settings torch last parsed (from the environment or from
    ``torch.cuda.memory._set_allocator_settings``, which may have overridden it) and, where
    torch has none to show (or ``environ`` is given), at the environment variables.
    ``export_tensor`` also checks the kind of each handle it gets, which is definitive.
    """
    sources: list[tuple[str, str]] = []
    if environ is None:
        environ = os.environ
        getter = getattr(load_torch()._C, "_accelerator_getAllocatorSettings", None)
        current = str(getter()) if getter is not None else ""
        if current.strip():
            sources.append(("the allocator settings", current))
    if not sources:
        for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            if environ.get(name):
                sources.append((name, environ[name]))
    for where, conf in sources:
        problem = allocator_problem(conf)
        if problem:
            raise CudaIpcError(f"{problem} ({where}: {conf!r}); {FIX_ALLOCATOR}")


def export_tensor(tensor: torch.Tensor) -> CudaIpcHandle:
    """The IPC handle of ``tensor``'s memory (see the module docstring); keep it alive."""
    if not tensor.is_cuda:
        raise CudaIpcError(f"tensor on {tensor.device} is not CUDA memory")
    check_ipc_capable()
    storage: Any = tensor.untyped_storage()
    try:
        shared = storage._share_cuda_()
    except RuntimeError as exc:
        raise CudaIpcError(f"torch cannot share this tensor: {exc}; {FIX_ALLOCATOR}") from exc
    (
        _device,
        handle,
        storage_size,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = shared
    if handle is None:
        raise CudaIpcError("the tensor has no memory to share (empty storage)")
    kind = handle_kind(bytes(handle))
    if kind != "cuda_malloc":
        raise CudaIpcError(f"the tensor lives in a {kind} allocation; {FIX_ALLOCATOR}")
    if ref_counter_handle:
        share_counter(bytes(ref_counter_handle))
    element_size = tensor.element_size()
    offset = int(tensor.storage_offset()) * element_size
    size = span_bytes(tensor.shape, tensor.stride(), element_size)
    if offset + size > storage_size:
        raise CudaIpcError(f"tensor bytes [{offset}, {offset + size}) exceed its storage")
    return CudaIpcHandle(
        device_uuid=device_uuid(tensor.get_device()),
        handle=bytes(handle),
        storage_size=int(storage_size),
        storage_offset=int(storage_offset),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync_required),
        offset=offset,
        size=size,
    )


def kv_region_from_tensor(
    tensor: torch.Tensor, page_size: int, layer_names: Sequence[str]
) -> KVRegion:
    """A ``KVRegion`` for a CUDA tensor of shape ``(num_blocks, ...)``.

    ``page_size`` is the unpadded bytes moved per block; the block stride is
    ``stride(0) * element_size`` (the padded page, or the whole row of a packed layout).
    """
    if tensor.dim() < 1:
        raise ValueError("a KV tensor needs dim 0 = num_blocks")
    region = KVRegion(
        handle=export_tensor(tensor),
        num_blocks=int(tensor.shape[0]),
        page_size=page_size,
        block_stride=int(tensor.stride(0)) * tensor.element_size(),
        layer_names=tuple(layer_names),
    )
    problem = region_problem(region)
    if problem:
        raise ValueError(f"KV tensor of shape {tuple(tensor.shape)}: {problem}")
    return region


def counter_path(ref_counter_handle: bytes) -> str:
    """Where torch's IPC reference counter file (a POSIX shm name) lives."""
    return "/dev/shm/" + ref_counter_handle.decode(errors="replace").lstrip("/")


def share_counter(ref_counter_handle: bytes) -> None:
    """Let the rank's group write torch's counter file (torch creates it 0600), best effort."""
    path = counter_path(ref_counter_handle)
    try:
        os.chmod(path, 0o660)
    except OSError as exc:
        logger.debug("cannot open %s to the rank's group: %s", path, exc)

"""CUDA IPC of KV tensors: export on the rank, import in the daemon, never pickled.

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

Daemon side:
- ``DeviceMap`` maps a GPU UUID to this process's device ordinal.
- ``open_ipc_handle(handle, device_index)`` imports a handle with torch's
  ``UntypedStorage._new_shared_cuda`` on the *local* ordinal (the producer's ordinal means
  nothing here) and returns the region's address and the storage that keeps it mapped:
  dropping the storage closes the import (torch shares one ``cudaIpcOpenMemHandle`` per
  allocation among storages and closes it when the last goes).
- ``CudaIpcOpener`` is the ``HandleTable`` plug-in built on it.

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
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from protocol.handles import CudaIpcHandle, KVRegion, region_problem

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


def _torch() -> Any:
    # Typed as Any: the private sharing APIs have no useful stubs, and importing here keeps
    # this module importable where torch has no CUDA.
    import torch

    return torch


# --- pure helpers --------------------------------------------------------------------------


def normalize_uuid(uuid: str) -> str:
    """A GPU UUID in one spelling: lower case, without nvidia-smi's ``GPU-`` prefix."""
    text = uuid.strip().lower()
    return text[4:] if text.startswith("gpu-") else text


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


class DeviceMap:
    """GPU UUID -> this process's device ordinal."""

    def __init__(self, uuids: Sequence[str]) -> None:
        self.uuids = [normalize_uuid(u) for u in uuids]
        self._index: dict[str, int] = {}
        for index, uuid in enumerate(self.uuids):
            if not uuid:
                raise CudaIpcError(f"device {index} reports no UUID; CUDA IPC needs one")
            if uuid in self._index:
                raise CudaIpcError(f"devices {self._index[uuid]} and {index} share UUID {uuid}")
            self._index[uuid] = index

    @classmethod
    def visible(cls) -> DeviceMap:
        """The devices this process sees (after its ``CUDA_VISIBLE_DEVICES``)."""
        torch = _torch()
        return cls([device_uuid(i) for i in range(torch.cuda.device_count())])

    def __len__(self) -> int:
        """Number of visible devices."""
        return len(self.uuids)

    def index(self, uuid: str) -> int:
        """The local ordinal of ``uuid``; raises CudaIpcError naming the visible devices."""
        found = self._index.get(normalize_uuid(uuid))
        if found is None:
            visible = ", ".join(f"{i}={u}" for i, u in enumerate(self.uuids)) or "none"
            raise CudaIpcError(
                f"GPU {uuid} is not visible to this process (visible devices: {visible}); "
                "run the daemon with every GPU of its ranks visible"
            )
        return found


# --- rank side -----------------------------------------------------------------------------


def device_uuid(index: int) -> str:
    """The UUID of local device ``index``, as ``DeviceMap`` spells it."""
    return normalize_uuid(str(_torch().cuda.get_device_properties(index).uuid))


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
        getter = getattr(_torch()._C, "_accelerator_getAllocatorSettings", None)
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


# --- daemon side ---------------------------------------------------------------------------


def _open_storage(handle: CudaIpcHandle, device_index: int) -> Any:
    kind = handle_kind(handle.handle)
    if kind != "cuda_malloc":
        raise CudaIpcError(f"handle names a {kind} allocation; {FIX_ALLOCATOR}")
    if handle.offset < 0 or handle.size < 0 or handle.offset + handle.size > handle.storage_size:
        raise CudaIpcError(
            f"region [{handle.offset}, {handle.offset + handle.size}) lies outside the "
            f"{handle.storage_size}-byte storage"
        )
    torch = _torch()
    torch.cuda.init()
    with torch.cuda.device(device_index):
        if handle.event_sync_required and handle.event_handle:
            # The producer's "allocation ready" event, waited for here on the host and
            # destroyed at once: torch would make this device's current stream wait on it
            # (the engine copies on its own streams) and, in some versions, never destroy it.
            ready = torch.cuda.Event.from_ipc_handle(
                torch.device("cuda", device_index), handle.event_handle
            )
            ready.synchronize()
            del ready
        storage = torch.UntypedStorage._new_shared_cuda(
            device_index,
            handle.handle,
            handle.storage_size,
            handle.storage_offset,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle,
            False,
        )
        _check_allocation(storage.data_ptr(), handle.storage_size)
    return storage


def _check_allocation(address: int, size: int) -> None:
    # torch trusts storage_size; the driver knows the real extent of the mapped allocation,
    # so a rank cannot make the daemon write past it.
    from offloadd.transfer import libcuda

    driver = libcuda.load()
    if driver is None:
        return
    extent = driver.address_range(address)
    if extent is None:
        return
    base, length = extent
    if address + size > base + length:
        raise CudaIpcError(
            f"handle claims {size} bytes at allocation offset {address - base} but the "
            f"allocation has {length} bytes"
        )


def counter_path(ref_counter_handle: bytes) -> str:
    """Where torch's IPC reference counter file (a POSIX shm name) lives."""
    return "/dev/shm/" + ref_counter_handle.decode(errors="replace").lstrip("/")


def _check_counter(handle: CudaIpcHandle, warned: set[bytes]) -> None:
    # torch releases the daemon's reference by writing this file, and swallows the error
    # when it cannot: say so once per file instead.
    name = handle.ref_counter_handle
    if not name or name in warned:
        return
    path = counter_path(name)
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        warned.add(name)
        logger.warning(
            "cannot write torch's IPC reference counter %s: when the rank frees this GPU "
            "memory it stays allocated until the rank exits. Run the ranks with the group "
            "they share with the daemon (offloadd-clients) as their primary group; see the "
            "README, CUDA part",
            path,
        )


def share_counter(ref_counter_handle: bytes) -> None:
    """Let the rank's group write torch's counter file (torch creates it 0600), best effort."""
    path = counter_path(ref_counter_handle)
    try:
        os.chmod(path, 0o660)
    except OSError as exc:
        logger.debug("cannot open %s to the rank's group: %s", path, exc)


def open_ipc_handle(handle: CudaIpcHandle, device_index: int) -> tuple[int, object]:
    """Import ``handle`` on local device ``device_index``: ``(region address, keepalive)``.

    The region is ``handle.size`` bytes at the returned address; dropping ``keepalive``
    (the imported storage) closes the import.
    """
    storage = _open_storage(handle, device_index)
    return int(storage.data_ptr()) + handle.offset, storage


class CudaIpcOpener:
    """The ``HandleTable`` plug-in that imports ``CudaIpcHandle``s with torch.

    ``open`` returns the imported *storage*'s address and size (the table adds the region
    offset and checks bounds) and a callable that drops the import.
    """

    def __init__(self, devices: DeviceMap | None = None) -> None:
        self._devices = devices
        self._warned: set[bytes] = set()  # counter files already reported unwritable

    @property
    def devices(self) -> DeviceMap:
        """The UUID map, read from torch on first use."""
        if self._devices is None:
            self._devices = DeviceMap.visible()
        return self._devices

    def device_index(self, handle: CudaIpcHandle) -> int:
        """The local ordinal of the handle's GPU; raises CudaIpcError."""
        return self.devices.index(handle.device_uuid)

    def duplicate(self, handle: CudaIpcHandle) -> None:
        """The storage is mapped already: release the reference the producer counted for
        this export, as torch's ``rebuild_cuda_tensor`` does on a cache hit (otherwise the
        rank can never free that memory). Best effort, like torch's."""
        _check_counter(handle, self._warned)
        _torch().UntypedStorage._release_ipc_counter_cuda(
            handle.ref_counter_handle, handle.ref_counter_offset
        )

    def open(self, handle: CudaIpcHandle) -> tuple[int, int, Callable[[], None]]:
        """Import the storage ``handle`` names: ``(address, size, close)``."""
        _check_counter(handle, self._warned)
        storage = _open_storage(handle, self.device_index(handle))
        holder = [storage]

        def close() -> None:
            # The last reference runs torch's deleter: it syncs the device's current stream,
            # drops the producer's IPC refcount and closes the mapping with the last user.
            holder.clear()

        return int(storage.data_ptr()), int(storage.nbytes()), close

"""CUDA IPC of KV tensors, the daemon's half: import the handles ranks exported.

- ``DeviceMap`` maps a GPU UUID to this process's device ordinal.
- ``open_ipc_handle(handle, device_index)`` imports a handle with torch's
  ``UntypedStorage._new_shared_cuda`` on the *local* ordinal (the producer's ordinal means
  nothing here) and returns the region's address and the storage that keeps it mapped:
  dropping the storage closes the import (torch shares one ``cudaIpcOpenMemHandle`` per
  allocation among storages and closes it when the last goes).
- ``CudaIpcOpener`` is the ``HandleTable`` plug-in built on it.

Reference counting is described in ``offloadd.cuda_ipc``: the daemon releases an export's
reference when the import closes, and at once for an export whose storage it maps already
(``CudaIpcOpener.duplicate``, as torch's own rebuild does), and warns once per counter file
it cannot write. torch is imported inside the functions (through ``cuda_ipc.load_torch``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from offloadd import cuda_ipc
from offloadd.cuda_ipc import FIX_ALLOCATOR, CudaIpcError, counter_path, handle_kind
from protocol.handles import CudaIpcHandle, normalize_uuid

logger = logging.getLogger(__name__)


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
        torch = cuda_ipc.load_torch()
        return cls([cuda_ipc.device_uuid(i) for i in range(torch.cuda.device_count())])

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


def _open_storage(handle: CudaIpcHandle, device_index: int) -> Any:
    kind = handle_kind(handle.handle)
    if kind != "cuda_malloc":
        raise CudaIpcError(f"handle names a {kind} allocation; {FIX_ALLOCATOR}")
    if handle.offset < 0 or handle.size < 0 or handle.offset + handle.size > handle.storage_size:
        raise CudaIpcError(
            f"region [{handle.offset}, {handle.offset + handle.size}) lies outside the "
            f"{handle.storage_size}-byte storage"
        )
    torch = cuda_ipc.load_torch()
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
            "CUDA nodes in docs/operations.md",
            path,
        )


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
        cuda_ipc.load_torch().UntypedStorage._release_ipc_counter_cuda(
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

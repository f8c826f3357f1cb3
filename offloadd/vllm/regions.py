"""A rank's KV regions from vLLM's ``CanonicalKVCaches``.

vLLM hands a worker its KV caches as canonical tensors (``tensors[i].tensor`` is an int8
``(num_blocks, page)`` view whose ``stride(0)`` is the block stride) and, per offloaded group,
one ``CanonicalKVCacheRef(tensor_idx, page_size_bytes)`` per layer in the group's layer order
(a packed layout gives one ref per group). There are no layer names inside; they come from the
offloading config's groups. In vLLM's canonical layout each ref's ``CanonicalPageMapping``
(copy runs into the parallelism-free page) goes with its region as ``KVRegion.canonical``;
otherwise it is not read. One region is registered per (tensor,
unpadded page size) with the names of every layer that uses it, so aliased layers are copied
once and a tensor shared by groups with different page sizes becomes one region per size.

CUDA tensors are exported as CUDA IPC handles. A CPU tensor must live in a shared file mapping
(a file in ``/dev/shm``, as vLLM's CPU backend tests and offloadd's own tests allocate them,
or a memfd this process keeps open): its file and offset are found in ``/proc/self/maps``.
Anything else is refused with a message saying how to fix it. The daemon opens no path:
``open_region_files`` opens each such file here, in the rank that owns it, checks that it is
the very file mapped (device and inode, so a file put in its place under the same name is
not), and the client passes the descriptors (``OffloadClient.connect(..., files=...)``).

A memfd has no path to open: its region is named ``memfd:NAME (inode N)`` and its descriptor
is one this process holds read-write (found in ``/proc/self/fd`` by device and inode). The
daemon maps a memfd sealed against shrinking (it adds the seal when the memfd allows sealing)
and copies through that mapping, where a ``/dev/shm`` file costs a ``pread``/``pwrite`` per run
of neighbouring blocks (``offloadd.transfer.guarded``): on a CPU host, KV on memfds created
with ``MFD_ALLOW_SEALING`` is the fast path.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Sequence
from typing import Any

import msgspec

from protocol.config import OffloadingGroupConfig
from protocol.handles import CanonicalPage, KVRegion, ShmHandle, region_problem

__all__ = ["NotShareable", "kv_regions", "open_region_files", "shared_file_of"]

FIX_CPU_TENSOR = (
    "offloadd reads a CPU KV cache through shared memory: allocate it on a MAP_SHARED file "
    "mapping (a memfd kept open, e.g. os.memfd_create(name, os.MFD_ALLOW_SEALING) mapped with "
    "mmap, or a file in /dev/shm, or torch.from_file(path, shared=True)), or run the engine on "
    "GPUs"
)
logger = logging.getLogger(__name__)
_MEMFD = "/memfd:"  # how /proc/self/maps names a memfd's mapping: "/memfd:NAME (deleted)"
_DELETED = " (deleted)"


class NotShareable(ValueError):
    """A KV tensor the daemon cannot reach."""


def shared_file_of(address: int, length: int, maps: str | None = None) -> tuple[str, int]:
    """``(path, offset)`` of the shared file mapping that holds ``[address, address+length)``.

    ``maps`` is the text of ``/proc/self/maps`` (read when None).
    """
    if maps is None:
        with open("/proc/self/maps") as file:
            maps = file.read()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        start_text, _, end_text = fields[0].partition("-")
        start, end = int(start_text, 16), int(end_text, 16)
        if not start <= address < end:
            continue
        path = _mapped_path(fields)
        if fields[1][3:4] != "s" or not path:
            raise NotShareable(
                f"KV memory at {address:#x} is not a shared file mapping; {FIX_CPU_TENSOR}"
            )
        if path.endswith(_DELETED):
            raise NotShareable(f"the file backing KV memory at {address:#x} was removed: {path}")
        if address + length > end:
            raise NotShareable(
                f"KV memory at {address:#x} (+{length} bytes) runs past its mapping of {path}"
            )
        return path, int(fields[2], 16) + (address - start)
    raise NotShareable(f"KV memory at {address:#x} is not mapped; {FIX_CPU_TENSOR}")


def _mapped_path(fields: Sequence[str]) -> str:
    """The path of a ``/proc/self/maps`` line's file (a memfd's label), "" when it has none."""
    path = fields[5].strip() if len(fields) == 6 else ""
    if path.startswith(_MEMFD) and path.endswith(_DELETED):
        return f"memfd:{path[len(_MEMFD) : -len(_DELETED)]} (inode {fields[4]})"
    return path if path.startswith("/") else ""


def _mapped_files(maps: str) -> dict[str, set[tuple[int, int, int]]]:
    """Path -> {(device major, minor, inode)} of every file mapping in ``maps``."""
    found: dict[str, set[tuple[int, int, int]]] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        path = _mapped_path(fields)
        if path:
            major, _, minor = fields[3].partition(":")
            found.setdefault(path, set()).add((int(major, 16), int(minor, 16), int(fields[4])))
    return found


def _identity(info: os.stat_result) -> tuple[int, int, int]:
    return os.major(info.st_dev), os.minor(info.st_dev), info.st_ino


def _open_memfd(label: str, identities: set[tuple[int, int, int]]) -> int:
    """A duplicate of a read-write descriptor this process holds of the mapped memfd."""
    held = (int(name) for name in os.listdir("/proc/self/fd"))
    fd = next((fd for fd in held if _read_write_of(fd, identities)), None)
    if fd is None:
        raise NotShareable(
            f"KV memory in {label} is a memfd this process holds no read-write descriptor of: "
            "keep the descriptor memfd_create returned open while the engine runs"
        )
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & fcntl.F_SEAL_SEAL and not seals & fcntl.F_SEAL_SHRINK:
        logger.warning(
            "KV memory in %s is a memfd that cannot be sealed against shrinking: the daemon "
            "copies it with pread/pwrite, not through a mapping; create it with "
            "MFD_ALLOW_SEALING for the fast path",
            label,
        )
    return os.dup(fd)


def _read_write_of(fd: int, identities: set[tuple[int, int, int]]) -> bool:
    """Whether ``fd`` is open read-write on one of the files ``identities`` names."""
    try:  # a descriptor closed since the listing (the listing's own, too) is none of them
        return _identity(os.fstat(fd)) in identities and (
            fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
        )
    except OSError:
        return False


def open_region_files(regions: Sequence[KVRegion], maps: str | None = None) -> dict[str, int]:
    """Descriptors (read-write, the rank's own) of the files behind the shared-memory
    regions, by path, each checked to be the file this process maps; raises NotShareable."""
    if maps is None:
        with open("/proc/self/maps") as file:
            maps = file.read()
    mapped = _mapped_files(maps)
    opened: dict[str, int] = {}
    try:
        for region in regions:
            handle = region.handle
            if not isinstance(handle, ShmHandle) or handle.path in opened:
                continue
            if handle.path.startswith(_MEMFD[1:]):
                opened[handle.path] = _open_memfd(handle.path, mapped.get(handle.path, set()))
                continue
            try:
                fd = os.open(handle.path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                raise NotShareable(f"cannot open {handle.path}: {exc.strerror}") from None
            opened[handle.path] = fd
            if _identity(os.fstat(fd)) not in mapped.get(handle.path, set()):
                raise NotShareable(
                    f"{handle.path} is no longer the file this process maps (replaced?)"
                )
    except BaseException:
        for fd in opened.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        raise
    return opened


def kv_regions(
    kv_caches: Any, groups: Sequence[OffloadingGroupConfig], *, canonical: bool = False
) -> list[KVRegion]:
    """The rank's regions: one per (canonical tensor, unpadded page size) that a group uses;
    with ``canonical``, each with its refs' canonical page mapping (all must agree)."""
    refs_per_group = kv_caches.group_data_refs
    if len(refs_per_group) != len(groups):
        raise ValueError(
            f"vLLM gave KV refs for {len(refs_per_group)} groups, the offloading config has "
            f"{len(groups)}"
        )
    layers: dict[tuple[int, int], list[str]] = {}
    pages: dict[tuple[int, int], set[CanonicalPage | None]] = {}
    for group, refs in zip(groups, refs_per_group, strict=True):
        names = list(group.layer_names)
        # One ref per layer, or one ref standing for the whole group (packed layout).
        per_ref = [[name] for name in names] if len(refs) == len(names) else [names] * len(refs)
        for ref, ref_names in zip(refs, per_ref, strict=True):
            where = (ref.tensor_idx, ref.page_size_bytes)
            found = layers.setdefault(where, [])
            found.extend(name for name in ref_names if name not in found)
            if canonical:
                pages.setdefault(where, set()).add(canonical_page(ref.mapping))
    regions = []
    for where, names in layers.items():
        region = _region(kv_caches.tensors[where[0]].tensor, where[1], names)
        if canonical:
            (page, *others) = pages[where]
            if others or page is None:
                raise ValueError(
                    f"KV region of layers {names}: vLLM gave no canonical page mapping, or "
                    "different ones for layers sharing the region; the canonical layout "
                    "needs one"
                )
            region = msgspec.structs.replace(region, canonical=page)
        regions.append(region)
    for region in regions:
        problem = region_problem(region)
        if problem:
            raise ValueError(f"KV region of layers {region.layer_names}: {problem}")
    return regions


def canonical_page(mapping: Any) -> CanonicalPage | None:
    """vLLM's ``CanonicalPageMapping`` (or None) as the wire's ``CanonicalPage``."""
    if mapping is None:
        return None
    return CanonicalPage(
        page_size=int(mapping.canonical_page_size_bytes),
        runs=tuple(
            (
                int(run.local_offset),
                int(run.canonical_offset),
                int(run.fragment_size),
                int(run.num_fragments),
                int(run.local_stride),
                int(run.canonical_stride),
            )
            for run in mapping.runs
        ),
        writers=int(mapping.num_writers),
        agnostic=bool(mapping.parallelism_agnostic),
    )


def _region(tensor: Any, page_size: int, layer_names: Sequence[str]) -> KVRegion:
    if tensor.is_cuda:
        from offloadd.cuda_ipc import kv_region_from_tensor

        return kv_region_from_tensor(tensor, page_size, layer_names)
    num_blocks = int(tensor.shape[0])
    stride = int(tensor.stride(0)) * tensor.element_size()
    # The whole rows when mapped (so regions over one tensor share a handle), else the bytes
    # the last block's page reaches.
    size = num_blocks * stride
    try:
        path, offset = shared_file_of(tensor.data_ptr(), max(size, 1))
    except NotShareable:
        size = (num_blocks - 1) * stride + page_size if num_blocks else 0
        path, offset = shared_file_of(tensor.data_ptr(), max(size, 1))
    return KVRegion(
        handle=ShmHandle(path=path, offset=offset, size=size),
        num_blocks=num_blocks,
        page_size=page_size,
        block_stride=stride,
        layer_names=tuple(layer_names),
    )

"""Shared-memory KV tensors: what a rank on a host without a GPU registers with the daemon.

``SharedKVTensor.create`` makes a file in ``/dev/shm`` holding ``num_blocks`` blocks of
``block_stride`` bytes, maps it, and describes it as a ``KVRegion`` with an ``ShmHandle``;
``SharedKVTensor.memfd`` makes a memfd sealed against shrinking instead (no name in any
directory; pass ``files`` to ``OffloadClient.connect``). ``tensor`` is a uint8 torch view of
shape ``(num_blocks, block_stride)`` over the pages the daemon reads and writes, so bytes
written by either side are seen by the other.

Either way the client hands the daemon the file's descriptor (``offloadd.peer``), never its
name. The daemon copies a /dev/shm file's bytes with pread/pwrite on that descriptor (a file
its owner could truncate must never be mapped by the daemon) and maps a sealed memfd, which
cannot shrink: ``offloadd bench --only guarded`` says what the difference costs.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import uuid
from collections.abc import Sequence

import torch

from protocol.handles import KVRegion, ShmHandle


class SharedKVTensor:
    """A KV region in a shared-memory file; close() unmaps and removes it."""

    def __init__(
        self,
        path: str,
        num_blocks: int,
        block_stride: int,
        page_size: int,
        layer_names: Sequence[str],
        *,
        memfd: int | None = None,
    ) -> None:
        size = max(1, num_blocks * block_stride)
        if memfd is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED)
            finally:
                os.close(fd)
        else:
            self._mmap = mmap.mmap(memfd, size, mmap.MAP_SHARED)
        self._memfd = memfd
        self.path = path
        self.region = KVRegion(
            handle=ShmHandle(path=path, offset=0, size=num_blocks * block_stride),
            num_blocks=num_blocks,
            page_size=page_size,
            block_stride=block_stride,
            layer_names=tuple(layer_names),
        )
        flat = torch.frombuffer(self._mmap, dtype=torch.uint8, count=num_blocks * block_stride)
        self.tensor = flat.view(num_blocks, block_stride)

    @classmethod
    def create(
        cls,
        num_blocks: int,
        page_size: int,
        layer_names: Sequence[str],
        *,
        block_stride: int | None = None,
        directory: str = "/dev/shm",
        prefix: str = "offloadd-kv",
    ) -> SharedKVTensor:
        """A fresh zero-filled region with a unique file name under ``directory``."""
        path = os.path.join(directory, f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        return cls(path, num_blocks, block_stride or page_size, page_size, layer_names)

    @classmethod
    def memfd(
        cls,
        num_blocks: int,
        page_size: int,
        layer_names: Sequence[str],
        *,
        block_stride: int | None = None,
        name: str = "offloadd-kv",
    ) -> SharedKVTensor:
        """A fresh zero-filled region in a memfd sealed against shrinking (see ``files``)."""
        stride = block_stride or page_size
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, max(1, num_blocks * stride))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            label = f"memfd:{name}-{uuid.uuid4().hex[:12]}"
            return cls(label, num_blocks, stride, page_size, layer_names, memfd=fd)
        except BaseException:
            os.close(fd)
            raise

    @property
    def files(self) -> dict[str, int]:
        """``{path: descriptor}`` for ``OffloadClient.connect(files=...)`` (memfds only: a
        file in a directory is opened by the client itself)."""
        return {self.path: self._memfd} if self._memfd is not None else {}

    def pages(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The unpadded pages of ``block_ids`` (a copy), for comparisons."""
        index = torch.tensor(list(block_ids), dtype=torch.long)
        return self.tensor[:, : self.region.page_size].index_select(0, index)

    def close(self) -> None:
        """Drop the tensor view, unmap and remove the file. Idempotent."""
        if self.tensor is None:
            return
        del self.tensor
        self.tensor = None  # type: ignore[assignment]
        # A caller may still hold a view; the mapping then goes when that view does.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        if self._memfd is not None:
            os.close(self._memfd)
            self._memfd = None
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> SharedKVTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

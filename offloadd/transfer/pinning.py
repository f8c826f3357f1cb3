"""Pinning host memory for DMA: ``cudaHostRegister`` of an existing mapping, in pieces.

The arena is a shared-memory file mapped by the daemon, so it cannot come from CUDA's
pinned allocator; it is registered after the fact, as vLLM does for its shared offload
region. Registration happens in pieces of at most ``piece`` bytes (64 GiB by default): one
call for hundreds of GiB holds a driver lock for a long time and reports no progress.

Pinning is a bandwidth optimisation only. When it fails (no GPU, driver refusal, memlock
limits) every piece registered so far is unregistered, a warning says that copies will be
pageable (slower), and ``register_host_memory`` returns None; nothing else changes.

Registration uses ``cudaHostRegisterPortable`` by default: the daemon serves every GPU of
the node, and the memory must count as pinned for each of their contexts.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable
from typing import Any, Protocol

logger = logging.getLogger(__name__)

CUDA_HOST_REGISTER_DEFAULT = 0
CUDA_HOST_REGISTER_PORTABLE = 1
DEFAULT_PIECE = 64 << 30


class CudaRuntime(Protocol):
    """The two calls of ``torch.cuda.cudart()`` used here; each returns a cudaError code."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any:
        """Pin ``size`` bytes at ``ptr``."""
        ...

    def cudaHostUnregister(self, ptr: int) -> Any:
        """Unpin the registration that starts at ``ptr``."""
        ...


def _code(result: Any) -> int:
    # torch returns a pybind enum (``.value``), fakes may return ints.
    return int(getattr(result, "value", result))


def split_pieces(address: int, size: int, piece: int) -> list[tuple[int, int]]:
    """``(start, length)`` pieces of at most ``piece`` bytes covering the range exactly once."""
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    if piece <= 0 or piece % mmap.PAGESIZE:
        raise ValueError(f"piece must be a positive multiple of {mmap.PAGESIZE}, got {piece}")
    return [(address + offset, min(piece, size - offset)) for offset in range(0, size, piece)]


class HostRegistration:
    """Pinned pieces of one host range; ``close()`` unregisters them (idempotent)."""

    def __init__(
        self, address: int, size: int, pieces: list[tuple[int, int]], cudart: CudaRuntime
    ) -> None:
        self.address = address
        self.size = size
        self.pieces = pieces
        self._cudart = cudart

    def close(self) -> None:
        """Unregister every piece, last first."""
        while self.pieces:
            start, length = self.pieces.pop()
            code = _code(self._cudart.cudaHostUnregister(start))
            if code != 0:
                logger.warning(
                    "cudaHostUnregister of %d MiB at %#x failed (cudaError %d)",
                    length >> 20,
                    start,
                    code,
                )


def _default_cudart() -> CudaRuntime | None:
    import torch

    if not torch.cuda.is_available():
        return None
    runtime: CudaRuntime = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unstubbed
    return runtime


def register_host_memory(
    address: int,
    size: int,
    *,
    piece: int = DEFAULT_PIECE,
    flags: int = CUDA_HOST_REGISTER_PORTABLE,
    progress: Callable[[float], None] | None = None,
    cudart: CudaRuntime | None = None,
) -> HostRegistration | None:
    """Pin ``[address, address + size)`` in pieces; None (and a warning) if it cannot.

    ``progress`` is called after each piece with the fraction registered. ``cudart`` is
    ``torch.cuda.cudart()`` unless given; without CUDA nothing is pinned.
    """
    pieces = split_pieces(address, size, piece)
    if cudart is None:
        cudart = _default_cudart()
        if cudart is None:
            logger.info("no CUDA device: host memory at %#x stays pageable", address)
            return None
    registration = HostRegistration(address, size, [], cudart)
    started = time.perf_counter()
    done = 0
    for start, length in pieces:
        code = _code(cudart.cudaHostRegister(start, length, flags))
        if code != 0:
            logger.warning(
                "cudaHostRegister of %d MiB at %#x failed (cudaError %d): copies to and from "
                "this %d MiB range will be pageable (slower). Check the memlock limit "
                "(LimitMEMLOCK=infinity) and free memory.",
                length >> 20,
                start,
                code,
                size >> 20,
            )
            registration.close()
            return None
        registration.pieces.append((start, length))
        done += length
        if progress is not None:
            progress(done / size)
    logger.info(
        "pinned %d MiB in %d pieces in %.2fs",
        size >> 20,
        len(pieces),
        time.perf_counter() - started,
    )
    return registration

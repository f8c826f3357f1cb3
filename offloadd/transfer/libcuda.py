"""The few CUDA driver calls the daemon makes itself, through ctypes on ``libcuda.so.1``.

The driver library ships with the NVIDIA driver on every GPU host, so these work with
nothing but torch installed (torch's own ``cudart()`` exposes no memcpy and no address
queries). Each call needs a current context in the calling thread: bind the device first
(``torch.cuda.set_device``), which makes its primary context current.

``load()`` returns None where the library is missing (machines without a GPU).
"""

from __future__ import annotations

import ctypes
import functools

CUDA_SUCCESS = 0


class LibCuda:
    """Typed wrappers over the driver functions offloadd uses."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib  # for entry points resolved elsewhere (offloadd.transfer.batch)
        self._memcpy_async = lib.cuMemcpyAsync
        self._memcpy_async.argtypes = [
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_size_t,
            ctypes.c_void_p,
        ]
        self._memcpy_async.restype = ctypes.c_int
        self._address_range = lib.cuMemGetAddressRange_v2
        self._address_range.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        self._address_range.restype = ctypes.c_int
        self._error_name = lib.cuGetErrorName
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._error_name.restype = ctypes.c_int

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        """``cuMemcpyAsync`` (unified addressing picks the direction); returns the CUresult."""
        result: int = self._memcpy_async(dst, src, nbytes, stream or None)
        return result

    def address_range(self, pointer: int) -> tuple[int, int] | None:
        """``(base, size)`` of the device allocation holding ``pointer``, or None."""
        base = ctypes.c_uint64()
        size = ctypes.c_size_t()
        if self._address_range(ctypes.byref(base), ctypes.byref(size), pointer) != CUDA_SUCCESS:
            return None
        return base.value, size.value

    def error_name(self, code: int) -> str:
        """``CUDA_ERROR_...`` for a CUresult."""
        name = ctypes.c_char_p()
        if self._error_name(code, ctypes.byref(name)) != CUDA_SUCCESS or name.value is None:
            return f"CUresult {code}"
        return name.value.decode()


@functools.cache
def load() -> LibCuda | None:
    """The driver library, or None where there is none."""
    try:
        return LibCuda(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None

"""Which copy engine ``server.copy_engine = "auto"`` runs: cuda where it can, else cpu.

The cuda engine needs a CUDA device and a driver that exports the batched copy
(``cuMemcpyBatchAsync``, CUDA 12.8+). Both are asked of the driver library itself, so the
choice neither imports torch nor touches a GPU's memory.
"""

from __future__ import annotations

import ctypes

from offloadd.transfer import libcuda
from offloadd.transfer.batch import BatchCopier


def cuda_copy_problem() -> str:
    """Why the cuda copy engine cannot run on this machine ("" when it can)."""
    driver = libcuda.load()
    if driver is None:
        return "no CUDA driver (libcuda.so.1)"
    if BatchCopier.resolve(driver.lib) is None:
        return "the CUDA driver has no cuMemcpyBatchAsync (it needs CUDA 12.8 or newer)"
    count = ctypes.c_int(0)
    if driver.lib.cuInit(0) != libcuda.CUDA_SUCCESS:
        return "the CUDA driver does not initialise (cuInit failed)"
    if driver.lib.cuDeviceGetCount(ctypes.byref(count)) != libcuda.CUDA_SUCCESS or not count.value:
        return "no CUDA device is visible"
    return ""


def choose_copy_engine(configured: str) -> tuple[str, str]:
    """The engine to run for ``server.copy_engine`` and why (the why is "" unless "auto")."""
    if configured != "auto":
        return configured, ""
    problem = cuda_copy_problem()
    if problem:
        return "cpu", problem
    return "cuda", "a CUDA device and a driver with the batched copy are there"

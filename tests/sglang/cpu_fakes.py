"""What SGLang 0.5.23 needs faked to run its HiCache on a CPU host, each named; nothing else
is faked.

- ``torchvision``: its wheel cannot load beside CPU torch 2.13, and SGLang's model configs
  import ``torchvision.transforms`` at import time (for InternVL's image constants) though the
  HiCache code never uses it. ``install_torchvision_stub`` puts an import-only stand-in on
  ``sys.meta_path``, after importing transformers' image modules so that transformers still
  sees no torchvision.
- Host-memory pinning: SGLang pins its host pool with ``cudaHostRegister`` (through
  ``torch.cuda.cudart()``), which CPU torch does not have. ``install_hicache_cpu_fakes``
  makes ``cudaHostRegister`` and ``cudaHostUnregister`` no-ops that succeed; SGLang's own
  registration code still runs.
- The two ``sgl_kernel.kvcacheio`` copy kernels the ``page_first`` host layout uses with
  ``hicache_io_backend="kernel"`` (sgl_kernel is CUDA-only, so SGLang leaves their names
  undefined on CPU): ``transfer_kv_all_layer_lf_pf`` (device to host, every layer: SGLang's
  write-through) and ``transfer_kv_per_layer_pf_lf`` (host to device, one layer: SGLang's
  load-back). ``install_hicache_cpu_fakes`` puts torch-indexing versions into SGLang's
  ``pool_host.mha`` module, with the CUDA kernels' arguments: device layers by address (the
  pointer tables SGLang builds), host pages by byte offset within a token's row.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

import torch


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any ``torchvision.*`` module: empty, every attribute an empty class."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def __getattr__(name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

        module.__dict__["__getattr__"] = __getattr__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install_torchvision_stub() -> None:
    """Make ``import torchvision.transforms`` work without torchvision (see above)."""
    if any(isinstance(finder, _TorchvisionStub) for finder in sys.meta_path):
        return
    import transformers.image_processing_utils
    import transformers.image_utils  # noqa: F401

    sys.meta_path.append(_TorchvisionStub())


class _NoPinning:
    """``torch.cuda.cudart()`` for SGLang's host-pool registration: nothing to pin on CPU."""

    @staticmethod
    def cudaHostRegister(pointer: int, size: int, flags: int) -> int:
        return 0

    @staticmethod
    def cudaHostUnregister(pointer: int) -> int:
        return 0

    @staticmethod
    def cudaGetErrorString(code: int) -> str:
        return f"error {code}"


def _rows(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """A contiguous tensor's bytes as rows of ``width``."""
    return tensor.view(torch.uint8).view(-1, width)


def _layer_at(pointer: torch.Tensor, rows: int, item_size: int) -> torch.Tensor:
    """The first ``rows`` rows of a device layer, from its address in a pointer table."""
    memory = (ctypes.c_char * (rows * item_size)).from_address(int(pointer))
    return torch.frombuffer(memory, dtype=torch.uint8).view(rows, item_size)


def transfer_kv_all_layer_lf_pf(
    *,
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
) -> None:
    """Device (one buffer per layer) to host (``page_first``: a token's layers side by side)."""
    rows = int(src_indices.max()) + 1 if src_indices.numel() else 0
    for layers, host in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        host_rows = _rows(host, dst_layout_dim)
        for layer in range(num_layers):
            span = slice(layer * item_size, (layer + 1) * item_size)
            host_rows[dst_indices, span] = _layer_at(layers[layer], rows, item_size)[src_indices]


def transfer_kv_per_layer_pf_lf(
    *,
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
) -> None:
    """Host (``page_first``) to device, one layer."""
    span = slice(layer_id * item_size, (layer_id + 1) * item_size)
    for host, device in ((src_k, dst_k), (src_v, dst_v)):
        _rows(device, item_size)[dst_indices] = _rows(host, src_layout_dim)[src_indices, span]


def install_hicache_cpu_fakes() -> None:
    """No host pinning and torch copy kernels for SGLang's HiCache on CPU (see above)."""
    from sglang.srt.mem_cache.pool_host import mha

    torch.cuda.cudart = lambda: _NoPinning
    mha.transfer_kv_all_layer_lf_pf = transfer_kv_all_layer_lf_pf
    mha.transfer_kv_per_layer_pf_lf = transfer_kv_per_layer_pf_lf

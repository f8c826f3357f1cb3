"""SGLang's pieces as the tests and the sglang bench build them on a CPU host: the device KV
pool, the extra config that has SGLang's factory load offloadd's backend (``dynamic``) and
one rank's storage config.
Callers install the torchvision stub first (``tests.sglang.cpu_fakes``)."""

from __future__ import annotations

from typing import Any

import torch


def backend_extra(
    endpoint: str, timeout: float, allocator: str = "shm", **more: object
) -> dict[str, object]:
    """``--hicache-storage-backend-extra-config`` loading offloadd's backend at ``endpoint``."""
    return {
        "backend_name": "offloadd",
        "module_path": "offloadd.sglang",
        "class_name": "OffloaddHiCacheStorage",
        "interface_v1": 1,
        "allocator": allocator,
        "endpoint": endpoint,
        "timeout": timeout,
        **more,
    }


def storage_config(model: str, extra: dict[str, object]) -> Any:
    """SGLang's ``HiCacheStorageConfig`` of one rank (TP 1, page-first layout, no MLA) with
    the backend's ``extra`` config."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config=extra,
    )


def device_pool(tokens: int, page: int, *, layers: int, heads: int, head_dim: int) -> Any:
    """SGLang's ``MHATokenToKVPool`` of ``tokens`` bf16 tokens on the CPU."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=tokens,
        page_size=page,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )

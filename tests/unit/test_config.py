"""protocol.config: vLLM's translation, the block-size resolver, the converter, diffs, codec.

vLLM is not installed: its configs are stood in for by SimpleNamespace objects and by tiny
spec classes that carry vLLM's class names, which is all the duck typing looks at.
"""

from __future__ import annotations

import ast
import dataclasses
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import protocol.config as config_module
from protocol.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
    build_offloading_config,
    config_differences,
    from_vllm_offloading_config,
    is_kv_cache_tensor_packed,
    resolve_kv_cache_block_sizes,
)
from tests.strategies import offloading_configs, property_settings

# --- stand-ins for vLLM's KV cache specs (only class names and block_size matter) ---------


class KVCacheSpec:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size


class FullAttentionSpec(KVCacheSpec):
    pass


class MLAAttentionSpec(FullAttentionSpec):
    pass


class SlidingWindowSpec(KVCacheSpec):
    pass


class MambaSpec(KVCacheSpec):
    pass


class TorchDtype:
    """Prints like ``torch.bfloat16`` does."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


SEED_DIVISIBILITY = (
    "tokens_per_block={0} not divisible by tokens_per_hash={1}. "
    "Hybrid models (e.g. Mamba+Attention) need --enable-prefix-caching to align block sizes."
)
SEED_SAME_BLOCK_SIZE = (
    "If 'block_size' is specified in kv_connector_extra_config, there must be at least one "
    "KV cache group, and all groups must have the same block size."
)


def make_vllm_config(
    *,
    block_size: int = 16,
    dcp: int = 1,
    pcp: int = 1,
    tp: int = 1,
    pp: int = 1,
    rank: int = 0,
    dp_index: int = 0,
    extra: Mapping[str, Any] | None = None,
    engine_id: str | None = "engine-0",
    with_transfer: bool = True,
    kv_events: Any = None,
    cache_dtype: Any = "auto",
    model: str = "org/model",
    use_v2_model_runner: bool = False,
    enable_prefix_caching: bool = True,
    prefix_match_unit: int | None = None,
) -> types.SimpleNamespace:
    kv_transfer_config = (
        types.SimpleNamespace(
            kv_connector_extra_config={} if extra is None else extra,
            engine_id=engine_id,
        )
        if with_transfer
        else None
    )
    return types.SimpleNamespace(
        kv_transfer_config=kv_transfer_config,
        parallel_config=types.SimpleNamespace(
            rank=rank,
            world_size=tp * pp * pcp,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            prefill_context_parallel_size=pcp,
            decode_context_parallel_size=dcp,
            data_parallel_index=dp_index,
        ),
        cache_config=types.SimpleNamespace(
            block_size=block_size,
            cache_dtype=cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
            prefix_match_unit=prefix_match_unit,
        ),
        model_config=types.SimpleNamespace(model=model),
        kv_events_config=kv_events,
        use_v2_model_runner=use_v2_model_runner,
    )


def tensor(size: int, block_stride: int = 0) -> types.SimpleNamespace:
    return types.SimpleNamespace(size=size, block_stride=block_stride)


def make_kv_cache_config(
    *groups: tuple[KVCacheSpec, list[str]],
    num_blocks: int = 10,
    tensors: list[types.SimpleNamespace] | None = None,
) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        kv_cache_groups=[
            types.SimpleNamespace(kv_cache_spec=spec, layer_names=names) for spec, names in groups
        ],
        num_blocks=num_blocks,
        kv_cache_tensors=tensors if tensors is not None else [tensor(1000), tensor(1000)],
    )


def full_group(block_size: int = 16, *names: str) -> tuple[KVCacheSpec, list[str]]:
    return FullAttentionSpec(block_size), list(names or ("layers.0", "layers.1"))


# --- struct shape ---------------------------------------------------------------------


def test_struct_fields_mirror_vllm_in_order() -> None:
    def names(cls: type[msgspec.Struct]) -> list[str]:
        return [f.name for f in msgspec.structs.fields(cls)]

    assert names(OffloadingGroupConfig) == [
        "tokens_per_block",
        "layer_names",
        "group_id",
        "sliding_window_size_in_chunks",
    ]
    assert names(OffloadingModelConfig) == ["name", "dtype", "max_model_len"]
    assert names(OffloadingCacheConfig) == ["tokens_per_hash", "blocks_per_chunk"]
    assert names(OffloadingParallelConfig) == [
        "rank",
        "world_size",
        "tp_size",
        "pp_size",
        "pcp_size",
        "dcp_size",
        "data_parallel_index",
        "is_parallelism_agnostic",
        "data_parallel_size",
        "data_parallel_rank_local",
    ]
    assert names(OffloadingConfig) == [
        "groups",
        "worker_kv_bytes_per_block",
        "enable_kv_cache_events",
        "extra_config",
        "engine_id",
        "model",
        "cache",
        "parallel",
        "replicated_layout",
        "num_cpu_blocks",
        "canonical_layout",
        "kv_cache_layout",
    ]
    defaults = {f.name: f.default for f in msgspec.structs.fields(OffloadingConfig)}
    assert defaults["replicated_layout"] is False
    assert defaults["num_cpu_blocks"] is None
    assert defaults["canonical_layout"] is False
    assert defaults["kv_cache_layout"] is None


def test_group_ids_default_to_positions() -> None:
    a = OffloadingGroupConfig(tokens_per_block=16, layer_names=("a",))
    b = OffloadingGroupConfig(tokens_per_block=16, layer_names=("b",), group_id=3)
    config = sample_config(groups=(a, b))
    assert config.group_ids() == (0, 3)


def test_module_imports_only_msgspec_and_stdlib() -> None:
    tree = ast.parse(Path(config_module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "collections", "math", "re", "typing", "msgspec"}


# --- build_offloading_config ----------------------------------------------------------


def test_single_group_full_config() -> None:
    vllm_config = make_vllm_config(
        tp=2, rank=1, dp_index=3, cache_dtype=TorchDtype("bfloat16"), extra={"cpu_bytes": 7}
    )
    kv_cache_config = make_kv_cache_config(
        full_group(16, "layers.0", "layers.1"),
        num_blocks=10,
        tensors=[tensor(1000), tensor(1000)],
    )

    config = build_offloading_config(vllm_config, kv_cache_config)

    assert config == OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0", "layers.1")),),
        worker_kv_bytes_per_block=200,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes": 7},
        engine_id="engine-0",
        model=OffloadingModelConfig(name="org/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=1,
            world_size=2,
            tp_size=2,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=3,
            is_parallelism_agnostic=True,
        ),
        replicated_layout=False,
        num_cpu_blocks=None,
    )
    assert type(config.extra_config) is dict
    assert type(config.groups[0].layer_names) is tuple


def test_hybrid_groups_hash_at_gcd() -> None:
    vllm_config = make_vllm_config(block_size=16)
    kv_cache_config = make_kv_cache_config(
        (FullAttentionSpec(16), ["full.0"]),
        (SlidingWindowSpec(32), ["sw.0", "sw.1"]),
    )

    assert resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) == (32, 16)
    config = build_offloading_config(vllm_config, kv_cache_config)
    assert [g.tokens_per_block for g in config.groups] == [16, 32]
    assert [g.layer_names for g in config.groups] == [("full.0",), ("sw.0", "sw.1")]
    assert config.cache.tokens_per_hash == 16
    assert config.parallel.is_parallelism_agnostic is False


def test_hybrid_groups_prefix_match_unit_overrides_gcd() -> None:
    vllm_config = make_vllm_config(block_size=16, prefix_match_unit=8)
    kv_cache_config = make_kv_cache_config(
        (FullAttentionSpec(16), ["full.0"]), (SlidingWindowSpec(32), ["sw.0"])
    )

    assert resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) == (32, 8)
    assert build_offloading_config(vllm_config, kv_cache_config).cache.tokens_per_hash == 8


def test_older_hash_block_size_override_is_read() -> None:
    vllm_config = make_vllm_config(block_size=16)
    del vllm_config.cache_config.prefix_match_unit
    vllm_config.cache_config.hash_block_size = 4
    kv_cache_config = make_kv_cache_config(
        (FullAttentionSpec(16), ["full.0"]), (SlidingWindowSpec(48), ["sw.0"])
    )

    assert resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) == (48, 4)


def test_prefix_match_unit_must_divide_every_group() -> None:
    vllm_config = make_vllm_config(block_size=16, prefix_match_unit=12)
    kv_cache_config = make_kv_cache_config(
        (FullAttentionSpec(16), ["full.0"]), (SlidingWindowSpec(32), ["sw.0"])
    )

    with pytest.raises(ValueError, match=r"Invalid prefix_match_unit=12.*\[16, 32\]"):
        resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)


def test_hashing_inactive_hashes_at_scheduler_block_size() -> None:
    vllm_config = make_vllm_config(block_size=16, with_transfer=False, enable_prefix_caching=False)
    kv_cache_config = make_kv_cache_config(
        (FullAttentionSpec(16), ["full.0"]), (SlidingWindowSpec(32), ["sw.0"])
    )

    assert resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) == (32, 32)


@pytest.mark.parametrize(
    ("attention_block", "mamba_block", "tokens_per_hash"),
    [pytest.param(16, 48, 48, id="16-vs-48"), pytest.param(24, 36, 72, id="24-vs-36")],
)
def test_tokens_per_block_not_divisible_by_tokens_per_hash(
    attention_block: int, mamba_block: int, tokens_per_hash: int
) -> None:
    # A Mamba group whose block differs from the cache block (no "align" mode) makes vLLM
    # hash at the LCM, which the smaller attention block cannot be divided by.
    vllm_config = make_vllm_config(block_size=16)
    kv_cache_config = make_kv_cache_config(
        (FullAttentionSpec(attention_block), ["attn.0"]), (MambaSpec(mamba_block), ["mamba.0"])
    )

    assert resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) == (
        tokens_per_hash,
        tokens_per_hash,
    )
    with pytest.raises(ValueError) as excinfo:
        build_offloading_config(vllm_config, kv_cache_config)
    assert str(excinfo.value) == SEED_DIVISIBILITY.format(attention_block, tokens_per_hash)


def test_aligned_mamba_group_hashes_at_gcd() -> None:
    vllm_config = make_vllm_config(block_size=16)
    kv_cache_config = make_kv_cache_config(
        (FullAttentionSpec(32), ["attn.0"]), (MambaSpec(16), ["mamba.0"])
    )

    assert resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) == (32, 16)


def test_dcp_and_pcp_single_group() -> None:
    vllm_config = make_vllm_config(block_size=16, dcp=2, pcp=2, tp=4)
    kv_cache_config = make_kv_cache_config(full_group(16))

    # vLLM's resolver scales the hash size by DCP only; build_offloading_config scales blocks by
    # DCP*PCP.
    assert resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) == (32, 32)
    config = build_offloading_config(vllm_config, kv_cache_config)
    assert config.groups[0].tokens_per_block == 64
    assert config.cache.tokens_per_hash == 32
    assert (config.parallel.dcp_size, config.parallel.pcp_size) == (2, 2)
    assert config.parallel.world_size == 8
    assert config.parallel.tp_size == 4


def test_dcp_scales_attention_groups_but_not_mamba_in_resolver() -> None:
    vllm_config = make_vllm_config(block_size=16, dcp=2)
    kv_cache_config = make_kv_cache_config(
        (FullAttentionSpec(16), ["attn.0"]), (MambaSpec(16), ["mamba.0"])
    )

    assert resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) == (32, 16)
    config = build_offloading_config(vllm_config, kv_cache_config)
    # build_offloading_config scales every group, Mamba included, by the context-parallel factor.
    assert [g.tokens_per_block for g in config.groups] == [32, 32]
    assert config.cache.tokens_per_hash == 16


def test_hybrid_attention_groups_with_dcp() -> None:
    vllm_config = make_vllm_config(block_size=16, dcp=2, tp=2)
    kv_cache_config = make_kv_cache_config(
        (FullAttentionSpec(16), ["full.0"]), (SlidingWindowSpec(32), ["sw.0"])
    )

    # Both attention groups count dcp tokens per block: 32 and 64, hashed at their GCD.
    assert resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) == (64, 32)
    config = build_offloading_config(vllm_config, kv_cache_config)
    assert [g.tokens_per_block for g in config.groups] == [32, 64]
    assert config.cache.tokens_per_hash == 32
    assert config.parallel.dcp_size == 2 and config.parallel.world_size == 2
    assert config.parallel.is_parallelism_agnostic is False
    # A chunk size in tokens needs every group to have the same block size.
    vllm_config = make_vllm_config(block_size=16, dcp=2, extra={"block_size": 64})
    with pytest.raises(ValueError, match="all groups must have the same block size"):
        build_offloading_config(vllm_config, kv_cache_config)


def test_config_without_context_parallel_attributes() -> None:
    vllm_config = make_vllm_config(block_size=16)
    del vllm_config.parallel_config.decode_context_parallel_size
    del vllm_config.parallel_config.prefill_context_parallel_size

    config = build_offloading_config(vllm_config, make_kv_cache_config(full_group(16)))
    assert config.groups[0].tokens_per_block == 16
    assert (config.parallel.dcp_size, config.parallel.pcp_size) == (1, 1)


def test_block_size_in_extra_config_sets_blocks_per_chunk() -> None:
    vllm_config = make_vllm_config(block_size=16, extra={"block_size": "64"})
    config = build_offloading_config(vllm_config, make_kv_cache_config(full_group(16)))

    assert config.cache.blocks_per_chunk == 4
    assert config.extra_config == {"block_size": "64"}


def test_block_size_counts_context_parallel_tokens() -> None:
    vllm_config = make_vllm_config(block_size=16, dcp=2, extra={"block_size": 128})
    config = build_offloading_config(vllm_config, make_kv_cache_config(full_group(16)))

    assert config.cache.blocks_per_chunk == 4


def test_no_block_size_means_one_block_per_chunk() -> None:
    config = build_offloading_config(make_vllm_config(), make_kv_cache_config(full_group(16)))

    assert config.cache.blocks_per_chunk == 1


def test_block_size_not_a_multiple_of_tokens_per_block() -> None:
    vllm_config = make_vllm_config(block_size=16, extra={"block_size": 40})

    with pytest.raises(ValueError, match=r"block_size=40 .*tokens_per_block=16"):
        build_offloading_config(vllm_config, make_kv_cache_config(full_group(16)))


def test_block_size_with_groups_of_different_block_sizes() -> None:
    vllm_config = make_vllm_config(block_size=16, extra={"block_size": 64})
    kv_cache_config = make_kv_cache_config(
        (FullAttentionSpec(16), ["full.0"]), (SlidingWindowSpec(32), ["sw.0"])
    )

    with pytest.raises(ValueError) as excinfo:
        build_offloading_config(vllm_config, kv_cache_config)
    assert str(excinfo.value) == SEED_SAME_BLOCK_SIZE


def test_block_size_without_groups() -> None:
    vllm_config = make_vllm_config(block_size=16, extra={"block_size": 64})

    with pytest.raises(ValueError) as excinfo:
        build_offloading_config(vllm_config, make_kv_cache_config(num_blocks=0))
    assert str(excinfo.value) == SEED_SAME_BLOCK_SIZE


def test_packed_tensors_count_one_allocation() -> None:
    kv_cache_config = make_kv_cache_config(
        full_group(16),
        num_blocks=8,
        tensors=[tensor(4096, block_stride=512), tensor(4096, block_stride=512)],
    )

    config = build_offloading_config(make_vllm_config(), kv_cache_config)
    assert config.worker_kv_bytes_per_block == 512


def test_unpacked_tensors_are_summed() -> None:
    kv_cache_config = make_kv_cache_config(
        full_group(16), num_blocks=10, tensors=[tensor(1000), tensor(3005)]
    )

    config = build_offloading_config(make_vllm_config(), kv_cache_config)
    assert config.worker_kv_bytes_per_block == 400


def test_tensors_without_block_stride_attribute_are_unpacked() -> None:
    tensors = [types.SimpleNamespace(size=600), types.SimpleNamespace(size=600)]
    kv_cache_config = make_kv_cache_config(full_group(16), num_blocks=4, tensors=tensors)

    config = build_offloading_config(make_vllm_config(), kv_cache_config)
    assert not is_kv_cache_tensor_packed(tensors[0])
    assert config.worker_kv_bytes_per_block == 300


def test_mixed_packed_and_unpacked_tensors() -> None:
    kv_cache_config = make_kv_cache_config(
        full_group(16), num_blocks=8, tensors=[tensor(4096, block_stride=512), tensor(4096)]
    )

    with pytest.raises(ValueError, match="mix packed and unpacked"):
        build_offloading_config(make_vllm_config(), kv_cache_config)


def test_zero_blocks_means_zero_bytes_per_block() -> None:
    kv_cache_config = make_kv_cache_config(
        full_group(16), num_blocks=0, tensors=[tensor(4096, block_stride=512), tensor(4096)]
    )

    assert (
        build_offloading_config(make_vllm_config(), kv_cache_config).worker_kv_bytes_per_block == 0
    )


@pytest.mark.parametrize(
    ("groups", "use_v2", "expected"),
    [
        pytest.param([full_group(16)], False, True, id="full-attention-v1"),
        pytest.param([full_group(16)], True, False, id="v2-model-runner"),
        pytest.param([(MLAAttentionSpec(16), ["mla.0"])], False, False, id="mla"),
        pytest.param([(SlidingWindowSpec(16), ["sw.0"])], False, False, id="sliding-window"),
        pytest.param(
            [full_group(16), (SlidingWindowSpec(16), ["sw.0"])], False, False, id="two-groups"
        ),
        pytest.param([], False, False, id="no-groups"),
    ],
)
def test_is_parallelism_agnostic(
    groups: list[tuple[KVCacheSpec, list[str]]], use_v2: bool, expected: bool
) -> None:
    vllm_config = make_vllm_config(use_v2_model_runner=use_v2)
    config = build_offloading_config(vllm_config, make_kv_cache_config(*groups))

    assert config.parallel.is_parallelism_agnostic is expected


def test_release_without_v2_model_runner_flag() -> None:
    vllm_config = make_vllm_config()
    del vllm_config.use_v2_model_runner

    config = build_offloading_config(vllm_config, make_kv_cache_config(full_group(16)))
    assert config.parallel.is_parallelism_agnostic is True


@pytest.mark.parametrize(
    ("kv_events", "expected"),
    [
        pytest.param(types.SimpleNamespace(enable_kv_cache_events=True), True, id="on"),
        pytest.param(types.SimpleNamespace(enable_kv_cache_events=False), False, id="off"),
        pytest.param(None, False, id="no-events-config"),
    ],
)
def test_kv_cache_events(kv_events: Any, expected: bool) -> None:
    vllm_config = make_vllm_config(kv_events=kv_events)
    config = build_offloading_config(vllm_config, make_kv_cache_config(full_group(16)))

    assert config.enable_kv_cache_events is expected


@pytest.mark.parametrize(
    ("cache_dtype", "expected"),
    [
        pytest.param(TorchDtype("bfloat16"), "bfloat16", id="torch-dtype"),
        pytest.param("torch.float16", "float16", id="torch-prefixed-string"),
        pytest.param("fp8", "fp8", id="plain-string"),
        pytest.param("auto", "auto", id="auto-passes-through"),
    ],
)
def test_dtype(cache_dtype: Any, expected: str) -> None:
    vllm_config = make_vllm_config(cache_dtype=cache_dtype)
    config = build_offloading_config(vllm_config, make_kv_cache_config(full_group(16)))

    assert config.model.dtype == expected


def test_extra_config_mapping_becomes_a_dict() -> None:
    extra = types.MappingProxyType({"cpu_bytes_to_use": 1 << 30, "block_size": 32})
    vllm_config = make_vllm_config(extra=extra)

    config = build_offloading_config(vllm_config, make_kv_cache_config(full_group(16)))
    assert type(config.extra_config) is dict
    assert config.extra_config == {"cpu_bytes_to_use": 1 << 30, "block_size": 32}
    assert config.cache.blocks_per_chunk == 2


def test_missing_kv_transfer_config() -> None:
    with pytest.raises(ValueError, match="kv_transfer_config is None"):
        build_offloading_config(
            make_vllm_config(with_transfer=False), make_kv_cache_config(full_group(16))
        )


def test_missing_engine_id() -> None:
    with pytest.raises(ValueError, match="engine_id is None"):
        build_offloading_config(
            make_vllm_config(engine_id=None), make_kv_cache_config(full_group(16))
        )


# --- from_vllm_offloading_config --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VllmGroup:
    tokens_per_block: int
    layer_names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class VllmModel:
    name: str
    dtype: str


@dataclasses.dataclass(frozen=True)
class VllmCache:
    tokens_per_hash: int
    blocks_per_chunk: int


@dataclasses.dataclass(frozen=True)
class VllmParallel:
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    data_parallel_index: int
    is_parallelism_agnostic: bool


@dataclasses.dataclass(frozen=True)
class VllmConfigV033:
    """Shaped like the 006f89ac revision's OffloadingConfig (before 0.33.0's group ids)."""

    groups: tuple[VllmGroup, ...]
    worker_kv_bytes_per_block: int
    enable_kv_cache_events: bool
    extra_config: Mapping[str, Any]
    engine_id: str
    model: VllmModel
    cache: VllmCache
    parallel: VllmParallel
    replicated_layout: bool = False
    num_cpu_blocks: int | None = None


@dataclasses.dataclass(frozen=True)
class VllmConfigOlder:
    """Shaped like an older release: no replicated_layout, no num_cpu_blocks."""

    groups: tuple[VllmGroup, ...]
    worker_kv_bytes_per_block: int
    enable_kv_cache_events: bool
    extra_config: Mapping[str, Any]
    engine_id: str
    model: VllmModel
    cache: VllmCache
    parallel: VllmParallel


@dataclasses.dataclass(frozen=True)
class VllmGroupLater:
    tokens_per_block: int
    layer_names: tuple[str, ...]
    group_id: int


@dataclasses.dataclass(frozen=True)
class VllmConfigLater:
    """Shaped like a later variant, with fields this module does not know."""

    groups: tuple[VllmGroupLater, ...]
    worker_kv_bytes_per_block: int
    enable_kv_cache_events: bool
    extra_config: Mapping[str, Any]
    engine_id: str
    model: VllmModel
    cache: VllmCache
    parallel: VllmParallel
    replicated_layout: bool = False
    canonical_layout: bool = False
    kv_cache_layout: str | None = None
    num_cpu_blocks: int | None = None
    field_from_the_future: str = "unknown here"


VLLM_PARALLEL = VllmParallel(
    rank=1,
    world_size=2,
    tp_size=2,
    pp_size=1,
    pcp_size=1,
    dcp_size=1,
    data_parallel_index=0,
    is_parallelism_agnostic=False,
)
OUR_PARALLEL = OffloadingParallelConfig(
    rank=1,
    world_size=2,
    tp_size=2,
    pp_size=1,
    pcp_size=1,
    dcp_size=1,
    data_parallel_index=0,
    is_parallelism_agnostic=False,
)


def test_converter_reads_every_v033_field() -> None:
    vllm_config = VllmConfigV033(
        groups=(VllmGroup(16, ("a.0", "a.1")), VllmGroup(32, ("b.0",))),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=True,
        extra_config=types.MappingProxyType({"cpu_bytes_to_use": 123}),
        engine_id="e_dp0",
        model=VllmModel("org/model", "bfloat16"),
        cache=VllmCache(tokens_per_hash=16, blocks_per_chunk=4),
        parallel=VLLM_PARALLEL,
        replicated_layout=True,
        num_cpu_blocks=777,
    )

    config = from_vllm_offloading_config(vllm_config)

    assert config == OffloadingConfig(
        groups=(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=("a.0", "a.1")),
            OffloadingGroupConfig(tokens_per_block=32, layer_names=("b.0",)),
        ),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": 123},
        engine_id="e_dp0",
        model=OffloadingModelConfig(name="org/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
        parallel=OUR_PARALLEL,
        replicated_layout=True,
        num_cpu_blocks=777,
    )
    assert type(config.extra_config) is dict


def test_converter_defaults_fields_an_older_release_lacks() -> None:
    vllm_config = VllmConfigOlder(
        groups=[VllmGroup(16, ("a.0",))],  # type: ignore[arg-type]  # a list where vLLM holds a tuple
        worker_kv_bytes_per_block=10,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="e",
        model=VllmModel("m", "float16"),
        cache=VllmCache(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=VLLM_PARALLEL,
    )

    config = from_vllm_offloading_config(vllm_config)

    assert config.replicated_layout is False
    assert config.num_cpu_blocks is None
    assert config.groups == (OffloadingGroupConfig(tokens_per_block=16, layer_names=("a.0",)),)
    assert config.parallel == OUR_PARALLEL


def test_converter_carries_0_33_fields_and_ignores_unknown_ones() -> None:
    vllm_config = VllmConfigLater(
        groups=(VllmGroupLater(16, ("a.0",), group_id=3),),
        worker_kv_bytes_per_block=10,
        enable_kv_cache_events=False,
        extra_config={"canonical_layout": True},
        engine_id="e",
        model=VllmModel("m", "float16"),
        cache=VllmCache(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=VLLM_PARALLEL,
        canonical_layout=True,
        kv_cache_layout="HND",
        num_cpu_blocks=5,
    )

    config = from_vllm_offloading_config(vllm_config)

    assert config.groups == (
        OffloadingGroupConfig(tokens_per_block=16, layer_names=("a.0",), group_id=3),
    )
    assert config.num_cpu_blocks == 5
    assert config.canonical_layout is True
    assert config.kv_cache_layout == "HND"
    assert not hasattr(config, "field_from_the_future")


def test_converter_rejects_a_missing_required_field() -> None:
    obj = types.SimpleNamespace(groups=(), worker_kv_bytes_per_block=0)

    with pytest.raises(ValueError, match="enable_kv_cache_events"):
        from_vllm_offloading_config(obj)


def test_converter_round_trips_our_own_build() -> None:
    vllm_config = make_vllm_config(tp=2, extra={"block_size": 32})
    built = build_offloading_config(vllm_config, make_kv_cache_config(full_group(16)))
    as_vllm = VllmConfigV033(
        groups=tuple(VllmGroup(g.tokens_per_block, g.layer_names) for g in built.groups),
        worker_kv_bytes_per_block=built.worker_kv_bytes_per_block,
        enable_kv_cache_events=built.enable_kv_cache_events,
        extra_config=built.extra_config,
        engine_id=built.engine_id,
        model=VllmModel(built.model.name, built.model.dtype),
        cache=VllmCache(**msgspec.structs.asdict(built.cache)),
        parallel=VllmParallel(
            *(getattr(built.parallel, f.name) for f in dataclasses.fields(VllmParallel))
        ),
    )

    assert from_vllm_offloading_config(as_vllm) == built


# --- config_differences -----------------------------------------------------------------


def sample_config(**changes: Any) -> OffloadingConfig:
    base = OffloadingConfig(
        groups=(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=("a.0", "a.1")),
            OffloadingGroupConfig(tokens_per_block=32, layer_names=("b.0",)),
        ),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": 1 << 30},
        engine_id="engine_dp0",
        model=OffloadingModelConfig(name="org/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=2,
            tp_size=2,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            is_parallelism_agnostic=True,
        ),
        num_cpu_blocks=100,
    )
    return msgspec.structs.replace(base, **changes)


def test_equal_configs_have_no_differences() -> None:
    assert config_differences(sample_config(), sample_config()) == []


def test_differences_name_dotted_paths_and_both_values() -> None:
    a = sample_config()
    b = sample_config(
        model=OffloadingModelConfig(name="org/model", dtype="float16"),
        parallel=msgspec.structs.replace(a.parallel, world_size=4, tp_size=4),
        groups=(
            a.groups[0],
            OffloadingGroupConfig(tokens_per_block=64, layer_names=("b.0",)),
        ),
        extra_config={"cpu_bytes_to_use": 1},
        num_cpu_blocks=None,
    )

    assert config_differences(a, b) == [
        ("groups[1].tokens_per_block", 32, 64),
        ("extra_config", {"cpu_bytes_to_use": 1 << 30}, {"cpu_bytes_to_use": 1}),
        ("model.dtype", "bfloat16", "float16"),
        ("parallel.world_size", 2, 4),
        ("parallel.tp_size", 2, 4),
        ("num_cpu_blocks", 100, None),
    ]


def test_groups_of_different_length_are_reported_whole() -> None:
    a = sample_config()
    b = sample_config(groups=a.groups[:1])

    assert config_differences(a, b) == [("groups", a.groups, b.groups)]


def test_differences_honour_ignore() -> None:
    a = sample_config()
    b = sample_config(
        worker_kv_bytes_per_block=2048,
        parallel=msgspec.structs.replace(a.parallel, rank=1),
        groups=(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=("x.0",)),
            OffloadingGroupConfig(tokens_per_block=32, layer_names=("y.0",)),
        ),
        model=OffloadingModelConfig(name="other", dtype="float16"),
    )

    ignore = frozenset(
        {"parallel.rank", "worker_kv_bytes_per_block", "groups[*].layer_names", "model"}
    )
    assert config_differences(a, b, ignore=ignore) == []
    assert config_differences(a, b, ignore=frozenset({"groups[0].layer_names", "model"})) == [
        ("groups[1].layer_names", ("b.0",), ("y.0",)),
        ("worker_kv_bytes_per_block", 4096, 2048),
        ("parallel.rank", 0, 1),
    ]


# --- wire -------------------------------------------------------------------------------


def test_msgpack_round_trip_as_maps() -> None:
    config = sample_config(replicated_layout=True)
    data = msgspec.msgpack.encode(config)

    assert msgspec.msgpack.decode(data, type=OffloadingConfig) == config
    raw = msgspec.msgpack.decode(data)
    assert isinstance(raw, dict)
    assert raw["model"] == {"name": "org/model", "dtype": "bfloat16", "max_model_len": 0}
    assert raw["groups"][1] == {
        "tokens_per_block": 32,
        "layer_names": ["b.0"],
        "group_id": None,
        "sliding_window_size_in_chunks": None,
    }


def test_decoding_a_config_from_an_older_peer_fills_defaults() -> None:
    raw = msgspec.to_builtins(sample_config())
    del raw["replicated_layout"], raw["num_cpu_blocks"]
    raw["a_field_from_the_future"] = 1

    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=OffloadingConfig)
    assert decoded == sample_config(num_cpu_blocks=None)


texts = st.text(max_size=12)
sizes = st.integers(min_value=0, max_value=2**40)
json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | texts

configs = offloading_configs(
    sizes, texts, st.dictionaries(texts, json_scalars | st.lists(json_scalars, max_size=3))
)


@property_settings(100, database=None)
@given(configs)
def test_msgpack_round_trip_property(config: OffloadingConfig) -> None:
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=OffloadingConfig)

    assert decoded == config
    assert config_differences(config, decoded) == []

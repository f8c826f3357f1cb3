"""The offloading config a rank hands the daemon, and the two ways a rank obtains it.

The Structs mirror vLLM 0.33's ``vllm/v1/kv_offload/config.py`` field for field, names and
order included (checked against the installed vLLM 0.33.0; ``num_cpu_blocks`` is kept from an
earlier revision, 006f89ac). They travel inside msgpack messages as maps, so a field is only ever
appended, with a default.

- ``build_offloading_config(vllm_config, kv_cache_config)`` is vLLM's translation exactly
  (``build_offloading_config`` in
  ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py``), duck-typed so that vLLM
  is not a dependency. Spec classes are recognised by class name, so vLLM's own classes and
  test stand-ins with the same names both work.
- ``from_vllm_offloading_config(obj)`` converts vLLM's own ``OffloadingConfig`` dataclass of any
  release, for a rank that can call vLLM's function itself.
- ``config_differences(a, b, ignore=...)`` names every field on which two configs disagree, so a
  handshake can say which field differs.

Imports msgspec and the standard library only.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

__all__ = [
    "OffloadingCacheConfig",
    "OffloadingConfig",
    "OffloadingGroupConfig",
    "OffloadingModelConfig",
    "OffloadingParallelConfig",
    "build_offloading_config",
    "config_differences",
    "from_vllm_offloading_config",
    "is_kv_cache_tensor_packed",
    "resolve_kv_cache_block_sizes",
]


class OffloadingGroupConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One offloaded KV cache group.

    ``group_id`` is the group's index in vLLM's ``KVCacheConfig`` (offloaded groups can be a
    subset, so it is not always the position in ``OffloadingConfig.groups``); it is the group
    an ``OffloadKey`` names. None (configs from before 0.33) means the position.
    """

    # Total token span of one block across all workers (context parallelism included).
    tokens_per_block: int
    layer_names: tuple[str, ...]
    group_id: int | None = None
    # Chunks of this group kept for one request; None for full attention.
    sliding_window_size_in_chunks: int | None = None


class OffloadingModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The model and the KV cache dtype (``"bfloat16"``, ``"fp8"``, ...; no ``torch.``)."""

    name: str
    dtype: str
    # Longest request the engine accepts, in tokens; 0 when not known.
    max_model_len: int = 0


class OffloadingCacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Hashing and chunking granularity: tokens per block hash, GPU blocks per stored chunk."""

    tokens_per_hash: int
    blocks_per_chunk: int


class OffloadingParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where this process sits in its engine. ``rank`` is 0 on the scheduler side too."""

    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    data_parallel_index: int
    # True when concatenating a block's bytes across all workers gives the same result
    # whatever the parallel config.
    is_parallelism_agnostic: bool
    data_parallel_size: int = 1
    # Local rank of the data parallel group, set only in SPMD mode.
    data_parallel_rank_local: int | None = None


class OffloadingConfig(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's normalized offloading config, as one process (scheduler or worker) built it."""

    groups: tuple[OffloadingGroupConfig, ...]
    # KV bytes one worker holds for one GPU block, over all layers and groups.
    worker_kv_bytes_per_block: int
    enable_kv_cache_events: bool
    # kv_connector_extra_config, passed through.
    extra_config: dict[str, Any]
    # Unique per engine and distinct per DP rank.
    engine_id: str
    model: OffloadingModelConfig
    cache: OffloadingCacheConfig
    parallel: OffloadingParallelConfig
    # Every worker's offloaded bytes are identical per block, so one host copy is enough.
    replicated_layout: bool = False
    # CPU block count unified across workers, when vLLM precomputed one (before 0.33).
    num_cpu_blocks: int | None = None
    # The canonical per-layer host byte layout was requested (vLLM 0.33).
    canonical_layout: bool = False
    # Resolved KVCacheLayout name of the worker KV cache ("NHD", "HND", ...), when known.
    kv_cache_layout: str | None = None

    def group_ids(self) -> tuple[int, ...]:
        """The KV-cache group id of each entry of ``groups`` (what keys name)."""
        return tuple(
            index if group.group_id is None else group.group_id
            for index, group in enumerate(self.groups)
        )


# vLLM's AttentionSpec subclasses. Real vLLM specs carry "AttentionSpec" in their MRO anyway;
# the explicit names let flat stand-ins (no shared base class) count as attention too.
_ATTENTION_SPEC_NAMES = frozenset(
    {
        "AttentionSpec",
        "FullAttentionSpec",
        "MLAAttentionSpec",
        "SlidingWindowSpec",
        "SlidingWindowMLASpec",
        "ChunkedLocalAttentionSpec",
        "CrossAttentionSpec",
        "SinkFullAttentionSpec",
        "EncoderOnlyAttentionSpec",
    }
)


def _class_names(obj: object) -> frozenset[str]:
    """Names of every class ``obj`` is an instance of: a duck-typed ``isinstance``."""
    return frozenset(cls.__name__ for cls in type(obj).__mro__)


def _is_attention_spec(spec: object) -> bool:
    return not _ATTENTION_SPEC_NAMES.isdisjoint(_class_names(spec))


def is_kv_cache_tensor_packed(kv_cache_tensor: Any) -> bool:
    """Whether a ``KVCacheTensor`` uses a packed block stride (releases without the field: no)."""
    return bool(getattr(kv_cache_tensor, "block_stride", 0))


def _context_parallel_sizes(parallel_config: Any) -> tuple[int, int]:
    """(dcp, pcp); releases before context parallelism lack the attributes, meaning 1."""
    dcp = getattr(parallel_config, "decode_context_parallel_size", 1)
    pcp = getattr(parallel_config, "prefill_context_parallel_size", 1)
    return dcp, pcp


def resolve_kv_cache_block_sizes(kv_cache_config: Any, vllm_config: Any) -> tuple[int, int]:
    """Return ``(scheduler_block_size, tokens_per_hash)`` as vLLM resolves them.

    Mirrors ``resolve_kv_cache_block_sizes`` in vLLM's ``vllm/v1/core/kv_cache_utils.py``
    (commit 006f89ac), duck-typed:

    - One group: both are ``cache_config.block_size * dcp`` (that revision does not multiply
      by pcp).
    - Several groups: attention groups count ``block_size * dcp``, others (Mamba)
      ``block_size``; the scheduler block size is their LCM. The hash size is
      ``cache_config.prefix_match_unit`` (older releases: ``hash_block_size``) when set, else
      the GCD, and every group size must be a multiple of it. It falls back to the scheduler
      block size when neither prefix caching nor a KV connector is on, or when a Mamba
      group's block size differs from ``cache_config.block_size`` (no "align" mode).
    """
    cache_config = vllm_config.cache_config
    dcp, _ = _context_parallel_sizes(vllm_config.parallel_config)
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())

    if len(groups) <= 1:
        size: int = cache_config.block_size * dcp
        return size, size

    group_block_sizes: list[int] = [
        g.kv_cache_spec.block_size * dcp
        if _is_attention_spec(g.kv_cache_spec)
        else g.kv_cache_spec.block_size
        for g in groups
    ]
    scheduler_block_size = math.lcm(*group_block_sizes)

    # Block hashes are only consumed by prefix caching and KV connectors.
    connector_enabled = getattr(vllm_config, "kv_transfer_config", None) is not None
    if not (getattr(cache_config, "enable_prefix_caching", False) or connector_enabled):
        return scheduler_block_size, scheduler_block_size

    # A Mamba group outside "align" mode breaks divisibility: hash at the scheduler size.
    if any(
        "MambaSpec" in _class_names(g.kv_cache_spec)
        and g.kv_cache_spec.block_size != cache_config.block_size
        for g in groups
    ):
        return scheduler_block_size, scheduler_block_size

    requested = getattr(cache_config, "prefix_match_unit", None)
    if requested is None:
        requested = getattr(cache_config, "hash_block_size", None)
    hash_block_size: int = requested if requested is not None else math.gcd(*group_block_sizes)
    if any(bs % hash_block_size != 0 for bs in group_block_sizes):
        raise ValueError(
            f"Invalid prefix_match_unit={hash_block_size}; all KV cache group "
            f"block sizes must be divisible by prefix_match_unit. "
            f"Got group block sizes={group_block_sizes}."
        )
    return scheduler_block_size, hash_block_size


def build_offloading_config(vllm_config: Any, kv_cache_config: Any) -> OffloadingConfig:
    """Translate vLLM configuration into an ``OffloadingConfig``, exactly as vLLM's does.

    vLLM's assertions raise ``ValueError`` with vLLM's messages (asserts vanish under
    ``python -O``). ``replicated_layout`` and ``num_cpu_blocks`` keep their defaults: vLLM's
    function does not set them.
    """
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    if kv_transfer_config is None:
        raise ValueError("vllm_config.kv_transfer_config is None")
    extra_config = kv_transfer_config.kv_connector_extra_config
    # msgspec encodes plain dicts; vLLM may hand any Mapping.
    extra_config = dict(extra_config) if extra_config is not None else {}
    if kv_transfer_config.engine_id is None:
        raise ValueError("kv_transfer_config.engine_id is None")
    engine_id = kv_transfer_config.engine_id

    parallel_config = vllm_config.parallel_config
    dcp_size, pcp_size = _context_parallel_sizes(parallel_config)
    context_parallel_factor = dcp_size * pcp_size
    groups = tuple(
        OffloadingGroupConfig(
            tokens_per_block=(group.kv_cache_spec.block_size * context_parallel_factor),
            layer_names=tuple(group.layer_names),
        )
        for group in kv_cache_config.kv_cache_groups
    )

    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    for group in groups:
        if group.tokens_per_block % tokens_per_hash != 0:
            raise ValueError(
                f"tokens_per_block={group.tokens_per_block} not divisible by "
                f"tokens_per_hash={tokens_per_hash}. "
                f"Hybrid models (e.g. Mamba+Attention) need "
                f"--enable-prefix-caching to align block sizes."
            )

    blocks_per_chunk = 1
    tokens_per_chunk = extra_config.get("block_size")
    if tokens_per_chunk is not None:
        tokens_per_chunk_int = int(tokens_per_chunk)
        unique_tokens_per_block = {group.tokens_per_block for group in groups}
        if len(unique_tokens_per_block) != 1:
            raise ValueError(
                "If 'block_size' is specified in kv_connector_extra_config, "
                "there must be at least one KV cache group, "
                "and all groups must have the same block size."
            )
        tokens_per_block = unique_tokens_per_block.pop()
        if tokens_per_chunk_int % tokens_per_block != 0:
            raise ValueError(
                f"block_size={tokens_per_chunk_int} in kv_connector_extra_config is not "
                f"divisible by tokens_per_block={tokens_per_block}."
            )
        blocks_per_chunk = tokens_per_chunk_int // tokens_per_block

    worker_kv_bytes_per_block = 0
    if kv_cache_config.num_blocks > 0:
        packed_tensors = tuple(
            is_kv_cache_tensor_packed(tensor) for tensor in kv_cache_config.kv_cache_tensors
        )
        is_packed = any(packed_tensors)
        if is_packed and not all(packed_tensors):
            raise ValueError("KV cache tensors mix packed and unpacked layouts.")
        total_gpu_kv_bytes = (
            kv_cache_config.kv_cache_tensors[0].size
            if is_packed
            else sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors)
        )
        worker_kv_bytes_per_block = total_gpu_kv_bytes // kv_cache_config.num_blocks

    # Only a single non-MLA full-attention group is parallelism-invariant:
    # MLA latent KV is replicated per rank (never head-sharded), and the V2
    # model runner's KV layout is not known to be parallelism-invariant.
    single_group = (
        kv_cache_config.kv_cache_groups[0].kv_cache_spec
        if len(kv_cache_config.kv_cache_groups) == 1
        else None
    )
    single_group_names = _class_names(single_group) if single_group is not None else frozenset()
    is_parallelism_agnostic = (
        not getattr(vllm_config, "use_v2_model_runner", False)
        and single_group is not None
        and "FullAttentionSpec" in single_group_names
        and "MLAAttentionSpec" not in single_group_names
    )

    kv_events_config = getattr(vllm_config, "kv_events_config", None)
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=bool(
            kv_events_config is not None and kv_events_config.enable_kv_cache_events
        ),
        extra_config=extra_config,
        engine_id=engine_id,
        model=OffloadingModelConfig(
            name=vllm_config.model_config.model,
            dtype=str(vllm_config.cache_config.cache_dtype).replace("torch.", ""),
        ),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_hash,
            blocks_per_chunk=blocks_per_chunk,
        ),
        parallel=OffloadingParallelConfig(
            rank=parallel_config.rank,
            world_size=parallel_config.world_size,
            tp_size=parallel_config.tensor_parallel_size,
            pp_size=parallel_config.pipeline_parallel_size,
            pcp_size=pcp_size,
            dcp_size=dcp_size,
            data_parallel_index=parallel_config.data_parallel_index,
            is_parallelism_agnostic=is_parallelism_agnostic,
        ),
    )


def from_vllm_offloading_config(obj: Any) -> OffloadingConfig:
    """Convert vLLM's own ``OffloadingConfig`` dataclass, of any release.

    Fields are read by attribute name, nested configs included. A field the release lacks
    takes our default (a missing required field raises ``msgspec.ValidationError``, a
    ``ValueError``); attributes we do not know are ignored; sequences become tuples and any
    ``Mapping`` a dict.
    """
    # from_attributes walks our Struct fields and reads each one off the object by name.
    return msgspec.convert(obj, OffloadingConfig, from_attributes=True)


_INDEX = re.compile(r"\[\d+\]")


def config_differences(
    a: OffloadingConfig,
    b: OffloadingConfig,
    *,
    ignore: frozenset[str] = frozenset(),
) -> list[tuple[str, Any, Any]]:
    """Every ``(dotted_path, value_in_a, value_in_b)`` on which two configs differ.

    Nested configs are compared field by field (``"model.dtype"``), tuples of configs element
    by element (``"groups[1].tokens_per_block"``); a tuple whose length differs, and any
    other value, is reported whole. A path in ``ignore`` is skipped with everything below it;
    ``[*]`` in an ignored path matches any index (``"groups[*].layer_names"``).
    """
    differences: list[tuple[str, Any, Any]] = []
    _collect_differences("", a, b, ignore, differences)
    return differences


def _collect_differences(
    path: str,
    a: Any,
    b: Any,
    ignore: frozenset[str],
    out: list[tuple[str, Any, Any]],
) -> None:
    if path and (path in ignore or _INDEX.sub("[*]", path) in ignore):
        return
    if isinstance(a, msgspec.Struct) and type(a) is type(b):
        if a == b:
            return  # the usual case (ranks that agree), answered without a walk
        for name in type(a).__struct_fields__:
            child = f"{path}.{name}" if path else name
            _collect_differences(child, getattr(a, name), getattr(b, name), ignore, out)
    elif (
        isinstance(a, tuple)
        and isinstance(b, tuple)
        and len(a) == len(b)
        and any(isinstance(item, msgspec.Struct) for item in (*a, *b))
    ):
        for index, (item_a, item_b) in enumerate(zip(a, b, strict=True)):
            _collect_differences(f"{path}[{index}]", item_a, item_b, ignore, out)
    elif a != b:
        out.append((path, a, b))

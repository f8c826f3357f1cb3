"""Drive vLLM 0.33's real Scheduler and real OffloadingConnector on a CPU host.

The harness plays the engine core and every worker rank of one vLLM engine in
this process, with no model and no GPU: a simulated forward pass writes
deterministic bytes into the KV pages of the scheduled tokens, so what an
offloading spec stores and loads can be checked byte for byte.

Usage::

    from tests.vllm.harness import VllmHarness

    extra = {"spec_name": "MySpec", "spec_module_path": "my.module", "block_size": 32}
    with VllmHarness(tmp_path, extra, tensor_parallel_size=2) as h:
        a = h.add_request(prompt, max_tokens=2)
        h.run_until_finished()                  # A computes, the connector stores
        h.reset_prefix_cache()                  # drop the GPU prefix cache, zero all KV
        b = h.add_request(prompt[:64] + other, max_tokens=2)
        h.run_until_finished()                  # B loads its shared prefix
        assert h.external_tokens(b) == 64       # what get_num_new_matched_tokens gave
        h.assert_loaded_pages(b)                # every loaded page == A's bytes

What is real vLLM: `VllmConfig` (from `EngineArgs` over a config.json-only tiny
Llama), the KV cache layout (`resolve_kv_cache_layout`, which takes the
connector's preferred layout), `get_kv_cache_configs`, the per-rank KV tensors
(`vllm.v1.worker.utils.allocate_kv_cache` / `create_kv_cache_views`), the
`Scheduler` / `AsyncScheduler` with its scheduler-role connector, one
worker-role connector per rank (`KVConnectorFactory.create_connector`) given
the layer caches through `register_kv_caches` (the connector builds the
`CanonicalKVCaches` itself), the per-step connector calls (vLLM's own
`KVConnectorModelRunnerMixin._get_kv_connector_output`), `KVOutputAggregator`
and `update_from_output`, and the KV event publisher.

What is simulated: the forward pass and the sampler (a Mamba layer's state: see
`VllmHarness`'s ``model``). For token position p of a
request, every layer l on rank r holds ``token_kv_bytes(prefix[:p+1], l, first_head(r),
heads, width)`` in its slot: each of the rank's heads (K and V) holds the bytes of its
*global* head index, so the same prefix always gives the same bytes, on every engine (DP),
after every recompute and at every TP size (a TP=2 rank holds the half of a TP=1 rank's
heads that it owns: what the canonical layout's sharing needs), and differs between heads
and layers (``first_head(r)`` is ``kv_rank(r) * heads``: MLA's one latent head is the same
on every rank); the token sampled after a prefix is ``sampled_token(prefix)``. Before
writing, the forward pass checks that every token before the scheduled range (whether
prefix-cached or loaded) already holds its bytes, on every rank and layer -- what attention
would read -- and raises `KVMismatchError` if not.

One step (`VllmHarness.step`), in vLLM's order::

    scheduler.schedule()          # connector: get_num_new_matched_tokens,
                                  #   update_state_after_alloc, build_connector_meta
    for each rank:                # Worker.execute_model -> GPUModelRunner.execute_model
        connector.handle_preemptions(metadata)
        zero scheduler_output.new_block_ids_to_zero          # _update_states
        with set_forward_context(None, ...),
             KVConnectorModelRunnerMixin._get_kv_connector_output(so):
            #   bind_connector_metadata; start_load_kv first iff so.has_sync_kv_loads
            forward pass          # check the context's KV, write the new tokens' KV
            #   start_load_kv (otherwise: after the forward launch); wait_for_save;
            #   get_transfer_results (-> get_finished); get_block_ids_with_load_errors;
            #   get_kv_connector_stats; get_kv_connector_kv_cache_events;
            #   build_connector_worker_meta; clear_connector_metadata
    sample                        # the same on every rank
    KVOutputAggregator.aggregate(rank outputs, output_rank=0)
    scheduler.update_from_output  # connector: update_connector_output,
                                  #   request_finished, take_events -> publisher

With async scheduling (`AsyncScheduler`) update_from_output runs a step late:
step N+1 is scheduled and executed first, as EngineCore.step_with_batch_queue
does with its queue of `vllm_config.max_concurrent_batches` (2) batches.

The KV memory of each rank is one int8 buffer over a MAP_SHARED mapping of its
own file in /dev/shm (`RankState.buffer.path`), so a spec's worker can find the
file and offset of any page through /proc/self/maps (see `backing_file`). With
``kv_memory="memfd"`` it is a memfd instead (the harness keeps its descriptor
open; ``path`` is the name offloadd's plugin gives it), as a CPU host should
allocate it for offloadd (``offloadd.vllm.regions``).

Import this module before anything else imports vLLM (tests/vllm/conftest.py
does): it sets ``VLLM_TARGET_DEVICE=cpu`` and imports vLLM without turning the
deprecation warning torch raises on the way into an error.

Ranks: ``rank`` below is the worker rank within the engine
(``parallel_config.rank``, 0..tensor_parallel_size-1). ``layer`` is an index
into `VllmHarness.layer_names`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import mmap
import os
import struct
import tempfile
import time
import uuid
import warnings
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq
from torch.overrides import TorchFunctionMode

from offloadd.vllm.regions import shared_file_of  # a pure module: it imports no vLLM

# vLLM resolves its platform from the environment on first use: the harness runs
# vLLM's CPU platform (no accelerator is involved).
os.environ["VLLM_TARGET_DEVICE"] = "cpu"

with warnings.catch_warnings():
    # torch.utils.mkldnn uses the deprecated torch.jit.script_method, and vLLM's
    # scheduler imports it (through torch.compile) while it is imported.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning
    )
    from vllm.config import KVEventsConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import set_forward_context
    from vllm.platforms import current_platform
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.utils import (
        _DEFAULT_LAYOUT_PREFERENCE,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
        update_kv_cache_capacity,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
    from vllm.v1.worker.utils import allocate_kv_cache

# The tiny model: what `write_model_dir` writes and the KV specs mirror.
VOCAB_SIZE = 1000
NUM_LAYERS = 2
NUM_KV_HEADS = 2
NUM_HEADS = 4
HIDDEN_SIZE = 64
HEAD_SIZE = HIDDEN_SIZE // NUM_HEADS
KV_DTYPE = torch.bfloat16
# The tiny MLA model (``model="mla"``, a DeepSeek-V2 config): one latent vector per token and
# layer, ``MLA_KV_LORA_RANK + MLA_ROPE_DIM`` wide, the same on every TP rank.
MLA_NUM_HEADS = 8
MLA_KV_LORA_RANK = 32
MLA_ROPE_DIM = 16
MLA_HEAD_SIZE = MLA_KV_LORA_RANK + MLA_ROPE_DIM
# The tiny hybrid model (``model="hybrid"``, a Qwen2 with per-layer ``layer_types``): sliding-window
# layers of `HYBRID_WINDOW` tokens interleaved with full-attention layers, Llama's head layout.
# vLLM's hybrid KV cache manager gives each layer type its own KV cache group; one layer of each
# group shares a KV tensor (block ids come from one pool).
HYBRID_LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
HYBRID_WINDOW = 20
# The tiny Mamba hybrid (``model="mamba"``): a Llama whose even layers report a Mamba state
# (vLLM's ``MambaSpec`` in prefix caching's "align" mode: block ``i`` holds the state after
# exactly ``(i + 1) * block_size`` tokens) and odd layers full attention. A Mamba page is one
# state: a conv and an SSM part, as wide as an attention page so both groups share one pool.
MAMBA_LAYER_TYPES = ("mamba", "full_attention", "mamba", "full_attention")
MODELS = ("llama", "mla", "hybrid", "mamba")

_HASH_SEED = b"offloadd-vllm-harness"


class KVMismatchError(AssertionError):
    """A KV page or token slot does not hold the bytes its prefix determines."""


# --------------------------------------------------------------------------- model


def write_model_dir(path: Path, model: str = "llama", num_kv_heads: int = NUM_KV_HEADS) -> Path:
    """Write a config.json-only tiny model (a Llama; with ``model="mla"`` a DeepSeek-V2
    whose attention is MLA; with ``model="hybrid"`` a Qwen2 of sliding-window and
    full-attention layers; with ``model="mamba"`` a Llama of `MAMBA_LAYER_TYPES`' length,
    whose Mamba layers only the KV specs know) of ``num_kv_heads`` KV heads (not MLA) into
    `path` (created); return `path`."""
    path.mkdir(parents=True, exist_ok=True)
    if model == "mla":
        mla = {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "hidden_size": HIDDEN_SIZE,
            "intermediate_size": 2 * HIDDEN_SIZE,
            "moe_intermediate_size": HIDDEN_SIZE,
            "first_k_dense_replace": NUM_LAYERS,  # no MoE layer
            "num_attention_heads": MLA_NUM_HEADS,
            "num_key_value_heads": MLA_NUM_HEADS,
            "num_hidden_layers": NUM_LAYERS,
            "kv_lora_rank": MLA_KV_LORA_RANK,
            "qk_rope_head_dim": MLA_ROPE_DIM,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        }
        (path / "config.json").write_text(json.dumps(mla, indent=1))
        return path
    if model == "hybrid":
        hybrid = {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": HIDDEN_SIZE,
            "intermediate_size": 2 * HIDDEN_SIZE,
            "num_attention_heads": NUM_HEADS,
            "num_key_value_heads": num_kv_heads,
            "num_hidden_layers": len(HYBRID_LAYER_TYPES),
            "layer_types": list(HYBRID_LAYER_TYPES),
            "use_sliding_window": True,
            "sliding_window": HYBRID_WINDOW,
            "max_window_layers": 0,
            "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        }
        (path / "config.json").write_text(json.dumps(hybrid, indent=1))
        return path
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": 2 * HIDDEN_SIZE,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": len(MAMBA_LAYER_TYPES) if model == "mamba" else NUM_LAYERS,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def layer_name(layer: int) -> str:
    """The attention layer name vLLM gives layer `layer` of a Llama."""
    return f"model.layers.{layer}.self_attn.attn"


# ------------------------------------------------------------- deterministic bytes


def prefix_hashes(tokens: Sequence[int]) -> list[bytes]:
    """Chained hash of every prefix: ``out[p]`` identifies ``tokens[: p + 1]``."""
    out: list[bytes] = []
    h = _HASH_SEED
    for token in tokens:
        h = hashlib.blake2b(h + struct.pack("<I", token), digest_size=16).digest()
        out.append(h)
    return out


def _slot_bytes(prefix_hash: bytes, layer: int, first_head: int, heads: int, width: int) -> bytes:
    """One token's slot: ``width`` bytes of each global head ``first_head ...``, in order."""
    return b"".join(
        hashlib.shake_128(prefix_hash + struct.pack("<II", layer, head)).digest(width)
        for head in range(first_head, first_head + heads)
    )


def token_kv_bytes(
    prefix: Sequence[int], layer: int, first_head: int, heads: int, width: int
) -> bytes:
    """The bytes the forward pass writes for the last token of `prefix` (see the module)."""
    return _slot_bytes(prefix_hashes(prefix)[-1], layer, first_head, heads, width)


def _sample(prefix_hash: bytes) -> int:
    return int.from_bytes(prefix_hash[:4], "little") % VOCAB_SIZE


def sampled_token(prefix: Sequence[int]) -> int:
    """The token the simulated sampler picks after `prefix`."""
    return _sample(prefix_hashes(prefix)[-1])


# ------------------------------------------------------------------ shm-backed KV


@dataclass
class ShmBuffer:
    """An int8 tensor over a MAP_SHARED mapping of a file (in /dev/shm), or of a memfd
    whose descriptor it keeps (`memfd`)."""

    path: Path
    size: int
    _mmap: mmap.mmap
    tensor: torch.Tensor
    memfd: int | None = None

    @classmethod
    def create(cls, path: Path, size: int) -> ShmBuffer:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        tensor = torch.frombuffer(mapping, dtype=torch.int8)
        return cls(path=path, size=size, _mmap=mapping, tensor=tensor)

    @classmethod
    def create_memfd(cls, name: str, size: int) -> ShmBuffer:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        tensor = torch.frombuffer(mapping, dtype=torch.int8)
        label, _ = shared_file_of(tensor.data_ptr(), size)  # the name the plugin gives it
        return cls(path=Path(label), size=size, _mmap=mapping, tensor=tensor, memfd=fd)

    def close(self) -> None:
        """Unlink the file (close the memfd); unmap unless views of the tensor are alive."""
        if self.memfd is not None:
            os.close(self.memfd)
            self.memfd = None
        else:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        del self.tensor
        # Views (e.g. a spec's worker) may outlive the harness; then the
        # mapping goes when they do.
        with contextlib.suppress(BufferError):
            self._mmap.close()


class _BackKVWithShm(TorchFunctionMode):
    """Serve vLLM's one KV backing allocation (``torch.zeros(n, int8)`` in
    `allocate_kv_cache`) from a /dev/shm file mapping instead."""

    def __init__(self, make_buffer: Any):
        super().__init__()
        self._make_buffer = make_buffer
        self.buffers: list[ShmBuffer] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.zeros and kwargs.get("dtype") is torch.int8 and len(args) == 1:
            (size,) = args
            device = torch.device(kwargs.get("device", "cpu"))
            assert device.type == "cpu", device
            buffer = self._make_buffer(int(size))
            self.buffers.append(buffer)
            return buffer.tensor
        return func(*args, **kwargs)


def backing_file(ptr: int) -> tuple[str, int]:
    """(path, file offset) of the shared file mapping holding address `ptr`,
    read from /proc/self/maps the way a spec's worker would."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= ptr < end:
                perms, offset = fields[1], int(fields[2], 16)
                path = fields[5].strip() if len(fields) == 6 else ""
                if "s" not in perms or not path.startswith("/"):
                    raise LookupError(f"{ptr:#x} is not in a shared file mapping: {line!r}")
                return path, offset + (ptr - start)
    raise LookupError(f"{ptr:#x} is not mapped")


# -------------------------------------------------------------------- KV events


class KVEventSubscriber:
    """A zmq SUB socket on an engine's KV event endpoint, decoding batches
    with vLLM's own `KVEventBatch`. Get one from `VllmHarness.subscribe_kv_events`."""

    def __init__(self, endpoint: str):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def receive(self, timeout: float) -> tuple[int, KVEventBatch] | None:
        """The next (sequence number, batch), or None after `timeout` seconds."""
        if not self._sock.poll(int(timeout * 1000)):
            return None
        _topic, seq, payload = self._sock.recv_multipart()
        return int.from_bytes(seq, "big"), self._decoder.decode(payload)

    def drain(self, timeout: float = 0.2) -> list[KVEventBatch]:
        """Every batch that arrives until none has for `timeout` seconds."""
        batches = []
        while (got := self.receive(timeout)) is not None:
            batches.append(got[1])
        return batches

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


# ------------------------------------------------------------------- bookkeeping


@dataclass(frozen=True)
class MatchCall:
    """One call of the scheduler connector's get_num_new_matched_tokens."""

    step: int
    num_computed_tokens: int
    num_matched: int | None
    load_async: bool


@dataclass(frozen=True)
class LoadJob:
    """A load job the scheduler connector put in a step's metadata."""

    step: int
    job_id: int
    req_id: str
    dst: GPULoadStoreSpec
    sync: bool


@dataclass(frozen=True)
class StoreJob:
    """A store job the scheduler connector put in a step's metadata."""

    step: int
    job_id: int
    req_id: str
    src: GPULoadStoreSpec


@dataclass
class RankState:
    """One worker rank: its config, KV memory, layer views and connector."""

    rank: int
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    buffer: ShmBuffer
    # layer name -> the view vLLM allocated (what register_kv_caches got)
    kv_caches: dict[str, torch.Tensor]
    # layer name -> the same memory as int8 (blocks, heads, tokens, bytes)
    kv_bytes: dict[str, torch.Tensor]
    connector: KVConnectorBase
    # Every step's KVConnectorOutput of this rank, before aggregation.
    outputs: list[KVConnectorOutput] = field(default_factory=list)

    @property
    def offloading_worker(self) -> Any:
        """The spec's OffloadingWorker (from get_worker) on this rank."""
        return self.connector.connector_worker.worker  # type: ignore[attr-defined]

    @property
    def offloading_spec(self) -> Any:
        return self.connector.connector_worker.spec  # type: ignore[attr-defined]


@dataclass
class _RunnerRequest:
    """What a model runner keeps per request (the same on every rank)."""

    tokens: list[int]
    block_ids: list[list[int]]
    hashes: list[bytes] = field(default_factory=list)
    # (layer, first head, heads, bytes per head) -> slot bytes of positions 0, 1, ...
    slot_cache: dict[tuple[int, int, int, int], bytearray] = field(default_factory=dict)

    def hashes_upto(self, n: int) -> list[bytes]:
        if len(self.hashes) < n:
            h = self.hashes[-1] if self.hashes else _HASH_SEED
            for token in self.tokens[len(self.hashes) : n]:
                h = hashlib.blake2b(h + struct.pack("<I", token), digest_size=16).digest()
                self.hashes.append(h)
        return self.hashes[:n]

    def slot_bytes(
        self, layer: int, first_head: int, heads: int, width: int, start: int, end: int
    ) -> bytes:
        """The bytes of positions [start, end), each ``heads * width`` long."""
        cache = self.slot_cache.setdefault((layer, first_head, heads, width), bytearray())
        nbytes = heads * width
        have = len(cache) // nbytes
        if have < end:
            hashes = self.hashes_upto(end)
            cache += b"".join(
                _slot_bytes(h, layer, first_head, heads, width) for h in hashes[have:end]
            )
        return bytes(cache[start * nbytes : end * nbytes])

    def set_tokens(self, tokens: list[int]) -> None:
        common = 0
        for old, new in zip(self.tokens, tokens, strict=False):
            if old != new:
                break
            common += 1
        self.tokens = list(tokens)
        del self.hashes[common:]
        for (_, _, heads, width), cache in self.slot_cache.items():
            del cache[common * heads * width :]


# ----------------------------------------------------------------------- harness


def _spec_blocks(specs: Sequence[GPULoadStoreSpec]) -> list[tuple[int, int, int]]:
    """(group, block index in the request, GPU block id) of every block of `specs`."""
    out: list[tuple[int, int, int]] = []
    for spec in specs:
        block_ids = [int(b) for b in spec.block_ids]
        offset = 0
        for group, (size, first) in enumerate(
            zip(spec.group_sizes, spec.block_indices, strict=True)
        ):
            out.extend((group, first + j, block_ids[offset + j]) for j in range(size))
            offset += size
    return out


class VllmHarness:
    """One vLLM engine (scheduler + `tensor_parallel_size` worker ranks) in process.

    Args:
        workdir: a directory for the model config and the event socket.
        extra_config: ``kv_connector_extra_config`` (``spec_name``,
            ``spec_module_path``, ``block_size`` ...), passed through as is.
        tensor_parallel_size: worker ranks (KV heads are split between them).
        data_parallel_size / data_parallel_index: this engine's place among
            independent DP engines (build one harness per index; they may share
            a cache). As in vLLM, a dense model's engine then runs as DP size 1
            with ``data_parallel_index`` kept and ``engine_id`` suffixed ``_dpN``.
        num_blocks: GPU KV blocks per rank (``num_gpu_blocks_override``).
        block_size: tokens per GPU block.
        async_scheduling: use `AsyncScheduler` with vLLM's batch queue.
        kv_events: publish KV events over zmq at `kv_events_endpoint`
            (``ipc://`` in `workdir`; vLLM cannot offset ipc endpoints for
            ``data_parallel_index`` > 0, so pass a ``tcp://`` one there).
        engine_id: ``kv_transfer_config.engine_id`` before any DP suffix.
        max_num_batched_tokens: scheduler token budget per step.
        max_num_seqs: requests running at once.
        max_model_len: default: what `num_blocks` can hold.
        kv_cache_layout: force a layout name (e.g. "BLHNC"); default: vLLM's
            resolution, which takes the connector's preference (LBHNC).
        shm_dir: where the per-rank KV files go.
        kv_memory: ``"file"`` (a file in `shm_dir` per rank) or ``"memfd"`` (a memfd per rank).
        model: ``"llama"`` (`num_kv_heads` KV heads split over TP) or ``"mla"`` (a DeepSeek-V2 whose
            latent KV every TP rank holds whole: vLLM's ``use_mla``, ``MLAAttentionSpec``
            with ``max_tp_shards=1``); MLA pages hold the same bytes on every rank
            (`kv_rank`); or ``"hybrid"`` (`HYBRID_LAYER_TYPES`: sliding-window layers of
            `HYBRID_WINDOW` tokens and full-attention layers, one KV cache group per type
            through vLLM's hybrid KV cache manager, which vLLM's CPU platform would turn off
            and a GPU platform keeps). The forward pass checks in a sliding-window group only
            the context its attention reads (the last ``window - 1`` tokens). Or ``"mamba"``
            (`MAMBA_LAYER_TYPES`: Mamba layers, vLLM's ``MambaSpec`` in prefix caching's
            "align" mode, and full-attention layers, one group each): a Mamba layer's page is
            one state, rank-sharded bytes of the prefix it follows; a step starting at ``s``
            checks the state in block ``(s - 1) // block_size`` and leaves the state after
            its last token ``e`` in block ``(e - 1) // block_size``, as the model runner does.
        decode_context_parallel_size: vLLM's DCP over the TP ranks (a llama whose KV heads
            are replicated over at least that many ranks): each rank holds its share of every
            block's tokens, interleaved (`_place`); a block then spans ``block_size * dcp``
            tokens, which is the scheduler's (and `VllmHarness.block_size`'s) block.
        num_kv_heads: the model's KV heads (not MLA): 1, 2 or 4. With fewer heads than TP
            ranks vLLM replicates each head over ``tp // num_kv_heads`` ranks (`kv_rank`).
        kv_load_failure_policy: vLLM's ``kv_transfer_config`` key: ``"fail"`` (its default: a
            request whose load failed fails) or ``"recompute"``.
        prefix_cache_retention_interval: vLLM's (sliding-window groups): 0, its default,
            keeps (and offloads) a window only at the prompt's end; ``N`` also every ``N``
            tokens; None at every boundary.
    """

    def __init__(
        self,
        workdir: Path,
        extra_config: Mapping[str, Any],
        *,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        data_parallel_index: int = 0,
        num_blocks: int = 64,
        block_size: int = 16,
        async_scheduling: bool = False,
        kv_events: bool = False,
        kv_events_endpoint: str | None = None,
        engine_id: str = "harness",
        max_num_batched_tokens: int = 256,
        max_model_len: int | None = None,
        kv_cache_layout: str | None = None,
        shm_dir: Path = Path("/dev/shm"),
        kv_memory: str = "file",
        model: str = "llama",
        max_num_seqs: int = 64,
        prefix_cache_retention_interval: int | None = 0,
        num_kv_heads: int = NUM_KV_HEADS,
        decode_context_parallel_size: int = 1,
        kv_load_failure_policy: str = "fail",
    ):
        self.workdir = Path(workdir)
        self.step_count = 0
        self._closed = False
        self._shm_prefix = f"offloadd-vllmh-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._shm_dir = Path(shm_dir)
        self._buffers: list[ShmBuffer] = []
        if kv_memory not in ("file", "memfd"):
            raise ValueError(f"kv_memory {kv_memory!r}: 'file' or 'memfd'")
        self._kv_memory = kv_memory
        self.ranks: list[RankState] = []
        if model not in MODELS:
            raise ValueError(f"model {model!r}: one of {MODELS}")
        self.model = model
        if NUM_HEADS % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide {NUM_HEADS} heads")
        self.num_kv_heads = num_kv_heads
        self.tp = tensor_parallel_size
        self.dcp = decode_context_parallel_size
        try:
            self._build(
                extra_config=dict(extra_config),
                tp=tensor_parallel_size,
                dp_size=data_parallel_size,
                dp_index=data_parallel_index,
                num_blocks=num_blocks,
                block_size=block_size,
                async_scheduling=async_scheduling,
                kv_events=kv_events,
                kv_events_endpoint=kv_events_endpoint,
                engine_id=engine_id,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                kv_cache_layout=kv_cache_layout,
                max_num_seqs=max_num_seqs,
                retention_interval=prefix_cache_retention_interval,
                kv_load_failure_policy=kv_load_failure_policy,
            )
        except BaseException:
            self.close()
            raise

    # -------------------------------------------------------------- construction

    def _build(
        self,
        *,
        extra_config: dict[str, Any],
        tp: int,
        dp_size: int,
        dp_index: int,
        num_blocks: int,
        block_size: int,
        async_scheduling: bool,
        kv_events: bool,
        kv_events_endpoint: str | None,
        engine_id: str,
        max_num_batched_tokens: int,
        max_model_len: int | None,
        kv_cache_layout: str | None,
        max_num_seqs: int = 64,
        retention_interval: int | None,
        kv_load_failure_policy: str = "fail",
    ) -> None:
        if not current_platform.is_cpu():
            raise RuntimeError(
                f"vLLM runs on {type(current_platform).__name__}: the harness needs its CPU "
                "platform (import tests.vllm.harness before anything resolves vLLM's platform)"
            )
        if max_model_len is None:
            # vLLM refuses a max_model_len the KV cache cannot hold (less the null block).
            max_model_len = (num_blocks - 1) * block_size
            if self.model in ("hybrid", "mamba"):
                # The groups share the blocks; a sliding-window or Mamba request holds few.
                max_model_len //= 2
        name = "model" if self.model == "llama" else f"model-{self.model}"
        if self.num_kv_heads != NUM_KV_HEADS and self.model != "mla":
            name += f"-kv{self.num_kv_heads}"
        model_dir = write_model_dir(self.workdir / name, self.model, self.num_kv_heads)
        self.kv_events_endpoint: str | None = None
        kv_events_config = None
        if kv_events:
            self.kv_events_endpoint = kv_events_endpoint or self._ipc_endpoint("kv-events")
            kv_events_config = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=self.kv_events_endpoint
            )
        engine_args = EngineArgs(
            model=str(model_dir),
            skip_tokenizer_init=True,
            load_format="dummy",
            block_size=block_size,
            enable_prefix_caching=True,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            tensor_parallel_size=tp,
            decode_context_parallel_size=self.dcp,
            data_parallel_size=dp_size,
            async_scheduling=async_scheduling,
            num_gpu_blocks_override=num_blocks,
            prefix_cache_retention_interval=retention_interval,
            kv_events_config=kv_events_config,
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config=extra_config,
                engine_id=engine_id,
                kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
            ),
        )
        vllm_config = engine_args.create_engine_config()
        # CpuPlatform.check_and_update_config turns async scheduling off ("not
        # required on CPU"); a GPU platform keeps what was asked for.
        vllm_config.scheduler_config.async_scheduling = async_scheduling
        if vllm_config.model_config.use_mla:
            # CpuPlatform also turns prefix caching and chunked prefill off for MLA (its
            # kernels); a GPU platform keeps them, and the simulated pass needs neither kernel.
            vllm_config.cache_config.enable_prefix_caching = True
            vllm_config.scheduler_config.enable_chunked_prefill = True
            vllm_config.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
        if self.model in ("hybrid", "mamba"):
            # The CPU platform turns the hybrid KV cache manager off (every layer would get
            # full attention's blocks); a GPU platform keeps it for a connector that supports it.
            vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
        if self.model == "mamba":
            # What MambaModelConfig.verify_and_update_config sets for a Mamba model with prefix
            # caching (vllm/model_executor/models/config.py). Platform.update_block_size_for_
            # backend would raise the attention block size until the pages match; the Mamba
            # shapes below match it at 16 tokens already.
            vllm_config.cache_config.mamba_cache_mode = "align"
            vllm_config.cache_config.mamba_block_size = block_size
        parallel = vllm_config.parallel_config
        if dp_size > 1 or dp_index > 0:
            # What EngineCoreProc.run_engine_core does for one DP engine of a
            # dense (non-MoE) model.
            parallel.data_parallel_rank_local = dp_index
            assert vllm_config.kv_transfer_config is not None
            vllm_config.kv_transfer_config.engine_id = f"{engine_id}_dp{dp_index}"
            parallel.data_parallel_index = dp_index
            parallel.reconfigure_for_independent_dp_rank()
        self.vllm_config = vllm_config

        # ---- KV cache planning, as EngineCore._initialize_kv_caches does it.
        register_all_kvcache_specs(vllm_config)
        world_size = parallel.world_size
        assert world_size == tp, (world_size, tp)
        specs = [self._worker_kv_cache_spec(vllm_config, tp) for _ in range(world_size)]
        supported = [
            [kv_cache_layout] if kv_cache_layout else [x.name for x in _DEFAULT_LAYOUT_PREFERENCE]
        ] * world_size
        resolve_kv_cache_layout(vllm_config, supported, [s for w in specs for s in w.values()])
        global_groups = get_global_kv_cache_groups(vllm_config, specs)
        vllm_config.adjust_dcp_kv_cache_interleave_size(global_groups)
        # Memory is irrelevant: num_gpu_blocks_override fixes the block count.
        kv_cache_configs = get_kv_cache_configs(
            vllm_config, specs, [1 << 40] * world_size, global_groups
        )
        for cfg in kv_cache_configs:
            cfg.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
        scheduler_kv_cache_config = generate_scheduler_kv_cache_config(kv_cache_configs)
        vllm_config.cache_config.num_gpu_blocks = scheduler_kv_cache_config.num_blocks
        vllm_config.cache_config.block_size = min(
            g.kv_cache_spec.block_size for g in scheduler_kv_cache_config.kv_cache_groups
        )
        update_kv_cache_capacity(vllm_config, scheduler_kv_cache_config)
        vllm_config.validate_block_size()
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
            scheduler_kv_cache_config, vllm_config
        )
        alignment = resolve_cache_hit_alignment_tokens(
            scheduler_kv_cache_config, vllm_config, scheduler_block_size, hash_block_size
        )
        for cfg in (*kv_cache_configs, scheduler_kv_cache_config):
            cfg.hash_block_size = hash_block_size
            cfg.cache_hit_alignment_tokens = alignment
        self.kv_cache_config = scheduler_kv_cache_config
        self.block_size = scheduler_block_size
        self.interleave = parallel.cp_kv_cache_interleave_size
        num_layers = {"hybrid": len(HYBRID_LAYER_TYPES), "mamba": len(MAMBA_LAYER_TYPES)}.get(
            self.model, NUM_LAYERS
        )
        self.layer_names = [layer_name(i) for i in range(num_layers)]

        # ---- Workers: config per rank (Worker.__init__ sets parallel_config.rank),
        # connector before the KV tensors (Worker.initialize_from_config), then
        # the model runner's allocation and register_kv_caches.
        for rank in range(world_size):
            self.ranks.append(self._build_rank(rank, kv_cache_configs[rank]))

        # ---- Engine core: scheduler, aggregator, request hasher, batch queue.
        self.structured_output_manager = StructuredOutputManager(vllm_config)
        scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
        scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=scheduler_kv_cache_config,
            structured_output_manager=self.structured_output_manager,
            block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        assert isinstance(scheduler, Scheduler)  # AsyncScheduler is one too
        self.scheduler: Scheduler = scheduler
        connector = self.scheduler.connector
        assert connector is not None
        self.scheduler_connector = connector
        self.aggregator = KVOutputAggregator.from_connector(connector, world_size)
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(
            hash_block_size, hash_fn, vllm_config.num_hash_lookahead_tokens
        )
        self.batch_queue_size = vllm_config.max_concurrent_batches
        self._batch_queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()

        # ---- Observation.
        # req_id -> every get_num_new_matched_tokens call for it
        self.match_calls: dict[str, list[MatchCall]] = {}
        # req_id -> every load job scheduled for it
        self.load_jobs: dict[str, list[LoadJob]] = {}
        # req_id -> every store job scheduled for it
        self.store_jobs: dict[str, list[StoreJob]] = {}
        # every SchedulerOutput, in step order
        self.scheduler_outputs: list[SchedulerOutput] = []
        # req_id -> (step, first token, tokens) of every forward pass over it
        self.forward_ranges: dict[str, list[tuple[int, int, int]]] = {}
        # req_id -> output tokens the scheduler accepted / its finish reason
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        # What each step's update_from_output reported for vLLM's stat loggers.
        self.scheduler_stats: list[SchedulerStats] = []
        self.prompts: dict[str, list[int]] = {}
        self._runner: dict[str, _RunnerRequest] = {}
        self._next_req = 0
        self._spy_matched_tokens()

    @property
    def offloading_manager(self) -> Any:
        """The spec's OffloadingManager (from get_manager) in the scheduler."""
        return self.scheduler_connector.connector_scheduler.manager  # type: ignore[attr-defined]

    def _ipc_endpoint(self, name: str) -> str:
        path = self.workdir / f"{name}.sock"
        if len(str(path)) > 100:  # sun_path is 108 bytes
            path = Path(tempfile.mkdtemp(prefix="vllmh-")) / f"{name}.sock"
        return f"ipc://{path}"

    def kv_rank(self, rank: int) -> int:
        """Which shard of the KV heads `rank` holds: 0 when every rank holds the same (MLA's
        latent KV is replicated on every TP rank, never head-sharded), else its head shard
        (as vLLM places heads: with fewer KV heads than ranks, ranks ``[h * r, (h + 1) * r)``
        hold head ``h``, ``r = tp // num_kv_heads``)."""
        if self.model == "mla":
            return 0
        return rank // max(1, self.tp // self.num_kv_heads)

    def _worker_kv_cache_spec(self, vllm_config: VllmConfig, tp: int) -> dict[str, KVCacheSpec]:
        """What GPUModelRunner.get_kv_cache_spec reports: one spec per
        attention layer (Attention.get_kv_cache_spec / MLAAttention's), heads split over TP."""
        if self.model == "mla":
            assert vllm_config.model_config.use_mla
            assert vllm_config.model_config.get_head_size() == MLA_HEAD_SIZE
            mla = MLAAttentionSpec(
                block_size=vllm_config.cache_config.block_size,
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=MLA_HEAD_SIZE,
                dtype=KV_DTYPE,
                cache_dtype_str="auto",
            )
            return {layer_name(i): mla for i in range(NUM_LAYERS)}
        total = self.num_kv_heads
        assert total % tp == 0 or tp % total == 0, (total, tp)
        heads = max(1, total // tp)  # replicated over ranks when fewer than TP
        spec = FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=heads,
            head_size=HEAD_SIZE,
            dtype=KV_DTYPE,
        )
        if self.model == "mamba":
            # Mamba state is sharded over TP like the heads; the page is an attention page.
            mamba = MambaSpec(
                block_size=vllm_config.cache_config.block_size,
                shapes=((4, 64 // tp), (16 // tp, 48)),
                dtypes=(KV_DTYPE, KV_DTYPE),
                mamba_cache_mode="align",
            )
            assert mamba.page_size_bytes == spec.page_size_bytes
            return {
                layer_name(i): mamba if kind == "mamba" else spec
                for i, kind in enumerate(MAMBA_LAYER_TYPES)
            }
        if self.model == "hybrid":
            assert vllm_config.model_config.get_sliding_window() == HYBRID_WINDOW
            sliding = SlidingWindowSpec(
                block_size=vllm_config.cache_config.block_size,
                num_kv_heads=heads,
                head_size=HEAD_SIZE,
                dtype=KV_DTYPE,
                sliding_window=HYBRID_WINDOW,
            )
            return {
                layer_name(i): sliding if kind == "sliding_attention" else spec
                for i, kind in enumerate(HYBRID_LAYER_TYPES)
            }
        return {layer_name(i): spec for i in range(NUM_LAYERS)}

    def _build_rank(self, rank: int, kv_cache_config: KVCacheConfig) -> RankState:
        vllm_config = copy.deepcopy(self.vllm_config)
        vllm_config.parallel_config.rank = rank
        connector = KVConnectorFactory.create_connector(
            config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
        )
        dp = vllm_config.parallel_config.data_parallel_index

        def make_buffer(size: int) -> ShmBuffer:
            name = f"{self._shm_prefix}-dp{dp}-rank{rank}"
            if self._kv_memory == "memfd":
                buffer = ShmBuffer.create_memfd(name, size)
            else:
                buffer = ShmBuffer.create(self._shm_dir / name, size)
            self._buffers.append(buffer)
            return buffer

        # GPUModelRunner.initialize_kv_cache deep-copies the config, then
        # initialize_kv_cache_tensors -> allocate_kv_cache.
        runner_kv_cache_config = copy.deepcopy(kv_cache_config)
        shm = _BackKVWithShm(make_buffer)
        with shm:
            kv_caches = allocate_kv_cache(
                runner_kv_cache_config,
                torch.device("cpu"),
                vllm_config.cache_config.get_resolved_kv_cache_layout(),
                # Every backend takes the manager block size unsplit here.
                [g.kv_cache_spec.block_size for g in runner_kv_cache_config.kv_cache_groups],
            )
        assert len(shm.buffers) == 1, "vLLM's KV allocation changed shape"
        (buffer,) = shm.buffers
        for name, cache in kv_caches.items():
            assert cache.untyped_storage().data_ptr() == buffer.tensor.data_ptr(), name
        connector.register_kv_caches(kv_caches)
        kv_bytes = {name: cache.view(torch.int8) for name, cache in kv_caches.items()}
        return RankState(
            rank=rank,
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            buffer=buffer,
            kv_caches=kv_caches,
            kv_bytes=kv_bytes,
            connector=connector,
        )

    def _spy_matched_tokens(self) -> None:
        connector = self.scheduler_connector
        real = connector.get_num_new_matched_tokens

        def spy(request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
            num, load_async = real(request, num_computed_tokens)
            self.match_calls.setdefault(request.request_id, []).append(
                MatchCall(self.step_count, num_computed_tokens, num, load_async)
            )
            return num, load_async

        connector.get_num_new_matched_tokens = spy  # type: ignore[method-assign]

    # ----------------------------------------------------------------- requests

    def add_request(
        self, prompt_token_ids: Sequence[int], max_tokens: int = 1, req_id: str | None = None
    ) -> str:
        """Queue a request (greedy, ignore_eos); return its id."""
        if req_id is None:
            req_id = f"req-{self._next_req}"
            self._next_req += 1
        prompt = [int(t) for t in prompt_token_ids]
        assert all(0 <= t < VOCAB_SIZE for t in prompt)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(
            request_id=req_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._block_hasher,
        )
        self.prompts[req_id] = prompt
        self.outputs[req_id] = []
        self.scheduler.add_request(request)
        return req_id

    def tokens(self, req_id: str) -> list[int]:
        """Prompt plus the output tokens the scheduler has accepted."""
        return self.prompts[req_id] + self.outputs[req_id]

    def match_call(self, req_id: str) -> MatchCall:
        """The last get_num_new_matched_tokens call that returned a number."""
        calls = [c for c in self.match_calls.get(req_id, []) if c.num_matched is not None]
        assert calls, f"{req_id}: get_num_new_matched_tokens never answered"
        return calls[-1]

    def external_tokens(self, req_id: str) -> int:
        """What get_num_new_matched_tokens last returned for `req_id` (0 if None)."""
        return self.match_call(req_id).num_matched or 0

    # -------------------------------------------------------------------- steps

    def has_work(self) -> bool:
        """Requests, connector jobs or queued batches left (EngineCore's loop test)."""
        return self.scheduler.has_requests() or bool(self._batch_queue)

    def step(self) -> None:
        """One engine-core step: EngineCore.step, or step_with_batch_queue
        when async scheduling is on."""
        if self.batch_queue_size == 1:
            if not self.scheduler.has_requests():
                return
            scheduler_output = self._schedule()
            self._update(scheduler_output, self._execute(scheduler_output))
            return
        queue = self._batch_queue
        if self.scheduler.has_requests():
            scheduler_output = self._schedule()
            queue.appendleft((scheduler_output, self._execute(scheduler_output)))
            executed = scheduler_output.total_num_scheduled_tokens > 0
            if len(queue) < self.batch_queue_size and (executed or self.scheduler.has_requests()):
                return
        elif not queue:
            return
        self._update(*queue.pop())

    def run_until_finished(self, max_steps: int = 1000, timeout: float = 30.0) -> int:
        """Step until no request and no connector work is left; return steps.

        Like the engine core, it keeps stepping while transfers run elsewhere (an offload
        daemon's copies): it gives up after ``max_steps`` steps *and* ``timeout`` seconds,
        pausing a millisecond between steps past the first ``max_steps``.
        """
        deadline = time.monotonic() + timeout
        n = 0
        while self.has_work():
            if n >= max_steps:
                if time.monotonic() > deadline:
                    raise AssertionError(f"still busy after {n} steps and {timeout:.0f}s")
                time.sleep(0.001)
            self.step()
            n += 1
        return n

    def _schedule(self) -> SchedulerOutput:
        self.step_count += 1
        out = self.scheduler.schedule()
        self.scheduler_outputs.append(out)
        meta = out.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        for job_id, job in meta.load_jobs.items():
            assert isinstance(job.dst_spec, GPULoadStoreSpec)
            self.load_jobs.setdefault(job.req_id, []).append(
                LoadJob(self.step_count, job_id, job.req_id, job.dst_spec, job.sync)
            )
        for job_id, job in meta.store_jobs.items():
            assert isinstance(job.src_spec, GPULoadStoreSpec)
            self.store_jobs.setdefault(job.req_id, []).append(
                StoreJob(self.step_count, job_id, job.req_id, job.src_spec)
            )
        return out

    def _update(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        engine_outputs = self.scheduler.update_from_output(scheduler_output, output)
        for outs in engine_outputs.values():
            if outs.scheduler_stats is not None:
                self.scheduler_stats.append(outs.scheduler_stats)
            for o in outs.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)

    # ----------------------------------------------------------- model runner

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Every rank's Worker.execute_model for one scheduler output, then the
        executor's aggregation of their KV connector outputs."""
        self._update_runner_states(so)
        for req_id, start, n in self._scheduled_ranges(so):
            self.forward_ranges.setdefault(req_id, []).append((self.step_count, start, n))
        outputs = [self._execute_rank(state, so) for state in self.ranks]
        sampled = self._sample(so)
        req_ids = list(so.num_scheduled_tokens)
        for out in outputs:
            out.req_ids = req_ids
            out.req_id_to_index = {r: i for i, r in enumerate(req_ids)}
            out.sampled_token_ids = [sampled.get(r, []) for r in req_ids]
        aggregated: ModelRunnerOutput | None = self.aggregator.aggregate(
            list(outputs), output_rank=0
        )
        assert aggregated is not None
        return aggregated

    def _update_runner_states(self, so: SchedulerOutput) -> None:
        """GPUModelRunner._update_states, as far as KV placement goes."""
        for req_id in so.finished_req_ids:
            self._runner.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.prompt_token_ids is not None
            self._runner[new.req_id] = _RunnerRequest(
                tokens=list(new.prompt_token_ids), block_ids=[list(b) for b in new.block_ids]
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._runner[req_id]
            if req_id in cached.all_token_ids:
                state.set_tokens(cached.all_token_ids[req_id])
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                assert new_block_ids is not None
                state.block_ids = [list(b) for b in new_block_ids]
            elif new_block_ids is not None:
                for blocks, new_blocks in zip(state.block_ids, new_block_ids, strict=True):
                    blocks.extend(new_blocks)

    def _scheduled_ranges(self, so: SchedulerOutput) -> Iterator[tuple[str, int, int]]:
        starts = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, n in so.num_scheduled_tokens.items():
            yield req_id, starts[req_id], n

    def _execute_rank(self, state: RankState, so: SchedulerOutput) -> ModelRunnerOutput:
        connector = state.connector
        assert so.kv_connector_metadata is not None
        connector.handle_preemptions(so.kv_connector_metadata)
        # vLLM copies blocks for a Mamba hit inside a block (hash blocks smaller than the
        # block size), which no harness config makes.
        assert not so.kv_cache_block_copies, "copy-on-write blocks are not simulated"
        if so.new_block_ids_to_zero:
            for kv in state.kv_bytes.values():
                kv[so.new_block_ids_to_zero] = 0
        with (
            self._bind_worker_connector(connector),
            set_forward_context(None, state.vllm_config),
            KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kv_output,
        ):
            for req_id, start, n in self._scheduled_ranges(so):
                self._forward(state, req_id, start, n)
        state.outputs.append(kv_output)
        return ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv_output)

    @contextlib.contextmanager
    def _bind_worker_connector(self, connector: KVConnectorBase) -> Iterator[None]:
        """Each worker process has its connector in kv_transfer_state; here
        the ranks take turns."""
        assert kv_transfer_state._KV_CONNECTOR_AGENT is None
        kv_transfer_state._KV_CONNECTOR_AGENT = connector
        try:
            yield
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None

    @staticmethod
    def context_start(spec: KVCacheSpec, start: int) -> int:
        """The first token position attention over `spec` reads when computing tokens from
        `start` on: 0 for full attention, the window's start for a sliding window (whose
        earlier blocks vLLM frees, and whose block table then names the null block)."""
        if isinstance(spec, SlidingWindowSpec):
            return max(0, start - (spec.sliding_window - 1))
        return 0

    def _place(self, rank: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of token `positions` `rank` holds, and the slot of each in its block: all,
        at ``position % block_size``, without DCP; with it, runs of `interleave` tokens of a
        block go to the DCP ranks in turn (vLLM's ``cp_kv_cache_interleave_size``)."""
        offset = positions % self.block_size
        runs, within = offset // self.interleave, offset % self.interleave
        mine = runs % self.dcp == rank % self.dcp  # a TP rank's DCP rank
        return mine, (runs // self.dcp) * self.interleave + within

    def _slots(
        self, req: _RunnerRequest, group: int, start: int, end: int, rank: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block id, slot) of the token positions in [start, end) of `group` that `rank`
        holds, and which of the positions those are."""
        positions = torch.arange(start, end)
        table = torch.tensor(req.block_ids[group], dtype=torch.long)
        mine, slots = self._place(rank, positions)
        return table[positions[mine] // self.block_size], slots[mine], mine

    @staticmethod
    def _as_slots(data: bytes, heads: int, width: int) -> torch.Tensor:
        """(tokens, heads, bytes) int8 from concatenated slot bytes."""
        return torch.frombuffer(bytearray(data), dtype=torch.int8).view(-1, heads, width)

    def _expected_slots(
        self, hashes: Sequence[bytes], layer: int, rank: int, heads: int, width: int
    ) -> torch.Tensor:
        first = self.kv_rank(rank) * heads
        data = b"".join(_slot_bytes(h, layer, first, heads, width) for h in hashes)
        return self._as_slots(data, heads, width)

    def _forward(self, state: RankState, req_id: str, start: int, n: int) -> None:
        """Write the KV of tokens [start, start + n) of one request on one rank,
        after checking the KV of every token before them."""
        req = self._runner[req_id]
        end = start + n
        assert end <= len(req.tokens), (req_id, start, n, len(req.tokens))
        byte_rank = self.kv_rank(state.rank)
        for group, kv_group in enumerate(state.kv_cache_config.kv_cache_groups):
            if isinstance(kv_group.kv_cache_spec, MambaSpec):
                self._forward_mamba(state, req, group, start, end)
                continue
            for name in kv_group.layer_names:
                layer = self.layer_names.index(name)
                kv = state.kv_bytes[name]
                _, heads, _, width = kv.shape
                first = self.context_start(kv_group.kv_cache_spec, start)
                if first < start:
                    # Attention reads every earlier token it reaches: cached, loaded or
                    # computed (a sliding window's last ``window - 1``, else all of them).
                    blocks, slots, mine = self._slots(req, group, first, start, state.rank)
                    data = req.slot_bytes(layer, byte_rank * heads, heads, width, first, start)
                    want = self._as_slots(data, heads, width)[mine]
                    got = kv[blocks, :, slots, :]
                    if not torch.equal(got, want):
                        bad = sorted(
                            {
                                int(p) // self.block_size
                                for p in torch.arange(first, start)[mine][
                                    torch.nonzero((got != want).flatten(1).any(1))
                                ]
                            }
                        )
                        raise KVMismatchError(
                            f"step {self.step_count}: {req_id} rank {state.rank} {name}: "
                            f"context blocks (by index) {bad} do not hold their tokens' KV "
                            f"before computing tokens [{start}, {end})"
                        )
                blocks, slots, mine = self._slots(req, group, start, end, state.rank)
                data = req.slot_bytes(layer, byte_rank * heads, heads, width, start, end)
                kv[blocks, :, slots, :] = self._as_slots(data, heads, width)[mine]

    def mamba_state(self, prefix_hash: bytes, layer: int, rank: int) -> torch.Tensor:
        """A Mamba layer's page on `rank` after the prefix `prefix_hash` names: the state
        bytes of the rank's shard (conv and SSM parts, one page)."""
        kv = self.ranks[rank].kv_bytes[self.layer_names[layer]]
        _, _, _, width = kv.shape
        data = _slot_bytes(prefix_hash, layer, self.kv_rank(rank), 1, width)
        return torch.frombuffer(bytearray(data), dtype=torch.int8)

    def _forward_mamba(
        self, state: RankState, req: _RunnerRequest, group: int, start: int, end: int
    ) -> None:
        """Align mode: the state after `start` tokens is in block ``(start - 1) // block``
        (prefix-cached, loaded, copied or computed); the step leaves the state after `end`
        in block ``(end - 1) // block`` (the model runner's pre-copy and in-place update)."""
        names = state.kv_cache_config.kv_cache_groups[group].layer_names
        table = req.block_ids[group]
        hashes = req.hashes_upto(end)
        for name in names:
            layer = self.layer_names.index(name)
            kv = state.kv_bytes[name]
            if start > 0:
                index = (start - 1) // self.block_size
                got = kv[table[index], 0, 0]
                if not torch.equal(got, self.mamba_state(hashes[start - 1], layer, state.rank)):
                    raise KVMismatchError(
                        f"step {self.step_count}: rank {state.rank} {name}: the Mamba state "
                        f"in block {index} (GPU block {table[index]}) is not the state "
                        f"after {start} tokens, before computing tokens [{start}, {end})"
                    )
            block_id = table[(end - 1) // self.block_size]
            assert block_id != 0, f"{name}: no state block for tokens [{start}, {end})"
            kv[block_id, 0, 0] = self.mamba_state(hashes[end - 1], layer, state.rank)

    def _sample(self, so: SchedulerOutput) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        for req_id, start, n in self._scheduled_ranges(so):
            req = self._runner[req_id]
            if start + n < len(req.tokens):
                continue  # a partial prefill samples nothing
            token = _sample(req.hashes_upto(start + n)[-1])
            req.tokens.append(token)
            sampled[req_id] = [token]
        return sampled

    @contextlib.contextmanager
    def subscribe_kv_events(self, timeout: float = 10.0) -> Iterator[KVEventSubscriber]:
        """A subscriber that receives everything published from now on: it
        publishes empty batches through the scheduler's publisher until one
        arrives (zmq drops what a PUB sends before the SUB has joined)."""
        assert self.kv_events_endpoint is not None, "built without kv_events=True"
        subscriber = KVEventSubscriber(self.kv_events_endpoint)
        try:
            publisher = self.scheduler.kv_event_publisher
            deadline = time.monotonic() + timeout
            while True:
                publisher.publish(KVEventBatch(ts=time.time(), events=[]))
                if subscriber.receive(0.05) is not None:
                    break
                assert time.monotonic() < deadline, "no KV event subscription"
            subscriber.drain(0.05)  # the other probes
            yield subscriber
        finally:
            subscriber.close()

    # ------------------------------------------------------------ KV contents

    def zero_kv(self) -> None:
        """Zero every rank's whole KV memory."""
        for state in self.ranks:
            state.buffer.tensor.zero_()

    def reset_prefix_cache(self, zero_kv: bool = True) -> None:
        """Reset the GPU prefix cache (not the connector's), then zero all KV."""
        assert self.scheduler.reset_prefix_cache(), "prefix cache reset refused"
        if zero_kv:
            self.zero_kv()

    def _page_span(self, kv: torch.Tensor) -> int:
        """Bytes from a page's first to its last byte (the unpadded page)."""
        return 1 + sum((n - 1) * s for n, s in zip(kv.shape[1:], kv.stride()[1:], strict=True))

    def page(self, rank: int, layer: int, block_id: int) -> torch.Tensor:
        """The live bytes of one block of a layer on a rank, in memory order
        (what a spec copies: ``CanonicalKVCacheRef.page_size_bytes`` from the
        block's start)."""
        state = self.ranks[rank]
        kv = state.kv_bytes[self.layer_names[layer]]
        start = kv[block_id].storage_offset() - state.buffer.tensor.storage_offset()
        return state.buffer.tensor[start : start + self._page_span(kv)]

    def expected_page_bytes(
        self, prefix_tokens: Sequence[int], layer: int, rank: int
    ) -> torch.Tensor:
        """What `page` holds for the block with the last `block_size` tokens of
        `prefix_tokens` (a whole number of blocks) once they are computed."""
        assert prefix_tokens and len(prefix_tokens) % self.block_size == 0
        if self.model == "mamba" and MAMBA_LAYER_TYPES[layer] == "mamba":
            return self.mamba_state(prefix_hashes(prefix_tokens)[-1], layer, rank)
        kv = self.ranks[rank].kv_bytes[self.layer_names[layer]]
        _, heads, tokens, width = kv.shape
        hashes = prefix_hashes(prefix_tokens)[-self.block_size :]
        mine, _ = self._place(rank, torch.arange(self.block_size))
        slots = self._expected_slots(hashes, layer, rank, heads, width)[mine]
        page = torch.zeros(self._page_span(kv), dtype=torch.int8)
        torch.as_strided(page, (heads, tokens, width), kv.stride()[1:]).copy_(
            slots.permute(1, 0, 2)
        )
        return page

    def block_table(self, req_id: str, group: int) -> list[int]:
        """The model runner's block ids of `req_id` in KV cache group `group`, by block
        index (0, the null block, where vLLM left or dropped a sliding window's blocks)."""
        return list(self._runner[req_id].block_ids[group])

    def loaded_blocks(self, req_id: str) -> list[tuple[int, int, int]]:
        """(group, block index in the request, GPU block id) of every block
        the connector loaded for `req_id`, in job order."""
        return _spec_blocks([job.dst for job in self.load_jobs.get(req_id, [])])

    def stored_blocks(self, req_id: str) -> list[tuple[int, int, int]]:
        """(group, block index in the request, GPU block id) of every block
        the connector stored for `req_id`, in job order."""
        return _spec_blocks([job.src for job in self.store_jobs.get(req_id, [])])

    def assert_loaded_pages(self, req_id: str) -> int:
        """Check every page the connector loaded for `req_id`, on every rank
        and layer, against the bytes of its prefix; return pages checked.
        Call it before those blocks can be reused by another request."""
        tokens = self.tokens(req_id)
        checked = 0
        for group, index, block_id in self.loaded_blocks(req_id):
            prefix = tokens[: (index + 1) * self.block_size]
            for state in self.ranks:
                group_layers = state.kv_cache_config.kv_cache_groups[group].layer_names
                for name in group_layers:
                    layer = self.layer_names.index(name)
                    got = self.page(state.rank, layer, block_id)
                    want = self.expected_page_bytes(prefix, layer, state.rank)
                    if not torch.equal(got, want):
                        raise KVMismatchError(
                            f"{req_id}: block {index} (GPU block {block_id}) rank "
                            f"{state.rank} {name}: loaded page != its prefix's bytes "
                            f"({int((got != want).sum())} of {got.numel()} bytes differ)"
                        )
                    checked += 1
        return checked

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """Shut the scheduler (publisher, connector) and workers down; unlink
        the shm files."""
        if self._closed:
            return
        self._closed = True
        scheduler = getattr(self, "scheduler", None)  # None if __init__ failed early
        if scheduler is not None:
            scheduler.shutdown()
        for state in self.ranks:
            state.connector.shutdown()
        self.ranks.clear()
        for buffer in self._buffers:
            buffer.close()
        self._buffers.clear()

    def __enter__(self) -> VllmHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

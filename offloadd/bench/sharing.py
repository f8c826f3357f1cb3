"""``mla_bytes_per_token_tp<N>``: arena bytes per cached token of an MLA engine at TP=N.

MLA's latent KV is replicated on every tensor-parallel rank (vLLM 0.33 says so with
``replicated_layout``, see ``build_offloading_config``), so the daemon keeps one shard per
chunk whatever the TP size. Each row starts a daemon subprocess, connects N ranks with
DeepSeek-V3-shaped latent pages (576 bf16 per token and layer, the same bytes on every rank)
and a config as vLLM builds it for that TP size, has every rank store the same chunks,
reads the daemon's ``used_bytes`` and divides by the tokens cached. The baseline is one copy:
the latent bytes of one token over all layers. Goal: a ratio of 1.0 at every TP size (flat),
where storing a copy per rank would give N. Before measuring, every rank's pages are zeroed,
loaded back and compared byte for byte with what was stored.
"""

from __future__ import annotations

import contextlib

import msgspec
import torch

from offloadd.bench._util import Context, Result, chain_keys, one_group_config, ratio
from offloadd.client import OffloadClient
from offloadd.shm import SharedKVTensor

__all__ = ["TP_SIZES", "result_name", "run"]

TP_SIZES = (1, 2, 4, 8)
LAYERS = 4
TOKENS_PER_BLOCK = 16
LATENT_BYTES = (512 + 64) * 2  # kv_lora_rank + qk_rope_head_dim, bf16 (DeepSeek-V3)
PAGE = TOKENS_PER_BLOCK * LATENT_BYTES
BLOCKS_PER_CHUNK = 4
CHUNKS = 64
SMOKE_TP_SIZES = (1, 2)  # --smoke: a daemon and its ranks per TP size, 8 chunks each
SMOKE_CHUNKS = 8
SEED = 4321


def result_name(tp: int) -> str:
    return f"mla_bytes_per_token_tp{tp}"


def _measure(ctx: Context, tp: int, chunks: int = CHUNKS) -> Result:
    from offloadd.bench.datapath import daemon

    num_blocks = chunks * BLOCKS_PER_CHUNK
    chunk_bytes = PAGE * BLOCKS_PER_CHUNK * LAYERS
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    generator = torch.Generator().manual_seed(SEED)
    latent = torch.randint(0, 256, (LAYERS, num_blocks, PAGE), generator=generator).to(torch.uint8)
    keys = chain_keys(chunks, f"mla-tp{tp}".encode())
    blocks = list(range(num_blocks))
    with contextlib.ExitStack() as stack:
        endpoint, _server = stack.enter_context(
            daemon(ctx, tp * chunks * chunk_bytes + (8 << 20), f"mla-tp{tp}", persist=False)
        )
        memory: list[list[SharedKVTensor]] = []
        clients: list[OffloadClient] = []
        for rank in range(tp):
            tensors = []
            for layer, name in enumerate(layers):
                kv = SharedKVTensor.create(
                    num_blocks, PAGE, [name], prefix=f"{ctx.scratch.shm_prefix}-mla"
                )
                stack.callback(kv.close)
                kv.tensor.copy_(latent[layer])  # MLA: every rank holds the same latent
                tensors.append(kv)
            memory.append(tensors)
            config = one_group_config(
                f"bench-mla-tp{tp}",
                model="bench/mla",
                layers=layers,
                bytes_per_block=PAGE * LAYERS,
                blocks_per_chunk=BLOCKS_PER_CHUNK,
                rank=rank,
                tp=tp,
                tokens_per_block=TOKENS_PER_BLOCK,
            )
            # vLLM 0.33: MLA at TP > 1 (TP only, one node) is replicated, never agnostic.
            config = msgspec.structs.replace(
                config,
                replicated_layout=tp > 1,
                parallel=msgspec.structs.replace(config.parallel, is_parallelism_agnostic=False),
            )
            client = OffloadClient.connect(
                endpoint, config, [kv.region for kv in tensors], name=f"bench mla rank {rank}"
            )
            stack.callback(client.close)
            clients.append(client)
        for client in clients:
            client.wait_ready(30)
        for client in clients:
            client.store(1, keys, blocks)
        for client in clients:
            client.wait([1], timeout=120)
        stats = clients[0].stats()
        if stats.committed_entries != chunks:
            raise RuntimeError(f"mla tp={tp}: {stats.committed_entries} of {chunks} committed")
        for rank, tensors in enumerate(memory):
            for kv in tensors:
                kv.tensor.zero_()
            clients[rank].load(2, keys, blocks)
            clients[rank].wait([2], timeout=120)
            for layer, kv in enumerate(tensors):
                if not torch.equal(kv.tensor, latent[layer]):
                    raise RuntimeError(f"mla tp={tp}: rank {rank} layer {layer} differs")
        tokens = chunks * BLOCKS_PER_CHUNK * TOKENS_PER_BLOCK
        value = stats.used_bytes / tokens
        baseline = float(LATENT_BYTES * LAYERS)
        return Result(
            result_name(tp),
            value,
            "B/token",
            baseline,
            ratio(value, baseline),
            {
                "tp": tp,
                "layers": LAYERS,
                "latent_bytes": LATENT_BYTES,
                "chunks": chunks,
                "goal": "ratio <= 1.01",  # one copy at every TP size: flat
            },
        )


def run(ctx: Context) -> list[Result]:
    results = []
    chunks = ctx.pick(CHUNKS, CHUNKS, SMOKE_CHUNKS)
    for tp in ctx.pick(TP_SIZES, TP_SIZES, SMOKE_TP_SIZES):
        if ctx.wanted(result_name(tp)):
            ctx.progress(f"mla: {tp} ranks storing {chunks} chunks")
            results.append(_measure(ctx, tp, chunks))
    return results

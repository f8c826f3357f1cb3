"""Production traffic for vLLM's real scheduler: the Mooncake conversation trace, mapped onto
small blocks, and the engines stepped back to back through it.

The trace (Mooncake's FAST'25 ``conversation_trace.jsonl``, its first 2,000 requests shipped
in ``data/``) gives each request ``hash_ids``, one per 512-token block of its prompt: equal
ids at equal positions mean an equal prefix. Each id becomes ``BLOCK`` tokens derived from
the id, and each request ends in one token of its own, so equal ids give equal tokens, equal
block hashes in vLLM and equal offload keys; every request then has ``len(hash_ids)`` full
blocks to find in a cache. ``synthetic`` makes requests of the same shape from a few numbers
(a shared system prompt, conversations that grow), for shapes the trace lacks.

``lru_hit`` is the oracle a cache of ``capacity`` chunks is measured against: an exact LRU
over the requests in arrival order, each looking up its blocks from the first (stopping at
the first miss) and then touching all of them. ``drive`` runs engines (``VllmHarness``) the
way an engine core meets them: ``arrivals`` requests added per step, spread over the engines
in turn, every engine stepped once per round, no pause for the cache to drain.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.vllm.harness import VOCAB_SIZE, VllmHarness, sampled_token

BLOCK = 16  # tokens per trace block (and per vLLM block and offload chunk in the soaks)
TRACE = Path(__file__).parent / "data" / "mooncake_conversation_2000.jsonl"


@dataclass(frozen=True)
class TraceRequest:
    """One request: its blocks' ids (prefix order) and its output length."""

    hash_ids: tuple[int, ...]
    max_tokens: int = 2

    def prompt(self, index: int) -> list[int]:
        """``BLOCK`` tokens per hash id, then one token of this request's own."""
        tokens: list[int] = []
        for hash_id in self.hash_ids:
            tokens.extend(_block_tokens(hash_id))
        tokens.append(3 + (index * 7919) % (VOCAB_SIZE - 3))
        return tokens


def _block_tokens(hash_id: int) -> list[int]:
    digest = hashlib.blake2b(hash_id.to_bytes(8, "little"), digest_size=2 * BLOCK).digest()
    return [3 + int.from_bytes(digest[2 * i : 2 * i + 2], "little") % (VOCAB_SIZE - 3)
            for i in range(BLOCK)]  # fmt: skip


def load_trace(count: int = 2000, path: Path = TRACE) -> list[TraceRequest]:
    """The first ``count`` requests of the shipped trace (max_tokens 2 each)."""
    requests: list[TraceRequest] = []
    with path.open() as lines:
        for line in lines:
            if len(requests) == count:
                break
            requests.append(TraceRequest(tuple(json.loads(line)["hash_ids"])))
    if len(requests) < count:
        raise ValueError(f"{path} has {len(requests)} requests, {count} asked")
    return requests


def synthetic(
    count: int,
    *,
    system_blocks: int = 4,
    conversations: int = 64,
    turn_blocks: tuple[int, int] = (1, 6),
    seed: int = 0,
) -> list[TraceRequest]:
    """Requests shaped like a chat service's: every prompt starts with the same system
    prompt; each request continues one of ``conversations`` (picked at random), whose prompt
    grows by a turn of ``turn_blocks`` blocks each time it is picked."""
    rnd = random.Random(seed)
    next_id = system_blocks
    system = tuple(range(system_blocks))
    histories = [system for _ in range(conversations)]
    requests: list[TraceRequest] = []
    for _ in range(count):
        which = rnd.randrange(conversations)
        turn = rnd.randint(*turn_blocks)
        histories[which] = (*histories[which], *range(next_id, next_id + turn))
        next_id += turn
        requests.append(TraceRequest(histories[which]))
    return requests


def working_set(requests: Sequence[TraceRequest]) -> int:
    """Distinct chunks over the requests (prefixes, not ids: an id after another prefix is
    another chunk)."""
    return len({key for request in requests for key in _chunk_keys(request)})


def _chunk_keys(request: TraceRequest) -> list[tuple[int, ...]]:
    return [request.hash_ids[: i + 1] for i in range(len(request.hash_ids))]


def lru_hit(requests: Sequence[TraceRequest], capacity: int) -> float:
    """Tokens an exact LRU of ``capacity`` chunks serves, over the prompt tokens."""
    cache: OrderedDict[tuple[int, ...], None] = OrderedDict()
    hit = total = 0
    for request in requests:
        keys = _chunk_keys(request)
        total += len(keys) * BLOCK + 1
        for key in keys:
            if key not in cache:
                break
            hit += BLOCK
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hit / total


@dataclass
class Run:
    """What ``drive`` saw: requests per engine, steps, and each request's computed tokens."""

    engines: list[VllmHarness]
    requests: dict[str, tuple[int, TraceRequest]] = field(default_factory=dict)  # id -> where
    rounds: int = 0
    seconds: float = 0.0

    def hit(self) -> float:
        """Prompt tokens not computed (GPU prefix cache or loaded), over the prompt tokens:
        where each request's first forward pass began."""
        hit = total = 0
        for req_id, (engine, _request) in self.requests.items():
            h = self.engines[engine]
            total += len(h.prompts[req_id])
            hit += h.forward_ranges[req_id][0][1]
        return hit / total

    def recomputed(self) -> int:
        """Requests whose prompt was computed from an earlier point than their first
        forward pass began (a load that failed, recomputed)."""
        count = 0
        for req_id, (engine, _request) in self.requests.items():
            ranges = self.engines[engine].forward_ranges[req_id]
            if any(start < ranges[0][1] for _step, start, _n in ranges[1:]):
                count += 1
        return count

    def check_outputs(self) -> None:
        """Every request finished with the tokens its prompt samples."""
        for req_id, (engine, request) in self.requests.items():
            h = self.engines[engine]
            assert req_id in h.finished, f"{req_id} never finished"
            tokens = list(h.prompts[req_id])
            for _ in range(request.max_tokens):
                tokens.append(sampled_token(tokens))
            got = h.outputs[req_id]
            assert got == tokens[len(h.prompts[req_id]) :], f"{req_id}: sampled {got}"


def drive(
    engines: Sequence[VllmHarness],
    requests: Sequence[TraceRequest],
    *,
    arrivals: int = 4,
    before_round: Callable[[int], None] | None = None,
    timeout: float = 600.0,
) -> Run:
    """Add ``arrivals`` requests per round (round robin over ``engines``), step every engine
    once per round, back to back, until every request finished. ``before_round(n)`` runs
    before round ``n`` (a fault to inject)."""
    run = Run(list(engines))
    start = time.monotonic()
    deadline = start + timeout
    pending = list(enumerate(requests))
    pending.reverse()
    turn = 0
    while pending or any(h.has_work() for h in engines):
        if before_round is not None:
            before_round(run.rounds)
        for _ in range(min(arrivals, len(pending))):
            index, request = pending.pop()
            engine = turn % len(engines)
            turn += 1
            req_id = engines[engine].add_request(
                request.prompt(index), max_tokens=request.max_tokens, req_id=f"t{index}"
            )
            run.requests[req_id] = (engine, request)
        for h in engines:
            h.step()
        run.rounds += 1
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{len(pending)} requests not added and some not finished after "
                f"{run.rounds} rounds, {time.monotonic() - start:.0f}s"
            )
    run.seconds = time.monotonic() - start
    return run


# The soaks' geometry (the issue "vLLM on real traffic"): 16-token blocks, one block per
# offload chunk, 4 KiB chunks (the harness's tiny Llama), 2,048 GPU blocks.
GPU_BLOCKS = 2048
CHUNK_BYTES = 4096
ENGINE_ARGS: dict[str, Any] = {
    "num_blocks": GPU_BLOCKS,
    "block_size": BLOCK,
    "max_num_batched_tokens": 2048,
    "max_num_seqs": 64,
    "max_model_len": 4096,  # the tiny model's positions; the trace's longest prompt fits
    "kv_load_failure_policy": "recompute",
}


def offloadd_extra(endpoint: str, **more: object) -> dict[str, object]:
    """The connector config for offloadd at ``endpoint``, one block per chunk."""
    return {
        "spec_name": "OffloaddSpec",
        "spec_module_path": "offloadd.vllm",
        "offloadd_endpoint": endpoint,
        "block_size": BLOCK,
        **more,
    }


def native_extra(capacity: int) -> dict[str, object]:
    """The connector config for vLLM's CPU spec (``tests.vllm.native_spec``) of
    ``capacity`` bytes, one block per chunk."""
    return {
        "spec_name": "NativeCPUSpec",
        "spec_module_path": "tests.vllm.native_spec",
        "cpu_bytes_to_use": capacity,
        "block_size": BLOCK,
    }


@contextlib.contextmanager
def engines(
    workdir: Path, extra: dict[str, object], count: int = 1, **args: Any
) -> Iterator[list[VllmHarness]]:
    """``count`` data-parallel engines of the soaks' geometry on one connector config."""
    built: list[VllmHarness] = []
    try:
        for index in range(count):
            built.append(
                VllmHarness(
                    workdir,
                    extra,
                    data_parallel_size=count,
                    data_parallel_index=index,
                    **(ENGINE_ARGS | args),
                )
            )
        yield built
    finally:
        for h in built:
            h.close()

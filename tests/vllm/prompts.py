"""Prompts and steps the vLLM offloading tests share: seeded token prompts (``A_PROMPT`` and
prompts sharing a prefix of it), a request run to completion with its sampled tokens checked,
a wait for the scheduler's mirror, and the connector's extra config naming a daemon."""

from __future__ import annotations

import random
import time

from offloadd.vllm.manager import OffloaddManager
from tests.integration.harness import DaemonThread, ServeProcess
from tests.vllm.harness import VllmHarness, sampled_token

__all__ = ["A_PROMPT", "b_prompt", "compute", "extra_for", "prompt_of", "settle", "why_not_stored"]


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


A_PROMPT = prompt_of(100)


def b_prompt(shared: int, seed: int = 1) -> list[int]:
    return A_PROMPT[:shared] + prompt_of(7, seed=seed)


def compute(h: VllmHarness, prompt: list[int], max_tokens: int = 2) -> str:
    """Run one request to completion and check the simulated sampler's output."""
    req = h.add_request(prompt, max_tokens=max_tokens)
    h.run_until_finished()
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(sampled_token(tokens))
    assert h.outputs[req] == tokens[len(prompt) :]
    return req


def settle(h: VllmHarness, chunks: int) -> None:
    """Wait until the scheduler's mirror shows ``chunks`` chunks (commits reach it async)."""
    manager = h.offloading_manager
    assert isinstance(manager, OffloaddManager)
    deadline = time.monotonic() + 30  # a loaded machine delays the mirror, never the bytes
    while len(manager._mirror.keys) < chunks:
        assert time.monotonic() < deadline, (
            f"mirror has {len(manager._mirror.keys)} chunks; {why_not_stored(h)}"
        )
        time.sleep(0.01)


def why_not_stored(h: VllmHarness) -> str:
    """What the plugin counted of stores that went nowhere, for a failed wait's message."""
    manager = h.offloading_manager
    assert isinstance(manager, OffloaddManager)
    workers = [rank.offloading_worker for rank in h.ranks]
    return (
        f"scheduler: steps unsent {manager.unsent_steps}, refused {manager.refused_steps}, "
        f"keys not reserved {manager.refused_keys}, session "
        f"{'up' if manager._client is not None else 'down'}; per rank: stores unsent "
        f"{[w.stores_unsent for w in workers]}, given up {[w.stores_given_up for w in workers]}, "
        f"keys not stored {[w.keys_not_stored for w in workers]}"
    )


def extra_for(daemon: DaemonThread | ServeProcess, **more: object) -> dict[str, object]:
    return {
        "spec_name": "OffloaddSpec",
        "spec_module_path": "offloadd.vllm",
        "offloadd_endpoint": daemon.endpoint,
        **more,
    }

"""A load the daemon cannot serve never kills the engine: vLLM's real scheduler recomputes the
request (``kv_load_failure_policy="recompute"``) or fails that request alone ("fail").

The failure is real: the daemon runs without persistence and is killed (SIGKILL) after the
scheduler promised a load and before the rank sent it; it comes back empty, the rank sends
the load again by key, and the daemon answers that the keys are gone.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")

from offloadd.client import OffloadClient
from tests.integration.harness import ServeProcess, serve_process
from tests.vllm.harness import VllmHarness, sampled_token
from tests.vllm.prompts import A_PROMPT, b_prompt, compute, prompt_of, settle

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def serve() -> Iterator[ServeProcess]:
    with serve_process(persist=False) as daemon:
        yield daemon


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(sampled_token(tokens))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_load_whose_keys_are_gone_is_recomputed_not_fatal(
    tmp_path: Path, serve: ServeProcess, policy: str
) -> None:
    serve.start()
    extra = {
        "spec_name": "OffloaddSpec",
        "spec_module_path": "offloadd.vllm",
        "offloadd_endpoint": serve.endpoint,
    }
    with VllmHarness(tmp_path, extra, kv_load_failure_policy=policy) as h:
        worker = h.ranks[0].offloading_worker
        assert worker.load_failures.reporting  # the connector's methods were found
        compute(h, A_PROMPT)
        settle(h, 6)
        h.reset_prefix_cache()
        real = worker.submit_load

        def submit_load(*args: object, **kwargs: object) -> bool:
            """The daemon dies (and comes back empty) before the rank sends the load."""
            worker.submit_load = real
            serve.stop(signal.SIGKILL)
            serve.start()
            return bool(real(*args, **kwargs))

        worker.submit_load = submit_load
        prompt = b_prompt(64)
        b = h.add_request(prompt, max_tokens=2)
        h.run_until_finished(timeout=60)
        matched = [call.num_matched for call in h.match_calls[b] if call.num_matched]
        assert matched[0] == 64  # the scheduler promised a load of 4 chunks
        # Once, or again while the scheduler's mirror still shows the lost daemon's keys
        # (it notices the restart at its next keepalive): each failure is counted on both
        # sides, and each one only recomputes.
        failed = worker.load_failures.count
        assert failed >= 1 if policy == "recompute" else failed == 1
        with OffloadClient(serve.endpoint, timeout=5.0, heartbeat=0) as client:
            assert client.stats().loads_missing == failed
        if policy == "recompute":
            # B ran from its first token: every context token's KV was checked before use.
            assert h.forward_ranges[b][0][1] == 0
            assert h.outputs[b] == expected_output(prompt, 2)
            assert h.finished[b] == "length"
        else:
            assert b not in h.forward_ranges  # never computed on KV that was not loaded
            assert h.finished[b] == "error"
        # The engine runs on: the next request is served (a prompt of its own: the scheduler
        # may not have noticed the restart yet, and A's keys would fail their load again).
        c = compute(h, prompt_of(40, seed=11))
        assert h.finished[c] == "length"

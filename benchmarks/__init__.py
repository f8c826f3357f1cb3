"""Development benchmarks of offloadd: those that need the test harness (``tests/vllm``).

They drive vLLM's real scheduler and worker connectors through ``tests/vllm``'s harness,
which the wheel does not carry, so they live here, beside ``tests``, and run from a checkout
only. What an operator runs on a node is ``offloadd bench`` (``offloadd.bench``), whose
runner and table these reuse: the same flags, figures, ``--smoke`` verdicts and JSON.

``python -m benchmarks [--quick | --smoke] [--json FILE] [--only NAME ...] [--profile DIR]``

Groups (``--only`` takes a group name or a result-name pattern such as ``vllm_step_*``); each
needs vLLM 0.33 (``sglang``: SGLang 0.5.23) installed and says so (skips) without it:

- ``vllm_step``: ``vllm_step_64`` / ``vllm_step_256``: worker ms per step, messages per rank
  per step, ``schedule()`` median and p99, the scheduler's messages inside ``schedule()``,
  store and load latency with N requests storing (then loading) in one step, through vLLM's
  real scheduler and worker connectors, vs an in-process spec, both engines alive and their
  rounds taking turns (``benchmarks.vllm_step``).
- ``vllm_trace``: the Mooncake conversation trace through vLLM's real scheduler and worker
  connectors, one engine (``vllm_trace_1``) and two DP engines sharing a daemon
  (``vllm_trace_dp2``), steps back to back, offloadd vs vLLM's own CPU spec on the same
  requests in the same run: total hit over an exact LRU of the same capacity (goal >= 0.97),
  engine steps, load and store latency (median, p99) of both; and the daemon's CPU per chunk
  moved on that traffic (``daemon_cpu_per_chunk``) (``benchmarks.vllm_trace``).
- ``shared_cache``: two DP engines through vLLM's real scheduler and worker connectors on one
  arena smaller than their working set, a prefix-sharing workload: the total chunk hit rate
  vs an exact shared LRU of the same capacity over the same requests
  (``shared_cache_hit_rate``; goal: ratio >= 0.9) and the keys refused vs those offered
  (``shared_cache_refused``; goal: ratio <= 0.01) (``benchmarks.shared_cache``).

- ``sglang``: ``sglang_set_64`` / ``sglang_get_64``: GB/s of one SGLang 0.5.23 HiCache L3
  batch of 64 pages (``batch_set_v1`` / ``batch_get_v1`` on offloadd's backend, built by
  SGLang's backend factory over its own ``shm`` host pool) vs the same page runs moved by
  ``memmove`` in the process (no goal yet); skipped without SGLang
  (``benchmarks.sglang_batch``).

``tests/integration/test_bench_smoke.py`` runs ``python -m benchmarks --smoke`` beside
``offloadd bench --smoke``.
"""

from __future__ import annotations

from collections.abc import Sequence

from offloadd.bench import Group
from offloadd.bench import main as run_groups
from offloadd.bench._util import Context, Result

__all__ = ["GROUPS", "main"]


def _vllm_step(ctx: Context) -> list[Result]:
    from benchmarks import vllm_step

    return vllm_step.run(ctx)


def _vllm_trace(ctx: Context) -> list[Result]:
    from benchmarks import vllm_trace

    return vllm_trace.run(ctx)


def _sglang(ctx: Context) -> list[Result]:
    from benchmarks import sglang_batch

    return sglang_batch.run(ctx)


def _shared_cache(ctx: Context) -> list[Result]:
    from benchmarks import shared_cache

    return shared_cache.run(ctx)


GROUPS = (
    Group("vllm_step", ("vllm_step_*",), _vllm_step, "rank cost per step through vLLM's workers"),
    Group(
        "vllm_trace",
        ("vllm_trace_*", "daemon_cpu_per_chunk"),
        _vllm_trace,
        "the Mooncake trace through vLLM, vs its CPU spec",
    ),
    Group("shared_cache", ("shared_cache_*",), _shared_cache, "two DP engines on one arena"),
    Group("sglang", ("sglang_*",), _sglang, "a 64-page SGLang HiCache L3 batch (needs SGLang)"),
)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks``: ``GROUPS`` through ``offloadd.bench``'s runner."""
    return run_groups(
        argv,
        groups=GROUPS,
        prog="python -m benchmarks",
        description="offloadd's development benchmarks, run from a checkout (they drive "
        "vLLM through\ntests/vllm's harness): ratios against baselines measured side by side.",
    )

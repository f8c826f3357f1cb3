"""Loads the daemon could not serve, reported to vLLM so the engine recomputes them.

vLLM 0.33's ``OffloadingConnectorWorker`` asserts that every transfer succeeded, but the
connector around it (``KVConnectorBase_V1``) has two ways to report a failed load, read by
the scheduler under ``kv_load_failure_policy`` ("recompute": the request computes the tokens
again; "fail": the request, not the engine, fails):
- ``get_transfer_results().failed_recving``: the request ids of asynchronous loads that
  failed (each still reported finished, as vLLM requires); any number of KV cache groups;
- ``get_block_ids_with_load_errors()``: the GPU block ids of synchronous loads that failed
  (the request already runs this step); vLLM refuses this with more than one KV cache group.
The worker reports a failed load to vLLM's worker connector as a finished transfer and
records it here; ``offloadd.vllm.step_hook`` wraps the calling connector's two methods to add
what is recorded (``take``). Pure logic: no vLLM, no sockets.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["LoadFailures"]


class LoadFailures:
    """Failed loads not yet reported to vLLM, and how many there were."""

    def __init__(self) -> None:
        self.count = 0  # load jobs failed since start (the plugin's counter)
        self.reporting = False  # set once the connector's methods are wrapped to report them
        self.groups = 1  # the engine's KV cache groups (a synchronous failure needs one)
        self._requests: set[str] = set()
        self._blocks: set[int] = set()

    def can_report(self, expedited: bool) -> bool:
        """Whether vLLM can be told of this load's failure (else it must not run on)."""
        return self.reporting and (not expedited or self.groups == 1)

    def failed(self, request: str, block_ids: Iterable[int], *, expedited: bool) -> None:
        """A load of ``request`` into ``block_ids`` failed; ``expedited``: synchronous."""
        self.count += 1
        if expedited:
            self._blocks.update(block_ids)
        else:
            self._requests.add(request)

    def take(self) -> tuple[set[str], set[int]]:
        """The requests and the blocks failed since the last call."""
        requests, self._requests = self._requests, set()
        blocks, self._blocks = self._blocks, set()
        return requests, blocks

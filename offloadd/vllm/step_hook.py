"""Tell the rank's worker when vLLM's last submission of a step is in.

vLLM 0.33's ``OffloadingWorker`` interface has no "end of submissions" call: its
``OffloadingConnectorWorker`` submits a step's jobs in ``handle_preemptions`` (the stores
``wait_for_save`` deferred from the last step, before the forward pass) and
``start_kv_transfers`` (any stores left, then the loads: before the forward pass when some
load is synchronous, else right after its launch), and the next call the worker sees is
``get_finished``, after the forward pass. ``install`` wraps those two methods of the one
``OffloadingConnectorWorker`` that asked the spec for ``worker`` (instance attributes: the
class and every other instance are untouched), so that ``worker.send_step()`` runs once the
step's jobs are all in:

- after ``handle_preemptions`` when the step has no loads (``start_kv_transfers`` then
  submits nothing: ``handle_preemptions`` took every deferred store), so a step of stores
  sends before the forward pass;
- after ``start_kv_transfers`` always (a step with loads: its stores and loads in one
  message; its synchronous loads' ``wait`` has sent them already).

The caller is found by walking up from ``get_worker`` to the frame whose ``self`` is an
``OffloadingConnectorWorker`` holding this spec (vLLM calls ``get_worker`` from its
``_init_worker``). Where none is found (another vLLM, a spec driven by other code), nothing
is wrapped and the jobs leave at the worker's next ``wait`` or ``get_finished``, as without
the hook; ``install`` says so at INFO.

Further up is the connector that owns it (the ``KVConnectorBase_V1`` whose
``connector_worker`` it is, from its ``register_kv_caches``): its ``get_transfer_results``
and ``get_block_ids_with_load_errors`` are wrapped the same way to report the loads the
daemon could not serve (``offloadd.vllm.load_failures``), so vLLM recomputes them. Without
that connector, a failed load raises in the worker, as before.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, Protocol

from offloadd.vllm.load_failures import LoadFailures

logger = logging.getLogger(__name__)

# vLLM 0.33: 5 up from _up_the_stack to the connector worker (calling_connector_worker,
# install, get_worker, _init_worker), 6 to its connector.
_MAX_FRAMES = 10


class StepSender(Protocol):
    load_failures: LoadFailures

    def send_step(self) -> None:
        """Send the step's jobs now (nothing when none are queued)."""


def calling_connector_worker(spec: object) -> Any | None:
    """The ``OffloadingConnectorWorker`` up the call stack whose ``spec`` is ``spec``."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
            OffloadingConnectorWorker,
        )
    except ImportError:
        return None
    return _up_the_stack(
        lambda candidate: (
            isinstance(candidate, OffloadingConnectorWorker) and candidate.spec is spec
        )
    )


def calling_connector(connector_worker: object) -> Any | None:
    """The connector up the call stack whose ``connector_worker`` is ``connector_worker``."""
    return _up_the_stack(
        lambda candidate: getattr(candidate, "connector_worker", None) is connector_worker
    )


def _up_the_stack(wanted: Callable[[object], bool]) -> Any | None:
    """The first ``self`` up the call stack that is ``wanted``."""
    frame = inspect.currentframe()
    try:
        for _ in range(_MAX_FRAMES):
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if wanted(candidate):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame reference in a local keeps the stack alive


def install(spec: object, worker: StepSender) -> bool:
    """Make ``worker`` send each step's jobs once vLLM submitted them all; False (and the
    worker sends at ``get_finished``) when the calling connector worker is not found."""
    connector_worker = calling_connector_worker(spec)
    connector = calling_connector(connector_worker) if connector_worker is not None else None
    if connector_worker is not None and connector is not None:
        report_load_failures(connector, worker.load_failures, connector_worker.kv_cache_config)
    if connector_worker is None or not all(
        callable(getattr(connector_worker, name, None))
        for name in ("handle_preemptions", "start_kv_transfers")
    ):
        logger.info(
            "offloadd: no vLLM OffloadingConnectorWorker found calling get_worker; a step's "
            "jobs leave at get_finished (after the forward pass)"
        )
        return False
    handle_preemptions = connector_worker.handle_preemptions
    start_kv_transfers = connector_worker.start_kv_transfers

    @functools.wraps(handle_preemptions)
    def preempted(metadata: Any) -> None:
        handle_preemptions(metadata)
        if getattr(metadata, "load_jobs", None) == {}:  # no load follows: all jobs are in
            worker.send_step()

    @functools.wraps(start_kv_transfers)
    def started(metadata: Any) -> None:
        start_kv_transfers(metadata)
        worker.send_step()

    connector_worker.handle_preemptions = preempted
    connector_worker.start_kv_transfers = started
    logger.debug("offloadd: a step's jobs leave when vLLM's last submission is in")
    return True


def report_load_failures(connector: Any, failures: LoadFailures, kv_cache_config: Any) -> bool:
    """Wrap ``connector``'s ``get_transfer_results`` and ``get_block_ids_with_load_errors``
    (instance attributes) to add the loads that failed since the last call: asynchronous
    ones as ``failed_recving`` request ids, synchronous ones as invalid block ids. False
    (nothing wrapped) where the connector lacks either method."""
    names = ("get_transfer_results", "get_block_ids_with_load_errors")
    if not all(callable(getattr(connector, name, None)) for name in names):
        return False
    transfer_results = connector.get_transfer_results
    load_errors = connector.get_block_ids_with_load_errors
    taken: list[set[int]] = []  # the blocks taken with the results, for load_errors next

    @functools.wraps(transfer_results)
    def with_failed_loads(finished_req_ids: set[str]) -> Any:
        results = transfer_results(finished_req_ids)
        requests, blocks = failures.take()
        if requests:
            results.failed_recving = set(results.failed_recving) | requests
        if blocks:
            taken.append(blocks)
        return results

    @functools.wraps(load_errors)
    def with_failed_blocks() -> set[int]:
        blocks = set(load_errors())
        while taken:
            blocks |= taken.pop()
        return blocks

    connector.get_transfer_results = with_failed_loads
    connector.get_block_ids_with_load_errors = with_failed_blocks
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    failures.groups = len(groups) if groups is not None else 2  # unknown: report none sync
    failures.reporting = True
    return True

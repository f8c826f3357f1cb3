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
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_MAX_FRAMES = 8  # vLLM 0.33: 4 up from here (install, get_worker, _init_worker)


class StepSender(Protocol):
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
    frame = inspect.currentframe()
    try:
        for _ in range(_MAX_FRAMES):
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, OffloadingConnectorWorker) and candidate.spec is spec:
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame reference in a local keeps the stack alive


def install(spec: object, worker: StepSender) -> bool:
    """Make ``worker`` send each step's jobs once vLLM submitted them all; False (and the
    worker sends at ``get_finished``) when the calling connector worker is not found."""
    connector_worker = calling_connector_worker(spec)
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

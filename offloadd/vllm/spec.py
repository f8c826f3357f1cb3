"""``OffloaddSpec``: what stock vLLM 0.33 loads through ``spec_module_path="offloadd.vllm"``.

vLLM's ``OffloadingConnector`` builds its ``OffloadingConfig`` and creates the spec in every
process: the scheduler asks it for a manager, each rank for a worker. Keys read from
``kv_connector_extra_config``:

- ``offloadd_endpoint``: the daemon's control endpoint (else ``OFFLOADD_ENDPOINT``, else the
  node daemon's default socket, ``ipc:///run/offloadd/offloadd.sock`` where that directory
  exists: see ``offloadd.endpoint.runtime_dir``);
- ``offloadd_optional``: with no daemon at start, run without offload (every lookup misses,
  nothing is stored) and start offloading when it appears, instead of failing;
- ``offloadd_timeout``: seconds to wait for the daemon's answers (default 10);
- ``offloadd_load_timeout``: seconds after which a load still not finished fails loudly
  (default 60).
- ``offloadd_store_timeout``: seconds after which a store the daemon has not finished is given
  up (done, nothing cached; the daemon commits none of it later): how long a stalled daemon
  holds a request's GPU blocks (default 10, > 0).
- ``offloadd_load_wait_ms``: how long ``get_finished`` waits, from their submit, for the loads
  a rank sent in this step (default 2; 0: never waits). vLLM submits asynchronous loads after
  it launched the forward pass and asks for them once it ended: on a GPU they are done by
  then, but on a host where the forward pass ran before the submit (a CPU host), each load
  would finish a whole step later for a turnaround of a millisecond or two.
``block_size`` / ``blocks_per_chunk``, ``namespace`` and ``private_cache`` are read by vLLM and
the daemon as usual; ``canonical_layout: true`` (vLLM's parallelism-free host layout) makes each
rank send its canonical page mappings with its regions, and engines of the same model in that
layout share chunks whatever their TP size (``docs/design.md``, "What is shared across what").

``get_worker`` also hooks the calling ``OffloadingConnectorWorker`` so that a step's jobs
leave once vLLM submitted them all (``offloadd.vllm.step_hook``).

The spec declares the series and info labels vLLM's ``vllm:kv_offload_*`` metrics read from its
manager (``offloadd.vllm.stats``): the CPU spec's, so its dashboards work unchanged.
"""

from __future__ import annotations

import math
import os
from typing import Any

from vllm.v1.kv_offload.base import (
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)

from offloadd.endpoint import default_endpoint
from protocol.config import from_vllm_offloading_config

__all__ = ["OffloaddSpec"]


class OffloaddSpec(OffloadingSpec):
    """Offload vLLM's KV cache to the node's offloadd daemon."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The series ``OffloaddManager.get_stats`` reports (vLLM's CPU spec's names)."""
        from offloadd.vllm.stats import metric_definitions

        return metric_definitions(extra_config)

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The ``vllm:kv_offload_config_info`` labels ``OffloaddManager.config_info`` fills."""
        from offloadd.vllm.stats import config_info_keys

        return config_info_keys()

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        # Exactly the config vLLM built, converted field by field for the daemon.
        self.offloadd_config = from_vllm_offloading_config(config)
        extra = self.extra_config
        self.endpoint: str = str(
            extra.get("offloadd_endpoint")
            or os.environ.get("OFFLOADD_ENDPOINT")
            or default_endpoint(service=False)
        )
        self.optional = bool(extra.get("offloadd_optional", False))
        self.timeout = float(extra.get("offloadd_timeout", 10.0))
        self.load_timeout = float(extra.get("offloadd_load_timeout", 60.0))
        self.store_timeout = float(extra.get("offloadd_store_timeout", 10.0))
        if not (math.isfinite(self.store_timeout) and self.store_timeout > 0):
            raise ValueError(
                f"offloadd_store_timeout must be a finite number of seconds > 0, got "
                f"{extra.get('offloadd_store_timeout')!r}"
            )
        self.load_wait = float(extra.get("offloadd_load_wait_ms", 2.0)) / 1000
        if not (math.isfinite(self.load_wait) and self.load_wait >= 0):
            raise ValueError(
                f"offloadd_load_wait_ms must be a finite number of milliseconds >= 0, got "
                f"{extra.get('offloadd_load_wait_ms')!r}"
            )
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        """The scheduler's manager (one per process)."""
        if self._manager is None:
            from offloadd.vllm.manager import OffloaddManager

            self._manager = OffloaddManager(
                self.offloadd_config,
                endpoint=self.endpoint,
                optional=self.optional,
                record_events=self.kv_events_config.enable_kv_cache_events,
                timeout=self.timeout,
            )
        return self._manager

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        """This rank's worker (one per process)."""
        if self._worker is None:
            from offloadd.vllm import step_hook
            from offloadd.vllm.worker import OffloaddWorker

            worker = OffloaddWorker(
                self.offloadd_config,
                kv_caches,
                endpoint=self.endpoint,
                optional=self.optional,
                load_timeout=self.load_timeout,
                timeout=self.timeout,
                store_timeout=self.store_timeout,
                load_wait=self.load_wait,
            )
            # The step's jobs leave once vLLM submitted them all (before the forward pass
            # where it can), not at get_finished: see step_hook.
            step_hook.install(self, worker)
            self._worker = worker
        return self._worker

"""The rank side: vLLM's ``OffloadingWorker`` over the daemon, one per GPU worker.

Contract with vLLM 0.33 (``OffloadingConnectorWorker``):
- ``submit_store`` / ``submit_load`` return True (vLLM asserts it) and never block on the
  copy: the request is sent and the daemon answers ``JobAccepted`` at once.
- ``get_finished`` never blocks (a non-blocking poll); ``wait`` blocks until the jobs finish.
- A store that the daemon could not complete is harmless (the chunk is just not cached), so it
  is reported as done. A load that fails is not: vLLM has no way to recompute it, so the
  worker raises ``LoadFailed`` instead of letting the engine run on wrong KV.

Ordering against the GPU: on CUDA every store and load carries an interprocess event recorded
on the current stream, and the daemon's copy waits for it; CPU tensors need no event (the
forward pass has finished writing when vLLM submits).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from offloadd.client import OffloadClient
from offloadd.errors import DaemonUnavailable, JobError, OffloaddError
from offloadd.vllm.regions import kv_regions, open_region_files
from offloadd.vllm.transfer_specs import OffloaddLoadSpec, OffloaddStoreSpec
from protocol.config import OffloadingConfig
from protocol.handles import KVRegion
from protocol.messages import JobDone, Segment

logger = logging.getLogger(__name__)

RECONNECT_SECONDS = 1.0


class LoadFailed(RuntimeError):
    """A KV load could not be completed; vLLM must not compute on those blocks."""


@dataclass
class _Job:
    load: bool
    started: float
    event: Any = None  # the CUDA event the daemon waits on, kept alive until the job ends


def segments_for(
    keys: Sequence[bytes], gpu: GPULoadStoreSpec, blocks_per_chunk: int, group_ids: Sequence[int]
) -> list[Segment]:
    """The wire segments of one job: per group, its keys and its blocks from ``gpu``.

    vLLM lists keys group-major in config order; group ``g`` has ``group_sizes[g]`` blocks
    starting at sub-block ``block_indices[g] % blocks_per_chunk`` of its first chunk.
    """
    segments: list[Segment] = []
    position = 0
    for group_id, size, index in zip(group_ids, gpu.group_sizes, gpu.block_indices, strict=True):
        if size == 0:
            continue
        skip = index % blocks_per_chunk
        count = -(-(skip + size) // blocks_per_chunk)
        names = {int.from_bytes(key[-4:], "big") for key in keys[position : position + count]}
        if len(keys) < position + count or names != {group_id}:
            raise ValueError(
                f"group {group_id}: {size} blocks from sub-block {skip} need {count} keys of "
                f"that group at position {position}; the keys name groups {sorted(names)}"
            )
        segments.append(Segment(count, skip, int(size)))
        position += count
    if position != len(keys):
        raise ValueError(f"{len(keys)} keys for blocks that fill {position} chunks")
    return segments


class OffloaddWorker(OffloadingWorker):
    """vLLM's rank-side worker backed by offloadd; see the module docstring."""

    def __init__(
        self,
        config: OffloadingConfig,
        kv_caches: Any,
        *,
        endpoint: str,
        optional: bool,
        load_timeout: float = 60.0,
        timeout: float = 10.0,
    ) -> None:
        self._config = config
        self._endpoint = endpoint
        self._bpc = config.cache.blocks_per_chunk
        self._group_ids = config.group_ids()
        self._regions: list[KVRegion] = kv_regions(kv_caches, config.groups)
        # CPU tensors: their files, opened here (the rank owns them) and passed to the daemon
        # as descriptors; kept for a reconnect.
        self._files = open_region_files(self._regions)
        self._cuda = any(t.tensor.is_cuda for t in kv_caches.tensors)
        self._device = next((t.tensor.device for t in kv_caches.tensors if t.tensor.is_cuda), None)
        self._load_timeout = load_timeout
        self._jobs: dict[int, _Job] = {}
        self._results: list[TransferResult] = []
        self._lock = threading.Lock()  # guards the hand-over of a late connection
        self._client: OffloadClient | None = None
        try:
            self._client = self._connect(timeout)
        except DaemonUnavailable:
            if not optional:
                raise DaemonUnavailable(
                    f"offloadd: no daemon answers at {endpoint} (rank "
                    f"{config.parallel.rank}); start it, point offloadd_endpoint at it, or set "
                    '"offloadd_optional": true'
                ) from None
            logger.warning("offloadd: no daemon at %s; rank runs without offload", endpoint)
            threading.Thread(
                target=self._connect_later, name="offloadd-connect", daemon=True
            ).start()

    # -- vLLM's interface --------------------------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Send the store; a store that cannot be sent is reported done (nothing cached)."""
        assert isinstance(dst_spec, OffloaddStoreSpec)
        client = self._connected()
        if client is None or not dst_spec.keys:
            self._results.append(TransferResult(job_id, True))
            return True
        segments = segments_for(dst_spec.keys, src_spec, self._bpc, self._group_ids)
        job = _Job(load=False, started=time.perf_counter())
        wait_event, job.event = self._record_event()
        try:
            client.store(
                job_id,
                dst_spec.keys,
                src_spec.block_ids.tolist(),
                segments=segments,
                reserved=True,
                wait_event=wait_event,
            )
        except OffloaddError as exc:
            logger.warning("offloadd: store job %d not sent: %s", job_id, exc)
            self._results.append(TransferResult(job_id, True))
            return True
        self._jobs[job_id] = job
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Send the load of the keys the scheduler holds; raises LoadFailed if it cannot."""
        assert isinstance(src_spec, OffloaddLoadSpec)
        client = self._connected()
        if client is None:
            raise LoadFailed(f"offloadd: load job {job_id}: no daemon at {self._endpoint}")
        segments = segments_for(src_spec.keys, dst_spec, self._bpc, self._group_ids)
        job = _Job(load=True, started=time.perf_counter())
        wait_event, job.event = self._record_event()
        try:
            client.load(
                job_id,
                src_spec.keys,
                dst_spec.block_ids.tolist(),
                segments=segments,
                hold=src_spec.hold,
                wait_event=wait_event,
            )
        except OffloaddError as exc:
            raise LoadFailed(f"offloadd: load job {job_id} refused: {exc}") from exc
        self._jobs[job_id] = job
        return True

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call; never blocks."""
        client = self._connected()
        if client is not None and self._jobs:
            try:
                client.poll(0)
            except OffloaddError as exc:
                logger.warning("offloadd: poll failed: %s", exc)
            self._collect(client)
        results, self._results = self._results, []
        return results

    def wait(self, job_ids: set[int]) -> None:
        """Block until ``job_ids`` are finished (their results still come from get_finished)."""
        client = self._connected()
        pending = [job_id for job_id in job_ids if job_id in self._jobs]
        if client is None or not pending:
            return
        try:
            client.wait(pending, self._load_timeout, raise_on_failure=False)
        except JobError as exc:
            if any(self._jobs[job_id].load for job_id in pending if job_id in self._jobs):
                raise LoadFailed(f"offloadd: loads did not finish: {exc}") from exc
            logger.warning("offloadd: stores did not finish in time: %s", exc)
        self._collect(client)

    def shutdown(self) -> None:
        """End the session."""
        client, self._client = self._client, None
        if client is not None:
            client.close()
        files, self._files = self._files, {}
        for fd in files.values():
            os.close(fd)

    # -- internals -------------------------------------------------------------------------

    def _connect(self, timeout: float) -> OffloadClient:
        device_uuid = ""
        if self._device is not None:
            from offloadd.cuda_ipc import device_uuid as uuid_of

            device_uuid = uuid_of(self._device.index or 0)
        return OffloadClient.connect(
            self._endpoint,
            self._config,
            self._regions,
            device_uuid=device_uuid,
            name=f"vllm rank {self._config.parallel.rank}",
            mirror=True,  # this engine's scheduler publishes its events
            timeout=timeout,
            files=self._files,
        )

    def _connect_later(self) -> None:
        while self._client is None:
            time.sleep(RECONNECT_SECONDS)
            try:
                client = self._connect(0.5)
            except OffloaddError:
                continue
            with self._lock:
                self._client = client
            logger.info(
                "offloadd: rank %d connected to %s", self._config.parallel.rank, self._endpoint
            )

    def _connected(self) -> OffloadClient | None:
        with self._lock:
            return self._client

    def _record_event(self) -> tuple[bytes, Any]:
        """An interprocess CUDA event after the current stream's work, for the daemon to wait
        on; nothing on CPU."""
        if not self._cuda:
            return b"", None
        import torch

        event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        return bytes(event.ipc_handle()), event  # type: ignore[no-untyped-call]

    def _collect(self, client: OffloadClient) -> None:
        now = time.perf_counter()
        for job_id, job in list(self._jobs.items()):
            done = client.finished.get(job_id)
            if done is None:
                if now - job.started <= self._load_timeout:
                    continue
                if job.load:
                    raise LoadFailed(
                        f"offloadd: load job {job_id} did not finish within "
                        f"{self._load_timeout:.0f}s (daemon at {self._endpoint} gone?)"
                    )
                # A store that never ends (the daemon went away) must not hold the blocks
                # forever: vLLM gets it back as done, nothing was cached.
                logger.warning("offloadd: store job %d did not finish; given up", job_id)
                done = JobDone(job_id, False, [], 0, 0.0, "timed out")
            del self._jobs[job_id]
            self._results.append(self._result(job_id, job, done))

    def _result(self, job_id: int, job: _Job, done: JobDone) -> TransferResult:
        if job.load and not done.ok:
            raise LoadFailed(
                f"offloadd: load job {job_id} failed ({done.error or 'keys missing'}, "
                f"{len(done.failed_keys)} keys); refusing to run on KV that was not loaded"
            )
        if not done.ok:
            logger.debug("offloadd: store job %d stored part: %s", job_id, done.error)
        return TransferResult(job_id, True, done.nbytes, done.seconds)

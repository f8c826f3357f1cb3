"""Builders shared by the tests that run the daemon's parts without one: Hellos and configs a
registry accepts (their regions name shm paths that do not exist: the registry never opens a
handle), engines made ready, daemon stats, and metric samples read back."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from offloadd.server.metrics import Metrics
from offloadd.server.registry import Engine, HelloOutcome, Registry
from protocol.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from protocol.handles import KVRegion, ShmHandle
from protocol.messages import DaemonStats, EngineState, Hello, Role

LAYERS = ("layer.0", "layer.1")
PAGE = 64
STRIDE = 64
NUM_BLOCKS = 16


def region(
    layers: tuple[str, ...],
    *,
    page: int = PAGE,
    stride: int | None = None,
    num_blocks: int = NUM_BLOCKS,
    handle_size: int | None = None,
    offset: int = 0,
    path: str | None = None,
) -> KVRegion:
    # One file per tensor, as ranks register them: regions over one handle are one tensor.
    path = path if path is not None else "/dev/shm/kv-test-" + "-".join(layers)
    stride = page if stride is None else stride
    size = num_blocks * stride if handle_size is None else handle_size
    return KVRegion(
        handle=ShmHandle(path=path, offset=offset, size=size),
        num_blocks=num_blocks,
        page_size=page,
        block_stride=stride,
        layer_names=layers,
    )


def config(
    *,
    engine_id: str = "engine-a",
    dp: int = 0,
    rank: int = 0,
    world_size: int = 2,
    tp_size: int | None = None,
    pp_size: int = 1,
    model: str = "org/model",
    dtype: str = "bfloat16",
    tokens_per_hash: int = 16,
    tokens_per_block: int = 16,
    blocks_per_chunk: int = 2,
    groups: tuple[tuple[str, ...], ...] = (LAYERS,),
    worker_kv_bytes_per_block: int | None = None,
    extra: dict[str, Any] | None = None,
    replicated: bool = False,
) -> OffloadingConfig:
    if worker_kv_bytes_per_block is None:
        worker_kv_bytes_per_block = STRIDE * sum(len(layers) for layers in groups)
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(tokens_per_block=tokens_per_block, layer_names=layers)
            for layers in groups
        ),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=True,
        extra_config=dict(extra or {}),
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_hash, blocks_per_chunk=blocks_per_chunk
        ),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size // pp_size if tp_size is None else tp_size,
            pp_size=pp_size,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=dp,
            is_parallelism_agnostic=True,
        ),
        replicated_layout=replicated,
    )


def hello(
    cfg: OffloadingConfig | None = None,
    regions: tuple[KVRegion, ...] | None = None,
    *,
    role: Role = "worker",
    **config_overrides: Any,
) -> Hello:
    """A Hello; by default one unpadded region per layer of every group."""
    cfg = cfg if cfg is not None else config(**config_overrides)
    if regions is None:
        if role == "scheduler":
            regions = ()
        else:
            regions = tuple(
                region((name,), path=f"/dev/shm/kv-{cfg.engine_id}-{cfg.parallel.rank}-{name}")
                for group in cfg.groups
                for name in group.layer_names
            )
    return Hello(
        request_id=1,
        protocol_version=1,
        role=role,
        config=cfg,
        regions=regions,
        device_uuid=f"GPU-{cfg.parallel.rank}",
        pid=1000 + cfg.parallel.rank,
    )


def register_engine(reg: Registry, prefix: str = "s", **overrides: Any) -> list[HelloOutcome]:
    """Every rank of one engine says Hello, rank order; session ids ``{prefix}{rank}``."""
    world_size = overrides.pop("world_size", 2)
    return [
        reg.hello(f"{prefix}{rank}", hello(rank=rank, world_size=world_size, **overrides))
        for rank in range(world_size)
    ]


def ready(registry: Registry, engine_id: str, *, events: bool = True, dp: int = 0) -> Engine:
    outcome = None
    for rank in range(2):
        cfg = config(engine_id=engine_id, rank=rank, dp=dp)
        cfg = msgspec.structs.replace(cfg, enable_kv_cache_events=events)
        outcome = registry.hello(f"{engine_id}-{dp}-{rank}", hello(cfg))
    assert outcome is not None and outcome.engine.ready
    return outcome.engine


def fake_stats(**changes: object) -> DaemonStats:
    values: dict[str, object] = {
        "uptime_seconds": 42.5,
        "capacity_bytes": 1 << 30,
        "used_bytes": 3 << 20,
        "entries": 10,
        "committed_entries": 7,
        "lookups": 5,
        "hits": 12,
        "misses": 4,
        "stores_refused": 2,
        "stores_refused_by_reason": {"full": 2},
        "evictions": 9,
        "bytes_stored": 100,
        "bytes_loaded": 50,
        "protocol_errors": 1,
        "sessions": 3,
        "engines": [
            EngineState("engine-a", 0, 2, True, [0, 1], "ns1", 1),
            EngineState("engine-b", 1, 4, False, [2], "", 0),
        ],
    }
    values.update(changes)
    return DaemonStats(**values)  # type: ignore[arg-type]


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@contextlib.contextmanager
def tmpfs(size: str, mode: str, prefix: str) -> Iterator[str]:
    """A tmpfs of the caller's own (``size``, ``mode`` as mount takes them), never /dev/shm
    (shared); skips the test where it cannot be mounted (not root, no mount rights)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    directory = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", directory],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        os.rmdir(directory)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", directory], check=False)
        os.rmdir(directory)


@contextlib.contextmanager
def held_report(process: subprocess.Popen[str]) -> Iterator[dict[str, Any]]:
    """The JSON line a helper started with ``--hold`` prints once it holds its session; the
    helper is let go (its stdin closed) and waited for when the block ends."""
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line, process.stderr.read() if process.stderr else "no report"
        yield json.loads(line)
    finally:
        process.communicate(timeout=60)


@contextlib.contextmanager
def system_group(name: str) -> Iterator[int]:
    """The system group ``name``'s gid, made with groupadd for the block (and removed after)
    unless it exists already; skips where the host has no groupadd."""
    if shutil.which("groupadd") is None:
        pytest.skip("no groupadd on this host")
    made = False
    try:
        grp.getgrnam(name)
    except KeyError:
        subprocess.run(["groupadd", "--system", name], check=True)
        made = True
    try:
        yield grp.getgrnam(name).gr_gid
    finally:
        if made:
            subprocess.run(["groupdel", name], check=False)

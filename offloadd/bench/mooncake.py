"""The cluster tier vs Mooncake Store used raw, same chunks, same run.

A ``mooncake_master`` on loopback (free ports) and two nodes in this process, each an arena
and a ``MooncakeTier`` contributing a segment: node A publishes, node B promotes.

- ``mooncake_put_<chunk>``: GiB/s of ``MooncakeTier.put`` on A (every shard sealed with
  AES-GCM into the staging buffer and xxh3_64'd, the data object, then its MAC'd companion);
  baseline: raw ``batch_put_from`` of the
  same chunks' bytes (shards laid out contiguously: one range per chunk) through the same
  client, under other names.
- ``mooncake_get_<chunk>``: GiB/s of ``MooncakeTier.get`` on B (companion, data into the
  extents, xxh3_64 check); baseline: raw ``batch_get_into`` of the raw objects into the same
  extents of B's arena.

- ``mooncake_seal_<chunk>`` / ``mooncake_open_<chunk>``: what the AEAD costs, in one run and
  without the network: GiB/s of the tier's own sealing of a call's shards (AES-GCM from the
  arena into the staging buffer, then xxh3_64 of the sealed bytes) and of its opening
  (xxh3_64, then AES-GCM into the extents); baseline: xxh3_64 of the same shards in place,
  the whole per-byte work of the plain (v2) tier it replaced.

Each rep puts new names (a put of an existing name costs nothing) and removes them after.
Reps alternate tier and raw (sealed and plain), and each pair is compared. Skipped when
mooncake is not installed (``pip install 'offloadd[mooncake]'``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

from offloadd.bench._util import Context, Result, median, paired_ratio, size_name
from offloadd.cache.arena import Arena
from offloadd.safety import write_secret
from offloadd.settings import MooncakeSettings
from offloadd.tiers.base import ChunkAddress

GiB = 1 << 30
SHARDS = 4
BATCH_BYTES = 64 << 20  # one put / get call
SMOKE_BATCH_BYTES = 8 << 20  # --smoke
CHUNK_SIZES = (256 << 10, 4 << 20)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _master_binary() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return beside if os.access(beside, os.X_OK) else shutil.which("mooncake_master")


@contextlib.contextmanager
def _master(binary: str):
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [
                binary,
                "--rpc_address=127.0.0.1",
                f"--rpc_port={rpc}",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={http}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            metadata = f"http://127.0.0.1:{http}/metadata"
            deadline = time.monotonic() + 30
            while True:
                if process.poll() is not None:
                    raise RuntimeError("mooncake_master exited at start")
                try:
                    socket.create_connection(("127.0.0.1", rpc), timeout=1).close()
                    urllib.request.urlopen(f"{metadata}?key=probe", timeout=1).close()
                    break
                except urllib.error.HTTPError:
                    break  # it answers (404 for an unknown key)
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("mooncake_master did not answer in 30s") from None
                    time.sleep(0.05)
            yield f"127.0.0.1:{rpc}", metadata
        finally:
            process.kill()
            process.wait()


def mooncake_installed() -> tuple[str | None, str]:
    """``(mooncake_master's path, "")``, or ``(None, what is missing)``."""
    from offloadd.tiers.mooncake_client import MooncakeUnavailable, _load_store_class

    try:
        _load_store_class()
    except MooncakeUnavailable as exc:
        return None, str(exc)
    binary = _master_binary()
    if binary is None:
        return None, "mooncake_master is not installed"
    return binary, ""


TENANTS = {"bench": [f"uid:{os.getuid()}"]}  # this user, named "bench" in the cluster


def cluster_key(ctx: Context) -> str:
    """A fresh cluster key for the run's nodes (32 random bytes, 0600, in the scratch dir)."""
    key_file = ctx.scratch.shm_path("mooncake-cluster.key")
    write_secret(key_file, os.urandom(32))
    return key_file


def _wanted_sizes(ctx: Context, *operations: str) -> list[int]:
    """The chunk sizes for which some ``mooncake_<operation>_<size>`` result is wanted."""
    return [
        size
        for size in CHUNK_SIZES
        if any(ctx.wanted(f"mooncake_{op}_{size_name(size)}") for op in operations)
    ]


def run(ctx: Context) -> list[Result]:
    """``mooncake_put_<chunk>`` and ``mooncake_get_<chunk>`` for each chunk size."""
    from offloadd.tiers.mooncake import MooncakeTier

    binary, missing = mooncake_installed()
    if binary is None:
        ctx.skip("mooncake", missing)
        return []
    sizes = _wanted_sizes(ctx, "put", "get")
    if not sizes:
        return []
    reps = ctx.pick(9, 3, 1)
    batch = ctx.pick(BATCH_BYTES, BATCH_BYTES, SMOKE_BATCH_BYTES)
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        master, metadata = stack.enter_context(_master(binary))
        settings = MooncakeSettings(
            key_file=cluster_key(ctx),
            tenants=TENANTS,
            master=master,
            metadata=metadata,
            segment=4 * BATCH_BYTES,
            local_buffer=16 << 20,
            local_hostname="127.0.0.1",
        )
        arenas, tiers = [], []
        for label in ("a", "b"):
            arena = Arena(ctx.scratch.shm_path(f"mooncake-{label}"), batch + (1 << 20))
            stack.callback(arena.close)
            tier = MooncakeTier(settings, arena, tenant_of=lambda namespace: f"u{os.getuid()}")
            stack.callback(tier.close)
            arenas.append(arena)
            tiers.append(tier)
        for size in sizes:
            results += _measure(ctx, arenas, tiers, size, reps, batch)
    return results


def run_aead(ctx: Context) -> list[Result]:
    """``mooncake_seal_<chunk>`` and ``mooncake_open_<chunk>`` for each chunk size."""
    from offloadd.tiers.mooncake import ClusterKeys, MooncakeUnavailable

    sizes = _wanted_sizes(ctx, "seal", "open")
    if not sizes:
        return []
    try:
        keys = ClusterKeys(os.urandom(32))
    except MooncakeUnavailable as exc:
        ctx.skip("mooncake aead", str(exc))
        return []
    reps = ctx.pick(9, 3, 1)
    batch = ctx.pick(BATCH_BYTES, BATCH_BYTES, SMOKE_BATCH_BYTES)
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        arena = Arena(ctx.scratch.shm_path("mooncake-aead"), batch + (1 << 20))
        stack.callback(arena.close)
        for offset in range(0, batch, 1 << 20):
            arena.view(offset, 1 << 20)[:] = os.urandom(1 << 20)
        for size in sizes:
            results += _measure_aead(ctx, arena, keys, size, reps, batch)
    return results


def _measure_aead(
    ctx: Context, arena: Arena, keys, size: int, reps: int, batch: int = BATCH_BYTES
) -> list[Result]:
    from offloadd.checksum import checksum
    from offloadd.tiers.mooncake import _Job, _open_sealed, _seal, sealed_size

    count = batch // size
    shard = size // SHARDS
    label = size_name(size)
    space = keys.space("bench", f"bench-{uuid.uuid4().hex}")
    chunks = [
        ChunkAddress(
            space.prefix,
            os.urandom(16),
            tuple((i * size + s * shard, shard) for s in range(SHARDS)),
        )
        for i in range(count)
    ]
    staging = (ctypes.c_char * sum(sealed_size(chunk) for chunk in chunks))()
    base = ctypes.addressof(staging)
    jobs, at = [], base
    for index, chunk in enumerate(chunks):
        data, companion = space.names(chunk.key)
        jobs.append(_Job(index, chunk, space, data, companion, at))
        at += sealed_size(chunk)
    ctx.progress(
        f"mooncake aead: {count} chunks of {label} ({SHARDS} shards) per call, {reps} reps"
    )

    def plain() -> None:
        for chunk in chunks:
            for offset, length in chunk.extents:
                checksum(arena.address + offset, length)

    timings: dict[str, list[float]] = {"seal": [], "open": [], "plain_seal": [], "plain_open": []}
    for rep in range(reps):
        for kind in ("seal", "open"):
            for side in (kind, "plain_" + kind) if rep % 2 == 0 else ("plain_" + kind, kind):
                started = time.perf_counter()
                if side == "seal":
                    sealed = _seal(arena.address, jobs)
                elif side == "open":
                    expected = [list(zip(sums, nonces, strict=True)) for sums, nonces in sealed]
                    if not all(_open_sealed(arena.address, jobs, expected)):
                        raise RuntimeError("mooncake aead bench: a sealed shard did not open")
                else:
                    plain()
                timings[side].append(batch / (time.perf_counter() - started) / GiB)
    params = {
        "chunk_bytes": size,
        "shards": SHARDS,
        "chunks_per_call": count,
        "reps": reps,
        "baseline": "xxh3_64 of the plaintext shards in place (the plain v2 tier's work)",
    }
    sides = [(kind, timings[kind], timings["plain_" + kind]) for kind in ("seal", "open")]
    return _rows(ctx, label, sides, params)


def _measure(
    ctx: Context, arenas, tiers, size: int, reps: int, batch: int = BATCH_BYTES
) -> list[Result]:
    arena_a, arena_b = arenas
    tier_a, tier_b = tiers
    raw_a, raw_b = tier_a._client, tier_b._client
    count = batch // size
    shard = size // SHARDS
    label = size_name(size)
    ctx.progress(f"mooncake: {count} chunks of {label} ({SHARDS} shards) per call, {reps} reps")
    for offset in range(0, count * size, 1 << 20):  # random bytes: nothing compresses
        arena_a.view(offset, min(1 << 20, count * size - offset))[:] = os.urandom(
            min(1 << 20, count * size - offset)
        )
    offsets = [i * size for i in range(count)]
    puts, raw_puts, gets, raw_gets = [], [], [], []
    for rep in range(reps):
        namespace = f"bench-{uuid.uuid4().hex}"
        keys = [os.urandom(16) for _ in range(count)]
        chunks = [
            ChunkAddress(namespace, key, tuple((o + s * shard, shard) for s in range(SHARDS)))
            for key, o in zip(keys, offsets, strict=True)
        ]
        raw_names = [f"bench-raw/{namespace}/{i}" for i in range(count)]
        addresses_a = [arena_a.address + o for o in offsets]
        addresses_b = [arena_b.address + o for o in offsets]
        order = (0, 1) if rep % 2 == 0 else (1, 0)
        for side in order:
            started = time.perf_counter()
            if side == 0:
                ok = all(tier_a.put(chunks, arena_a).stored)
            else:
                codes = raw_a.batch_put_from(raw_names, addresses_a, [size] * count)
                ok = all(c == 0 for c in codes)
            elapsed = time.perf_counter() - started
            if not ok:
                raise RuntimeError(f"mooncake bench: a {'raw ' if side else ''}put failed")
            (puts if side == 0 else raw_puts).append(batch / elapsed / GiB)
        for side in order:
            started = time.perf_counter()
            if side == 0:
                ok = all(tier_b.get(chunks, arena_b))
            else:
                codes = raw_b.batch_get_into(raw_names, addresses_b, [size] * count)
                ok = all(c == size for c in codes)
            elapsed = time.perf_counter() - started
            if not ok:
                raise RuntimeError(f"mooncake bench: a {'raw ' if side else ''}get failed")
            (gets if side == 0 else raw_gets).append(batch / elapsed / GiB)
        if rep == 0 and bytes(arena_b.view(0, size)) != bytes(arena_a.view(0, size)):
            raise RuntimeError("mooncake bench: bytes differ after a get")
        tier_a.remove(namespace, keys)
        raw_a.batch_remove(raw_names, True)
    params = {
        "chunk_bytes": size,
        "shards": SHARDS,
        "chunks_per_call": count,
        "reps": reps,
        "protocol": "tcp",
        "baseline": "raw batch_put_from / batch_get_into, same client",
    }
    return _rows(ctx, label, [("put", puts, raw_puts), ("get", gets, raw_gets)], params)


def _rows(
    ctx: Context,
    label: str,
    sides: list[tuple[str, list[float], list[float]]],
    params: dict[str, object],
) -> list[Result]:
    """One ``mooncake_<kind>_<label>`` row (GiB/s, against its baseline) per wanted kind."""
    return [
        Result(
            f"mooncake_{kind}_{label}",
            median(values),
            "GiB/s",
            median(baselines),
            paired_ratio(values, baselines),
            dict(params),
        )
        for kind, values, baselines in sides
        if ctx.wanted(f"mooncake_{kind}_{label}")
    ]

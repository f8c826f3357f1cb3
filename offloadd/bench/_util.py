"""Shared pieces of the benchmarks: results, progress, statistics, scratch names, servers.

Every figure is a ratio against a baseline measured in the same run, interleaved with it, so
that the noise of a shared two-core machine hits both sides alike.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from protocol.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

# The directory that holds the offloadd package (a checkout, or site-packages): first on the
# PYTHONPATH of every subprocess, so that it runs this very copy of offloadd.
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHM_DIR = "/dev/shm"

KiB = 1 << 10
MiB = 1 << 20

_T = TypeVar("_T")


@dataclass
class Result:
    """One line of the table and one object of the JSON list."""

    name: str
    value: float
    unit: str
    baseline: float
    ratio: float
    params: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "baseline": self.baseline,
            "ratio": self.ratio,
            "params": self.params,
        }


def ratio(value: float, baseline: float) -> float:
    return value / baseline if baseline else float("nan")


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def paired_ratio(values: Sequence[float], baselines: Sequence[float]) -> float:
    """Median of ``values[i] / baselines[i]``: each pair was measured back to back, so noise
    that comes and goes (other processes on a shared machine) mostly cancels within a pair."""
    return median(v / b for v, b in zip(values, baselines, strict=True))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), nearest rank on the sorted values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def size_name(nbytes: int) -> str:
    """``65536`` -> ``64KiB``, ``1048576`` -> ``1MiB``."""
    if nbytes % MiB == 0:
        return f"{nbytes // MiB}MiB"
    if nbytes % KiB == 0:
        return f"{nbytes // KiB}KiB"
    return f"{nbytes}B"


class Progress:
    """Progress lines on stderr, stamped with the seconds since the run began."""

    def __init__(self) -> None:
        self._started = time.perf_counter()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self._started
        print(f"[bench {elapsed:6.1f}s] {message}", file=sys.stderr, flush=True)


class Scratch:
    """Private names for sockets (a /tmp directory) and /dev/shm files; removes them all."""

    def __init__(self) -> None:
        self.tag = f"offloadd-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.workdir = tempfile.mkdtemp(prefix=f"{self.tag}-", dir="/tmp")
        self._count = 0

    def endpoint(self, name: str) -> str:
        self._count += 1
        return f"ipc://{self.workdir}/{name}-{self._count}.sock"

    def shm_path(self, name: str) -> str:
        self._count += 1
        return os.path.join(SHM_DIR, f"{self.tag}-{name}-{self._count}")

    @property
    def shm_prefix(self) -> str:
        return self.tag

    def leftovers(self) -> list[str]:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(self.tag)]

    def close(self) -> None:
        """Remove the socket directory and any /dev/shm file carrying this run's tag."""
        for name in self.leftovers():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class Context:
    """What every benchmark group gets.

    ``smoke`` (``--smoke``, which sets ``quick`` too): every group at a tiny size, to find
    out whether it runs at all, not to measure; ``pick`` gives a group its sizes. What a
    group leaves out and why (mooncake not installed, no checkout) goes through ``skip``, so
    that ``--smoke`` can tell a group that said why it ran nothing from a broken one.
    """

    quick: bool
    scratch: Scratch
    progress: Progress
    patterns: list[str]
    profile_dir: str | None = None
    smoke: bool = False
    skipped: list[str] = field(default_factory=list)

    def pick(self, full: _T, quick: _T, smoke: _T) -> _T:
        """``full``, or ``quick`` in a ``--quick`` run, or ``smoke`` in a ``--smoke`` run."""
        if self.smoke:
            return smoke
        return quick if self.quick else full

    def skip(self, what: str, why: str) -> None:
        """Say that ``what`` was not measured, and why (a progress line, and ``skipped``)."""
        self.skipped.append(f"{what}: {why}")
        self.progress(f"{what}: skipped ({why})")

    def wanted(self, name: str) -> bool:
        """Whether the result ``name`` was asked for (everything without --only)."""
        return not self.patterns or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def profile_path(self, label: str) -> str | None:
        """Where py-spy writes the profile of the daemon labelled ``label`` (or None)."""
        if self.profile_dir is None:
            return None
        return os.path.join(self.profile_dir, f"{label}.txt")


class ServerProcess:
    """A ``offloadd.bench._servers`` subprocess: started, waited for, and always stopped.

    It prints ``ready`` on stdout once it serves; line commands go to its stdin and each gets
    one reply line. With ``profile`` (a file path), py-spy samples it until it exits.
    """

    def __init__(
        self,
        mode: str,
        args: dict[str, Any],
        *,
        profile: str | None = None,
        ready_timeout: float = 60.0,
    ) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = IMPORT_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        command = [sys.executable, "-m", "offloadd.bench._servers", mode, json.dumps(args)]
        self.mode = mode
        self._profiler: subprocess.Popen[bytes] | None = None
        self.process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            line = self._read_line(ready_timeout)
            if line != "ready":
                raise RuntimeError(f"{mode} server said {line!r} instead of ready")
            if profile:
                self._profiler = _attach_py_spy(self.process.pid, profile)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_seconds(self) -> float:
        """CPU time used so far by every thread of the server (ns resolution)."""
        return process_cpu_seconds(self.process.pid)

    def command(self, line: str, timeout: float = 60.0) -> str:
        """Send one command line; return the reply line."""
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()
        return self._read_line(timeout)

    def _read_line(self, timeout: float) -> str:
        assert self.process.stdout is not None
        stdout = self.process.stdout
        deadline = time.monotonic() + timeout
        poller = select.poll()  # not select(): a pytest run may hold descriptors past 1024
        poller.register(stdout, select.POLLIN)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.mode} server did not answer within {timeout:.0f}s")
            if poller.poll(min(remaining, 0.5) * 1000):
                line = stdout.readline()
                if not line:
                    raise RuntimeError(f"{self.mode} server exited (status {self.process.poll()})")
                return line.decode().strip()
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.mode} server exited with {self.process.returncode}")

    def close(self) -> None:
        """SIGTERM, wait, SIGKILL if needed; then let py-spy write its profile. Idempotent."""
        process = self.process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            try:
                profiler.wait(60)
            except subprocess.TimeoutExpired:
                profiler.kill()
                profiler.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _attach_py_spy(pid: int, output: str) -> subprocess.Popen[bytes] | None:
    py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(py_spy):
        print("[bench] py-spy not found: no profile", file=sys.stderr)
        return None
    command = [py_spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw"]
    command += ["--threads", "--gil", "--nonblocking", "--output", output]
    profiler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # py-spy needs a moment to attach before the load starts
    return profiler


def process_cpu_seconds(pid: int) -> float:
    """CPU time of all threads of ``pid`` from /proc/<pid>/task/*/schedstat (0 if gone)."""
    total = 0
    task_dir = f"/proc/{pid}/task"
    try:
        tasks = os.listdir(task_dir)
    except FileNotFoundError:
        return 0.0
    for task in tasks:
        with (
            contextlib.suppress(FileNotFoundError, ProcessLookupError),
            open(f"{task_dir}/{task}/schedstat") as handle,
        ):
            total += int(handle.read().split()[0])
    return total / 1e9


def timed(function: Callable[[], object]) -> float:
    """Seconds ``function()`` took."""
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def one_group_config(
    engine_id: str,
    *,
    model: str,
    layers: Sequence[str],
    bytes_per_block: int,
    blocks_per_chunk: int = 1,
    rank: int = 0,
    tp: int = 1,
    dp: int = 0,
    tokens_per_block: int = 16,
    tokens_per_hash: int | None = None,
    dtype: str = "bfloat16",
    events: bool = False,
    extra: dict[str, object] | None = None,
) -> OffloadingConfig:
    """A one-group, tensor-parallel config shaped like ``build_offloading_config``'s output:
    what the benchmarks' (and the tests') engines say Hello with."""
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(tokens_per_block=tokens_per_block, layer_names=tuple(layers)),
        ),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=dict(extra or {}),
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_hash or tokens_per_block, blocks_per_chunk=blocks_per_chunk
        ),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp,
            tp_size=tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=dp,
            is_parallelism_agnostic=True,
        ),
    )


def chain_keys(count: int, salt: bytes = b"", group: int = 0) -> list[bytes]:
    """Chained 32-byte sha256 hashes + u32be group, like vLLM's offload keys: extending a
    sequence keeps its prefix."""
    keys, parent = [], salt
    for index in range(count):
        parent = hashlib.sha256(parent + index.to_bytes(4, "big")).digest()
        keys.append(parent + group.to_bytes(4, "big"))
    return keys

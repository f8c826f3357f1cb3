"""The cluster tier: whole chunks in Mooncake Store, shared by every daemon of a cluster.

Each daemon contributes ``segment`` bytes of its host memory to the cluster pool (held by
the Mooncake client it opens) and registers its whole arena once, so that puts read shards
straight out of arena extents and gets write them straight into extents: no staging copy.

Objects, named so that only engines whose bytes are interchangeable share them (the
namespace, percent-encoded, is part of every name), and only daemons of one object format
(``v2``: daemons of two versions in one cluster during an upgrade each miss the other's
objects instead of dropping them as damaged):

- ``offloadd/v2/<namespace>/<key hex>``: the chunk's shards, in shard order, as one object put
  from several arena ranges (``batch_put_from_multi_buffers``);
- ``offloadd/v2/<namespace>/<key hex>.sum``: its companion, put only AFTER the data object was
  written: magic, version, the checksum of the data name, each shard's size and checksum
  (``offloadd.checksum``, xxh3_64, as the journal's sums). Its existence is what
  makes the chunk visible (two-phase across the cluster): ``contains`` asks for companions
  only, and ``get`` reads companion and data (into the extents) in one call and answers
  True only when the sizes and every shard's checksum check out. A mismatch drops both objects;
  so does data missing under its companion (evicted, or its daemon left).

Faults: Mooncake answers errors as negative codes, never exceptions (``-704`` not found,
``-900`` RPC failure, ...). An RPC failure marks the tier unhealthy; while unhealthy, calls
are skipped (answered False at once) for a back-off that doubles from ``backoff`` up to
``backoff_max`` seconds, after which one call probes again (first asking the client's own
``health_check``, which costs nothing). Against a dead master one Mooncake call blocks
about 4.5 s (measured with 0.3.13), so the back-off is what keeps the worker thread free.
Opening checks that the master's and the metadata server's ports accept a connection first:
Mooncake's ``setup`` against a dead master blocks about 90 s before it fails.

The master evicts objects on its own when the pool fills and tells no one, so
``TierWrite.evicted`` is always empty here and ``used_bytes`` counts what this daemon
published and did not remove (capped at ``segment``, the oldest forgotten first): an
estimate, not the pool's fill.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import re
import socket
import struct
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from offloadd.cache.arena import Arena
from offloadd.checksum import checksum, checksum_of
from offloadd.settings import MooncakeSettings
from offloadd.tiers.base import ChunkAddress, Tier, TierCounters, TierStats, TierWrite

__all__ = [
    "MooncakeTier",
    "MooncakeUnavailable",
    "decode_companion",
    "encode_companion",
    "object_names",
]

logger = logging.getLogger(__name__)

# Mooncake's ErrorCode values (mooncake-store/include/types.h), as the Python binding returns them.
INVALID_PARAMS = -600  # also: a destination smaller than the object
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800  # also: destinations larger than the object
RPC_FAIL = -900
RPC_TIMEOUT = -901
_UNREACHABLE = frozenset({RPC_FAIL, RPC_TIMEOUT})
_SIZE_MISMATCH = frozenset({INVALID_PARAMS, TRANSFER_FAIL})
_HEALTH_UNREACHABLE = 2  # health_check(): 0 healthy, 1 closed, 2 master unreachable

_MAGIC = b"OFLD"
_VERSION = 2  # 1 had crc32s (and names without the version)
_PREFIX = f"offloadd/v{_VERSION}"
_HEADER = struct.Struct("<4sHHIQ")  # magic, version, reserved, shards, name checksum
_SCRATCH = 1 << 20  # registered buffer for companions; a batch is split to fit it
_CONNECT_TIMEOUT = 2.0
# Checksums run on a few threads (xxhash releases the GIL), a put's while its data object is
# written and a get's while the next group transfers.
_SUM_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
_SUM_JOB = 8 << 20  # bytes of chunks per checksum job
_GET_BATCH = 16 << 20  # bytes of chunks per get call: checksums overlap the next call
_INSTALL_HINT = (
    "install the extra: pip install 'offloadd[mooncake]' "
    "(and the system library libibverbs1: apt-get install libibverbs1)"
)


class MooncakeUnavailable(Exception):
    """The cluster tier cannot open: the package is missing, or the master does not answer."""


def object_names(namespace: str, key: bytes) -> tuple[str, str]:
    """The data object's and the companion's names for one chunk."""
    data = f"{_PREFIX}/{urllib.parse.quote(namespace, safe='')}/{key.hex()}"
    return data, data + ".sum"


def _namespace_pattern(namespace: str) -> str:
    return "^" + re.escape(f"{_PREFIX}/{urllib.parse.quote(namespace, safe='')}/")


def companion_size(shards: int) -> int:
    """Bytes of the companion of a chunk of ``shards`` shards."""
    return _HEADER.size + 16 * shards  # per shard: size (u64), checksum (u64)


def encode_companion(name: str, sizes: Sequence[int], sums: Sequence[int]) -> bytes:
    """The companion of the data object ``name``: its shards' sizes and checksums."""
    header = _HEADER.pack(_MAGIC, _VERSION, 0, len(sizes), checksum_of(name.encode()))
    return header + struct.pack(f"<{len(sizes)}Q{len(sums)}Q", *sizes, *sums)


def decode_companion(name: str, raw: bytes, sizes: Sequence[int]) -> tuple[int, ...] | None:
    """The shard checksums a companion holds; None unless it is one for ``name`` and ``sizes``."""
    if len(raw) != companion_size(len(sizes)):
        return None
    magic, version, _, shards, name_sum = _HEADER.unpack_from(raw)
    if magic != _MAGIC or version != _VERSION or shards != len(sizes):
        return None
    if name_sum != checksum_of(name.encode()):
        return None
    fields = struct.unpack_from(f"<{2 * shards}Q", raw, _HEADER.size)
    if list(fields[:shards]) != list(sizes):
        return None
    return tuple(fields[shards:])


def _shard_sums(address: int, chunk: ChunkAddress) -> tuple[int, ...]:
    """The checksum of each shard (``offloadd.checksum``, as the journal's)."""
    return tuple(checksum(address + offset, size) for offset, size in chunk.extents)


def _chunks_sums(address: int, chunks: Sequence[ChunkAddress]) -> list[tuple[int, ...]]:
    return [_shard_sums(address, chunk) for chunk in chunks]


def _nothing() -> int:
    return 0


def _load_store_class() -> Any:
    # Mooncake logs (glog) every connection at INFO to stderr; warnings and errors are
    # enough in a daemon's log unless the operator asks for more.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:  # imported here: the daemon runs without the extra
        store = importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise MooncakeUnavailable(f"mooncake is not importable ({exc}); {_INSTALL_HINT}") from exc
    return store.MooncakeDistributedStore


def _host_port(address: str, default_port: int) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host:
        return address, default_port
    return host.strip("[]"), int(port)


def _check_listening(what: str, host: str, port: int) -> None:
    try:
        with socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT):
            pass
    except OSError as exc:
        raise MooncakeUnavailable(f"mooncake {what} {host}:{port} does not answer: {exc}") from exc


def default_metadata(master: str) -> str:
    """The metadata server a master with ``--enable_http_metadata_server`` serves."""
    host, _ = _host_port(master, 50051)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:8080/metadata"


def _open_client(settings: MooncakeSettings) -> Any:
    """A set-up ``MooncakeDistributedStore`` contributing ``settings.segment`` bytes."""
    if not settings.master:
        raise MooncakeUnavailable("[mooncake] master is empty: the cluster tier is off")
    store_class = _load_store_class()
    metadata = settings.metadata or default_metadata(settings.master)
    # setup() against a master that is not there blocks about 90 s before it fails.
    _check_listening("master", *_host_port(settings.master, 50051))
    parsed = urllib.parse.urlsplit(metadata)
    if parsed.scheme == "http" and parsed.hostname:
        _check_listening("metadata server", parsed.hostname, parsed.port or 80)
    client = store_class()
    hostname = settings.local_hostname or socket.gethostname()
    code = client.setup(
        hostname,
        metadata,
        settings.segment,
        settings.local_buffer,
        settings.protocol,
        settings.rdma_devices,
        settings.master,
    )
    if code != 0:
        with contextlib.suppress(Exception):
            client.close()
        raise MooncakeUnavailable(
            f"mooncake setup failed with code {code} (master {settings.master}, "
            f"metadata {metadata}, local_hostname {hostname})"
        )
    logger.info(
        "mooncake tier: master %s, metadata %s, %s as %s, contributing %d bytes",
        settings.master,
        metadata,
        settings.protocol,
        hostname,
        settings.segment,
    )
    return client


class MooncakeTier(Tier):
    """Whole chunks in Mooncake Store; see the module docstring."""

    name = "mooncake"

    def __init__(
        self,
        settings: MooncakeSettings,
        arena: Arena,
        *,
        client: Any = None,
        backoff: float = 1.0,
        backoff_max: float = 16.0,
    ) -> None:
        """Open a Mooncake client from ``settings`` (or take ``client``, already set up: tests)
        and register the arena with it; raises MooncakeUnavailable. Blocks up to seconds:
        call it off the event loop."""
        self._capacity = settings.segment
        self._address = arena.address
        self._arena_size = arena.size
        self._backoff_min = backoff
        self._backoff_max = backoff_max
        if client is None:
            client = _open_client(settings)
        self._scratch: ctypes.Array[ctypes.c_char] | None = (ctypes.c_char * _SCRATCH)()
        self._scratch_address = ctypes.addressof(self._scratch)
        for address, size, what in (
            (arena.address, arena.size, "the arena"),
            (self._scratch_address, _SCRATCH, "the companion buffer"),
        ):
            code = client.register_buffer(address, size)
            if code != 0:
                with contextlib.suppress(Exception):
                    client.close()
                raise MooncakeUnavailable(f"mooncake could not register {what} (code {code})")
        self._client: Any = client
        self._sum_pool = ThreadPoolExecutor(
            _SUM_THREADS, thread_name_prefix="offloadd-mooncake-sum"
        )
        self._lock = threading.Lock()  # around what stats() reads
        self._published: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._used = 0
        self._retry_at = 0.0
        self._backoff = backoff
        self._counts = TierCounters()

    # -- health -------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False from an unreachable master until a call succeeds again."""
        return self._counts.healthy

    def _may_call(self) -> bool:
        """Whether to call the cluster now: not while closed or backing off after a fault."""
        if self._scratch is None:
            return False
        if self._counts.healthy:
            return True
        if time.monotonic() < self._retry_at:
            return False
        try:
            unreachable = self._client.health_check() == _HEALTH_UNREACHABLE
        except Exception:
            unreachable = True
        if unreachable:  # the client already knows: no call that would block for seconds
            self._fault("health check: master unreachable", count=False)
            return False
        return True

    def _fault(self, reason: str, *, count: bool = True) -> None:
        with self._lock:
            if count:
                self._counts.errors += 1
            was_healthy, self._counts.healthy = self._counts.healthy, False
        if was_healthy:
            logger.warning("mooncake tier unreachable (%s): skipping it while it is down", reason)
            self._backoff = self._backoff_min
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self._backoff_max)

    def _reached(self) -> None:
        if not self._counts.healthy:
            with self._lock:
                self._counts.healthy = True
            self._backoff = self._backoff_min
            logger.warning("mooncake tier reachable again")

    def _answered(self, codes: Sequence[int], what: str) -> bool:
        """Account a batch's codes: False (and a fault) when the master was not reached."""
        failed = [c for c in codes if c in _UNREACHABLE]
        if failed:
            self._fault(f"{what}: code {failed[0]}")
            return False
        self._reached()
        return True

    def _count_errors(self, number: int) -> None:
        if number:
            with self._lock:
                self._counts.errors += number

    def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """One client call; an exception from it is a fault (None), never the caller's."""
        try:
            return getattr(self._client, method)(*args, **kwargs)
        except Exception as exc:
            self._fault(f"{what}: {exc!r}")
            return None

    # -- Tier ---------------------------------------------------------------------------

    def _batches(
        self, chunks: Sequence[ChunkAddress], limit: int | None = None
    ) -> Iterator[list[int]]:
        """Indexes of ``chunks`` in groups whose companions fit the scratch buffer (and whose
        bytes stay within ``limit``, past the first chunk)."""
        group: list[int] = []
        used = 0
        nbytes = 0
        for index, chunk in enumerate(chunks):
            need = companion_size(len(chunk.extents))
            full = limit is not None and nbytes + chunk.nbytes > limit
            if group and (used + need > _SCRATCH or full):
                yield group
                group, used, nbytes = [], 0, 0
            if need <= _SCRATCH:
                group.append(index)
                used += need
                nbytes += chunk.nbytes
        if group:
            yield group

    def _start_sums(self, chunks: Sequence[ChunkAddress]) -> list[Future[list[tuple[int, ...]]]]:
        """Each chunk's shard sums, computed on the pool in jobs of about ``_SUM_JOB`` bytes."""
        jobs: list[Future[list[tuple[int, ...]]]] = []
        start, size = 0, 0
        for end, chunk in enumerate(chunks, 1):
            size += chunk.nbytes
            if size >= _SUM_JOB or end == len(chunks):
                jobs.append(self._sum_pool.submit(_chunks_sums, self._address, chunks[start:end]))
                start, size = end, 0
        return jobs

    @staticmethod
    def _finish_sums(jobs: list[Future[list[tuple[int, ...]]]]) -> list[tuple[int, ...]]:
        return [sums for job in jobs for sums in job.result()]

    def _ranges(self, chunk: ChunkAddress) -> list[tuple[int, int]]:
        """``(address, size)`` of the chunk's shards, adjacent ones merged (fewer buffers)."""
        ranges: list[tuple[int, int]] = []
        for offset, size in chunk.extents:
            address = self._address + offset
            if ranges and ranges[-1][0] + ranges[-1][1] == address:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + size)
            else:
                ranges.append((address, size))
        return ranges

    def _valid(self, chunk: ChunkAddress) -> bool:
        return bool(chunk.extents) and all(
            offset >= 0 and size > 0 and offset + size <= self._arena_size
            for offset, size in chunk.extents
        )

    def put(self, chunks: Sequence[ChunkAddress], arena: Arena) -> TierWrite:
        stored = [False] * len(chunks)
        started = time.perf_counter()
        written = 0
        for group in self._batches(chunks):
            if not self._may_call():
                break
            written += self._put_group(chunks, group, stored)
        with self._lock:
            self._counts.bytes_written += written
            self._counts.write_seconds += time.perf_counter() - started
        return TierWrite(stored)

    def _put_group(
        self, chunks: Sequence[ChunkAddress], group: list[int], stored: list[bool]
    ) -> int:
        valid = [i for i in group if self._valid(chunks[i])]
        self._count_errors(len(group) - len(valid))
        if not valid:
            return 0
        names = [object_names(chunks[i].namespace, chunks[i].key) for i in valid]
        pending = self._start_sums([chunks[i] for i in valid])
        ranges = [self._ranges(chunks[i]) for i in valid]
        codes = self._call(
            "put",
            "batch_put_from_multi_buffers",
            [data for data, _ in names],
            [[address for address, _ in r] for r in ranges],
            [[size for _, size in r] for r in ranges],
        )
        shard_sums = self._finish_sums(pending)
        if codes is None or not self._answered(codes, "put"):
            return 0
        done = [n for n, code in enumerate(codes) if code in (0, OBJECT_ALREADY_EXISTS)]
        self._count_errors(len(valid) - len(done))
        if not done:
            return 0
        addresses: list[int] = []
        sizes: list[int] = []
        offset = 0
        for n in done:
            chunk = chunks[valid[n]]
            raw = encode_companion(names[n][0], [size for _, size in chunk.extents], shard_sums[n])
            ctypes.memmove(self._scratch_address + offset, raw, len(raw))
            addresses.append(self._scratch_address + offset)
            sizes.append(len(raw))
            offset += len(raw)
        codes = self._call("put", "batch_put_from", [names[n][1] for n in done], addresses, sizes)
        if codes is None or not self._answered(codes, "put"):
            return 0
        written = 0
        orphans: list[str] = []
        for n, code in zip(done, codes, strict=True):
            chunk = chunks[valid[n]]
            if code in (0, OBJECT_ALREADY_EXISTS):
                stored[valid[n]] = True
                written += chunk.nbytes
                self._publish(chunk)
            else:
                orphans.append(names[n][0])
        if orphans:
            self._count_errors(len(orphans))
            self._call("put", "batch_remove", orphans, True)
        return written

    def _publish(self, chunk: ChunkAddress) -> None:
        name = (chunk.namespace, chunk.key)
        with self._lock:
            if name in self._published:
                self._published.move_to_end(name)
                return
            self._published[name] = chunk.nbytes
            self._used += chunk.nbytes
            while self._used > self._capacity and self._published:
                _, nbytes = self._published.popitem(last=False)
                self._used -= nbytes

    def _forget(self, namespace: str, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                nbytes = self._published.pop((namespace, key), None)
                if nbytes is not None:
                    self._used -= nbytes

    def get(self, chunks: Sequence[ChunkAddress], arena: Arena) -> list[bool]:
        found = [False] * len(chunks)
        started = time.perf_counter()
        # Group by group, each group's checksums running on the pool while the next one
        # transfers; verified (and the failures dropped) once every transfer is done.
        verifications: list[Callable[[], int]] = []
        for group in self._batches(chunks, _GET_BATCH):
            if not self._may_call():
                break
            verifications.append(self._get_group(chunks, group, found))
        read = sum(verify() for verify in verifications)
        with self._lock:
            self._counts.bytes_read += read
            self._counts.read_seconds += time.perf_counter() - started
        return found

    def _get_group(
        self, chunks: Sequence[ChunkAddress], group: list[int], found: list[bool]
    ) -> Callable[[], int]:
        """Transfer one group; the returned function verifies it and answers the bytes read."""
        valid = [i for i in group if self._valid(chunks[i])]
        self._count_errors(len(group) - len(valid))
        if not valid:
            return _nothing
        names = [object_names(chunks[i].namespace, chunks[i].key) for i in valid]
        slots: list[int] = []
        sizes: list[int] = []
        offset = 0
        for i in valid:
            size = companion_size(len(chunks[i].extents))
            slots.append(offset)
            sizes.append(size)
            offset += size
        # Data and companions in one call: a chunk whose companion is missing (a put still
        # under way) may have its extents filled, which a False answer allows.
        ranges = [self._ranges(chunks[i]) for i in valid]
        codes = self._call(
            "get",
            "batch_get_into_multi_buffers",
            [data for data, _ in names] + [sum_name for _, sum_name in names],
            [[address for address, _ in r] for r in ranges]
            + [[self._scratch_address + slot] for slot in slots],
            [[size for _, size in r] for r in ranges] + [[size] for size in sizes],
        )
        if codes is None or not self._answered(codes, "get"):
            return _nothing
        bad: list[int] = []  # positions in valid whose objects failed verification
        gone: list[int] = []  # positions in valid whose data is missing under a companion
        expected: dict[int, tuple[int, ...]] = {}  # position in valid -> its companion's sums
        halves = zip(codes[: len(valid)], codes[len(valid) :], strict=True)
        for n, (data_code, sum_code) in enumerate(halves):
            chunk = chunks[valid[n]]
            if sum_code == OBJECT_NOT_FOUND:
                continue  # not there, or not complete yet
            stored = None
            if sum_code == sizes[n]:
                raw = ctypes.string_at(self._scratch_address + slots[n], sizes[n])
                stored = decode_companion(names[n][0], raw, [size for _, size in chunk.extents])
            if stored is None:
                if sum_code >= 0 or sum_code in _SIZE_MISMATCH:
                    bad.append(n)
                else:
                    self._count_errors(1)
            elif data_code == chunk.nbytes:
                expected[n] = stored
            elif data_code == OBJECT_NOT_FOUND:
                # The data went (evicted, or it lived in the segment of a daemon that left)
                # while its companion stays: a miss, and the companion goes too.
                gone.append(n)
            elif data_code >= 0 or data_code in _SIZE_MISMATCH:
                bad.append(n)
            else:
                self._count_errors(1)
        arrived = list(expected)
        pending = self._start_sums([chunks[valid[n]] for n in arrived])

        def verify() -> int:
            read = 0
            for n, sums in zip(arrived, self._finish_sums(pending), strict=True):
                if sums == expected[n]:
                    found[valid[n]] = True
                    read += chunks[valid[n]].nbytes
                else:
                    bad.append(n)
            if bad:
                self._count_errors(len(bad))
                logger.warning(
                    "mooncake tier: %d chunk(s) failed (size, checksum or transfer); dropped",
                    len(bad),
                )
            if (bad or gone) and self._counts.healthy:
                dropped = [name for n in bad + gone for name in reversed(names[n])]
                self._call("get", "batch_remove", dropped, True)
            return read

        return verify

    def contains(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        if not keys or not self._may_call():
            return [False] * len(keys)
        codes = self._call(
            "contains", "batch_is_exist", [object_names(namespace, key)[1] for key in keys]
        )
        if codes is None or not self._answered(codes, "contains"):
            return [False] * len(keys)
        self._count_errors(sum(1 for code in codes if code < 0))
        return [code == 1 for code in codes]

    def remove(self, namespace: str, keys: Sequence[bytes]) -> None:
        self._forget(namespace, keys)
        if not keys or not self._may_call():
            return
        # The companion first: a chunk stops being visible before its bytes go.
        names = [name for key in keys for name in reversed(object_names(namespace, key))]
        codes = self._call("remove", "batch_remove", names, True)
        if codes is not None and self._answered(codes, "remove"):
            self._count_errors(sum(1 for code in codes if code < 0 and code != OBJECT_NOT_FOUND))

    def clear(self, namespace: str) -> None:
        with self._lock:
            for name in [name for name in self._published if name[0] == namespace]:
                self._used -= self._published.pop(name)
        if not self._may_call():
            return
        code = self._call("clear", "remove_by_regex", _namespace_pattern(namespace), True)
        if code is not None and self._answered([code], "clear") and code < 0:
            self._count_errors(1)

    def stats(self) -> TierStats:
        with self._lock:
            return self._counts.stats(self.name, self._capacity, self._used, len(self._published))

    def close(self) -> None:
        """Unregister the buffers and close the client (the objects in its segment go)."""
        if self._scratch is None:
            return
        client, self._client = self._client, None
        for address in (self._address, self._scratch_address):
            with contextlib.suppress(Exception):
                client.unregister_buffer(address)
        with contextlib.suppress(Exception):
            client.close()
        self._sum_pool.shutdown()
        self._scratch = None

    def __enter__(self) -> MooncakeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

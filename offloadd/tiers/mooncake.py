"""The cluster tier: whole chunks in Mooncake Store, shared by every daemon of a cluster.

Each daemon contributes ``segment`` bytes of its host memory to the cluster pool (held by
the Mooncake client it opens) and registers its whole arena once, so that puts read shards
straight out of arena extents and gets write them straight into extents: no staging copy.

Trust: the master has no access control, so anyone who reaches its ports can list, read,
write and remove objects. The tier therefore trusts only what the cluster key
(``key_file``: 32 random bytes, 0600, the same on every daemon) vouches for:

- a chunk belongs to a *cluster tenant*, an operator-given name (``tenants``) for a local
  ``u<uid>`` or ``g<gid>`` tenant; a chunk whose tenant has no name does not use the tier;
- its namespace's objects live under ``offloadd/v3/<space>/`` where ``space`` is an HMAC of
  (cluster tenant, namespace) under the key: names say nothing of tenant or model, and a
  daemon without the key cannot name another tenant's objects;
- each shard is sealed with AES-GCM under a key derived from the cluster key, the tenant and
  the namespace, with a random nonce per shard and put (in the companion), and the object name,
  shard index and size as associated data: a raw read of the pool sees ciphertext only;
- the companion carries an HMAC-SHA256 (its own derived key) over the object name and every
  field before it, checked on every get: a forged or replayed-under-another-name companion is
  a miss, counted in ``stats().errors``, and its objects dropped.

Objects of one chunk, in the format ``v3`` (a daemon of another format misses them):

- ``offloadd/v3/<space>/<key hex>``: the chunk's shards, in shard order, each as ciphertext
  followed by its 16-byte tag, as one object put from the tier's registered staging buffer
  (the shards are sealed into it from the arena; gets land there and open into the extents);
- ``offloadd/v3/<space>/<key hex>.sum``: its companion, put only AFTER the data object was
  written: magic, version, each shard's size, the checksum (``offloadd.checksum``, xxh3_64)
  of its stored bytes and its nonce, then the MAC. Its existence is what makes the chunk
  visible (two-phase across the cluster): ``contains`` asks for companions only, and ``get``
  reads companion and data in one call and answers True only when the MAC, the sizes, every
  shard's checksum and every tag check out. A mismatch drops both objects; so does data
  missing under its companion (evicted, or its daemon left).

Faults: Mooncake answers errors as negative codes, never exceptions (``-704`` not found,
``-900`` RPC failure, ...). An RPC failure marks the tier unhealthy; while unhealthy, calls
are skipped (answered False at once) for a back-off that doubles from ``backoff`` up to
``backoff_max`` seconds, after which one call probes again (first asking the client's own
``health_check``, which costs nothing). Against a dead master one Mooncake call blocks
about 4.5 s (measured with 0.3.13), so the back-off is what keeps the worker thread free.
Opening checks that the master's and the metadata server's ports accept a connection first:
Mooncake's ``setup`` against a dead master blocks about 90 s before it fails
(``offloadd.tiers.mooncake_client`` opens the client).

The master evicts objects on its own when the pool fills and tells no one, so
``TierWrite.evicted`` is always empty here and ``used_bytes`` counts what this daemon
published and did not remove (capped at ``segment``, the oldest forgotten first): an
estimate, not the pool's fill.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import importlib
import logging
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from offloadd.cache.arena import Arena
from offloadd.checksum import checksum
from offloadd.safety import read_secret
from offloadd.settings import MooncakeSettings
from offloadd.tiers.base import ChunkAddress, Tier, TierCounters, TierStats, TierWrite
from offloadd.tiers.mooncake_client import INSTALL_HINT, MooncakeUnavailable, open_client

__all__ = [
    "KEY_SIZE",
    "ClusterKeys",
    "MooncakeTier",
    "MooncakeUnavailable",
    "Space",
    "load_cluster_key",
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
# 1 had crc32s (and names without the version), 2 plain xxh3 companions and plaintext.
_VERSION = 3
_PREFIX = f"offloadd/v{_VERSION}"
_HEADER = struct.Struct("<4sHHI")  # magic, version, reserved, shards
_SHARD = struct.Struct("<QQ12s")  # per shard: size, checksum of its stored bytes, nonce
_MAC_SIZE = 32
_TAG = 16  # AES-GCM's tag, after each shard's ciphertext
_NONCE = 12
KEY_SIZE = 32
_SCRATCH = 1 << 20  # registered buffer for companions; a batch is split to fit it
# Registered staging for sealed shards: two halves, so one get group transfers while the
# last one is opened. A chunk larger than a half is never put (counted as an error).
_HALF = 32 << 20
# Checksums run on a few threads (xxhash releases the GIL), a put's while its data object is
# written and a get's while the next group transfers.
_SUM_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
_SUM_JOB = 8 << 20  # bytes of chunks per checksum job
_GET_BATCH = 16 << 20  # bytes of chunks per call: a get's opening overlaps the next call
_SPACES = 4096  # derived per-namespace keys kept; beyond, the cache starts over


def load_cluster_key(path: str) -> bytes:
    """The cluster key at ``path`` (``mooncake.key_file``); raises MooncakeUnavailable.

    Checked like the journal key: a regular file of the daemon's user, 0600, of exactly
    ``KEY_SIZE`` bytes. Never created here: every daemon of the cluster needs the same one.
    """
    if not path:
        raise MooncakeUnavailable(
            "mooncake.key_file is empty: the cluster tier needs the cluster key (32 random "
            "bytes, mode 0600, the same file on every daemon: "
            "head -c 32 /dev/urandom > KEY && chmod 600 KEY)"
        )
    try:
        key = read_secret(path, KEY_SIZE)
    except FileNotFoundError:
        key = f"{path}: No such file or directory"
    if isinstance(key, str):
        raise MooncakeUnavailable(f"mooncake.key_file: {key}")
    return key


def _derive(key: bytes, label: str, *parts: str) -> bytes:
    """A subkey: HMAC-SHA256 of the label and parts (NUL-separated) under ``key``."""
    message = "\0".join((label, *parts)).encode()
    return hmac.new(key, message, hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Space:
    """Where one (cluster tenant, namespace) lives: its name prefix and its payload cipher."""

    prefix: str
    cipher: Any  # cryptography's AESGCM

    def names(self, key: bytes) -> tuple[str, str]:
        """The data object's and the companion's names for one chunk."""
        data = f"{self.prefix}{key.hex()}"
        return data, data + ".sum"

    def pattern(self) -> str:
        """The regex of every object of this space (``remove_by_regex``)."""
        return "^" + re.escape(self.prefix)


class ClusterKeys:
    """What the cluster key derives: spaces, and the MAC of companions."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_SIZE:
            raise ValueError(f"a cluster key is {KEY_SIZE} bytes")
        try:  # imported here: the daemon runs without the extra
            aead = importlib.import_module("cryptography.hazmat.primitives.ciphers.aead")
        except ImportError as exc:
            raise MooncakeUnavailable(
                f"cryptography is not importable ({exc}); {INSTALL_HINT}"
            ) from exc
        self._aesgcm = aead.AESGCM
        self._key = key
        self._mac_key = _derive(key, "offloadd/v3 companion mac")
        self._spaces: dict[tuple[str, str], Space] = {}

    def space(self, tenant: str, namespace: str) -> Space:
        """The space of ``namespace`` of cluster tenant ``tenant``."""
        found = self._spaces.get((tenant, namespace))
        if found is None:
            digest = _derive(self._key, "offloadd/v3 space", tenant, namespace)[:16].hex()
            cipher = self._aesgcm(_derive(self._key, "offloadd/v3 payload", tenant, namespace))
            found = Space(f"{_PREFIX}/{digest}/", cipher)
            if len(self._spaces) >= _SPACES:
                self._spaces.clear()
            self._spaces[(tenant, namespace)] = found
        return found

    def _mac(self, name: str, body: bytes) -> bytes:
        encoded = name.encode()
        message = struct.pack("<I", len(encoded)) + encoded + body
        return hmac.new(self._mac_key, message, hashlib.sha256).digest()

    def encode_companion(
        self, name: str, sizes: Sequence[int], sums: Sequence[int], nonces: Sequence[bytes]
    ) -> bytes:
        """The companion of the data object ``name``: sizes, checksums, nonces, then the MAC."""
        body = _HEADER.pack(_MAGIC, _VERSION, 0, len(sizes)) + b"".join(
            _SHARD.pack(*fields) for fields in zip(sizes, sums, nonces, strict=True)
        )
        return body + self._mac(name, body)

    def decode_companion(
        self, name: str, raw: bytes, sizes: Sequence[int]
    ) -> list[tuple[int, bytes]] | None:
        """Each shard's (checksum, nonce); None unless the MAC is right for ``name`` and the
        companion describes ``sizes``."""
        if len(raw) != companion_size(len(sizes)):
            return None
        body, mac = raw[:-_MAC_SIZE], raw[-_MAC_SIZE:]
        if not hmac.compare_digest(mac, self._mac(name, body)):
            return None
        magic, version, _, shards = _HEADER.unpack_from(body)
        if magic != _MAGIC or version != _VERSION or shards != len(sizes):
            return None
        out: list[tuple[int, bytes]] = []
        for index, size in enumerate(sizes):
            stored, total, nonce = _SHARD.unpack_from(body, _HEADER.size + index * _SHARD.size)
            if stored != size:
                return None
            out.append((total, nonce))
        return out


def companion_size(shards: int) -> int:
    """Bytes of the companion of a chunk of ``shards`` shards."""
    return _HEADER.size + _SHARD.size * shards + _MAC_SIZE


def sealed_size(chunk: ChunkAddress) -> int:
    """Bytes of a chunk's data object: each shard's ciphertext and tag."""
    return chunk.nbytes + _TAG * len(chunk.extents)


def _aad(name: str, index: int, size: int) -> bytes:
    return name.encode() + struct.pack("<IQ", index, size)


def _memory(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


@dataclass(frozen=True, slots=True)
class _Job:
    """One chunk's place in a call: its index, space, names and data object's staging address."""

    index: int
    chunk: ChunkAddress
    space: Space
    data: str
    companion: str
    slot: int


_Sealed = tuple[tuple[int, ...], tuple[bytes, ...]]  # the stored shards' checksums, nonces


def _seal(arena: int, jobs: Sequence[_Job]) -> list[_Sealed]:
    """Seal each job's shards from the arena into its staging slot: their sums and nonces."""
    out: list[_Sealed] = []
    for job in jobs:
        sums: list[int] = []
        nonces: list[bytes] = []
        at = job.slot
        for index, (offset, size) in enumerate(job.chunk.extents):
            nonce = os.urandom(_NONCE)
            job.space.cipher.encrypt_into(
                nonce,
                _memory(arena + offset, size),
                _aad(job.data, index, size),
                _memory(at, size + _TAG),
            )
            sums.append(checksum(at, size + _TAG))
            nonces.append(nonce)
            at += size + _TAG
        out.append((tuple(sums), tuple(nonces)))
    return out


def _open_sealed(
    arena: int, jobs: Sequence[_Job], shards: Sequence[list[tuple[int, bytes]]]
) -> list[bool]:
    """Check and open each job's staged shards into its extents: whether all of them passed."""
    out: list[bool] = []
    for job, expected in zip(jobs, shards, strict=True):
        at = job.slot
        ok = True
        for index, ((offset, size), (total, nonce)) in enumerate(
            zip(job.chunk.extents, expected, strict=True)
        ):
            if checksum(at, size + _TAG) != total:
                ok = False
                break
            try:
                job.space.cipher.decrypt_into(
                    nonce,
                    _memory(at, size + _TAG),
                    _aad(job.data, index, size),
                    _memory(arena + offset, size),
                )
            except Exception:  # InvalidTag: forged or damaged under a valid companion
                ok = False
                break
            at += size + _TAG
        out.append(ok)
    return out


def _split(jobs: list[_Job]) -> Iterator[list[_Job]]:
    """``jobs`` in runs of about ``_SUM_JOB`` bytes, one pool job each."""
    start, size = 0, 0
    for end, job in enumerate(jobs, 1):
        size += job.chunk.nbytes
        if size >= _SUM_JOB or end == len(jobs):
            yield jobs[start:end]
            start, size = end, 0


def _nothing() -> int:
    return 0


class MooncakeTier(Tier):
    """Whole chunks in Mooncake Store; see the module docstring."""

    name = "mooncake"

    def __init__(
        self,
        settings: MooncakeSettings,
        arena: Arena,
        *,
        tenant_of: Callable[[str], str | None] | None = None,
        client: Any = None,
        backoff: float = 1.0,
        backoff_max: float = 16.0,
    ) -> None:
        """Read the cluster key, open a Mooncake client from ``settings`` (or take ``client``,
        already set up: tests) and register its buffers; raises MooncakeUnavailable.
        ``tenant_of`` names a namespace's local tenant (``u1000``; None: unknown); without it
        no chunk has a tenant and none uses the tier. Blocks up to seconds: call it off the
        event loop."""
        self._keys = ClusterKeys(load_cluster_key(settings.key_file))
        self._tenants = settings.cluster_tenants()
        self._tenant_of = tenant_of
        self._capacity = settings.segment
        self._address = arena.address
        self._arena_size = arena.size
        self._backoff_min = backoff
        self._backoff_max = backoff_max
        if client is None:
            client = open_client(settings)
        self._scratch: ctypes.Array[ctypes.c_char] | None = (ctypes.c_char * _SCRATCH)()
        self._scratch_address = ctypes.addressof(self._scratch)
        self._staging = (ctypes.c_char * (2 * _HALF))()
        self._staging_address = ctypes.addressof(self._staging)
        for address, size, what in (
            (self._scratch_address, _SCRATCH, "the companion buffer"),
            (self._staging_address, 2 * _HALF, "the staging buffer"),
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

    def _space(self, namespace: str) -> Space | None:
        """The namespace's space, or None when its tenant has no cluster name."""
        local = self._tenant_of(namespace) if self._tenant_of is not None else None
        tenant = self._tenants.get(local) if local is not None else None
        return None if tenant is None else self._keys.space(tenant, namespace)

    def _jobs(self, chunks: Sequence[ChunkAddress], group: list[int], half: int) -> list[_Job]:
        """The group's chunks that may use the tier, each with its staging slot in ``half``."""
        jobs: list[_Job] = []
        at = self._staging_address + half * _HALF
        errors = 0
        for i in group:
            chunk = chunks[i]
            if not self._valid(chunk) or sealed_size(chunk) > _HALF:
                errors += 1
                continue
            space = self._space(chunk.namespace)
            if space is None:
                continue  # an unmapped tenant: neither put nor got, not a fault
            data, companion = space.names(chunk.key)
            jobs.append(_Job(i, chunk, space, data, companion, at))
            at += sealed_size(chunk)
        self._count_errors(errors)
        return jobs

    def _valid(self, chunk: ChunkAddress) -> bool:
        return bool(chunk.extents) and all(
            offset >= 0 and size > 0 and offset + size <= self._arena_size
            for offset, size in chunk.extents
        )

    def put(self, chunks: Sequence[ChunkAddress], arena: Arena) -> TierWrite:
        stored = [False] * len(chunks)
        started = time.perf_counter()
        written = 0
        for group in self._batches(chunks, _GET_BATCH):
            jobs = self._jobs(chunks, group, 0)
            if not jobs:
                continue
            if not self._may_call():
                break
            written += self._put_group(jobs, stored)
        with self._lock:
            self._counts.bytes_written += written
            self._counts.write_seconds += time.perf_counter() - started
        return TierWrite(stored)

    def _put_group(self, jobs: list[_Job], stored: list[bool]) -> int:
        pending = [self._sum_pool.submit(_seal, self._address, run) for run in _split(jobs)]
        sealed = [one for job in pending for one in job.result()]
        codes = self._call(
            "put",
            "batch_put_from",
            [job.data for job in jobs],
            [job.slot for job in jobs],
            [sealed_size(job.chunk) for job in jobs],
        )
        if codes is None or not self._answered(codes, "put"):
            return 0
        done = [n for n, code in enumerate(codes) if code in (0, OBJECT_ALREADY_EXISTS)]
        self._count_errors(len(jobs) - len(done))
        if not done:
            return 0
        addresses: list[int] = []
        sizes: list[int] = []
        offset = 0
        for n in done:
            job = jobs[n]
            sums, nonces = sealed[n]
            shard_sizes = [size for _, size in job.chunk.extents]
            raw = self._keys.encode_companion(job.data, shard_sizes, sums, nonces)
            ctypes.memmove(self._scratch_address + offset, raw, len(raw))
            addresses.append(self._scratch_address + offset)
            sizes.append(len(raw))
            offset += len(raw)
        codes = self._call(
            "put", "batch_put_from", [jobs[n].companion for n in done], addresses, sizes
        )
        if codes is None or not self._answered(codes, "put"):
            return 0
        written = 0
        orphans: list[str] = []
        for n, code in zip(done, codes, strict=True):
            job = jobs[n]
            if code in (0, OBJECT_ALREADY_EXISTS):
                stored[job.index] = True
                written += job.chunk.nbytes
                self._publish(job.chunk)
            else:
                orphans.append(job.data)
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
        # Group by group into alternate staging halves, each group opened on the pool while
        # the next one transfers; a half is reused only once its last group is opened.
        pending: list[Callable[[], int]] = [_nothing, _nothing]
        read = 0
        half = 0
        for group in self._batches(chunks, _GET_BATCH):
            read += pending[half]()
            pending[half] = _nothing
            jobs = self._jobs(chunks, group, half)
            if not jobs:
                continue
            if not self._may_call():
                break
            pending[half] = self._get_group(jobs, found)
            half ^= 1
        read += sum(verify() for verify in pending)
        with self._lock:
            self._counts.bytes_read += read
            self._counts.read_seconds += time.perf_counter() - started
        return found

    def _get_group(self, jobs: list[_Job], found: list[bool]) -> Callable[[], int]:
        """Transfer one group; the returned function opens it and answers the bytes read."""
        slots: list[int] = []
        sizes: list[int] = []
        offset = 0
        for job in jobs:
            size = companion_size(len(job.chunk.extents))
            slots.append(offset)
            sizes.append(size)
            offset += size
        # Data and companions in one call: a chunk whose companion is missing (a put still
        # under way) may have its staging filled, which a False answer allows.
        codes = self._call(
            "get",
            "batch_get_into_multi_buffers",
            [job.data for job in jobs] + [job.companion for job in jobs],
            [[job.slot] for job in jobs] + [[self._scratch_address + slot] for slot in slots],
            [[sealed_size(job.chunk)] for job in jobs] + [[size] for size in sizes],
        )
        if codes is None or not self._answered(codes, "get"):
            return _nothing
        bad: list[int] = []  # positions in jobs whose objects failed verification
        gone: list[int] = []  # positions in jobs whose data is missing under a companion
        expected: dict[int, list[tuple[int, bytes]]] = {}  # position -> its companion's shards
        halves = zip(codes[: len(jobs)], codes[len(jobs) :], strict=True)
        for n, (data_code, sum_code) in enumerate(halves):
            job = jobs[n]
            if sum_code == OBJECT_NOT_FOUND:
                continue  # not there, or not complete yet
            stored = None
            if sum_code == sizes[n]:
                raw = ctypes.string_at(self._scratch_address + slots[n], sizes[n])
                shard_sizes = [size for _, size in job.chunk.extents]
                stored = self._keys.decode_companion(job.data, raw, shard_sizes)
            if stored is None:
                if sum_code >= 0 or sum_code in _SIZE_MISMATCH:
                    bad.append(n)
                else:
                    self._count_errors(1)
            elif data_code == sealed_size(job.chunk):
                expected[n] = stored
            elif data_code == OBJECT_NOT_FOUND:
                # The data went (evicted, or it lived in the segment of a daemon that left)
                # while its companion stays: a miss, and the companion goes too.
                gone.append(n)
            elif data_code >= 0 or data_code in _SIZE_MISMATCH:
                bad.append(n)
            else:
                self._count_errors(1)
        positions = list(expected)
        opened: list[Future[list[bool]]] = []
        at = 0
        for run in _split([jobs[n] for n in positions]):
            shards = [expected[n] for n in positions[at : at + len(run)]]
            opened.append(self._sum_pool.submit(_open_sealed, self._address, run, shards))
            at += len(run)

        def verify() -> int:
            read = 0
            results = [ok for job in opened for ok in job.result()]
            for n, ok in zip(positions, results, strict=True):
                if ok:
                    found[jobs[n].index] = True
                    read += jobs[n].chunk.nbytes
                else:
                    bad.append(n)
            if bad:
                self._count_errors(len(bad))
                logger.warning(
                    "mooncake tier: %d chunk(s) failed (MAC, size, checksum, tag or transfer); "
                    "dropped",
                    len(bad),
                )
            if (bad or gone) and self._counts.healthy:
                dropped = [name for n in bad + gone for name in (jobs[n].companion, jobs[n].data)]
                self._call("get", "batch_remove", dropped, True)
            return read

        return verify

    def contains(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        space = self._space(namespace)
        if not keys or space is None or not self._may_call():
            return [False] * len(keys)
        codes = self._call("contains", "batch_is_exist", [space.names(key)[1] for key in keys])
        if codes is None or not self._answered(codes, "contains"):
            return [False] * len(keys)
        self._count_errors(sum(1 for code in codes if code < 0))
        return [code == 1 for code in codes]

    def remove(self, namespace: str, keys: Sequence[bytes]) -> None:
        self._forget(namespace, keys)
        space = self._space(namespace)
        if not keys or space is None or not self._may_call():
            return
        # The companion first: a chunk stops being visible before its bytes go.
        names = [name for key in keys for name in reversed(space.names(key))]
        codes = self._call("remove", "batch_remove", names, True)
        if codes is not None and self._answered(codes, "remove"):
            self._count_errors(sum(1 for code in codes if code < 0 and code != OBJECT_NOT_FOUND))

    def clear(self, namespace: str) -> None:
        with self._lock:
            for name in [name for name in self._published if name[0] == namespace]:
                self._used -= self._published.pop(name)
        space = self._space(namespace)
        if space is None or not self._may_call():
            return
        code = self._call("clear", "remove_by_regex", space.pattern(), True)
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
        for address in (self._scratch_address, self._staging_address):
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

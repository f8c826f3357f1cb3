"""Handshakes -> one shared config per engine, keyed by ``(engine_id, data_parallel_index)``.

Pure logic, no I/O. Contract:
- ``hello(session_id, hello, tenant=, uid=)`` validates a rank's (or scheduler's) Hello
  against itself and against the engine it joins. On success it registers the session,
  replacing any earlier session of the same sender or of the same engine rank, and says
  whether the engine just became ready. A scheduler is replaced by a scheduler Hello for its
  engine from the same process (``pid``, the kernel's, not 0) and uid: a scheduler that lost
  its connection and connects again, never two schedulers at once. On failure it raises
  ``RegistrationError`` and changes nothing: an engine that is already registered is never
  disturbed by a disagreeing rank.
- ``tenant`` and ``uid`` come from the kernel (``offloadd.server.tenancy``), never from the
  Hello. An engine belongs to the tenant of its first session: a Hello of another tenant for it is
  refused (``NOT_PERMITTED``), and a session is only replaced by a Hello of the same uid.
- An engine is ready when every rank in ``[0, world_size)`` has a worker session. Its
  namespace (which engines' bytes are interchangeable) is fixed then, because it covers
  every rank's geometry.
- ``remove(session_id)`` forgets a session; an engine with no sessions left is dropped.
- ``cluster_tenants`` (``MooncakeSettings.cluster_tenants``: local tenant -> cluster tenant)
  names a tenant in its namespaces by its cluster name when it has one, so that its engines
  on every node of the cluster (where its uid may differ) name their chunks alike, and the
  local tenants one cluster tenant names share a cache here too.
- ``tenant_of_namespace(name)``: the local tenant whose engines made namespace ``name``
  (the cluster tier's ``tenant_of``), remembered after they leave (their chunks stay, their
  writes to the tiers may still be queued) for the last ``NAMESPACE_TENANTS`` namespaces
  besides those in use. Called from the tiers' threads: one dict read, written on the loop.
- ``EngineOwners`` (the one part with I/O) remembers across restarts which tenant each engine
  id belongs to, so that after a restart nobody who read the ids from the metrics takes one
  by saying Hello first: ``owner(engine_id)``, ``bind(engine_id, tenant)``. Its file lies in
  the state directory beside the journal (0600, replaced atomically); each tenant keeps at
  most ``OWNED_PER_TENANT`` ids (its oldest go first), so no tenant pushes out another's.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from typing import Any

import msgspec

from offloadd.server.canonical import CanonicalMismatch, CanonicalPlan, canonical_plan, elected
from offloadd.transfer.plan import GroupLayout, group_layouts
from protocol.config import OffloadingConfig, config_differences
from protocol.errors import ErrorCode
from protocol.handles import KVRegion, region_problem
from protocol.messages import EngineState, Hello, Role

EngineKey = tuple[str, int]
OWNED_PER_TENANT = 4096
NAMESPACE_TENANTS = 4096

logger = logging.getLogger(__name__)

# Fields a rank may legitimately hold differently from its peers.
# A key's group id as its last four bytes (big-endian): what fast paths compare, at C speed.
group_bytes = itemgetter(slice(-4, None))
_PER_RANK_FIELDS = frozenset({"parallel.rank", "worker_kv_bytes_per_block"})
# extra_config keys that never change the bytes (tuning knobs), so they may differ per rank.
PRIVATE_CACHE_KEY = "private_cache"
NAMESPACE_SALT_KEY = "namespace"


class RegistrationError(Exception):
    """A Hello that cannot be accepted; ``code`` is the wire error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Session:
    """One connected rank or scheduler."""

    session_id: str
    role: Role
    engine_key: EngineKey
    config: OffloadingConfig
    regions: tuple[KVRegion, ...]
    layouts: list[GroupLayout]
    device_uuid: str = ""
    pid: int = 0
    kv_events_topic: str = ""
    kv_events_raw_hashes: bool = False
    # A scheduler mirroring its namespace's keys (KeysChanged); on a worker: its engine's
    # scheduler does, and publishes the engine's events itself.
    mirror: bool = False
    # Who the kernel says the peer is (offloadd.server.tenancy): its tenant and uid.
    tenant: str = ""
    uid: int = -1
    peer_pid: int = 0  # the process that registered, as the kernel names it (0: unknown)
    # A scheduler: the request id of its latest Reserve read (its ranks' stores wait for it).
    reserves_read: int = 0

    @property
    def rank(self) -> int:
        """The engine rank (0 for a scheduler, which is told apart by role)."""
        return self.config.parallel.rank

    @property
    def num_blocks(self) -> int:
        """GPU blocks in each of this rank's regions (all regions agree)."""
        return self.regions[0].num_blocks if self.regions else 0

    def describe(self) -> str:
        """``engine_id/dp rank N`` for log lines."""
        engine_id, dp = self.engine_key
        who = "scheduler" if self.role == "scheduler" else f"rank {self.rank}"
        return f"engine {engine_id} dp {dp} {who}"


@dataclass(eq=False)
class Namespace:
    """Engines whose cached bytes are interchangeable; keys are looked up inside one."""

    name: str
    blocks_per_chunk: int
    # shard_sizes[position] -> one size per shard (one shard when the layout is replicated)
    shard_sizes: list[tuple[int, ...]]
    replicated: bool
    # group id (what keys name) -> position in the config's groups
    group_positions: dict[int, int] = field(default_factory=dict)
    engines: set[EngineKey] = field(default_factory=set)
    # vLLM's canonical layout: each chunk is one shard (the canonical chunk) that this many
    # writers of its first engine fill together; 0 for one shard per rank. Engines of other
    # TP sizes may share the namespace: a store counts its own engine's (``store_part``).
    writers: int = 0

    def shard_sizes_for_key(self, key: bytes) -> tuple[int, ...]:
        """Shard sizes of the chunk ``key`` names (its group is the key's last 4 bytes)."""
        return self.shard_sizes[self.group_positions[group_of_key(key)]]

    def chunk_bytes(self, keys: Sequence[bytes]) -> list[int]:
        """Bytes each key's chunk takes in the arena, all shards together."""
        if len(keys) < 4:
            return [sum(self.shard_sizes_for_key(key)) for key in keys]
        # A request's keys name a few groups: each key's bytes read from its group id's
        # suffix at C speed (map), one sum per group.
        sizes = self.shard_sizes
        by_suffix = {
            group.to_bytes(4, "big"): sum(sizes[position])
            for group, position in self.group_positions.items()
            if 0 <= group < 1 << 32
        }
        try:
            return list(map(by_suffix.__getitem__, map(group_bytes, keys)))
        except KeyError:
            return [sum(self.shard_sizes_for_key(key)) for key in keys]  # raises as it did


@dataclass(eq=False)
class Engine:
    """The shared state of one engine: its agreed config and the sessions of its ranks."""

    key: EngineKey
    config: OffloadingConfig
    workers: dict[int, Session] = field(default_factory=dict)
    schedulers: dict[str, Session] = field(default_factory=dict)
    namespace: Namespace | None = None
    tenant: str = ""  # the tenant of its first session; only that tenant's peers join it
    # vLLM's canonical layout: who writes which canonical bytes (set when it becomes ready).
    canonical: CanonicalPlan | None = None

    @cached_property  # asked for every job's keys; the config never changes
    def group_positions(self) -> dict[int, int]:
        """Group id (what keys name) -> position in ``config.groups`` (not to be changed)."""
        return {group_id: index for index, group_id in enumerate(self.config.group_ids())}

    @cached_property
    def group_suffixes(self) -> frozenset[bytes]:
        """The 4-byte big-endian group ids keys of this engine end with."""
        return frozenset(g.to_bytes(4, "big") for g in self.group_positions if 0 <= g < 1 << 32)

    @property
    def mirrored(self) -> bool:
        """The engine's scheduler mirrors its keys and publishes its events itself."""
        return any(session.mirror for session in self.sessions())

    @property
    def world_size(self) -> int:
        """Ranks the engine needs before it is ready."""
        return self.config.parallel.world_size

    @property
    def ready(self) -> bool:
        """Every rank has said Hello with an agreeing config."""
        return len(self.workers) == self.world_size

    def sessions(self) -> Iterator[Session]:
        """Every session of the engine, workers first."""
        yield from self.workers.values()
        yield from self.schedulers.values()

    def missing_ranks(self) -> list[int]:
        """Ranks the engine still waits for."""
        return [r for r in range(self.world_size) if r not in self.workers]

    def state(self) -> EngineState:
        """Wire view of the engine."""
        return EngineState(
            engine_id=self.key[0],
            data_parallel_index=self.key[1],
            world_size=self.world_size,
            ready=self.ready,
            ranks_present=sorted(self.workers),
            namespace=self.namespace.name if self.namespace else "",
            schedulers=len(self.schedulers),
        )


@dataclass
class HelloOutcome:
    """What a successful Hello changed."""

    session: Session
    engine: Engine
    replaced: list[Session]
    became_ready: bool


@dataclass
class RemoveOutcome:
    """What forgetting a session changed."""

    session: Session
    engine: Engine
    was_ready: bool
    engine_dropped: bool


def group_of_key(key: bytes) -> int:
    """The KV-cache group of an OffloadKey (``block_hash ‖ u32be(group_idx)``)."""
    return int.from_bytes(key[-4:], "big")


def one_group(keys: Sequence[bytes]) -> bool:
    """Whether ``keys`` are all of one KV-cache group (``group_of_key``), told without a
    call per key."""
    return len({key[-4:] for key in keys}) == 1


class Registry:
    """Sessions and engines; see the module docstring for the contract."""

    def __init__(self, *, cluster_tenants: Mapping[str, str] | None = None) -> None:
        self._sessions: dict[str, Session] = {}
        self._engines: dict[EngineKey, Engine] = {}
        self._namespaces: dict[str, Namespace] = {}
        self._cluster_tenants = dict(cluster_tenants or {})
        self._namespace_tenants: dict[str, str] = {}

    def session(self, session_id: str) -> Session | None:
        """The live session ``session_id``, if any."""
        return self._sessions.get(session_id)

    def engine(self, key: EngineKey) -> Engine | None:
        """The engine ``key``, if registered."""
        return self._engines.get(key)

    def engines(self) -> list[Engine]:
        """All registered engines."""
        return list(self._engines.values())

    def namespace(self, name: str) -> Namespace | None:
        """The namespace ``name`` while a ready engine uses it."""
        return self._namespaces.get(name)

    def namespaces(self) -> list[Namespace]:
        """Namespaces of ready engines."""
        return list(self._namespaces.values())

    def tenant_of_namespace(self, name: str) -> str | None:
        """The local tenant of namespace ``name``, if known (see the module docstring)."""
        return self._namespace_tenants.get(name)

    def __len__(self) -> int:
        return len(self._sessions)

    def hello(
        self, session_id: str, hello: Hello, *, tenant: str = "", uid: int = -1, pid: int = 0
    ) -> HelloOutcome:
        """Register ``hello``; raises RegistrationError and changes nothing on bad input.
        ``pid``: the sender's process as the kernel names it (0: unknown)."""
        config = hello.config
        key: EngineKey = (config.engine_id, config.parallel.data_parallel_index)
        layouts = _check_own(hello)

        engine = self._engines.get(key)
        replaced = self._sessions_replaced_by(session_id, hello, engine, uid, pid)
        for old in replaced:
            if old.uid != uid:
                raise RegistrationError(
                    ErrorCode.NOT_PERMITTED,
                    f"{old.describe()} belongs to another user: a session is only replaced "
                    "by a Hello of the same user",
                )
        peers = [s for s in engine.sessions() if s not in replaced] if engine else []
        if engine is not None and peers and engine.tenant != tenant:
            raise RegistrationError(
                ErrorCode.NOT_PERMITTED,
                f"engine {key[0]} dp {key[1]} belongs to another user (engine ids are per "
                "node: pick another)",
            )
        if peers:
            assert engine is not None
            _check_agreement(engine, peers, hello)
        _check_canonical_writers(peers, hello)

        for old in replaced:
            self._forget(old)
        engine = self._engines.get(key)
        if engine is None or not peers:
            engine = Engine(key, config, tenant=tenant)
            self._engines[key] = engine
        was_ready = engine.ready
        session = Session(
            session_id=session_id,
            role=hello.role,
            engine_key=key,
            config=config,
            regions=hello.regions,
            layouts=layouts,
            device_uuid=hello.device_uuid,
            pid=hello.pid,
            kv_events_topic=hello.kv_events_topic,
            kv_events_raw_hashes=hello.kv_events_raw_hashes,
            mirror=hello.mirror,
            tenant=tenant,
            uid=uid,
            peer_pid=pid,
        )
        self._sessions[session_id] = session
        if hello.role == "worker":
            engine.workers[session.rank] = session
        else:
            engine.schedulers[session_id] = session
        became_ready = engine.ready and not was_ready
        if became_ready:
            self._join_namespace(engine)
        return HelloOutcome(session, engine, replaced, became_ready)

    def remove(self, session_id: str) -> RemoveOutcome | None:
        """Forget ``session_id``; None when it is unknown."""
        session = self._sessions.get(session_id)
        if session is None:
            return None
        engine = self._engines[session.engine_key]
        was_ready = engine.ready
        self._forget(session)
        return RemoveOutcome(session, engine, was_ready, session.engine_key not in self._engines)

    def _sessions_replaced_by(
        self, session_id: str, hello: Hello, engine: Engine | None, uid: int, pid: int
    ) -> list[Session]:
        replaced = []
        own = self._sessions.get(session_id)
        if own is not None:
            replaced.append(own)
        if engine is not None and hello.role == "worker":
            same_rank = engine.workers.get(hello.config.parallel.rank)
            if same_rank is not None and same_rank is not own:
                replaced.append(same_rank)
        if engine is not None and hello.role == "scheduler" and pid:
            replaced += [
                old
                for old in engine.schedulers.values()
                if old is not own and old.peer_pid == pid and old.uid == uid
            ]
        return replaced

    def _forget(self, session: Session) -> None:
        self._sessions.pop(session.session_id, None)
        engine = self._engines.get(session.engine_key)
        if engine is None:
            return
        if session.role == "worker":
            if engine.workers.get(session.rank) is session:
                del engine.workers[session.rank]
        else:
            engine.schedulers.pop(session.session_id, None)
        if not engine.ready:
            self._leave_namespace(engine)
        if not engine.workers and not engine.schedulers:
            del self._engines[session.engine_key]

    def _join_namespace(self, engine: Engine) -> None:
        if engine.config.canonical_layout:
            engine.canonical = canonical_plan({r: s.regions for r, s in engine.workers.items()})
        name, shard_sizes = namespace_of(engine, self._cluster_tenants.get(engine.tenant, ""))
        self._remember_tenant(name, engine.tenant)
        namespace = self._namespaces.get(name)
        if namespace is None:
            namespace = Namespace(
                name=name,
                blocks_per_chunk=engine.config.cache.blocks_per_chunk,
                shard_sizes=shard_sizes,
                replicated=engine.config.replicated_layout,
                group_positions=engine.group_positions,
                writers=canonical_writers(engine),
            )
            self._namespaces[name] = namespace
        namespace.engines.add(engine.key)
        engine.namespace = namespace

    def _remember_tenant(self, name: str, tenant: str) -> None:
        known = self._namespace_tenants
        known.pop(name, None)
        known[name] = tenant
        if len(known) > NAMESPACE_TENANTS + len(self._namespaces):
            oldest = next(old for old in known if old not in self._namespaces)
            del known[oldest]

    def _leave_namespace(self, engine: Engine) -> None:
        namespace = engine.namespace
        if namespace is None:
            return
        namespace.engines.discard(engine.key)
        engine.namespace = None
        # The namespace object goes when its last engine leaves; the cache keeps its chunks
        # under the same name, so an engine that comes back finds them again.
        if not namespace.engines:
            del self._namespaces[namespace.name]


def _check_own(hello: Hello) -> list[GroupLayout]:
    """Checks that need only this Hello; returns the rank's group layouts."""
    config = hello.config
    parallel = config.parallel
    if parallel.world_size < 1:
        raise RegistrationError(
            ErrorCode.BAD_REQUEST, f"parallel.world_size={parallel.world_size} must be >= 1"
        )
    if not 0 <= parallel.rank < parallel.world_size:
        raise RegistrationError(
            ErrorCode.BAD_REQUEST,
            f"parallel.rank={parallel.rank} outside [0, world_size={parallel.world_size})",
        )
    if _nesting(config.extra_config) > _MAX_EXTRA_NESTING:
        raise RegistrationError(
            ErrorCode.BAD_REQUEST, f"extra_config nests deeper than {_MAX_EXTRA_NESTING} levels"
        )
    if config.cache.blocks_per_chunk < 1:
        raise RegistrationError(
            ErrorCode.BAD_REQUEST,
            f"cache.blocks_per_chunk={config.cache.blocks_per_chunk} must be >= 1",
        )
    group_ids = config.group_ids()
    if len(set(group_ids)) != len(group_ids) or min(group_ids, default=0) < 0:
        raise RegistrationError(
            ErrorCode.BAD_REQUEST, f"group ids {list(group_ids)} must be distinct and >= 0"
        )
    if hello.role == "scheduler":
        if hello.regions:
            raise RegistrationError(ErrorCode.BAD_REQUEST, "a scheduler registers no KV regions")
        return []
    return _check_geometry(hello)


_MAX_EXTRA_NESTING = 32


def _nesting(value: object) -> int:
    """How deeply ``value`` nests lists and dicts (iterative: hostile input can be deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            deepest = max(deepest, depth)
            if depth > _MAX_EXTRA_NESTING:
                return depth
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_geometry(hello: Hello) -> list[GroupLayout]:
    config = hello.config
    regions = hello.regions
    for index, region in enumerate(regions):
        problem = region_problem(region) or _canonical_problem(config, region)
        if problem:
            raise RegistrationError(ErrorCode.BAD_GEOMETRY, f"region {index}: {problem}")
    if len({region.num_blocks for region in regions}) > 1:
        raise RegistrationError(
            ErrorCode.BAD_GEOMETRY,
            "num_blocks differs between regions: "
            + ", ".join(str(region.num_blocks) for region in regions),
        )
    known_layers = {name for group in config.groups for name in group.layer_names}
    for index, region in enumerate(regions):
        unknown = set(region.layer_names) - known_layers
        if unknown:
            raise RegistrationError(
                ErrorCode.BAD_GEOMETRY,
                f"region {index} holds layers that no group of the config names: {sorted(unknown)}",
            )
    if config.worker_kv_bytes_per_block > 0:
        # Regions over one tensor (a packed layout, pages of several sizes) count it once.
        per_block = sum(
            {
                (region.handle, region.block_stride): region.block_stride for region in regions
            }.values()
        )
        if per_block != config.worker_kv_bytes_per_block:
            raise RegistrationError(
                ErrorCode.BAD_GEOMETRY,
                f"worker_kv_bytes_per_block: the config says {config.worker_kv_bytes_per_block}"
                f" but the regions hold {per_block} bytes per block",
            )
    layouts = group_layouts(regions, config.groups)
    if regions:
        for index, (group, layout) in enumerate(zip(config.groups, layouts, strict=True)):
            if group.layer_names and not layout.regions:
                raise RegistrationError(
                    ErrorCode.BAD_GEOMETRY, f"no region holds a layer of group {index}"
                )
    return layouts


def _canonical_problem(config: OffloadingConfig, region: KVRegion) -> str | None:
    """Why ``region`` does not fit the config's layout (direct or vLLM's canonical)."""
    canonical = region.canonical
    if not config.canonical_layout:
        return None if canonical is None else "a canonical page in a direct-layout engine"
    if canonical is None:
        return "no canonical page, but the engine is in vLLM's canonical layout"
    if config.parallel.pp_size > 1:
        return "the canonical layout under pipeline parallelism is not supported"
    if config.parallel.pcp_size > 1:
        # Never run: vLLM 0.33 builds PCP only with its V2 model runner (Triton), so no test
        # shows its ranks' runs hold what they claim; refused rather than trusted.
        return "the canonical layout under prefill context parallelism is not supported"
    return None


def _check_canonical_writers(peers: Sequence[Session], hello: Hello) -> None:
    """When ``hello`` completes a canonical engine: every canonical byte has one writer
    (ranks holding the same bytes are replicas, the rest disjoint, no gap)."""
    config = hello.config
    if hello.role != "worker" or not config.canonical_layout:
        return
    ranks = {s.rank: s.regions for s in peers if s.role == "worker"}
    ranks[config.parallel.rank] = hello.regions
    if len(ranks) != config.parallel.world_size:
        return
    try:
        canonical_plan(ranks)
    except CanonicalMismatch as exc:
        raise RegistrationError(ErrorCode.BAD_GEOMETRY, f"canonical layout: {exc}") from None


def _canonical_pages(regions: Sequence[KVRegion]) -> list[int]:
    return [region.canonical.page_size if region.canonical else 0 for region in regions]


def _geometry(session: Session) -> list[tuple[int, tuple[str, ...]]]:
    return [(region.page_size, region.layer_names) for region in session.regions]


def _check_agreement(engine: Engine, peers: list[Session], hello: Hello) -> None:
    """The new rank must agree with the engine on every field but its per-rank ones."""
    rank = hello.config.parallel.rank
    ignore = _PER_RANK_FIELDS
    if hello.config.parallel.pp_size > 1:
        # Each pipeline stage holds its own layers, so group layer names differ per rank.
        ignore = ignore | {"groups[*].layer_names"}
    for path, ours, theirs in config_differences(peers[0].config, hello.config, ignore=ignore):
        raise RegistrationError(
            ErrorCode.CONFIG_MISMATCH,
            f"{path}: engine {engine.key[0]} dp {engine.key[1]} has {ours!r}, "
            f"{hello.role} rank {rank} sent {theirs!r}",
        )
    if hello.role != "worker":
        return
    workers = [s for s in peers if s.role == "worker"]
    if not workers:
        return
    first = workers[0]
    if hello.regions and first.regions and first.num_blocks != hello.regions[0].num_blocks:
        raise RegistrationError(
            ErrorCode.CONFIG_MISMATCH,
            f"num_blocks: rank {first.rank} has {first.num_blocks}, "
            f"rank {rank} sent {hello.regions[0].num_blocks}",
        )
    # Without pipeline parallelism every rank holds the same layers: its geometry must match.
    if hello.config.parallel.pp_size == 1:
        if first.config.worker_kv_bytes_per_block != hello.config.worker_kv_bytes_per_block:
            raise RegistrationError(
                ErrorCode.CONFIG_MISMATCH,
                f"worker_kv_bytes_per_block: rank {first.rank} has "
                f"{first.config.worker_kv_bytes_per_block}, rank {rank} sent "
                f"{hello.config.worker_kv_bytes_per_block}",
            )
        theirs = [(region.page_size, region.layer_names) for region in hello.regions]
        if _geometry(first) != theirs or _canonical_pages(first.regions) != _canonical_pages(
            hello.regions
        ):
            raise RegistrationError(
                ErrorCode.CONFIG_MISMATCH,
                f"geometry: rank {first.rank} has regions {_geometry(first)}, "
                f"rank {rank} sent {theirs}",
            )


def namespace_of(engine: Engine, cluster_tenant: str = "") -> tuple[str, list[tuple[int, ...]]]:
    """The engine's namespace name and per-group shard sizes (engine must be ready).

    Engines share chunks when their bytes are interchangeable: same model, dtype, groups,
    hashing, chunking, parallel layout, per-rank geometry, KV layout and namespace salt
    (in vLLM's canonical layout with parallelism-free pages, the canonical geometry instead
    of the parallel layout and the per-rank geometry: engines of any TP size share keys),
    and only inside one tenant (the kernel's identity of its peers, never a claim of theirs):
    a user cannot plant chunks another user's engines would load. A tenant the operator
    named in the cluster (``cluster_tenant``) is hashed by that name, the same on every
    node. ``extra_config["private_cache"]`` opts an engine out by adding its identity and
    rank 0's uid.
    """
    ranks = [engine.workers[r] for r in range(engine.world_size)]
    # Rank 0's config, not the engine's (whoever said Hello first): under pipeline parallelism
    # group layer names differ per rank, and the name must not depend on arrival order.
    config = ranks[0].config
    bpc = config.cache.blocks_per_chunk
    extra: dict[str, Any] = dict(config.extra_config)
    writers = canonical_writers(engine)
    shared_across_parallelism = writers > 0 and all(
        region.canonical is not None and region.canonical.agnostic
        for session in ranks
        for region in session.regions
    )
    parallel: list[Any] = [
        config.parallel.tp_size,
        config.parallel.pp_size,
        config.parallel.pcp_size,
        config.parallel.dcp_size,
        config.parallel.world_size,
    ]
    geometry: list[Any] = [_geometry(session) for session in ranks]
    if shared_across_parallelism:
        # Rank 0's canonical pages stand for every rank's (vLLM verified that the ranks'
        # fragments tile each canonical page once; registration checked they agree).
        parallel = ["canonical"]
        geometry = [
            [(r.canonical.page_size if r.canonical else 0, r.layer_names) for r in ranks[0].regions]
        ]
    elif writers:
        parallel.append("canonical")
    identity: list[Any] = [
        config.model.name,
        config.model.dtype,
        [(g.tokens_per_block, list(g.layer_names)) for g in config.groups],
        config.cache.tokens_per_hash,
        bpc,
        parallel,
        config.replicated_layout,
        geometry,
        str(config.kv_cache_layout or extra.get("kv_cache_layout", "")),
        str(extra.get(NAMESPACE_SALT_KEY, "")),
    ]
    if cluster_tenant:
        identity.append(["cluster tenant", cluster_tenant])
    elif engine.tenant:
        identity.append(["tenant", engine.tenant])
    if extra.get(PRIVATE_CACHE_KEY):
        identity.append(list(engine.key))
        identity.append(["uid", ranks[0].uid])
    digest = hashlib.sha256(msgspec.msgpack.encode(identity)).hexdigest()[:16]
    name = f"{config.model.name}@{digest}"
    if writers:
        # One shard: the canonical chunk, the same size on every rank.
        return name, [
            (ranks[0].layouts[group].shard_bytes(bpc),) for group in range(len(config.groups))
        ]
    shard_ranks = ranks[:1] if config.replicated_layout else ranks
    shard_sizes = [
        tuple(session.layouts[group].shard_bytes(bpc) for session in shard_ranks)
        for group in range(len(config.groups))
    ]
    return name, shard_sizes


def canonical_writers(engine: Engine) -> int:
    """How many writers fill each canonical chunk together (1 when replicated: rank 0; else
    one per distinct fragment set, ``offloadd.server.canonical``), or 0 when the engine is
    not in vLLM's canonical layout (one shard per rank)."""
    if not engine.config.canonical_layout:
        return 0
    if engine.config.replicated_layout:
        return 1
    return engine.canonical.writers if engine.canonical else engine.world_size


def store_part(engine: Engine, rank: int) -> tuple[int, int]:
    """``(shard, writers)`` for ``ChunkCache.begin_store`` of a store by ``rank``: its shard
    (0 when replicated) and no writers in the direct layout; in vLLM's canonical layout the
    one shard, written as the rank's writer index among the engine's writers. The engine's
    own count, never its namespace's: engines of other TP sizes share a canonical namespace."""
    writers = canonical_writers(engine)
    replicated = engine.config.replicated_layout
    if writers and not replicated and engine.canonical is not None:
        return engine.canonical.roles[rank].writer, writers
    return (0 if replicated else rank), writers


def elected_keys(engine: Engine, rank: int, keys: Sequence[bytes]) -> list[int]:
    """Indexes of the keys whose chunk ``rank`` writes: all of them, but in vLLM's canonical
    layout with ranks holding the same bytes, one replica's per key (``canonical.elected``;
    a replicated layout has rank 0 write every key instead)."""
    plan = engine.canonical
    role = plan.roles.get(rank) if plan and not engine.config.replicated_layout else None
    if role is None or role.replicas == 1:
        return list(range(len(keys)))
    return [i for i, key in enumerate(keys) if elected(key, role)]


class EngineOwners:
    """Engine id -> tenant, kept in ``path`` across restarts; see the module docstring."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._owners: dict[str, tuple[str, float]] = {}
        try:
            with open(path, "rb") as handle:
                raw = msgspec.json.decode(handle.read(), type=dict[str, tuple[str, float]])
            self._owners = raw
        except FileNotFoundError:
            pass
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("engine owners %s unreadable, starting empty: %s", path, exc)

    def owner(self, engine_id: str) -> str | None:
        """The tenant ``engine_id`` belongs to, if it was ever bound."""
        entry = self._owners.get(engine_id)
        return None if entry is None else entry[0]

    def bind(self, engine_id: str, tenant: str) -> None:
        """Bind ``engine_id`` to ``tenant`` (its first); written when the binding is new."""
        known = self._owners.get(engine_id)
        if known is not None and known[0] == tenant:
            return
        self._owners[engine_id] = (tenant, time.time())
        own = [(when, eid) for eid, (t, when) in self._owners.items() if t == tenant]
        for _, eid in sorted(own)[: max(0, len(own) - OWNED_PER_TENANT)]:
            del self._owners[eid]
        self._write()

    def _write(self) -> None:
        temporary = f"{self.path}.{os.getpid()}.tmp"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(msgspec.json.encode(self._owners))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, self.path)
        except OSError as exc:
            logger.warning("engine owners %s not written: %s", self.path, exc)
            with contextlib.suppress(OSError):
                os.unlink(temporary)

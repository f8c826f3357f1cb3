"""The host side of the cache as the daemon opens it at start: the arena and its journal.

Both report their progress to systemd (``STATUS=`` lines, and more start-up time while they
work), since pre-faulting a large arena or verifying the chunks of a previous run takes
seconds to minutes.

- ``open_arena(settings, notify, cuda=)``: create (or reopen) the arena file (the default
  one in its own 0700 directory, created here), pre-fault it
  and, on a cuda daemon, register it as pinned memory in pieces of ``PIN_PIECE``.
- ``open_journal(settings, arena, cache, notify)``: with ``cache.persist``, replay the
  previous run's journal into ``cache`` (warm restart), compact it so that it names exactly
  what the cache holds, and return it; without, remove any journal left behind (it names
  chunks of an arena that is not kept) and return None.
- ``open_copy_engine(arena, cuda=)``: the cuda engine over the arena's pinned pieces, or the
  cpu engine.
- ``tier_slots(settings, arena, tenant_of=)``: the tiers below the arena the settings turn
  on (disk, then the cluster); a cluster that cannot open is left off, logged. ``tenant_of``
  names a namespace's local tenant (``Registry.tenant_of_namespace``, called on the
  cluster tier's thread): the cluster tier takes only chunks of tenants ``mooncake.tenants``
  names; without it no chunk has one. ``cluster_tenant_problems(settings)``: names there
  that can never apply (logged when the cluster opens).
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import re
from collections.abc import Callable

import msgspec

from offloadd.cache.arena import Arena
from offloadd.cache.index import ChunkCache
from offloadd.cache.journal import Journal, discard
from offloadd.server.systemd import Notifier
from offloadd.server.tiers import TierSlot
from offloadd.settings import Settings, default_arena_dir
from offloadd.tiers.base import Tier
from offloadd.transfer.choice import choose_copy_engine
from offloadd.transfer.engine import CopyEngine, CpuCopyEngine
from offloadd.transfer.pinning import DEFAULT_PIECE as PIN_PIECE
from protocol.events import LOCALITY_LOCAL, LOCALITY_REMOTE, MEDIUM_STORAGE

__all__ = [
    "PIN_PIECE",
    "cluster_tenant_problems",
    "open_arena",
    "open_copy_engine",
    "open_journal",
    "tier_slots",
    "with_copy_engine_chosen",
]

logger = logging.getLogger(__name__)


def open_arena(settings: Settings, notify: Notifier, *, cuda: bool) -> Arena:
    """The arena, pre-faulted (and pinned on a cuda daemon); see the module docstring."""

    def prefault_progress(fraction: float) -> None:
        notify.status(f"pre-faulting the arena: {fraction:.0%}")
        notify.extend_timeout(30)

    def pin_arena(address: int, size: int) -> object:
        from offloadd.transfer.pinning import register_host_memory

        def progress(fraction: float) -> None:
            notify.status(f"registering the arena as pinned memory: {fraction:.0%}")
            notify.extend_timeout(60)

        return register_host_memory(address, size, piece=PIN_PIECE, progress=progress)

    notify.status("preparing the arena")
    if not settings.cache.arena:
        # Checked by Arena like any directory: another user's (pre-created) one is refused.
        with contextlib.suppress(FileExistsError):
            os.mkdir(default_arena_dir(), 0o700)
    return Arena(
        settings.arena_path(),
        settings.cache.capacity,
        progress=prefault_progress,
        unlink_on_close=not settings.cache.persist,
        pin=pin_arena if cuda else None,
    )


def open_journal(
    settings: Settings, arena: Arena, cache: ChunkCache, notify: Notifier
) -> Journal | None:
    """Find the chunks a previous daemon committed in this arena (warm restart)."""
    if not settings.cache.persist:
        with contextlib.suppress(OSError):  # it names chunks of an arena not kept
            discard(settings.journal_path())
        return None

    def progress(fraction: float) -> None:
        notify.status(f"verifying the chunks of the previous run: {fraction:.0%}")
        notify.extend_timeout(30)

    journal, chunks = Journal.open(
        settings.journal_path(),
        arena,
        shm_dirs=settings.server.shm_dirs,
        progress=progress,
    )
    try:
        kept = cache.restore(chunks)  # checksums verified: only their bounds are left to check
        if kept != len(chunks):
            logger.warning("journal: %d damaged chunk records skipped", len(chunks) - kept)
        # Always: the file must name exactly what the cache holds before extents get reused.
        journal.compact(cache.committed_chunks())
    except BaseException:
        journal.close()
        raise
    if kept:
        logger.info("warm start: %d committed chunks from the previous run", kept)
    return journal


def open_copy_engine(arena: Arena, *, cuda: bool) -> CopyEngine:
    """The engine that moves the bytes between the ranks' memory and ``arena``."""
    if not cuda:
        return CpuCopyEngine()
    from offloadd.transfer.batch import HostPieces
    from offloadd.transfer.cuda import make_engine

    return make_engine(host_pieces=HostPieces(arena.address, PIN_PIECE))


def tier_slots(
    settings: Settings, arena: Arena, *, tenant_of: Callable[[str], str | None] | None = None
) -> list[TierSlot]:
    """The tiers the settings turn on, in order: disk, then the cluster (none by default)."""
    slots: list[TierSlot] = []
    if settings.disk.path:
        from offloadd.tiers.disk import DiskTier

        disk = DiskTier.from_settings(settings.disk)
        # Its index is in memory: a lookup asks it on the loop.
        slots.append(
            TierSlot(
                disk,
                settings.disk.queue_bytes,
                inline=True,
                medium=MEDIUM_STORAGE,
                locality=LOCALITY_LOCAL,
            )
        )
    if settings.mooncake.master:
        cluster = _open_cluster(settings, arena, tenant_of)
        if cluster is not None:
            timeout = settings.mooncake.lookup_timeout
            slots.append(
                TierSlot(
                    cluster,
                    settings.mooncake.queue_bytes,
                    lookup_timeout=timeout,
                    medium=MEDIUM_STORAGE,
                    locality=LOCALITY_REMOTE,
                )
            )
    return slots


_DERIVED = re.compile(r"[ug]\d+\Z")  # the tenants of a uid or a gid, not of a uid range


def cluster_tenant_problems(
    settings: Settings, gid_of: Callable[[str], int] | None = None
) -> list[str]:
    """Entries of ``mooncake.tenants`` that name no local tenant ``offloadd.server.tenancy``
    can make: a gid whose group is not in ``tenancy.shared_groups`` (its users are ``u<uid>``
    tenants), a range that is not one of ``tenancy.uid_ranges``, or any uid or gid entry
    while ``tenancy.share_across_uids`` makes every user outside the ranges ``*``."""
    names = settings.mooncake.cluster_tenants()
    ranges = settings.tenancy.uid_ranges
    unranged = {local: name for local, name in names.items() if _DERIVED.match(local)}
    problems = [
        f"{name}: range:{local} is not one of tenancy.uid_ranges: this entry names nobody"
        for local, name in names.items()
        if local not in unranged and local not in ranges
    ]
    if unranged and settings.tenancy.share_across_uids:
        return [
            *problems,
            "tenancy.share_across_uids makes every local user one tenant, which no uid or gid "
            "entry names: the cluster tier takes none of their chunks",
        ]
    lookup = gid_of or (lambda name: grp.getgrnam(name).gr_gid)
    shared = {lookup(name) for name in settings.tenancy.shared_groups}
    return problems + [
        f"{name}: gid:{local[1:]} is not one of tenancy.shared_groups, so no tenant is "
        f"{local} (its users are tenants by uid): this entry names nobody"
        for local, name in unranged.items()
        if local.startswith("g") and int(local[1:]) not in shared
    ]


def _open_cluster(
    settings: Settings, arena: Arena, tenant_of: Callable[[str], str | None] | None
) -> Tier | None:
    """The cluster tier, or None (logged) when it cannot open: a node whose master is down,
    or that lacks the ``mooncake`` extra, still serves its host memory and disk."""
    for problem in cluster_tenant_problems(settings):
        logger.warning("mooncake.tenants: %s", problem)
    try:
        from offloadd.tiers.mooncake import MooncakeTier

        tier: Tier = MooncakeTier(settings.mooncake, arena, tenant_of=tenant_of)
    except Exception as exc:
        logger.error(
            "cluster tier OFF: cannot open Mooncake Store at %s: %s (restart to retry)",
            settings.mooncake.master,
            exc,
        )
        return None
    return tier


def with_copy_engine_chosen(settings: Settings) -> Settings:
    """``settings`` with ``server.copy_engine = "auto"`` replaced by the engine it picks."""
    engine, why = choose_copy_engine(settings.server.copy_engine)
    if not why:
        return settings
    logger.info("copy engine: %s (auto: %s)", engine, why)
    server = msgspec.structs.replace(settings.server, copy_engine=engine)
    return msgspec.structs.replace(settings, server=server)

"""Bounds per session, per engine and per user (``[limits]``): no client exhausts the daemon.

Pure logic, no I/O. Contract:

- ``Limits.keys_problem(keys)``: why a request's keys are refused ("" when they are fine):
  more than ``keys_per_request``, or a key longer than ``key_bytes`` (keys live in the
  index and the journal, so their size is what a client could grow them by).
- ``Limits.session_problem(regions, sessions)``: why a Hello is refused: more regions than
  ``regions_per_session``, or its user has ``sessions_per_uid`` sessions already.
- ``file_problem(size, furthest)``: why a region file of ``size`` bytes whose regions in one
  Hello end at ``furthest`` at most is refused: it is larger than that end rounded up to a
  page (a sparse file of any size would reserve the daemon's address space at that size).
- ``Limits.message_problem(request)``: why a request is refused for its size alone, before
  any of its work (its nested Lookups or jobs included) is done: more Lookups than
  ``lookups_per_message`` (Reserve, UpdateHolds), more jobs than ``jobs_per_message``
  (StepJobs), more keys in all its lists together than ``keys_per_message``. Counting is
  O(lists), never O(keys); a frame not decoded is judged on its ``StepCounts``.
- ``Limits.fragments_problem(regions)``: why a Hello's canonical pages cost too much to
  check and plan: a region whose runs copy more than ``fragments_per_page`` fragments, or
  regions that copy more than ``fragments_per_hello`` together (each fragment is a span
  every store and load of the session plans). O(runs), checked before the runs are walked.
- ``Limits.lease(asked, default)``: the pin lease a Lookup gets: ``asked`` (``0``: the
  default) cut to ``max_lease_seconds``; ``None`` for NaN or a negative lease.
- ``Limits.mapped_problem(mapped)``: why a Hello is refused when its user's live sessions
  would make the daemon map (or reserve address space for) ``mapped`` bytes of host region
  files: more than ``mapped_bytes_per_uid`` (0: the host's memory).
- What an engine and a tenant keep from eviction (``protected_fraction`` and
  ``tenant_protected_fraction`` of the capacity) and how long a reservation lasts
  (``reservation_seconds``) are bounded by the cache itself, which owns the pins, holds and
  reservations (``offloadd.cache.ledger``); ``cache_bounds`` gives its arguments.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from typing import TypedDict

from offloadd.server.peek import Peek, step_counts
from offloadd.settings import LimitsSettings, physical_memory
from protocol.handles import KVRegion
from protocol.messages import Request

__all__ = ["CacheBounds", "Limits", "cache_bounds", "file_problem"]


class CacheBounds(TypedDict):
    """``ChunkCache``'s keyword arguments that come from ``[limits]``."""

    budget: int
    tenant_budget: int
    reservation_lease: float
    reservation_renewals: int


def cache_bounds(capacity: int, settings: LimitsSettings) -> CacheBounds:
    """What each engine and each tenant may keep from eviction, and a reservation's lease."""
    tenant = settings.tenant_protected_fraction or settings.protected_fraction
    return CacheBounds(
        budget=int(capacity * settings.protected_fraction),
        tenant_budget=int(capacity * tenant),
        reservation_lease=settings.reservation_seconds,
        reservation_renewals=settings.reservation_renewals,
    )


class Limits:
    """The ``[limits]`` settings' checks that need no state."""

    def __init__(self, settings: LimitsSettings, *, memory: int | None = None) -> None:
        self.settings = settings
        # Bytes of host region files one uid's sessions may make the daemon map.
        self.mapped_bytes = settings.mapped_bytes_per_uid or (memory or physical_memory())

    def keys_problem(self, keys: Sequence[bytes]) -> str:
        """Why ``keys`` are refused ("" when they are fine)."""
        most = self.settings.keys_per_request
        if len(keys) > most:
            return f"{len(keys)} keys: more than limits.keys_per_request = {most}"
        longest = self.settings.key_bytes
        for key in keys:
            if len(key) > longest:
                return (
                    f"a key of {len(key)} bytes ({key[:16].hex()}...): more than "
                    f"limits.key_bytes = {longest}"
                )
        return ""

    def session_problem(self, regions: int, sessions: int) -> str:
        """Why a Hello with ``regions`` from a user with ``sessions`` others is refused."""
        settings = self.settings
        if regions > settings.regions_per_session:
            return (
                f"{regions} regions: limits.regions_per_session is {settings.regions_per_session}"
            )
        if sessions >= settings.sessions_per_uid:
            return f"this user has {sessions} sessions already (limits.sessions_per_uid)"
        return ""

    def mapped_problem(self, mapped: int) -> str:
        """Why a Hello after which its user's sessions map ``mapped`` bytes is refused."""
        if mapped <= self.mapped_bytes or not self.mapped_bytes:  # 0: the host did not say
            return ""
        return (
            f"this user's sessions would map {mapped} bytes of region files, more than "
            f"limits.mapped_bytes_per_uid ({self.mapped_bytes})"
        )

    def message_problem(self, request: Request | Peek) -> str:
        """Why ``request`` is refused for its size alone ("" when it is within bounds); a
        frame not decoded is judged on its counts (``offloadd.server.peek``), its keys counted
        only when it is long enough to hold too many (2 bytes a key at least)."""
        settings = self.settings
        if isinstance(request, Peek):
            counts = request.counts(keys=len(request.frame) // 2 > settings.keys_per_message)
        else:
            counts = step_counts(request)
        if counts is None:
            return ""
        if counts.lookups > settings.lookups_per_message:
            return (
                f"{counts.lookups} lookups in one message: more than "
                f"limits.lookups_per_message = {settings.lookups_per_message}"
            )
        if counts.jobs > settings.jobs_per_message:
            return (
                f"{counts.jobs} jobs in one StepJobs: more than "
                f"limits.jobs_per_message = {settings.jobs_per_message}"
            )
        if counts.keys > settings.keys_per_message:
            return (
                f"{counts.keys} keys in one message: more than "
                f"limits.keys_per_message = {settings.keys_per_message}"
            )
        return ""

    def fragments_problem(self, regions: Sequence[KVRegion]) -> str:
        """Why ``regions``' canonical pages copy too many fragments ("" when they do not)."""
        per_page, per_hello = self.settings.fragments_per_page, self.settings.fragments_per_hello
        total = 0
        for index, region in enumerate(regions):
            canonical = region.canonical
            if canonical is None:
                continue
            # A run of no or negative fragments is refused later, by the geometry checks;
            # each run counts at least one so their number is bounded too.
            fragments = sum(max(run[3], 1) for run in canonical.runs)
            if fragments > per_page:
                return (
                    f"region {index}: its canonical page is copied in {fragments} fragments, "
                    f"more than limits.fragments_per_page = {per_page}"
                )
            total += fragments
            if total > per_hello:
                return (
                    f"regions 0-{index}: their canonical pages are copied in {total} "
                    f"fragments, more than limits.fragments_per_hello = {per_hello}"
                )
        return ""

    def lease(self, asked: float, default: float) -> float | None:
        """The lease a pin gets, or None for a lease that is no number of seconds."""
        if math.isnan(asked) or asked < 0:
            return None
        return min(asked or default, self.settings.max_lease_seconds)


def file_problem(size: int, furthest: int) -> str:
    """Why a region file of ``size`` bytes, used by regions up to ``furthest``, is refused."""
    page = mmap.PAGESIZE
    bound = -(-furthest // page) * page
    if size > bound:
        return (
            f"its file has {size} bytes, but its regions use {furthest}: a region file may be "
            f"at most its furthest region's end rounded up to a page ({bound})"
        )
    return ""

"""A chunk's commit and removal: the one place "visible only when written, sealed and
journaled" is kept, and the journal's one writer.

A rank's store (``offloadd.server.jobs``) and a tier's promotion (``offloadd.server.tiers``)
both end here, in the same steps: the bytes are sealed off the loop, the chunks become
visible, the journal records them (or they are taken back), and only then are they
announced.

Contract of ``Committer`` (the event loop's thread, except ``seal``):
- ``seal(writes, then)``: any thread, once every shard in ``writes`` holds its bytes (the
  copy ended, the tier's ``get`` verified them). With a journal each shard is synced (on a
  disk) and checksummed on the journal's threads, then ``then()`` runs there; without one,
  ``then()`` runs at once. ``commit`` comes after ``then``: a shard not sealed has no
  checksum, and its chunk is lost at the commit.
- ``commit(namespace, writes, ok=, source=)``: ends ``writes`` in the cache
  (``ChunkCache.finish_store``; with ``ok=False`` nothing commits: a failed or abandoned
  copy). Each chunk whose every shard is now written becomes visible and is journaled; the
  chunks the journal refuses (a shard without a checksum, a failing journal) are taken back
  at once: removed from the cache, their extents freed, never announced. The rest are
  announced (``Announcer.chunks_committed``: mirrors, KV events, every tier but ``source``),
  unless ``namespace`` is None (its engine is gone: nobody to tell). Returns a ``Commit``:
  what committed, what was lost and why. A journal grown mostly of tombstones is compacted
  here, from the cache's committed chunks.
- ``fail(writes)``: a copy that failed or was never started: its writes end, nothing
  commits. ``abandon(writes)``: their session went away mid-copy: their pending entries
  leave the index now (``ChunkCache.abandon``); the copy's end still calls ``commit``.
- ``removed(entries)``: the cache's listener (``offloadd.cache.listeners``; it listens from
  construction on), so the cache itself tells of what it evicts or removes, before it
  returns: tombstones are journaled before the extents can be reused, then the announcer
  tells of them. ``placed()``: nothing (room placed is the waiting stores' concern).
- ``cleared(engine, namespace, removed)`` (a Clear) and ``dropped(name, removed)`` (an
  operator's ``ClearCache``): the same for a cleared namespace's entries; returns the
  committed keys dropped (``Announcer.cleared`` / ``dropped`` say whom they are told).
- ``journal_closed()``: the daemon is closing the journal; later commits are visible
  without a record (a restart does not find them, never anything wrong).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from offloadd.cache.index import ChunkCache, Entry, ShardWrite
from offloadd.cache.journal import Journal
from offloadd.server.announce import Announcer
from offloadd.server.registry import Engine, Namespace

__all__ = ["Commit", "Committer"]


class Commit(NamedTuple):
    """What one ``Committer.commit`` made visible, and what it took back."""

    committed: list[Entry]  # visible, journaled and announced
    lost: list[Entry]  # written, but the journal refused them: removed, never announced
    reason: str  # why ``lost`` were refused ("" when none were)


class Committer:
    """Seal, make visible, journal, announce; see the module docstring."""

    def __init__(self, cache: ChunkCache, announce: Announcer, *, journal: Journal | None) -> None:
        self._cache = cache
        self._announce = announce
        self._journal = journal
        cache.listen(self)  # the cache tells of its evictions itself

    def journal_closed(self) -> None:
        """Journal nothing more (the daemon is closing the journal)."""
        self._journal = None

    def seal(self, writes: Sequence[ShardWrite], then: Callable[[], object]) -> None:
        """Checksum (and on a disk, sync) ``writes`` off the loop, then call ``then()``."""
        journal = self._journal
        if journal is None:
            then()
            return
        journal.submit_seal(writes, then)

    def commit(
        self,
        namespace: Namespace | None,
        writes: Sequence[ShardWrite],
        *,
        ok: bool = True,
        source: str = "",
    ) -> Commit:
        """End ``writes``; journal and announce the chunks that became visible."""
        committed = self._cache.finish_store(writes, ok=ok)
        lost = self._journal_commits(committed)
        reason = ""
        if lost:
            committed = [entry for entry in committed if not entry.dead]
            reason = self._failure()
        if namespace is not None:
            self._announce.chunks_committed(namespace, committed, source=source)
        return Commit(committed, lost, reason)

    def _journal_commits(self, entries: list[Entry]) -> list[Entry]:
        """Journal ``entries``; those it refuses are taken back (extents freed) and returned."""
        journal = self._journal
        if not entries or journal is None:
            return []
        cache = self._cache
        lost = journal.committed(entries, cache.committed_chunks)
        for entry in lost:
            cache.remove(entry.namespace, [entry.key])
        if journal.should_compact():
            journal.compact(cache.committed_chunks())
        return lost

    def _failure(self) -> str:
        failure = self._journal.failed if self._journal is not None else ""
        return failure or "its bytes could not be checksummed"

    def fail(self, writes: Sequence[ShardWrite]) -> None:
        """End the writes of a copy that failed or never started: nothing commits."""
        self._cache.finish_store(writes, ok=False)

    def abandon(self, writes: Sequence[ShardWrite]) -> None:
        """The session of ``writes`` went away mid-copy: their pending entries leave now."""
        self._cache.abandon(writes)

    def removed(self, entries: Sequence[Entry]) -> None:
        """Evicted or removed chunks: tombstones before their extents can be reused, then
        told (the cache's listener)."""
        self._journal_removals(entries)
        self._announce.removed(entries)

    def placed(self) -> None:
        """Nothing: keys placed are not announced (they commit later)."""

    def cleared(self, engine: Engine, namespace: Namespace, removed: list[Entry]) -> list[bytes]:
        """``engine`` cleared ``namespace``; returns the committed keys dropped."""
        self._journal_removals(removed)
        return self._announce.cleared(engine, namespace, removed)

    def dropped(self, name: str, removed: list[Entry]) -> list[bytes]:
        """An operator cleared namespace ``name``; returns the committed keys dropped."""
        self._journal_removals(removed)
        return self._announce.dropped(name, removed)

    def _journal_removals(self, entries: Sequence[Entry]) -> None:
        if self._journal is not None:
            self._journal.removed(entries)

"""A job's copies held as numpy blocks: the planner's output for the engines' fast path.

``Copies`` is a ``Sequence[Triple]`` (so every engine and test can read it as triples), but
``offloadd.transfer.plan.chunk_copies`` fills it one chunk at a time with a few array
operations over all of the chunk's regions and blocks at once, instead of one Python tuple
per copy, and ``offloadd.transfer.batch.move_arrays`` takes its ``table()`` as is. Nothing
is merged here: the engine merges once, over the whole job. The daemon plans through
``ChunkRuns``: consecutive chunks alike (same spans, first sub-block and block count) go in
as one ``add_chunks``, the same copies in the same order as chunk after chunk; the jobs of
one step are joined and planned at once (``offloadd.server.jobs``' batch).

``windows`` (set by the daemon) lists the rank's shared-memory files in the plan's address
space (``offloadd.transfer.guarded``): copies touching them are made through the files'
descriptors, never through a mapping.

Order of the copies: chunk after chunk; inside a chunk, region after region (the group's
order), block after block: the order ``chunk_copies`` appends triples in, so a shard's bytes
come out in arena order and neighbours can merge.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, overload

import numpy as np

from offloadd.transfer.types import FileWindow, Span, Table, Triple

_SPAN_CACHE = 1024


class _SpanArrays(NamedTuple):
    bases: Table
    strides: Table
    pages: Table
    parts: Table
    page_sum: int
    steps: Table


class Copies(Sequence[Triple]):
    """A job's ``(src, dst, nbytes)`` copies as int64 column blocks; see the module."""

    __slots__ = ("_columns", "_count", "_joined", "windows")

    def __init__(self, windows: Sequence[FileWindow] = ()) -> None:
        self._columns: tuple[list[Table], list[Table], list[Table]] = ([], [], [])
        self._count = 0
        self._joined: tuple[Table, Table, Table] | None = None
        self.windows = tuple(windows)

    def add_chunk(
        self,
        spans: Sequence[Span],
        block_ids: Sequence[int],
        shard_address: int,
        *,
        first_sub_block: int = 0,
        load: bool = False,
    ) -> int:
        """Append one chunk's copies (``chunk_copies``'s contract); returns the bytes."""
        count = len(block_ids)
        if not count or not spans:
            return 0
        arrays = _span_arrays(spans)
        ids = np.fromiter(block_ids, np.int64, count)
        region = np.multiply.outer(arrays.strides, ids)
        region += arrays.bases[:, None]
        shard, sizes = _shard_template(arrays, count, first_sub_block)
        shard = shard + shard_address
        srcs, dsts, nbytes = self._columns
        srcs.append((shard if load else region).ravel())
        dsts.append((region if load else shard).ravel())
        nbytes.append(sizes)
        self._count += sizes.size
        self._joined = None
        return arrays.page_sum * count

    def add_chunks(
        self,
        spans: Sequence[Span],
        block_ids: Sequence[int],
        shard_addresses: Sequence[int],
        *,
        first_sub_block: int = 0,
        load: bool = False,
    ) -> int:
        """Append the copies of several chunks that share ``spans``, their first sub-block
        and their block count: ``block_ids`` holds each chunk's ids in turn, one chunk per
        address. The same copies, in the same order, as one ``add_chunk`` per chunk, made
        with a handful of array operations for the whole run; returns the bytes."""
        chunks = len(shard_addresses)
        if not chunks or not spans:
            return 0
        count, extra = divmod(len(block_ids), chunks)
        if extra:
            raise ValueError(f"{len(block_ids)} block ids for {chunks} chunks of equal length")
        if not count:
            return 0
        arrays = _span_arrays(spans)
        ids = np.fromiter(block_ids, np.int64, chunks * count).reshape(chunks, 1, count)
        region = arrays.strides[None, :, None] * ids  # (chunk, region, block)
        region += arrays.bases[None, :, None]
        template, sizes = _shard_template(arrays, count, first_sub_block)
        addresses = np.fromiter(shard_addresses, np.int64, chunks)
        shard = template[None, :, :] + addresses[:, None, None]
        srcs, dsts, nbytes = self._columns
        srcs.append((shard if load else region).ravel())
        dsts.append((region if load else shard).ravel())
        nbytes.append(np.tile(sizes, chunks))
        self._count += sizes.size * chunks
        self._joined = None
        return arrays.page_sum * count * chunks

    def columns(self) -> tuple[Table, Table, Table]:
        """``(srcs, dsts, sizes)``, each one contiguous array (joined once, on first use)."""
        if self._joined is None:
            joined = tuple(
                blocks[0] if len(blocks) == 1 else np.concatenate(blocks) if blocks else _NONE
                for blocks in self._columns
            )
            self._joined = (joined[0], joined[1], joined[2])
            self._columns = ([joined[0]], [joined[1]], [joined[2]]) if self._count else ([], [], [])
        return self._joined

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Triple]:
        srcs, dsts, sizes = (column.tolist() for column in self.columns())
        return zip(srcs, dsts, sizes, strict=True)

    @overload
    def __getitem__(self, index: int) -> Triple: ...

    @overload
    def __getitem__(self, index: slice) -> list[Triple]: ...

    def __getitem__(self, index: int | slice) -> Triple | list[Triple]:
        srcs, dsts, sizes = self.columns()
        if isinstance(index, slice):
            columns = (srcs[index].tolist(), dsts[index].tolist(), sizes[index].tolist())
            return list(zip(*columns, strict=True))
        return int(srcs[index]), int(dsts[index]), int(sizes[index])


_NONE: Table = np.zeros(0, np.int64)


class ChunkRuns:
    """A job's chunks, kept as runs of consecutive chunks alike (same spans, first sub-block
    and block count: most of a job, often all of it) and planned by ``copies()`` into one
    ``Copies``, each run one ``Copies.add_chunks``. ``add`` the chunks in order. ``joined``
    puts several jobs' runs end to end (a step's jobs, whose runs alike then merge), so that
    they are planned once; ``nbytes`` and truth (any byte to copy) are known before."""

    __slots__ = ("_load", "_runs", "nbytes", "windows")

    def __init__(self, windows: Sequence[FileWindow] = (), *, load: bool = False) -> None:
        self.windows = tuple(windows)
        self._load = load
        # Each run: its key (id(spans), first sub-block, block count), spans, ids, addresses.
        self._runs: list[tuple[tuple[int, int, int], Sequence[Span], list[int], list[int]]] = []
        self.nbytes = 0

    def add(
        self,
        spans: Sequence[Span],
        block_ids: Sequence[int],
        shard_address: int,
        first_sub_block: int = 0,
    ) -> None:
        """One more chunk (``Copies.add_chunk``'s arguments)."""
        self.add_alike(spans, block_ids, (shard_address,), first_sub_block)

    def add_alike(
        self,
        spans: Sequence[Span],
        block_ids: Sequence[int],
        shard_addresses: Sequence[int],
        first_sub_block: int = 0,
    ) -> None:
        """More chunks alike, in order (``Copies.add_chunks``' arguments): ``add`` of each."""
        chunks = len(shard_addresses)
        if not block_ids or not spans or not chunks:
            return
        count, extra = divmod(len(block_ids), chunks)
        if extra:
            raise ValueError(f"{len(block_ids)} block ids for {chunks} chunks of equal length")
        key = (id(spans), first_sub_block, count)
        runs = self._runs
        if not runs or runs[-1][0] != key:
            runs.append((key, spans, [], []))
        _, _, ids, addresses = runs[-1]
        ids.extend(block_ids)
        addresses.extend(shard_addresses)
        self.nbytes += _span_arrays(spans).page_sum * len(block_ids)

    def __bool__(self) -> bool:
        return self.nbytes > 0

    @classmethod
    def joined(cls, parts: Sequence[ChunkRuns]) -> ChunkRuns:
        """The chunks of ``parts`` (of one rank and direction), in order, as one job's."""
        first = parts[0]
        if any(p.windows != first.windows or p._load != first._load for p in parts):
            raise ValueError("chunk runs of different ranks or directions cannot be joined")
        joined = cls(first.windows, load=first._load)
        runs = joined._runs
        for part in parts:
            for key, spans, ids, addresses in part._runs:
                if runs and runs[-1][0] == key:
                    runs[-1][2].extend(ids)
                    runs[-1][3].extend(addresses)
                else:
                    runs.append((key, spans, list(ids), list(addresses)))
            joined.nbytes += part.nbytes
        return joined

    def copies(self) -> Copies:
        """The copies of every chunk added, in order."""
        copies = Copies(self.windows)
        for (_, first, _), spans, ids, addresses in self._runs:
            copies.add_chunks(spans, ids, addresses, first_sub_block=first, load=self._load)
        return copies


def block_bytes(spans: Sequence[Span]) -> int:
    """Bytes the copies of one block id over ``spans`` move (what ``ChunkRuns`` counts)."""
    return _span_arrays(spans).page_sum


# The daemon passes the same spans tuple (cached per session and group) for every chunk, so the
# arrays are keyed by its identity; the tuple itself is kept so the id cannot be reused.
_cache: dict[int, tuple[Sequence[Span], _SpanArrays]] = {}


def _span_arrays(spans: Sequence[Span]) -> _SpanArrays:
    hit = _cache.get(id(spans))
    if hit is not None and hit[0] is spans:
        return hit[1]
    columns = np.array([tuple(span) for span in spans], np.int64).reshape(-1, 5)
    pages = columns[:, 2].copy()
    arrays = _SpanArrays(
        columns[:, 0].copy(),
        columns[:, 1].copy(),
        pages,
        columns[:, 3].copy(),
        int(pages.sum()),
        np.where(columns[:, 4] > 0, columns[:, 4], pages),
    )
    if len(_cache) >= _SPAN_CACHE:
        _cache.pop(next(iter(_cache)))
    _cache[id(spans)] = (spans, arrays)
    return arrays


# Per spans, chunk length and first sub-block: the shard offsets and sizes of a chunk's copies,
# which only the shard's address changes from chunk to chunk.
_templates: dict[tuple[int, int, int], tuple[_SpanArrays, Table, Table]] = {}


def _shard_template(arrays: _SpanArrays, count: int, first: int) -> tuple[Table, Table]:
    key = (id(arrays), count, first)
    hit = _templates.get(key)
    if hit is not None and hit[0] is arrays:
        return hit[1], hit[2]
    offsets = np.multiply.outer(arrays.steps, np.arange(first, first + count))
    offsets += arrays.parts[:, None]
    sizes = np.repeat(arrays.pages, count)
    sizes.flags.writeable = False
    if len(_templates) >= _SPAN_CACHE:
        _templates.pop(next(iter(_templates)))
    _templates[key] = (arrays, offsets, sizes)
    return offsets, sizes

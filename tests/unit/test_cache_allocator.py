"""ExtentAllocator: alignment, best fit, splitting, coalescing, and a model-based check."""

from __future__ import annotations

import random

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from offloadd.cache.allocator import ExtentAllocator
from tests.strategies import property_settings

A = 4096


def test_offsets_and_sizes_are_aligned() -> None:
    alloc = ExtentAllocator(64 * A)
    assert alloc.alloc_size(1) == A
    assert alloc.alloc_size(A) == A
    assert alloc.alloc_size(A + 1) == 2 * A
    offsets = [alloc.alloc(size) for size in (1, A + 1, 3 * A - 7, 100)]
    assert all(off is not None and off % A == 0 for off in offsets)
    assert alloc.used_bytes == A + 2 * A + 3 * A + A
    assert alloc.free_bytes == 64 * A - alloc.used_bytes


def test_capacity_rounds_down_to_align() -> None:
    alloc = ExtentAllocator(10 * A + 123)
    assert alloc.capacity == 10 * A
    assert alloc.free_extents() == [(0, 10 * A)]
    assert ExtentAllocator(A - 1).alloc(1) is None


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="align must be positive, got 0"):
        ExtentAllocator(A, align=0)
    with pytest.raises(ValueError, match="capacity must not be negative, got -1"):
        ExtentAllocator(-1)
    with pytest.raises(ValueError, match="size must be positive, got 0"):
        ExtentAllocator(A).alloc(0)
    with pytest.raises(ValueError, match="boundary must be 0 or a multiple of align, got -4096"):
        ExtentAllocator(A, boundary=-A)
    # The smallest legal values.
    assert ExtentAllocator(0).free_extents() == []
    assert ExtentAllocator(0).alloc(1) is None
    tiny = ExtentAllocator(3, align=1)
    assert [tiny.alloc(1), tiny.alloc(2), tiny.alloc(1)] == [0, 1, None]


def test_exact_fit_reuses_the_hole_of_the_same_size() -> None:
    alloc = ExtentAllocator(16 * A)
    a = alloc.alloc(2 * A)
    b = alloc.alloc(3 * A)
    c = alloc.alloc(2 * A)
    assert (a, b, c) == (0, 2 * A, 5 * A)
    alloc.free(2 * A, 3 * A)
    # Free: a 3-page hole at 2A and the 9-page tail at 7A. A 3-page request takes the hole.
    assert alloc.alloc(3 * A) == 2 * A
    assert alloc.free_extents() == [(7 * A, 9 * A)]


def test_best_fit_splits_the_smallest_larger_extent() -> None:
    alloc = ExtentAllocator(20 * A)
    offs = [alloc.alloc(A) for _ in range(20)]
    assert offs == [i * A for i in range(20)]
    # Holes of 3 pages (at 0) and 2 pages (at 10A): a 1-page request splits the 2-page hole.
    for i in (0, 1, 2, 10, 11):
        alloc.free(i * A, A)
    assert alloc.free_extents() == [(0, 3 * A), (10 * A, 2 * A)]
    assert alloc.largest_free == 3 * A
    assert alloc.alloc(A) == 10 * A
    assert alloc.free_extents() == [(0, 3 * A), (11 * A, A)]
    assert alloc.alloc(4 * A) is None
    assert alloc.alloc(3 * A) == 0


def test_freeing_everything_in_random_order_coalesces_to_one_extent() -> None:
    rng = random.Random(7)
    alloc = ExtentAllocator(1000 * A)
    held: list[tuple[int, int]] = []
    while True:
        size = rng.randint(1, 5 * A)
        off = alloc.alloc(size)
        if off is None:
            break
        held.append((off, size))
    rng.shuffle(held)
    for off, size in held:
        alloc.free(off, size)
    assert alloc.used_bytes == 0
    assert alloc.free_extents() == [(0, 1000 * A)]
    assert alloc.largest_free == 1000 * A


def test_double_free_and_bad_free_raise() -> None:
    alloc = ExtentAllocator(8 * A)
    off = alloc.alloc(2 * A)
    assert off is not None
    with pytest.raises(ValueError, match=r"extent \(0, 12288\) is not allocated"):
        alloc.free(off, 3 * A)  # wrong size
    with pytest.raises(ValueError, match=r"extent \(4096, 4096\) is not allocated"):
        alloc.free(off + A, A)  # inside an extent, not its start
    with pytest.raises(ValueError, match="is not allocated"):
        alloc.free(off, A)  # its start, but only part of it
    with pytest.raises(ValueError, match="is not allocated"):
        alloc.free(2 * A, A)  # free space
    alloc.free(off, 2 * A)
    with pytest.raises(ValueError, match="is not allocated"):
        alloc.free(off, 2 * A)
    assert alloc.used_bytes == 0
    assert alloc.free_extents() == [(0, 8 * A)]


@pytest.mark.parametrize(
    ("offset", "size"),
    [
        (-A, A),  # before the arena
        (A // 2, A),  # not aligned
        (8 * A, A),  # at the end
        (7 * A, 2 * A),  # running past the end
    ],
)
def test_a_free_outside_the_arena_or_unaligned_raises(offset: int, size: int) -> None:
    alloc = ExtentAllocator(8 * A)
    for _ in range(8):
        assert alloc.alloc(A) is not None  # every unit allocated: only the bounds can refuse
    with pytest.raises(ValueError, match=rf"extent \({offset}, {size}\) is not allocated"):
        alloc.free(offset, size)
    assert alloc.used_bytes == 8 * A


def test_a_free_spanning_two_extents_raises() -> None:
    alloc = ExtentAllocator(16 * A)
    assert [alloc.alloc(n * A) for n in (1, 8, 1, 1)] == [0, A, 9 * A, 10 * A]
    # From the second extent's start to the third's end: the end at unit 8, in the next
    # byte of the bitmap, lies inside.
    with pytest.raises(ValueError, match="is not allocated"):
        alloc.free(A, 9 * A)
    # Two one-unit extents: the first one's end is the first unit of the range.
    with pytest.raises(ValueError, match="is not allocated"):
        alloc.free(9 * A, 2 * A)
    with pytest.raises(ValueError, match="is not allocated"):
        alloc.free(0, 2 * A)
    assert alloc.used_bytes == 11 * A
    alloc.free(A, 8 * A)  # the extent itself is freed
    assert alloc.used_bytes == 3 * A


def test_a_freed_extent_leaves_no_start_behind_and_touches_no_other() -> None:
    alloc = ExtentAllocator(8 * A)
    assert [alloc.alloc(n * A) for n in (1, 1, 2)] == [0, A, 2 * A]  # units 0, 1, 2-3
    alloc.free(A, A)
    # Unit 1 no longer starts an extent, and unit 3 never did (it ends one).
    with pytest.raises(ValueError, match=r"extent \(4096, 12288\) is not allocated"):
        alloc.free(A, 3 * A)
    with pytest.raises(ValueError, match=r"extent \(12288, 4096\) is not allocated"):
        alloc.free(3 * A, A)
    alloc.free(2 * A, 2 * A)
    alloc.free(0, A)
    assert alloc.free_extents() == [(0, 8 * A)] and alloc.used_bytes == 0


def test_extents_restored_past_the_first_bitmap_byte_can_be_freed() -> None:
    # Units 9-10 and 17: their marks live in the second and third bytes of the bitmaps.
    alloc = ExtentAllocator.with_allocated(24 * A, [(9 * A, 2 * A), (17 * A, A)])
    with pytest.raises(ValueError, match="is not allocated"):
        alloc.free(A, 2 * A)  # where a mark in the wrong byte would put unit 9's
    alloc.free(9 * A, 2 * A)
    alloc.free(17 * A, A)
    assert alloc.free_extents() == [(0, 24 * A)] and alloc.used_bytes == 0


def test_extents_never_overlap_under_random_churn() -> None:
    rng = random.Random(11)
    cap = 256
    alloc = ExtentAllocator(cap * A)
    owner = bytearray(cap)  # one byte per page: 0 free, 1 allocated
    held: dict[int, int] = {}
    for _ in range(5000):
        if held and rng.random() < 0.45:
            off = rng.choice(list(held))
            size = held.pop(off)
            alloc.free(off, size)
            owner[off // A : off // A + -(-size // A)] = bytes(-(-size // A))
        else:
            size = rng.randint(1, 9 * A)
            got = alloc.alloc(size)
            if got is None:
                continue
            off = got
            pages = -(-size // A)
            assert off % A == 0 and off + pages * A <= cap * A
            assert not any(owner[off // A : off // A + pages]), "overlap"
            owner[off // A : off // A + pages] = b"\x01" * pages
            held[off] = size
        assert alloc.used_bytes == sum(owner) * A


class AllocatorModel(RuleBasedStateMachine):
    """The allocator against a sorted list of allocated intervals."""

    CAP = 48 * A

    def __init__(self) -> None:
        super().__init__()
        self.alloc = ExtentAllocator(self.CAP)
        self.held: dict[int, int] = {}  # offset -> requested size

    def gaps(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        cursor = 0
        for off in sorted(self.held):
            if off > cursor:
                out.append((cursor, off - cursor))
            cursor = off + self.alloc.alloc_size(self.held[off])
        if cursor < self.CAP:
            out.append((cursor, self.CAP - cursor))
        return out

    @rule(size=st.integers(min_value=1, max_value=12 * A))
    def alloc_some(self, size: int) -> None:
        need = self.alloc.alloc_size(size)
        fitting = [g for g in self.gaps() if g[1] >= need]
        off = self.alloc.alloc(size)
        if off is None:
            assert not fitting
            return
        exact = [g for g in fitting if g[1] == need]
        best = min(g[1] for g in fitting)
        gap = next(g for g in fitting if g[0] <= off < g[0] + g[1])
        assert off + need <= gap[0] + gap[1]
        if exact:
            assert gap in exact
        else:
            assert gap[1] == best and off == gap[0]
        self.held[off] = size

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.held)))
        self.alloc.free(off, self.held.pop(off))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def double_free_fails(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.held)))
        size = self.held.pop(off)
        self.alloc.free(off, size)
        with pytest.raises(ValueError, match="is not allocated"):
            self.alloc.free(off, size)

    @invariant()
    def matches_model(self) -> None:
        used = sum(self.alloc.alloc_size(s) for s in self.held.values())
        assert self.alloc.used_bytes == used <= self.CAP
        gaps = self.gaps()
        # Fully coalesced: the free extents are exactly the gaps between allocations.
        assert self.alloc.free_extents() == gaps
        assert self.alloc.largest_free == max((g[1] for g in gaps), default=0)


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = property_settings(150, stateful_step_count=40)


# --- boundaries: no extent straddles a multiple of ``boundary`` (pinned pieces) ----------------


def test_boundary_cuts_the_free_space_and_is_never_straddled() -> None:
    alloc = ExtentAllocator(10 * A, boundary=4 * A)
    assert alloc.free_extents() == [(0, 4 * A), (4 * A, 4 * A), (8 * A, 2 * A)]
    assert alloc.max_alloc == 4 * A
    assert alloc.alloc(5 * A) is None  # larger than a piece: never fits
    offsets = [alloc.alloc(3 * A) for _ in range(2)]
    assert sorted(o for o in offsets if o is not None) == [0, 4 * A]
    # 4 pages are free, but no 3 of them in one piece: across the cut they would fit.
    assert alloc.free_bytes == 4 * A
    assert alloc.alloc(3 * A) is None
    assert alloc.largest_free == 2 * A
    assert alloc.alloc(2 * A) == 8 * A


@pytest.mark.parametrize("descending", [False, True])
def test_freeing_never_merges_across_a_boundary(descending: bool) -> None:
    alloc = ExtentAllocator(8 * A, boundary=4 * A)
    offsets = [alloc.alloc(A) for _ in range(8)]
    assert sorted(o for o in offsets if o is not None) == [i * A for i in range(8)]
    for offset in sorted(range(0, 8 * A, A), reverse=descending):
        alloc.free(offset, A)
    assert alloc.free_extents() == [(0, 4 * A), (4 * A, 4 * A)]


def test_straddles_at_the_edges_of_a_piece() -> None:
    alloc = ExtentAllocator(8 * A, boundary=4 * A)
    assert not alloc.straddles(3 * A, A)  # ends at the cut
    assert alloc.straddles(3 * A, A + 1)
    assert not alloc.straddles(4 * A - 1, 1)
    assert alloc.straddles(4 * A - 1, 2)
    assert not alloc.straddles(4 * A, 4 * A)
    assert not alloc.straddles(4 * A - 1, 0)  # nothing at all
    assert not alloc.straddles(4 * A, 0)
    assert not ExtentAllocator(8 * A).straddles(3 * A, 4 * A)  # no cuts


def test_with_allocated_keeps_the_cuts_and_refuses_a_straddling_extent() -> None:
    alloc = ExtentAllocator.with_allocated(12 * A, [(A, A), (6 * A, 2 * A)], boundary=4 * A)
    assert alloc.free_extents() == [(0, A), (2 * A, 2 * A), (4 * A, 2 * A), (8 * A, 4 * A)]
    with pytest.raises(ValueError, match="straddles"):
        ExtentAllocator.with_allocated(12 * A, [(3 * A, 2 * A)], boundary=4 * A)
    with pytest.raises(ValueError, match="boundary"):
        ExtentAllocator(12 * A, boundary=A + 1)


def test_with_allocated_rebuilds_used_and_free_extents() -> None:
    alloc = ExtentAllocator.with_allocated(10 * A + 5, [(6 * A, 100), (0, A), (A, 2 * A)])
    assert alloc.capacity == 10 * A
    assert alloc.used_bytes == 4 * A
    assert alloc.free_extents() == [(3 * A, 3 * A), (7 * A, 3 * A)]
    assert alloc.largest_free == 3 * A
    # The extents given are allocated: each can be freed once, as passed, and they coalesce.
    alloc.free(A, 2 * A)
    with pytest.raises(ValueError, match="is not allocated"):
        alloc.free(A, 2 * A)
    alloc.free(0, A)
    alloc.free(6 * A, 100)
    assert alloc.free_extents() == [(0, 10 * A)] and alloc.used_bytes == 0
    # Nothing in use, or everything.
    assert ExtentAllocator.with_allocated(4 * A, []).free_extents() == [(0, 4 * A)]
    full = ExtentAllocator.with_allocated(4 * A, [(0, 4 * A)])
    assert (full.free_extents(), full.used_bytes, full.alloc(1)) == ([], 4 * A, None)


def test_with_allocated_takes_the_alignment_given() -> None:
    alloc = ExtentAllocator.with_allocated(100, [(10, 10), (30, 5)], align=10)
    assert alloc.align == 10
    assert alloc.used_bytes == 20
    assert alloc.free_extents() == [(0, 10), (20, 10), (40, 60)]
    assert alloc.alloc(1) == 0
    with pytest.raises(ValueError, match=r"extent \(5, 10\) is unaligned"):
        ExtentAllocator.with_allocated(100, [(5, 10)], align=10)


@pytest.mark.parametrize(
    "extents",
    [
        [(A + 1, A)],  # unaligned
        [(0, 2 * A), (A, A)],  # overlapping
        [(A, A), (A, A)],  # the same twice
        [(3 * A, 2 * A)],  # past the end
        [(4 * A, 1)],  # starts at the end
        [(-A, A)],  # before the start
    ],
)
def test_with_allocated_refuses_what_cannot_be_in_use(extents: list[tuple[int, int]]) -> None:
    with pytest.raises(ValueError, match="is unaligned, overlaps or is outside"):
        ExtentAllocator.with_allocated(4 * A, extents)


@pytest.mark.parametrize("page_kib", [18, 40, 61])
def test_a_256_gib_arena_in_64_gib_pieces_is_filled_without_a_straddle(page_kib: int) -> None:
    # Pure arithmetic: no memory behind the offsets. Shards of 16 blocks x 40 layers of an odd
    # page size do not divide 64 GiB, so filling the arena in order would cross each cut.
    gib = 1 << 30
    shard = page_kib * 1024 * 16 * 40
    alloc = ExtentAllocator(256 * gib, boundary=64 * gib)
    rng = random.Random(page_kib)
    live: list[int] = []
    while (offset := alloc.alloc(shard)) is not None:
        live.append(offset)
    assert all(not alloc.straddles(offset, alloc.alloc_size(shard)) for offset in live)
    assert alloc.free_bytes < 4 * alloc.alloc_size(shard)  # at most a tail per piece is lost
    for offset in rng.sample(live, len(live) // 2):
        alloc.free(offset, shard)
        live.remove(offset)
    while (offset := alloc.alloc(shard // 3)) is not None:
        assert not alloc.straddles(offset, alloc.alloc_size(shard // 3))


def test_take_is_alloc_of_a_rounded_size() -> None:
    one, other = ExtentAllocator(8 * A), ExtentAllocator(8 * A)
    for size in (A, 3 * A, 2 * A, 3 * A, 2 * A):  # the second 3 * A does not fit
        assert one.take(size) == other.alloc(size - 1)
    assert one.take(A) is None and other.alloc(1) is None
    assert one.free_extents() == other.free_extents()


def test_a_split_keeps_the_free_sizes_ordered_and_the_ends_mapped() -> None:
    a = ExtentAllocator(16 * A)
    held = [a.alloc(A) for _ in range(4)]  # the tail splits in place: [4A, 16A) stays free
    a.free(held[1] or 0, A)  # a hole of A between used extents
    assert a.take(A) == A  # the exact fit
    a.free(held[2] or 0, 1)  # holes of A at 2A ...
    assert a.alloc(A) == 2 * A
    big = a.take(10 * A)  # from the 12A tail: the rest (2A) lands among the sizes in order
    assert big == 4 * A and a.free_extents() == [(14 * A, 2 * A)]
    a.free(big or 0, 10 * A)  # merges through the end map into one free extent again
    assert a.free_extents() == [(4 * A, 12 * A)] and a.largest_free == 12 * A


@pytest.mark.parametrize("seed", range(20))
def test_take_many_is_take_after_take(seed: int) -> None:
    """A step's extents in one call: the same offsets, free space and double-free checks as
    ``take`` called once per key, from exact-size holes (evictions) and a splitting tail."""
    rng = random.Random(seed)
    one, other = ExtentAllocator(64 * A), ExtentAllocator(64 * A)
    held: list[tuple[int, int]] = []
    for _ in range(40):  # churn both alike: holes of mixed sizes
        size = rng.choice((A, A, 2 * A))
        got = one.take(size)
        assert got == other.take(size)
        if got is not None:
            held.append((got, size))
        if held and rng.random() < 0.5:
            offset, freed = held.pop(rng.randrange(len(held)))
            one.free(offset, freed)
            other.free(offset, freed)
    count = rng.randrange(1, 40)
    many = one.take_many(A, count)
    singly = [other.take(A) for _ in range(count)]
    assert many == [offset for offset in singly if offset is not None][: len(many)]
    assert len(many) == count or singly[len(many)] is None
    assert one.free_extents() == other.free_extents() and one.used_bytes == other.used_bytes
    for offset in many:
        one.free(offset, A)
        with pytest.raises(ValueError):
            one.free(offset, A)

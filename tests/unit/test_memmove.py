"""``memmove_many``: every copy lands, whatever its size, order or neighbours (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from offloadd.transfer import memmove
from offloadd.transfer.memmove import memmove_many


def _plan(
    rng: np.random.Generator, source: np.ndarray, target: np.ndarray, sizes: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copies of ``sizes`` from random places of ``source`` to disjoint places of ``target``."""
    slot = max(sizes)
    places = rng.permutation(len(target) // slot)[: len(sizes)]
    dsts = places * slot + target.ctypes.data
    srcs = rng.integers(0, len(source) - slot, len(sizes)) + source.ctypes.data
    return srcs.astype(np.uint64), dsts.astype(np.uint64), np.array(sizes, np.uint64)


def _expected(
    source: np.ndarray,
    target: np.ndarray,
    srcs: np.ndarray,
    dsts: np.ndarray,
    sizes: np.ndarray,
    into: np.ndarray | None = None,
) -> np.ndarray:
    """``target`` after the copies (``dsts`` address its buffer), computed with slices on a
    copy of it (or on ``into``, such a copy already)."""
    want = target.copy() if into is None else into
    base = target.ctypes.data
    for src, dst, nbytes in zip(srcs.tolist(), dsts.tolist(), sizes.tolist(), strict=True):
        at, start = dst - base, src - source.ctypes.data
        want[at : at + nbytes] = source[start : start + nbytes]
    return want


@pytest.mark.parametrize(
    "sizes",
    [
        [2048] * 1024,  # a step's loads: one size, many copies (the rows path)
        [4096] * 3,  # too few for rows: one by one
        [512] * 40 + [1536] * 5 + [0] * 9 + [8] * 30,  # several sizes, one group small
        [],
    ],
    ids=["one-size", "few", "mixed", "none"],
)
def test_every_copy_lands(sizes: list[int]) -> None:
    rng = np.random.default_rng(7)
    source = rng.integers(0, 256, 8 << 20, dtype=np.uint8)
    target = np.zeros(8 << 20, np.uint8)
    srcs, dsts, counts = _plan(rng, source, target, sizes or [1])
    srcs, dsts, counts = srcs[: len(sizes)], dsts[: len(sizes)], counts[: len(sizes)]
    want = _expected(source, target, srcs, dsts, counts)
    memmove_many(srcs, dsts, counts)
    assert np.array_equal(target, want)


def test_far_apart_memory_and_a_span_too_large_for_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sources in two separate buffers (the span between them is never read); a span numpy
    could not describe goes one by one, with the same result."""
    rng = np.random.default_rng(8)
    first, second = (rng.integers(0, 256, 1 << 20, dtype=np.uint8) for _ in range(2))
    target = np.zeros(1 << 20, np.uint8)
    a_srcs, dsts, sizes = _plan(rng, first, target, [1024] * 64)
    b_srcs, _, _ = _plan(rng, second, target, [1024] * 64)
    odd = np.arange(64) % 2 == 1
    srcs = np.where(odd, a_srcs, b_srcs).astype(np.uint64)
    want = _expected(first, target, a_srcs[odd], dsts[odd], sizes[odd])
    want = _expected(second, target, b_srcs[~odd], dsts[~odd], sizes[~odd], into=want)
    memmove_many(srcs, dsts, sizes)
    assert np.array_equal(target, want)

    target[:] = 0
    monkeypatch.setattr(memmove, "_MAX_VIEW_BYTES", 1024)  # every view "too large"
    memmove_many(srcs, dsts, sizes)
    assert np.array_equal(target, want)

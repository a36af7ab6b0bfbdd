"""Pure piece planning: any job fits bounded staging, piece by piece."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import ConfigError
from kvpool.transfer import pieces


@given(
    st.lists(st.integers(1, 5000), min_size=0, max_size=60),
    st.integers(1, 20000),
)
def test_cut_covers_every_item_once_in_order_and_respects_the_budget(
    sizes: list[int], budget: int
) -> None:
    spans = pieces.cut(sizes, budget)
    flat = [i for lo, hi in spans for i in range(lo, hi)]
    assert flat == list(range(len(sizes)))
    for lo, hi in spans:
        assert hi > lo
        total = sum(sizes[lo:hi])
        # over budget only when a single item is over it by itself
        assert total <= budget or hi - lo == 1
    for lo, hi in spans[:-1]:
        # a piece is closed only because the next item would not fit in it
        assert sum(sizes[lo:hi]) + sizes[hi] > budget


def test_cut_of_equal_items_makes_equal_pieces() -> None:
    assert pieces.cut([10] * 7, 20) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert pieces.cut([30, 5, 5], 20) == [(0, 1), (1, 3)]
    assert pieces.cut([], 20) == []
    with pytest.raises(ValueError, match="budget"):
        pieces.cut([1], 0)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 500)), max_size=40))
def test_place_keeps_each_group_back_to_back_from_an_aligned_start(
    items: list[tuple[int, int]],
) -> None:
    items.sort(key=lambda x: x[0])
    groups, sizes = [g for g, _ in items], [n for _, n in items]
    offsets, extent = pieces.place(groups, sizes)
    for i, (g, n) in enumerate(items):
        if i == 0 or groups[i - 1] != g:
            assert offsets[i] % pieces.ALIGN == 0
        else:
            assert offsets[i] == offsets[i - 1] + sizes[i - 1]
        assert offsets[i] + n <= extent
    # no two objects overlap
    spans = sorted(zip(offsets, sizes, strict=True))
    for (a, n), (b, _) in itertools.pairwise(spans):
        assert a + n <= b
    assert extent <= sum(sizes) + pieces.ALIGN * len(set(groups))


def test_staging_splits_between_saves_and_staged_loads() -> None:
    assert pieces.split_staging(1 << 20, staged_loads=False) == (1 << 20, 0)
    save, load = pieces.split_staging(1 << 20, staged_loads=True)
    assert save + load == 1 << 20 and load == 1 << 19 and load % pieces.ALIGN == 0


def test_a_piece_budget_lets_two_pieces_fit_and_an_object_must_fit() -> None:
    assert pieces.piece_budget(16 << 20, 256 << 20) == 16 << 20
    assert pieces.piece_budget(16 << 20, 8 << 20, groups=2) == (4 << 20) - 128
    pieces.check_fits(4 << 20, 4 << 20, "saves")
    with pytest.raises(ConfigError, match="raise staging_bytes to at least"):
        pieces.check_fits((4 << 20) + 1, 4 << 20, "saves")


@given(st.integers(0, 1 << 30))
def test_both_halves_of_any_staging_start_aligned(nbytes: int) -> None:
    save, load = pieces.split_staging(nbytes, staged_loads=True)
    assert save % pieces.ALIGN == 0 and load % pieces.ALIGN == 0  # the load half starts at save
    assert save + load <= nbytes and nbytes - (save + load) < 2 * pieces.ALIGN


def test_a_small_load_moves_in_about_load_depth_pieces_a_large_one_at_the_budget() -> None:
    budget, floor, depth = 32 << 20, pieces.MIN_LOAD_PIECE, pieces.LOAD_DEPTH
    assert pieces.job_budget(62 << 20, budget) == -(-(62 << 20) // depth)  # 8 pieces
    assert pieces.job_budget(500 << 20, budget) == budget
    assert pieces.job_budget(10 << 20, budget) == floor  # pieces never below the floor
    assert pieces.job_budget(10 << 20, 1 << 20) == 1 << 20  # nor above the budget
    assert pieces.job_budget(0, budget) == floor
    sizes = [128 << 10] * 496  # the shape, 2,000 tokens
    spans = pieces.cut(sizes, pieces.job_budget(sum(sizes), budget))
    assert len(spans) == depth

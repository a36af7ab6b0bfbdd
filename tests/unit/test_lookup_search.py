"""The prefix search: exact on prefixes, bounded rounds, honest on holes."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.lookup.search import MAX_ROUNDS, find_prefix, plan_rounds


class Pool:
    """Answers probes from a presence list and records every round."""

    def __init__(self, present: Sequence[bool]) -> None:
        self.present = list(present)
        self.rounds: list[list[int]] = []

    def __call__(self, chunks: Sequence[int]) -> list[bool]:
        assert chunks, "a round never probes nothing"
        assert list(chunks) == sorted(set(chunks)), "probes ascend without repeats"
        self.rounds.append(list(chunks))
        return [self.present[i] for i in chunks]

    @property
    def probed(self) -> set[int]:
        return {i for r in self.rounds for i in r}


sizes = st.integers(0, 20000)
widths = st.integers(1, 16)


@given(sizes, widths, st.data())
def test_a_prefix_is_found_exactly_within_the_planned_rounds(
    n: int, per_chunk: int, data: st.DataObject
) -> None:
    prefix = data.draw(st.integers(0, n))
    pool = Pool([True] * prefix + [False] * (n - prefix))
    assert find_prefix(n, per_chunk, pool) == prefix
    rounds, fan = plan_rounds(n, per_chunk)
    assert len(pool.rounds) <= rounds
    assert all(len(r) <= fan + 1 for r in pool.rounds)
    if n:
        assert len(pool.rounds) >= 1


@given(st.lists(st.booleans(), max_size=3000), widths)
def test_on_any_presence_the_answer_is_bounded_by_what_was_probed(
    present: list[bool], per_chunk: int
) -> None:
    pool = Pool(present)
    hit = find_prefix(len(present), per_chunk, pool)
    true_prefix = next((i for i, ok in enumerate(present) if not ok), len(present))
    assert true_prefix <= hit <= len(present)
    assert all(present[i] for i in pool.probed if i < hit)  # no probed hole below it
    if hit < len(present):
        assert hit in pool.probed and not present[hit]  # it stops at an absent probe
    assert len(pool.rounds) <= plan_rounds(len(present), per_chunk)[0]


@pytest.mark.parametrize("n", [1, 2, 17, 64, 2047, 8191, 65535])
@pytest.mark.parametrize("per_chunk", [1, 2, 8, 16])
def test_the_plan_covers_the_window_and_stays_within_max_rounds(n: int, per_chunk: int) -> None:
    rounds, fan = plan_rounds(n, per_chunk)
    assert 1 <= rounds <= MAX_ROUNDS
    assert fan**rounds >= n
    assert rounds == 1 or (fan - 1) ** rounds < n  # the least fan-out for that many rounds


def test_short_prompts_are_probed_whole_and_long_ones_in_few_small_rounds() -> None:
    # A short prompt: one round over every chunk, as exact as a full probe.
    pool = Pool([True] * 30 + [False] + [True] * 9)
    assert find_prefix(40, 1, pool) == 30
    assert pool.rounds == [list(range(40))]
    # 32k tokens in 16-token chunks at TP1: two rounds of at most 47 chunks.
    assert plan_rounds(2047, 1) == (2, 46)
    # The same at TP8 with 8 KV heads (8 keys per chunk): three rounds of 14.
    assert plan_rounds(2047, 8) == (3, 13)
    # A full hit and a miss at chunk 0 end after the first round.
    for present in ([True] * 2047, [False] * 2047):
        pool = Pool(present)
        assert find_prefix(2047, 1, pool) == (2047 if present[0] else 0)
        assert len(pool.rounds) == 1


def test_a_probe_that_miscounts_is_an_error() -> None:
    with pytest.raises(ValueError, match="answered"):
        find_prefix(10, 1, lambda chunks: [True])
    with pytest.raises(ValueError, match="bad search shape"):
        plan_rounds(10, 0)


@given(st.lists(st.booleans(), max_size=3000), widths)
def test_exact_search_is_one_round_over_every_chunk_and_the_true_prefix(
    present: list[bool], per_chunk: int
) -> None:
    pool = Pool(present)
    true_prefix = next((i for i, ok in enumerate(present) if not ok), len(present))
    assert find_prefix(len(present), per_chunk, pool, exact=True) == true_prefix
    assert pool.rounds == ([list(range(len(present)))] if present else [])

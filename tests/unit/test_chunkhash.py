"""kvpool's chunk hash chain: prefix-determined, sensitive to every token and
extra, incremental, and safe on what it cannot encode."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.chunkhash import ROOT, ChunkChain, encode_extra, link

pytestmark = pytest.mark.unit

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=80)


@settings(max_examples=200, deadline=None)
@given(tokens_st, st.integers(1, 9), st.lists(st.integers(0, 80), max_size=5))
def test_growing_a_request_gives_the_hashes_of_hashing_it_whole(
    tokens: list[int], c: int, cuts: list[int]
) -> None:
    whole = list(ChunkChain(c).advance(tokens, len(tokens)))
    assert len(whole) == len(tokens) // c
    chain = ChunkChain(c)
    for n in [*sorted(cuts), len(tokens)]:
        got = chain.advance(tokens, min(n, len(tokens)))
        assert got == whole[: len(got)] and len(got) == min(n, len(tokens)) // c


@settings(max_examples=200, deadline=None)
@given(tokens_st, st.integers(1, 9), st.data())
def test_a_chunk_hash_names_exactly_its_prefix(tokens: list[int], c: int, data: Any) -> None:
    """Changing token i keeps every chunk before i and changes every chunk after."""
    if not tokens:
        return
    i = data.draw(st.integers(0, len(tokens) - 1))
    other = list(tokens)
    other[i] = (other[i] + 1) % 2**32
    a = ChunkChain(c).advance(tokens, len(tokens))
    b = ChunkChain(c).advance(other, len(other))
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        assert (x == y) == ((k + 1) * c <= i)


def test_extras_are_hashed_per_chunk_and_none_means_no_extras() -> None:
    tokens = list(range(12))
    plain = ChunkChain(4).advance(tokens, 12)
    assert ChunkChain(4).advance(tokens, 12, lambda a, b: None) == plain
    salted = ChunkChain(4).advance(tokens, 12, lambda a, b: ("cache_salt", "s") if a == 0 else None)
    assert all(x != y for x, y in zip(plain, salted, strict=True))  # the chain carries it on
    mm = ChunkChain(4).advance(tokens, 12, lambda a, b: (("mm", "img", 1),) if a == 4 else None)
    assert mm[0] == plain[0] and mm[1] != plain[1] and mm[2] != plain[2]


@pytest.mark.parametrize(
    ("x", "y"),
    [
        (("ab", "c"), ("a", "bc")),
        (1, "1"),
        ("1", b"1"),
        (True, 1),
        (None, ""),
        ((), None),
        ((("a",),), ("a",)),
        ([1, 2], [12]),
        (-1, 1),
    ],
)
def test_distinct_extras_encode_apart(x: Any, y: Any) -> None:
    assert encode_extra(x) != encode_extra(y)


def test_the_link_encodes_lengths_so_tokens_and_extras_never_run_together() -> None:
    assert link(ROOT, [1, 2], b"") != link(ROOT, [1], b"\x02\x00\x00\x00")
    assert link(ROOT, [], b"") != link(ROOT, [0], b"")


@pytest.mark.parametrize("bad_extra", [1.5, object(), {"a": 1}])
def test_an_extra_it_cannot_encode_stops_the_chain_without_raising(bad_extra: Any) -> None:
    chain = ChunkChain(2)
    got = chain.advance(list(range(8)), 8, lambda a, b: bad_extra if a == 4 else None)
    assert len(got) == 2 and chain.broken and "cannot hash" in chain.broken
    assert len(chain.advance(list(range(10)), 10)) == 2  # and stays stopped


@pytest.mark.parametrize("bad_token", [-1, 2**32])
def test_a_token_id_outside_uint32_stops_the_chain(bad_token: int) -> None:
    chain = ChunkChain(2)
    assert chain.advance([1, 2, 3, bad_token], 4) == chain.hashes and len(chain.hashes) == 1
    assert chain.broken


def test_a_chunk_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkChain(0)

"""``kvpool.chunks``: one chunk's objects, what a hit needs of them, where it may end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.unit.test_layout_properties import layout_args, make_layout, space_for

from kvpool.chunks import ChunkObjects, countable_chunks
from kvpool.groups import GroupKind
from kvpool.plan import chunk_hashes, probe_keys


@settings(max_examples=200, deadline=None)
@given(layout_args(), st.integers(1, 4))
def test_a_chunks_objects_are_the_keys_every_rank_reads(args: dict[str, object], n: int) -> None:
    layout = make_layout(args)
    space = space_for(layout)
    objects = ChunkObjects.of(layout, space)
    hashes = chunk_hashes(n)
    for h in hashes:
        assert objects.keys(h) == tuple(space.key(c, h) for c in objects.contents)
    assert probe_keys(layout, space, hashes) == [objects.keys(h) for h in hashes]
    read = {c for r in range(layout.world_size) for g in range(len(layout.groups))
            for c in layout.holdings(r, g)}  # fmt: skip
    assert set(objects.contents) == read
    # Every template has one role: every chunk, a window, or the last chunk's state.
    full, states = set(objects.full), set(objects.states)
    windowed = {t for t, _ in objects.windowed}
    assert full | windowed | states == set(objects.templates)
    assert not (full & windowed) and not (full & states) and not (windowed & states)
    assert sorted(t for ts in objects.classes for t in ts) == sorted(full)
    for t, spec in zip(objects.templates, objects.specs, strict=True):
        assert (t in states) == (spec.kind is GroupKind.MAMBA)


@pytest.mark.parametrize(
    ("num_tokens", "chunks", "expected"),
    [
        (0, 0, 0),
        (1, 1, 0),  # one token: nothing to load, vLLM computes it
        (32, 1, 0),  # a whole chunk, but its last token must be computed
        (33, 1, 1),
        (65, 2, 2),
        (65, 1, 1),  # only hashed chunks count
        (1000, 31, 31),
        (1000, 40, 31),
    ],
)
def test_a_hit_spans_whole_chunks_and_never_the_last_token(
    num_tokens: int, chunks: int, expected: int
) -> None:
    assert countable_chunks(num_tokens, 32, chunks) == expected

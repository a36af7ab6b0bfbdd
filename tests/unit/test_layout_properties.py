"""Property tests: for every valid layout, who writes and who reads agree.

The invariants are checked over the whole plan (``kvpool.plan.build_plan``) of
random layouts: tp <= 16, pp <= 4, pcp <= 2, dcp | tp, kv_heads in
{1, 2, 4, 8, 16, 32}, 1-3 groups of mixed kinds. Byte identity is checked
against an independent model of what each rank physically holds.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpool.errors import LayoutError
from kvpool.keys import KeySpace
from kvpool.layout import GroupKind, GroupSpec, Layout
from kvpool.plan import build_plan

KV_HEADS = [1, 2, 4, 8, 16, 32]


@st.composite
def group_specs(draw: st.DrawFn) -> GroupSpec:
    kind = draw(st.sampled_from(list(GroupKind)))
    # Sliding windows (hybrid models) on any attention kind: who holds and who
    # writes what must not depend on them.
    window = 0 if kind is GroupKind.MAMBA else draw(st.sampled_from([0, 0, 1, 64, 4096]))
    if kind in (GroupKind.GQA, GroupKind.MHA):
        return GroupSpec(kind, draw(st.sampled_from(KV_HEADS)), window)
    return GroupSpec(kind, 0, window)


@st.composite
def layout_args(draw: st.DrawFn) -> dict[str, object]:
    tp = draw(st.integers(1, 16))
    dcp = draw(st.sampled_from([d for d in range(1, tp + 1) if tp % d == 0]))
    return {
        "tp": tp,
        "pp": draw(st.integers(1, 4)),
        "pcp": draw(st.integers(1, 2)),
        "dcp": dcp,
        "groups": draw(st.lists(group_specs(), min_size=1, max_size=3)),
        "dp_index": draw(st.integers(0, 7)),
    }


def is_valid(args: dict[str, object]) -> bool:
    """Independent statement of the validity rules."""
    tp, dcp = args["tp"], args["dcp"]
    assert isinstance(tp, int) and isinstance(dcp, int)
    for g in args["groups"]:  # type: ignore[attr-defined]
        if g.kind is GroupKind.MAMBA:
            continue
        if g.kind is GroupKind.MLA:
            share = tp
        else:
            if g.kv_heads % tp and tp % g.kv_heads:
                return False
            share = max(1, tp // g.kv_heads)
        if share % dcp:
            return False
    return True


def make_layout(args: dict[str, object]) -> Layout:
    try:
        layout = Layout.create(**args)  # type: ignore[arg-type]
    except LayoutError:
        assert not is_valid(args), f"valid layout refused: {args}"
        assume(False)
        raise
    assert is_valid(args), f"invalid layout accepted: {args}"
    return layout


def space_for(layout: Layout, **overrides: object) -> KeySpace:
    fields: dict[str, object] = {
        "model": "org/model",
        "layout": layout,
        "kv_dtype": "bfloat16",
        "model_dtype": "bfloat16",
        "chunk_size": 32,
        "head_size": 128,
        "num_layers": 4,
    }
    fields.update(overrides)
    return KeySpace.create(**fields)  # type: ignore[arg-type]


def physical_content(layout: Layout, rank: int, group: int) -> tuple[object, ...]:
    """What a rank holds, from first principles (not via ContentId):
    the set of KV heads (or latent / state shard), the token shard and the layers."""
    c = layout.coord(rank)
    spec = layout.groups[group]
    tp = layout.tp
    if spec.kind is GroupKind.MLA:
        heads: frozenset[object] = frozenset({"latent"})
    elif spec.kind is GroupKind.MAMBA:
        heads = frozenset({("state-shard", c.tp_rank)})
    elif spec.kv_heads >= tp:
        per = spec.kv_heads // tp
        heads = frozenset(range(c.tp_rank * per, (c.tp_rank + 1) * per))
    else:
        heads = frozenset({c.tp_rank * spec.kv_heads // tp})
    # Token shards: DCP splits tokens among ranks that share heads, PCP splits
    # them again. Mamba state is never treated as shared between ranks.
    tokens = (c.dcp_rank, c.pcp_rank)
    return (group, heads, tokens, ("layers of stage", c.pp_rank))


@settings(max_examples=300, deadline=None)
@given(layout_args(), st.integers(1, 10), st.integers(0, 50))
def test_every_get_is_put_by_exactly_one_rank_with_same_content(
    args: dict[str, object], chunks: int, _offset: int
) -> None:
    layout = make_layout(args)
    plan = build_plan(layout, space_for(layout), chunks)

    writers: dict[str, list[int]] = defaultdict(list)
    for p in plan.puts:
        writers[p.key].append(p.rank)
    # Each key written by exactly one rank.
    assert all(len(rs) == 1 for rs in writers.values()), "a key has several writers"
    for g in plan.gets:
        assert g.key in writers, f"rank {g.rank} reads {g.key} that nobody writes"
        w = writers[g.key][0]
        assert layout.content(w, g.group) == layout.content(g.rank, g.group)
        # ... and the writer physically holds the same bytes as the reader.
        assert physical_content(layout, w, g.group) == physical_content(layout, g.rank, g.group)

    # Write amplification exactly 1.0: puts per chunk == distinct contents.
    distinct = sum(len(layout.contents(g)) for g in range(len(layout.groups)))
    per_chunk = Counter(p.chunk for p in plan.puts)
    assert set(per_chunk.values()) == {distinct}
    assert plan.totals.write_amplification == 1.0

    # Lookup probes exactly the keys read, and all of them are written.
    lookup = {p.key for p in plan.lookup_keys}
    assert lookup == {g.key for g in plan.gets} == set(writers)
    assert len(lookup) == len(plan.lookup_keys)


@settings(max_examples=200, deadline=None)
@given(layout_args())
def test_content_id_equality_is_physical_identity(args: dict[str, object]) -> None:
    layout = make_layout(args)
    for g in range(len(layout.groups)):
        for a in layout.ranks:
            for b in layout.ranks:
                same_id = layout.content(a, g) == layout.content(b, g)
                same_bytes = physical_content(layout, a, g) == physical_content(layout, b, g)
                assert same_id == same_bytes, (a, b, g)


@settings(max_examples=200, deadline=None)
@given(layout_args(), st.integers(0, 1000), st.integers(1, 40))
def test_writer_depends_only_on_absolute_chunk_index(
    args: dict[str, object], start: int, n: int
) -> None:
    """A delta save of chunks start..start+n agrees with a full save of 0..start+n."""
    layout = make_layout(args)
    for g in range(len(layout.groups)):
        for r in layout.ranks:
            full = layout.chunks_written(r, g, range(start + n))
            delta = layout.chunks_written(r, g, range(start, start + n))
            assert delta == [k for k in full if k >= start]
            assert all(layout.writes(r, g, k) for k in delta)


@settings(max_examples=200, deadline=None)
@given(layout_args())
def test_striping_spreads_writes_evenly(args: dict[str, object]) -> None:
    """Inside a replica set of size f, each member writes 1/f of the chunks."""
    layout = make_layout(args)
    for g in range(len(layout.groups)):
        for c in layout.contents(g):
            members = layout.replica_set(c)
            f = len(members)
            counts = Counter(layout.writer(c, k) for k in range(4 * f))
            assert counts == Counter({m: 4 for m in members})


@settings(max_examples=100, deadline=None)
@given(layout_args(), st.integers(1, 6))
def test_different_contents_and_configs_never_share_a_key(
    args: dict[str, object], chunks: int
) -> None:
    layout = make_layout(args)
    base = build_plan(layout, space_for(layout), chunks)
    by_key: dict[str, tuple[object, ...]] = {}
    for p in base.puts:
        ident = (layout.content(p.rank, p.group), p.chunk)
        assert by_key.setdefault(p.key, ident) == ident
    for change in (
        {"kv_dtype": "float32"},
        {"model_dtype": "float16"},
        {"chunk_size": 64},
        {"head_size": 64},
        {"num_layers": 5},
        {"hash_seed": "1"},
        {"hash_algo": "xxhash"},
        {"model": "org2/model"},
    ):
        other = build_plan(layout, space_for(layout, **change), chunks)
        assert not {p.key for p in other.puts} & set(by_key), change

"""Property tests: for every valid layout, who writes and who reads agree, and
for every pair of layouts of one model at different TP, PP, DCP and PCP sizes too.

The invariants are checked over the whole plan (``kvpool.plan.build_plan``) of
random layouts: tp <= 16, pp <= 4 with random (uneven) stage splits of up to 12
layers and random layer-band grids, pcp <= 2, dcp | tp, kv_heads in
{1, 2, 4, 8, 16, 32}, 1-3 groups of mixed kinds. Byte identity is checked
against an independent model of what each rank physically holds per local KV
head and layer (``physical_heads``).
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpool.errors import LayoutError
from kvpool.keys import KeySpace
from kvpool.layout import ContentId, GroupKind, GroupSpec, Layout
from kvpool.plan import build_plan, chunk_hashes

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
def stage_split(draw: st.DrawFn, layers: int, pp: int) -> list[tuple[int, int]]:
    """Any split of ``layers`` into ``pp`` non-empty stages (vLLM's may be uneven)."""
    if pp == 1:
        return [(0, layers)]
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1)))
    return list(itertools.pairwise([0, *cuts, layers]))


@st.composite
def layout_args(draw: st.DrawFn) -> dict[str, object]:
    tp = draw(st.integers(1, 16))
    dcp = draw(st.sampled_from([d for d in range(1, tp + 1) if tp % d == 0]))
    pp = draw(st.integers(1, 4))
    layers = draw(st.integers(pp, 12))
    bands = draw(st.one_of(st.none(), st.sets(st.integers(0, layers - 1)).map(sorted)))
    return {
        "tp": tp,
        "pp": pp,
        "pcp": draw(st.integers(1, 2)),
        "dcp": dcp,
        "groups": draw(st.lists(group_specs(), min_size=1, max_size=3)),
        "dp_index": draw(st.integers(0, 7)),
        "layers": layers,
        "stages": draw(stage_split(layers, pp)),
        "layer_bands": bands,
        "heads_per_object": draw(st.sampled_from([1, 1, 2, 4])),
        "token_classes": dcp * draw(st.sampled_from([1, 1, 2, 4])),
        "interleave": draw(st.sampled_from([1, 1, 2, 16])),
    }


def is_valid(args: dict[str, object]) -> bool:
    """Independent statement of the validity rules."""
    tp, dcp = args["tp"], args["dcp"]
    assert isinstance(tp, int) and isinstance(dcp, int)
    bands: Any = args.get("layer_bands")
    stages: Any = args.get("stages")
    if bands is not None and any(first not in {0, *bands} for first, _ in stages):
        return False  # a stage must begin on a band edge
    per: Any = args.get("heads_per_object", 1)
    for g in args["groups"]:  # type: ignore[attr-defined]
        if g.kind is GroupKind.MAMBA:
            continue
        if g.kind is GroupKind.MLA:
            share = tp
        else:
            if g.kv_heads % tp and tp % g.kv_heads:
                return False
            if (g.kv_heads // tp if g.kv_heads >= tp else 1) % per:
                return False  # a rank must hold whole groups of heads
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
        "num_layers": layout.layers,
    }
    fields.update(overrides)
    return KeySpace.create(**fields)  # type: ignore[arg-type]


def physical_heads(layout: Layout, rank: int, group: int) -> list[object]:
    """What a rank holds of a group, per local KV head in its tensor's order, from
    first principles (vLLM's sharding of KV heads; not via ContentId): the global
    KV head, the latent, or a TP-sized state slice, with the token shard, and per
    head the layers of its stage cut at every band edge of the grid."""
    c = layout.coord(rank)
    spec = layout.groups[group]
    tp = layout.tp
    heads: list[object]
    if spec.kind is GroupKind.MLA:
        heads = ["latent"]
    elif spec.kind is GroupKind.MAMBA:
        heads = [("state-slice", c.tp_rank, tp)]
    elif spec.kv_heads >= tp:
        per = spec.kv_heads // tp
        heads = list(range(c.tp_rank * per, (c.tp_rank + 1) * per))
    else:
        heads = [c.tp_rank * spec.kv_heads // tp]
    if spec.kind in (GroupKind.GQA, GroupKind.MHA):  # heads_per_object runs of heads
        per = layout.heads_per_object
        heads = [tuple(heads[i : i + per]) for i in range(0, len(heads), per)]
    first, end = layout.stages[c.pp_rank]
    cuts = [first, *(e for e in layout.bands if first < e < end), end]
    pieces = [tuple(range(a, b)) for a, b in itertools.pairwise(cuts)]
    return [
        (group, h, tokens, layers) for h in heads for layers in pieces for tokens in
        token_shards(layout, c.dcp_rank, c.pcp_rank, spec.kind is GroupKind.MAMBA)
    ]  # fmt: skip


def token_shards(layout: Layout, dcp_rank: int, pcp_rank: int, state: bool) -> list[object]:
    """The tokens of one block-table entry (2*T*I of them, virtual offsets) a DCP
    rank holds, by vLLM's placement (offset o on DCP rank (o // I) % dcp), split
    into the pool's token classes ((o // I) % T), in class order. PCP ranks hold
    the same tokens (vLLM's PCP ranks gather each other's KV: replicas). A mamba
    state is not split: one shard per DCP and PCP rank, named by both sizes."""
    if state:
        return [("state", dcp_rank, layout.dcp, pcp_rank, layout.pcp)]
    d, n, step = layout.dcp, layout.token_classes, layout.interleave
    mine = [o for o in range(2 * n * step) if (o // step) % d == dcp_rank]
    return [
        tuple(o for o in mine if (o // step) % n == cls)
        for cls in range(n)
        if any((o // step) % n == cls for o in mine)
    ]


def object_contents(layout: Layout, space: KeySpace, chunks: int) -> dict[tuple[int, str], object]:
    """(rank, key) -> the physical content behind it, for every key each rank reads:
    the rank's i-th shard of a group is its i-th local KV head."""
    out: dict[tuple[int, str], object] = {}
    hashes = chunk_hashes(chunks)
    for r in layout.ranks:
        for g in range(len(layout.groups)):
            shards = layout.holdings(r, g)
            phys = physical_heads(layout, r, g)
            assert len(shards) == len(phys), (r, g)
            for shard, what in zip(shards, phys, strict=True):
                for h in hashes:
                    out[(r, space.key(shard, h))] = what
    return out


@settings(max_examples=300, deadline=None)
@given(layout_args(), st.integers(1, 10), st.integers(0, 50))
def test_every_get_is_put_by_exactly_one_rank_with_same_content(
    args: dict[str, object], chunks: int, _offset: int
) -> None:
    layout = make_layout(args)
    space = space_for(layout)
    plan = build_plan(layout, space, chunks)
    holds = object_contents(layout, space, chunks)

    writers: dict[str, list[int]] = defaultdict(list)
    for p in plan.puts:
        writers[p.key].append(p.rank)
    # Each key written by exactly one rank.
    assert all(len(rs) == 1 for rs in writers.values()), "a key has several writers"
    for g in plan.gets:
        assert g.key in writers, f"rank {g.rank} reads {g.key} that nobody writes"
        # ... and the writer physically holds the bytes the reader expects there.
        assert holds[(writers[g.key][0], g.key)] == holds[(g.rank, g.key)]

    # Write amplification exactly 1.0: puts per chunk == distinct shards.
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
        ids: dict[ContentId, object] = {}
        for r in layout.ranks:
            for shard, what in zip(
                layout.holdings(r, g), physical_heads(layout, r, g), strict=True
            ):
                assert ids.setdefault(shard, what) == what, (r, g, shard)
        # ... and distinct shards are distinct contents.
        assert len(set(ids.values())) == len(ids) == len(layout.contents(g))


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[dict[str, object], dict[str, object]]:
    """A writer and a reader layout of one model: equal groups, any two PCP sizes,
    any two DCP sizes on one token grid, any two TP sizes that both fit the model, any
    two PP sizes and stage splits, and
    one layer-band grid that both can use (every stage of either begins on an
    edge, plus random further edges)."""
    args = draw(layout_args())
    classes, layers = args["token_classes"], args["layers"]
    assert isinstance(classes, int) and isinstance(layers, int)
    pp = draw(st.integers(1, min(4, layers)))
    # Another DCP size on the same token grid (a divisor of token_classes).
    dcp = draw(st.sampled_from([d for d in range(1, min(classes, 16) + 1) if classes % d == 0]))
    other = dict(args, dcp=dcp, tp=draw(st.sampled_from([t for t in range(1, 17) if t % dcp == 0])))
    other["pcp"] = draw(st.integers(1, 2))
    other.update(pp=pp, stages=draw(stage_split(layers, pp)), dp_index=draw(st.integers(0, 7)))
    extra = draw(st.sets(st.integers(0, layers - 1), max_size=3))
    starts = {first for a in (args, other) for first, _ in a["stages"]}  # type: ignore[attr-defined]
    grid = sorted(starts | extra)
    args, other = dict(args, layer_bands=grid), dict(other, layer_bands=grid)
    return (args, other) if draw(st.booleans()) else (other, args)


@settings(max_examples=300, deadline=None)
@given(layout_pairs(), st.integers(1, 6))
def test_a_reader_at_other_tp_pp_dcp_pcp_sizes_finds_every_byte_written_once_and_never_another(
    pair: tuple[dict[str, object], dict[str, object]], chunks: int
) -> None:
    """For a writer layout W and a reader layout R of the same model (TP, PP, DCP
    and PCP sizes differ; one layer-band grid, one token grid):
    every object R reads was written by exactly one rank of W, which physically
    held the bytes R expects under that key; no key of W or R ever names two
    contents. A model with a mamba group shares nothing across TP, DCP or PCP sizes."""
    w_layout, r_layout = make_layout(pair[0]), make_layout(pair[1])
    w_space, r_space = space_for(w_layout), space_for(r_layout)
    w_plan = build_plan(w_layout, w_space, chunks)
    w_holds = object_contents(w_layout, w_space, chunks)
    r_holds = object_contents(r_layout, r_space, chunks)
    writers: dict[str, list[int]] = defaultdict(list)
    for p in w_plan.puts:
        writers[p.key].append(p.rank)
    content: dict[str, object] = {}
    for (_, key), what in [*w_holds.items(), *r_holds.items()]:
        assert content.setdefault(key, what) == what, f"{key} names two contents"
    mamba = any(g.kind is GroupKind.MAMBA for g in w_layout.groups)
    read = {key for _, key in r_holds}
    if mamba and (w_layout.tp, w_layout.dcp, w_layout.pcp) != (
        r_layout.tp,
        r_layout.dcp,
        r_layout.pcp,
    ):
        assert not read & set(writers)  # another fingerprint: misses, never wrong bytes
        return
    assert w_space == r_space
    for (r, key), what in r_holds.items():
        assert len(writers[key]) == 1, f"reader rank {r}: {key} written {len(writers[key])}x"
        assert w_holds[(writers[key][0], key)] == what
    # Objects a reader rank reads per chunk: exactly its own shards.
    per_rank = Counter(r for r, _ in r_holds)
    for r in r_layout.ranks:
        want = sum(len(r_layout.holdings(r, g)) for g in range(len(r_layout.groups)))
        assert per_rank[r] == want * chunks


@settings(max_examples=200, deadline=None)
@given(layout_args(), st.integers(0, 1000), st.integers(1, 40))
def test_writer_depends_only_on_absolute_chunk_index(
    args: dict[str, object], start: int, n: int
) -> None:
    """A delta save of chunks start..start+n agrees with a full save of 0..start+n."""
    layout = make_layout(args)
    for g in range(len(layout.groups)):
        for r in layout.ranks:
            for c in layout.holdings(r, g):
                full = layout.chunks_written(r, c, range(start + n))
                delta = layout.chunks_written(r, c, range(start, start + n))
                assert delta == [k for k in full if k >= start]
                assert all(layout.writes(r, c, k) for k in delta)


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
    holds = object_contents(layout, space_for(layout), chunks)
    by_key: dict[str, tuple[object, ...]] = {}
    for p in base.puts:
        ident = (holds[(p.rank, p.key)], p.chunk)
        assert by_key.setdefault(p.key, ident) == ident
    for change in (
        {"kv_dtype": "float32"},
        {"model_dtype": "float16"},
        {"chunk_size": 64},
        {"head_size": 64},
        {"num_layers": layout.layers + 1},
        {"model": "org2/model"},
    ):
        other = build_plan(layout, space_for(layout, **change), chunks)
        assert not {p.key for p in other.puts} & set(by_key), change
    # Another layer-band grid holds other layers under a band index: other keys.
    free = sorted(set(range(1, layout.layers)) - set(layout.bands))
    if free:
        finer = Layout.create(**dict(args, layer_bands=[*layout.bands[:-1], free[0]]))  # type: ignore[arg-type]
        other = build_plan(finer, space_for(finer), chunks)
        assert not {p.key for p in other.puts} & set(by_key), finer.bands

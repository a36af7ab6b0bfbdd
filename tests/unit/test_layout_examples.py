"""Worked layouts from the issue and the seeds, and refusals of invalid ones."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from tests.factories import key_space

from kvpool.errors import LayoutError
from kvpool.keys import KeySpace, dp_index_of, lookup_endpoint
from kvpool.layout import GroupKind, GroupSpec, Layout, RankCoords
from kvpool.plan import build_plan, reference_totals


def space(layout: Layout) -> KeySpace:
    return key_space(layout, "org/m", dtype="bf16")


def objects_per_chunk(layout: Layout, chunks: int = 8) -> int:
    plan = build_plan(layout, space(layout), chunks)
    assert len(plan.puts) % chunks == 0
    return len(plan.puts) // chunks


@pytest.mark.parametrize("group", ["gqa:1", "mla"])
def test_tp4_single_kv_head_one_object_per_chunk_each_rank_writes_a_quarter(group: str) -> None:
    layout = Layout.create(tp=4, groups=[group])
    assert objects_per_chunk(layout) == 1
    for r in layout.ranks:
        (shard,) = layout.holdings(r, 0)
        assert layout.chunks_written(r, shard, range(16)) == [k for k in range(16) if k % 4 == r]


def test_tp4_dcp4_mla_four_objects_each_rank_writes_its_own() -> None:
    layout = Layout.create(tp=4, dcp=4, groups=["mla"])
    assert objects_per_chunk(layout) == 4
    for r in layout.ranks:
        (shard,) = layout.holdings(r, 0)
        assert layout.replica_set(shard) == (r,)
        assert layout.chunks_written(r, shard, range(8)) == list(range(8))


def test_tp8_dcp2_mla_two_objects_striped_four_ways() -> None:
    layout = Layout.create(tp=8, dcp=2, groups=["mla"])
    assert objects_per_chunk(layout) == 2
    assert [layout.replica_set(c) for c in layout.contents(0)] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    for r in layout.ranks:
        assert len(layout.chunks_written(r, layout.holdings(r, 0)[0], range(16))) == 4
    ref = reference_totals(layout)
    assert (ref.objects_per_chunk, ref.write_amplification) == (8, 4.0)


def test_mamba_is_never_deduplicated() -> None:
    layout = Layout.create(tp=4, groups=["gqa:1", "mla", "mamba"])
    assert [len(layout.replica_set(layout.holdings(0, g)[0])) for g in range(3)] == [4, 4, 1]
    assert objects_per_chunk(layout) == 1 + 1 + 4


def test_a_rank_holds_one_shard_per_kv_head_named_by_its_global_index() -> None:
    """GQA with 8 KV heads: TP1 holds all eight, TP2 rank 1 holds heads 4-7, TP16
    ranks 2 and 3 both hold head 1 (replicated) and take turns writing it."""

    def heads(layout: Layout, r: int) -> list[int]:
        return [c.head for c in layout.holdings(r, 0)]

    assert heads(Layout.create(tp=1, groups=["gqa:8"]), 0) == list(range(8))
    assert heads(Layout.create(tp=2, groups=["gqa:8"]), 1) == [4, 5, 6, 7]
    tp16 = Layout.create(tp=16, groups=["gqa:8"])
    assert heads(tp16, 2) == heads(tp16, 3) == [1]
    assert [tp16.writer(tp16.holdings(2, 0)[0], k) for k in range(4)] == [2, 3, 2, 3]
    assert objects_per_chunk(Layout.create(tp=1, groups=["gqa:8"])) == 8
    assert objects_per_chunk(tp16) == 8


def test_tp_sizes_of_one_model_share_keys_and_other_sizes_do_not() -> None:
    """The fingerprint leaves tp out (shards are named by head) and pcp (PCP ranks
    are replicas), keeps the layer bands (by default one per PP stage) and the token
    grid (by default one class per DCP rank), and keeps tp for a model with a mamba
    group (state slices depend on tp)."""
    one, two = Layout.create(tp=1, groups=["gqa:8"]), Layout.create(tp=2, groups=["gqa:8"])
    assert space(one) == space(two)
    assert space(one).key(one.holdings(0, 0)[5], b"x") == space(two).key(
        two.holdings(1, 0)[1], b"x"
    )
    assert space(Layout.create(tp=1, pp=2, groups=["gqa:8"])) != space(one)
    pcp2 = Layout.create(tp=1, pcp=2, groups=["gqa:8"])
    assert space(pcp2) == space(one) and pcp2.holdings(1, 0) == one.holdings(0, 0)
    assert pcp2.replica_set(one.holdings(0, 0)[0]) == (0, 1)  # the two PCP ranks
    mla = Layout.create(tp=2, groups=["mla"])
    assert space(Layout.create(tp=2, dcp=2, groups=["mla"])) != space(mla)
    assert space(Layout.create(tp=8, groups=["mla"])) == space(mla)
    m1, m2 = (Layout.create(tp=t, groups=["gqa:8", "mamba"]) for t in (1, 2))
    assert space(m1).fingerprint != space(m2).fingerprint


def test_groups_rotate_their_writer_phase() -> None:
    layout = Layout.create(tp=4, groups=["mla", "mla"])
    assert layout.writer(layout.holdings(0, 0)[0], 0) == 0
    assert layout.writer(layout.holdings(0, 1)[0], 0) == 1


@pytest.mark.parametrize("dcp", [1, 4])
def test_seed000_put_striding_covers_every_get_namespace(dcp: int) -> None:
    """Seed 000: TP=4, one KV head, DCP in {1, 4}: every key any rank GETs was PUT."""
    for group in ("gqa:1", "mla"):
        layout = Layout.create(tp=4, dcp=dcp, groups=[group])
        plan = build_plan(layout, space(layout), 12)
        put = {p.key for p in plan.puts}
        assert {g.key for g in plan.gets} <= put
        assert len(put) == len(plan.puts)  # and nothing is written twice


def test_seed001_dp_endpoint_when_rank_local_is_unset() -> None:
    """Seed 001: a headless wide-TP follower has no data_parallel_rank_local."""
    follower = SimpleNamespace(
        data_parallel_index=3, data_parallel_rank_local=None, data_parallel_rank=0
    )
    assert lookup_endpoint("/run", "m", dp_index_of(follower)).endswith("-dp3.sock")


def test_seed001_dp_endpoint_same_on_head_and_follower_of_replica_n() -> None:
    """A replica launched with --data-parallel-rank 2: the head node sees rank_local 0,
    a follower sees none; both must name the same engine."""
    head = SimpleNamespace(data_parallel_index=2, data_parallel_rank_local=0, data_parallel_rank=2)
    follower = SimpleNamespace(
        data_parallel_index=2, data_parallel_rank_local=None, data_parallel_rank=0
    )
    assert lookup_endpoint("/run", "m", dp_index_of(head)) == lookup_endpoint(
        "/run", "m", dp_index_of(follower)
    )
    assert lookup_endpoint("/run", "m", 0) != lookup_endpoint("/run", "m", 1)


def test_dp_index_missing_is_a_clear_error() -> None:
    with pytest.raises(LayoutError, match="data_parallel_index"):
        dp_index_of(SimpleNamespace(data_parallel_rank_local=0))


def test_dp_replicas_share_keys() -> None:
    a, b = (Layout.create(tp=2, groups=["gqa:2"], dp_index=i) for i in (0, 5))
    assert build_plan(a, space(a), 4).puts == build_plan(b, space(b), 4).puts


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 4, "dcp": 3}, "dcp=3 must divide tp=4"),
        ({"tp": 4, "dcp": 2, "groups": ["gqa:8"]}, "lower dcp or raise tp"),
        ({"tp": 4, "dcp": 4, "groups": ["gqa:2"]}, "dcp=4 must divide the 2"),
        ({"tp": 4, "groups": ["gqa:6"]}, "kv_heads=6 and tp=4 must divide one another"),
        ({"tp": 0}, "tp must be a positive integer"),
        ({"groups": []}, "at least one KV group"),
        ({"groups": ["lstm"]}, "unknown KV group kind 'lstm'"),
        ({"groups": ["gqa"]}, "needs its total KV heads"),
        ({"groups": ["mla:4"]}, "takes no head count"),
        ({"dp_index": -1}, "dp_index must be a non-negative integer"),
    ],
)
def test_invalid_layouts_say_what_to_change(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(LayoutError, match=message.replace("(", r"\(")):
        Layout.create(**kwargs)  # type: ignore[arg-type]


def test_default_coordinates_follow_vllm_group_order() -> None:
    layout = Layout.create(tp=2, pcp=2, pp=2, dcp=2, groups=["mla"])
    c = layout.coord(5)  # rank = tp_rank + tp * (pcp_rank + pcp * pp_rank)
    assert (c.tp_rank, c.pcp_rank, c.pp_rank, c.dcp_rank) == (1, 0, 1, 1)


def test_engine_given_coordinates_are_used() -> None:
    # An engine whose DCP ranks run the other way round inside each DCP group.
    coords = [RankCoords(r, r, 0, 0, 1 - r % 2) for r in range(4)]
    layout = Layout.create(tp=4, dcp=2, groups=["mla"], coords=coords)
    assert layout.holdings(0, 0)[0].dcp_rank == 1
    plan = build_plan(layout, space(layout), 4)
    assert {g.key for g in plan.gets} <= {p.key for p in plan.puts}


@pytest.mark.parametrize(
    ("coords", "message"),
    [
        ([RankCoords(0, 0), RankCoords(0, 1)], "ranks 0..1 once each"),
        ([RankCoords(0, 0), RankCoords(1, 0)], r"repeats \(tp, pcp, pp\)"),
        ([RankCoords(0, 0), RankCoords(1, 2)], "tp_rank=2 is outside"),
    ],
)
def test_bad_engine_coordinates_are_refused(coords: list[RankCoords], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        Layout.create(tp=2, groups=["mla"], coords=coords)


def test_coordinates_that_leave_a_token_shard_without_holder_are_refused() -> None:
    # TP=4, GQA 2 heads, DCP=2: ranks 0,1 share head 0; giving both dcp_rank 0
    # leaves head 0's second token shard with no holder.
    coords = [
        RankCoords(0, 0, dcp_rank=0),
        RankCoords(1, 1, dcp_rank=0),
        RankCoords(2, 2, dcp_rank=0),
        RankCoords(3, 3, dcp_rank=1),
    ]
    with pytest.raises(LayoutError, match="DCP groups must be made of TP ranks"):
        Layout.create(tp=4, dcp=2, groups=["gqa:2"], coords=coords)


def test_group_spec_parse_and_format_round_trip() -> None:
    for text in ("mla", "mamba", "gqa:8", "mha:32"):
        assert str(GroupSpec.parse(text)) == text
    assert GroupSpec.parse(" GQA:4 ") == GroupSpec(GroupKind.GQA, 4)


def test_a_sliding_window_group_parses_prints_and_needs_only_its_window() -> None:
    from kvpool.layout import GroupKind, GroupSpec

    g = GroupSpec.parse("gqa:8:w4096")
    assert g == GroupSpec(GroupKind.GQA, 8, 4096) and str(g) == "gqa:8:w4096"
    assert GroupSpec.parse("mla:w128") == GroupSpec(GroupKind.MLA, 0, 128)
    assert str(GroupSpec.parse("gqa:8")) == "gqa:8"
    # 64-token window, 32-token chunks: the last 63 tokens before the hit.
    swa = GroupSpec(GroupKind.GQA, 2, 64)
    assert swa.needed_chunks(9, 32) == range(7, 9)
    assert swa.needed_chunks(1, 32) == range(0, 1)
    assert swa.needed_chunks(0, 32) == range(0)
    assert GroupSpec(GroupKind.GQA, 2).needed_chunks(9, 32) == range(9)
    # A window of one chunk plus a token needs two chunks; of one token, one.
    assert GroupSpec(GroupKind.GQA, 2, 34).needed_chunks(4, 32) == range(2, 4)
    assert GroupSpec(GroupKind.GQA, 2, 1).needed_chunks(4, 32) == range(4, 4)


@pytest.mark.parametrize("text", ["gqa:8:w0", "gqa:8:wx", "mamba:w64", "gqa:w64"])
def test_bad_sliding_windows_say_what_to_write(text: str) -> None:
    from kvpool.layout import GroupSpec

    with pytest.raises(LayoutError):
        GroupSpec.parse(text)


def test_layer_bands_let_pp1_and_pp2_name_the_same_layers_alike() -> None:
    """32 layers in bands 0-15 and 16-31: a PP1 rank holds both bands of each head,
    each PP2 stage one; equal ContentIds hold equal layers."""
    one = Layout.create(tp=1, pp=1, groups=["gqa:2"], layers=32, layer_bands=[0, 16])
    two = Layout.create(tp=1, pp=2, groups=["gqa:2"], layers=32, layer_bands=[16])
    assert one.bands == two.bands == (0, 16, 32)
    assert [(c.head, c.band) for c in one.holdings(0, 0)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(c.head, c.band) for c in two.holdings(1, 0)] == [(0, 1), (1, 1)]
    assert set(one.contents(0)) == set(two.contents(0))
    assert one.band_layers(1) == two.band_layers(1) == range(16, 32)
    assert two.local_heads(1, two.holdings(1, 0)[1]) == range(1, 2)
    # By default each stage is one band: PP1 and PP2 then share nothing.
    assert Layout.create(pp=2, groups=["mla"], layers=32).bands == (0, 16, 32)
    assert Layout.create(pp=1, groups=["mla"], layers=32).bands == (0, 32)
    # vLLM's real (uneven) stages are taken as given.
    odd = Layout.create(pp=2, groups=["mla"], layers=5, stages=[(0, 3), (3, 5)])
    assert odd.bands == (0, 3, 5) and odd.holdings(1, 0)[0].band == 1


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"pp": 2, "layers": 32, "layer_bands": [0, 8]}, "no band beginning at [16]"),
        ({"pp": 2, "layers": 32, "layer_bands": [40]}, "each in 0..31"),
        ({"pp": 2, "layers": 32, "stages": [(0, 16), (17, 32)]}, "contiguous"),
        ({"pp": 2, "layers": 32, "stages": [(0, 16), (16, 30)]}, "not at the model's 32"),
        ({"pp": 4, "layers": 3}, "at least 4 layers"),
    ],
)
def test_bad_stages_and_layer_bands_say_what_to_change(
    kwargs: dict[str, object], says: str
) -> None:
    with pytest.raises(LayoutError, match=re.escape(says)):
        Layout.create(groups=["mla"], **kwargs)  # type: ignore[arg-type]


def test_heads_per_object_groups_a_ranks_kv_heads_into_fewer_objects() -> None:
    """8 KV heads, 4 per object: TP1 holds groups 0 and 1 (heads 0-3, 4-7), each
    TP2 rank one of them; TP4 ranks hold 2 heads each, not a whole group: refused.
    Another grouping is another fingerprint (never the same key for other bytes)."""
    one = Layout.create(tp=1, groups=["gqa:8"], heads_per_object=4)
    two = Layout.create(tp=2, groups=["gqa:8"], heads_per_object=4)
    assert [c.head for c in one.holdings(0, 0)] == [0, 1]
    assert [c.head for c in two.holdings(1, 0)] == [1]
    assert one.local_heads(0, one.holdings(0, 0)[1]) == range(4, 8)
    assert two.local_heads(1, two.holdings(1, 0)[0]) == range(0, 4)
    assert set(one.contents(0)) == set(two.contents(0))
    with pytest.raises(LayoutError, match=re.escape("choose heads_per_object among [1, 2]")):
        Layout.create(tp=4, groups=["gqa:8"], heads_per_object=4)
    # MLA has one latent: the setting does not apply to it.
    assert Layout.create(tp=2, groups=["mla"], heads_per_object=4).holdings(0, 0)[0].head == 0
    fields = {"model": "m", "kv_dtype": "bfloat16", "model_dtype": "bfloat16",
              "chunk_size": 32, "head_size": 128, "num_layers": 1}  # fmt: skip
    plain = Layout.create(tp=1, groups=["gqa:8"])
    assert KeySpace.create(layout=one, **fields) != KeySpace.create(layout=plain, **fields)  # type: ignore[arg-type]

"""Parallel layout of one engine, and who writes and reads each KV chunk.

This module is the single source of truth for naming KV content across ranks.
Everything that stores, loads or looks up KV asks it; nothing re-derives it.

    Layout.create(...)        validate and normalise a layout (raises LayoutError
                              with the field to change)
    Layout.holdings(r, g)     the shards (ContentIds) rank r holds of KV group g:
                              per local KV head (or run of heads), per layer
                              band, per token class
    Layout.replica_set(c)     ranks holding shard c, byte-identical (sorted)
    Layout.writer(c, k)       the one rank that writes chunk k of shard c
    Layout.writes(r, c, k)    does rank r write chunk k of shard c?
    Layout.contents(g)        every shard of group g: the keys a lookup must
                              probe, and exactly the ones read
    Layout.band_layers(b)     the model's layers in layer band b
    Layout.local_heads(r, c)  which of rank r's local KV heads shard c holds
    Layout.local_tokens(r, c) which rows of rank r's blocks shard c holds

A shard is named by what it holds, never by who holds it, so engines of one
model at different TP sizes name the same bytes alike and share them
(``ContentId`` = (head, dcp_rank, pcp_rank, band, group)):

* head is the model's (global) KV-head index for gqa/mha: a rank holding
  several KV heads holds one shard per head, in its local head order (vLLM
  gives TP rank r the heads ``[r*H/tp, (r+1)*H/tp)``; with fewer heads than TP
  ranks, head ``tp_rank // (tp // H)``, replicated). With ``heads_per_object``
  G > 1 a shard holds G consecutive heads and ``head`` is the group's index
  (KV head // G): fewer, larger objects, for engines whose ranks each hold
  whole groups (TP <= H / G). G is in the fingerprint. It is ``0`` for mla (one
  latent replicated on every TP rank) and ``tp_rank`` for mamba (a state slice
  whose bytes depend on tp, so it never names the same content across tp).
* band is a layer band: the model's layers are cut into bands at fixed layer
  indices (``layer_bands``; by default where this engine's PP stages begin), and
  a shard holds one band's layers. A rank holds every band of its stage, so
  engines at PP1 and PP2 whose band grids are equal (say bands 0-15 and 16-31
  of 32 layers) name the same bytes alike; a stage must begin on a band edge.
  The grid is in the fingerprint.
* dcp_rank is the token class under DCP: vLLM puts the token at offset o of a
  block-table entry (``block_size * dcp`` tokens) on DCP rank ``(o // I) % dcp``
  (I: the interleave). The pool cuts tokens into ``token_classes`` T classes
  the same way, ``(o // I) % T``, T a multiple of dcp (by default T = dcp): DCP
  rank j holds the classes j, j+dcp, ..., so engines at DCP1 and DCP2 with one
  T name the same tokens alike (``block_size * dcp`` must be a multiple of T*I,
  so a class is the same offsets of every block and of the chunk). T and I are
  in the fingerprint, the DCP size is not.
* pcp_rank is 0 for attention groups: vLLM's PCP ranks hold replicas of the
  KV cache (each gathers the KV its PCP peers computed and writes all of it;
  block tables and slot mappings split tokens by DCP only), so PCP ranks join
  replica sets and engines at any PCP size share. It is the PCP rank only for
  mamba, whose state keeps the PCP size in the fingerprint.
* Ranks holding an equal ContentId hold identical bytes and form its replica
  set. Writes are striped inside it: chunk k of a shard of group g is written
  by member ``(k + g) % f`` of the sorted set (f = its size). The choice depends
  only on the absolute chunk index, so delta saves agree with earlier ones.
* Every rank reads the shards it holds. Every shard has at least one holder,
  so the keys read are exactly the keys written, in every layout and across
  layouts of one model on one grid (layer bands, token classes, heads per
  object), whatever their TP, PP, DCP and PCP sizes.

Default rank coordinates follow vLLM's group construction: TP fastest, then
PCP, then PP (``rank = tp_rank + tp * (pcp_rank + pcp * pp_rank)``) and
``dcp_rank = tp_rank % dcp`` (DCP groups are runs of consecutive TP ranks).
An engine may pass the coordinates it reads from its real groups instead.
Group kinds and their specs live in ``kvpool.groups`` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from kvpool.errors import LayoutError
from kvpool.groups import HEADED, GroupKind, GroupSpec

__all__ = [
    "ContentId",
    "GroupKind",
    "GroupSpec",
    "Layout",
    "RankCoords",
    "even_stages",
]


MAX_RANKS = 4096  # tp * pp * pcp of one engine; far above any real deployment


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Coordinates of one worker rank inside one DP engine."""

    rank: int
    tp_rank: int
    pp_rank: int = 0
    pcp_rank: int = 0
    dcp_rank: int = 0


@dataclass(frozen=True, slots=True, order=True)
class ContentId:
    """One shard of a KV group's chunk; equal ids mean byte-identical KV."""

    head: int
    dcp_rank: int
    pcp_rank: int
    band: int  # index of the layer band (``Layout.band_layers``)
    group: int


def _default_coords(tp: int, pp: int, pcp: int, dcp: int) -> tuple[RankCoords, ...]:
    out = []
    for pp_rank in range(pp):
        for pcp_rank in range(pcp):
            for tp_rank in range(tp):
                rank = tp_rank + tp * (pcp_rank + pcp * pp_rank)
                out.append(RankCoords(rank, tp_rank, pp_rank, pcp_rank, tp_rank % dcp))
    return tuple(out)


def even_stages(layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """Stage k holds layers [k*L//pp, (k+1)*L//pp): an even split. Engines pass
    vLLM's real stages (``get_pp_indices``), which place remainders elsewhere."""
    return tuple((k * layers // pp, (k + 1) * layers // pp) for k in range(pp))


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Layout:
    """An engine's parallel layout and its KV-cache groups. Build with ``create``.

    ``dp_index`` is the engine's global data-parallel index
    (``parallel_config.data_parallel_index``); it names the engine (see
    ``keys.lookup_endpoint``) but never changes what a rank holds: DP replicas
    share every key.

    ``layers`` is the model's layer count, ``stages`` each PP stage's layers
    ``[first, end)`` and ``bands`` the layer-band edges ``(0, ..., layers)``. A
    layout made without ``layers`` counts one layer per stage (a plan's
    abstraction: each stage one band).
    """

    tp: int
    pp: int
    pcp: int
    dcp: int
    groups: tuple[GroupSpec, ...]
    coords: tuple[RankCoords, ...]
    dp_index: int = 0
    layers: int = 1
    stages: tuple[tuple[int, int], ...] = ((0, 1),)
    bands: tuple[int, ...] = (0, 1)
    heads_per_object: int = 1
    token_classes: int = 1
    interleave: int = 1

    @classmethod
    def create(
        cls,
        *,
        tp: int = 1,
        pp: int = 1,
        pcp: int = 1,
        dcp: int = 1,
        groups: Sequence[GroupSpec | str] = ("mla",),
        dp_index: int = 0,
        coords: Iterable[RankCoords] | None = None,
        layers: int | None = None,
        stages: Sequence[tuple[int, int]] | None = None,
        layer_bands: Sequence[int] | None = None,
        heads_per_object: int = 1,
        token_classes: int | None = None,
        interleave: int = 1,
    ) -> Layout:
        """Validate and normalise; raise ``LayoutError`` saying what to change.

        ``layer_bands`` lists the layers where a band begins (0 may be left out);
        by default the first layer of each PP stage. ``stages`` defaults to an
        even split of ``layers`` (which defaults to ``pp``)."""
        tp, pp, pcp, dcp = (
            _positive(n, v) for n, v in (("tp", tp), ("pp", pp), ("pcp", pcp), ("dcp", dcp))
        )
        if isinstance(dp_index, bool) or not isinstance(dp_index, int) or dp_index < 0:
            raise LayoutError(f"dp_index must be a non-negative integer, got {dp_index!r}")
        if tp % dcp:
            raise LayoutError(f"dcp={dcp} must divide tp={tp}; pick dcp among the divisors of tp")
        if tp * pp * pcp > MAX_RANKS:
            raise LayoutError(
                f"tp*pp*pcp = {tp * pp * pcp} ranks in one engine; "
                f"at most {MAX_RANKS} are supported"
            )
        specs = tuple(g if isinstance(g, GroupSpec) else GroupSpec.parse(g) for g in groups)
        if not specs:
            raise LayoutError("a layout needs at least one KV group, e.g. 'gqa:8' or 'mla'")
        per_object = _positive("heads_per_object", heads_per_object)
        classes = dcp if token_classes is None else _positive("token_classes", token_classes)
        if classes % dcp:
            raise LayoutError(
                f"token_classes={classes} must be a multiple of dcp={dcp} (each DCP rank "
                f"holds whole classes); e.g. {dcp * (classes // dcp + 1)}"
            )
        step = _positive("interleave", interleave)
        for i, g in enumerate(specs):
            _check_group(i, g, tp, dcp)
            _check_head_groups(i, g, tp, per_object)
        given = tuple(coords) if coords is not None else _default_coords(tp, pp, pcp, dcp)
        n_layers = pp if layers is None else _positive("layers", layers)
        split = _check_stages(n_layers, pp, stages)
        edges = _check_bands(n_layers, split, layer_bands)
        layout = cls(
            tp, pp, pcp, dcp, specs, tuple(sorted(given, key=lambda c: c.rank)), dp_index,
            n_layers, split, edges, per_object, classes, step,
        )  # fmt: skip
        layout._check_coords()
        return layout

    # -- shape -------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Worker ranks in one DP engine (tp * pcp * pp)."""
        return self.tp * self.pcp * self.pp

    @property
    def ranks(self) -> range:
        return range(self.world_size)

    def coord(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside 0..{self.world_size - 1}")
        return self.coords[rank]

    # -- content identity ----------------------------------------------------

    def holdings(self, rank: int, group: int) -> tuple[ContentId, ...]:
        """The shards rank ``rank`` holds of group ``group`` (also those it reads):
        per local KV head (or run of heads) in its order, per layer band of its
        stage, its token classes."""
        c = self.coord(rank)
        spec = self._group(group)
        bands = self._stage_bands[c.pp_rank]
        # A mamba state is not split into tokens: its one class is the DCP rank.
        classes = (
            (c.dcp_rank,)
            if spec.kind is GroupKind.MAMBA
            else range(c.dcp_rank, self.token_classes, self.dcp)
        )
        pcp_rank = c.pcp_rank if spec.kind is GroupKind.MAMBA else 0  # PCP ranks: replicas
        return tuple(
            ContentId(h, t, pcp_rank, b, group)
            for h in self._shard_heads(spec, c.tp_rank)
            for b in bands
            for t in classes
        )

    def band_layers(self, band: int) -> range:
        """The model's layers (global indices) in layer band ``band``."""
        if not 0 <= band < len(self.bands) - 1:
            raise LayoutError(f"layer band {band} is outside 0..{len(self.bands) - 2}")
        return range(self.bands[band], self.bands[band + 1])

    def local_heads(self, rank: int, content: ContentId) -> range:
        """The indices among rank ``rank``'s local KV heads (its tensors' head axis)
        of the heads that ``content`` holds."""
        c = self.coord(rank)
        spec = self._group(content.group)
        ids = self._shard_heads(spec, c.tp_rank)
        if content.head not in ids:
            raise LayoutError(f"rank {rank} does not hold {content}")
        per = self.heads_per_object if spec.kind in HEADED else 1
        i = ids.index(content.head)
        return range(i * per, (i + 1) * per)

    def local_tokens(self, rank: int, content: ContentId) -> tuple[int, int, int]:
        """Which rows of rank ``rank``'s physical blocks ``content`` holds, as
        ``(n, k, I)``: view a block's token axis as ``[-1, n, I]`` and take index
        ``k`` of the middle axis. ``(1, 0, I)`` is the whole block. A DCP rank j
        holds local row l of virtual offset ``((l // I) * dcp + j) * I + l % I``,
        of class ``((l // I) * dcp + j) % T`` (vLLM's placement)."""
        c = self.coord(rank)
        if self._group(content.group).kind is GroupKind.MAMBA:
            return (1, 0, self.interleave)
        n = self.token_classes // self.dcp
        if content.dcp_rank % self.dcp != c.dcp_rank:
            raise LayoutError(f"rank {rank} does not hold {content}")
        return (n, content.dcp_rank // self.dcp, self.interleave)

    def _shard_heads(self, spec: GroupSpec, tp_rank: int) -> range:
        """The head ids of a TP rank's shards of ``spec``: its KV heads, grouped
        ``heads_per_object`` at a time for mha/gqa."""
        heads = spec.heads(self.tp, tp_rank)
        per = self.heads_per_object
        if per == 1 or spec.kind not in HEADED:
            return heads
        return range(heads.start // per, heads.stop // per)

    def replica_set(self, content: ContentId) -> tuple[int, ...]:
        """Sorted ranks whose content is ``content`` (empty if none holds it)."""
        return self._replica_table.get(content, ())

    def contents(self, group: int) -> tuple[ContentId, ...]:
        """Every distinct content of ``group``, sorted: exactly the namespaces read."""
        self._group(group)
        return tuple(c for c in self._replica_table if c.group == group)

    # -- write plan ------------------------------------------------------------

    def writer(self, content: ContentId, chunk: int) -> int:
        """The one rank that writes chunk ``chunk`` (absolute index) of ``content``."""
        members = self.replica_set(content)
        if not members:
            raise LayoutError(f"no rank of this layout holds {content}")
        if chunk < 0:
            raise LayoutError(f"chunk index must be >= 0, got {chunk}")
        return members[(chunk + content.group) % len(members)]

    def writes(self, rank: int, content: ContentId, chunk: int) -> bool:
        """Does ``rank`` write chunk ``chunk`` of shard ``content``?"""
        return self.writer(content, chunk) == rank

    def chunks_written(self, rank: int, content: ContentId, chunks: Iterable[int]) -> list[int]:
        """The chunks among ``chunks`` that ``rank`` writes of ``content``, in order."""
        members = self.replica_set(content)
        if rank not in members:
            raise LayoutError(f"rank {rank} does not hold {content}")
        f = len(members)
        phase = members.index(rank) - content.group
        return [k for k in chunks if (k - phase) % f == 0]

    # -- internals -----------------------------------------------------------

    def _group(self, group: int) -> GroupSpec:
        if not 0 <= group < len(self.groups):
            raise LayoutError(f"group {group} is outside 0..{len(self.groups) - 1}")
        return self.groups[group]

    @cached_property
    def _stage_bands(self) -> tuple[range, ...]:
        """Per PP rank, the layer bands of its stage."""
        index = {edge: i for i, edge in enumerate(self.bands)}
        return tuple(range(index[first], index[end]) for first, end in self.stages)

    @cached_property
    def _replica_table(self) -> dict[ContentId, tuple[int, ...]]:
        table: dict[ContentId, list[int]] = {}
        for g in range(len(self.groups)):
            for r in self.ranks:
                for c in self.holdings(r, g):
                    table.setdefault(c, []).append(r)
        return {c: tuple(sorted(rs)) for c, rs in sorted(table.items())}

    def _check_coords(self) -> None:
        n = self.world_size
        if [c.rank for c in self.coords] != list(range(n)):
            raise LayoutError(
                f"coordinates must list ranks 0..{n - 1} once each "
                f"(tp*pcp*pp = {self.tp}*{self.pcp}*{self.pp}), got "
                f"{[c.rank for c in self.coords]}"
            )
        seen = set()
        for c in self.coords:
            for name, v, size in (
                ("tp_rank", c.tp_rank, self.tp),
                ("pp_rank", c.pp_rank, self.pp),
                ("pcp_rank", c.pcp_rank, self.pcp),
                ("dcp_rank", c.dcp_rank, self.dcp),
            ):
                if not 0 <= v < size:
                    raise LayoutError(f"rank {c.rank}: {name}={v} is outside 0..{size - 1}")
            place = (c.tp_rank, c.pcp_rank, c.pp_rank)
            if place in seen:
                raise LayoutError(f"rank {c.rank} repeats (tp, pcp, pp) ranks {place}")
            seen.add(place)
        # Every slice of every group must have all its DCP token shards present,
        # else some KV would have no holder (coordinates inconsistent with dcp).
        for g, spec in enumerate(self.groups):
            if spec.kind is GroupKind.MAMBA:
                continue  # state is per rank, not split into token shards
            shards: dict[tuple[int, int, int], set[int]] = {}
            for c in self.coords:
                for head in spec.heads(self.tp, c.tp_rank):
                    shards.setdefault((head, c.pcp_rank, c.pp_rank), set()).add(c.dcp_rank)
            for (head, pcp_rank, pp_rank), ds in shards.items():
                if ds != set(range(self.dcp)):
                    raise LayoutError(
                        f"group {g} ({spec}): KV head {head} at pcp_rank {pcp_rank}, "
                        f"pp_rank {pp_rank} has dcp ranks {sorted(ds)}, not 0..{self.dcp - 1}; "
                        "DCP groups must be made of TP ranks that hold the same KV heads"
                    )


def _check_stages(
    layers: int, pp: int, stages: Sequence[tuple[int, int]] | None
) -> tuple[tuple[int, int], ...]:
    if stages is None:
        if layers < pp:
            raise LayoutError(f"pp={pp} stages need at least {pp} layers, got layers={layers}")
        return even_stages(layers, pp)
    split = tuple((int(a), int(b)) for a, b in stages)
    if len(split) != pp:
        raise LayoutError(f"stages must list pp={pp} layer ranges, got {len(split)}")
    end = 0
    for k, (first, stop) in enumerate(split):
        if first != end or stop <= first:
            raise LayoutError(
                f"PP stage {k} holds layers [{first}, {stop}); stages must be non-empty, "
                f"contiguous and start at layer 0 ({list(split)})"
            )
        end = stop
    if end != layers:
        raise LayoutError(f"the PP stages end at layer {end}, not at the model's {layers}")
    return split


def _check_bands(
    layers: int, stages: tuple[tuple[int, int], ...], given: Sequence[int] | None
) -> tuple[int, ...]:
    """The band edges (0, ..., layers) from the layers where a band begins."""
    starts = [first for first, _ in stages] if given is None else list(given)
    for v in starts:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < layers:
            raise LayoutError(
                f"layer_bands lists the layers where a band begins, each in 0..{layers - 1}; "
                f"got {v!r}"
            )
    edges = tuple(sorted({0, *starts, layers}))
    missing = [first for first, _ in stages if first not in edges]
    if missing:
        raise LayoutError(
            f"PP stages begin at layers {[first for first, _ in stages]}, but layer_bands "
            f"{list(edges[:-1])} has no band beginning at {missing}; add them (a stage "
            "must hold whole bands)"
        )
    return edges


def _check_head_groups(index: int, g: GroupSpec, tp: int, per: int) -> None:
    """Each TP rank must hold whole groups of ``per`` KV heads."""
    if per == 1 or g.kind not in HEADED:
        return
    held = g.kv_heads // tp if g.kv_heads >= tp else 1
    if held % per:
        fits = [d for d in range(1, held + 1) if held % d == 0]
        raise LayoutError(
            f"group {index} ({g}): heads_per_object={per}, but each TP rank holds {held} "
            f"KV head(s) at tp={tp}; choose heads_per_object among {fits} or lower tp"
        )


def _check_group(index: int, g: GroupSpec, tp: int, dcp: int) -> None:
    where = f"group {index} ({g})"
    if g.kind in HEADED:
        h = g.kv_heads
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise LayoutError(f"{where}: kv_heads must be a positive integer, got {h!r}")
        if h % tp and tp % h:
            raise LayoutError(
                f"{where}: kv_heads={h} and tp={tp} must divide one another; "
                f"choose tp among the divisors or multiples of {h}"
            )
    elif g.kv_heads:
        raise LayoutError(f"{where}: {g.kind.value} takes no kv_heads; pass 0")
    w = g.window
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
        raise LayoutError(f"{where}: window must be a token count >= 0, got {w!r}")
    if g.kind is GroupKind.MAMBA:
        if w:
            raise LayoutError(f"{where}: mamba has no sliding window; pass 0")
        return
    r = g.replication(tp)
    if r % dcp:
        raise LayoutError(
            f"{where}: dcp={dcp} must divide the {r} TP rank(s) that share each KV head "
            f"at tp={tp} (vLLM refuses this layout too); lower dcp or raise tp"
        )

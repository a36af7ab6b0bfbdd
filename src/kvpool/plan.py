"""Whole-layout plans: every key put, got and probed for one synthetic prompt.

    build_plan(layout, space, n)  -> Plan: puts, gets and lookup keys for chunks
                                     0..n-1, per-rank shares and totals
    probe_keys(layout, space, hs) -> per chunk, the keys a lookup must find (every
                                     distinct content of every group: exactly the
                                     keys that the ranks will read)
    read_across(plan, r, space)   -> per rank of reader layout ``r``: the objects it
                                     reads per chunk and which writer ranks of
                                     ``plan`` wrote them (engines at other TP sizes)
    reference_totals(layout)      -> Totals under vLLM's in-tree connector rule
                                     (de-dup switched off whenever dcp > 1)
    chunk_hashes(n)               -> n chained synthetic chunk hashes

Pure: it only asks ``layout`` and ``keys``. ``kvpool plan`` renders a ``Plan``;
the property tests check its invariants over every layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.chunks import ChunkObjects
from kvpool.keys import KeySpace
from kvpool.layout import ContentId, GroupKind, Layout, RankCoords

__all__ = [
    "KeyIO",
    "Plan",
    "RankShare",
    "ReaderRank",
    "Totals",
    "build_plan",
    "chunk_hashes",
    "probe_keys",
    "read_across",
    "reference_totals",
]


@dataclass(frozen=True, slots=True)
class KeyIO:
    """One object moved: ``rank`` -1 for lookup probes (the lookup server)."""

    rank: int
    group: int
    chunk: int
    key: str


@dataclass(frozen=True, slots=True)
class RankShare:
    """One rank's part in one group: its shards, their replica-set size and the
    fraction of each shard's chunks it writes."""

    rank: int
    group: int
    shards: tuple[ContentId, ...]  # what the rank holds (and reads) of the group
    replicas: int  # size of each shard's replica set (equal for all of a rank's shards)
    write_share: float  # fraction of each shard's chunks the rank writes (1 / replicas)


@dataclass(frozen=True, slots=True)
class Totals:
    """Per-chunk figures summed over groups (all objects of a group equal in size)."""

    objects_per_chunk: int  # objects written per chunk
    distinct_per_chunk: int  # distinct contents per chunk (the minimum possible)
    keys_per_chunk_lookup: int  # keys a lookup probes per chunk

    @property
    def write_amplification(self) -> float:
        """Objects written per chunk over distinct contents per chunk (1.0 is ideal)."""
        return self.objects_per_chunk / self.distinct_per_chunk


@dataclass(frozen=True, slots=True)
class Plan:
    layout: Layout
    space: KeySpace
    chunks: int
    shares: tuple[RankShare, ...]
    puts: tuple[KeyIO, ...]
    gets: tuple[KeyIO, ...]
    lookup_keys: tuple[KeyIO, ...]
    totals: Totals

    @property
    def ranks(self) -> tuple[RankCoords, ...]:
        return self.layout.coords


def chunk_hashes(n: int, seed: bytes = b"kvpool-plan") -> list[bytes]:
    """``n`` chained hashes, like a prompt's block hashes (each depends on all before)."""
    out, prev = [], seed
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(8, "little")).digest()
        out.append(prev)
    return out


def probe_keys(layout: Layout, space: KeySpace, hashes: Sequence[bytes]) -> list[tuple[str, ...]]:
    """For each chunk hash, the keys a lookup must find: one per distinct content
    of every group (``chunks.ChunkObjects.keys``). These are exactly the keys the
    ranks read (``Layout.holdings``)."""
    objects = ChunkObjects.of(layout, space)
    return [objects.keys(h) for h in hashes]


def build_plan(layout: Layout, space: KeySpace, chunks: int) -> Plan:
    """Every put, get and lookup key for chunks ``0..chunks-1`` of one prompt."""
    hashes = chunk_hashes(chunks)
    groups = range(len(layout.groups))
    shares: list[RankShare] = []
    puts: list[KeyIO] = []
    gets: list[KeyIO] = []
    for r in layout.ranks:
        for g in groups:
            held = layout.holdings(r, g)
            f = len(layout.replica_set(held[0]))
            shares.append(RankShare(r, g, held, f, 1.0 / f))
            for c in held:
                for k in layout.chunks_written(r, c, range(chunks)):
                    puts.append(KeyIO(r, g, k, space.key(c, hashes[k])))
                gets.extend(KeyIO(r, g, k, space.key(c, hashes[k])) for k in range(chunks))
    groups_of = [c.group for g in groups for c in layout.contents(g)]
    lookups = [
        KeyIO(-1, groups_of[i], k, key)
        for k, keys in enumerate(probe_keys(layout, space, hashes))
        for i, key in enumerate(keys)
    ]
    distinct = sum(len(layout.contents(g)) for g in groups)
    totals = Totals(distinct, distinct, distinct)
    return Plan(
        layout, space, chunks, tuple(shares), tuple(puts), tuple(gets), tuple(lookups), totals
    )


@dataclass(frozen=True, slots=True)
class ReaderRank:
    """One rank of a reader layout beside a writer's plan."""

    rank: int
    shards: tuple[tuple[ContentId, ...], ...]  # per group, what it reads
    objects_per_chunk: int  # objects it reads per chunk, all groups
    bytes_share: float  # its objects' bytes over one chunk's distinct bytes
    writers: tuple[int, ...]  # writer ranks whose objects it reads (all chunks)


def read_across(writer: Plan, reader: Layout, reader_space: KeySpace) -> tuple[ReaderRank, ...]:
    """What each rank of ``reader`` reads of what ``writer``'s layout wrote, chunk by
    chunk of the same prompt. Empty when the two share no key (another
    fingerprint: other dcp, pcp or layer bands, another model config). Raises
    ``LookupError`` if the reader needs a key the writer never writes (a broken
    layout rule, never expected)."""
    if reader_space != writer.space:
        return ()
    hashes = chunk_hashes(writer.chunks)
    put_by = {p.key: p.rank for p in writer.puts}
    distinct = sum(
        _shard_weight(reader, c) for g in range(len(reader.groups)) for c in reader.contents(g)
    )
    out = []
    for r in reader.ranks:
        held = tuple(reader.holdings(r, g) for g in range(len(reader.groups)))
        writers: set[int] = set()
        for shards in held:
            for c in shards:
                for h in hashes:
                    key = reader_space.key(c, h)
                    if key not in put_by:
                        raise LookupError(f"reader rank {r} needs {key}, which no writer puts")
                    writers.add(put_by[key])
        weight = sum(_shard_weight(reader, c) for shards in held for c in shards)
        out.append(
            ReaderRank(
                r, held, sum(len(s) for s in held), weight / distinct, tuple(sorted(writers))
            )
        )
    return tuple(out)


def _shard_weight(layout: Layout, c: ContentId) -> float:
    """Relative bytes of shard ``c``: its band's share of the layers, and a token
    class's 1/token_classes of the tokens (all of them for mamba state)."""
    spec = layout.groups[c.group]
    tokens = 1 if spec.kind is GroupKind.MAMBA else layout.token_classes
    return len(layout.band_layers(c.band)) / (layout.layers * tokens)


def reference_totals(layout: Layout) -> Totals:
    """The same totals under vLLM's in-tree MooncakeStoreConnector rule.

    It de-duplicates replicated heads (put_step = tp / kv_heads, MLA counting as
    one KV head) only while dcp == 1; with dcp > 1 every TP rank writes its own
    namespace. Its lookup probes every namespace it writes.
    """
    objects = distinct = 0
    for g, spec in enumerate(layout.groups):
        heads = 1 if spec.kind is GroupKind.MLA else spec.kv_heads
        stride = layout.tp // heads if spec.kind is not GroupKind.MAMBA and heads < layout.tp else 1
        if layout.dcp > 1:
            stride = 1
        namespaces = {
            (c.tp_rank // stride, c.pcp_rank, c.dcp_rank, c.pp_rank) for c in layout.coords
        }
        objects += len(namespaces)
        # Its objects hold a rank's whole slice: distinct slices, not KV heads.
        distinct += len({layout.holdings(r, g) for r in layout.ranks})
    return Totals(objects, distinct, objects)

"""Whole-layout plans: every key put, got and probed for one synthetic prompt.

    build_plan(layout, space, n)  -> Plan: puts, gets and lookup keys for chunks
                                     0..n-1, per-rank shares and totals
    probe_keys(layout, space, hs) -> per chunk, the keys a lookup must find (every
                                     distinct content of every group: exactly the
                                     keys that the ranks will read)
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

from kvpool.keys import KeySpace
from kvpool.layout import GroupKind, Layout, RankCoords

__all__ = [
    "KeyIO",
    "Plan",
    "RankShare",
    "Totals",
    "build_plan",
    "chunk_hashes",
    "probe_keys",
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
    """One rank's part in one group: replica-set size and the fraction it writes."""

    rank: int
    group: int
    replicas: int  # size of the rank's replica set
    write_share: float  # fraction of this group's chunks the rank writes (1 / replicas)


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


def probe_keys(
    layout: Layout, space: KeySpace, hashes: Sequence[bytes | str]
) -> list[tuple[str, ...]]:
    """For each chunk hash, the keys a lookup must find: one per distinct content
    of every group. These are exactly the keys the ranks read (``Layout.content``)."""
    contents = [c for g in range(len(layout.groups)) for c in layout.contents(g)]
    return [tuple(space.key(c, h) for c in contents) for h in hashes]


def build_plan(layout: Layout, space: KeySpace, chunks: int) -> Plan:
    """Every put, get and lookup key for chunks ``0..chunks-1`` of one prompt."""
    hashes = chunk_hashes(chunks)
    groups = range(len(layout.groups))
    shares: list[RankShare] = []
    puts: list[KeyIO] = []
    gets: list[KeyIO] = []
    for r in layout.ranks:
        for g in groups:
            content = layout.content(r, g)
            f = len(layout.replica_set(content))
            shares.append(RankShare(r, g, f, 1.0 / f))
            for k in layout.chunks_written(r, g, range(chunks)):
                puts.append(KeyIO(r, g, k, space.key(content, hashes[k])))
            gets.extend(KeyIO(r, g, k, space.key(content, hashes[k])) for k in range(chunks))
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
        distinct += len(layout.contents(g))
    return Totals(objects, distinct, objects)

"""Builds rich renderables from core results; prints nothing itself."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from kvpool.layout import ContentId, Layout
from kvpool.plan import Plan, ReaderRank, Totals, reference_totals


def _run(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def shards_label(shards: tuple[ContentId, ...]) -> str:
    """A rank's shards of one group: ``h0.d0.c0.b0``, or ``h0-3.d0.c0.b0-1`` for
    runs of KV heads and layer bands (a rank's heads and bands are consecutive)."""
    first = shards[0]
    heads, bands = _run([c.head for c in shards]), _run([c.band for c in shards])
    return f"h{heads}.d{first.dcp_rank}.c{first.pcp_rank}.b{bands}"


def plan_ranks_table(plan: Plan) -> Table:
    """One row per rank: coordinates, and per group identity, replicas, write share."""
    layout = plan.layout
    t = Table(title=f"kvpool plan: {_layout_label(plan)}, {plan.chunks} chunks")
    for name in ("rank", "tp", "pp", "pcp", "dcp"):
        t.add_column(name, justify="right")
    for g, spec in enumerate(layout.groups):
        t.add_column(f"g{g} {spec} shards")
        t.add_column("replicas", justify="right")
        t.add_column("writes", justify="right")
    shares = {(s.rank, s.group): s for s in plan.shares}
    for c in layout.coords:
        row = [str(v) for v in (c.rank, c.tp_rank, c.pp_rank, c.pcp_rank, c.dcp_rank)]
        for g in range(len(layout.groups)):
            s = shares[(c.rank, g)]
            row += [
                shards_label(s.shards),
                str(s.replicas),
                _share(s.write_share),
            ]
        t.add_row(*row)
    return t


def plan_reader_table(plan: Plan, reader: Layout, rows: tuple[ReaderRank, ...]) -> Table:
    """Beside the writer's plan: per rank of the reader layout (another TP or PP
    size), the objects it reads per chunk and the writer ranks they come from."""
    w = plan.layout
    t = Table(
        title=f"a reader at tp={reader.tp} pp={reader.pp} dcp={reader.dcp} beside this "
        f"writer at tp={w.tp} pp={w.pp} dcp={w.dcp}{_bands_label(w, ' (layer bands {})')}"
    )
    t.add_column("reader rank", justify="right")
    for g, spec in enumerate(plan.layout.groups):
        t.add_column(f"g{g} {spec} shards")
    t.add_column("objects read per chunk", justify="right")
    t.add_column("share of a chunk's bytes", justify="right")
    t.add_column("written by ranks")
    for row in rows:
        t.add_row(
            str(row.rank),
            *(shards_label(s) for s in row.shards),
            str(row.objects_per_chunk),
            f"{row.bytes_share:.0%}",
            ",".join(str(w) for w in row.writers),
        )
    return t


def plan_totals_table(plan: Plan) -> Table:
    """Totals per chunk and per lookup, ours beside the in-tree connector's rule."""
    ours, ref = plan.totals, reference_totals(plan.layout)
    t = Table(title="totals")
    t.add_column("")
    t.add_column("kvpool", justify="right")
    t.add_column("vLLM in-tree rule", justify="right")

    def row(label: str, f: Any) -> None:
        t.add_row(label, f(ours), f(ref))

    row("objects written per chunk", lambda x: str(x.objects_per_chunk))
    row("distinct contents per chunk", lambda x: str(x.distinct_per_chunk))
    row("write amplification", lambda x: f"{x.write_amplification:.2f}x")
    row(
        f"keys probed per lookup ({plan.chunks} chunks)",
        lambda x: str(_lookup_keys(x, plan.chunks)),
    )
    return t


def plan_json(plan: Plan) -> dict[str, Any]:
    """The ``--json`` object: exactly layout, ranks, puts, gets, lookup_keys."""
    layout = plan.layout
    return {
        "layout": {
            "tp": layout.tp,
            "pp": layout.pp,
            "layers": layout.layers,
            "layer_bands": list(layout.bands[:-1]),
            "token_classes": layout.token_classes,
            "pcp": layout.pcp,
            "dcp": layout.dcp,
            "dp_index": layout.dp_index,
            "groups": [str(g) for g in layout.groups],
            "chunks": plan.chunks,
            "model": plan.space.model,
        },
        "ranks": [
            {
                "rank": c.rank,
                "tp_rank": c.tp_rank,
                "pp_rank": c.pp_rank,
                "pcp_rank": c.pcp_rank,
                "dcp_rank": c.dcp_rank,
            }
            for c in layout.coords
        ],
        "puts": [
            {"rank": p.rank, "group": p.group, "chunk": p.chunk, "key": p.key} for p in plan.puts
        ],
        "gets": [
            {"rank": p.rank, "group": p.group, "chunk": p.chunk, "key": p.key} for p in plan.gets
        ],
        "lookup_keys": [
            {"group": p.group, "chunk": p.chunk, "key": p.key} for p in plan.lookup_keys
        ],
    }


def reader_json(reader: Layout, rows: tuple[ReaderRank, ...]) -> dict[str, Any]:
    """The ``--json`` ``reader`` object of ``--read-tp``/``--read-pp``: per reader rank."""
    return {
        "tp": reader.tp,
        "pp": reader.pp,
        "dcp": reader.dcp,
        "shares_keys": bool(rows),
        "ranks": [
            {
                "rank": r.rank,
                "objects_per_chunk": r.objects_per_chunk,
                "bytes_share": r.bytes_share,
                "writers": list(r.writers),
            }
            for r in rows
        ],
    }


def _lookup_keys(t: Totals, chunks: int) -> int:
    return t.keys_per_chunk_lookup * chunks


def _share(x: float) -> str:
    return "all" if x == 1.0 else f"1/{round(1 / x)}"


def _bands_label(layout: Layout, form: str) -> str:
    """``form`` with the layer bands (e.g. ``0-15,16-31``) when the layout was given
    its layers or bands finer than its stages; "" otherwise."""
    b = layout.bands
    if layout.layers == layout.pp and len(b) == layout.pp + 1:
        return ""
    return form.format(",".join(f"{b[i]}-{b[i + 1] - 1}" for i in range(len(b) - 1)))


def _layout_label(plan: Plan) -> str:
    L = plan.layout
    groups = ",".join(str(g) for g in L.groups)
    label = f"tp={L.tp} pp={L.pp} pcp={L.pcp} dcp={L.dcp} groups={groups}"
    return label + _bands_label(L, f" layers={L.layers} bands={{}}")

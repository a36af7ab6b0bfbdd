"""`kvpool bench lookup` without a pool: the table and option errors."""

from __future__ import annotations

import click
import pytest
from rich.console import Console

from kvpool.bench.lookup import LookupBench, LookupCase
from kvpool.cli.bench_lookup_cmd import _layouts, _tokens, lookup_bench_table

BENCH = LookupBench(
    cases=(
        LookupCase("tp1", 32768, 2047, 61.0, 0.4, 0.7, 0.3, 1.9, 0.1, 2, 2.0, 0),
        LookupCase("tp8-gqa8", 32768, 16376, 290.0, 5.5, 3.8, 0.8, 9.7, 0.6, 3, 16.0, 2),
        LookupCase("tp8-mla-dcp2", 1024, 126, 126.0, 0.5, 0.4, 0.45, 3.3, 0.25, 1, None, 0),
    ),
    master_address="127.0.0.1:5555",
    chunk_size=16,
    lookups=400,
)


def test_table_shows_latencies_targets_round_trips_and_failures() -> None:
    console = Console(record=True, width=200, color_system=None)
    console.print(lookup_bench_table(BENCH))
    text = console.export_text()
    assert "127.0.0.1:5555" in text and "chunk 16 tokens" in text and "not measured here" in text
    rows = [line for line in text.splitlines() if line.startswith("│ tp")]
    assert len(rows) == 3
    cells = [[c.strip() for c in row.strip("│").split("│")] for row in rows]
    assert cells[0][:8] == ["tp1", "32k", "2047", "61", "0.40", "0.70", "0.30", "1.90"]
    assert cells[0][8:] == ["1", "0.10", "2", "2", "0"]
    assert cells[1][8] == "3" and cells[1][-1] == "2"
    assert cells[2][8] == "" and cells[2][-2] == "n/a"
    assert [c.on_target for c in BENCH.cases] == [True, False, None]


def test_token_and_layout_options_are_parsed_or_refused() -> None:
    ctx = click.Context(click.Command("x"))
    param = click.Option(["--x"])
    assert _tokens(ctx, param, "1k, 3k,100") == (1024, 3072, 100)
    with pytest.raises(click.BadParameter):
        _tokens(ctx, param, "1k,lots")
    with pytest.raises(click.BadParameter):
        _tokens(ctx, param, "1")
    assert _layouts(ctx, param, "tp1,tp8-gqa8") == ("tp1", "tp8-gqa8")
    with pytest.raises(click.BadParameter, match="tp8-mla-dcp2"):
        _layouts(ctx, param, "tp3")

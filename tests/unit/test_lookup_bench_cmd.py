"""`kvpool bench lookup` without a pool: the table and option errors."""

from __future__ import annotations

import click
import pytest
from rich.console import Console

from kvpool.bench.lookup import LookupBench, LookupCase
from kvpool.cli.bench_cmd import _layouts, _tokens, lookup_bench_table

BENCH = LookupBench(
    cases=(
        LookupCase("tp1", 3072, 191, 0.7, 2.0, 0.6, 1.9, 0.3, 1.0, 1.0, 0),
        LookupCase("tp8-gqa8", 32768, 16376, 75.5, 107.0, 69.8, 103.7, 62.0, 1.0, 16.0, 2),
        LookupCase("tp8-mla-dcp2", 1024, 126, 0.5, 3.4, 0.45, 3.3, 0.25, 1.0, None, 0),
    ),
    master_address="127.0.0.1:5555",
    chunk_size=16,
    lookups=400,
)


def test_table_shows_latencies_round_trips_and_failures() -> None:
    console = Console(record=True, width=160, color_system=None)
    console.print(lookup_bench_table(BENCH))
    text = console.export_text()
    assert "127.0.0.1:5555" in text and "chunk 16 tokens" in text and "1.64 ms miss" in text
    rows = [line for line in text.splitlines() if line.startswith("│ tp")]
    assert len(rows) == 3
    assert "3k" in rows[0] and "191" in rows[0] and "0.70" in rows[0] and "0.60" in rows[0]
    assert "32k" in rows[1] and "16376" in rows[1] and "16" in rows[1]
    assert "n/a" in rows[2]


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

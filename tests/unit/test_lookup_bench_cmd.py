"""`kvpool bench lookup` without a pool: the table and option errors."""

from __future__ import annotations

import click
import pytest
from rich.console import Console

from kvpool.bench.lookup import LookupBench, LookupCase
from kvpool.cli.bench_lookup_cmd import _layouts, _tokens, lookup_bench_table

BENCH = LookupBench(
    cases=(
        LookupCase("tp1", 32768, 2047, 61.0, 0.4, 0.7, 0.3, 1.9, 0.1, 0.3, 2, 2.0, 0),
        LookupCase("tp8-gqa8", 32768, 16376, 290.0, 5.5, 3.8, 0.8, 9.7, 0.6, 2.0, 3, 16.0, 2),
        LookupCase("tp8-mla-dcp2", 1024, 126, 126.0, 0.5, 0.4, 0.45, 3.3, 0.25, 0.2, 1, None, 0),
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
    assert cells[0][8:] == ["1", "0.30", "0.10", "2", "2", "0"]
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


def test_report_table_fits_80_columns_with_every_layout_name_whole() -> None:
    from kvpool.cli.bench_lookup_cmd import lookup_summary_table
    from kvpool.cli.console import REPORT_WIDTH, table_rows

    text = table_rows(lookup_summary_table(BENCH))
    lines = text.splitlines()
    assert REPORT_WIDTH <= 80 and all(len(line) <= REPORT_WIDTH for line in lines)
    assert lines[0].split() == [
        "layout", "prompt", "keys", "asked", "hit", "part", "miss", "direct", "store",
        "calls", "fail",
    ]  # fmt: skip
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["tp1", "tp8-gqa8", "tp8-mla-dcp2"]
    assert rows[0][4:9] == ["0.40", "0.70", "0.30", "0.30", "0.10"]  # hit part miss direct store
    assert rows[1][-1] == "2"

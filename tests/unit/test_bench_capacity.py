"""``kvpool bench capacity``'s pure parts: the trace, the LRU reference, the table."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from rich.console import Console

from kvpool.bench.capacity import CapacityBench, CapacityRow, CapacityWorkload, lru_hits, zipf_trace
from kvpool.cli.bench_capacity_cmd import capacity_table
from kvpool.demo.shapes import SHAPES


def test_a_zipf_trace_is_skewed_and_repeatable() -> None:
    trace = zipf_trace(64, 2000, alpha=1.0, seed=3)
    assert trace == zipf_trace(64, 2000, alpha=1.0, seed=3)
    counts = Counter(trace)
    assert counts[0] > 5 * counts[9] > 0  # a few hot prefixes ...
    assert sum(1 for n in counts.values() if n <= 10) > 16  # ... and a long tail
    assert Counter(zipf_trace(4, 4000, alpha=0.0))[3] > 800  # alpha 0: uniform


def test_the_lru_reference_keeps_what_was_used_last_and_loses_a_prefix_from_its_end() -> None:
    # 3 chunks per prefix, room for 4 chunks.
    assert lru_hits([0, 0], chunks=3, capacity=4) == [0, 3]
    # 0, then 1 pushes out 0's chunks (its end first: 0 keeps its first chunk).
    assert lru_hits([0, 1, 0], chunks=3, capacity=4) == [0, 0, 1]
    assert lru_hits([0, 1, 1], chunks=3, capacity=4) == [0, 0, 3]
    assert lru_hits([0, 1, 2, 0], chunks=2, capacity=100) == [0, 0, 0, 2]


def _row(ratio: int, pool: int, lru: int) -> CapacityRow:
    return CapacityRow(ratio, 8 * ratio, 24 * ratio, 1000, pool, lru, 5 << 20, 40, 9, 12,
                       0, 3, 0.025, 0.061, 0.75)  # fmt: skip


def test_the_table_fits_80_columns_and_shows_the_gap_to_lru() -> None:
    result = CapacityBench(
        SHAPES["small"], CapacityWorkload(), (_row(1, 700, 710), _row(4, 450, 530))
    )
    console = Console(width=80, record=True)
    console.print(capacity_table(result))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    row = next(line for line in text.splitlines() if line.lstrip().startswith("4x"))
    assert row.split()[:7] == ["4x", "96", "45%", "-", "53%", "+8", "75%"]
    assert "…" not in text  # no header cut short


def test_repeated_runs_show_medians_their_spread_and_every_drop() -> None:
    """Three runs per N: the table shows the median hit rate, half its range in points,
    the median of the counts, and the drops of all runs; it still fits 80 columns."""
    runs = [replace(_row(4, hit, 530), run=i, dropped=i) for i, hit in enumerate((300, 450, 520))]
    result = CapacityBench(SHAPES["small"], CapacityWorkload(repeats=3), tuple(runs))
    (summary,) = result.summary()
    assert summary.pool_hit_rate == pytest.approx(runs[1].pool_hit_rate)
    assert summary.hit_spread == pytest.approx(runs[2].pool_hit_rate - runs[0].pool_hit_rate)
    assert summary.dropped == 0 + 1 + 2 and summary.run == 3
    console = Console(width=80, record=True)
    console.print(capacity_table(result))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "medians of 3 runs" in text
    row = next(line for line in text.splitlines() if line.lstrip().startswith("4x"))
    spread = round((runs[2].pool_hit_rate - runs[0].pool_hit_rate) * 50)
    assert row.split()[:4] == ["4x", "96", "45%", str(spread)] and spread >= 10


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ratios", "1,x"], "comma-separated"),
        (["--ratios", "0"], ">= 1"),
        (["--prefix-len", "100"], "multiple of 32"),
    ],
)
def test_bad_options_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    from kvpool.cli.app import run

    rc = run(["bench", "capacity", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


def test_the_chart_shows_the_pool_beside_lru_at_each_n() -> None:
    import xml.etree.ElementTree as ET

    from kvpool.cli.bench_capacity_cmd import capacity_chart

    result = CapacityBench(
        SHAPES["small"], CapacityWorkload(), (_row(1, 700, 710), _row(4, 450, 530))
    )
    root = ET.fromstring(capacity_chart(result))
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    names = [line.findtext("{http://www.w3.org/2000/svg}title") for line in lines]
    assert names == ["kvpool pool: hits", "LRU cache of its bytes", "newest 4 prefixes kept"]
    pool = [p.split(",") for p in lines[0].get("points", "").split()]
    assert len(pool) == 2 and float(pool[0][1]) < float(pool[1][1])  # 70% above 45%

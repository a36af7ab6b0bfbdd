"""`kvpool bench store` without a pool: the table, JSON, layout and option errors."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from kvpool.bench.store import SizeResult, StoreBench, _Layout
from kvpool.cli.bench_cmd import store_bench_json, store_bench_table

BENCH = StoreBench(
    results=(
        SizeResult(256 << 10, 256, 0.9, 1.0, 1.0, 1.0, 9.0),
        SizeResult(1 << 20, 64, 1.5, 1.2, 1.6, 1.6, 9.5, failures=3),
    ),
    master_address="127.0.0.1:5555",
    repeats=5,
    segments=4,
    checksum=True,
)


def test_table_shows_both_paths_ratios_and_failures() -> None:
    console = Console(record=True, width=120, color_system=None)
    console.print(store_bench_table(BENCH))
    text = console.export_text()
    assert "127.0.0.1:5555" in text and "checksum on" in text
    assert "256 KiB" in text and "1 MiB" in text
    rows = [line for line in text.splitlines() if " put " in line or " get " in line]
    assert len(rows) == 4
    assert "0.90" in rows[0] and "1.00" in rows[0]  # put: 0.9 / 1.0
    assert "0.94" in rows[2] and "3" in rows[2]  # 1.5 / 1.6, three failures


def test_json_adds_ratios() -> None:
    data = store_bench_json(BENCH)
    assert data["master_address"] == "127.0.0.1:5555"
    assert data["results"][0]["put_ratio"] == pytest.approx(0.9)
    assert data["results"][1]["get_ratio"] == pytest.approx(0.75)


def test_layout_keeps_segments_apart_and_compares_per_object() -> None:
    layout = _Layout(size=10, objects=3, segments=4)
    segs = layout.scatter(1000)
    assert [sum(n for _, n in s) for s in segs] == [10, 10, 10]
    addrs = sorted((a, n) for s in segs for a, n in s)
    assert addrs[0][0] == 1000 and addrs[-1][0] + addrs[-1][1] == 1030  # covers 30 bytes
    for s in segs:  # no two segments of one object are adjacent
        assert all(a + n != b for (a, n), (b, _) in itertools.pairwise(s))
    x = np.arange(30, dtype=np.uint8)
    y = x.copy()
    y[segs[1][2][0] - 1000] ^= 1  # a byte of object 1's third segment
    assert layout.equal(x, y).tolist() == [True, False, True]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sizes", "1MiB,lots"], "byte size"),
        (["--sizes", "8MiB", "--total", "4MiB"], "must not exceed --total"),
        (["--repeats", "0"], "repeats"),
    ],
)
def test_bad_options_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    rc = main(["bench", "store", "--master", "127.0.0.1:1", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


def test_no_pool_is_a_config_error_saying_how_to_get_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVPOOL_HOME", str(tmp_path))
    monkeypatch.delenv("KVPOOL_POOL_FILE", raising=False)
    monkeypatch.delenv("KVPOOL_MASTER_ADDRESS", raising=False)
    rc = main(["bench", "store"])
    err = capsys.readouterr().err
    assert rc == 2 and "kvpool up" in err


def main(argv: list[str]) -> int:
    """``kvpool`` with ``argv``. Imported here, not at collection: importing the
    ``kvpool.cli.main`` module replaces the ``kvpool.cli.main`` function other
    test modules import."""
    from kvpool.cli.app import run

    return run(argv)

"""`kvpool bench store` without a pool: the table, JSON, layout and option errors."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from kvpool.bench.store import SizeResult, StoreBench, _Layout
from kvpool.cli.bench_store_cmd import store_bench_json, store_bench_table

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
    cells = [[c.strip() for c in row.strip("│").split("│")] for row in rows]
    # object, batch, op, kvpool, raw, kvpool/raw, numpy copy, failures
    assert cells[0] == ["256 KiB", "256", "put", "0.90", "1.00", "0.90", "9.00", "0"]
    assert cells[1][2:6] == ["get", "1.00", "1.00", "1.00"]
    assert cells[2] == ["1 MiB", "64", "put", "1.50", "1.60", "0.94", "9.50", "3"]
    assert cells[3][2:6] == ["get", "1.20", "1.60", "0.75"]  # the ratio of each op


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


def test_engine_table_says_no_hits_and_claims_no_speedup_without_hits() -> None:
    from kvpool.bench.engines import ConnectorRun, EngineBench, LengthRow
    from kvpool.cli.bench_vllm_cmd import engine_bench_legend, engine_bench_table
    from kvpool.demo.shapes import SHAPES

    hit = ConnectorRun("kvpool", (LengthRow(4000, 8.0, 1.0, 3968, True),), 1 << 20, 125)
    miss = ConnectorRun("mooncake", (LengthRow(4000, 8.0, 7.9, 0, True),), 0, 0)
    result = EngineBench(SHAPES["llama3-8b"], (4000,), (8.0,), (0.5,), (hit, miss), (0.1,))
    assert result.load_vs_copy(hit, 0) == pytest.approx(5.0)  # 0.5 s of load, 0.1 s a copy
    assert result.load_vs_copy(miss, 0) is None
    # kvpool's own account of its load wins over the TTFT estimate
    measured = ConnectorRun("kvpool", (LengthRow(4000, 8.0, 1.0, 3968, True, 1 << 30, 0.25),), 0, 0)
    assert result.load_gbps(measured, 0) == pytest.approx((1 << 30) / 0.25 / 1e9)
    full = 3968 * 131072  # one copy of every hittable byte takes 0.1 s
    assert result.load_vs_copy(measured, 0) == pytest.approx(0.25 / (0.1 * (1 << 30) / full))
    assert result.verdict(hit, 0) == "8.0x"
    # its chart: the baseline's two lines and one per connector, one point per length
    import xml.etree.ElementTree as ET

    from kvpool.cli.bench_vllm_cmd import engine_bench_chart

    svg = ET.fromstring(engine_bench_chart(result))
    polylines = svg.findall("{http://www.w3.org/2000/svg}polyline")
    assert [p.findtext("{http://www.w3.org/2000/svg}title") for p in polylines] == [
        "no connector: prefill", "no connector: local hit", "kvpool: warm engine",
        "mooncake: warm engine",
    ]  # fmt: skip
    assert all(len(p.get("points", "").split()) == 1 for p in polylines)
    assert result.verdict(miss, 0) == "no hits" and result.load_gbps(miss, 0) is None
    short = ConnectorRun("mooncake", hit.rows, 1 << 20, 125, saves_landed=31, saves_expected=156)
    assert result.verdict(short, 0) == "lost 125"  # saves that never landed: no speed-up
    differs = ConnectorRun("kvpool", (LengthRow(4000, 8.0, 1.0, 3968, False),), 1 << 20, 125)
    assert result.verdict(differs, 0) == "differs"
    # 3968 tokens of 128 KiB in the 0.5 s beyond a local hit: 1.04 GB/s
    gbps = result.load_gbps(hit, 0)
    assert gbps is not None and abs(gbps - 3968 * 131072 / 0.5 / 1e9) < 1e-9
    console = Console(width=250, record=True)
    console.print(engine_bench_table(result))
    text = console.export_text()
    kv_row = next(line for line in text.splitlines() if "kvpool" in line and "4000" in line)
    mc_row = next(line for line in text.splitlines() if "mooncake" in line and "4000" in line)
    assert "100%" in kv_row and "1.04" in kv_row and "8.0x" in kv_row and " 5.0 " in kv_row
    assert "no hits" in mc_row and "x" not in mc_row.split()[-2:] and "0%" in mc_row
    assert "128 KiB of KV per token" in text
    # the floor row: the local hit (0.5 s) plus one copy of a full hit's bytes (0.1 s)
    assert result.one_copy_s(0) == pytest.approx(0.6)
    assert result.copy_gbps(0) == pytest.approx(full / 0.1 / 1e9)
    floor_row = next(line for line in text.splitlines() if line.startswith("one copy"))
    assert floor_row.split()[2:] == [
        "4000", "8000", "500", "-", "600", "1.20", "-", f"{full / 0.1 / 1e9:.2f}", "1.0", "-", "-"
    ]  # fmt: skip
    no_copy = EngineBench(SHAPES["llama3-8b"], (4000,), (8.0,), (0.5,), (hit,))
    assert no_copy.one_copy_s(0) is None and no_copy.copy_gbps(0) is None
    assert "one copy" in engine_bench_legend(result)
    assert "32 layers, 8 KV heads x 128, bfloat16" in engine_bench_legend(result)
    assert result.vs_local(hit, 0) == pytest.approx(2.0) and result.vs_local(miss, 0) is None
    # what a miss costs, from the same run: cold TTFT over the prefill without a connector
    assert result.cold_ratio(miss, 0) == pytest.approx(1.0)
    assert "a miss, mooncake over no connector: 4000: TTFT 1.00x" in text
    assert result.cold_request_ratio(hit, 0) is None  # no whole-request times given
    whole = EngineBench(
        SHAPES["llama3-8b"], (4000,), (8.0,), (0.5,),
        (ConnectorRun("kvpool", (LengthRow(4000, 8.8, 1.0, 3968, True, 0, 0.0, 9.9),), 0, 0),),
        (0.1,), prefill_total_s=(9.0,),
    )  # fmt: skip
    assert whole.cold_ratio(whole.runs[0], 0) == pytest.approx(1.1)
    assert whole.cold_request_ratio(whole.runs[0], 0) == pytest.approx(1.1)
    recorded = Console(width=250, record=True)
    recorded.print(engine_bench_table(whole))
    assert "a miss, kvpool over no connector: 4000: TTFT 1.10x, request 1.10x" in (
        recorded.export_text()
    )
    # the widest cells a run prints still fit an 80-column terminal, nothing cut
    wide = ConnectorRun(
        "mooncake",
        (LengthRow(4000, 12.345, 11.0, 2000, False, 0, 0.0),),
        1 << 20,
        95,
        saves_landed=95,
        saves_expected=156,
    )
    slow = EngineBench(SHAPES["llama3-8b"], (4000,), (18.5,), (0.5,), (hit, wide), (0.03,))
    narrow = Console(width=80, record=True)
    narrow.print(engine_bench_table(slow))
    lines = narrow.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in "".join(lines)
    assert any("lost 61" in line for line in lines)


def test_samples_collapse_to_medians_and_one_sample_without_hits_makes_no_hits() -> None:
    """``--samples 3``: three prompts of each length, one row each with the medians
    of every time; the fewest hits of any sample (one that hit nothing: "no
    hits", no speed-up); outputs identical only if all were."""
    from kvpool.bench.engines import ConnectorRun, EngineBench, LengthRow, collapse
    from kvpool.cli.bench_vllm_cmd import engine_bench_legend
    from kvpool.demo.shapes import SHAPES

    rows = (
        LengthRow(1000, 3.0, 0.30, 992, True, 100, 0.10),
        LengthRow(1000, 2.0, 0.90, 992, True, 100, 0.30),
        LengthRow(1000, 4.0, 0.20, 992, True, 100, 0.05),
        LengthRow(4000, 9.0, 0.50, 3968, True, 400, 0.2),
        LengthRow(4000, 8.0, 0.60, 0, True, 0, 0.0),
        LengthRow(4000, 7.0, 0.40, 3968, False, 400, 0.3),
    )
    run = ConnectorRun("kvpool", rows, 1 << 20, 125)
    bench = EngineBench(
        SHAPES["llama3-8b"],
        (1000,) * 3 + (4000,) * 3,
        (1.0, 1.2, 1.1, 4.0, 4.4, 4.2),
        (0.1, 0.3, 0.2, 0.25, 0.2, 0.3),
        (run,),
    )
    got = collapse(bench, 3, (0.01, 0.04))
    assert got.lengths == (1000, 4000) and got.samples == 3 and got.copy_s == (0.01, 0.04)
    assert got.prefill_s == pytest.approx((1.1, 4.2))
    assert got.local_hit_s == pytest.approx((0.2, 0.25))
    first, second = got.runs[0].rows
    assert (first.cold_ttft_s, first.warm_ttft_s, first.load_s) == (3.0, 0.30, 0.10)
    assert first.hit_tokens == 992 and first.identical
    assert got.vs_local(got.runs[0], 0) == pytest.approx(1.5)
    assert second.hit_tokens == 0 and not second.identical
    assert got.verdict(got.runs[0], 1) == "no hits" and got.vs_local(got.runs[0], 1) is None
    assert "3 prompts of each length" in engine_bench_legend(got)
    assert "one prompt at a time" in engine_bench_legend(collapse(bench, 1, (0.1,) * 6))
    with pytest.raises(ValueError, match="not 2 consecutive prompts per length"):
        collapse(bench, 2, (0.1,) * 3)  # 1000, 1000 | 1000, 4000 | 4000, 4000


def test_copy_seconds_times_a_real_copy() -> None:
    from kvpool.bench.engines import copy_seconds

    small, big = copy_seconds(1 << 20), copy_seconds(64 << 20)
    assert 0 < small < big  # a copy 64 times bigger takes longer, on any machine


def test_shapes_have_real_models_kv_sizes_and_custom_ones_parse() -> None:
    from kvpool.demo.shapes import SHAPES, parse_shape

    kib = {name: s.kv_bytes_per_token // 1024 for name, s in SHAPES.items()}
    assert kib["llama3-8b"] == 128 and kib["qwen2.5-7b"] == 56 and kib["llama3-70b-tp8"] == 40
    custom = parse_shape("16x8x128:float32")
    assert (custom.layers, custom.kv_heads, custom.head_dim, custom.dtype) == (
        16,
        8,
        128,
        "float32",
    )
    assert custom.kv_bytes_per_token == 128 << 10
    assert custom.kv_cache_gib(8192) == 1 and custom.kv_cache_gib(8193) == 2  # 1 GiB: 8192
    assert custom.kv_cache_gib(1) == 1
    assert parse_shape("4x2x64").dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown shape"):
        parse_shape("llama9")
    with pytest.raises(ValueError, match="head size >= 32"):
        parse_shape("4x2x16")
    with pytest.raises(ValueError, match="dtype must be"):
        parse_shape("4x2x64:int8")

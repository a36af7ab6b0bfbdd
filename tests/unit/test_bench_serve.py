"""`kvpool bench serve` without servers: result files, cache counters, verdicts, table."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from kvpool.bench.serve import (
    Phase,
    ServeBench,
    ServeRun,
    Workload,
    cache_counts,
    read_bench_result,
)
from kvpool.cli.bench_serve_cmd import serve_bench_table
from kvpool.demo.shapes import SHAPES


def phase(p50: float, pool: int, failed: int = 0) -> Phase:
    return Phase(p50, 2 * p50, 1.5, 8 - failed, failed, 8000, 1000, pool)


def test_a_saved_result_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    sample = {"num_prompts": 8, "completed": 7, "median_ttft_ms": 120.5, "p90_ttft_ms": 300.0}
    path.write_text(json.dumps({**sample, "request_throughput": 0.75, "mean_ttft_ms": 150.0}))
    assert read_bench_result(path) == {
        "ttft_p50_ms": 120.5,
        "ttft_p90_ms": 300.0,
        "request_throughput": 0.75,
        "completed": 7,
        "failed": 1,
    }


def test_cache_counters_are_summed_over_engines() -> None:
    text = "\n".join(
        [
            "# HELP vllm:prefix_cache_queries_total x",
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0',
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0',
            'vllm:external_prefix_cache_hits_total{engine="1",model_name="m"} 40.0',
            'vllm:external_prefix_cache_queries_total{engine="1",model_name="m"} 70.0',
        ]
    )
    assert cache_counts(text) == (150, 30, 40)


def test_verdicts_are_honest_and_the_table_shows_every_phase() -> None:
    bench = ServeBench(
        SHAPES["llama3-8b"],
        Workload(),
        (
            ServeRun("none", phase(900.0, 0), phase(880.0, 0)),
            ServeRun("kvpool", phase(950.0, 0), phase(110.0, 7000)),
            ServeRun("mooncake", phase(990.0, 0), phase(870.0, 0)),
            ServeRun("broken", phase(990.0, 0), phase(100.0, 7000, failed=2)),
        ),
    )
    verdicts = [bench.verdict(r) for r in bench.runs]
    assert verdicts == ["baseline", "8.6x", "no hits", "failed requests"]  # 950 / 110
    console = Console(record=True, width=200, color_system=None)
    console.print(serve_bench_table(bench))
    text = console.export_text()
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["none"],
            ["kvpool"], ["mooncake"], ["broken"])]  # fmt: skip
    assert len(rows) == 8
    assert rows[3][:3] == ["kvpool", "warm", "110"] and rows[3][-1] == "8.6x"
    assert rows[3][-2] == "88%"  # pool hits: 7000 of 8000 tokens looked up
    assert rows[5][-3:] == ["0%", "no", "hits"]  # mooncake: "no hits", never a speedup

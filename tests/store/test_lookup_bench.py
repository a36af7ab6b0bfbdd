"""`kvpool bench lookup` against a real pool (short prompts, few lookups)."""

from __future__ import annotations

import json

import pytest

from kvpool.bench.lookup import run_lookup_bench
from kvpool.pool import LocalPool


def test_run_lookup_bench_answers_right_in_one_round_trip(local_pool: LocalPool) -> None:
    bench = run_lookup_bench(
        local_pool.config(), prompts=(256,), layouts=("tp1", "tp8-gqa8"), lookups=10
    )
    assert [(c.layout, c.keys_probed) for c in bench.cases] == [("tp1", 15), ("tp8-gqa8", 120)]
    for c in bench.cases:
        assert c.failures == 0
        assert c.exists_calls_per_lookup == 1
        assert c.round_trips_per_lookup == 1
        assert 0 < c.hit_p50_ms <= c.hit_p99_ms and 0 < c.miss_p50_ms <= c.miss_p99_ms


def test_cli_prints_json_and_exits_0(
    local_pool: LocalPool, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpool.cli.app import run

    rc = run(["bench", "lookup", "--master", local_pool.master_address, "--prompts", "100",
              "--layouts", "tp8-mla-dcp2", "--lookups", "4", "--json"])  # fmt: skip
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cases"][0]["failures"] == 0 and data["cases"][0]["keys_probed"] == 12

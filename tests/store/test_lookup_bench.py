"""`kvpool bench lookup` against a real pool (short prompts, few lookups)."""

from __future__ import annotations

import json

import pytest

from kvpool.bench.lookup import run_lookup_bench
from kvpool.pool import LocalPool


def test_run_lookup_bench_answers_right_in_few_round_trips(local_pool: LocalPool) -> None:
    bench = run_lookup_bench(
        local_pool.config(), prompts=(256, 32768), layouts=("tp1", "tp8-gqa8"), lookups=12
    )
    keys = [(c.layout, c.prompt_tokens, c.keys) for c in bench.cases]
    # Both layouts hold 8 KV heads, one key each per chunk (keys name heads, not ranks).
    assert keys == [("tp1", 256, 120), ("tp1", 32768, 16376), ("tp8-gqa8", 256, 120),
                    ("tp8-gqa8", 32768, 16376)]  # fmt: skip
    for c in bench.cases:
        assert c.failures == 0
        if c.prompt_tokens == 256:  # short: one round over every chunk, one head each
            assert c.exists_calls_max == 1 and c.keys_probed == c.keys / 8
            assert c.round_trips_per_lookup == 1
        else:  # long: a few rounds of a few dozen chunks
            assert 1 < c.exists_calls_max <= 4 and c.keys_probed < c.keys / 10
            assert c.round_trips_per_lookup is not None and c.round_trips_per_lookup <= 4
        p50s = (c.hit_p50_ms, c.partial_p50_ms, c.miss_p50_ms)
        assert min(p50s) > 0 and max(p50s) <= c.p99_ms


def test_cli_prints_json_and_exits_0(
    local_pool: LocalPool, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpool.cli.app import run

    rc = run(["bench", "lookup", "--master", local_pool.master_address, "--prompts", "100",
              "--layouts", "tp8-mla-dcp2", "--lookups", "4", "--json"])  # fmt: skip
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cases"][0]["failures"] == 0 and data["cases"][0]["keys"] == 12

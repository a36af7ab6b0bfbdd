"""`kvpool bench store` against a real pool (small sizes, one repeat)."""

from __future__ import annotations

import json

import pytest

from kvpool.bench.store import run_store_bench
from kvpool.pool import LocalPool

MiB = 1 << 20


def test_run_store_bench_measures_both_paths_without_failures(local_pool: LocalPool) -> None:
    bench = run_store_bench(local_pool.config(), sizes=(256 << 10, MiB), total_bytes=4 * MiB,
                            repeats=2, segments=3)  # fmt: skip
    assert [r.size for r in bench.results] == [256 << 10, MiB]
    assert [r.objects for r in bench.results] == [16, 4]
    for r in bench.results:
        assert r.failures == 0
        assert min(r.ours_put, r.ours_get, r.raw_put, r.raw_get, r.numpy_copy) > 0
    assert bench.checksum and bench.repeats == 2


def test_cli_prints_json_and_exits_0(
    local_pool: LocalPool, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["bench", "store", "--master", local_pool.master_address, "--sizes", "1MiB",
               "--total", "2MiB", "--repeats", "1", "--json"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out)
    assert data["results"][0]["failures"] == 0 and data["results"][0]["objects"] == 2


def main(argv: list[str]) -> int:
    """``kvpool`` with ``argv``. Imported here, not at collection: importing the
    ``kvpool.cli.main`` module replaces the ``kvpool.cli.main`` function other
    test modules import."""
    from kvpool.cli.app import run

    return run(argv)

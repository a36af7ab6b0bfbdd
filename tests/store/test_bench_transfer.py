"""`kvpool bench transfer` against a real pool: tiny sizes, two repeats, both paths."""

from __future__ import annotations

import json

import pytest

from kvpool.bench.transfer import run_transfer_bench
from kvpool.pool import LocalPool
from kvpool.transfer.loads import Loads

KiB, MiB = 1 << 10, 1 << 20


def test_both_paths_move_verified_bytes_and_report_positive_figures(local_pool: LocalPool) -> None:
    seen: list[tuple[str, int, int]] = []
    bench = run_transfer_bench(local_pool.config(), sizes=(64 * KiB, 256 * KiB),
                               total_bytes=2 * MiB, repeats=2, job_bytes=1 * MiB,
                               hook_steps=200, on_progress=lambda *a: seen.append(a),
                               staging_bytes=8 * MiB)  # fmt: skip
    assert [(r.path, r.size) for r in bench.results] == [
        ("tcp", 64 * KiB), ("tcp", 256 * KiB), ("shm", 64 * KiB), ("shm", 256 * KiB),
    ]  # fmt: skip
    assert bench.failures == 0  # every object saved, loaded and byte-equal (checked in warm-up)
    for r in bench.results:
        assert r.objects * r.size == 2 * MiB and r.jobs == 2
        assert r.shape.object_nbytes == r.size and r.shape.layers == 8
        assert r.copy > 0
        for v in r.variants:
            assert min(v.save, v.load, v.end_to_end) > 0, v
            assert v.end_to_end < min(v.save, v.load)
        assert r.kvpool.submit > 0 and r.raw.submit == 0
        assert r.save_ratio > 0 and r.load_ratio > 0
    tcp, shm = bench.results[0], bench.results[2]
    assert (tcp.transport, tcp.load_mode) == ("tcp", "staged")  # as the connector loads
    assert (shm.transport, shm.load_mode) == ("shared memory", "staged")
    assert bench.hooks is not None and bench.hooks.steps == 200
    assert 0 < bench.hooks.metadata_us < bench.hooks.step_us
    assert bench.hooks.submit_poll_us > 0 and bench.hooks.stats_us > 0
    assert ("tcp", 6, 6) in seen and ("shm", 6, 6) in seen and ("hooks", 4, 4) in seen


def test_a_load_that_writes_nothing_counts_as_failures(
    local_pool: LocalPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Loads, "_scatter", lambda self, piece, ok: None)
    bench = run_transfer_bench(local_pool.config(), sizes=(256 * KiB,), total_bytes=1 * MiB,
                               repeats=1, paths=("shm",), hook_steps=0,
                               staging_bytes=4 * MiB)  # fmt: skip
    (r,) = bench.results
    assert r.raw.failures == 0
    assert r.kvpool.failures == r.objects and r.checksum.failures == r.objects


def test_cli_prints_json_and_exits_0(
    local_pool: LocalPool, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["bench", "transfer", "--master", local_pool.master_address, "--object-sizes",
               "128KiB", "--total", "1MiB", "--repeats", "1", "--paths", "tcp",
               "--hook-steps", "0", "--json"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out)
    (row,) = data["results"]
    assert data["failures"] == 0 and data["hooks"] is None
    assert row["objects"] == 8 and row["path"] == "tcp" and row["kvpool"]["save"] > 0
    assert row["save_ratio"] > 0 and row["shape"]["layers"] == 8


def test_cli_exits_1_when_bytes_come_back_different(
    local_pool: LocalPool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Loads, "_scatter", lambda self, piece, ok: None)
    pool_file = local_pool.write_pool_file(local_pool.home / "pool.json")
    rc = main(["bench", "transfer", "--pool-file", str(pool_file), "--object-sizes",
               "256KiB", "--total", "1MiB", "--repeats", "1", "--paths", "shm",
               "--hook-steps", "0"])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 1
    assert "failed or came back different" in captured.err
    assert "shm: same-host shared memory" in captured.out


def main(argv: list[str]) -> int:
    """``kvpool`` with ``argv``. Imported here, not at collection: importing the
    ``kvpool.cli.main`` module replaces the ``kvpool.cli.main`` function other
    test modules import."""
    from kvpool.cli.app import run

    return run(argv)

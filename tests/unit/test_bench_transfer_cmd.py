"""`kvpool bench transfer` without a pool: shapes, job sizes, tables, verdicts, JSON, options."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rich.console import Console

from kvpool.bench.hooks import HookOverhead
from kvpool.bench.paged_kv import KVShape, PagedKV, kv_shape_for
from kvpool.bench.transfer import (
    DEFAULT_SIZES,
    MAX_SLICES,
    PATHS,
    SizeResult,
    TransferBench,
    VariantResult,
    job_size,
)
from kvpool.cli.bench_transfer_cmd import (
    TRANSFER_PATHS,
    TRANSFER_SIZES,
    transfer_bench_json,
    transfer_bench_tables,
    transfer_chart,
    transfer_hooks_table,
    transfer_verdicts,
)

KiB, MiB = 1 << 10, 1 << 20


def _row(
    path: str, size: int, raw: float, ours: float, ck: float, failures: int = 0, zero: float = 0
) -> SizeResult:
    return SizeResult(
        path=path,
        transport="shared memory" if path == "shm" else "tcp",
        load_mode="staged" if path == "shm" else "direct",
        size=size,
        objects=64 * MiB // size,
        jobs=4,
        shape=kv_shape_for(size),
        raw=VariantResult("raw", raw, raw, raw / 2, 0.0, 0),
        kvpool=VariantResult("kvpool", ours, ours, ours / 2, 10.0, failures),
        checksum=VariantResult("kvpool+checksum", ck, ck, ck / 2, 9.0, 0),
        copy=10.0,
        zero=VariantResult("zero-copy", zero, zero, zero / 2, 99.0, 0) if zero else None,
        zero_checksum=VariantResult("zero-copy+checksum", zero, zero, 1.0, 99.0, 0)
        if zero
        else None,
    )


BENCH = TransferBench(
    results=(
        _row("tcp", 256 * KiB, 1.0, 0.95, 0.92),
        _row("tcp", MiB, 1.6, 1.5, 1.2),
        _row("shm", 256 * KiB, 6.0, 5.8, 4.0, zero=5.7),
        _row("shm", MiB, 8.0, 6.0, 5.0, failures=2, zero=7.8),
    ),
    master_address="127.0.0.1:5555",
    repeats=5,
    total_bytes=64 * MiB,
    job_bytes=16 * MiB,
    hooks=HookOverhead(10_000, 3.5, 0.3, 7.0, 6.0),
)


def render(*items: object) -> str:
    console = Console(record=True, width=160, color_system=None)
    for item in items:
        console.print(item)
    return console.export_text()


@pytest.mark.parametrize("size", [32 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB])
def test_kv_shape_gives_exactly_the_object_size(size: int) -> None:
    shape = kv_shape_for(size)
    assert shape.object_nbytes == size
    assert shape.layers == 8 and shape.head_size >= 32  # what vLLM's CPU attention supports
    assert shape.layer_block_nbytes * shape.layers == size


def test_kv_shape_falls_back_to_fewer_layers_and_refuses_what_cannot_fit() -> None:
    assert kv_shape_for(32 * KiB, layers=1) == KVShape(1, 32, 2, 64)
    assert kv_shape_for(16 * KiB) == KVShape(4, 16, 1, 32)  # 8 layers cannot be that small
    with pytest.raises(ValueError, match="16 KiB"):
        kv_shape_for(1000)


def test_kv_cache_is_one_allocation_in_vllm_cpu_layout() -> None:
    shape = KVShape(4, 32, 2, 64)
    kv = PagedKV(shape, num_blocks=6)
    assert len(kv.layers) == 4
    for i, (_, t) in enumerate(kv.layers):
        assert tuple(t.shape) == (6, 2, 32, 128)
        assert t.data_ptr() == kv.base + i * kv.layer_stride
    segs = kv.segments(np.array([5, 0], dtype=np.int64))
    assert [len(s) for s in segs] == [4, 4]
    assert segs[0][1] == (kv.base + kv.layer_stride + 5 * shape.layer_block_nbytes,
                          shape.layer_block_nbytes)  # fmt: skip


def test_jobs_stay_below_the_tcp_lane_queue() -> None:
    shape = kv_shape_for(32 * KiB)  # 8 layers: 8 segments per object on direct loads
    assert job_size(shape, 2048, 16 * MiB) == MAX_SLICES // 8
    assert job_size(kv_shape_for(MiB), 64, 16 * MiB) == 16  # job_bytes rules for big objects
    assert job_size(kv_shape_for(MiB), 8, 16 * MiB) == 8  # never more than there are


def test_cli_constants_mirror_the_bench_module() -> None:
    assert TRANSFER_PATHS == PATHS
    sizes = {"32KiB": 32 * KiB, "256KiB": 256 * KiB, "1MiB": MiB}
    assert tuple(sizes[s] for s in TRANSFER_SIZES.split(",")) == DEFAULT_SIZES


def test_tables_show_every_variant_ratio_and_failure() -> None:
    text = render(*transfer_bench_tables(BENCH))
    assert "127.0.0.1:5555" in text and "median of 5" in text
    assert "tcp: loopback tcp, direct loads" in text
    assert "shm: same-host shared memory to the holder, staged loads" in text
    lines = text.splitlines()
    kvpool = [ln for ln in lines if " kvpool " in ln]
    assert len(kvpool) == 4
    assert "0.95/0.95" in kvpool[0]  # vs raw
    assert "0.97/0.97" in kvpool[2]
    assert "0.75/0.75" in kvpool[3] and kvpool[3].rstrip().endswith("2")  # failures
    assert sum("numpy copy" in ln for ln in lines) == 4
    assert sum("kvpool+sum" in ln for ln in lines) == 4
    zero = [ln for ln in lines if ln.strip().startswith("0-copy ")]
    assert len(zero) == 2 and "0.95/0.95" in zero[0] and "0.97/0.97" in zero[1]  # vs raw
    assert sum("0-copy+sum" in ln for ln in lines) == 2


def test_tables_fit_an_80_column_terminal() -> None:
    console = Console(record=True, width=80, color_system=None)
    for t in transfer_bench_tables(BENCH):
        console.print(t)
    text = console.export_text()
    assert "…" not in text  # no cell was cut


def test_verdicts_name_each_target_with_the_worst_figure() -> None:
    text = render(*transfer_verdicts(BENCH))
    assert "tcp save >= 0.90x raw: checksum off met (worst 0.94x)" in text
    assert "checksum on missed (worst 0.75x)" in text  # tcp 1 MiB: 1.2 / 1.6
    assert "shm save >= 0.90x raw: checksum off missed (worst 0.75x)" in text
    assert "same host end-to-end >= 2.5 GB/s: checksum off met (best 3.00 GB/s)" in text
    assert "shm zero-copy save >= 0.90x raw: checksum off met (worst 0.95x)" in text
    assert "same host zero-copy end-to-end >= 2.5 GB/s: checksum off met (best 3.90 GB/s)" in text
    assert "tcp zero-copy" not in text  # no zero-copy figures for tcp here


def test_hooks_table_and_json() -> None:
    text = render(transfer_hooks_table(BENCH.hooks))  # type: ignore[arg-type]
    assert "median of 10000 steps" in text and "7.30" in text  # metadata + hooks
    data = transfer_bench_json(BENCH)
    json.dumps(data)
    assert data["failures"] == 2 and data["hooks"]["step_us"] == pytest.approx(7.3)
    row = data["results"][3]
    assert row["save_ratio"] == pytest.approx(0.75) and row["failures"] == 2
    assert row["shape"]["layers"] == 8 and row["raw"]["name"] == "raw"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--object-sizes", "1MiB,lots"], "byte size"),
        (["--object-sizes", "8MiB", "--total", "4MiB"], "must not exceed --total"),
        (["--object-sizes", "1000"], "16 KiB"),
        (["--paths", "tcp,rdma"], "choose among tcp, shm"),
        (["--repeats", "0"], "repeats"),
    ],
)
def test_bad_options_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    rc = main(["bench", "transfer", "--master", "127.0.0.1:1", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


def main(argv: list[str]) -> int:
    """``kvpool`` with ``argv`` (imported late, as in test_bench_cmd)."""
    from kvpool.cli.app import run

    return run(argv)


def test_the_chart_has_kvpools_save_and_load_per_path_and_a_copy_on_a_log2_axis() -> None:
    import xml.etree.ElementTree as ET

    svg = ET.fromstring(transfer_chart(BENCH))
    ns = "{http://www.w3.org/2000/svg}"
    lines = {
        p.findtext(f"{ns}title"): p.get("points", "").split() for p in svg.iter(f"{ns}polyline")
    }
    assert list(lines) == ["tcp: kvpool save", "tcp: kvpool load", "shared memory: kvpool save",
                           "shared memory: kvpool load", "numpy copy"]  # fmt: skip
    assert all(len(points) == 2 for points in lines.values())  # one point per size
    xs = [float(p.split(",")[0]) for p in lines["numpy copy"]]
    assert xs[0] < xs[1]  # 256 KiB left of 1 MiB
    ticks = [t.text for t in svg.iter(f"{ns}text")]
    assert "256" in ticks and "1024" in ticks  # object sizes in KiB, one tick each

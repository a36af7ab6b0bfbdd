"""``kvpool bench store``: kvpool's store layer against raw Mooncake on the same bytes.

    bench store                   write and read 256 KiB, 1 MiB and 4 MiB objects
                                  through kvpool's framed Mooncake layer and through
                                  raw Mooncake calls on the same bytes, beside a
                                  numpy copy; medians over --repeats; exits 1 if any
                                  object failed or came back different
    store_bench_table(result)     the table (prints nothing)
    store_bench_json(result)      what ``--json`` prints

The pool is ``--master`` or a pool file (``bench_cmd.pool_options``); one must be named.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import click
from rich.table import Table

from kvpool.bench.store import DEFAULT_SIZES, StoreBench, run_store_bench
from kvpool.cli.bench_cmd import TARGET_RATIO, _config, _label, _size, _sizes, bench, pool_options
from kvpool.errors import KVPoolError

__all__ = ["store_bench_json", "store_bench_table"]


def _ratio(r: float) -> str:
    style = "green" if r >= TARGET_RATIO else "red"
    return f"[{style}]{r:.2f}[/{style}]"


def store_bench_table(bench: StoreBench) -> Table:
    """Two rows per object size (put, get): GB/s of each path, and kvpool/raw."""
    checksum = "checksum on" if bench.checksum else "checksum off"
    t = Table(
        title=(
            f"kvpool bench store: {bench.master_address} over {bench.transport}\n"
            f"median of {bench.repeats}, {bench.segments} segments/object, {checksum}"
        ),
        caption=f"GB/s = 1e9 payload bytes/s; target kvpool/raw >= {TARGET_RATIO:.2f}",
    )
    for name in ("object", "batch", "op", "kvpool", "raw", "kvpool/raw", "numpy copy"):
        t.add_column(name, justify="left" if name == "op" else "right")
    t.add_column("failures", justify="right")
    for r in bench.results:
        failures = str(r.failures) if not r.failures else f"[red]{r.failures}[/red]"
        t.add_row(
            _label(r.size),
            str(r.objects),
            "put",
            f"{r.ours_put:.2f}",
            f"{r.raw_put:.2f}",
            _ratio(r.put_ratio),
            f"{r.numpy_copy:.2f}",
            failures,
        )
        t.add_row("", "", "get", f"{r.ours_get:.2f}", f"{r.raw_get:.2f}", _ratio(r.get_ratio))
    return t


def store_bench_json(bench: StoreBench) -> dict[str, Any]:
    data = asdict(bench)
    for row, r in zip(data["results"], bench.results, strict=True):
        row["put_ratio"], row["get_ratio"] = r.put_ratio, r.get_ratio
    return data


@bench.command("store")
@pool_options()
@click.option(
    "--sizes",
    default=",".join(f"{s >> 10}KiB" for s in DEFAULT_SIZES),
    show_default=True,
    callback=_sizes,
    help="Object sizes, comma separated.",
)
@click.option(
    "--total",
    default="64MiB",
    show_default=True,
    callback=_size,
    help="Bytes per batch (objects per batch = total / size).",
)
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(min=1, max=100))
@click.option(
    "--segments", default=4, show_default=True, type=click.IntRange(min=1, max=64),
    help="Scatter segments per object (like one slice per layer).",
)  # fmt: skip
@click.option("--no-checksum", is_flag=True, help="Measure kvpool without payload checksums.")
@click.option(
    "--shared-memory", is_flag=True,
    help="Use Mooncake's same-host shared-memory path to the holder (falls back to TCP).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def store_cmd(
    master: str | None,
    pool_file: str | None,
    sizes: tuple[int, ...],
    total: int,
    repeats: int,
    segments: int,
    no_checksum: bool,
    shared_memory: bool,
    as_json: bool,
) -> None:
    """Throughput of kvpool's store layer against raw Mooncake, same bytes, same run."""
    from kvpool.cli.console import console

    config = _config(master, pool_file, checksum=not no_checksum)
    if max(sizes) > total:
        raise click.BadParameter(f"sizes must not exceed --total ({total} bytes)")
    result = run_store_bench(config, sizes, total, repeats, segments, shared_memory)
    if as_json:
        click.echo(json.dumps(store_bench_json(result)))
    else:
        console.print(store_bench_table(result))
    failed = sum(r.failures for r in result.results)
    if failed:
        raise KVPoolError(f"{failed} object transfers failed or came back different")

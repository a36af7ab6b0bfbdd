"""``kvpool bench capacity``: hit rates of a pool whose working set is N times its memory.

Runs ``kvpool.bench.capacity.run_capacity_bench`` (a fresh pool per N, a Zipf
trace of prefixes replayed by fresh engines) and prints a row per N beside an
LRU cache of the same bytes on the same trace. Takes minutes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click
from rich.table import Table

from kvpool.bench.capacity import CapacityBench, CapacityWorkload
from kvpool.cli.bench_cmd import bench, print_result
from kvpool.cli.bench_vllm_cmd import shape_or_fail
from kvpool.cli.charts import Series, line_chart, plot_option
from kvpool.cli.console import TABLE_HELP, PhaseBars, bench_table
from kvpool.demo.shapes import SHAPES
from kvpool.pool.local import LEASE_TTL_MS

__all__ = ["capacity_chart", "capacity_table"]


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f}"


def capacity_table(result: CapacityBench) -> Table:
    w = result.workload
    runs = f", medians of {w.repeats} runs" if w.repeats > 1 else ""
    title = (
        f"a {w.pool_mib} MiB pool, {result.shape.kv_bytes_per_token >> 10} KiB of KV per "
        f"token, {w.prefix_tokens}-token prefixes (Zipf {w.alpha:g}), {w.engines} engines{runs}"
    )
    columns = ("N", "reqs", "hits", "±", "LRU", "gap", "newest", "evicted", "retry", "drop",
               "gone", "hit", "miss")  # fmt: skip
    t = bench_table(title, columns, left=0)
    for r in result.summary():
        t.add_row(
            f"{r.ratio}x",
            str(r.requests),
            f"{r.pool_hit_rate:.0%}",
            f"{r.hit_spread * 50:.0f}" if w.repeats > 1 else "-",
            f"{r.lru_hit_rate:.0%}",
            f"{(r.lru_hit_rate - r.pool_hit_rate) * 100:+.0f}",
            f"{r.newest_kept:.0%}",
            f"{r.evicted_bytes / (1 << 20):.0f}M",
            str(r.puts_retried),
            str(r.dropped),
            str(r.missing_loads),
            _ms(r.ttft_hit_s),
            _ms(r.ttft_miss_s),
        )
    t.caption = (
        "N: working set over pool memory; hits: prompt tokens loaded from the pool over "
        "those any cache could supply; ±: half the range of the runs' hits, in points; "
        "LRU: an LRU cache of the pool's bytes on the same "
        "trace; gap: LRU minus pool, in points; newest: what a fresh engine then loads of "
        "the 4 prefixes used last; evicted: bytes the pool evicted; retry: "
        "objects whose put met a full pool and went again; drop: still refused after "
        "that (all runs); gone: loads of objects evicted since their lookup; hit/miss: "
        "TTFT medians of requests with and without a pool hit, in ms"
    )
    return t


def capacity_chart(result: CapacityBench) -> str:
    """Hit rate against N: the pool's, an LRU cache's of the same bytes, and what a
    fresh engine loads of the prefixes used last (an SVG line chart)."""
    rows = result.summary()
    series = [
        Series("kvpool pool: hits", tuple((r.ratio, 100 * r.pool_hit_rate) for r in rows)),
        Series("LRU cache of its bytes", tuple((r.ratio, 100 * r.lru_hit_rate) for r in rows)),
        Series("newest 4 prefixes kept", tuple((r.ratio, 100 * r.newest_kept) for r in rows)),
    ]
    w = result.workload
    title = f"a {w.pool_mib} MiB pool, {w.prefix_tokens}-token prefixes (Zipf {w.alpha:g})"
    return line_chart(title, "N: working set over pool memory", "%", series, y_max=100)


@bench.command("capacity")
@click.option("--shape", default="small", show_default=True,
              help=f"KV shape: one of {', '.join(SHAPES)}, or LxHxD[:dtype].")  # fmt: skip
@click.option("--pool-mib", default=128, show_default=True, type=click.IntRange(min=32))
@click.option("--prefix-len", default=512, show_default=True, type=click.IntRange(min=32))
@click.option("--ratios", default="1,2,4,8", show_default=True,
              help="Working sets as multiples of the pool's memory.")  # fmt: skip
@click.option("--requests-per-prefix", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--alpha", default=1.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--engines", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--lease-ttl-ms", default=LEASE_TTL_MS, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--local-cache/--no-local-cache",
    default=False,
    show_default=True,
    help="vLLM's own prefix cache in the engines (off: every reuse is a pool hit).",
)
@click.option(
    "--repeats",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Runs per N, each on a fresh pool with fresh engines; the table shows medians.",
)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--json", "as_json", is_flag=True)
@click.option("--table", "table_only", is_flag=True, hidden=True, help=TABLE_HELP)
@plot_option("hit rate against N")
def bench_capacity(
    shape: str,
    pool_mib: int,
    prefix_len: int,
    ratios: str,
    requests_per_prefix: int,
    alpha: float,
    engines: int,
    lease_ttl_ms: int,
    local_cache: bool,
    repeats: int,
    workdir: Path | None,
    as_json: bool,
    table_only: bool,
    plot: Path | None,
) -> None:
    """Pool hit rate against an LRU cache when the working set is N times the pool."""
    from kvpool.bench.capacity import run_capacity_bench

    model_shape = shape_or_fail(shape)
    if prefix_len % 32:
        raise click.BadParameter(
            f"must be a multiple of 32, got {prefix_len}", param_hint="--prefix-len"
        )
    try:
        ns = tuple(int(x) for x in ratios.split(","))
    except ValueError:
        raise click.BadParameter(
            f"comma-separated integers, got {ratios!r}", param_hint="--ratios"
        ) from None
    if not ns or min(ns) < 1:
        raise click.BadParameter(f"integers >= 1, got {ratios!r}", param_hint="--ratios")
    workload = CapacityWorkload(
        pool_mib=pool_mib,
        prefix_tokens=prefix_len,
        ratios=ns,
        requests_per_prefix=requests_per_prefix,
        alpha=alpha,
        engines=engines,
        lease_ttl_ms=lease_ttl_ms,
        local_cache=local_cache,
        repeats=repeats,
    )
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-capacity-") as tmp,
        PhaseBars(disable=table_only or as_json) as bars,
    ):
        result = run_capacity_bench(
            workdir or Path(tmp), shape=model_shape, workload=workload, on_progress=bars
        )
    print_result(
        result,
        capacity_table,
        table_only=table_only,
        as_json=as_json,
        plot=plot,
        chart=capacity_chart,
    )

"""``kvpool bench serve``: vLLM's benchmark client against real ``vllm serve``.

Runs ``kvpool.bench.serve.run_serve_bench`` (a server per connector and phase
on a private pool, a random model with a real model's KV shape) and prints a
row per connector and phase. Takes minutes: two server starts per connector.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click
from rich.table import Table

from kvpool.bench.serve import CONNECTORS, ServeBench, Workload
from kvpool.cli.bench_cmd import bench, print_result
from kvpool.cli.bench_vllm_cmd import connectors_or_fail, shape_or_fail
from kvpool.cli.console import TABLE_HELP, PhaseBars, bench_table
from kvpool.demo.shapes import SHAPES

__all__ = ["serve_bench_table"]


def serve_bench_table(result: ServeBench) -> Table:
    """One row per connector and phase (cold, then warm after a server restart)."""
    w = result.workload
    title = (
        f"vllm serve + vllm bench serve, {result.shape.kv_bytes_per_token >> 10} KiB of KV "
        f"per token: {w.prompts} prompts of {w.prefix_tokens}+{w.suffix_tokens} tokens "
        f"({w.prefixes} prefixes), {w.output_tokens} out, concurrency {w.concurrency}"
    )
    columns = ("connector", "phase", "TTFT p50", "p90", "req/s", "local hits", "pool hits",
               "cold/warm")  # fmt: skip
    t = bench_table(title, columns, left=2)
    for run in result.runs:
        for phase, p in (("cold", run.cold), ("warm", run.warm)):
            queried = max(p.queried_tokens, 1)
            t.add_row(
                run.name,
                phase,
                f"{p.ttft_p50_ms:.0f}",
                f"{p.ttft_p90_ms:.0f}",
                f"{p.request_throughput:.2f}",
                f"{p.local_hit_tokens / queried:.0%}",
                f"{p.pool_hit_tokens / queried:.0%}",
                result.verdict(run) if phase == "warm" else "",
            )
    t.caption = (
        "TTFT in ms (p50, p90 over the phase's requests); hits: prompt tokens found in the "
        "server's own prefix cache and through the connector, of those looked up; warm: the "
        "same prompts after a restart of the whole server (local caches empty, the pool kept); "
        "cold/warm: the connector's cold TTFT p50 over its warm one"
    )
    return t


@bench.command("serve")
@click.option(
    "--shape",
    default="llama3-8b",
    show_default=True,
    help=f"KV shape: one of {', '.join(SHAPES)}, or LxHxD[:dtype]. Random model, tiny hidden.",
)
@click.option("--connectors", default=",".join(CONNECTORS), show_default=True)
@click.option("--prompts", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--prefixes", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--prefix-len", default=1024, show_default=True, type=click.IntRange(min=32))
@click.option("--suffix-len", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--output-len", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--concurrency", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--json", "as_json", is_flag=True)
@click.option("--table", "table_only", is_flag=True, hidden=True, help=TABLE_HELP)
def bench_serve(
    shape: str,
    connectors: str,
    prompts: int,
    prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    concurrency: int,
    workdir: Path | None,
    as_json: bool,
    table_only: bool,
) -> None:
    """TTFT and hit rates under vLLM's benchmark client, cold and after a restart."""
    from kvpool.bench.serve import run_serve_bench

    model_shape = shape_or_fail(shape)
    names = connectors_or_fail(connectors, CONNECTORS)
    workload = Workload(prompts, prefixes, prefix_len, suffix_len, output_len, concurrency)
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-serve-") as tmp,
        PhaseBars(disable=table_only or as_json) as bars,
    ):
        result = run_serve_bench(
            workdir or Path(tmp),
            shape=model_shape,
            workload=workload,
            connectors=names,
            on_progress=bars,
        )
    print_result(result, serve_bench_table, table_only=table_only, as_json=as_json)

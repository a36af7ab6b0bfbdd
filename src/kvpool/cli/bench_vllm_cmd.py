"""``kvpool bench vllm``: our connector beside vLLM's in-tree Mooncake connector.

Runs ``kvpool.bench.engines.run_engine_bench`` (real vLLM engines on a private
pool) with progress bars and prints one table of ratios. Takes minutes.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import click
from rich.table import Table

from kvpool.bench.engines import EngineBench
from kvpool.cli.bench_cmd import bench
from kvpool.cli.console import PhaseBars, console

__all__ = ["engine_bench_table"]


def engine_bench_table(result: EngineBench) -> Table:
    """One row per connector; ratios against the first (kvpool)."""
    t = Table(
        title=f"vLLM engines, prompts of {min(result.prompt_tokens)}-"
        f"{max(result.prompt_tokens)} tokens, one at a time; "
        f"no-connector TTFT {result.baseline_ttft_s * 1000:.0f} ms"
    )
    for name in (
        "connector",
        "cold TTFT",
        "warm TTFT",
        "cold/warm",
        "pool MiB",
        "keys",
        "warm hits",
        "match",
    ):
        t.add_column(name, justify="left" if name == "connector" else "right", no_wrap=True)
    for r in result.runs:
        t.add_row(
            r.name,
            f"{r.cold_ttft_s * 1000:.0f} ms",
            f"{r.warm_ttft_s * 1000:.0f} ms",
            f"{r.cold_ttft_s / r.warm_ttft_s:.1f}x" if r.warm_ttft_s else "-",
            f"{r.bytes_stored / 2**20:.1f}",
            str(r.keys_stored),
            str(r.warm_hit_tokens),
            "yes" if r.identical else "no",
        )
    if len(result.runs) == 2 and result.runs[0].warm_ttft_s > 0:
        a, b = result.runs
        warm = b.warm_ttft_s / a.warm_ttft_s
        cold = a.cold_ttft_s / b.cold_ttft_s
        t.caption = (
            f"warm TTFT {b.name}/{a.name}: {warm:.2f}x; cold TTFT {a.name}/{b.name}: {cold:.2f}x"
        )
    return t


@bench.command("vllm")
@click.option("--prompts", default=4, show_default=True, type=click.IntRange(1, 64))
@click.option("--min-tokens", default=2000, show_default=True, type=click.IntRange(64, 3500))
@click.option("--max-tokens", default=3000, show_default=True, type=click.IntRange(65, 3600))
@click.option("--layers", default=8, show_default=True, type=click.IntRange(1, 64))
@click.option("--hidden", default=512, show_default=True, type=click.IntRange(64, 4096))
@click.option(
    "--connectors",
    default="kvpool,mooncake",
    show_default=True,
    help="Comma-separated: kvpool, mooncake (vLLM's in-tree MooncakeStoreConnector).",
)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--json", "as_json", is_flag=True)
def bench_vllm(
    prompts: int,
    min_tokens: int,
    max_tokens: int,
    layers: int,
    hidden: int,
    connectors: str,
    workdir: Path | None,
    as_json: bool,
) -> None:
    """Warm and cold TTFT with kvpool's and vLLM's in-tree connector, same pool."""
    from kvpool.bench.engines import run_engine_bench

    names = tuple(n.strip() for n in connectors.split(",") if n.strip())
    if not names or set(names) - {"kvpool", "mooncake"}:
        raise click.BadParameter("use kvpool and/or mooncake", param_hint="--connectors")
    if min_tokens >= max_tokens:
        raise click.BadParameter("must exceed --min-tokens", param_hint="--max-tokens")
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as tmp, PhaseBars() as bars:
        result = run_engine_bench(
            workdir or Path(tmp),
            prompts=prompts,
            min_tokens=min_tokens,
            max_tokens=max_tokens,
            layers=layers,
            hidden=hidden,
            connectors=names,
            on_progress=bars,
        )
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(result)))
    else:
        console.print(engine_bench_table(result))

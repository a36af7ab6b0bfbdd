"""``kvpool demo``: engines sharing prefixes through a pool, shown in one table.

Runs ``kvpool.demo.run.run_demo`` with progress bars, prints a table per request
(prompt tokens, tokens the fresh engine loaded from the pool, time to first
token of the cold prefill, of a local hit and of the pool hit) and totals (bytes
saved and loaded, lookups, pool keys), and exits 1 unless every request of the
fresh engine hit the pool and answered exactly like the local hit. ``--plot``
writes an SVG chart of cold vs warm time to first token (``kvpool.cli.charts``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click
from rich import box
from rich.console import Group
from rich.table import Table

from kvpool.cli.charts import Series, bar_chart, plot_option
from kvpool.cli.console import TABLE_HELP, PhaseBars, table_rows
from kvpool.demo.run import DemoReport
from kvpool.demo.shapes import parse_shape

__all__ = ["demo", "demo_request_table", "demo_tables"]


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def demo_request_table(report: DemoReport) -> Table:
    """A row per measured request: its tokens, what the fresh engine loaded from the
    pool, TTFT cold, local and from the pool, and whether the answers match."""
    t = Table(
        title="kvpool demo: a cold engine, then a fresh engine on the same pool",
        caption=(
            "TTFT in ms: cold, the cold engine's first run (it computes what its own cache "
            "lacks: the whole prompt, or a turn's new tokens); local, its second run, a local "
            "hit (the best a cache can do); pool, the fresh engine's pool hit; same: the pool "
            "hit's answer equals the local hit's, token for token and logprob for logprob"
            + (f"; KV of {report.shape}" if report.shape else "")
        ),
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for name in ("request", "prompt", "pool hit", "cold", "local", "pool", "pool/local",
                 "same"):  # fmt: skip
        t.add_column(name, justify="left" if name == "request" else "right")
    for r in report.rows:
        t.add_row(
            r.name,
            str(r.prompt_tokens),
            str(r.warm_cached) if r.hit else "[red]none[/red]",
            f"{r.cold_ttft_s * 1000:.0f}",
            f"{r.local_ttft_s * 1000:.0f}",
            f"{r.warm_ttft_s * 1000:.0f}",
            f"{r.warm_ttft_s / r.local_ttft_s:.1f}x" if r.hit and r.local_ttft_s > 0 else "-",
            "yes" if r.identical else "[red]NO[/red]",
        )
    return t


def demo_tables(report: DemoReport) -> Group:
    """The per-request table and the totals, as one renderable (80 columns)."""
    t = demo_request_table(report)
    s = Table(title="totals", box=box.SIMPLE_HEAD, pad_edge=False)
    s.add_column("")
    s.add_column("cold", justify="right")
    s.add_column("fresh", justify="right")
    s.add_row(
        "tokens loaded from the pool",
        str(report.cold.get("hit_tokens", 0)),
        str(report.warm.get("hit_tokens", 0)),
    )
    s.add_row(
        "bytes put (incl. chunks already there)",
        _mib(report.cold.get("bytes_saved", 0)),
        _mib(report.warm.get("bytes_saved", 0)),
    )
    s.add_row(
        "bytes loaded from the pool",
        _mib(report.cold.get("bytes_loaded", 0)),
        _mib(report.warm.get("bytes_loaded", 0)),
    )
    s.add_row("lookups", str(report.cold.get("lookups", 0)), str(report.warm.get("lookups", 0)))
    prefill = sum(r.cold_ttft_s for r in report.rows)
    s.add_row("sum of TTFT (first runs)", f"{prefill:.2f} s", f"{report.warm_ttft_s:.2f} s")
    s.add_row("pool after both", f"{report.pool_keys} keys", _mib(report.pool_bytes))
    missed = [r.name for r in report.rows if not r.hit]
    differ = [r.name for r in report.rows if not r.identical]
    if report.passed:
        verdict = (
            "[bold green]every request of the fresh engine loaded its prefix from the pool "
            "and answered exactly like a local hit"
        )
    else:
        why = []
        if missed:
            why.append(f"no pool hit: {', '.join(missed)}")
        if differ:
            why.append(f"answers differ from the local hit: {', '.join(differ)}")
        verdict = "[bold red]check failed: " + "; ".join(why or ["no requests"])
    return Group(t, s, verdict)


def _plot(report: DemoReport, path: Path) -> None:
    """Cold against warm TTFT per measured request, as an SVG bar chart."""
    rows = report.rows
    groups = [r.name for r in rows]
    series = [
        Series("cold engine", tuple((i, r.cold_ttft_s * 1000) for i, r in enumerate(rows))),
        Series("warm engine", tuple((i, r.warm_ttft_s * 1000) for i, r in enumerate(rows))),
    ]
    chart = bar_chart("kvpool demo: time to first token", "ms", groups, series)
    path.write_text(chart)


@click.command()
@click.option("--conversations", default=4, show_default=True, type=click.IntRange(1, 64))
@click.option("--turns", default=2, show_default=True, type=click.IntRange(1, 16))
@click.option("--document-tokens", default=1536, show_default=True, type=click.IntRange(32, 3000))
@click.option(
    "--shape",
    default=None,
    help="A real model's KV shape (e.g. llama3-8b, qwen2.5-7b; see `kvpool bench vllm "
    "--help`) with a tiny hidden size; default: a small 4-layer model (about a minute).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the model, logs and pool here (default: a temporary folder).",
)
@plot_option("cold vs warm time to first token")
@click.option("--table", "table_only", is_flag=True, hidden=True, help=TABLE_HELP)
def demo(
    conversations: int,
    turns: int,
    document_tokens: int,
    shape: str | None,
    workdir: Path | None,
    plot: Path | None,
    table_only: bool,
) -> None:
    """Run a cold and a warm vLLM engine sharing prefixes through a private pool."""
    from kvpool.cli.console import console
    from kvpool.demo.run import run_demo

    try:
        model_shape = parse_shape(shape) if shape else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--shape") from None
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(f"kvpool demo needs vLLM ({exc}); run scripts/setup.sh") from exc
    with tempfile.TemporaryDirectory(prefix="kvpool-demo-") as tmp:
        folder = workdir or Path(tmp)
        with PhaseBars(disable=table_only) as bars:
            report = run_demo(
                folder,
                conversations=conversations,
                turns=turns,
                document_tokens=document_tokens,
                shape=model_shape,
                on_progress=bars,
            )
        if table_only:
            click.echo(table_rows(demo_request_table(report)))
        else:
            console.print(demo_tables(report))
        if plot is not None:
            _plot(report, plot)
            console.print(f"plot written to {plot}")
    if not report.passed:
        raise click.exceptions.Exit(1)

"""``kvpool bench vllm``: our connector beside vLLM's in-tree Mooncake connector.

Runs ``kvpool.bench.engines.run_engine_bench`` (real vLLM engines on a private
pool, a random model with a real model's KV shape) with progress bars and
prints a row per connector and prompt length. Takes minutes (a 16k-token
prompt at 128 KiB per token: tens of minutes on two cores).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click
from rich import box
from rich.table import Table

from kvpool.bench.engines import EngineBench
from kvpool.cli.bench_cmd import bench, print_result
from kvpool.cli.charts import Series, line_chart, plot_option
from kvpool.cli.console import TABLE_HELP, PhaseBars
from kvpool.demo.shapes import SHAPES, ModelShape, parse_shape
from kvpool.errors import ConfigError
from kvpool.settings import parse_extra

__all__ = ["connectors_or_fail", "engine_bench_chart", "engine_bench_table", "shape_or_fail"]

# The row of no connector: a local hit plus one memory copy of a full hit's bytes.
ONE_COPY = "one copy"

# Settings that would point the engines away from the bench's private pool.
_BENCH_OWNS = frozenset({"pool_file", "master_address", "holder_address", "metrics_url"})


def engine_bench_table(result: EngineBench) -> Table:
    """One row per connector and prompt length, beside the no-connector baseline."""
    t = Table(
        title=f"vLLM engines, {result.shape.kv_bytes_per_token >> 10} KiB of KV per token",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
        padding=(0, 0),  # one space between columns: the table fits 80 columns
    )
    for name in (
        "connector",
        "len",
        "prefill",
        "local",
        "cold",
        "warm",
        "xlocal",
        "hits",
        "GB/s",
        "xcopy",
    ):
        t.add_column(name, justify="left" if name == "connector" else "right", no_wrap=True)
    t.add_column("speedup", no_wrap=True)
    t.add_column("same", justify="right", no_wrap=True)
    for run in result.runs:
        for i, row in enumerate(run.rows):
            gbps = result.load_gbps(run, i)
            t.add_row(
                run.name,
                str(row.tokens),
                f"{result.prefill_s[i] * 1000:.0f}",
                f"{result.local_hit_s[i] * 1000:.0f}",
                f"{row.cold_ttft_s * 1000:.0f}",
                f"{row.warm_ttft_s * 1000:.0f}",
                f"{vs:.2f}" if (vs := result.vs_local(run, i)) is not None else "-",
                f"{row.hit_rate:.0%}",
                f"{gbps:.2f}" if gbps is not None else "-",
                _ratio(result.load_vs_copy(run, i)),
                result.verdict(run, i),
                "yes" if row.identical else "no",
            )
    for i, n in enumerate(result.lengths):  # no connector: the local hit plus one copy
        if (floor := result.one_copy_s(i)) is None:
            continue
        gbps = result.copy_gbps(i)
        local = result.local_hit_s[i]
        t.add_row(
            ONE_COPY,
            str(n),
            f"{result.prefill_s[i] * 1000:.0f}",
            f"{local * 1000:.0f}",
            "-",
            f"{floor * 1000:.0f}",
            f"{floor / local:.2f}" if local else "-",
            "-",
            f"{gbps:.2f}" if gbps is not None else "-",
            "1.0",
            "-",
            "-",
        )
    stored = "; ".join(
        f"{r.name} stored {r.keys_stored} keys, {r.bytes_stored / 2**20:.1f} MiB"
        for r in result.runs
    )
    t.caption = "\n".join([stored, *miss_costs(result)])
    return t


def miss_costs(result: EngineBench) -> list[str]:
    """What a miss costs each connector, a line each: its cold engine's TTFT and
    whole request (prompt in, last token out) over the engine's without a
    connector, same prompts, same run (under the table: it fills 80 columns)."""
    lines = []
    for run in result.runs:
        cells = []
        for i, row in enumerate(run.rows):
            whole = result.cold_request_ratio(run, i)
            tail = f", request {whole:.2f}x" if whole is not None else ""
            cells.append(f"{row.tokens}: TTFT {result.cold_ratio(run, i):.2f}x{tail}")
        lines.append(f"a miss, {run.name} over no connector: " + "; ".join(cells))
    return lines


def engine_bench_chart(result: EngineBench) -> str:
    """TTFT against prompt length: the baseline's prefill and local hit, and each
    connector's warm engine (an SVG line chart)."""

    def ms(times: tuple[float, ...]) -> tuple[tuple[float, float], ...]:
        return tuple((n, t * 1000) for n, t in zip(result.lengths, times, strict=True))

    series = [
        Series("no connector: prefill", ms(result.prefill_s)),
        Series("no connector: local hit", ms(result.local_hit_s)),
        *(
            Series(f"{run.name}: warm engine",
                   tuple((r.tokens, r.warm_ttft_s * 1000) for r in run.rows))
            for run in result.runs
        ),
    ]  # fmt: skip
    title = f"vLLM engines, {result.shape.kv_bytes_per_token >> 10} KiB of KV per token"
    return line_chart(title, "prompt tokens", "time to first token (ms)", series)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.{1 if x < 100 else 0}f}"


def engine_bench_legend(result: EngineBench) -> str:
    """What the table's columns mean (printed under it)."""
    each = (
        f"{result.samples} prompts of each length, one at a time (len: their tokens); "
        "TTFT in ms, medians"
        if result.samples > 1
        else "one prompt at a time (len: its tokens); TTFT in ms"
    )
    return (
        f"{result.shape.describe()}, {each}. "
        "prefill, local: an engine without a connector, the prompt cold, then from its "
        "own prefix cache; cold, warm: the connector's engines; xlocal: warm / local; "
        "hits: of the whole chunks; GB/s: the load rate (kvpool: bytes over its load's "
        "own time; others: hit bytes over warm - local); xcopy: the load's time over one "
        "memory copy of the same bytes; speedup: prefill / warm (lost N: N objects of the "
        "cold engine's saves never landed in the pool, no speed-up claimed); same: warm "
        "output = the baseline run that computed the same tokens. one copy: no connector, "
        "the local hit plus one memory copy of a full hit's bytes, both measured in this "
        "run (GB/s: the copy's rate): the fastest a load that does not overlap the "
        "forward could be on this host."
    )


def shape_or_fail(text: str) -> ModelShape:
    """``--shape`` of the engine benches: a named shape or LxHxD[:dtype]."""
    try:
        return parse_shape(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--shape") from None


def connectors_or_fail(text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``--connectors``: a comma-separated subset of ``allowed``."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or set(names) - set(allowed):
        raise click.BadParameter(f"choose among {', '.join(allowed)}", param_hint="--connectors")
    return names


def _lengths(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 64:
        raise click.BadParameter(
            "comma-separated prompt lengths of at least 64 tokens, e.g. 1000,4000,16000",
            param_hint="--lengths",
        )
    return out


@bench.command("vllm")
@click.option(
    "--shape",
    default="llama3-8b",
    show_default=True,
    help=f"KV shape: one of {', '.join(SHAPES)}, or LxHxD[:dtype] (layers, KV heads, "
    "head size), e.g. 16x8x128:float32. The model is random with a tiny hidden size.",
)
@click.option(
    "--lengths",
    default="1000,4000",
    show_default=True,
    help="Comma-separated prompt lengths in tokens: one row each.",
)
@click.option(
    "--samples",
    type=click.IntRange(1, 20),
    default=3,
    show_default=True,
    help="Distinct prompts per length, one request each per engine: a row gives their "
    "medians (one request on a busy host varies by a third).",
)
@click.option(
    "--connectors",
    default="kvpool,mooncake",
    show_default=True,
    help="Comma-separated: kvpool, mooncake (vLLM's in-tree MooncakeStoreConnector).",
)
@click.option(
    "--extra",
    default="{}",
    show_default=True,
    help='kvpool connector settings as JSON, e.g. \'{"staging_bytes": "64MiB"}\'.',
)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--json", "as_json", is_flag=True)
@click.option("--table", "table_only", is_flag=True, hidden=True, help=TABLE_HELP)
@plot_option("TTFT against prompt length")
def bench_vllm(
    shape: str,
    lengths: str,
    samples: int,
    connectors: str,
    extra: str,
    workdir: Path | None,
    as_json: bool,
    table_only: bool,
    plot: Path | None,
) -> None:
    """TTFT at a real model's KV size: kvpool, vLLM's in-tree connector, no connector."""
    from kvpool.bench.engines import run_engine_bench

    model_shape = shape_or_fail(shape)
    names = connectors_or_fail(connectors, ("kvpool", "mooncake"))
    try:
        settings = json.loads(extra)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--extra") from None
    if not isinstance(settings, dict):
        raise click.BadParameter("a JSON object of settings", param_hint="--extra")
    # Checked before any engine runs: a typo must not surface after the baseline.
    taken = sorted(set(settings) & _BENCH_OWNS)
    if taken:
        raise click.BadParameter(
            f"{', '.join(taken)}: the bench runs its own private pool; leave them out",
            param_hint="--extra",
        )
    try:
        parse_extra(settings)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--extra") from None
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-bench-") as tmp,
        PhaseBars(disable=table_only or as_json) as bars,
    ):
        result = run_engine_bench(
            workdir or Path(tmp),
            shape=model_shape,
            lengths=_lengths(lengths),
            connectors=names,
            extra=settings,
            on_progress=bars,
            samples=samples,
        )
    print_result(
        result,
        engine_bench_table,
        table_only=table_only,
        as_json=as_json,
        legend=engine_bench_legend,
        plot=plot,
        chart=engine_bench_chart,
    )

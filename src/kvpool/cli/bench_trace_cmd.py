"""``kvpool bench trace FILE``: a fleet of ``vllm serve`` replaying a production trace.

Reads a trace in Mooncake's FAST'25 format (``kvpool.bench.trace``), keeps the
sessions the options choose, and runs ``kvpool.bench.fleet.run_trace_bench``:
per configuration (no connector, kvpool, vLLM's in-tree Mooncake connector) a
fresh pool and ``--servers`` ``vllm serve`` behind the bench's router, the same
turns sent to each. Prints one row per configuration and two reference rows
(an ideal cache, an LRU cache of the pool's size). Takes minutes: a fleet start
per configuration, and every turn's prefill on this machine.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click
from rich.table import Table

from kvpool.bench.fleet import CONFIGS, ConfigRun, Fleet, TraceBench, percentile
from kvpool.bench.replay import ROUTERS, Pacing
from kvpool.bench.trace import Sample, TraceError, read_trace, select
from kvpool.cli.bench_cmd import _size, bench, print_result
from kvpool.cli.bench_vllm_cmd import connectors_or_fail, shape_or_fail
from kvpool.cli.charts import Series, line_chart, plot_option
from kvpool.cli.console import TABLE_HELP, PhaseBars, bench_table
from kvpool.connector.costs import POLICIES
from kvpool.demo.shapes import LLAMA3_8B_FLOP_PER_KV_BYTE, SHAPES

__all__ = ["trace_chart", "trace_table"]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _pct(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def trace_table(result: TraceBench) -> Table:
    """A row per configuration, then the ideal and LRU references."""
    f, p = result.fleet, result.pacing
    loop = f"concurrency {p.concurrency}" if p.concurrency else "no concurrency cap"
    pace = f"arrivals x{p.speedup:g}" if p.speedup else "no arrival times"
    title = (
        f"{result.turns} turns of {result.sessions} sessions ({result.prompt_tokens:,} prompt "
        f"tokens), {f.servers} servers, {p.router}, {loop}, {pace}, {p.output_tokens} out; "
        f"{f.shape.kv_bytes_per_token >> 10} KiB KV/token, "
        f"{f.flop_per_kv_byte / 1000:.0f}k FLOP per KV byte "
        f"(Llama-3-8B {LLAMA3_8B_FLOP_PER_KV_BYTE / 1000:.0f}k); pool {f.pool_bytes >> 20} MiB; "
        f"kvpool load_decision {f.load_decision}"
    )
    columns = ("fleet", "p50", "p90", "p99", "e2e", "req/s", "tok/s", "own", "pool", "reuse",
               "miss", "err")  # fmt: skip
    t = bench_table(title, columns)
    for run in result.runs:
        t.add_row(*_row(result, run))
    empty = ("",) * 8
    t.add_row("ideal", *empty, _pct(result.ideal_tokens, result.prompt_tokens), "", "")
    t.add_row("LRU", *empty, _pct(result.lru_tokens, result.prompt_tokens), "", "")
    pool = "; ".join(
        f"{r.name}: {r.evicted} objects evicted, {r.refused_puts} puts refused, {_checks(r)}"
        + _kvpool_moves(r)
        for r in result.runs
        if r.name != "none"
    )
    t.caption = (
        "TTFT p50/p90/p99 and e2e (end-to-end p50) in ms, streamed, over every turn; "
        "req/s and tok/s (prompt tokens): over the replay's wall time; own, pool: prompt "
        "tokens the servers took from their own prefix cache and through the connector, "
        "reuse: both, of all prompt tokens; miss: tokens of whole blocks that a turn "
        "answered before this one was sent had computed, computed again (saves in flight, "
        "evictions, another server's cache), of all prompt tokens; err: failed requests; "
        "ideal: an infinite cache of every whole block computed earlier; LRU: an LRU cache "
        f"of the pool's size ({result.pool_blocks:,} blocks), both in trace order"
        + (f". The pool: {pool}" if pool else "")
    )
    return t


def _checks(run: ConfigRun) -> str:
    """What asking answers again of another server showed (``fleet.Check``)."""
    if not run.checks:
        return "no answer asked again"
    same = sum(c.same_tokens for c in run.checks)
    diff = max(c.logprob_diff for c in run.checks)
    return (
        f"{same} of {len(run.checks)} answers asked again of another server with as many "
        f"tokens cached gave the same tokens (logprobs within {diff:.1g})"
    )


def _kvpool_moves(run: ConfigRun) -> str:
    """kvpool's load decisions and write efficiency over the replay ("" for others)."""
    if run.name != "kvpool":
        return ""
    eff = run.write_efficiency
    return (
        f", {run.recomputed_tokens:,} tokens of pool hits computed instead of loaded, "
        f"{run.bytes_saved / 2**20:,.0f} MiB written and {run.bytes_loaded / 2**20:,.0f} "
        f"read (" + ("-" if eff is None else f"{eff:.2f}") + " read per byte written)"
    )


def _row(result: TraceBench, run: ConfigRun) -> tuple[str, ...]:
    ttft = run.ttfts_ms()
    e2e = sorted(a.e2e_s * 1000 for a in run.answers if a.e2e_s is not None)
    tokens = sum(run.tokens.values())
    local, pool = run.tokens["local_cache_hit"], run.tokens["external_kv_transfer"]
    wall = run.wall_s or float("nan")
    return (
        run.name,
        _ms(percentile(ttft, 50)),
        _ms(percentile(ttft, 90)),
        _ms(percentile(ttft, 99)),
        _ms(percentile(e2e, 50)),
        f"{len(run.answers) / wall:.2f}",
        f"{result.prompt_tokens / wall:.0f}",
        _pct(local, tokens),
        _pct(pool, tokens),
        _pct(local + pool, tokens),
        _pct(run.missed_tokens, result.prompt_tokens),
        str(run.errors),
    )


def trace_chart(result: TraceBench) -> str:
    """Each configuration's TTFT distribution (share of turns answered within x ms)."""
    series = []
    for run in result.runs:
        ttft = run.ttfts_ms()
        n = len(ttft)
        series.append(Series(run.name, tuple((v, 100 * (i + 1) / n) for i, v in enumerate(ttft))))
    title = f"TTFT of {result.turns} turns, {result.fleet.servers} servers, {result.pacing.router}"
    return line_chart(title, "TTFT (ms)", "% of turns within", series, y_max=100)


@bench.command("trace")
@click.argument("trace_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--servers", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--router", default="round-robin", show_default=True, type=click.Choice(ROUTERS))
@click.option("--connectors", default=",".join(CONFIGS), show_default=True,
              help="Fleets to run: none (each server's own cache), kvpool, mooncake "
                   "(vLLM's in-tree MooncakeStoreConnector).")  # fmt: skip
@click.option("--shape", default="small-gqa", show_default=True,
              help=f"KV shape: one of {', '.join(SHAPES)}, or LxHxD[:dtype].")  # fmt: skip
@click.option("--hidden", default=1536, show_default=True, type=click.IntRange(min=64),
              help="The random model's hidden size: with --intermediate, its compute per KV "
                   "byte (a tiny one makes recomputing artificially cheap).")  # fmt: skip
@click.option("--intermediate", default=5376, show_default=True, type=click.IntRange(min=64))
@click.option("--block-tokens", default=32, show_default=True, type=click.IntRange(min=1),
              help="Tokens per trace block (the trace's 512, scaled down).")  # fmt: skip
@click.option("--start", "start_s", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Keep sessions starting this many seconds into the trace or later.")  # fmt: skip
@click.option("--duration", "duration_s", default=None, type=click.FloatRange(min=0),
              help="... and before start + duration (default: to the end).")  # fmt: skip
@click.option("--sessions", default=12, show_default=True, type=click.IntRange(min=1),
              help="A seeded sample of that many of those sessions (whole sessions).")  # fmt: skip
@click.option("--min-turns", default=3, show_default=True, type=click.IntRange(min=1),
              help="Only sessions of at least this many requests.")  # fmt: skip
@click.option("--max-prompt", default=2048, show_default=True, type=click.IntRange(min=2),
              help="Leave out sessions with a longer prompt (tokens, after scaling).")  # fmt: skip
@click.option("--output-tokens", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--concurrency", default=None, type=click.IntRange(min=1),
              help="Requests in flight at most (default: one per server).")  # fmt: skip
@click.option("--speedup", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Send turns at the trace's arrival times divided by this (default: "
                   "ignore arrival times).")  # fmt: skip
@click.option("--pool-size", default="2GiB", show_default=True, callback=_size)
@click.option("--kv-cache", default="1GiB", show_default=True, callback=_size,
              help="Each server's own KV cache (vLLM's --kv-cache-memory-bytes).")  # fmt: skip
@click.option(
    "--load-decision",
    default="measured",
    show_default=True,
    type=click.Choice(POLICIES),
    help="kvpool's load_decision setting",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--json", "as_json", is_flag=True)
@click.option("--table", "table_only", is_flag=True, hidden=True, help=TABLE_HELP)
@plot_option("each fleet's TTFT distribution")
def bench_trace(
    trace_file: Path,
    servers: int,
    router: str,
    connectors: str,
    shape: str,
    hidden: int,
    intermediate: int,
    block_tokens: int,
    start_s: float,
    duration_s: float | None,
    sessions: int,
    min_turns: int,
    max_prompt: int,
    output_tokens: int,
    concurrency: int | None,
    speedup: float | None,
    pool_size: int,
    kv_cache: int,
    load_decision: str,
    seed: int,
    workdir: Path | None,
    as_json: bool,
    table_only: bool,
    plot: Path | None,
) -> None:
    """Replay a trace (Mooncake's format) on a fleet of vllm serve, with and without a pool."""
    from kvpool.bench.fleet import run_trace_bench

    names = connectors_or_fail(connectors, CONFIGS)
    sample = Sample(
        block_tokens=block_tokens,
        start_s=start_s,
        duration_s=duration_s,
        sessions=sessions,
        min_turns=min_turns,
        max_prompt=max_prompt,
        seed=seed,
    )
    try:
        turns = select(read_trace(trace_file), sample)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    fleet = Fleet(
        shape_or_fail(shape),
        hidden=hidden,
        intermediate=intermediate,
        servers=servers,
        pool_bytes=pool_size,
        kv_cache_bytes=kv_cache,
        load_decision=load_decision,
    )
    pacing = Pacing(
        block_tokens=block_tokens,
        output_tokens=output_tokens,
        router=router,
        concurrency=concurrency if concurrency or speedup else servers,
        speedup=speedup,
    )
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-trace-") as tmp,
        PhaseBars(disable=table_only or as_json) as bars,
    ):
        result = run_trace_bench(
            workdir or Path(tmp),
            turns,
            trace=trace_file.name,
            fleet=fleet,
            pacing=pacing,
            configs=names,
            on_progress=bars,
        )
    print_result(
        result, trace_table, table_only=table_only, as_json=as_json, plot=plot, chart=trace_chart
    )

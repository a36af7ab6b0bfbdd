"""``kvpool bench lookup``: the lookup service's latency and store round trips.

    bench lookup                  per parallel layout and prompt length, client-side
                                  latency of hits, partial hits and misses, the
                                  store's share and its calls per lookup; exits 1 if
                                  a lookup answered wrong or made more than
                                  ``MAX_ROUNDS`` store calls
    lookup_bench_table(result)    the table (prints nothing)
    lookup_summary_table(result)  the README report's table (``--table``)

The pool is ``--master`` or a pool file (``bench_cmd.pool_options``); without
one (or with ``--temp-pool``), a temporary local pool.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import click
from rich.table import Table

from kvpool.bench.lookup import DEFAULT_PROMPTS, LAYOUTS, LookupBench, run_lookup_bench
from kvpool.cli.bench_cmd import _given_config, _pool_or_temporary, bench, pool_options
from kvpool.cli.console import TABLE_HELP, bench_table, table_rows
from kvpool.errors import KVPoolError
from kvpool.lookup.search import MAX_ROUNDS

__all__ = ["lookup_bench_table", "lookup_summary_table"]


def _tokens(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        out = tuple(
            int(v[:-1]) * 1024 if v.lower().endswith("k") else int(v)
            for v in (p.strip() for p in value.split(","))
            if v
        )
    except ValueError:
        raise click.BadParameter("give token counts, e.g. 1k,3k,8k,32k") from None
    if not out or min(out) < 2:
        raise click.BadParameter("give token counts >= 2, e.g. 1k,3k,8k,32k")
    return out


def _layouts(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        raise click.BadParameter(f"choose among {', '.join(LAYOUTS)}")
    return names


def _prompt(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _p50(ms: float, target: float | None) -> str:
    if target is None:
        return f"{ms:.2f}"
    style = "green" if ms <= target else "red"
    return f"[{style}]{ms:.2f}[/{style}]"


def lookup_bench_table(bench: LookupBench) -> Table:
    """One row per layout and prompt: client-side latency, store share, round trips."""
    t = Table(
        title=(
            f"kvpool bench lookup: {bench.master_address}, chunk {bench.chunk_size} tokens, "
            f"{bench.lookups} lookups per row (hit, partial hit, miss in turn)"
        ),
        caption=(
            "ms, client side over IPC; keys: a probe of every key, probed: what the search "
            "asked per lookup; direct: the same lookups answered in-process without the "
            "socket; target: every p50 within the row's target (fixed in "
            "kvpool.bench.lookup.TARGETS_MS; vLLM's in-tree connector is not measured here)"
        ),
    )
    columns = ("layout", "prompt", "keys", "probed", "hit p50", "partial p50", "miss p50")
    for name in (
        *columns,
        "p99",
        "target",
        "direct p50",
        "store p50",
        "rounds",
        "round trips",
        "failures",
    ):
        t.add_column(name, justify="left" if name == "layout" else "right")
    for c in bench.cases:
        trips = c.round_trips_per_lookup
        target = c.target_ms
        t.add_row(
            c.layout,
            _prompt(c.prompt_tokens),
            str(c.keys),
            f"{c.keys_probed:.0f}",
            _p50(c.hit_p50_ms, target),
            _p50(c.partial_p50_ms, target),
            _p50(c.miss_p50_ms, target),
            f"{c.p99_ms:.2f}",
            "" if target is None else f"{target:g}",
            f"{c.direct_p50_ms:.2f}",
            f"{c.store_p50_ms:.2f}",
            f"{c.exists_calls_max}",
            "n/a" if trips is None else f"{trips:.2g}",
            str(c.failures) if not c.failures else f"[red]{c.failures}[/red]",
        )
    return t


def lookup_summary_table(bench: LookupBench) -> Table:
    """The report's table (``--table``), ms: p50 of hits, partial hits (part) and
    misses over the socket; of the same lookups answered in-process (direct); of
    one store call (store); keys a search asked (asked), and its most store
    calls (calls) per lookup."""
    t = bench_table(
        "kvpool bench lookup, p50 ms",
        ("layout", "prompt", "keys", "asked", "hit", "part", "miss", "direct", "store",
         "calls", "fail"),
    )  # fmt: skip
    t.columns[0].no_wrap = True  # a layout's name whole; the numbers' columns give way
    t.columns[0].min_width = max((len(c.layout) for c in bench.cases), default=6)
    for c in bench.cases:
        t.add_row(
            c.layout,
            _prompt(c.prompt_tokens),
            str(c.keys),
            f"{c.keys_probed:.0f}",
            *(f"{ms:.2f}" for ms in (c.hit_p50_ms, c.partial_p50_ms, c.miss_p50_ms)),
            f"{c.direct_p50_ms:.2f}",
            f"{c.store_p50_ms:.2f}",
            str(c.exists_calls_max),
            str(c.failures),
        )
    return t


@bench.command("lookup")
@pool_options()
@click.option(
    "--temp-pool",
    is_flag=True,
    help="Start a temporary local pool for the run (the default when no pool is configured).",
)
@click.option(
    "--prompts",
    default=",".join(f"{p // 1024}k" for p in DEFAULT_PROMPTS),
    show_default=True,
    callback=_tokens,
    help="Prompt lengths in tokens, comma separated.",
)
@click.option(
    "--layouts",
    default=",".join(LAYOUTS),
    show_default=True,
    callback=_layouts,
    help="Parallel layouts, comma separated.",
)
@click.option("--chunk-size", default=16, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--lookups", default=400, show_default=True, type=click.IntRange(min=2, max=100000),
    help="Timed lookups per row (hits, partial hits and misses in turn).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
@click.option("--table", "table_only", is_flag=True, hidden=True, help=TABLE_HELP)
def lookup_cmd(
    master: str | None,
    pool_file: str | None,
    temp_pool: bool,
    prompts: tuple[int, ...],
    layouts: tuple[str, ...],
    chunk_size: int,
    lookups: int,
    as_json: bool,
    table_only: bool,
) -> None:
    """Scheduler-side lookup latency and store round trips per lookup."""
    from kvpool.cli.console import console

    if min(prompts) <= chunk_size:
        raise click.BadParameter(f"every prompt must be longer than --chunk-size ({chunk_size})")
    given = _given_config(master, pool_file)
    use = None if temp_pool or not given.master_address else given
    with _pool_or_temporary(use, 256 << 20) as config:
        result = run_lookup_bench(config, prompts, layouts, chunk_size, lookups)
    if as_json:
        click.echo(json.dumps(asdict(result)))
    elif table_only:
        click.echo(table_rows(lookup_summary_table(result)))
    else:
        console.print(lookup_bench_table(result))
    failed = sum(c.failures for c in result.cases)
    if failed or any(c.exists_calls_max > MAX_ROUNDS for c in result.cases):
        raise KVPoolError(
            f"{failed} lookups answered wrong, or a lookup made more than {MAX_ROUNDS} store calls"
        )

"""``kvpool bench``: measurements against a running pool.

    bench store   write and read 256 KiB, 1 MiB and 4 MiB objects through kvpool's
                  framed Mooncake layer and through raw Mooncake calls on the same
                  bytes, beside a numpy copy; medians over --repeats; exits 1 if any
                  object failed or came back different

The pool is ``--master HOST:PORT`` or, by default, the pool file of ``kvpool up``
(``--pool-file`` to pick another). ``store_bench_table`` builds the table and
prints nothing.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import click
from rich.table import Table

from kvpool.bench.store import DEFAULT_SIZES, StoreBench, run_store_bench
from kvpool.config import PoolConfig, load_config, parse_size
from kvpool.errors import ConfigError, KVPoolError

TARGET_RATIO = 0.90  # ours/raw throughput we aim for


def _sizes(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(parse_size(v.strip(), "size") for v in value.split(",") if v.strip())
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    if not sizes or min(sizes) <= 0:
        raise click.BadParameter("give positive sizes, e.g. 256KiB,1MiB,4MiB")
    return sizes


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        return parse_size(value, param.name or "size")
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


def _label(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


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


@click.group()
def bench() -> None:
    """Measure a running pool."""


@bench.command("store")
@click.option("--master", metavar="HOST:PORT", help="mooncake_master to use (default: pool file).")
@click.option(
    "--pool-file",
    type=click.Path(dir_okay=False),
    help="Pool file to read (default: the one `kvpool up` writes).",
)
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


def _config(master: str | None, pool_file: str | None, checksum: bool) -> PoolConfig:
    extra: dict[str, Any] = {"checksum": checksum}
    if master:
        extra["master_address"] = master
    if pool_file:
        extra["pool_file"] = pool_file
    config = load_config(extra)
    config.require_master()
    return config


# -- kvpool bench lookup (the lookup service's benchmark) -------------------------

from kvpool.bench.lookup import DEFAULT_PROMPTS, LAYOUTS, LookupBench, run_lookup_bench  # noqa: E402

LOOKUP_TARGET_MS = 1.0  # median at 3k tokens, tp1
LOOKUP_IN_TREE = "vLLM's in-tree connector: 1.64 ms miss / 1.93 ms hit"


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


def _median_ms(ms: float, target: bool) -> str:
    if not target:
        return f"{ms:.2f}"
    style = "green" if ms <= LOOKUP_TARGET_MS else "red"
    return f"[{style}]{ms:.2f}[/{style}]"


def lookup_bench_table(bench: LookupBench) -> Table:
    """One row per layout and prompt: client-side latency, store share, round trips."""
    t = Table(
        title=(
            f"kvpool bench lookup: {bench.master_address}, chunk {bench.chunk_size} tokens, "
            f"{bench.lookups // 2} hits + {bench.lookups - bench.lookups // 2} misses per row"
        ),
        caption=(
            f"ms, client side over IPC; target: hit and miss p50 <= {LOOKUP_TARGET_MS} ms at "
            f"3k tokens, tp1 ({LOOKUP_IN_TREE})"
        ),
    )
    for name in ("layout", "prompt", "keys", "hit p50", "hit p99", "miss p50", "miss p99"):
        t.add_column(name, justify="left" if name == "layout" else "right")
    for name in ("store p50", "exists calls", "round trips", "failures"):
        t.add_column(name, justify="right")
    for c in bench.cases:
        target = c.layout == "tp1" and c.prompt_tokens == 3072
        trips = c.round_trips_per_lookup
        t.add_row(
            c.layout,
            f"{c.prompt_tokens // 1024}k" if c.prompt_tokens % 1024 == 0 else str(c.prompt_tokens),
            str(c.keys_probed),
            _median_ms(c.hit_p50_ms, target),
            f"{c.hit_p99_ms:.2f}",
            _median_ms(c.miss_p50_ms, target),
            f"{c.miss_p99_ms:.2f}",
            f"{c.store_p50_ms:.2f}",
            f"{c.exists_calls_per_lookup:g}",
            "n/a" if trips is None else (f"{trips:g}" if trips == 1 else f"[red]{trips:g}[/red]"),
            str(c.failures) if not c.failures else f"[red]{c.failures}[/red]",
        )
    return t


@bench.command("lookup")
@click.option("--master", metavar="HOST:PORT", help="mooncake_master to use (default: pool file).")
@click.option(
    "--pool-file",
    type=click.Path(dir_okay=False),
    help="Pool file to read (default: the one `kvpool up` writes).",
)
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
    help="Timed lookups per row (half hits, half misses).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def lookup_cmd(
    master: str | None,
    pool_file: str | None,
    temp_pool: bool,
    prompts: tuple[int, ...],
    layouts: tuple[str, ...],
    chunk_size: int,
    lookups: int,
    as_json: bool,
) -> None:
    """Scheduler-side lookup latency and store round trips per lookup."""
    import tempfile

    from kvpool.cli.console import console
    from kvpool.pool import LocalPool

    if min(prompts) <= chunk_size:
        raise click.BadParameter(f"every prompt must be longer than --chunk-size ({chunk_size})")
    extra: dict[str, Any] = {"master_address": master} if master else {}
    if pool_file:
        extra["pool_file"] = pool_file
    config = load_config(extra)
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-pool-") as home:
        pool = None
        if temp_pool or not config.master_address:
            pool = LocalPool.start(home, segment_size=256 << 20)
            config = pool.config()
        try:
            result = run_lookup_bench(config, prompts, layouts, chunk_size, lookups)
        finally:
            if pool is not None:
                pool.stop()
    if as_json:
        click.echo(json.dumps(asdict(result)))
    else:
        console.print(lookup_bench_table(result))
    failed = sum(c.failures for c in result.cases)
    if failed or any(c.exists_calls_per_lookup != 1 for c in result.cases):
        raise KVPoolError(f"{failed} lookups answered wrong, or a lookup made several store calls")

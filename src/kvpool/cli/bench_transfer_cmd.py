"""``kvpool bench transfer``: TransferEngine throughput against raw Mooncake.

    bench transfer                KV tensors -> pool -> KV tensors through
                                  ``TransferEngine`` (kvpool, checksum off and on,
                                  zero copy) and through raw Mooncake calls, per path
                                  and object size, and the worker hooks' idle cost;
                                  exits 1 if any chunk failed or came back different
    transfer_bench_tables(result) one table per path (prints nothing)
    transfer_hooks_table(hooks)   the idle worker hooks, microseconds per step
    transfer_verdicts(result)     one line per target: met or missed
    transfer_bench_json(result)   what ``--json`` prints

The pool is ``--master`` or ``--pool-file`` (``bench_cmd.pool_options``), else a
temporary local pool with a 2 GiB holder. ``kvpool.bench.transfer`` imports
torch, so only the command itself imports it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich import box
from rich.table import Table

from kvpool.cli.bench_cmd import (
    TARGET_RATIO,
    _config,
    _label,
    _pool_or_temporary,
    _size,
    _sizes,
    bench,
    pool_options,
)
from kvpool.cli.charts import Series, line_chart, plot_option
from kvpool.cli.console import TABLE_HELP, table_rows
from kvpool.errors import KVPoolError

if TYPE_CHECKING:  # the module imports torch: only the command itself loads it
    from kvpool.bench.hooks import HookOverhead
    from kvpool.bench.transfer import SizeResult as TransferSize
    from kvpool.bench.transfer import TransferBench

__all__ = [
    "TRANSFER_PATHS",
    "TRANSFER_SIZES",
    "transfer_bench_json",
    "transfer_bench_tables",
    "transfer_hooks_table",
    "transfer_summary_table",
    "transfer_verdicts",
]

TRANSFER_PATHS = ("tcp", "shm")  # kvpool.bench.transfer.PATHS
TRANSFER_SIZES = "32KiB,256KiB,1MiB"  # kvpool.bench.transfer.DEFAULT_SIZES
E2E_TARGET_GBPS = 2.5  # same host, KV tensors -> pool -> KV tensors
TARGET_SIZES = (256 << 10, 1 << 20)  # the ratio targets hold for objects in this range
TRANSFER_POOL_SEGMENT = 2 << 30  # the temporary pool's holder


def _paths(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    if not names or any(n not in TRANSFER_PATHS for n in names):
        raise click.BadParameter(f"choose among {', '.join(TRANSFER_PATHS)}")
    return names


def _gb(x: float) -> str:
    return f"{x:.2f}"


def _pair(a: float, b: float, target: float | None) -> str:
    """``a/b`` ratios; coloured against ``target`` when one applies."""
    if target is None:
        return f"{a:.2f}/{b:.2f}"
    return f"{_ratio_style(a, target)}/{_ratio_style(b, target)}"


def _div(a: float, b: float) -> float:
    return a / b if b else 0.0


def _ratio_style(r: float, target: float) -> str:
    style = "green" if r >= target else "red"
    return f"[{style}]{r:.2f}[/{style}]"


def _in_target_range(r: TransferSize) -> bool:
    return TARGET_SIZES[0] <= r.size <= TARGET_SIZES[1]


def _path_title(r: TransferSize) -> str:
    if r.transport == "shared memory":
        return f"{r.path}: same-host shared memory to the holder, {r.load_mode} loads"
    if r.path == "shm":
        return (
            f"{r.path}: shared memory unavailable, fell back to {r.transport}, {r.load_mode} loads"
        )
    return f"{r.path}: loopback {r.transport}, {r.load_mode} loads into the KV tensors"


_VARIANT_LABELS = {
    "raw": "raw",
    "kvpool": "kvpool",
    "kvpool+checksum": "kvpool+sum",
    "kvpool+secret": "kvpool+sig",
    "zero-copy": "0-copy",
    "zero-copy+checksum": "0-copy+sum",
}


def transfer_bench_tables(bench: TransferBench) -> list[Table]:
    """One table per path: per object size raw Mooncake, kvpool (checksum off, on), a copy."""
    tables = []
    paths = list(dict.fromkeys(r.path for r in bench.results))
    for n, path in enumerate(paths):
        rows = [r for r in bench.results if r.path == path]
        title = _path_title(rows[0])
        if n == 0:
            title = (
                f"kvpool bench transfer: {bench.master_address}; KV tensors -> pool -> KV "
                f"tensors, {_label(bench.total_bytes)} per repeat, median of {bench.repeats}\n"
                + title
            )
        t = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True,
                  pad_edge=False)  # fmt: skip
        if n == len(paths) - 1:
            t.caption = (
                "GB/s = 1e9 payload bytes/s; e2e = bytes / (save + load); vs raw and vs copy: "
                "save/load ratios; stall = ms per repeat the caller spends in submit_save; "
                "+sum = checksum on; +sig = checksum on and every object signed with a pool "
                "secret (HMAC-SHA256); kvpool(+sum) copies blocks through staging, 0-copy "
                "moves them from KV memory the store reaches (connector setting zero_copy).\n"
                f"targets: save and load >= {TARGET_RATIO:.2f}x raw for "
                f"{_label(TARGET_SIZES[0])}-{_label(TARGET_SIZES[1])} objects; same host "
                f"e2e >= {E2E_TARGET_GBPS} GB/s"
            )
        t.add_column("object")
        t.add_column("variant")
        for name in ("save", "load", "e2e", "vs raw", "vs copy", "stall\nms", "fail"):
            t.add_column(name, justify="right")
        for i, r in enumerate(rows):
            if i:
                t.add_section()
            target = TARGET_RATIO if _in_target_range(r) else None
            sh = r.shape
            obj = (
                (
                    _label(r.size),
                    f"[dim]{sh.layers}L {sh.block_size}t {sh.kv_heads}x{sh.head_size}[/dim]",
                    f"[dim]{r.objects} chunks[/dim]",
                )
                + ("",) * (len(r.variants) - 3)
                + (f"[dim]{r.jobs} job{'s' if r.jobs > 1 else ''}[/dim]",)
            )
            nbytes = r.size * r.objects
            for j, v in enumerate(r.variants):
                ours = v.name != "raw"
                e2e = _gb(v.end_to_end)
                if ours and r.transport == "shared memory":
                    style = "green" if v.end_to_end >= E2E_TARGET_GBPS else "red"
                    e2e = f"[{style}]{e2e}[/{style}]"
                t.add_row(
                    obj[j],
                    _VARIANT_LABELS.get(v.name, v.name),
                    _gb(v.save),
                    _gb(v.load),
                    e2e,
                    _pair(_div(v.save, r.raw.save), _div(v.load, r.raw.load),
                          target if ours else None),
                    _pair(_div(v.save, r.copy), _div(v.load, r.copy), None),
                    f"{nbytes / v.submit / 1e6:.1f}" if v.submit else "-",
                    str(v.failures) if not v.failures else f"[red]{v.failures}[/red]",
                )  # fmt: skip
            t.add_row(obj[-1], "numpy copy", _gb(r.copy), "", "", "", "", "", "")
        tables.append(t)
    return tables


def transfer_hooks_table(hooks: HookOverhead) -> Table:
    """Median microseconds per idle step of the worker side."""
    t = Table(
        title=(
            "worker hooks with nothing to load or save: CPU per engine step "
            f"(median of {hooks.steps} steps)"
        )
    )
    t.add_column("what")
    t.add_column("µs", justify="right")
    t.add_row("TransferEngine.submit_save(job, []) + poll()", f"{hooks.submit_poll_us:.2f}")
    t.add_row("build an empty step plan", f"{hooks.metadata_us:.2f}")
    t.add_row(
        "Worker start_loads + start_saves + finished + load_errors + worker_meta + interval_stats",
        f"{hooks.hooks_us:.2f}",
    )
    t.add_row("  of which interval_stats (get_kv_connector_stats)", f"{hooks.stats_us:.2f}")
    t.add_row("[bold]per idle step (metadata + hooks)[/bold]", f"[bold]{hooks.step_us:.2f}[/bold]")
    return t


def transfer_verdicts(bench: TransferBench) -> list[str]:
    """One line per target: met or not, with the worst figure, checksum off and on."""
    lines = []
    in_range = [r for r in bench.results if _in_target_range(r)]
    for path in TRANSFER_PATHS:
        rows = [r for r in in_range if r.path == path]
        if not rows:
            continue
        checks: tuple[tuple[str, list[float], list[float]], ...] = (
            ("save", [r.save_ratio for r in rows], [r.checksum_save_ratio for r in rows]),
            ("load", [r.load_ratio for r in rows], [r.checksum_load_ratio for r in rows]),
            ("zero-copy save", [r.zero_save_ratio for r in rows],
             [r.zero_checksum_save_ratio for r in rows]),
            ("zero-copy load", [r.zero_load_ratio for r in rows],
             [r.zero_checksum_load_ratio for r in rows]),
        )  # fmt: skip
        for what, off, on in checks:
            if what.startswith("zero") and any(r.zero is None for r in rows):
                continue
            lines.append(
                f"{path} {what} >= {TARGET_RATIO:.2f}x raw: "
                f"checksum off {_met(min(off) >= TARGET_RATIO)} (worst {min(off):.2f}x), "
                f"checksum on {_met(min(on) >= TARGET_RATIO)} (worst {min(on):.2f}x)"
            )
    shm = [r for r in bench.results if r.transport == "shared memory"]
    for label, names in (("", ("kvpool", "kvpool+checksum")),
                         ("zero-copy ", ("zero-copy", "zero-copy+checksum"))):  # fmt: skip
        e2e = [[v.end_to_end for v in r.variants if v.name == name] for name in names for r in shm]
        if not shm or not all(e2e):
            continue
        half = len(shm)
        best_off = max(x[0] for x in e2e[:half])
        best_on = max(x[0] for x in e2e[half:])
        lines.append(
            f"same host {label}end-to-end >= {E2E_TARGET_GBPS} GB/s: "
            f"checksum off {_met(best_off >= E2E_TARGET_GBPS)} (best {best_off:.2f} GB/s), "
            f"checksum on {_met(best_on >= E2E_TARGET_GBPS)} (best {best_on:.2f} GB/s)"
        )
    for path in TRANSFER_PATHS:
        costs = [r for r in bench.results if r.path == path and r.secret is not None]
        if costs:
            figures = ", ".join(f"{_label(r.size)} {r.secret_cost:.2f}x" for r in costs)
            lines.append(
                f"{path} pool secret (signed objects): end-to-end time vs checksum only: {figures}"
            )
    return lines


def _met(ok: bool) -> str:
    return "[green]met[/green]" if ok else "[red]missed[/red]"


def transfer_bench_json(bench: TransferBench) -> dict[str, Any]:
    data = asdict(bench)
    for row, r in zip(data["results"], bench.results, strict=True):
        row["save_ratio"], row["load_ratio"] = r.save_ratio, r.load_ratio
        row["checksum_save_ratio"] = r.checksum_save_ratio
        row["checksum_load_ratio"] = r.checksum_load_ratio
        row["zero_save_ratio"], row["zero_load_ratio"] = r.zero_save_ratio, r.zero_load_ratio
        row["zero_checksum_save_ratio"] = r.zero_checksum_save_ratio
        row["zero_checksum_load_ratio"] = r.zero_checksum_load_ratio
        row["secret_cost"] = r.secret_cost
        row["failures"] = r.failures
    if bench.hooks is not None:
        data["hooks"]["step_us"] = bench.hooks.step_us
    data["failures"] = bench.failures
    return data


def transfer_summary_table(bench: TransferBench) -> Table:
    """One row per path and object size: end-to-end GB/s of each variant (KV
    tensors -> pool -> KV tensors) and of a numpy copy; what ``--table`` prints."""
    t = Table(title="kvpool bench transfer, end-to-end GB/s", box=box.SIMPLE_HEAD,
              padding=(0, 1), collapse_padding=True, pad_edge=False, show_edge=False)  # fmt: skip
    t.add_column("path")
    t.add_column("object", justify="right")
    names = ("raw", "kvpool", "kvpool+checksum", "kvpool+secret", "zero-copy",
             "zero-copy+checksum")  # fmt: skip
    short = {"kvpool+checksum": "+sum", "kvpool+secret": "+sig", "zero-copy+checksum": "0c+sum"}
    for name in names:
        t.add_column(short.get(name, _VARIANT_LABELS[name]), justify="right")
    t.add_column("copy", justify="right")
    t.add_column("fail", justify="right")
    for r in bench.results:
        by_name = {v.name: v for v in r.variants}
        path = "shm" if r.transport == "shared memory" else r.transport
        t.add_row(
            path,
            _label(r.size),
            *(_gb(by_name[n].end_to_end) if n in by_name else "-" for n in names),
            _gb(r.copy),
            str(sum(v.failures for v in r.variants)),
        )
    t.caption = (
        "GB/s = 1e9 payload bytes / (save + load seconds), medians; raw: Mooncake's own "
        "batch calls on the same bytes; kvpool: staged, checksums off; +sum: checksums on "
        "(the default); +sig: and signed with a pool secret; 0-copy, 0c+sum: zero_copy "
        "without and with checksums; copy: one numpy copy of the bytes"
    )
    return t


def transfer_chart(bench: TransferBench) -> str:
    """GB/s against object size: kvpool's saves and loads on each path, and one
    numpy copy of the same bytes (an SVG line chart, object sizes on a log-2 axis)."""
    series = []
    for path in dict.fromkeys(r.path for r in bench.results):
        rows = [r for r in bench.results if r.path == path]
        for op in ("save", "load"):
            points = tuple((r.size / 1024, getattr(r.kvpool, op)) for r in rows)
            series.append(Series(f"{rows[0].transport}: kvpool {op}", points))
    first = [r for r in bench.results if r.path == bench.results[0].path]
    series.append(Series("numpy copy", tuple((r.size / 1024, r.copy) for r in first)))
    title = f"kvpool bench transfer ({_label(bench.total_bytes)} per repeat)"
    return line_chart(title, "object size (KiB)", "GB/s (median)", series, x_log2=True)


@bench.command("transfer")
@pool_options(
    master_help="mooncake_master to use (default: a temporary pool).",
    pool_file_help="Pool file to read (default: start a temporary local pool with a 2 GiB holder).",
)
@click.option(
    "--object-sizes",
    "sizes",
    default=TRANSFER_SIZES,
    show_default=True,
    callback=_sizes,
    help="Chunk object sizes (one block over all layers), comma separated.",
)
@click.option(
    "--total",
    default="64MiB",
    show_default=True,
    callback=_size,
    help="Bytes saved and loaded per repeat (chunks = total / size).",
)
@click.option(
    "--job-size", default="16MiB", show_default=True, callback=_size,
    help="Bytes per save/load job (capped at 1024 segments per Mooncake call).",
)  # fmt: skip
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(min=1, max=100))
@click.option("--layers", default=8, show_default=True, type=click.IntRange(min=1, max=128))
@click.option(
    "--paths", "paths", default=",".join(TRANSFER_PATHS), show_default=True, callback=_paths,
    help="tcp (loopback TCP) and/or shm (same-host shared memory); loads are staged.",
)  # fmt: skip
@click.option(
    "--hook-steps", default=10_000, show_default=True, type=click.IntRange(min=0),
    help="Idle engine steps timed for the worker-hook overhead (0 skips it).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
@click.option("--table", "table_only", is_flag=True, hidden=True, help=TABLE_HELP)
@plot_option("GB/s against object size")
def transfer_cmd(
    master: str | None,
    pool_file: str | None,
    sizes: tuple[int, ...],
    total: int,
    job_size: int,
    repeats: int,
    layers: int,
    paths: tuple[str, ...],
    hook_steps: int,
    as_json: bool,
    table_only: bool,
    plot: Path | None,
) -> None:
    """Throughput of the TransferEngine, KV tensors to the pool and back, against raw Mooncake."""
    import os

    from rich.console import Group

    from kvpool.bench.paged_kv import kv_shape_for
    from kvpool.bench.transfer import run_transfer_bench
    from kvpool.cli.console import PhaseBars, console

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    if max(sizes) > total:
        raise click.BadParameter(f"object sizes must not exceed --total ({total} bytes)")
    for s in sizes:
        try:
            kv_shape_for(s, layers)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    given = _config(master, pool_file, checksum=True) if master or pool_file else None
    with PhaseBars(transient=True, disable=as_json or table_only) as bars:
        bars("pool", 0, 1)
        with _pool_or_temporary(given, TRANSFER_POOL_SEGMENT) as config:
            bars("pool", 1, 1)
            result = run_transfer_bench(
                config, sizes, total, repeats, paths, layers, job_size, hook_steps, bars
            )
    if table_only:
        click.echo(table_rows(transfer_summary_table(result)))
    elif as_json:
        click.echo(json.dumps(transfer_bench_json(result)))
    else:
        parts: list[Any] = [*transfer_bench_tables(result)]
        if result.hooks is not None:
            parts.append(transfer_hooks_table(result.hooks))
        parts.extend(transfer_verdicts(result))
        console.print(Group(*parts))
    if plot is not None:
        plot.write_text(transfer_chart(result))
        click.echo(f"chart written to {plot}", err=True)
    if result.failures:
        raise KVPoolError(f"{result.failures} chunk transfers failed or came back different")

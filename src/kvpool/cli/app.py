"""``kvpool`` commands: option parsing, the one error boundary and exit codes.

Commands print tables built by ``render`` (or by their bench's own renderer) on one
console; with ``--json`` (where a command has it) one JSON object instead.
Bad input exits 2 with one line on stderr; a kvpool error exits 1 likewise.
"""

from __future__ import annotations

import json
import logging
import math
import sys

import click

# importing a bench_*_cmd module registers its `kvpool bench` command
from kvpool.cli import bench_capacity_cmd as _bench_capacity  # noqa: F401
from kvpool.cli import bench_ha_cmd as _bench_ha  # noqa: F401
from kvpool.cli import bench_lookup_cmd as _bench_lookup  # noqa: F401
from kvpool.cli import bench_report_cmd as _bench_report  # noqa: F401
from kvpool.cli import bench_serve_cmd as _bench_serve  # noqa: F401
from kvpool.cli import bench_store_cmd as _bench_store  # noqa: F401
from kvpool.cli import bench_trace_cmd as _bench_trace  # noqa: F401
from kvpool.cli import bench_transfer_cmd as _bench_transfer  # noqa: F401
from kvpool.cli import bench_vllm_cmd as _bench_vllm  # noqa: F401
from kvpool.cli import render
from kvpool.cli.bench_cmd import bench
from kvpool.cli.chaos_cmd import chaos
from kvpool.cli.console import console
from kvpool.cli.demo_cmd import demo
from kvpool.cli.pool_cmd import down, status, up
from kvpool.cli.purge_cmd import purge
from kvpool.errors import KVPoolError
from kvpool.keys import KeySpace
from kvpool.layout import GroupSpec, Layout, even_stages
from kvpool.plan import ReaderRank, build_plan, read_across
from kvpool.settings import parse_layer_bands


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level.")
def cli(verbose: bool) -> None:
    """kvpool: a shared KV-cache pool for vLLM engines on Mooncake Store."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


@cli.command()
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--pp", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--pcp", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--dcp", default=1, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--dp-index",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Global DP index of the engine (names it; never changes keys).",
)
@click.option(
    "--group",
    "groups",
    multiple=True,
    metavar="KIND[:HEADS]",
    help="A KV group: mla, mamba, gqa:N or mha:N; a sliding window as gqa:N:wTOKENS. "
    "Repeat for hybrid models.",
)
@click.option(
    "--kv-heads",
    type=click.IntRange(min=1),
    default=None,
    help="Shorthand for one gqa group with this many KV heads.",
)
@click.option("--chunks", default=16, show_default=True, type=click.IntRange(min=1, max=100000))
@click.option("--model", default="example/model", show_default=True)
@click.option(
    "--read-tp",
    type=click.IntRange(min=1),
    default=None,
    help="Also show what an engine of this TP size (same model, pp, pcp, dcp) reads "
    "of this layout's objects.",
)
@click.option(
    "--read-pp",
    type=click.IntRange(min=1),
    default=None,
    help="Also show what an engine of this PP size reads (with --read-tp: of both). "
    "Both use one layer-band grid: --layer-bands, or by default the layers where a "
    "stage of either begins.",
)
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=None,
    help="The model's layer count (default: one per PP stage).",
)
@click.option(
    "--layer-bands",
    default=None,
    metavar="L1,L2,...",
    help="The layers where a layer band begins (the connector's layer_bands); "
    "default: where each PP stage begins.",
)
@click.option(
    "--read-dcp",
    type=click.IntRange(min=1),
    default=None,
    help="Also show what an engine of this DCP size reads (with --read-tp: its TP). "
    "Both use one token grid: --token-classes, or by default the larger DCP size "
    "when one divides the other.",
)
@click.option(
    "--token-classes",
    type=click.IntRange(min=1),
    default=None,
    help="Token classes per block (the connector's token_classes; default: dcp).",
)
@click.option(
    "--heads-per-object",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="KV heads per pool object (the connector's heads_per_object).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def plan(
    tp: int,
    pp: int,
    pcp: int,
    dcp: int,
    dp_index: int,
    groups: tuple[str, ...],
    kv_heads: int | None,
    chunks: int,
    model: str,
    read_tp: int | None,
    read_pp: int | None,
    layers: int | None,
    layer_bands: str | None,
    read_dcp: int | None,
    token_classes: int | None,
    heads_per_object: int,
    as_json: bool,
) -> None:
    """Show who writes and who reads every key of a parallel layout."""
    specs: list[str | GroupSpec] = list(groups)
    if kv_heads is not None:
        specs.append(f"gqa:{kv_heads}")
    if not specs:
        raise click.UsageError(
            "give the model's KV groups: --group mla, --group gqa:8 (repeatable) or --kv-heads N"
        )

    def space_of(layout: Layout) -> KeySpace:
        return KeySpace.create(
            model=model,
            layout=layout,
            kv_dtype="bfloat16",
            model_dtype="bfloat16",
            chunk_size=16,
            head_size=128,
            num_layers=layout.layers,
        )

    bands = None if layer_bands is None else list(parse_layer_bands(layer_bands, "--layer-bands"))
    reading = read_tp is not None or read_pp is not None or read_dcp is not None
    r_tp, r_pp, r_dcp = read_tp or tp, read_pp or pp, read_dcp or dcp
    if read_pp is not None and read_pp != pp and layers is None:
        raise click.UsageError("--read-pp needs the model's layer count: --layers N")
    if bands is None and reading and layers:  # one grid: where a stage of either begins
        bands = sorted({first for n in (pp, r_pp) for first, _ in even_stages(layers, n)})
    if token_classes is None and reading:  # one grid for both DCP sizes
        token_classes = math.lcm(dcp, r_dcp)
    common = {"pcp": pcp, "groups": specs, "layers": layers, "layer_bands": bands,
              "heads_per_object": heads_per_object, "token_classes": token_classes}  # fmt: skip
    layout = Layout.create(tp=tp, pp=pp, dcp=dcp, dp_index=dp_index, **common)  # type: ignore[arg-type]
    result = build_plan(layout, space_of(layout), chunks)
    readers: tuple[ReaderRank, ...] = ()
    reader = layout
    if reading:
        reader = Layout.create(tp=r_tp, pp=r_pp, dcp=r_dcp, **common)  # type: ignore[arg-type]
        readers = read_across(result, reader, space_of(reader))
    if as_json:
        data = render.plan_json(result)
        if reading:
            data["reader"] = render.reader_json(reader, readers)
        click.echo(json.dumps(data))
        return
    console.print(render.plan_ranks_table(result))
    console.print(render.plan_totals_table(result))
    if reading and readers:
        console.print(render.plan_reader_table(result, reader, readers))
    elif reading:
        console.print(
            f"an engine at tp={r_tp} pp={r_pp} shares no object with this layout: a mamba "
            "group's state slices depend on tp, so its keys differ"
        )


@cli.command("settings")
def settings_cmd() -> None:
    """Every kv_connector_extra_config setting: default, KVPOOL_* override, meaning."""
    from kvpool.settings import settings_table

    click.echo(settings_table(), nl=False)


for command in (up, down, status, purge, bench, demo, chaos):
    cli.add_command(command)


def run(argv: list[str] | None = None) -> int:
    """Run the CLI; map every error to one line on stderr and an exit status."""
    try:
        rv = cli.main(args=argv, prog_name="kvpool", standalone_mode=False)
    except click.exceptions.Abort:
        print("kvpool: aborted", file=sys.stderr)
        return 130
    except click.ClickException as exc:
        print(f"kvpool: error: {exc.format_message()}", file=sys.stderr)
        return 2
    except KVPoolError as exc:
        print(f"kvpool: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except OSError as exc:  # a file, socket or URL (a server gone) failed
        print(f"kvpool: error: {exc}", file=sys.stderr)
        return 1
    return rv if isinstance(rv, int) else 0

"""``kvpool bench report``: the README's bench tables, made again by their commands.

    REPORTS[name]            a README table: the ``kvpool`` command line that makes
                             it (a bench, or the demo), and the table function whose
                             columns it has
    readme_blocks(text)      the report blocks of a README: (name, command, date,
                             machine, table lines) each
    put_block(text, name, command, table, date, machine)
                             the README with that block's content replaced
    machine_name()           this machine as a block names it: CPU model, cores
    kvpool bench report [--readme FILE] [--only NAMES]
                             run each table's command (``--table``: header and
                             rows, 80 columns) and write it into its block
    kvpool bench report --check [--band B] [--only NAMES]
                             run the commands of the blocks made on this machine
                             (CPU model and cores as the block names them; others
                             are skipped, said) and compare, writing nothing: exit
                             1 where a number is off by more than ``--band``
                             (``kvpool.bench.drift``)

A block in the README reads::

    <!-- report vllm -->
        $ kvpool bench vllm --lengths 1000   # 6 December 2026, AMD EPYC, 2 cores
        connector  len prefill ...
        ...
    <!-- /report -->

The command line is the one run, the date the day it ran, the machine the one it
ran on; nothing else writes inside a block. A unit test checks every block's form
against ``REPORTS`` (its command, its column names, a date and a machine): the
columns cannot drift from what the command prints, but the numbers are checked by
nobody but the command that wrote them (run it again to compare).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from kvpool.bench.drift import table_drift
from kvpool.cli.bench_cmd import bench
from kvpool.cli.console import console

__all__ = ["REPORTS", "Report", "put_block", "readme_blocks"]

_OPEN = re.compile(r"^<!-- report ([a-z0-9-]+) -->$", re.M)
_CLOSE = "<!-- /report -->"
_COMMAND = re.compile(r"^    \$ (kvpool .+?)\s+# (\d{1,2} [A-Z][a-z]+ \d{4}), (\S.*)$")


@dataclass(frozen=True)
class Report:
    args: tuple[str, ...]  # after ``kvpool``
    empty_table: Callable[[], Any]  # the command's table with no rows: its columns

    @property
    def command(self) -> str:
        return shlex.join(["kvpool", *self.args])


def _vllm_table() -> Any:
    from kvpool.bench.engines import EngineBench
    from kvpool.cli.bench_vllm_cmd import engine_bench_table
    from kvpool.demo.shapes import SHAPES

    return engine_bench_table(EngineBench(SHAPES["small"], (), (), (), ()))


def _serve_table() -> Any:
    from kvpool.bench.serve import ServeBench, Workload
    from kvpool.cli.bench_serve_cmd import serve_bench_table
    from kvpool.demo.shapes import SHAPES

    return serve_bench_table(ServeBench(SHAPES["small"], Workload(), ()))


def _capacity_table() -> Any:
    from kvpool.bench.capacity import CapacityBench, CapacityWorkload
    from kvpool.cli.bench_capacity_cmd import capacity_table
    from kvpool.demo.shapes import SHAPES

    return capacity_table(CapacityBench(SHAPES["small"], CapacityWorkload(), ()))


def _transfer_table() -> Any:
    from kvpool.bench.transfer import TransferBench
    from kvpool.cli.bench_transfer_cmd import transfer_summary_table

    return transfer_summary_table(TransferBench((), "", 0, 0, 0))


def _lookup_table() -> Any:
    from kvpool.bench.lookup import LookupBench
    from kvpool.cli.bench_lookup_cmd import lookup_summary_table

    return lookup_summary_table(LookupBench((), "", 0, 0))


def _trace_table() -> Any:
    from kvpool.bench.fleet import Fleet, TraceBench
    from kvpool.bench.replay import Pacing
    from kvpool.cli.bench_trace_cmd import trace_table
    from kvpool.demo.shapes import SHAPES

    return trace_table(TraceBench("", Fleet(SHAPES["small-gqa"]), Pacing(), 0, 0, 0, 0, 0, 0))


def _demo_table() -> Any:
    from kvpool.cli.demo_cmd import demo_request_table
    from kvpool.demo.run import DemoReport

    return demo_request_table(DemoReport([], {}, {}, 0, 0, ""))


ZERO_COPY_EXTRA = (
    '{"zero_copy":true,"heads_per_object":8,"load_by_layer":true,"layer_bands":[0,8,16,24]}'
)

REPORTS: dict[str, Report] = {
    "demo": Report(("demo",), _demo_table),
    "vllm": Report(
        ("bench", "vllm", "--shape", "llama3-8b", "--lengths", "1000,4000"), _vllm_table
    ),
    "vllm-small": Report(
        ("bench", "vllm", "--shape", "small", "--lengths", "2000,3000"), _vllm_table
    ),
    # The same-host settings that load fastest here (README, "Loading by layer").
    "vllm-zero-copy": Report(
        (
            "bench",
            "vllm",
            "--shape",
            "llama3-8b",
            "--lengths",
            "4000",
            "--connectors",
            "kvpool",
            "--extra",
            ZERO_COPY_EXTRA,
        ),
        _vllm_table,
    ),
    "serve": Report(("bench", "serve", "--shape", "llama3-8b"), _serve_table),
    "trace": Report(
        ("bench", "trace", "traces/conversation_trace.jsonl.gz", "--speedup", "60"), _trace_table
    ),
    "capacity": Report(("bench", "capacity", "--repeats", "3"), _capacity_table),
    "transfer": Report(("bench", "transfer"), _transfer_table),
    "lookup": Report(
        ("bench", "lookup", "--prompts", "3k,32k,128k", "--layouts", "tp1,tp8-gqa8"),
        _lookup_table,
    ),
}


@dataclass(frozen=True)
class Block:
    name: str
    command: str
    date: str
    machine: str  # CPU model and cores, as machine_name() says
    table: tuple[str, ...]  # header, rule, rows (indent removed)


def readme_blocks(text: str) -> list[Block]:
    """Every report block of ``text``; ``ValueError`` naming a malformed one."""
    blocks = []
    for m in _OPEN.finditer(text):
        name = m.group(1)
        end = text.find(_CLOSE, m.end())
        if end < 0:
            raise ValueError(f"report block {name!r} has no {_CLOSE} line")
        lines = text[m.end() : end].strip("\n").split("\n")
        first = _COMMAND.match(lines[0]) if lines else None
        if first is None:
            raise ValueError(
                f"report block {name!r} must begin with "
                "'    $ kvpool ...   # D Month YYYY, CPU MODEL, N cores'"
            )
        if any(line and not line.startswith("    ") for line in lines[1:]):
            raise ValueError(f"report block {name!r}: table lines are indented 4 spaces")
        table = tuple(line[4:] for line in lines[1:])
        blocks.append(Block(name, first.group(1), first.group(2), first.group(3), table))
    return blocks


def columns(header: str) -> list[str]:
    """A header row's words (column names may hold a space: compare words)."""
    return header.split()


def put_block(text: str, name: str, command: str, table: str, date: str, machine: str) -> str:
    """``text`` with block ``name``'s content replaced; ``ValueError`` if it has none."""
    m = re.search(rf"^<!-- report {re.escape(name)} -->$", text, re.M)
    end = text.find(_CLOSE, m.end()) if m else -1
    if m is None or end < 0:
        raise ValueError(f"the README has no report block {name!r} to write")
    body = f"    $ {command}   # {date}, {machine}\n" + "".join(
        f"    {line}\n" for line in table.splitlines()
    )
    return text[: m.end()] + "\n" + body + text[end:]


def machine_name() -> str:
    """This machine's CPU model (``/proc/cpuinfo``) and core count, e.g. "AMD EPYC,
    2 cores": the figures of a block hold on that machine only."""
    model = platform.processor() or platform.machine() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = " ".join(line.split(":", 1)[1].split())
                break
    return f"{model}, {os.cpu_count() or 1} cores"


def _today() -> str:
    d = datetime.date.today()
    return f"{d.day} {d.strftime('%B')} {d.year}"


@bench.command("report")
@click.option(
    "--readme",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=Path("README.md"),
    show_default=True,
)
@click.option(
    "--only",
    default=",".join(REPORTS),
    show_default=True,
    help="Comma-separated tables to make again.",
)
@click.option(
    "--check",
    is_flag=True,
    help="Compare instead of writing: run the tables made on this machine and fail where "
    "a number is off by more than --band.",
)
@click.option(
    "--band",
    default=2.0,
    show_default=True,
    type=click.FloatRange(min=1.0),
    help="With --check: a number matches within this factor of the README's.",
)
def bench_report(readme: Path, only: str, check: bool, band: float) -> None:
    """Run the commands behind the README's bench tables and write their tables in."""
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in REPORTS]
    if unknown:
        raise click.BadParameter(
            f"{', '.join(unknown)}: the tables are {', '.join(REPORTS)}", param_hint="--only"
        )
    text = readme.read_text()
    present = {b.name for b in readme_blocks(text)}
    missing = [n for n in names if n not in present]
    if missing:
        raise click.BadParameter(
            f"{readme} has no report block for {', '.join(missing)}", param_hint="--only"
        )
    if check:
        _check(readme_blocks(text), names, band)
        return
    for name in names:
        report = REPORTS[name]
        console.print(f"running {report.command}")
        table = _run(report.args)
        text = put_block(readme.read_text(), name, report.command, table, _today(), machine_name())
        readme.write_text(text)  # after each table: a later failure keeps the earlier
        console.print(table)


def _check(blocks: Sequence[Block], names: Sequence[str], band: float) -> None:
    """Run each named block's command made on this machine and compare (writes nothing)."""
    here = machine_name()
    off: list[str] = []
    checked = 0
    for block in (b for b in blocks if b.name in names):
        if block.machine != here:
            console.print(f"{block.name}: skipped, made on {block.machine} (this is {here})")
            continue
        checked += 1
        console.print(f"{block.name}: running {block.command}")
        now = _run(REPORTS[block.name].args).splitlines()
        drift = table_drift(block.table, now, band)
        console.print(f"{block.name}: " + ("within the band" if not drift else "; ".join(drift)))
        off += [block.name] if drift else []
    if off:
        raise click.ClickException(
            f"{', '.join(off)}: numbers off by more than {band}x from the README's block"
        )
    if not checked:
        raise click.ClickException(
            f"nothing checked: no block of {', '.join(names)} was made on this machine "
            f"({here}); `kvpool bench report --only NAMES` makes them here"
        )


def _run(args: Sequence[str]) -> str:
    cmd = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]
    done = subprocess.run([*cmd, *args, "--table"], capture_output=True, text=True)
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise click.ClickException(f"kvpool {' '.join(args)} failed: {tail}")
    return done.stdout.strip("\n")

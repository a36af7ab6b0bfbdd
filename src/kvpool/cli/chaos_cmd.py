"""``kvpool chaos``: run the fault matrix against real pools and engines, print a table.

Each row starts its own private pool on loopback (and vLLM engines where the row
needs them), injects its fault and checks the promise: the engine stays up,
outputs equal a run without the connector, the fault is visible, service
recovers. Exits 1 if any row fails.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import click
from rich.table import Table

from kvpool.chaos.matrix import ROWS, Outcome
from kvpool.cli.console import PhaseBars, console

__all__ = ["chaos", "outcome_table"]


def outcome_table(outcomes: Sequence[Outcome]) -> Table:
    t = Table(title="kvpool chaos: fault -> outcome", show_lines=True)
    t.add_column("fault", ratio=2)
    t.add_column("result", justify="center", no_wrap=True)
    t.add_column("observed", ratio=3)
    for o in outcomes:
        t.add_row(
            f"[bold]{o.row}[/bold]\n{o.fault}",
            ("[green]pass[/green]" if o.passed else "[bold red]FAIL[/bold red]")
            + f"\n{o.seconds:.0f} s",
            o.observed,
        )
    return t


@click.command()
@click.option(
    "--row",
    "rows",
    multiple=True,
    type=click.Choice([r.name for r in ROWS]),
    help="Run only this row (repeatable). Default: every row.",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the model, engine logs and pool logs here (default: a temporary folder).",
)
@click.option("--list", "list_rows", is_flag=True, help="List the rows and exit.")
def chaos(rows: tuple[str, ...], workdir: Path | None, list_rows: bool) -> None:
    """Inject faults into real pools and vLLM engines; show that each costs a miss."""
    if list_rows:
        t = Table(title="kvpool chaos rows")
        for name in ("row", "fault", "promise", "engines"):
            t.add_column(name)
        for r in ROWS:
            t.add_row(r.name, r.fault, r.expected, str(r.engines))
        console.print(t)
        return
    from kvpool.chaos.matrix import run_matrix

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(
            f"kvpool chaos needs vLLM ({exc}); run scripts/setup.sh"
        ) from exc
    with tempfile.TemporaryDirectory(prefix="kvpool-chaos-") as tmp:
        with PhaseBars() as bars:
            outcomes = run_matrix(workdir or Path(tmp), list(rows) or None, bars)
        console.print(outcome_table(outcomes))
    failed = [o.row for o in outcomes if not o.passed]
    if failed:
        console.print(f"[bold red]{len(failed)} row(s) failed: {', '.join(failed)}")
        raise click.exceptions.Exit(1)
    console.print(f"[bold green]all {len(outcomes)} rows passed")

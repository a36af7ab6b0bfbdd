"""The one rich console every ``kvpool`` command prints on, phase progress bars, and
the compact table the benches print (``bench_table``: a rule under the header, no
frame, so a row fits 80 columns), and ``mooncake_quiet``: Mooncake's C++ log lines
kept out of a command's output."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Sequence

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

console = Console()

TABLE_HELP = "Only the table's header and rows, 80 columns (for kvpool bench report)."
REPORT_WIDTH = 80  # README tables: what an 80-column terminal shows


def table_rows(table: Table) -> str:
    """``table``'s header and rows as plain text, ``REPORT_WIDTH`` wide, without its
    title and caption: what ``kvpool bench report`` puts in the README."""
    table.title = table.caption = None
    out = Console(file=io.StringIO(), width=REPORT_WIDTH, record=True, color_system=None)
    out.print(table)
    lines = [line.rstrip() for line in out.export_text().splitlines() if line.strip()]
    return textwrap.dedent("\n".join(lines))  # no margin a table's edge padding left


def bench_table(title: str, columns: Sequence[str], left: int = 1) -> Table:
    """A compact table with ``columns``, the first ``left`` aligned left, the rest right."""
    t = Table(
        title=title, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True
    )
    for i, name in enumerate(columns):
        t.add_column(name, justify="left" if i < left else "right")
    return t


class PhaseBars:
    """Progress bars, one per named phase, fed by ``(phase, done, total)`` callbacks.

    Use as a context manager; pass the instance itself as the callback.
    """

    def __init__(self, *, transient: bool = False, disable: bool = False) -> None:
        self._bars = Progress(
            TextColumn("{task.description:<16}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=transient,
            disable=disable,
        )
        self._tasks: dict[str, TaskID] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase not in self._tasks:
            self._tasks[phase] = self._bars.add_task(phase, total=total)
        self._bars.update(self._tasks[phase], completed=done, total=total)

    def __enter__(self) -> PhaseBars:
        self._bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bars.stop()


@contextlib.contextmanager
def mooncake_quiet() -> Iterator[None]:
    """Mooncake's C++ log lines (written to fd 2 whatever the log level) kept out of
    a command's output; shown after all if the block raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                caught.seek(0)
                os.write(2, caught.read()[-8000:])

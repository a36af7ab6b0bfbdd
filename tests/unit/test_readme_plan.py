"""The README's ``kvpool plan`` blocks are what the command prints.

Each indented block that starts with ``$ .venv/bin/kvpool plan ...`` is run again
(through click, in process: ``plan`` is pure) and compared line by line with the
command's output; a block marked ``(last table)`` is compared with the last table the
command prints. A change to the layout rules or to the table that leaves the README
behind fails here.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvpool.cli import console as console_module
from kvpool.cli.app import cli

README = Path(__file__).resolve().parents[2] / "README.md"
PROMPT = "$ .venv/bin/kvpool plan "
LAST = "(last table)"


def plan_blocks() -> list[tuple[str, list[str]]]:
    """(command line, the block's output lines) for each plan block of the README."""
    lines = README.read_text().splitlines()
    blocks: list[tuple[str, list[str]]] = []
    for i, line in enumerate(lines):
        if not line.startswith("    " + PROMPT):
            continue
        output: list[str] = []
        for after in lines[i + 1 :]:
            if not after.startswith("    "):
                break
            output.append(after[4:].rstrip())
        blocks.append((line[4:], output))
    return blocks


def test_the_readme_has_its_plan_blocks() -> None:
    assert len(plan_blocks()) == 3


@pytest.mark.parametrize("command, shown", plan_blocks(), ids=lambda v: str(v)[:60])
def test_a_readme_plan_block_is_what_the_command_prints(
    command: str, shown: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    last = command.endswith(LAST)
    args = shlex.split(command.removesuffix(LAST))[2:]
    monkeypatch.setattr(console_module.console, "width", 200)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    printed = [line.rstrip() for line in result.output.splitlines()]
    if last:  # the last table: from its title line (the line before its top border)
        top = max(i for i, line in enumerate(printed) if line.startswith("┏"))
        printed = printed[top - 1 :]
    assert printed == shown

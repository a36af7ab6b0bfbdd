"""The README's bench tables are in the form their commands print: each sits in a
report block naming the command that made it, the date and the machine, with that
command's columns (the numbers are the command's to check: run it again)."""

from __future__ import annotations

import datetime
from pathlib import Path

import click
import pytest

import kvpool.cli.app  # noqa: F401  (registers every bench command)
from kvpool.cli.bench_cmd import bench
from kvpool.cli.bench_report_cmd import REPORTS, columns, put_block, readme_blocks
from kvpool.cli.console import REPORT_WIDTH, table_rows

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_readme_table_is_a_report_block_of_its_commands_format() -> None:
    blocks = readme_blocks(README.read_text())
    assert sorted(b.name for b in blocks) == sorted(REPORTS)  # each once, none unknown
    for b in blocks:
        report = REPORTS[b.name]
        assert b.command == report.command, b.name
        datetime.datetime.strptime(b.date, "%d %B %Y")  # a real date
        assert b.machine.endswith(" cores"), (b.name, b.machine)  # CPU model, cores
        header, rule, *rows = b.table
        want = table_rows(report.empty_table()).splitlines()[0]
        assert columns(header) == columns(want), b.name
        assert set(rule) == {"─"} and rows, b.name
        assert all(len(line) <= REPORT_WIDTH for line in b.table), b.name


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_each_report_command_is_one_the_cli_accepts(name: str) -> None:
    from kvpool.cli.app import cli

    args = [*REPORTS[name].args, "--table"]
    command: click.Command = cli
    while isinstance(command, click.Group):  # down to the command the args name
        command, args = command.commands[args[0]], args[1:]
    ctx = command.make_context(command.name or "", args)  # parses and checks every option
    assert ctx.params["table_only"] is True


def test_a_block_is_rewritten_in_place_and_read_back() -> None:
    text = (
        "intro\n<!-- report vllm -->\n    $ old   # 1 January 2026, X, 2 cores\n    x\n"
        "<!-- /report -->\nend\n"
    )
    table = "a  b\n────\n1  2"
    out = put_block(
        text, "vllm", REPORTS["vllm"].command, table, "6 December 2026", "AMD EPYC, 2 cores"
    )
    assert REPORTS["vllm"].command.startswith("kvpool bench vllm ")
    assert REPORTS["demo"].command == "kvpool demo"
    assert out.startswith("intro\n") and out.endswith("<!-- /report -->\nend\n")
    (block,) = readme_blocks(out)
    assert block.command == REPORTS["vllm"].command and block.date == "6 December 2026"
    assert block.machine == "AMD EPYC, 2 cores"
    assert block.table == ("a  b", "────", "1  2")
    with pytest.raises(ValueError, match="no report block 'serve'"):
        put_block(text, "serve", "kvpool bench serve", table, "6 December 2026", "X, 2 cores")


def test_a_malformed_block_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="'vllm' must begin with"):
        readme_blocks("<!-- report vllm -->\n    connector\n<!-- /report -->\n")
    with pytest.raises(ValueError, match="no <!-- /report --> line"):
        readme_blocks("<!-- report vllm -->\n")


def test_report_refuses_unknown_tables_before_running_anything(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no blocks\n")
    with pytest.raises(click.BadParameter, match="nope"):
        bench.main(["report", "--readme", str(readme), "--only", "nope"], standalone_mode=False)
    with pytest.raises(click.BadParameter, match="no report block for capacity"):
        bench.main(["report", "--readme", str(readme), "--only", "capacity"], standalone_mode=False)


def test_a_block_without_its_machine_is_refused_and_this_machine_is_named() -> None:
    from kvpool.cli.bench_report_cmd import machine_name

    with pytest.raises(ValueError, match="CPU MODEL, N cores"):
        readme_blocks(
            "<!-- report vllm -->\n    $ kvpool demo   # 6 December 2026\n<!-- /report -->\n"
        )
    assert machine_name().endswith(" cores") and not machine_name().startswith(",")

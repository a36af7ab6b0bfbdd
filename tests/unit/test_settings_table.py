"""The README's settings table is the one the settings classes make."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from kvpool.config import PoolConfig
from kvpool.settings import ConnectorSettings, parse_extra, settings_table

README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- settings table: kvpool settings -->\n", "<!-- end of settings table -->"


def test_the_readme_table_is_the_generated_one() -> None:
    text = README.read_text()
    assert START in text and END in text, "the README lost its settings-table markers"
    block = text.split(START, 1)[1].split(END, 1)[0]
    assert block == settings_table(), (
        "README.md's settings table is out of date: replace the lines between its markers "
        "with the output of `kvpool settings`"
    )


def test_every_setting_has_a_row_with_a_description_and_parses() -> None:
    table = settings_table()
    for f in (*fields(ConnectorSettings), *fields(PoolConfig)):
        assert f"| `{f.name}` |" in table
        assert f.metadata.get("doc"), f"{f.name} has no description"
    pool_rows = [line for line in table.splitlines() if "`KVPOOL_" in line]
    assert len(pool_rows) == len(fields(PoolConfig)) + 1  # and tenant's KVPOOL_TENANT
    # Every name in the table is a key parse_extra accepts.
    names = [line.split("`")[1] for line in table.splitlines()[2:]]
    settings, pool = parse_extra({"chunk_size": 64, "master_address": "127.0.0.1:1"})
    assert settings.chunk_size == 64 and pool == {"master_address": "127.0.0.1:1"}
    for name in names:
        try:
            parse_extra({name: getattr(ConnectorSettings(), name, None) or "x"})
        except ValueError as exc:
            assert "unknown" not in str(exc), name

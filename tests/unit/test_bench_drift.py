"""``kvpool bench report --check``'s comparison of a table printed now with the one a
README block kept (``kvpool.bench.drift``)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

import kvpool.cli.app  # noqa: F401  (registers every bench command)
from kvpool.bench.drift import table_drift
from kvpool.cli.bench_cmd import bench

KEPT = [
    "connector  len prefill cold warm hits speedup same",
    "──────────────────────────────────────────────────",
    "kvpool    2000     267  286   56 100%    4.7x  yes",
    "one copy  2000     267    -   29    -       -    -",
]


def test_numbers_within_the_band_match_and_words_must_be_equal() -> None:
    now = [KEPT[0], KEPT[1], "kvpool    2000     301  250   90  97%    2.6x  yes", KEPT[3]]
    assert table_drift(KEPT, now, band=2.0) == []
    assert table_drift(KEPT, now, band=1.5) == [
        "row 1 (kvpool): 56 -> 90",
        "row 1 (kvpool): 4.7x -> 2.6x",
    ]
    wrong = [KEPT[0], KEPT[1], "kvpool    2000     267  286  200 100%    1.2x   no", KEPT[3]]
    assert table_drift(KEPT, wrong) == [
        "row 1 (kvpool): 56 -> 200",
        "row 1 (kvpool): 4.7x -> 1.2x",
        "row 1 (kvpool): yes -> no",
    ]


def test_a_zero_stays_zero_and_units_must_agree() -> None:
    kept = ["path fail  size", "────", "tcp     0  1MiB", "shm   0.5  2M"]
    assert table_drift(kept, ["path fail  size", "────", "tcp     3  1MiB", "shm   0.5  2G"]) == [
        "row 1 (tcp): 0 -> 3",
        "row 2 (shm): 2M -> 2G",
    ]


def test_another_header_or_row_count_is_a_difference() -> None:
    assert table_drift(KEPT, ["connector len", *KEPT[1:]])[0].startswith("header:")
    assert table_drift(KEPT, KEPT[:3]) == ["rows: 2 kept, 1 now"]
    with pytest.raises(ValueError):
        table_drift(KEPT, KEPT, band=0.5)


def test_check_skips_blocks_made_on_another_machine_and_writes_nothing(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    text = (
        "<!-- report lookup -->\n"
        "    $ kvpool bench lookup   # 6 December 2026, Some Other CPU, 64 cores\n"
        "    a  b\n    ────\n    1  2\n<!-- /report -->\n"
    )
    readme.write_text(text)
    with pytest.raises(click.ClickException, match="nothing checked"):
        bench.main(
            ["report", "--readme", str(readme), "--only", "lookup", "--check"],
            standalone_mode=False,
        )
    assert readme.read_text() == text
    with pytest.raises(click.BadParameter):
        bench.main(
            ["report", "--readme", str(readme), "--check", "--band", "0.5"], standalone_mode=False
        )


def test_signed_numbers_compare_as_numbers_and_only_counts_must_stay_zero() -> None:
    kept = ["N gap fail  ms", "──", "1x   +4    0  0.00"]
    assert table_drift(kept, ["N gap fail  ms", "──", "1x   +5    0  0.01"]) == []
    assert table_drift(kept, ["N gap fail  ms", "──", "1x  +15    1  0.00"]) == [
        "row 1 (1x): +4 -> +15",
        "row 1 (1x): 0 -> 1",
    ]

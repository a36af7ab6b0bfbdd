"""`kvpool plan`: the table, the --json contract, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.cli import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_json_has_exactly_the_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(
        capsys, "plan", "--tp", "8", "--dcp", "2", "--group", "mla", "--chunks", "16", "--json"
    )
    assert (rc, err) == (0, "")
    data = json.loads(out)
    assert set(data) == {"layout", "ranks", "puts", "gets", "lookup_keys"}
    assert data["layout"]["tp"] == 8 and data["layout"]["groups"] == ["mla"]
    assert len(data["ranks"]) == 8
    assert set(data["ranks"][1]) == {"rank", "tp_rank", "pp_rank", "pcp_rank", "dcp_rank"}
    assert data["ranks"][1]["dcp_rank"] == 1
    assert len(data["puts"]) == 2 * 16  # two objects per chunk
    assert set(data["puts"][0]) == {"rank", "group", "chunk", "key"}
    assert len(data["gets"]) == 8 * 16
    assert set(data["lookup_keys"][0]) == {"group", "chunk", "key"}
    puts = {p["key"] for p in data["puts"]}
    assert {g["key"] for g in data["gets"]} == puts == {k["key"] for k in data["lookup_keys"]}


def test_plan_hybrid_groups_and_kv_heads_shorthand(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(
        capsys,
        "plan",
        "--tp",
        "4",
        "--group",
        "gqa:8",
        "--group",
        "mla",
        "--group",
        "mamba",
        "--chunks",
        "2",
        "--json",
    )
    assert rc == 0
    assert json.loads(out)["layout"]["groups"] == ["gqa:8", "mla", "mamba"]
    rc, out, _ = run(capsys, "plan", "--tp", "4", "--kv-heads", "1", "--chunks", "4", "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["layout"]["groups"] == ["gqa:1"] and len(data["puts"]) == 4


def test_plan_table_shows_totals_against_reference(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "plan", "--tp", "8", "--dcp", "2", "--group", "mla")
    assert rc == 0
    assert "write amplification" in out and "4.00x" in out and "1.00x" in out
    assert "h0.d1.c0.b0" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", "--tp", "4", "--dcp", "3", "--group", "mla"], "dcp=3 must divide tp=4"),
        (["plan", "--tp", "4"], "give the model's KV groups"),
        (["plan", "--tp", "x", "--group", "mla"], "--tp"),
        (["plan", "--group", "lstm"], "unknown KV group kind"),
        (["plan", "--tp", "4", "--group", "gqa:8", "--dcp", "2"], "lower dcp or raise tp"),
    ],
)
def test_bad_arguments_exit_nonzero_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    rc, out, err = run(capsys, *args)
    assert rc != 0 and out == ""
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_console_script_is_installed() -> None:
    exe = Path(sys.executable).with_name("kvpool")
    out = subprocess.run(
        [str(exe), "plan", "--tp", "2", "--kv-heads", "2", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["layout"]["tp"] == 2


def test_plan_shows_a_reader_at_another_tp_beside_the_writer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Writer TP2 with 8 KV heads: a TP1 reader reads 8 objects per chunk from both
    writer ranks; a TP4 rank reads 2, all from one writer rank. A model with a
    mamba group shares nothing across TP sizes."""
    rc, out, _ = run(capsys, "plan", "--tp", "2", "--kv-heads", "8", "--read-tp", "1", "--json")
    assert rc == 0
    reader = json.loads(out)["reader"]
    assert reader["tp"] == 1 and reader["shares_keys"]
    assert reader["ranks"] == [
        {"rank": 0, "objects_per_chunk": 8, "bytes_share": 1.0, "writers": [0, 1]}
    ]
    rc, out, _ = run(capsys, "plan", "--tp", "2", "--kv-heads", "8", "--read-tp", "4", "--json")
    ranks = json.loads(out)["reader"]["ranks"]
    assert [(r["objects_per_chunk"], r["writers"]) for r in ranks] == [
        (2, [0]), (2, [0]), (2, [1]), (2, [1])
    ]  # fmt: skip
    rc, out, _ = run(capsys, "plan", "--tp", "2", "--kv-heads", "8", "--read-tp", "1")
    assert rc == 0 and "a reader at tp=1 pp=1 dcp=1 beside this writer at tp=2 pp=1 dcp=1" in out
    args = ["plan", "--tp", "2", "--group", "gqa:8", "--group", "mamba", "--read-tp", "1"]
    rc, out, _ = run(capsys, *args, "--json")
    assert rc == 0 and json.loads(out)["reader"] == {
        "tp": 1, "pp": 1, "dcp": 1, "shares_keys": False, "ranks": []
    }  # fmt: skip
    rc, out, _ = run(capsys, *args)
    assert rc == 0 and "shares no object" in out


def test_plan_shows_a_reader_at_another_pp_size_on_one_layer_band_grid(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """32 layers, 8 KV heads: a PP2 writer and a PP1 reader share bands 0-15 and
    16-31 (where a stage of either begins). The PP1 rank reads 16 objects per chunk
    (8 heads x 2 bands) from both stages; the other way round each PP2 rank reads
    its band's 8, all written by the PP1 rank. Bands that split a stage are refused."""
    base = ["plan", "--kv-heads", "8", "--layers", "32", "--json"]
    rc, out, _ = run(capsys, *base, "--pp", "2", "--read-pp", "1")
    assert rc == 0
    data = json.loads(out)
    assert data["layout"]["layer_bands"] == [0, 16]
    assert data["reader"]["ranks"] == [
        {"rank": 0, "objects_per_chunk": 16, "bytes_share": 1.0, "writers": [0, 1]}
    ]
    rc, out, _ = run(capsys, *base, "--pp", "1", "--read-pp", "2")
    ranks = json.loads(out)["reader"]["ranks"]
    assert [(r["objects_per_chunk"], r["bytes_share"], r["writers"]) for r in ranks] == [
        (8, 0.5, [0]), (8, 0.5, [0])
    ]  # fmt: skip
    rc, out, err = run(capsys, *base, "--pp", "2", "--layer-bands", "0,8")
    assert rc != 0 and "no band beginning at [16]" in err
    rc, out, err = run(capsys, "plan", "--kv-heads", "8", "--pp", "2", "--read-pp", "1")
    assert rc != 0 and "--layers" in err


def test_plan_takes_heads_per_object(capsys: pytest.CaptureFixture[str]) -> None:
    """8 KV heads, 4 per object: 2 objects per chunk at TP1; a TP2 reader's ranks
    read one each; TP4 cannot hold whole groups of 4 and is refused."""
    base = ["plan", "--kv-heads", "8", "--heads-per-object", "4", "--json"]
    rc, out, _ = run(capsys, *base, "--read-tp", "2")
    assert rc == 0
    data = json.loads(out)
    assert len(data["puts"]) == 2 * 16
    assert [r["objects_per_chunk"] for r in data["reader"]["ranks"]] == [1, 1]
    rc, _, err = run(capsys, *base, "--tp", "4")
    assert rc != 0 and "heads_per_object" in err


def test_plan_shows_a_reader_at_another_dcp_size_on_one_token_grid(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """MLA at TP2/DCP2 beside a TP1/DCP1 reader on one grid of 2 token classes: the
    DCP1 rank reads both classes (2 objects per chunk), one from each writer
    rank; the other way round, each DCP2 rank reads its own class."""
    base = ["plan", "--group", "mla", "--json"]
    rc, out, _ = run(capsys, *base, "--tp", "2", "--dcp", "2", "--read-tp", "1", "--read-dcp", "1")
    assert rc == 0
    data = json.loads(out)
    assert data["layout"]["token_classes"] == 2
    assert data["reader"]["ranks"] == [
        {"rank": 0, "objects_per_chunk": 2, "bytes_share": 1.0, "writers": [0, 1]}
    ]
    rc, out, _ = run(capsys, *base, "--read-tp", "2", "--read-dcp", "2")
    ranks = json.loads(out)["reader"]["ranks"]
    assert [(r["objects_per_chunk"], r["bytes_share"], r["writers"]) for r in ranks] == [
        (1, 0.5, [0]), (1, 0.5, [0])
    ]  # fmt: skip
    rc, _, err = run(capsys, *base, "--tp", "2", "--dcp", "2", "--token-classes", "3")
    assert rc != 0 and "multiple of dcp=2" in err

"""SVG charts of bench and demo figures (``kvpool.cli.charts``): valid SVG, one
mark per figure, placed by its value, and the CLI's ``--plot`` checks."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import click
import pytest

from kvpool.cli.charts import Series, bar_chart, line_chart, plot_path

SVG = "{http://www.w3.org/2000/svg}"


def _points(polyline: ET.Element) -> list[tuple[float, float]]:
    return [
        (float(x), float(y)) for x, y in (p.split(",") for p in polyline.get("points", "").split())
    ]


def test_a_line_chart_draws_each_series_in_x_order_higher_values_higher_up() -> None:
    series = [
        Series("prefill <ms>", ((4000, 900.0), (1000, 200.0), (2000, 420.0))),
        Series("warm", ((1000, 110.0), (2000, 150.0), (4000, 380.0))),
    ]
    root = ET.fromstring(line_chart("TTFT & length", "tokens", "ms", series))
    lines = root.findall(f"{SVG}polyline")
    assert [line.findtext(f"{SVG}title") for line in lines] == ["prefill <ms>", "warm"]
    prefill, warm = (_points(line) for line in lines)
    assert [x for x, _ in prefill] == sorted(x for x, _ in prefill)  # joined in x order
    assert prefill[0][1] > prefill[1][1] > prefill[2][1]  # SVG y grows downwards
    assert all(p[1] < w[1] for p, w in zip(prefill, warm, strict=True))  # prefill above warm
    assert len(root.findall(f"{SVG}circle")) == 6
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "TTFT & length" in texts and "1000" in texts and "prefill <ms>" in texts
    # the y axis runs from 0 to a round number at or above the largest value
    assert "0" in texts and "1000" in texts


def test_a_bar_chart_has_one_bar_per_series_and_group_as_tall_as_its_value() -> None:
    series = [Series("cold", ((0, 300.0), (1, 600.0))), Series("warm", ((0, 100.0), (1, 50.0)))]
    root = ET.fromstring(bar_chart("demo", "ms", ["doc 1", "doc 2"], series))
    bars = [r for r in root.findall(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    heights = {r.findtext(f"{SVG}title"): float(r.get("height", "0")) for r in bars}
    assert len(bars) == 4
    assert heights["cold doc 2: 600"] == pytest.approx(2 * heights["cold doc 1: 300"], rel=0.01)
    assert heights["warm doc 2: 50"] < heights["warm doc 1: 100"] < heights["cold doc 1: 300"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: line_chart("t", "x", "y", []),
        lambda: line_chart("t", "x", "y", [Series("empty", ())]),
        lambda: bar_chart("t", "y", ["a", "b"], [Series("one value", ((0, 1.0),))]),
    ],
)
def test_a_chart_without_figures_is_refused(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]


def test_plot_takes_an_svg_path_in_a_folder_that_exists(tmp_path: Path) -> None:
    ctx = click.Context(click.Command("x"))
    param = click.Option(["--plot"])
    assert plot_path(ctx, param, None) is None
    assert plot_path(ctx, param, tmp_path / "a.svg") == tmp_path / "a.svg"
    with pytest.raises(click.BadParameter, match=r"\*\.svg"):
        plot_path(ctx, param, tmp_path / "a.png")
    with pytest.raises(click.BadParameter, match="does not exist"):
        plot_path(ctx, param, tmp_path / "missing" / "a.svg")

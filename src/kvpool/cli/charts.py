"""Charts of bench and demo figures as SVG files, with no plotting library.

    line_chart(title, x_label, y_label, series, y_max=None, x_log2=False)
                                                   one line per ``Series`` of (x, y)
                                                   points, on axes from 0 (or x
                                                   on a log-2 axis)
    bar_chart(title, y_label, groups, series)      one bar per series in each group
    plot_option(what)                              the commands' ``--plot FILE.svg`` option:
                                                   an ``.svg`` path whose folder exists

A chart is a string of SVG 1.1 (any browser shows it); numbers are drawn as
given, each axis from 0 to a rounded maximum with 4-6 ticks; a series' points
are joined in x order. Text is escaped; attributes hold only numbers and fixed
colours. Pure: the caller writes the file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

import click

__all__ = ["Series", "bar_chart", "line_chart", "plot_option", "plot_path"]

WIDTH, HEIGHT = 900, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 210, 50, 60  # margins around the plot area: legend right
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#7f7f7f")


@dataclass(frozen=True, slots=True)
class Series:
    """One line (or one bar per group) of a chart."""

    name: str
    points: tuple[tuple[float, float], ...]  # (x, y); for a bar chart, x is ignored


def _nice_max(value: float) -> tuple[float, float]:
    """(axis maximum, tick step): a 1, 2 or 5 step times a power of ten, 4-6 ticks."""
    if value <= 0 or not math.isfinite(value):
        return 1.0, 0.2
    value *= 1.04  # headroom: the largest mark stays below the top line
    raw = value / 5
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return step * math.ceil(value / step - 1e-9), step


def _label(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:g}"


def _frame(title: str, x_label: str, y_label: str, y_top: float, y_step: float) -> list[str]:
    """The SVG head, title, axis labels and the y axis with its ticks and grid."""
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="24" text-anchor="middle" font-size="15">{escape(title)}</text>',
        f'<text x="{LEFT + w / 2}" y="{HEIGHT - 14}" text-anchor="middle">{escape(x_label)}</text>',
        f'<text transform="translate(16,{TOP + h / 2}) rotate(-90)" text-anchor="middle">'
        f"{escape(y_label)}</text>",
    ]
    ticks = round(y_top / y_step)
    for i in range(ticks + 1):
        y = TOP + h - h * i / ticks
        out.append(f'<line x1="{LEFT}" x2="{LEFT + w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_label(y_step * i)}</text>'
        )
    out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + h}" stroke="black"/>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT + w}" y1="{TOP + h}" y2="{TOP + h}" stroke="black"/>')
    return out


def _legend(names: Sequence[str]) -> list[str]:
    """The series' names and colours, right of the plot area."""
    out = []
    left = WIDTH - RIGHT + 15
    for i, name in enumerate(names):
        y = TOP + 8 + 18 * i
        colour = COLOURS[i % len(COLOURS)]
        out.append(f'<rect x="{left}" y="{y - 9}" width="12" height="10" fill="{colour}"/>')
        out.append(f'<text x="{left + 18}" y="{y}">{escape(name)}</text>')
    return out


def line_chart(
    title: str,
    x_label: str,
    y_label: str,
    series: Sequence[Series],
    y_max: float | None = None,
    x_log2: bool = False,
) -> str:
    """Lines of ``series`` (each with at least one point) on axes from 0; the y axis
    up to ``y_max`` when given (e.g. 100 for percentages). ``x_log2``: x values
    (all > 0) on a log-2 axis, a tick at each value the series have."""
    if not series or any(not s.points for s in series):
        raise ValueError("a line chart needs series, each with at least one point")
    xs = sorted({x for s in series for x, _ in s.points})
    ys = [y for s in series for _, y in s.points]
    if x_log2 and xs[0] <= 0:
        raise ValueError("a log-2 axis needs x values above 0")
    y_top, y_step = (y_max, y_max / 5) if y_max else _nice_max(max(ys))
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    if x_log2:  # the smallest value at the left edge, the largest at the right
        lo = math.log2(xs[0])
        span = (math.log2(xs[-1]) - lo) or 1.0
        ticks = xs

        def place(x: float) -> float:
            return LEFT + w * (math.log2(x) - lo) / span
    else:
        x_top, x_step = _nice_max(xs[-1])
        ticks = [x_step * i for i in range(round(x_top / x_step) + 1)]

        def place(x: float) -> float:
            return LEFT + w * x / x_top

    out = _frame(title, x_label, y_label, y_top, y_step)
    for tick in ticks:
        out.append(
            f'<text x="{place(tick):.1f}" y="{TOP + h + 18}" text-anchor="middle">'
            f"{_label(tick)}</text>"
        )
    for n, s in enumerate(series):
        colour = COLOURS[n % len(COLOURS)]
        marks = [(f"{place(x):.1f}", f"{TOP + h - h * y / y_top:.1f}") for x, y in sorted(s.points)]
        points = " ".join(f"{px},{py}" for px, py in marks)
        out.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}">'
            f"<title>{escape(s.name)}</title></polyline>"
        )
        out += [f'<circle cx="{px}" cy="{py}" r="3" fill="{colour}"/>' for px, py in marks]
    out += _legend([s.name for s in series])
    return "\n".join([*out, "</svg>"]) + "\n"


def bar_chart(title: str, y_label: str, groups: Sequence[str], series: Sequence[Series]) -> str:
    """One bar per series in each of ``groups`` (series' y values, in group order)."""
    if not groups or not series or any(len(s.points) != len(groups) for s in series):
        raise ValueError("a bar chart needs groups and series with one value per group")
    y_top, y_step = _nice_max(max(y for s in series for _, y in s.points))
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    out = _frame(title, "", y_label, y_top, y_step)
    slot = w / len(groups)
    bar = slot * 0.8 / len(series)
    for g, group in enumerate(groups):
        centre = LEFT + slot * (g + 0.5)
        out.append(
            f'<text x="{centre:.1f}" y="{TOP + h + 18}" text-anchor="middle">{escape(group)}</text>'
        )
        for n, s in enumerate(series):
            value = s.points[g][1]
            top = TOP + h - h * value / y_top
            x = centre - slot * 0.4 + bar * n
            out.append(
                f'<rect x="{x:.1f}" y="{top:.1f}" width="{bar:.1f}" height="{TOP + h - top:.1f}" '
                f'fill="{COLOURS[n % len(COLOURS)]}"><title>{escape(s.name)} '
                f"{escape(group)}: {_label(value)}</title></rect>"
            )
    out += _legend([s.name for s in series])
    return "\n".join([*out, "</svg>"]) + "\n"


def plot_path(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """``--plot``'s callback: None, or an ``.svg`` path whose folder exists."""
    if value is None:
        return None
    if value.suffix.lower() != ".svg":
        raise click.BadParameter(f"charts are SVG files: name it *.svg, got {str(value)!r}")
    if not value.parent.resolve().is_dir():
        raise click.BadParameter(f"folder {str(value.parent)!r} does not exist")
    return value


def plot_option(what: str) -> Callable[[Callable[..., object]], Callable[..., object]]:
    """``--plot FILE.svg`` (a ``Path`` or None, checked by ``plot_path``)."""
    return click.option(
        "--plot",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        callback=plot_path,
        help=f"Also write an SVG chart of {what} to this file.",
    )

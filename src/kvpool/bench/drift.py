"""How far a table printed now is from the one a README block kept: ``kvpool bench
report --check``.

    table_drift(kept, now, band)   what differs, one line each (empty: within the band)

Both tables are the lines a command prints with ``--table`` (header, rule, rows).
Cells are compared word by word: a number (``0.29``, ``100%``, ``4.7x``, ``1494M``)
matches when the larger of the two is at most ``band`` times the smaller (the
same sign; a count, a whole number without a unit, that was 0 must stay 0; a
measured 0 matches a value of at most 1 in its unit); any other word must be
equal (row labels, "yes", "-"). A row more or fewer, or a changed header, is a
difference. The band is the noise a shared 2-core machine shows between runs of
one command (2x by default: runs of ``bench vllm`` on one host varied by up to
1.5x); it catches a table that no longer says what its command prints, not a
regression of a few percent.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["table_drift"]

_NUMBER = re.compile(r"^([-+]?\d+(?:\.\d+)?)([%xMGKms]*)$")


def _number(word: str) -> tuple[float, str, bool] | None:
    """(value, unit, a count: a whole number without a unit), or None for a word."""
    m = _NUMBER.match(word)
    if m is None:
        return None
    count = not m.group(2) and "." not in m.group(1)
    return float(m.group(1)), m.group(2), count


def _close(a: float, b: float, band: float, count: bool) -> bool:
    if a == b:
        return True
    if count and (a == 0 or b == 0):  # a count that was 0 stays 0 (failures, refusals)
        return False
    if a == 0 or b == 0:  # a measured 0.00 against 0.01: both at the table's resolution
        return abs(a - b) <= 0.05 or max(abs(a), abs(b)) <= 1
    if (a < 0) != (b < 0):
        return False
    big, small = max(abs(a), abs(b)), min(abs(a), abs(b))
    return big <= band * small


def table_drift(kept: Sequence[str], now: Sequence[str], band: float = 2.0) -> list[str]:
    """What differs between table ``kept`` and table ``now`` (see the module docstring)."""
    if band < 1:
        raise ValueError(f"band must be >= 1, got {band}")
    out: list[str] = []
    if not kept or not now or kept[0].split() != now[0].split():
        return [f"header: {kept[0] if kept else ''!r} -> {now[0] if now else ''!r}"]
    rows_kept, rows_now = list(kept[2:]), list(now[2:])
    if len(rows_kept) != len(rows_now):
        out.append(f"rows: {len(rows_kept)} kept, {len(rows_now)} now")
    for i, (a, b) in enumerate(zip(rows_kept, rows_now, strict=False)):
        wa, wb = a.split(), b.split()
        if len(wa) != len(wb):
            out.append(f"row {i + 1}: {a.strip()!r} -> {b.strip()!r}")
            continue
        for x, y in zip(wa, wb, strict=True):
            nx, ny = _number(x), _number(y)
            same = (
                nx[1] == ny[1] and _close(nx[0], ny[0], band, nx[2] and ny[2])
                if nx is not None and ny is not None
                else x == y
            )
            if not same:
                out.append(f"row {i + 1} ({wa[0]}): {x} -> {y}")
    return out

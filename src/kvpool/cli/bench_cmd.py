"""``kvpool bench``: the command group and what its commands share.

    bench                         the group; each ``bench_*_cmd`` module adds its
                                  command when imported (``app`` imports them all)
    pool_options(...)             ``--master`` and ``--pool-file``, the pool a
                                  command measures
    _given_config(master, file)   the pool those name, or the default pool file's
                                  (may name none); ``_config``: one must be named
    _pool_or_temporary(config, n) ``config``, or a temporary local pool with an
                                  ``n``-byte holder, stopped afterwards
    _sizes, _size, _label         size options (``256KiB,1MiB``) and size labels
    print_result(result, table, ...)  what an engine bench prints: its table's rows
                                  (``--table``), one JSON object (``--json``) or the
                                  table and its legend; and its chart (``--plot``)

The pool is ``--master HOST:PORT`` or, by default, the pool file of ``kvpool up``
(``--pool-file`` to pick another). Table builders print nothing; a command
prints its table, or one JSON object with ``--json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click

from kvpool.config import PoolConfig, load_config, parse_size
from kvpool.errors import ConfigError

__all__ = ["TARGET_RATIO", "bench", "pool_options", "print_result"]

TARGET_RATIO = 0.90  # ours/raw throughput we aim for
F = TypeVar("F", bound=Callable[..., Any])


@click.group()
def bench() -> None:
    """Measure a running pool."""


def print_result(
    result: Any,
    table: Callable[[Any], Any],
    *,
    table_only: bool,
    as_json: bool,
    legend: Callable[[Any], str] | None = None,
    plot: Path | None = None,
    chart: Callable[[Any], str] | None = None,
) -> None:
    """Print a bench's dataclass ``result`` as its options ask (see the module
    docstring); write ``chart(result)`` to ``plot`` when given."""
    from kvpool.cli.console import console, table_rows

    if table_only:
        click.echo(table_rows(table(result)))
    elif as_json:
        click.echo(json.dumps(dataclasses.asdict(result)))
    else:
        console.print(table(result))
        if legend is not None:
            console.print(legend(result))
    if plot is not None and chart is not None:
        plot.write_text(chart(result))
        click.echo(f"chart written to {plot}", err=True)


def pool_options(
    master_help: str = "mooncake_master to use (default: pool file).",
    pool_file_help: str = "Pool file to read (default: the one `kvpool up` writes).",
) -> Callable[[F], F]:
    """The options ``--master HOST:PORT`` and ``--pool-file``, in that order."""

    def add(command: F) -> F:
        command = click.option("--pool-file", type=click.Path(dir_okay=False), help=pool_file_help)(
            command
        )
        return click.option("--master", metavar="HOST:PORT", help=master_help)(command)

    return add


def _sizes(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(parse_size(v.strip(), "size") for v in value.split(",") if v.strip())
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    if not sizes or min(sizes) <= 0:
        raise click.BadParameter("give positive sizes, e.g. 256KiB,1MiB,4MiB")
    return sizes


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        return parse_size(value, param.name or "size")
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


def _label(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _given_config(master: str | None, pool_file: str | None, checksum: bool = True) -> PoolConfig:
    """The pool named by ``--master`` / ``--pool-file`` / the default pool file (may be none)."""
    extra: dict[str, Any] = {"checksum": checksum}
    if master:
        extra["master_address"] = master
    if pool_file:
        extra["pool_file"] = pool_file
    return load_config(extra)


def _config(master: str | None, pool_file: str | None, checksum: bool) -> PoolConfig:
    config = _given_config(master, pool_file, checksum)
    config.require_master()
    return config


@contextlib.contextmanager
def _pool_or_temporary(config: PoolConfig | None, segment_size: int) -> Iterator[PoolConfig]:
    """``config``, or (when None) a temporary local pool that is stopped afterwards."""
    if config is not None:
        yield config
        return
    from kvpool.pool import LocalPool

    with tempfile.TemporaryDirectory(prefix="kvpool-bench-pool-") as home:
        pool = LocalPool.start(home, segment_size=segment_size)
        try:
            yield pool.config()
        finally:
            pool.stop()

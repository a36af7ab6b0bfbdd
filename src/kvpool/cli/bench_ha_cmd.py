"""``kvpool bench ha``: what HA masters cost on puts, and what a failover takes.

bench ha                      start a pool of one master and an HA pool (etcd
                              and two masters), put the same batches to both,
                              then kill the HA pool's leader ``--failovers``
                              times (``kvpool.bench.ha``); exits 1 if a
                              failover kept less than 99% of the objects
ha_bench_table(result)        the table (prints nothing)
"""

from __future__ import annotations

import statistics

import click
from rich.table import Table

from kvpool.bench.ha import HaBench, run_ha_bench
from kvpool.cli.bench_cmd import _label, _size, bench, print_result
from kvpool.errors import KVPoolError

__all__ = ["ha_bench_table"]

KEPT_TARGET = 0.99  # the share of objects a failover must keep


def ha_bench_table(b: HaBench) -> Table:
    """Puts on each pool and their ratio; one row per failover."""
    t = Table(
        title=f"kvpool bench ha: {b.batches} batches of {b.objects} x {_label(b.size)} per pool",
        caption="median time of a batch put; a leader killed before a put is in its log "
        "(etcd) loses that object, so each kill waits for the log; failover: from SIGKILL "
        "of the leader to the first get that returned the object's bytes",
    )
    t.add_column("what")
    t.add_column("result", justify="right")
    one, two = statistics.median(b.single_put_s), statistics.median(b.ha_put_s)
    t.add_row("put, one master", f"{one * 1e3:.1f} ms")
    t.add_row("put, HA masters (oplog in etcd)", f"{two * 1e3:.1f} ms")
    t.add_row("HA / one master", f"{b.put_ratio:.2f}x")
    lag = sorted(b.log_lag_s)
    t.add_row(
        "HA: in etcd's log, after the put",
        f"median {statistics.median(lag) * 1e3:.1f} ms, max {lag[-1] * 1e3:.1f} ms",
    )
    for i, f in enumerate(b.failovers, 1):
        took = "none within 60 s" if f.first_get_s is None else f"{f.first_get_s:.1f} s"
        share = f.kept / max(1, f.objects)
        style = "green" if share >= KEPT_TARGET else "red"
        t.add_row(
            f"failover {i} ({f.killed} killed)",
            f"first get {took}; kept [{style}]{f.kept}/{f.objects}[/{style}]; "
            f"new put {'ok' if f.put_after else '[red]failed[/red]'}",
        )
    return t


@bench.command("ha")
@click.option("--objects", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--size", default="64KiB", show_default=True, callback=_size,
              help="Bytes per object.")  # fmt: skip
@click.option("--batches", default=20, show_default=True, type=click.IntRange(min=1))
@click.option("--failovers", default=2, show_default=True, type=click.IntRange(min=0, max=10))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def ha_cmd(objects: int, size: int, batches: int, failovers: int, as_json: bool) -> None:
    """HA masters against one master: put latency, failover time, objects kept."""
    result = run_ha_bench(None, objects, size, batches, failovers)
    print_result(result, ha_bench_table, table_only=False, as_json=as_json)
    lost = [f for f in result.failovers if f.kept < KEPT_TARGET * f.objects or not f.put_after]
    if lost:
        raise KVPoolError(f"{len(lost)} failover(s) lost objects or took no new put")

"""``kvpool up``, ``down`` and ``status``: a local pool run from the pool file.

    up       start master + holder in their own session (they outlive the command),
             write the pool file, print where the pool is and the vLLM flag to use;
             exits 1 if a live pool already has the pool file (a stale one is replaced)
             or another ``up`` of the same pool file is under way (``<file>.lock``,
             held from the check to the written file: two at once never orphan a pool)
    down     stop the processes the pool file names (only while they are verifiably
             those mooncake processes) and remove the file; exits 1 without a pool
    status   processes, keys, bytes used / capacity, clients, segments, memory per
             host (a pool across hosts) and keys per kvpool namespace; exits 1 if
             the master does not answer

The pool file is ``kvpool.config.pool_file_path()`` (``$KVPOOL_POOL_FILE``, else
``$KVPOOL_HOME/pool.json``, else ``~/.kvpool/pool.json``); logs sit beside it.
Table builders return rich renderables and print nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from rich.console import Console, Group
from rich.table import Table

from kvpool.config import parse_size, pool_file_path
from kvpool.errors import ConfigError, KVPoolError, LayoutError, StoreUnavailable
from kvpool.keys import check_tenant
from kvpool.pool import (
    LocalPool,
    NamespaceSummary,
    PoolStatus,
    pool_status,
)
from kvpool.pool.local import LEASE_TTL_MS
from kvpool.pool.master_api import master_health


def _console() -> Console:
    from kvpool.cli.console import console

    return console


# --------------------------------------------------------------------------- rendering


def format_bytes(n: int | None) -> str:
    """``1.0 GiB``-style sizes; ``?`` when unknown."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_age(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.2 h``, ``2.1 d``."""
    if seconds < 120:
        return f"{max(0.0, seconds):.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: str) -> float:
    """Seconds of ``90s``, ``10m``, ``2.5h``, ``7d``; ``ValueError`` naming the form."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", value)
    if not m:
        raise ValueError(
            f"a duration is a number and a unit s, m, h or d (90s, 2h, 7d), got {value!r}"
        )
    return float(m.group(1)) * _UNITS[m.group(2)]


def _oldest_age(status: PoolStatus, now_ms: int) -> float | None:
    if status.oldest_written_ms is None:
        return None
    return max(0.0, (now_ms - status.oldest_written_ms) / 1000)


def kv_transfer_config(pool_file: str | Path) -> str:
    """The ``--kv-transfer-config`` JSON that points vLLM at this pool file."""
    return json.dumps(
        {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"pool_file": str(pool_file)},
        },
        separators=(",", ":"),
    )


def _process_label(pool: LocalPool | PoolStatus, role: str) -> str:
    procs = pool.processes() if isinstance(pool, LocalPool) else pool.processes
    for r, pid, running in procs:
        if r == role:
            return f"pid {pid}" + ("" if running else ", not running")
    return "not ours" if role == "master" else "none"


def up_summary(pool: LocalPool, pool_file: Path) -> Table:
    """Where a freshly started pool is: addresses, PIDs, files."""
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("master", f"{pool.master_address}  ({_process_label(pool, 'master')})")
    t.add_row(
        "holder",
        f"{pool.holder_address}  ({_process_label(pool, 'holder')}, "
        f"{format_bytes(pool.segment_size)})",
    )
    t.add_row("metrics", f"{pool.metrics_url}/metrics" if pool.metrics_url else "unknown")
    t.add_row("pool file", str(pool_file))
    if pool.secret:
        t.add_row("secret", "objects are signed; the secret is in the pool file (mode 0600)")
    if pool.disk_dir:
        limit = f", at most {format_bytes(pool.disk_bytes)}" if pool.disk_bytes else ""
        t.add_row("disk", f"evicted objects kept in {pool.disk_dir}{limit}")
    t.add_row("logs", f"{pool.home / 'master.log'}, {pool.home / 'holder.log'}")
    return t


def status_table(status: PoolStatus, pool_file: Path) -> Table:
    """One pool's processes and the master's gauges."""
    t = Table(title="kvpool pool", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("pool file", str(pool_file))
    t.add_row("master", f"{status.master_address}  ({_process_label(status, 'master')})")
    if status.holder_address:
        t.add_row("holder", f"{status.holder_address}  ({_process_label(status, 'holder')})")
    if not status.reachable:
        t.add_row("state", f"[red]master not answering[/red]: {status.error.splitlines()[0]}")
        return t
    t.add_row("keys", "?" if status.keys is None else str(status.keys))
    used, cap = status.used_bytes, status.capacity_bytes
    share = f" ({100 * used / cap:.1f}%)" if used is not None and cap else ""
    t.add_row("memory", f"{format_bytes(used)} used of {format_bytes(cap)}{share}")
    if status.evicted_objects is not None:
        t.add_row(
            "evicted",
            f"{status.evicted_objects} objects, {format_bytes(status.evicted_bytes)} since start"
            + ("" if status.refused_puts is None else
               f"; {status.refused_puts} puts found the pool full (written once it evicted)"),
        )  # fmt: skip
    age = _oldest_age(status, int(time.time() * 1000))
    if age is not None:
        t.add_row(
            "oldest",
            f"written {format_age(age)} ago (the oldest of {status.ages_sampled} objects read)",
        )
    t.add_row("clients", "?" if status.clients is None else str(status.clients))
    segments = ", ".join(f"{n} ({format_bytes(c)})" for n, c in sorted(status.segments.items()))
    t.add_row("segments", f"{len(status.segments)}: {segments}" if segments else "0")
    hosts = status.hosts()
    if len(hosts) > 1:  # a pool across hosts: memory (and keys) per host
        t.add_row("hosts", "\n".join(
            f"{h}: {format_bytes(u)} used of {format_bytes(c)} ({n} segment{'s' * (n > 1)})"
            + _host_keys(status, h)
            for h, (n, u, c) in hosts.items()
        ))  # fmt: skip
    return t


def _host_keys(status: PoolStatus, host: str) -> str:
    if not status.host_keys_sampled:
        return ""
    n = status.host_keys.get(host, 0)
    estimated = status.keys is not None and status.host_keys_sampled < status.keys
    return f", {'~' if estimated else ''}{n} keys"


def namespace_table(summary: NamespaceSummary) -> Table:
    """Keys per kvpool namespace and KV group, and a row for keys of other users;
    a tenant column when some keys are in a tenant's space ("-": of no tenant)."""
    t = Table(title="keys by namespace", title_justify="left")
    tenants = any(row.tenant for row in summary.rows)
    if tenants:
        t.add_column("tenant")
    t.add_column("model")
    t.add_column("fingerprint")
    t.add_column("group", justify="right")
    t.add_column("contents", justify="right")
    t.add_column("keys", justify="right")
    t.add_column("bytes", justify="right")
    for row in summary.rows:
        cells = [row.model, row.fingerprint, f"g{row.group}", str(row.contents), str(row.keys)]
        t.add_row(*([row.tenant or "-"] if tenants else []), *cells, format_bytes(row.bytes))
    if summary.other or not summary.rows:
        t.add_row(*([""] if tenants else []), "(other)", "", "", "", str(summary.other), "")
    return t


def status_view(status: PoolStatus, pool_file: Path) -> Group:
    """Everything ``kvpool status`` prints."""
    parts: list[Table] = [status_table(status, pool_file)]
    ns = status.namespaces
    if ns is not None and (ns.rows or ns.other):
        parts.append(namespace_table(ns))
    return Group(*parts)


def status_json(status: PoolStatus, pool_file: Path) -> dict[str, Any]:
    """``kvpool status --json``: the same facts as one JSON object."""
    ns = status.namespaces
    return {
        "pool_file": str(pool_file),
        "master_address": status.master_address,
        "holder_address": status.holder_address,
        "metrics_url": status.metrics_url,
        "processes": [{"role": r, "pid": p, "running": ok} for r, p, ok in status.processes],
        "reachable": status.reachable,
        "error": status.error,
        "keys": status.keys,
        "used_bytes": status.used_bytes,
        "capacity_bytes": status.capacity_bytes,
        "clients": status.clients,
        "evicted_objects": status.evicted_objects,
        "evicted_bytes": status.evicted_bytes,
        "refused_puts": status.refused_puts,
        "oldest_object_age_s": _oldest_age(status, int(time.time() * 1000)),
        "ages_sampled": status.ages_sampled,
        "segments": dict(status.segments),
        "hosts": {
            h: {"segments": n, "used_bytes": u, "capacity_bytes": c}
            | ({"keys": status.host_keys.get(h, 0)} if status.host_keys_sampled else {})
            for h, (n, u, c) in status.hosts().items()
        },
        "host_keys_sampled": status.host_keys_sampled,
        "namespaces": None
        if ns is None
        else {
            "rows": [
                {
                    "tenant": r.tenant,
                    "model": r.model,
                    "fingerprint": r.fingerprint,
                    "group": r.group,
                    "contents": r.contents,
                    "keys": r.keys,
                    "bytes": r.bytes,
                }
                for r in ns.rows
            ],
            "other": ns.other,
        },
    }


# --------------------------------------------------------------------------- commands


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        size = parse_size(value, param.name or "size")
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    if size <= 0:
        raise click.BadParameter("must be > 0")
    return size


def _duration(value: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _check_metrics_url(url: str) -> None:
    """Before anything starts: ``--metrics-url`` must be http://HOST:PORT of a master
    that answers (a typo once ended in a 20 s wait blamed on the holder)."""
    if not re.fullmatch(r"http://[^/:\s]+:\d{1,5}/?", url):
        raise click.BadParameter(
            f"must be http://HOST:PORT, got {url!r}", param_hint="--metrics-url"
        )
    try:
        master_health(url, timeout=3.0)
    except StoreUnavailable as exc:
        raise click.BadParameter(
            f"{url} does not answer as a mooncake_master's metrics server ({exc}); give the "
            "master's http://HOST:PORT (`kvpool status` on its host shows it)",
            param_hint="--metrics-url",
        ) from None


def _host_port(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise click.BadParameter(f"must be HOST:PORT, got {value!r}")
    return value


def _live_pool(path: Path) -> LocalPool | None:
    """The pool the file names if any of its processes still runs; else None."""
    if not path.exists():
        return None
    try:
        pool = LocalPool.attach(path)
    except ConfigError:
        return None
    return pool if any(running for _, _, running in pool.processes()) else None


@contextlib.contextmanager
def _starting(pool_file: Path) -> Iterator[None]:
    """Hold ``<pool_file>.lock`` (never through a link planted at its name) for one
    ``kvpool up``; KVPoolError at once if another holds it."""
    lock = pool_file.with_name(pool_file.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise KVPoolError(f"cannot open the lock {lock}: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise KVPoolError(
                f"another `kvpool up` is starting a pool with pool file {pool_file}; "
                "wait for it, then `kvpool status`"
            ) from None
        yield
    finally:
        os.close(fd)  # releases the lock


@click.command()
@click.option(
    "--segment-size",
    default="1GB",
    show_default=True,
    callback=_size,
    help="Memory the holder gives the pool (e.g. 512MB, 4GiB).",
)
@click.option(
    "--client-ttl",
    default=10,
    show_default=True,
    type=click.IntRange(min=1),
    help="Seconds the master keeps a silent client's memory mounted.",
)
@click.option(
    "--lease-ttl-ms",
    default=LEASE_TTL_MS,
    show_default=True,
    type=click.IntRange(min=1),
    help="Read lease: an object read or looked up is not evicted (nor removed) for this "
    "long, in ms. Longer keeps more of what was read and less of what was written last.",
)
@click.option(
    "--master",
    default=None,
    metavar="HOST:PORT",
    callback=_host_port,
    help="Join this existing master: start only a holder.",
)
@click.option(
    "--metrics-url",
    default="",
    metavar="URL",
    help="With --master: its metrics server (http://HOST:PORT), for health and status.",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    metavar="ADDR",
    help="This host's address the master and holder bind and advertise; another host's "
    "address for engines and holders there to reach the pool (the network must be private).",
)
@click.option(
    "--secret",
    is_flag=True,
    help="Sign every object with a pool secret, kept in the pool file (mode 0600): engines "
    "refuse objects not signed with it. Uses $KVPOOL_POOL_SECRET if set (give every host "
    "the same), else makes one.",
)
@click.option(
    "--disk",
    "disk_dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep what the pool evicts from memory in files under this folder (read back "
    "from disk, at several times the time of a memory read; kept across a holder restart).",
)
@click.option(
    "--disk-size",
    default=None,
    callback=lambda ctx, param, value: None if value is None else _size(ctx, param, value),
    help="With --disk: at most this much on disk (e.g. 100GB); default: Mooncake's.",
)
def up(
    segment_size: int,
    client_ttl: int,
    lease_ttl_ms: int,
    master: str | None,
    metrics_url: str,
    host: str,
    secret: bool,
    disk_dir: Path | None,
    disk_size: int | None,
) -> None:
    """Start a local pool (master + holder) in the background."""
    if metrics_url and master is None:
        raise click.UsageError("--metrics-url goes with --master")
    if disk_size is not None and disk_dir is None:
        raise click.UsageError("--disk-size goes with --disk")
    if metrics_url:
        _check_metrics_url(metrics_url)
    pool_secret = ""
    if secret:
        pool_secret = os.environ.get("KVPOOL_POOL_SECRET") or secrets.token_hex(32)
    path = pool_file_path()
    with _starting(path):
        live = _live_pool(path)
        if live is not None:
            raise KVPoolError(
                f"a pool is already running (master {live.master_address}, pool file {path}); "
                "stop it with `kvpool down`"
            )
        if path.exists():
            click.echo(f"kvpool: replacing stale pool file {path}", err=True)
        pool = LocalPool.start(
            path.parent,
            segment_size=segment_size,
            client_ttl=client_ttl,
            lease_ttl_ms=lease_ttl_ms,
            master_address=master,
            metrics_url=metrics_url,
            detach=True,
            host=host,
            secret=pool_secret,
            disk_dir=disk_dir or "",
            disk_bytes=disk_size or 0,
        )
        try:
            pool.write_pool_file(path)
        except BaseException:
            pool.stop()
            raise
    console = _console()
    console.print("[bold green]kvpool pool is up[/bold green]", soft_wrap=True)
    console.print(up_summary(pool, path))
    console.print("\nvLLM: add to `vllm serve`:")
    click.echo(f"  --kv-transfer-config '{kv_transfer_config(path)}'")
    console.print("Stop it with `kvpool down`.")


@click.command()
def down() -> None:
    """Stop the pool in the pool file and remove the file."""
    path = pool_file_path()
    if not path.exists():
        raise KVPoolError(f"no pool to stop: {path} does not exist")
    pool = LocalPool.attach(path)
    running = [(role, pid) for role, pid, ok in pool.processes() if ok]
    pool.stop()
    left = [f"{role} (pid {pid})" for role, pid, ok in pool.processes() if ok]
    if left:
        raise KVPoolError(f"could not stop {', '.join(left)}; pool file {path} kept")
    path.unlink(missing_ok=True)
    stopped = ", ".join(f"{role} (pid {pid})" for role, pid in running) or "nothing was running"
    _console().print(
        f"kvpool pool at {pool.master_address} stopped: {stopped}; removed {path}", soft_wrap=True
    )


@contextlib.contextmanager
def _head_reader(pool: LocalPool) -> Iterator[Any]:
    """``MooncakeStore.read_heads`` of a client of ``pool``'s master, or None (logged)
    when no client connects: status then shows no object ages."""
    from kvpool.store.mooncake import MooncakeStore

    with mooncake_quiet():
        try:
            store = MooncakeStore(pool.config())
        except KVPoolError as exc:
            logging.getLogger(__name__).info("cannot read object headers: %s", exc)
            yield None
            return
        with store:
            yield store.read_heads


@contextlib.contextmanager
def mooncake_quiet() -> Iterator[None]:
    """Mooncake's C++ log lines (written to fd 2 whatever the log level) kept out of
    a command's output; shown after all if the block raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                caught.seek(0)
                os.write(2, caught.read()[-8000:])


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def status(as_json: bool) -> None:
    """Show the pool: processes, keys, memory, clients, segments, namespaces."""
    path = pool_file_path()
    if not path.exists():
        raise KVPoolError(f"no pool: {path} does not exist; start one with `kvpool up`")
    pool = LocalPool.attach(path)
    with _head_reader(pool) as read_heads:
        report = pool_status(pool, read_heads=read_heads)
    if as_json:
        click.echo(json.dumps(status_json(report, path)))
    else:
        _console().print(status_view(report, path))
    if not report.reachable:
        reason = report.error.splitlines()[0] if report.error else "no answer"
        raise KVPoolError(f"the master at {pool.master_address} is not answering: {reason}")


@click.command()
@click.option(
    "--model", default=None, help="Remove the objects of this model (its name as served)."
)
@click.option(
    "--fingerprint",
    default=None,
    metavar="HEX",
    help="Remove the objects of this config fingerprint (`kvpool status` lists them; at "
    "least 4 hex digits), of one model or of all.",
)
@click.option(
    "--tenant",
    default=None,
    help="Remove the objects of this tenant (the connector's `tenant` setting); with "
    "--model or --fingerprint, only those of it. Without it they match every tenant.",
)
@click.option(
    "--older-than",
    default=None,
    metavar="DURATION",
    callback=lambda ctx, param, v: None if v is None else _duration(v),
    help="Remove objects written longer ago than this (90s, 10m, 2h, 7d; the time in "
    "each object's header); with --tenant/--model/--fingerprint, only theirs.",
)
@click.option("--all", "everything", is_flag=True, help="Remove every kvpool object.")
@click.option("--dry-run", is_flag=True, help="Show what would be removed; remove nothing.")
@click.option(
    "--wait",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds to retry objects in use (an engine reading them holds a lease).",
)
def purge(
    model: str | None,
    fingerprint: str | None,
    tenant: str | None,
    older_than: float | None,
    everything: bool,
    dry_run: bool,
    wait: float,
) -> None:
    """Remove a tenant's or a model's objects, or old ones, from the running pool
    (safe while engines run)."""
    from kvpool.pool.ages import written_before, written_times
    from kvpool.pool.master_api import key_bytes, master_keys
    from kvpool.pool.purge import purge as remove
    from kvpool.pool.purge import select
    from kvpool.store.mooncake import MooncakeStore

    named = (model, fingerprint, tenant, older_than)
    if everything == any(v is not None for v in named):
        raise click.UsageError(
            "name what to remove: --tenant, --model, --fingerprint and/or --older-than, or --all"
        )
    if tenant is not None:
        try:
            check_tenant(tenant)
        except LayoutError as exc:
            raise click.BadParameter(str(exc), param_hint="--tenant") from None
    if fingerprint is not None and not re.fullmatch(r"[0-9a-f]{4,16}", fingerprint):
        raise click.BadParameter(
            f"4 to 16 lowercase hex digits, got {fingerprint!r}", param_hint="--fingerprint"
        )
    path = pool_file_path()
    if not path.exists():
        raise KVPoolError(f"no pool: {path} does not exist; start one with `kvpool up`")
    pool = LocalPool.attach(path)
    keys = select(
        master_keys(pool.metrics_url),
        model=model,
        fingerprint=fingerprint,
        tenant=tenant,
        everything=everything or (model is None and fingerprint is None and tenant is None),
    )
    given = (("tenant", tenant), ("model", model), ("fingerprint", fingerprint))
    what = "every kvpool object" if everything else " ".join(
        f"{name} {value}" for name, value in given if value is not None
    ) or "any tenant or model"  # fmt: skip
    unknown = 0
    if older_than is not None and keys:
        what += f" written over {format_age(older_than)} ago"
        cutoff = int((time.time() - older_than) * 1000)
        with mooncake_quiet(), MooncakeStore(pool.config()) as store:
            times = written_times(store.read_heads, keys)
        unknown = sum(t is None for t in times.values())
        keys = written_before(times, cutoff)
        if unknown:
            _console().print(
                f"kvpool purge: {unknown} objects of unknown age (gone meanwhile, or of "
                "another object format: `--fingerprint` removes those) are kept",
                soft_wrap=True,
            )
    if not keys:
        _console().print(f"kvpool purge: no object of {what} in the pool", soft_wrap=True)
        return
    sample = keys[:_PURGE_SAMPLE]
    size = key_bytes(pool.metrics_url, sample) * len(keys) // len(sample)
    approx = "~" if len(keys) > len(sample) else ""
    if dry_run:
        _console().print(
            f"kvpool purge --dry-run: would remove {len(keys)} objects of {what}, "
            f"{approx}{format_bytes(size)}",
            soft_wrap=True,
        )
        return
    with mooncake_quiet(), MooncakeStore(pool.config()) as store:
        result = remove(store, keys, wait_s=wait)
    _console().print(
        f"kvpool purge: removed {result.removed} objects of {what} ({approx}{format_bytes(size)}"
        f" before); {result.gone} were gone already",
        soft_wrap=True,
    )
    if result.in_use or result.failed:
        raise KVPoolError(
            f"{len(result.in_use)} objects still in use after {wait:g} s and {result.failed} the "
            "pool did not answer for were left; run kvpool purge again"
        )


_PURGE_SAMPLE = 1000  # keys whose size purge asks for, at most (one HTTP request each)


__all__ = [
    "down",
    "format_bytes",
    "kv_transfer_config",
    "namespace_table",
    "purge",
    "status",
    "status_json",
    "status_table",
    "status_view",
    "up",
    "up_summary",
]

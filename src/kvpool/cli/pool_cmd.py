"""``kvpool up``, ``down`` and ``status``: a local pool run from the pool file
(what they print: ``kvpool.cli.pool_render``; ``kvpool purge``: ``purge_cmd``).

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from kvpool.cli.console import mooncake_quiet
from kvpool.cli.pool_render import (
    kv_transfer_config,
    status_json,
    status_view,
    up_summary,
)
from kvpool.config import master_endpoints, parse_size, pool_file_path
from kvpool.errors import ConfigError, KVPoolError, StoreUnavailable
from kvpool.pool import (
    LocalPool,
    pool_status,
)
from kvpool.pool.local import LEASE_TTL_MS
from kvpool.pool.master_api import master_health
from kvpool.pool.quotas import parse_quota


def _console() -> Console:
    from kvpool.cli.console import console

    return console


# --------------------------------------------------------------------------- commands


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        size = parse_size(value, param.name or "size")
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    if size <= 0:
        raise click.BadParameter("must be > 0")
    return size


def _check_metrics_url(urls: str) -> None:
    """Before anything starts: ``--metrics-url`` must be http://HOST:PORT of a master
    that answers, or of HA masters a comma-separated list of which one answers at
    least (the other may be down; a typo once ended in a 20 s wait blamed on the
    holder)."""
    listed = [u.strip() for u in urls.split(",")]
    for url in listed:
        if not re.fullmatch(r"http://[^/:\s]+:\d{1,5}/?", url):
            raise click.BadParameter(
                f"must be http://HOST:PORT (HA masters: both, comma-separated), got {url!r}",
                param_hint="--metrics-url",
            )
    silent: list[str] = []
    for url in listed:
        try:
            master_health(url, timeout=3.0)
        except StoreUnavailable as exc:
            silent.append(f"{url} ({exc})")
    if len(silent) == len(listed):
        raise click.BadParameter(
            f"{'; '.join(silent)}: does not answer as a mooncake_master's metrics server; "
            "give the master's http://HOST:PORT (`kvpool status` on its host shows it)",
            param_hint="--metrics-url",
        )
    for one in silent:
        click.echo(
            f"kvpool: --metrics-url {one} does not answer; going on with the others", err=True
        )


def _host_port(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        master_endpoints(value)
    except ConfigError:
        raise click.BadParameter(
            f"must be HOST:PORT (a master) or etcd://HOST:PORT (an HA pool's etcd), got {value!r}"
        ) from None
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


def _quotas(values: tuple[str, ...]) -> dict[str, int]:
    """{tenant: bytes} of ``--quota`` values; a tenant named twice is an error."""
    out: dict[str, int] = {}
    for text in values:
        try:
            tenant, size = parse_quota(text)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--quota") from None
        if tenant in out:
            raise click.BadParameter(f"tenant {tenant} has two quotas", param_hint="--quota")
        out[tenant] = size
    return out


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
    help="Join this existing master (etcd://HOST:PORT: an HA pool's etcd): start only a holder.",
)
@click.option(
    "--ha",
    is_flag=True,
    help="No single point of failure in the masters: start etcd and two masters in "
    "Mooncake's HA mode (the standby replays the leader's log and takes over when it "
    "dies, objects kept). Needs Debian's etcd-server.",
)
@click.option(
    "--metrics-url",
    default="",
    metavar="URL",
    help="With --master: its metrics server (http://HOST:PORT; HA masters: both, "
    "comma-separated), for health and status.",
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
@click.option(
    "--quota",
    "quotas",
    multiple=True,
    metavar="TENANT=SIZE",
    callback=lambda ctx, param, value: _quotas(value),
    help="Give a tenant this share of the pool's memory (repeatable): its engines put "
    "through a holder of that size, and past the quota evict their own objects, never "
    "another tenant's. Engines of no tenant share what is left.",
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
    quotas: dict[str, int],
    ha: bool,
) -> None:
    """Start a local pool (master + holder) in the background."""
    if ha and master is not None:
        raise click.UsageError(
            "--ha starts the pool's own masters; to join an HA pool, give --master "
            "etcd://HOST:PORT (its etcd) without --ha"
        )
    if quotas and master is not None:
        raise click.UsageError("--quota starts a pool of its own: it does not go with --master")
    if metrics_url and master is None:
        raise click.UsageError("--metrics-url goes with --master")
    if disk_size is not None and disk_dir is None:
        raise click.UsageError("--disk-size goes with --disk")
    if metrics_url:
        if "," in metrics_url and not str(master).startswith("etcd://"):
            raise click.UsageError(
                "--metrics-url names several masters only with --master etcd://HOST:PORT "
                "(an HA pool's two masters); one master has one metrics URL"
            )
        metrics_url = ",".join(u.strip() for u in metrics_url.split(","))
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
            quotas=quotas,
            ha=ha,
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
            store = MooncakeStore(pool.command_config())
        except KVPoolError as exc:
            logging.getLogger(__name__).info("cannot read object headers: %s", exc)
            yield None
            return
        with store:
            yield store.read_heads


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


__all__ = ["down", "status", "up"]

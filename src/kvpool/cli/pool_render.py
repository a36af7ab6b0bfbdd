"""What ``kvpool up``, ``status`` and ``purge`` print: tables, sizes, ages, JSON.

    format_bytes(n), format_age(s)   ``1.0 GiB``, ``2.0 h``
    parse_duration(text)             seconds of ``90s``, ``10m``, ``2h``, ``7d``
    kv_transfer_config(pool_file)    the ``--kv-transfer-config`` JSON for vLLM
    up_summary(pool, file)           where a freshly started pool is
    status_table, namespace_table, status_view, status_json
                                     one pool's state (``kvpool status``)

Builders return rich renderables or plain data and print nothing.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table

from kvpool.pool import LocalPool, NamespaceSummary, PoolStatus
from kvpool.pool.quotas import DEFAULT_TENANT, registered
from kvpool.pool.status import MasterState

__all__ = [
    "format_age",
    "format_bytes",
    "kv_transfer_config",
    "namespace_table",
    "parse_duration",
    "status_json",
    "status_table",
    "status_view",
    "up_summary",
]


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
    if pool.ha_masters:
        t.add_row("etcd", f"{pool.etcd_endpoint}  ({_process_label(pool, 'etcd')})")
        for name, address in zip(("master", "master-2"), pool.ha_masters, strict=False):
            t.add_row(name, f"{address}  ({_process_label(pool, name)}, HA)")
        t.add_row("", f"engines and holders find the leader at {pool.master_address}")
    else:
        t.add_row("master", f"{pool.master_address}  ({_process_label(pool, 'master')})")
    t.add_row(
        "holder",
        f"{pool.holder_address}  ({_process_label(pool, 'holder')}, "
        f"{format_bytes(pool.shared_segment)})",
    )
    for tenant, address in pool.tenant_holders.items():
        t.add_row(
            f"tenant {tenant}",
            f"{address}  (holder of its share, {format_bytes(pool.quotas.get(tenant))}; "
            f"quota {format_bytes(registered(pool.quotas.get(tenant, 0)))})",
        )
    urls = [f"{u}/metrics" for u in pool.metrics_url.split(",") if u]
    t.add_row("metrics", ", ".join(urls) or "unknown")
    t.add_row("pool file", str(pool_file))
    if pool.secret:
        t.add_row("secret", "objects are signed; the secret is in the pool file (mode 0600)")
    if pool.disk_dir:
        limit = f", at most {format_bytes(pool.disk_bytes)}" if pool.disk_bytes else ""
        t.add_row("disk", f"evicted objects kept in {pool.disk_dir}{limit}")
    logs = ["etcd", "master", "master-2"] if pool.ha_masters else ["master"]
    t.add_row("logs", ", ".join(str(pool.home / f"{n}.log") for n in [*logs, "holder"]))
    return t


def status_table(status: PoolStatus, pool_file: Path) -> Table:
    """One pool's processes and the master's gauges."""
    t = Table(title="kvpool pool", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("pool file", str(pool_file))
    if status.masters:  # HA: etcd names the leader
        etcd = _process_label(status, "etcd")
        health = "[red]" + status.etcd + "[/red]" if status.etcd else "healthy"
        t.add_row("master", f"{status.master_address}  (etcd, {etcd}): {health}")
        for m in status.masters:
            t.add_row(f"  {m.name}", _master_line(status, m))
        t.add_row("  failovers", _failovers_line(status))
    else:
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
    for tenant, (charged, quota) in sorted(status.tenants.items()):
        name = "(no tenant)" if tenant == DEFAULT_TENANT else tenant
        t.add_row(f"quota {name}", f"{format_bytes(charged)} used of {format_bytes(quota)}")
    if status.tenants:
        t.add_row("", "keys of tenants with a quota are not listed (Mooncake lists its "
                  "default tenant's only)")  # fmt: skip
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


def _master_line(status: PoolStatus, m: MasterState) -> str:
    label = f"{m.address}  ({_process_label(status, m.name)})"
    if m.role == "down":
        return f"{label}: [red]down[/red]"
    view = "" if m.view is None else f", view {m.view}"
    colour = "green" if m.role == "leader" else "default"
    return f"{label}: [{colour}]{m.role}[/{colour}] ({m.state}{view})"


def _failovers_line(status: PoolStatus, shown: int = 3) -> str:
    """How many leaders were replaced, and the last few leaders (from etcd)."""
    if status.failovers is None:
        return f"[yellow]unknown[/yellow] ({status.elections_error})"
    last = status.elections[-shown:]
    leaders = ", then ".join(f"{e.leader} from view {e.view}" for e in last)
    more = "..., " if len(status.elections) > shown else ""
    return f"{status.failovers}" + (f" (leaders: {more}{leaders})" if last else "")


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


def _ha_json(status: PoolStatus) -> dict[str, Any]:
    if not status.masters:
        return {}
    return {
        "masters": [dataclasses.asdict(m) for m in status.masters],
        "etcd_error": status.etcd,
        "failovers": status.failovers,
        "leaders": [dataclasses.asdict(e) for e in status.elections],
        "leaders_error": status.elections_error,
    }


def status_json(status: PoolStatus, pool_file: Path) -> dict[str, Any]:
    """``kvpool status --json``: the same facts as one JSON object."""
    ns = status.namespaces
    return {
        "pool_file": str(pool_file),
        "master_address": status.master_address,
        "holder_address": status.holder_address,
        "metrics_url": status.metrics_url,
        **_ha_json(status),
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
        "quotas": {
            t: {"used_bytes": used, "quota_bytes": quota}
            for t, (used, quota) in sorted(status.tenants.items())
        },
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

"""``kvpool purge``: remove a tenant's or a model's objects, or old ones, from the
running pool (safe while engines run; ``kvpool.pool.purge`` says why)."""

from __future__ import annotations

import re
import time

import click
from rich.console import Console

from kvpool.cli.console import mooncake_quiet
from kvpool.cli.pool_render import format_age, format_bytes, parse_duration
from kvpool.config import pool_file_path
from kvpool.errors import KVPoolError, LayoutError
from kvpool.keys import ROOT_PREFIX, check_tenant
from kvpool.pool import LocalPool

__all__ = ["purge"]


def _console() -> Console:
    from kvpool.cli.console import console

    return console


def _duration(value: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


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
    quota_tenants = [t for t in pool.tenant_holders if everything or t == tenant]
    if quota_tenants and (model, fingerprint, older_than) != (None, None, None):
        raise click.UsageError(
            f"tenant {quota_tenants[0]} has a quota: the master does not list its keys, so "
            "only all of its objects can go (`kvpool purge --tenant NAME` alone)"
        )
    for name in quota_tenants:
        _purge_quota_tenant(pool, name, dry_run, wait)
    if tenant is not None and tenant in pool.tenant_holders:
        return
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
        with mooncake_quiet(), MooncakeStore(pool.command_config()) as store:
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
    with mooncake_quiet(), MooncakeStore(pool.command_config()) as store:
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


def _purge_quota_tenant(pool: LocalPool, tenant: str, dry_run: bool, wait: float) -> None:
    """Every kvpool object of a tenant with a quota: in its own Mooncake namespace,
    which the master's key listing leaves out, by prefix through a client of it.
    Objects in use are kept until their lease ends, retried for ``wait`` s."""
    from kvpool.pool.quotas import tenant_usage
    from kvpool.store.mooncake import MooncakeStore

    charged = tenant_usage(pool.metrics()).get(tenant, (0, 0))[0]
    if dry_run:
        _console().print(
            f"kvpool purge --dry-run: would remove every kvpool object of tenant {tenant} "
            f"({format_bytes(charged)} charged to its quota)",
            soft_wrap=True,
        )
        return
    removed = 0
    deadline = time.monotonic() + wait
    with mooncake_quiet(), MooncakeStore(pool.command_config().for_tenant(tenant)) as store:
        while True:
            removed += store.remove_prefix(ROOT_PREFIX)
            left = tenant_usage(pool.metrics()).get(tenant, (0, 0))[0]
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.1)  # objects in use: their read leases run out on the master
    _console().print(
        f"kvpool purge: removed {removed} objects of tenant {tenant} "
        f"({format_bytes(charged)} before)",
        soft_wrap=True,
    )
    if left:
        raise KVPoolError(
            f"{format_bytes(left)} of tenant {tenant} still in use after {wait:g} s; "
            "run kvpool purge again"
        )


_PURGE_SAMPLE = 1000  # keys whose size purge asks for, at most (one HTTP request each)

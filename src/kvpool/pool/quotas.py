"""Tenant quotas: each tenant's share of a pool's memory, as Mooncake enforces it.

    parse_quota(text)              ("TENANT", bytes) from ``TENANT=SIZE`` (``--quota``)
    Shares.plan(memory, quotas)    the pool's memory split: each quota tenant's share,
                                   and what is left for engines of no tenant (or of a
                                   tenant without a quota); ``ConfigError`` saying what
                                   to change when the quotas do not fit
    registered(share)              the quota a share is registered with (``QUOTA_FILL``)
    shares.policy_yaml()           the master's tenant policy file (``--enable_multi_tenants
                                   --tenant_quota_connector_uri``)
    tenant_usage(metrics)          {Mooncake tenant: (bytes charged, quota)} from the
                                   master's metrics

A tenant with a quota gets its own holder whose memory is its share, and Mooncake
charges every object to the tenant of the client that put it: a tenant past its
quota evicts its own oldest objects to admit a new one, never another tenant's.
Mooncake also evicts across tenants once the whole pool is ``EVICTION_HIGH`` full,
so each tenant is registered with ``QUOTA_FILL`` of its share: all tenants at their
quotas leave the pool below that mark. Engines of no tenant are Mooncake's tenant
``default``, registered with the rest of the memory the same way.

Mooncake keeps each tenant's keys apart (one key names different objects in two
tenants), and its admin HTTP API lists only the ``default`` tenant's keys. Pure:
no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvpool.config import parse_size
from kvpool.errors import ConfigError, LayoutError
from kvpool.keys import check_tenant

__all__ = [
    "DEFAULT_TENANT",
    "QUOTA_FILL",
    "Shares",
    "parse_quota",
    "registered",
    "tenant_usage",
]

DEFAULT_TENANT = "default"  # Mooncake's tenant of a client that names none
EVICTION_HIGH = 0.9  # mooncake_master's --eviction_high_watermark_ratio default
QUOTA_FILL = 0.85  # of a share, a tenant's registered quota: below EVICTION_HIGH
MIN_SHARE = 16 << 20  # a share is one holder's segment: Mooncake's minimum


def registered(share: int) -> int:
    """The quota Mooncake enforces for a share of ``share`` bytes."""
    return int(share * QUOTA_FILL)


def parse_quota(text: str) -> tuple[str, int]:
    """``("A", 1 << 30)`` from ``"A=1GiB"``; ``ConfigError`` saying the form."""
    tenant, sep, size = text.partition("=")
    if not sep or not tenant or not size:
        raise ConfigError(f"a quota is TENANT=SIZE (e.g. teamA=2GB), got {text!r}")
    try:
        check_tenant(tenant)
    except LayoutError as exc:
        raise ConfigError(f"quota {text!r}: {exc}") from None
    if tenant == DEFAULT_TENANT:
        raise ConfigError(
            f"quota {text!r}: '{DEFAULT_TENANT}' is the share of engines of no tenant "
            "(what the quotas leave); name another tenant"
        )
    return tenant, parse_size(size, f"quota of {tenant}")


@dataclass(frozen=True, slots=True)
class Shares:
    """A pool's memory split between quota tenants and the rest (bytes)."""

    tenants: tuple[tuple[str, int], ...]  # (tenant, share), in the order given
    rest: int  # engines of no tenant, or of a tenant without a quota

    @classmethod
    def plan(cls, memory: int, quotas: Mapping[str, int]) -> Shares:
        small = [t for t, q in quotas.items() if q < MIN_SHARE]
        if small:
            raise ConfigError(
                f"quota of {small[0]} is {quotas[small[0]]} bytes; each quota must be at "
                "least 16MiB (one holder's memory, Mooncake's minimum)"
            )
        rest = memory - sum(quotas.values())
        if rest < MIN_SHARE:
            raise ConfigError(
                f"the quotas add up to {sum(quotas.values())} bytes of the pool's {memory}; "
                "leave at least 16MiB for engines of no tenant: raise --segment-size or "
                "lower a quota"
            )
        return cls(tuple(quotas.items()), rest)

    def policy_yaml(self) -> str:
        """Mooncake's tenant quota policy (version 1): every tenant with
        ``QUOTA_FILL`` of its share, ``default`` with that of the rest."""
        lines = ["version: 1", "tenants:"]
        for tenant, share in ((DEFAULT_TENANT, self.rest), *self.tenants):
            lines += [f"  - name: {tenant}", f"    quota: {registered(share)}"]
        return "\n".join(lines) + "\n"


def tenant_usage(metrics: Mapping[str, float]) -> dict[str, tuple[int, int]]:
    """{Mooncake tenant: (bytes charged, effective quota)} from ``master_metrics``;
    empty for a pool without tenants."""
    out: dict[str, tuple[int, int]] = {}
    for metric, slot in (
        ("mooncake_tenant_quota_charged_bytes", 0),
        ("mooncake_tenant_quota_effective_bytes", 1),
    ):
        prefix = metric + '{tenant_id="'
        for name, value in metrics.items():
            if name.startswith(prefix) and name.endswith('"}'):
                tenant = name[len(prefix) : -2]
                pair = list(out.get(tenant, (0, 0)))
                pair[slot] = int(value)
                out[tenant] = (pair[0], pair[1])
    return out

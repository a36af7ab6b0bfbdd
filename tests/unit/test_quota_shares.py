"""Tenant quotas: parsing, the split of a pool's memory, the master's policy file,
usage from metrics, and a client's config for its tenant (pure logic)."""

from __future__ import annotations

import pytest

from kvpool.config import PoolConfig
from kvpool.errors import ConfigError
from kvpool.pool.quotas import QUOTA_FILL, Shares, parse_quota, tenant_usage

MiB = 1 << 20


def test_a_quota_is_a_tenant_and_a_size() -> None:
    assert parse_quota("teamA=2GiB") == ("teamA", 2 << 30)
    assert parse_quota("b.1-x=512MB") == ("b.1-x", 512 * MiB)  # as --segment-size reads it


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("teamA", "TENANT=SIZE"),
        ("=1GB", "TENANT=SIZE"),
        ("teamA=", "TENANT=SIZE"),
        ("_a=1GB", "tenant name"),
        ("default=1GB", "engines of no tenant"),
        ("teamA=lots", "byte size"),
    ],
)
def test_a_malformed_quota_says_what_to_write(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_quota(text)


def test_shares_leave_the_rest_to_engines_of_no_tenant_and_register_below_eviction() -> None:
    shares = Shares.plan(128 * MiB, {"a": 32 * MiB, "b": 48 * MiB})
    assert shares.rest == 48 * MiB and shares.tenants == (("a", 32 * MiB), ("b", 48 * MiB))
    yaml = shares.policy_yaml()
    assert yaml.splitlines()[:2] == ["version: 1", "tenants:"]
    quotas = dict(
        zip(
            [ln.split(": ")[1] for ln in yaml.splitlines() if "name:" in ln],
            [int(ln.split(": ")[1]) for ln in yaml.splitlines() if "quota:" in ln],
            strict=True,
        )
    )
    assert quotas == {t: int(n * MiB * QUOTA_FILL) for t, n in (("default", 48), ("a", 32),
                                                                ("b", 48))}  # fmt: skip
    assert sum(quotas.values()) < 0.9 * 128 * MiB  # all full: below Mooncake's eviction mark


@pytest.mark.parametrize(
    ("quotas", "says"),
    [({"a": 8 * MiB}, "at least 16MiB"), ({"a": 64 * MiB, "b": 56 * MiB}, "leave at least")],
)
def test_quotas_that_do_not_fit_the_pool_are_refused(quotas: dict[str, int], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        Shares.plan(128 * MiB, quotas)


def test_tenant_usage_reads_charged_bytes_and_quota_per_tenant() -> None:
    metrics = {
        'mooncake_tenant_quota_charged_bytes{tenant_id="a"}': 5.0,
        'mooncake_tenant_quota_effective_bytes{tenant_id="a"}': 9.0,
        'mooncake_tenant_quota_effective_bytes{tenant_id="default"}': 7.0,
        "master_key_count": 3.0,
    }
    assert tenant_usage(metrics) == {"a": (5, 9), "default": (0, 7)}
    assert tenant_usage({"master_key_count": 3.0}) == {}


def test_a_client_of_a_quota_tenant_goes_through_its_holder() -> None:
    pool = PoolConfig(
        master_address="127.0.0.1:5000",
        holder_address="127.0.0.1:5001",
        tenant_holders="a=127.0.0.1:5002, b=127.0.0.1:5003",
    )
    a = pool.for_tenant("a")
    assert (a.mooncake_tenant, a.holder_address) == ("a", "127.0.0.1:5002")
    assert pool.for_tenant("c") is pool and pool.for_tenant("") is pool  # the shared rest
    assert PoolConfig().for_tenant("a") == PoolConfig()  # a pool without quotas
    with pytest.raises(ConfigError, match="TENANT=HOST:PORT"):
        PoolConfig(tenant_holders="a=nowhere")

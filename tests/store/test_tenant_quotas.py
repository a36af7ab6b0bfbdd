"""Tenant quotas on a real Mooncake master (``kvpool up --quota``).

A pool of 96 MiB with quotas A=32MiB and B=32MiB (32 MiB left for engines of no
tenant). Tenant B saves prompts and never reads them again; tenant A then writes
four times the whole pool. With quotas, every object of B is still there and A
evicted only its own; the control, the same flood on a pool without quotas,
evicts B's prompts. Prompts are 4 MiB: 32 chunk objects of 128 KiB.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpool.config import PoolConfig, read_pool_file
from kvpool.pool import LocalPool
from kvpool.pool.quotas import QUOTA_FILL, tenant_usage
from kvpool.store.base import Status
from kvpool.store.mooncake import MooncakeStore
from kvpool.transfer import ChunkRef, TransferEngine

PoolFactory = Callable[..., LocalPool]  # the conftest fixture's type

MiB = 1 << 20
NB, BS, ROW = 40, 32, 512  # blocks; a block is 2 x 32 x 512 float32 = 128 KiB
CHUNKS = 32  # objects per prompt: 4 MiB
POOL, QUOTA = 96 * MiB, 32 * MiB
B_PROMPTS = 4  # 16 MiB of B's: half its share, never read again


def _prompt(name: str) -> list[ChunkRef]:
    return [ChunkRef(f"{name}/{c:02d}", 0, c, (c,)) for c in range(CHUNKS)]


def _present(store: MooncakeStore, name: str) -> int:
    return store.batch_exists([c.key for c in _prompt(name)]).count(Status.OK)


def _save(config: PoolConfig, kv: torch.Tensor, names: list[str]) -> None:
    """Save each prompt of ``names`` through ``config``'s client (shared memory)."""
    with MooncakeStore(config, shared_memory=True) as store:
        assert store.shared_memory, "the tenant's own holder serves shared memory"
        engine = TransferEngine(store, [[("l0", kv)]], NB, staging_bytes=32 * MiB)
        try:
            for name in names:
                assert engine.submit_save(name, _prompt(name)), name
                (saved,) = engine.wait([name], timeout=60)
                assert saved.ok, (name, saved.statuses)  # A admits all: it evicts its own
        finally:
            engine.close()


def _flood(pool: LocalPool) -> tuple[list[int], int, int]:
    """B saves, A writes 4x the pool: (objects left of each B prompt, of A's newest
    prompt, and of A's newest prompt as B's client sees it)."""
    kv = torch.randn(NB, 2, BS, ROW)
    a, b = pool.config().for_tenant("A"), pool.config().for_tenant("B")
    b_names = [f"b{i}" for i in range(B_PROMPTS)]
    _save(b, kv, b_names)
    a_names = [f"a{i:03d}" for i in range(4 * POOL // (CHUNKS * 128 << 10))]
    _save(a, kv, a_names)
    with MooncakeStore(b) as b_store, MooncakeStore(a) as a_store:
        return (
            [_present(b_store, n) for n in b_names],
            _present(a_store, a_names[-1]),
            _present(b_store, a_names[-1]),
        )


def test_a_tenant_writing_four_times_the_pool_evicts_only_its_own_objects(
    pool_factory: PoolFactory,
) -> None:
    pool = pool_factory(segment_size=POOL, lease_ttl_ms=200, quotas={"A": QUOTA, "B": QUOTA})
    # The pool file names each tenant's holder; a tenant's client goes through it.
    assert pool.pool_file is None
    data = read_pool_file(pool.write_pool_file(pool.home / "pool.json"))
    holders = PoolConfig(tenant_holders=data["tenant_holders"]).holders_by_tenant()
    assert sorted(holders) == ["A", "B"] and data["quotas"] == {"A": QUOTA, "B": QUOTA}
    assert pool.config().for_tenant("A").holder_address == holders["A"] != pool.holder_address
    assert pool.config().for_tenant("C") == pool.config()  # no quota: the shared rest
    left_b, left_a, a_as_b = _flood(pool)
    assert left_b == [CHUNKS] * B_PROMPTS  # every object of B's
    assert left_a == CHUNKS  # A keeps admitting its newest
    assert a_as_b == 0  # tenants' keys are apart: B does not see A's objects
    usage = tenant_usage(pool.metrics())
    assert usage["A"][1] == int(QUOTA * QUOTA_FILL) and usage["default"][1] > 0
    assert 0 < usage["A"][0] <= usage["A"][1]  # A filled its quota, and no more
    assert usage["B"][0] == B_PROMPTS * CHUNKS * (128 << 10)
    # kvpool down finds every holder in the pool file
    attached = LocalPool.attach(pool.home / "pool.json")
    assert sorted(role for role, _, ok in attached.processes() if ok) == [
        "holder", "holder-A", "holder-B", "master"
    ]  # fmt: skip


def test_without_quotas_the_same_flood_evicts_the_other_tenants_prompts(
    pool_factory: PoolFactory,
) -> None:
    """The control: one 96 MiB holder, tenants only in key names."""
    pool = pool_factory(segment_size=POOL, lease_ttl_ms=200)
    left_b, left_a, _ = _flood(pool)
    assert left_a == CHUNKS
    assert sum(left_b) < B_PROMPTS * CHUNKS // 2, left_b

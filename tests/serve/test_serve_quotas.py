"""``vllm serve`` on a pool with tenant quotas (``kvpool up --quota``): a tenant's
engines put through its own holder, over shared memory, within its quota, and a
restarted server of the tenant hits what it saved; an engine of no tenant does not.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.serve.test_serve import BLOCK, prompt, saved_all

from kvpool.pool import LocalPool
from kvpool.pool.quotas import tenant_usage

TINY_KV_HEADS = 2  # the serve fixture's tiny model: a chunk is one object per KV head


@pytest.fixture
def local_pool(pool_factory: Any) -> LocalPool:
    """The pool the ``serve`` fixture's servers use: 256 MiB, 64 MiB of it teamA's."""
    pool: LocalPool = pool_factory(segment_size=256 << 20, quotas={"teamA": 64 << 20})
    return pool


def test_a_quota_tenants_server_saves_within_its_quota_and_a_restart_hits(
    serve: Any, local_pool: LocalPool
) -> None:
    ids = prompt(5)
    whole = len(ids) // BLOCK * BLOCK
    first = serve("quota-a", connector={"tenant": "teamA"})
    assert first.complete(ids).cached_tokens == 0
    saved_all(first, whole // BLOCK * TINY_KV_HEADS)
    first.stop()
    again = serve("quota-b", connector={"tenant": "teamA"})
    assert again.complete(ids).cached_tokens == whole
    log = again.log_path.read_text()
    assert "tenant teamA puts within its quota" in log
    assert "over shared memory (tenant teamA)" in log  # through teamA's own holder
    usage = tenant_usage(local_pool.metrics())
    assert usage["teamA"][0] > 0 and usage["default"][0] == 0  # charged to teamA alone
    other = serve("quota-none")  # no tenant: another space
    assert other.complete(ids).cached_tokens == 0

"""Shared test set-up: loopback-only Mooncake settings, markers by directory, pools.

    tests/unit/   -> marker ``unit``   (pure logic, no processes)
    tests/store/  -> marker ``store``  (a real mooncake_master on loopback)
    tests/vllm/   -> marker ``vllm``   (a real vLLM engine on the CPU)
    tests/chaos/  -> marker ``chaos``  (the fault matrix: real pools and engines)
    tests/serve/  -> marker ``serve``  (real ``vllm serve`` processes, DP engines)
    tests/hosts/  -> marker ``hosts``  (several simulated hosts: network namespaces)

Fixtures:
    pool_factory  ``pool_factory(segment_size=256 MiB, with_holder=True, client_ttl=2,
                  lease_ttl_ms=500, **start_kwargs) -> LocalPool``; each call starts a
                  fresh pool on free ports under the test's tmp dir; every pool it
                  started is stopped at teardown, whether the test passed or not
    local_pool    one started pool with a holder and the test timers above
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeAlias

import pytest
from hypothesis import settings

from kvpool.pool import LocalPool

# Set before any test (or Mooncake) reads them: advertise loopback only, and fail a
# setup against a missing master in seconds rather than ~90 s.
os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] = "1"

# Property tests draw the same examples on every run, so CI is deterministic; set
# HYPOTHESIS_PROFILE=explore to draw new ones (and pin what they find with @example).
# No wall-clock deadline: two pytest processes share two cores in CI, and a slow
# example is not a wrong one (timing bounds live in the benches).
settings.register_profile("kvpool", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvpool"))

_TESTS = Path(__file__).parent
_MARKERS = {"unit", "store", "vllm", "chaos", "serve", "hosts"}

PoolFactory: TypeAlias = Callable[..., LocalPool]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the name of its top-level test directory."""
    for item in items:
        try:
            top = item.path.relative_to(_TESTS).parts[0]
        except (ValueError, IndexError):
            continue
        if top in _MARKERS:
            item.add_marker(getattr(pytest.mark, top))


@pytest.fixture
def pool_factory(tmp_path: Path) -> Iterator[PoolFactory]:
    """Start pools on demand; all of them are stopped when the test ends."""
    pools: list[LocalPool] = []

    def start(
        segment_size: int = 256 << 20,
        with_holder: bool = True,
        client_ttl: int = 2,
        lease_ttl_ms: int = 500,
        **kwargs: Any,
    ) -> LocalPool:
        home = tmp_path / f"pool{len(pools)}"
        pool = LocalPool.start(
            home,
            segment_size=segment_size,
            with_holder=with_holder,
            client_ttl=client_ttl,
            lease_ttl_ms=lease_ttl_ms,
            **kwargs,
        )
        pools.append(pool)
        return pool

    try:
        yield start
    finally:
        for pool in reversed(pools):
            pool.stop(kill=True)  # throwaway pools: no graceful shutdown to wait for


@pytest.fixture
def local_pool(pool_factory: PoolFactory) -> LocalPool:
    """A running pool: master and a 256 MiB holder, client_ttl 2 s, lease 500 ms."""
    return pool_factory()

"""Opening a connector's halves (``kvpool.connector.opening``): a worker's store and
the scheduler's lookups, on the in-memory store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.unit.test_worker import identity

from kvpool.config import PoolConfig
from kvpool.connector.opening import start_lookups, worker_store
from kvpool.settings import ConnectorSettings
from kvpool.store.framed import FramedStore
from kvpool.store.memory import MemoryStore

OPENED: list[dict[str, Any]] = []


class Recording(MemoryStore):
    """A memory store that notes the options it was opened with."""

    @classmethod
    def from_config(cls, config: PoolConfig, **options: Any) -> Recording:
        OPENED.append(options)
        return cls(capacity=1 << 20)


@pytest.mark.parametrize(
    ("mode", "holder", "shm"),
    [
        ("auto", "127.0.0.1:5000", True),  # a holder on this host
        ("auto", "10.0.0.9:5000", False),  # another host's: TCP
        ("on", "10.0.0.9:5000", True),
        ("off", "127.0.0.1:5000", False),
    ],
)
def test_a_worker_opens_shared_memory_only_with_a_holder_here_unless_told(
    mode: str, holder: str, shm: bool
) -> None:
    settings = ConnectorSettings(store=f"{__name__}:Recording", shared_memory=mode)  # type: ignore[arg-type]
    OPENED.clear()
    store = worker_store(identity(), settings)(PoolConfig(holder_address=holder))
    assert [{"shared_memory": shm}] == OPENED
    assert isinstance(store, FramedStore)  # fingerprinted, checked objects
    store.close()


def test_the_scheduler_lookups_answer_and_a_second_engine_takes_the_next_endpoint(
    tmp_path: Path,
) -> None:
    settings = ConnectorSettings(store="memory", run_dir=str(tmp_path), instance="i")
    first = start_lookups(identity(), settings, PoolConfig(), exact=False)
    second = start_lookups(identity(), settings, PoolConfig(), exact=False)
    try:
        assert first.server.endpoint.url != second.server.endpoint.url
        assert first.client.lookup("r", [b"\x01" * 32], 64) == 0  # an empty pool
        stats = first.client.stats
        assert stats.lookups == 1 and not stats.misses  # answered, not failed
    finally:
        first.close()
        second.close()

"""vLLM's worker half: ``kvpool.connector.worker.Worker`` with vLLM's parts.

WorkerSide(identity, rank, settings, pool, kv_cache_config, open_store, events)
    a ``Worker`` that reads layer indices with vLLM's ``extract_layer_index``
    and reports ``KVPoolWorkerMetadata``. What it does, and why:
    ``kvpool.connector.worker``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.config import PoolConfig
from kvpool.connector.identity import EngineIdentity
from kvpool.connector.worker import IDLE_WAIT_S, RECONNECT_BACKOFF_S, Worker
from kvpool.settings import ConnectorSettings
from kvpool.store.base import KVStore
from kvpool.vllm.identity import layer_index
from kvpool.vllm.metadata import KVPoolWorkerMetadata

__all__ = ["IDLE_WAIT_S", "RECONNECT_BACKOFF_S", "WorkerSide"]


class WorkerSide(Worker):
    """A ``Worker`` with vLLM's layer indices and worker metadata."""

    def __init__(
        self,
        identity: EngineIdentity,
        rank: int,
        settings: ConnectorSettings,
        pool: PoolConfig,
        kv_cache_config: Any,
        open_store: Callable[[PoolConfig], KVStore],
        events: bool = False,
    ) -> None:
        super().__init__(
            identity,
            rank,
            settings,
            pool,
            kv_cache_config,
            open_store,
            events,
            layer_index=layer_index,
            new_report=KVPoolWorkerMetadata,
        )

"""Worker half of the connector: turns step metadata into transfer jobs.

    WorkerSide.register(kv_caches)  describe the KV tensors per group and open the
        pool (a FramedStore over Mooncake) and the TransferEngine; a pool that
        cannot be reached leaves the worker idle (every load then fails fast)
    WorkerSide.start_loads(meta)    queue this step's loads (background)
    WorkerSide.start_saves(meta)    stage the chunks this rank writes (the layout's
        striping rule) and queue their puts; called after the forward
    WorkerSide.finished()           (finished loads, failed loads) by request id;
        never blocks
    WorkerSide.load_errors()        block ids to recompute, reported no later than
        the step that returns their request as finished
    WorkerSide.worker_meta()        chunk hashes that failed to load, for the
        scheduler's lookup suppression

A request whose load finished is always reported finished, failed or not.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch

from kvpool.config import PoolConfig
from kvpool.errors import KVPoolError
from kvpool.store.base import KVStore
from kvpool.transfer import ChunkRef, TransferEngine, TransferStats
from kvpool.vllm.identity import EngineIdentity
from kvpool.vllm.metadata import KVPoolMetadata, KVPoolWorkerMetadata, RequestOps
from kvpool.vllm.settings import ConnectorSettings
from kvpool.vllm.stats import KVPoolStats, stats_delta

__all__ = ["WorkerSide"]

logger = logging.getLogger(__name__)


class WorkerSide:
    def __init__(
        self,
        identity: EngineIdentity,
        rank: int,
        settings: ConnectorSettings,
        pool: PoolConfig,
        kv_cache_config: Any,
        open_store: Callable[[PoolConfig], KVStore],
    ) -> None:
        self.identity = identity
        self.rank = rank
        self.settings = settings
        self.pool = pool
        self.kv_cache_config = kv_cache_config
        self._open_store = open_store
        self.engine: TransferEngine | None = None
        self.store: KVStore | None = None
        self._local: dict[int, int] = {}  # vLLM group index -> engine group index
        self._jobs = itertools.count()
        self._loads: dict[object, tuple[str, dict[str, bytes]]] = {}  # job -> (req, key->hash)
        self._invalid: set[int] = set()
        self._failed_hashes: set[bytes] = set()
        self._unfinished_without_engine: set[str] = set()
        self._last_stats = TransferStats()

    # -- set-up ------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups: list[list[tuple[str, torch.Tensor]]] = []
        for g, spec in enumerate(self.kv_cache_config.kv_cache_groups):
            layers = [(n, kv_caches[n]) for n in spec.layer_names if n in kv_caches]
            if layers:  # a PP stage holds only its own layers
                self._local[g] = len(groups)
                groups.append(layers)
        if not groups:
            logger.warning("kvpool: no KV tensors on this worker; the connector stays idle")
            return
        try:
            self.store = self._open_store(self.pool)
            mode = self.settings.load_mode
            self.engine = TransferEngine(
                self.store,
                groups,
                int(self.kv_cache_config.num_blocks),
                staging_bytes=self.settings.staging_bytes,
                # Staged by default: bytes reach the KV cache only after their header
                # and checksum were checked, and each object moves as one segment.
                load_mode="staged" if mode == "auto" else mode,
            )
        except KVPoolError as exc:
            logger.error("kvpool: %s; the worker connector stays idle (loads miss)", exc)
            if self.store is not None:
                self.store.close()
                self.store = None

    # -- per step ------------------------------------------------------------------

    def _refs(self, ops: RequestOps, writing: bool) -> list[tuple[ChunkRef, bytes]]:
        """This rank's chunk objects of ``ops`` (only those it writes, when writing)."""
        layout, space = self.identity.layout, self.identity.space
        refs = []
        for c in ops.chunks:
            for g, local in self._local.items():
                if writing and not layout.writes(self.rank, g, c.chunk):
                    continue
                key = space.key(layout.content(self.rank, g), c.chunk_hash)
                refs.append((ChunkRef(key, local, c.chunk, c.block_ids[g]), c.chunk_hash))
        return refs

    def start_loads(self, meta: KVPoolMetadata) -> None:
        for ops in meta.loads:
            if self.engine is None:
                self._unfinished_without_engine.add(ops.req_id)
                for c in ops.chunks:
                    self._invalid.update(b for ids in c.block_ids for b in ids)
                continue
            job = ("load", next(self._jobs))
            refs = self._refs(ops, writing=False)
            self._loads[job] = (ops.req_id, {r.key: h for r, h in refs})
            self.engine.submit_load(job, [r for r, _ in refs])

    def start_saves(self, meta: KVPoolMetadata) -> None:
        if self.engine is None:
            return
        for ops in meta.saves:
            refs = [r for r, _ in self._refs(ops, writing=True)]
            if refs:
                self.engine.submit_save(("save", next(self._jobs)), refs)

    def finished(self) -> tuple[set[str], set[str]]:
        """(request ids whose load finished, the subset that failed)."""
        done, failed = set(self._unfinished_without_engine), set(self._unfinished_without_engine)
        self._unfinished_without_engine.clear()
        if self.engine is None:
            return done, failed
        for result in self.engine.poll():
            if result.kind != "load":
                continue
            req_id, hashes = self._loads.pop(result.job_id)
            done.add(req_id)
            logger.debug(
                "kvpool: load of %s: %d chunk(s), %.1f MiB in %.1f ms",
                req_id,
                len(result.statuses),
                result.nbytes / 2**20,
                result.seconds * 1e3,
            )
            bad = [k for k, s in result.statuses.items() if not s.ok]
            if bad:
                failed.add(req_id)
                self._invalid |= result.invalid_block_ids
                self._failed_hashes.update(hashes[k] for k in bad)
                causes = sorted({result.statuses[k].value for k in bad})
                logger.warning(
                    "kvpool: load of %d chunk(s) of %s failed (%s); recomputing",
                    len(bad),
                    req_id,
                    ", ".join(causes),
                )
        return done, failed

    def load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def worker_meta(self) -> KVPoolWorkerMetadata | None:
        if not self._failed_hashes:
            return None
        out = KVPoolWorkerMetadata(self._failed_hashes)
        self._failed_hashes = set()
        return out

    def stats(self) -> TransferStats | None:
        return self.engine.stats() if self.engine is not None else None

    def interval_stats(self) -> dict[str, Any] | None:
        """Counters since the previous call (None when idle or nothing happened)."""
        if self.engine is None:
            return None
        now = self.engine.stats()
        data = stats_delta(
            now, self._last_stats, self.engine.queue_depth, self.engine.in_backpressure
        )
        self._last_stats = now
        return data if KVPoolStats(data=data).is_empty() is False else None

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.store is not None:
            self.store.close()
            self.store = None

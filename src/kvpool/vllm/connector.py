"""``KVPoolConnector``: the vLLM v1 KV connector that vLLM loads by module path.

    --kv-transfer-config '{"kv_connector": "KVPoolConnector",
                           "kv_connector_module_path": "kvpool.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute"}'

vLLM builds one instance per process and role. The scheduler role forwards to
``SchedulerSide`` (lookups, load and save plans), the worker role to
``WorkerSide`` (transfers); each hook here is a few lines. Loads are
asynchronous (the request waits in WAITING_FOR_REMOTE_KVS); saves are handed
over at the end of the forward, copied from the blocks and put in the background
(the copy inside the step only with KV events on or a group that frees blocks
early: ``connector.worker``). A save the
worker refused for local pressure (staging busy: the pool slower than the
engine) is retried by that worker while the request holds its blocks, so a
finished request with saves handed over keeps its blocks (``request_finished``
returns True) until every worker lists it as finished sending: its saves are
done, or were given up after ``drain.DRAIN_LIMIT_S``.

The scheduler asks its own lookup server (a thread of this process) over the
server's ZMQ socket, as other processes do. Answered in-process without the
socket, a lookup takes 0.3-0.8 ms instead of 0.6-1.3 (``kvpool bench lookup``,
column "direct p50"), but the socket is what gives a lookup its deadline
(``lookup_timeout_ms``) and ``lookup_async``: a direct call would hold the
scheduler for as long as Mooncake takes to answer, seconds with a frozen master.

When the pool is not configured or not reachable (no pool file yet, the master
down), or the model uses something kvpool cannot pool yet, the connector logs
one line saying why (and how to start a pool) and stays idle: lookups miss,
nothing is saved, the engine serves. A bad setting (an unknown key or a bad
value in ``kv_connector_extra_config`` or a ``KVPOOL_*`` override, a run_dir
too long for a socket) raises ``ConfigError`` and stops the engine at start:
a typo must not turn caching off in silence.

With ``load_by_layer``, a hit is loaded in the step that computes the rest of the
prompt (vLLM's sync load): the worker starts one load per layer band before the
forward and ``wait_for_layer_load`` waits for a band at its first layer, so the
load overlaps the forward; failed blocks are reported by
``get_block_ids_with_load_errors`` and vLLM recomputes them (discarding that
step's output for the request).

Hybrid models: the connector supports vLLM's hybrid KV cache manager
(``SupportsHMA``), so sliding-window groups keep only their window's blocks; a
hit needs each sliding-window group's chunks inside the window only, and blocks
vLLM already dropped (its null block) are neither saved nor loaded. A Mamba
group (vLLM's prefix caching on: "align" mode) saves the states vLLM hands over
per step (``boundary_state_offloads``) and a hit loads the state after its last
chunk only; with prefix caching off the connector stays idle, the engine serves.

With vLLM's KV events on (``--kv-events-config '{"enable_kv_cache_events": true}'``),
``take_events`` yields a ``BlockStored`` (medium "cpu", block size = chunk size)
for each chunk once all of its objects, from every rank, are in the pool.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool import amx
from kvpool.config import PoolConfig, load_config
from kvpool.connector.counters import worker_totals
from kvpool.connector.opening import pool_for_tenant, start_lookups, worker_store
from kvpool.connector.results import IdleWorker
from kvpool.errors import ConfigError, KVPoolError, PoolNotFound, UnsupportedEngine
from kvpool.settings import ConnectorSettings, parse_extra
from kvpool.vllm.identity import (
    EngineIdentity,
    attention_isas,
    engine_identity,
    worker_rank,
)
from kvpool.vllm.metadata import KVPoolMetadata
from kvpool.vllm.scheduler import SchedulerSide
from kvpool.vllm.stats import KVPoolPromMetrics, KVPoolStats, LookupInterval
from kvpool.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvpool.lookup.client import LookupClient
    from kvpool.lookup.server import LookupServer

__all__ = ["KVPoolConnector"]

logger = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """Show kvpool's INFO lines in the engine's log, in vLLM's format: vLLM
    configures only the ``vllm`` logger, so without this only warnings would
    reach stderr. They stay on stderr (where warnings always went). Left alone
    when the application configured logging itself."""
    ours = logging.getLogger("kvpool")
    theirs = logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(theirs.handlers[0].formatter)
    ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.level or logging.INFO)


def _ready_amx(vllm_config: Any, kv_cache_config: Any) -> None:
    """Ask Linux for AMX tile data before this worker runs any forward (see
    ``kvpool.amx``): vLLM's "amx" attention never asks, and a pool hit that leaves
    at most 4 tokens to compute would reach it first. Where Linux refuses and the
    attention takes that path, no forward could run: stop at start, saying so."""
    if not amx.cpu_has_amx():
        return
    try:
        amx.request_tile_data()
    except amx.AmxDenied as exc:
        try:
            needed = kv_cache_config is not None and "amx" in attention_isas(
                vllm_config, kv_cache_config
            )
        except UnsupportedEngine:
            needed = False
        if needed:
            raise ConfigError(
                f"kvpool: vLLM's CPU attention takes its AMX path here (bfloat16 KV, block "
                f"size a multiple of 32) but {exc}; its first short forward would kill the "
                f"worker with SIGILL. Serve with --dtype float32 or --block-size 16, or on a "
                f"kernel that grants AMX"
            ) from None
        logger.warning("kvpool: %s (vLLM's attention does not take its AMX path here)", exc)
        return
    logger.info("kvpool: AMX tile data enabled for this worker (vLLM's CPU attention needs it)")


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """Shares KV blocks between engines through a kvpool pool. See the module docstring."""

    # Hits come from the pool's host memory (a holder process, local or remote).
    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        self._sched: SchedulerSide | None = None
        # The worker role's half: an IdleWorker until (and unless) WorkerSide starts.
        groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        self._worker: WorkerSide | IdleWorker = IdleWorker(groups)
        self._lookup_client: LookupClient | None = None
        self.lookup_server: LookupServer | None = None  # this engine's, in the scheduler
        self._lookups = LookupInterval()
        self._closers: list[Any] = []
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # the base class checked it
        self._failure_policy = str(getattr(transfer, "kv_load_failure_policy", "fail"))
        if role == KVConnectorRole.WORKER:
            _ready_amx(vllm_config, kv_cache_config)  # first: before any forward can run
        if self._failure_policy == "fail":
            logger.warning(
                "kvpool: kv_load_failure_policy is 'fail', so a pool fault fails requests; "
                'set "kv_load_failure_policy": "recompute" to recompute instead'
            )
        try:
            settings, pool_settings = parse_extra(transfer.kv_connector_extra_config)
            identity = engine_identity(
                vllm_config,
                kv_cache_config,
                settings.chunk_size,
                settings.layer_bands,
                settings.heads_per_object,
                settings.token_classes,
                settings.tenant,
            )
            pool = pool_for_tenant(load_config(pool_settings), settings.tenant)
            pool.require_master()
            events_config = getattr(vllm_config, "kv_events_config", None)
            events = bool(getattr(events_config, "enable_kv_cache_events", False))
            if role == KVConnectorRole.SCHEDULER:
                self._sched = self._start_scheduler(identity, settings, pool, events)
            else:
                rank = worker_rank(identity.layout)
                self._worker = WorkerSide(
                    identity,
                    rank,
                    settings,
                    pool,
                    kv_cache_config,
                    worker_store(identity, settings),
                    events=events,
                )
        except ConfigError as exc:
            if not isinstance(exc, PoolNotFound):  # a setting to fix: stop the engine
                raise ConfigError(f"kvpool: {exc}") from exc
            logger.error("kvpool: %s; the connector stays idle", exc)
        except KVPoolError as exc:  # the pool is down, the model unsupported, ...
            logger.error("kvpool: %s; the connector stays idle", exc)

    @property
    def worker(self) -> WorkerSide | None:
        """This worker's side of the connector (None in the scheduler, or without a pool)."""
        return self._worker if isinstance(self._worker, WorkerSide) else None

    def counters(self) -> dict[str, Any]:
        """kvpool's running totals in this process's half (a copy, plain data):
        a worker's transfers (``connector.counters.worker_totals``); the
        scheduler's lookups (``Planner.totals``) and its lookup server's error
        replies by code. {} when the connector is idle."""
        out: dict[str, Any] = {}
        if (stats := self._worker.stats()) is not None:
            out.update(worker_totals(stats))
        if self.lookup_server is not None:
            errors = self.lookup_server.stats.errors
            out["lookup_server_errors"] = {str(k): v for k, v in errors.items()}
        if self._sched is not None:
            out.update(self._sched.totals())
        return out

    def _start_scheduler(
        self,
        identity: EngineIdentity,
        settings: ConnectorSettings,
        pool: PoolConfig,
        events: bool,
    ) -> SchedulerSide:
        lookups = start_lookups(identity, settings, pool, exact=self._failure_policy == "fail")
        self._closers.append(lookups.close)
        self.lookup_server = lookups.server
        self._lookup_client = lookups.client
        role = str(getattr(self._vllm_config.kv_transfer_config, "kv_role", None) or "kv_both")
        return SchedulerSide(identity, settings, lookups.client, events=events, role=role)

    # ==============================
    # Scheduler side
    # ==============================

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._sched is None:
            return 0, False
        return self._sched.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._sched is not None:
            self._sched.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._sched is None:
            return KVPoolMetadata()
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.loads_ended(connector_output.finished_recving)
            self._sched.worker_output(connector_output.kv_connector_worker_meta)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._sched.take_events() if self._sched is not None else ()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager (``SupportsHMA``) calls this once per
        request. The blocks stay until the workers report the request finished
        sending when its saves may still be retried (``SchedulerSide.finish``)."""
        if self._sched is None:
            return False, None
        return self._sched.finish(request.request_id), None

    # ==============================
    # Worker side
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Called before the forward that may overwrite freed blocks.
        if isinstance(kv_connector_metadata, KVPoolMetadata):
            self._worker.flush_saves(kv_connector_metadata.freed)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.step_began()  # the forward runs next: its time is a cost sample

    def _plan(self) -> KVPoolMetadata | None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return meta if isinstance(meta, KVPoolMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if (plan := self._plan()) is not None:
            self._worker.start_loads(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)  # loads by layer (load_by_layer)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        if (plan := self._plan()) is not None:
            self._worker.start_saves(plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.results(self._plan())
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self._worker.interval_stats()
        if data is None and self._lookup_client is not None:  # the scheduler: its lookups
            stats = self._lookup_client.stats
            recomputed = self._sched.recomputed if self._sched is not None else (0, 0)
            data = self._lookups.take(stats.lookups, stats.misses, recomputed)
        return KVPoolStats(data=data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVPoolStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.worker_meta()

    def shutdown(self) -> None:
        self._worker.close()
        for close in self._closers:
            try:
                close()
            except Exception:  # shutting down: log and go on closing the rest
                logger.exception("kvpool: error while shutting down")
        self._closers.clear()

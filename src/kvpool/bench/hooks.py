"""The worker hooks' idle cost: what the vLLM connector's worker side spends per
engine step when no request loads or saves.

    measure_hook_overhead(config, steps) -> HookOverhead   measure; prints nothing

    HookOverhead                                          what it measured

It measures ``kvpool.connector.worker.Worker`` (no vLLM: what vLLM's adapter
runs); ``run_transfer_bench`` calls it only when asked (``hook_steps`` > 0). The
KV cache and its shape are ``kvpool.bench.paged_kv``'s.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace

from kvpool.bench.paged_kv import KiB, PagedKV, Progress, kv_shape_for
from kvpool.config import PoolConfig
from kvpool.connector.identity import EngineIdentity
from kvpool.connector.steps import StepPlan
from kvpool.connector.worker import Worker
from kvpool.errors import StoreError
from kvpool.keys import KeySpace
from kvpool.layout import Layout
from kvpool.settings import ConnectorSettings
from kvpool.store.framed import FramedStore
from kvpool.store.mooncake import MooncakeStore

__all__ = ["HookOverhead", "measure_hook_overhead"]


@dataclass(frozen=True, slots=True)
class HookOverhead:
    """Median microseconds per engine step with nothing to load or save."""

    steps: int
    submit_poll_us: float  # TransferEngine.submit_save(job, []) + poll()
    metadata_us: float  # building an empty StepPlan
    hooks_us: float  # Worker start_loads, start_saves, finished, load_errors, worker_meta,
    #                  interval_stats: every worker hook the connector calls per step
    stats_us: float  # of which interval_stats (the connector's get_kv_connector_stats)

    @property
    def step_us(self) -> float:
        """What a worker pays per idle step: the metadata and the hooks."""
        return self.metadata_us + self.hooks_us


def _median_us(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1000.0


def measure_hook_overhead(
    config: PoolConfig, steps: int = 10_000, on_progress: Progress | None = None
) -> HookOverhead:
    """Median CPU cost per step of the worker side when no request loads or saves.

    Builds a ``Worker`` by hand (``kvpool.connector.worker``: the connector's worker
    half, which vLLM's adapter runs with vLLM's metadata classes; on a small KV
    cache of 16 blocks, over ``FramedStore(MooncakeStore)``) and times, per step,
    ``submit_save(job, [])`` + ``poll()`` on its engine, building an empty
    ``StepPlan``, and the worker hooks the connector calls every step on it
    (``start_loads``, ``start_saves``, ``finished``, ``load_errors``,
    ``worker_meta``, ``interval_stats``), the last also alone.
    """
    progress = on_progress or (lambda *_: None)
    shape = kv_shape_for(256 * KiB)
    kv = PagedKV(shape, 16)
    layout = Layout.create(tp=1, groups=[f"gqa:{shape.kv_heads}"])
    space = KeySpace.create(model="kvpool-bench/hooks", layout=layout, kv_dtype="float32",
                            model_dtype="float32", chunk_size=shape.block_size,
                            head_size=shape.head_size, num_layers=shape.layers)  # fmt: skip
    identity = EngineIdentity(layout, space, shape.block_size, shape.block_size, 0)
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=[name for name, _ in kv.layers])],
        num_blocks=kv.num_blocks,
    )

    def open_store(cfg: PoolConfig) -> FramedStore:
        return FramedStore(
            MooncakeStore(cfg), space.fingerprint, checksum=cfg.checksum, secret=cfg.secret
        )

    worker = Worker(identity, 0, ConnectorSettings(), config, kv_cache_config, open_store)
    worker.register(dict(kv.layers))
    try:
        engine = worker.engine
        if engine is None:
            raise StoreError(f"the worker could not open the pool at {config.master_address}")
        phases = 4
        progress("hooks", 0, phases)
        clock = time.perf_counter_ns
        empty: list[int] = []
        for i in range(steps):
            t = clock()
            engine.submit_save(("idle", i), [])
            engine.poll()
            empty.append(clock() - t)
        progress("hooks", 1, phases)
        meta_ns: list[int] = []
        for _ in range(steps):
            t = clock()
            StepPlan()
            meta_ns.append(clock() - t)
        progress("hooks", 2, phases)
        hooks_ns: list[int] = []
        for _ in range(steps):
            meta = StepPlan()
            t = clock()
            worker.start_loads(meta)
            worker.start_saves(meta)
            worker.finished()
            worker.load_errors()
            worker.worker_meta()
            worker.interval_stats()
            hooks_ns.append(clock() - t)
        progress("hooks", 3, phases)
        stats_ns: list[int] = []
        for _ in range(steps):
            t = clock()
            worker.interval_stats()
            stats_ns.append(clock() - t)
        progress("hooks", 4, phases)
    finally:
        worker.close()
    return HookOverhead(
        steps,
        _median_us(empty),
        _median_us(meta_ns),
        _median_us(hooks_ns),
        _median_us(stats_ns),
    )

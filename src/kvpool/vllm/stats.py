"""Connector counters for vLLM's stats logger and Prometheus.

    stats_delta(now, before, depth, pressure) -> the data dict of one interval
                      (a worker's transfers; ``kvpool.connector.counters``)
    LookupInterval    the scheduler's lookups since the last interval
    KVPoolStats       vLLM's KVConnectorStats over those dicts: counters add up
                      across workers and intervals, dicts of counts add up by
                      key; gauges keep the maximum
    KVPoolPromMetrics registers ``vllm:kvpool_*`` counters and gauges, per engine

Counters: chunks and bytes saved and loaded, chunks skipped as already stored,
saves and chunks refused (backpressure, staging busy), puts that met a full pool
(and went again), transfer failures by status (label ``cause``; ``missing``: an
object evicted between lookup and load), lookups and lookup failures by reason (label ``reason``:
timeout, unreachable, store_unavailable, backoff, ...), backpressure events.
Gauges: transfer queue depth, backpressure (0/1). The hit rate is vLLM's own:
``vllm:external_prefix_cache_hits_total / vllm:external_prefix_cache_queries_total``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvpool.connector.counters import interval_empty, stats_delta

__all__ = ["GAUGES", "KVPoolPromMetrics", "KVPoolStats", "LookupInterval", "stats_delta"]

GAUGES = ("queue_depth", "backpressure")
COUNTERS = {
    "chunks_saved": "Chunk objects written to the pool",
    "bytes_saved": "Payload bytes written to the pool",
    "chunks_skipped": "Chunks not written because the pool had them already",
    "saves_refused": "Save jobs refused, whole or in part (backpressure, staging busy)",
    "chunks_refused": "Chunks not saved because their save was refused",
    "chunks_loaded": "Chunk objects loaded from the pool",
    "bytes_loaded": "Payload bytes loaded from the pool",
    "backpressure_events": "Times saves were paused because the pool refused puts",
    "puts_no_space": "Chunk objects whose put met a full pool and went again once it "
    "had evicted (those still refused after a while: transfer_failures{cause=no_space})",
    "lookups": "Lookups the scheduler asked the pool (answered, failed or timed out)",
    "hits_recomputed": "Requests whose pool hit was computed instead of loaded, loading "
    "it being measured slower (load_decision measured, or recompute)",
    "tokens_recomputed": "Tokens of those hits, computed instead of loaded",
}
# Counters with a second label: data key of the per-label counts -> (name, label, doc).
LABELED = {
    "failures_by_cause": (
        "transfer_failures",
        "cause",
        "Chunk loads and puts that failed, by status (missing, corrupt, no_space, "
        "transfer_failed, unavailable, ...)",
    ),
    "lookup_failures_by_reason": (
        "lookup_failures",
        "reason",
        "Lookups answered as a miss because they failed, by reason (timeout, ...)",
    ),
}


class LookupInterval:
    """The scheduler's lookup counters since the previous ``take``."""

    def __init__(self) -> None:
        self._lookups = 0
        self._failures: Counter[str] = Counter()
        self._recomputed = (0, 0)

    def take(
        self, lookups: int, failures: Mapping[str, int], recomputed: tuple[int, int] = (0, 0)
    ) -> dict[str, Any] | None:
        """The interval's data from the running totals (the client's lookups and
        failures; the planner's hits recomputed and their tokens); None if nothing new."""
        new = {k: v - self._failures[k] for k, v in failures.items() if v > self._failures[k]}
        if lookups == self._lookups and not new and recomputed == self._recomputed:
            return None
        out = {
            "lookups": lookups - self._lookups,
            "lookup_failures_by_reason": new,
            "hits_recomputed": recomputed[0] - self._recomputed[0],
            "tokens_recomputed": recomputed[1] - self._recomputed[1],
        }
        self._lookups, self._failures, self._recomputed = lookups, Counter(failures), recomputed
        return out


@dataclass
class KVPoolStats(KVConnectorStats):
    """One interval of kvpool counters (``data`` as made by ``stats_delta``)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged: dict[str, Any] = dict(self.data)
        for k, v in other.data.items():
            if k in GAUGES:
                merged[k] = max(merged.get(k, 0), v)
            elif isinstance(v, dict):  # counts by cause or reason
                causes = dict(merged.get(k, {}))
                for cause, n in v.items():
                    causes[cause] = causes.get(cause, 0) + n
                merged[k] = causes
            else:
                merged[k] = merged.get(k, 0) + v
        return KVPoolStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            k: v for k, v in self.data.items() if isinstance(v, int | float)
        }
        for key, (name, _, _) in LABELED.items():
            for cause, n in self.data.get(key, {}).items():
                out[f"{name}_{cause}"] = n
        return out

    def is_empty(self) -> bool:
        return interval_empty(self.data)


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvpool_<counter>_total`` and ``vllm:kvpool_<gauge>`` per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:kvpool_{name}_total", documentation=doc, labelnames=labelnames
            )
            for name, doc in COUNTERS.items()
        }
        self._labeled = {
            key: self._counter_cls(
                name=f"vllm:kvpool_{name}_total",
                documentation=doc,
                labelnames=[*labelnames, label],
            )
            for key, (name, label, doc) in LABELED.items()
        }
        self._gauges = {
            "queue_depth": self._gauge_cls(
                name="vllm:kvpool_queue_depth",
                documentation="Transfer jobs queued on the workers (max over workers)",
                labelnames=labelnames,
            ),
            "backpressure": self._gauge_cls(
                name="vllm:kvpool_backpressure",
                documentation="1 while saves are paused because the pool refused puts",
                labelnames=labelnames,
            ),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, counter in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counter.labels(*labels).inc(value)
        for key, labeled in self._labeled.items():
            for cause, n in transfer_stats_data.get(key, {}).items():
                if n:
                    labeled.labels(*labels, cause).inc(n)
        for name, gauge in self._gauges.items():
            gauge.labels(*labels).set(transfer_stats_data.get(name, 0))

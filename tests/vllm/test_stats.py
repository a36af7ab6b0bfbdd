"""Connector stats: deltas, aggregation across workers, Prometheus export."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import prometheus_client

from kvpool.transfer import TransferStats
from kvpool.vllm.stats import KVPoolPromMetrics, KVPoolStats, LookupInterval, stats_delta


def test_delta_aggregate_and_reduce() -> None:
    before = TransferStats(chunks_put=2, bytes_put=100)
    now = TransferStats(
        chunks_put=5,
        bytes_put=400,
        chunks_loaded=1,
        bytes_loaded=50,
        failures=Counter({"missing": 2}),
        saves_refused=Counter(backpressure=1),
    )
    a = KVPoolStats(data=stats_delta(now, before, queue_depth=3, backpressure=True))
    b = KVPoolStats(data=stats_delta(now, now, queue_depth=1, backpressure=False))
    assert b.is_empty() and not a.is_empty()
    total = a.aggregate(b).aggregate(a)
    reduced = total.reduce()
    assert reduced["chunks_saved"] == 6 and reduced["bytes_saved"] == 600
    assert reduced["load_failures"] == 4 and reduced["transfer_failures_missing"] == 4
    assert reduced["queue_depth"] == 3 and reduced["backpressure"] == 1
    assert reduced["saves_refused"] == 2


def _metrics() -> tuple[KVPoolPromMetrics, prometheus_client.CollectorRegistry]:
    """kvpool's Prometheus metrics for one engine ("0"), on a registry of their own."""
    registry = prometheus_client.CollectorRegistry()

    def counter(**kw: object) -> prometheus_client.Counter:
        return prometheus_client.Counter(registry=registry, **kw)  # type: ignore[arg-type]

    def gauge(**kw: object) -> prometheus_client.Gauge:
        return prometheus_client.Gauge(registry=registry, **kw)  # type: ignore[arg-type]

    config = SimpleNamespace(kv_transfer_config=None)
    types = {
        prometheus_client.Counter: counter,
        prometheus_client.Gauge: gauge,
        prometheus_client.Histogram: prometheus_client.Histogram,
    }
    return KVPoolPromMetrics(config, types, ["engine"], {0: ["0"]}), registry


def test_prometheus_metrics_are_exported() -> None:
    metrics, registry = _metrics()
    metrics.observe({"chunks_saved": 3, "bytes_saved": 1024, "queue_depth": 2}, 0)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'vllm:kvpool_chunks_saved_total{engine="0"} 3.0' in text
    assert 'vllm:kvpool_queue_depth{engine="0"} 2.0' in text


def test_lookup_intervals_count_lookups_and_failures_by_reason() -> None:
    interval = LookupInterval()
    assert interval.take(0, {}) is None
    none = {"hits_recomputed": 0, "tokens_recomputed": 0}
    first = interval.take(5, Counter(timeout=2))
    assert first == {"lookups": 5, "lookup_failures_by_reason": {"timeout": 2}, **none}
    assert interval.take(5, Counter(timeout=2)) is None  # nothing new
    second = interval.take(9, Counter(timeout=2, store_unavailable=1), (2, 640))
    assert second == {"lookups": 4, "lookup_failures_by_reason": {"store_unavailable": 1},
                      "hits_recomputed": 2, "tokens_recomputed": 640}  # fmt: skip
    third = interval.take(9, Counter(timeout=2, store_unavailable=1), (3, 800))
    assert third is not None and (third["hits_recomputed"], third["tokens_recomputed"]) == (1, 160)
    merged = KVPoolStats(data=first).aggregate(KVPoolStats(data=second))
    assert not merged.is_empty()
    reduced = merged.reduce()
    assert reduced["lookups"] == 9
    assert reduced["lookup_failures_timeout"] == 2
    assert reduced["lookup_failures_store_unavailable"] == 1
    assert reduced["hits_recomputed"] == 2 and reduced["tokens_recomputed"] == 640


def test_failures_are_exported_with_their_cause_and_reason() -> None:
    metrics, registry = _metrics()
    now = TransferStats(failures=Counter({"missing": 2, "corrupt": 1}))
    metrics.observe(stats_delta(now, TransferStats(), queue_depth=0, backpressure=False), 0)
    metrics.observe({"lookups": 3, "lookup_failures_by_reason": {"timeout": 1}}, 0)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'vllm:kvpool_transfer_failures_total{cause="missing",engine="0"} 2.0' in text
    assert 'vllm:kvpool_transfer_failures_total{cause="corrupt",engine="0"} 1.0' in text
    assert 'vllm:kvpool_lookup_failures_total{engine="0",reason="timeout"} 1.0' in text
    assert 'vllm:kvpool_lookups_total{engine="0"} 3.0' in text

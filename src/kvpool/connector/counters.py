"""A worker's transfer counters, as plain data (no vLLM).

    stats_delta(now, before, queue_depth, backpressure) -> the data dict of one
                      interval: counters since ``before``, the gauges now, and
                      failures by cause
    interval_empty(data)  whether nothing worth reporting happened in it
    worker_totals(stats)  the running totals since the worker started, by name
                      (``KVPoolConnector.counters``: the read-only view the demo
                      and the benches read)

``kvpool.vllm.stats`` hands the interval dicts to vLLM's stats logger and Prometheus.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool.transfer import TransferStats

__all__ = ["ACTIVE", "interval_empty", "stats_delta", "worker_totals"]

# Counters of an interval in which something happened.
ACTIVE = ("chunks_saved", "chunks_loaded", "load_failures", "saves_refused", "lookups",
          "chunks_skipped")  # fmt: skip


def stats_delta(
    now: TransferStats, before: TransferStats, queue_depth: int, backpressure: bool
) -> dict[str, Any]:
    """Counters since ``before``, plus current gauges and failures by cause."""
    failures = now.failures - before.failures
    return {
        "chunks_saved": now.chunks_put - before.chunks_put,
        "bytes_saved": now.bytes_put - before.bytes_put,
        "chunks_skipped": _skipped(now) - _skipped(before),
        "saves_refused": sum(now.saves_refused.values()) - sum(before.saves_refused.values()),
        "chunks_refused": sum(now.chunks_refused.values()) - sum(before.chunks_refused.values()),
        "chunks_loaded": now.chunks_loaded - before.chunks_loaded,
        "bytes_loaded": now.bytes_loaded - before.bytes_loaded,
        "load_failures": sum(failures.values()),
        "backpressure_events": now.backpressure_events - before.backpressure_events,
        "puts_no_space": now.puts_no_space - before.puts_no_space,
        "failures_by_cause": dict(failures),
        "queue_depth": queue_depth,
        "backpressure": int(backpressure),
    }


def worker_totals(stats: TransferStats) -> dict[str, Any]:
    """A worker's counters since it started (bytes, chunks, seconds, and by cause)."""
    return {
        "bytes_saved": stats.bytes_put,
        "bytes_loaded": stats.bytes_loaded,
        "load_s": stats.load_s,
        "chunks_saved": stats.chunks_put,
        "chunks_loaded": stats.chunks_loaded,
        "failures": dict(stats.failures),
        "saves_refused": dict(stats.saves_refused),
        "backpressure_events": stats.backpressure_events,
        "puts_no_space": stats.puts_no_space,
        "chunks_refused": dict(stats.chunks_refused),
        "loads_timed_out": stats.loads_timed_out,
        "chunks_discarded": stats.chunks_discarded,
    }


def interval_empty(data: Mapping[str, Any]) -> bool:
    """No counter of ``ACTIVE`` moved in this interval."""
    return not any(data.get(k) for k in ACTIVE)


def _skipped(stats: TransferStats) -> int:
    """Chunks a save did not put: stored recently, already there, or being put."""
    return stats.chunks_skipped_known + stats.chunks_skipped_exist + stats.chunks_skipped_putting

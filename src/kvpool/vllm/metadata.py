"""What the scheduler half tells the worker half each step, and what comes back, as
vLLM's connector metadata: ``kvpool.connector.steps``'s records (the same fields).

KVPoolMetadata        scheduler -> workers: a ``StepPlan``
KVPoolWorkerMetadata  workers -> scheduler: a ``WorkerReport``; ``aggregate`` is
                      vLLM's name for summing two workers' reports
ChunkOp, RequestOps, NULL_BLOCK  as ``kvpool.connector.steps``
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvpool.connector.steps import NULL_BLOCK, ChunkOp, RequestOps, StepPlan, WorkerReport

__all__ = ["NULL_BLOCK", "ChunkOp", "KVPoolMetadata", "KVPoolWorkerMetadata", "RequestOps"]


@dataclass
class KVPoolMetadata(StepPlan, KVConnectorMetadata):
    pass


@dataclass
class KVPoolWorkerMetadata(WorkerReport, KVConnectorWorkerMetadata):
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVPoolWorkerMetadata):
            return self
        merged = self.merged(other)
        assert isinstance(merged, KVPoolWorkerMetadata)
        return merged

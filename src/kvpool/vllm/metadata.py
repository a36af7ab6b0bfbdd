"""What the scheduler half tells the worker half each step, and what comes back.

ChunkOp         one chunk of one request: absolute index, chunk hash, and the
                block ids holding it in each KV group
RequestOps      a request's chunks to load or to save this step
KVPoolMetadata  scheduler -> workers: ``loads`` and ``saves`` for this step; a
                request never appears in both
KVPoolWorkerMetadata  workers -> scheduler: chunk hashes whose load failed
                (aggregated over workers), so lookups stop reporting them
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["ChunkOp", "KVPoolMetadata", "KVPoolWorkerMetadata", "RequestOps"]


@dataclass(frozen=True, slots=True)
class ChunkOp:
    chunk: int  # absolute chunk index in the request
    chunk_hash: bytes
    block_ids: tuple[tuple[int, ...], ...]  # per KV group, the blocks of this chunk


@dataclass(frozen=True, slots=True)
class RequestOps:
    req_id: str
    chunks: tuple[ChunkOp, ...]


@dataclass
class KVPoolMetadata(KVConnectorMetadata):
    loads: list[RequestOps] = field(default_factory=list)
    saves: list[RequestOps] = field(default_factory=list)


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    failed_hashes: set[bytes] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVPoolWorkerMetadata):
            return KVPoolWorkerMetadata(self.failed_hashes | other.failed_hashes)
        return self

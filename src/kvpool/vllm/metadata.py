"""What the scheduler half tells the worker half each step, and what comes back.

ChunkOp         one chunk of one request: absolute index, chunk hash, and the
                block ids holding it in each KV group
RequestOps      a request's chunks to load or to save this step
KVPoolMetadata  scheduler -> workers: ``loads`` and ``saves`` for this step (a
                request never appears in both), and the requests whose blocks
                were freed since the last step
KVPoolWorkerMetadata  workers -> scheduler: chunk hashes whose load failed
                (aggregated over workers), so lookups stop reporting them, and
                saves refused for local pressure, to submit again
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
    # No tokens are scheduled this step (e.g. every request waits for its load):
    # the worker may block briefly on its transfers instead of letting the engine
    # spin through empty steps, which starves the transfer threads of CPU.
    idle: bool = False
    # Requests that finished or were preempted since the last step: their blocks
    # may be overwritten in this step, so zero-copy saves reading them must end.
    freed: frozenset[str] = frozenset()


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    failed_hashes: set[bytes] = field(default_factory=set)  # chunks whose load failed
    # chunk hash -> objects of it now in the pool, from this worker's saves (only
    # with KV events on); summed over workers, a chunk is stored when the sum
    # reaches the layout's objects per chunk
    stored: dict[bytes, int] = field(default_factory=dict)
    fresh: set[bytes] = field(default_factory=set)  # chunks with an object put just now
    # request -> first chunk whose save some rank refused for local pressure
    # (its staging was busy): the scheduler submits it, and later ones, again
    refused: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVPoolWorkerMetadata):
            return self
        stored = dict(self.stored)
        for h, n in other.stored.items():
            stored[h] = stored.get(h, 0) + n
        refused = dict(self.refused)
        for r, k in other.refused.items():
            refused[r] = min(k, refused.get(r, k))
        return KVPoolWorkerMetadata(
            self.failed_hashes | other.failed_hashes, stored, self.fresh | other.fresh, refused
        )

"""Moving chunk objects between a rank's paged KV tensors and the pool.

    records   ChunkRef, JobResult, TransferStats: what a job is and what it answers
    pieces    pure planning: a job cut into pieces that fit bounded staging
    arena     StagingArena: a ring allocator over one staging buffer
    copies    KVCopier: indexed copies between KV tensors and staging
    engine    TransferEngine: the threads that stage, put, get and copy

The contract is ``TransferEngine``'s (``kvpool.transfer.engine``).
"""

from kvpool.transfer.arena import StagingArena
from kvpool.transfer.engine import LOAD_PIECE_BYTES, PIECE_BYTES, TransferEngine
from kvpool.transfer.records import ChunkRef, JobResult, TransferStats

__all__ = [
    "LOAD_PIECE_BYTES",
    "PIECE_BYTES",
    "ChunkRef",
    "JobResult",
    "StagingArena",
    "TransferEngine",
    "TransferStats",
]

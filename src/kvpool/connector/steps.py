"""What the scheduler half plans for the workers each step, and what they report back.

    NULL_BLOCK    vLLM's null block: never saved, never loaded into
    ChunkOp       one chunk of one request: absolute index, chunk hash, and the
                  block ids holding it in each KV group
    RequestOps    a request's chunks to load or to save this step
    StepPlan      scheduler -> workers: ``loads`` and ``saves`` for this step (a
                  request never appears in both), the requests whose blocks were
                  freed since the last step, and the finished requests whose
                  blocks vLLM holds until every worker reports their saves done
    WorkerReport  workers -> scheduler: chunk hashes whose load failed, so lookups
                  stop reporting them, (KV events) the objects each worker's
                  saves stored, and the time of this step's forward (a sample of
                  ``kvpool.connector.costs``); ``merged`` sums two workers'
                  reports (the forward: the slowest worker's)

Plain records, no vLLM: ``kvpool.vllm.metadata`` makes ``StepPlan`` and
``WorkerReport`` vLLM's connector metadata (the same fields).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NULL_BLOCK", "ChunkOp", "RequestOps", "StepPlan", "WorkerReport"]

# vLLM's BlockPool takes block 0 as its null block: the placeholder of blocks a
# sliding window dropped (hybrid KV cache manager) and of Mamba positions that
# hold no state. It holds no request's KV: never saved, never loaded into.
NULL_BLOCK = 0


@dataclass(frozen=True, slots=True)
class ChunkOp:
    chunk: int  # absolute chunk index in the request
    chunk_hash: bytes
    block_ids: tuple[tuple[int, ...], ...]  # per KV group, the blocks of this chunk


@dataclass(frozen=True, slots=True)
class RequestOps:
    req_id: str
    chunks: tuple[ChunkOp, ...]
    # Saves: the pool lacked chunks from this index on at the request's lookup, so a
    # worker puts them even if it remembers putting them (evicted since); None: no
    # lookup said (the worker skips keys it stored or loaded recently).
    fresh_from: int | None = None
    # Saves: soft-pin the objects put for this long (the request's pin_seconds).
    pin_ms: int = 0
    # Loads: in this step, before the forward reads each layer band (vLLM's sync
    # load, ``load_by_layer``); never reported as a finished load.
    by_layer: bool = False


@dataclass
class StepPlan:
    """Scheduler -> workers, for one step."""

    loads: list[RequestOps] = field(default_factory=list)
    saves: list[RequestOps] = field(default_factory=list)
    # No tokens are scheduled this step (e.g. every request waits for its load):
    # the worker may block briefly on its transfers instead of letting the engine
    # spin through empty steps, which starves the transfer threads of CPU.
    idle: bool = False
    # Requests that finished or were preempted since the last step: their blocks
    # may be overwritten in this step, so zero-copy saves reading them must end.
    freed: frozenset[str] = frozenset()
    # Requests that finished since the last step with saves handed to the workers:
    # vLLM keeps their blocks until each worker lists them as finished sending
    # (their saves, and the retries of refused ones, are done or given up).
    finishing: frozenset[str] = frozenset()
    # Tokens computed by this step's forward (all requests): the forward's time
    # per token is what recomputing a pool hit would cost.
    tokens: int = 0


@dataclass
class WorkerReport:
    """Workers -> scheduler, for one step (summed over workers by ``merged``)."""

    failed_hashes: set[bytes] = field(default_factory=set)  # chunks whose load failed
    # chunk hash -> objects of it now in the pool, from this worker's saves (only
    # with KV events on); summed over workers, a chunk is stored when the sum
    # reaches the layout's objects per chunk
    stored: dict[bytes, int] = field(default_factory=dict)
    fresh: set[bytes] = field(default_factory=set)  # chunks with an object put just now
    # (tokens, seconds) of this step's forward on this worker, if it was timed
    forward: tuple[int, float] | None = None

    def merged(self, other: WorkerReport) -> WorkerReport:
        """This report and ``other`` summed: every failed chunk, every stored object;
        of forwards, the slowest worker's (the step ends with the last rank)."""
        stored = dict(self.stored)
        for h, n in other.stored.items():
            stored[h] = stored.get(h, 0) + n
        forwards = [f for f in (self.forward, other.forward) if f is not None]
        return type(self)(
            self.failed_hashes | other.failed_hashes,
            stored,
            self.fresh | other.fresh,
            max(forwards, key=lambda f: f[1]) if forwards else None,
        )

"""The records a transfer job is described and answered with.

    ChunkRef       one chunk object of one shard view: its key and the blocks holding it
    JobResult      a finished save or load: a status per key it handled, the blocks
                   to recompute (loads), and what was refused before the store was asked
    TransferStats  counters since the engine started (``TransferEngine.stats``)
    Job, Piece     the engine's own bookkeeping of a job in flight, and of a range of
                   its chunks moving together (internal)

Pure data: no threads are started here and nothing moves bytes.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field, fields
from typing import Literal

from kvpool.store.base import DeferredCheck, Status

__all__ = ["ChunkRef", "Job", "JobKind", "JobResult", "Piece", "TransferStats"]

JobKind = Literal["save", "load"]

# Why a save (or the rest of one) was refused before the store was asked. Only
# local pressure is worth retrying while the request still holds its blocks.
RETRYABLE_REFUSALS = frozenset({"staging_busy", "queue_full"})


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One chunk object: its key and the blocks that hold it."""

    key: str
    # Which of the engine's groups of tensors (``TransferEngine(groups=...)``) it
    # moves: in the connector one shard's views (``connector.shards``), not a
    # vLLM KV cache group.
    group: int
    chunk: int  # absolute chunk index in its request (orders failures)
    block_ids: tuple[int, ...]
    pin_ms: int = 0  # saves: soft-pin the object this long (its request asked)


@dataclass(frozen=True, slots=True)
class JobResult:
    """A finished job. ``statuses`` has one entry per chunk key the job handled."""

    job_id: Hashable
    kind: JobKind
    statuses: dict[str, Status]
    invalid_block_ids: frozenset[int] = frozenset()  # loads: blocks to recompute
    skipped: int = 0  # saves: chunks not written (already stored, or refused)
    nbytes: int = 0  # payload bytes moved
    seconds: float = 0.0  # wall time to finish: saves from submit, loads from start
    known: tuple[str, ...] = ()  # saves: keys skipped as stored recently (no store call)
    # Saves: why chunks were refused before the store was asked ("" when none
    # were), and the lowest chunk index refused (the job was refused from some
    # point of its (group, chunk) order on).
    refused: str = ""
    refused_from: int | None = None

    @property
    def ok(self) -> bool:
        """Every chunk handled: stored (saves, none refused) or loaded (loads)."""
        stored = all(s.stored for s in self.statuses.values())
        return stored and not self.invalid_block_ids and not self.refused

    @property
    def retry(self) -> bool:
        """Saves: the refused chunks may succeed if submitted again (local pressure)."""
        return self.refused in RETRYABLE_REFUSALS


@dataclass
class TransferStats:
    """Counters since start; read with ``TransferEngine.stats()``."""

    saves_submitted: int = 0
    saves_refused: Counter[str] = field(default_factory=Counter)  # reason -> jobs
    chunks_put: int = 0  # put OK (on Mooncake also duplicates, which it cannot tell)
    chunks_skipped_known: int = 0
    chunks_skipped_putting: int = 0  # another save job of this engine was putting the key
    chunks_skipped_exist: int = 0  # put reported EXISTS (stores that tell)
    bytes_put: int = 0
    loads_submitted: int = 0
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    failures: Counter[str] = field(default_factory=Counter)  # status -> chunks
    backpressure_events: int = 0
    loads_timed_out: int = 0  # load jobs abandoned at their deadline
    chunks_discarded: int = 0  # damaged objects removed (never forced)
    chunks_refused: Counter[str] = field(default_factory=Counter)  # reason -> chunks
    save_wait_s: float = 0.0  # time callers waited for save staging (pool slower than KV)
    puts_no_space: int = 0  # objects whose put met a full pool (then retried)
    full_wait_s: float = 0.0  # time the save thread waited for a full pool to evict
    load_s: float = 0.0  # wall time of finished load jobs, start to finish, summed

    def __add__(self, other: TransferStats) -> TransferStats:
        """Counters of two engines (e.g. before and after a reconnect) together."""
        out = TransferStats()
        for f in fields(self):
            setattr(out, f.name, getattr(self, f.name) + getattr(other, f.name))
        return out

    def copy(self) -> TransferStats:
        """A snapshot (the counters copied, not shared)."""
        return self + TransferStats()


@dataclass
class Piece:
    """Chunks ``lo:hi`` of a job, moving together through one staging reservation
    (``staging`` is its offset, None when it holds none)."""

    job: Job
    lo: int
    hi: int
    last: bool  # the job's last piece: its copy finishes the job
    staging: int | None = None  # offset of its reservation in its arena
    offsets: list[int] = field(default_factory=list)  # per chunk, absolute in staging
    statuses: list[Status] = field(default_factory=list)
    get_s: float = 0.0
    # The payload check its get left to the scatter thread (``batch_get_deferred``),
    # whose indices follow ``order`` (the get's order of the piece's chunks).
    check: DeferredCheck | None = None
    order: list[int] = field(default_factory=list)


@dataclass
class Job:
    job_id: Hashable
    kind: JobKind
    chunks: list[ChunkRef]
    submitted: float
    started: float = 0.0  # loads: when the load thread took it (0: not yet)
    skipped: int = 0
    known: list[str] = field(default_factory=list)  # saves: keys skipped as stored recently
    claimed: tuple[str, ...] = ()  # saves: keys this job puts (no other job of ours may)
    pieces: list[tuple[int, int]] = field(default_factory=list)  # chunk ranges moved together
    # Saves: pieces staged so far (the caller stages piece by piece while the put
    # thread waits on ``TransferEngine._stage_cond``), and why the caller stopped
    # before the last piece ("" while it has not: the rest of the job is refused).
    staged: list[Piece] = field(default_factory=list)
    refused: str = ""
    refused_from: int | None = None  # the lowest chunk index refused
    # Staged loads: statuses of the pieces copied so far, and the first failed chunk.
    got: dict[str, Status] = field(default_factory=dict)
    first_failed: int | None = None
    # Loads: set under ``lock`` when the job's result is published (by the scatter
    # thread, or by ``poll`` at the deadline); the scatter thread checks it under
    # the same lock before copying each piece into the KV tensors, so a job
    # reported TIMED_OUT never writes blocks that the engine may have reused since.
    reported: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def is_reported(self) -> bool:  # a method: mypy narrows attributes, not calls
        return self.reported

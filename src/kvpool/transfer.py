"""Moves paged KV blocks between this rank's KV tensors and the pool.

    TransferEngine(store, groups, num_blocks)  describe the KV tensors (``kvcache``),
                                   register each distinct allocation once
    submit_save(job_id, chunks)    copy the chunks' blocks into staging memory *now*,
                                   then put them on a background thread; returns
                                   False (and a finished, skipped job) when the save
                                   is refused (backpressure, staging or queue full)
    submit_load(job_id, chunks)    get the chunks on a background thread into the KV
                                   tensors (zero-copy, ``load_mode="direct"``) or
                                   through staging (``"staged"``, forced when the
                                   store moves bytes only through its own buffers,
                                   as on Mooncake's same-host shared-memory path)

Jobs move in pieces of about ``piece_bytes`` (16 MiB): the put of a save's first
piece starts while the caller still copies later ones, and a staged load's next
piece is fetched while a second thread copies the previous one into the KV
tensors. Smaller pieces would overlap more but cost Mooncake ~0.4 ms per call.
    wait_any(timeout)              block until some job finished (or timeout)
    poll()                         finished jobs (``JobResult``); never blocks; a
                                   staged load older than ``load_timeout_s`` is
                                   reported here as TIMED_OUT and abandoned
    wait(job_ids, timeout)         block until those jobs finish
    abandon_loads()                report every unfinished staged load failed now
                                   (before the engine is replaced)
    close()                        stop the threads after the queued jobs (staging
                                   memory belongs to the store and goes with it)

Zero copy (``zero_copy=True``): the store moves bytes straight between the KV
tensors and the pool, with no staging copy. The KV tensors must lie in memory
the store reaches (``KVStore.reaches``; on Mooncake's shared-memory path, memory
from ``alloc_staging``, see ``kvpool.placement``). Loads are direct, so they
have no deadline, and a save reads its blocks until its job finished: the
caller must not let them be overwritten before (``wait``).

Guarantees:

* A save reads KV blocks only inside ``submit_save``: once it returns, the blocks
  may be freed and reused by another request; the pool still gets the bytes they
  held at submit time (or nothing). Zero copy: until the job finished instead.
* A load job reports, in ``JobResult.invalid_block_ids``, the blocks of every chunk
  that failed (missing, evicted, leased, corrupt, transfer failure) and of every
  later chunk of the job, so the engine recomputes exactly those.
* In staged load mode, bytes reach the KV tensors only after their header and
  checksum were verified; in direct mode a failed chunk's blocks may hold
  garbage, but they are reported invalid.
* A CORRUPT object (header or checksum mismatch) is removed from the pool.
* A staged load that has not finished ``load_timeout_s`` after its submit (a
  holder that stopped answering blocks a Mooncake get for ~30 s) is reported
  failed (TIMED_OUT, all its blocks invalid) by ``poll``; when its get returns
  later, nothing is copied into the KV tensors. Direct loads cannot be abandoned
  (the store writes into the KV tensors itself), so they have no deadline.
* NO_SPACE, TRANSFER_FAILED or UNAVAILABLE on a put switch saves into
  backpressure: further saves are skipped until a growing back-off expires.
* Nothing raises into the caller for store faults; they become statuses.

The caller decides which chunks this rank writes (``layout.Layout.writes``);
chunks whose keys were stored (or loaded) recently are skipped without a store
round trip; the rest are put without asking first. A duplicate put keeps the old
value and reports OK (Mooncake) or EXISTS (stores that tell); Mooncake moves no
bytes for it and answers as fast as an exists check would (0.2 ms for 16 MiB of
duplicates against 8.4 ms for new objects over TCP, measured), so a check before
every put cost more than it saved (staged shared-memory saves: 10-25 %).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

import numpy as np
import torch

from kvpool.kvcache import GroupKV, describe_group
from kvpool.store.base import KVStore, Scatter, Status

__all__ = ["ChunkRef", "JobResult", "StagingArena", "TransferEngine", "TransferStats"]

logger = logging.getLogger(__name__)

JobKind = Literal["save", "load"]

PIECE_BYTES = 16 << 20  # a save's put and a staged load's get move this much at a time


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One chunk object of one group: its key and the blocks that hold it."""

    key: str
    group: int
    chunk: int  # absolute chunk index in its request (orders failures)
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class JobResult:
    """A finished job. ``statuses`` has one entry per chunk key the job handled."""

    job_id: Hashable
    kind: JobKind
    statuses: dict[str, Status]
    invalid_block_ids: frozenset[int] = frozenset()  # loads: blocks to recompute
    skipped: int = 0  # saves: chunks not written (already stored, or refused)
    nbytes: int = 0  # payload bytes moved
    seconds: float = 0.0  # wall time from submit to finish
    known: tuple[str, ...] = ()  # saves: keys skipped as stored recently (no store call)

    @property
    def ok(self) -> bool:
        return all(s.stored for s in self.statuses.values()) and not self.invalid_block_ids


@dataclass
class TransferStats:
    """Counters since start; read with ``TransferEngine.stats()``."""

    saves_submitted: int = 0
    saves_refused: Counter[str] = field(default_factory=Counter)  # reason -> jobs
    chunks_put: int = 0  # put OK (on Mooncake also duplicates, which it cannot tell)
    chunks_skipped_known: int = 0
    chunks_skipped_exist: int = 0  # put reported EXISTS (stores that tell)
    bytes_put: int = 0
    loads_submitted: int = 0
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    failures: Counter[str] = field(default_factory=Counter)  # status -> chunks
    backpressure_events: int = 0
    loads_timed_out: int = 0  # load jobs abandoned at their deadline

    def __add__(self, other: TransferStats) -> TransferStats:
        """Counters of two engines (e.g. before and after a reconnect) together."""
        out = TransferStats()
        for f in fields(self):
            setattr(out, f.name, getattr(self, f.name) + getattr(other, f.name))
        return out


class StagingArena:
    """A ring allocator over one registered buffer; frees are roughly FIFO.

    ``alloc`` returns a byte offset or None when the space is not free now.
    """

    def __init__(self, nbytes: int, align: int = 64) -> None:
        self.nbytes = nbytes
        self._align = align
        self._live: deque[list[int]] = deque()  # [start, size, freed]
        self._by_start: dict[int, list[int]] = {}
        self._lock = threading.Condition()

    def alloc(self, size: int, wait: bool = False) -> int | None:
        """Offset of ``size`` free bytes, or None. With ``wait``, block until they
        are free (None at once if ``size`` exceeds the whole arena)."""
        size = -(-size // self._align) * self._align
        if size > self.nbytes:
            return None
        with self._lock:
            while (start := self._try_alloc(size)) is None and wait:
                self._lock.wait()
            return start

    def _try_alloc(self, size: int) -> int | None:
        """Place ``size`` bytes after the newest live block, wrapping to 0 if needed."""
        if not self._live:
            start: int | None = 0
        else:
            tail = self._live[0][0]
            head = self._live[-1][0] + self._live[-1][1]
            if self._live[-1][0] < tail:  # wrapped: free space is [head, tail)
                start = head if head + size <= tail else None
            elif head + size <= self.nbytes:
                start = head
            else:
                start = 0 if size <= tail else None
        if start is not None:
            entry = [start, size, 0]
            self._live.append(entry)
            self._by_start[start] = entry
        return start

    def free(self, start: int) -> None:
        with self._lock:
            self._by_start.pop(start)[2] = 1
            while self._live and self._live[0][2]:
                self._live.popleft()
            self._lock.notify_all()

    @property
    def used(self) -> int:
        with self._lock:
            return sum(e[1] for e in self._live if not e[2])


@dataclass
class _Piece:
    """Chunks ``lo:hi`` of a staged load, fetched into staging, to copy into KV."""

    job: _Job
    lo: int
    hi: int
    last: bool  # the job's last piece: its copy finishes the job
    statuses: list[Status] = field(default_factory=list)
    get_s: float = 0.0


@dataclass
class _Job:
    job_id: Hashable
    kind: JobKind
    chunks: list[ChunkRef]
    submitted: float
    staging: int | None = None  # offset in the staging arena
    offsets: list[int] = field(default_factory=list)  # per chunk, in the arena
    skipped: int = 0
    known: list[str] = field(default_factory=list)  # saves: keys skipped as stored recently
    pieces: list[tuple[int, int]] = field(default_factory=list)  # chunk ranges moved together
    # Saves: chunks staged so far (the caller gathers piece by piece while the put
    # thread waits on ``TransferEngine._stage_cond``), and whether staging failed.
    staged: int = 0
    stage_failed: bool = False
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


def _word(nbytes: int) -> torch.dtype:
    """The widest integer dtype whose size divides ``nbytes``."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if nbytes % size == 0:
            return dtype
    return torch.uint8


class TransferEngine:
    """See the module docstring. One engine per worker rank."""

    def __init__(
        self,
        store: KVStore,
        groups: Sequence[Sequence[tuple[str, torch.Tensor]]],
        num_blocks: int,
        *,
        staging_bytes: int = 256 << 20,
        staging: torch.Tensor | None = None,
        load_mode: Literal["direct", "staged"] = "direct",
        max_queue: int = 64,
        known_keys: int = 65536,
        backoff_s: tuple[float, float] = (1.0, 30.0),
        load_timeout_s: float | None = None,
        piece_bytes: int = PIECE_BYTES,
        zero_copy: bool = False,
    ) -> None:
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
        self.store = store
        self.piece_bytes = piece_bytes
        self.groups: list[GroupKV] = [describe_group(g, num_blocks) for g in groups]
        self.zero_copy = zero_copy
        if zero_copy:
            away = [r for spec in self.groups for r in spec.regions
                    if not store.reaches(r.base, r.nbytes)]  # fmt: skip
            if away:
                raise ValueError(
                    f"zero_copy: {len(away)} KV allocation(s) lie outside the store's "
                    "memory; place them with kvpool.placement.place_kv first"
                )
        # Stores that move bytes only through their own buffers (Mooncake's
        # same-host shared memory) cannot reach the KV tensors: stage loads too,
        # unless the KV tensors were placed in the store's memory (zero copy).
        if zero_copy:
            self.load_mode: str = "direct"
        else:
            self.load_mode = "staged" if store.requires_staging else load_mode
        # Views of each distinct allocation as (rows, row_bytes / w) of the widest
        # integer type w dividing the row: indexed copies of bytes are several
        # times slower than of 8-byte words.
        self._views: list[list[torch.Tensor]] = []
        registered: set[int] = set()
        for spec, tensors in zip(self.groups, groups, strict=True):
            by_base = {int(t.untyped_storage().data_ptr()): t for _, t in tensors}
            views = []
            for region in spec.regions:
                t = by_base[region.base]
                flat = torch.empty(0, dtype=torch.uint8, device=t.device)
                flat.set_(t.untyped_storage(), 0, (region.nbytes,))  # type: ignore[call-overload]
                words = flat.view(_word(region.row_bytes))
                views.append(words.view(region.num_rows, -1))
                if region.base not in registered and not store.requires_staging:
                    store.register_memory(region.base, region.nbytes)
                    registered.add(region.base)
            self._views.append(views)
        if zero_copy:  # nothing is staged
            staging = torch.empty(0, dtype=torch.uint8)
        elif staging is None:  # registered memory from the store (shared with the holder)
            staging = torch.from_numpy(store.alloc_staging(staging_bytes))
        else:
            store.register_memory(int(staging.data_ptr()), staging.numel())
        self._staging = staging.view(-1)
        self._staging_base = int(self._staging.data_ptr())
        self._arena = StagingArena(self._staging.numel())
        self._known: OrderedDict[str, None] = OrderedDict()
        self._known_max = known_keys
        self._known_lock = threading.Lock()
        self._backoff = backoff_s
        self._backoff_next = backoff_s[0]
        self._pressure_until = 0.0
        self._stats = TransferStats()
        self._stats_lock = threading.Lock()
        self._stats_version = 0  # bumped by _counting, with every change of _stats
        self._done: deque[JobResult] = deque()
        self._done_cond = threading.Condition()
        self._stage_cond = threading.Condition()  # a save's gather progress (_Job.staged)
        self._save_q: queue.Queue[_Job | None] = queue.Queue(max_queue)
        self._load_q: queue.Queue[_Job | None] = queue.Queue(max_queue)
        self._scatter_q: queue.Queue[_Piece | None] = queue.Queue()  # bounded by _load_q
        self._load_timeout = load_timeout_s if self.load_mode == "staged" else None
        if load_timeout_s is not None and self._load_timeout is None:
            logger.info("direct loads cannot be abandoned: load_timeout_s is not enforced")
        # Unreported staged loads (id(job) -> job): what a deadline or ``abandon_loads``
        # may report early. Direct loads are never reported early.
        self._pending_loads: dict[int, _Job] = {}
        # A save is put piece by piece while the caller still gathers later pieces; a
        # staged load's next piece is fetched while the previous one is copied into
        # the KV tensors (the scatter thread).
        self._threads = [
            threading.Thread(target=self._loop, args=(self._save_q,), name="kvpool-save"),
            threading.Thread(target=self._loop, args=(self._load_q,), name="kvpool-load"),
            threading.Thread(target=self._scatter_loop, name="kvpool-scatter"),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()
        self._closed = False

    # -- public --------------------------------------------------------------------

    def submit_save(self, job_id: Hashable, chunks: Sequence[ChunkRef]) -> bool:
        """Stage ``chunks`` now and queue their put. False if refused (job finishes skipped)."""
        job = _Job(job_id, "save", [], time.monotonic())
        with self._known_lock:
            for c in sorted(chunks, key=lambda c: (c.group, c.chunk)):
                if c.key in self._known:
                    job.skipped += 1
                    job.known.append(c.key)
                else:
                    job.chunks.append(c)
        with self._counting():
            self._stats.saves_submitted += 1
            self._stats.chunks_skipped_known += job.skipped
        if not job.chunks:
            self._finish(job, {})
            return True
        if time.monotonic() < self._pressure_until:
            return self._refuse(job, "backpressure")
        if self.zero_copy:  # put straight from the KV tensors
            job.pieces = self._pieces(job.chunks)
            job.staged = len(job.chunks)
            try:
                self._save_q.put_nowait(job)
            except queue.Full:
                return self._refuse(job, "queue_full")
            return True
        offsets, total = self._place(job.chunks)
        start = self._arena.alloc(total)
        if start is None:
            return self._refuse(job, "staging_full")
        job.staging = start
        job.offsets = [start + o for o in offsets]
        job.pieces = self._pieces(job.chunks)
        try:  # queued before the gather: its first put starts once the first piece is in
            self._save_q.put_nowait(job)
        except queue.Full:
            return self._refuse(job, "queue_full")
        for lo, hi in job.pieces:
            try:
                self._gather(job.chunks[lo:hi], job.offsets[lo:hi])
            except Exception:
                logger.exception("staging copy failed; save skipped")
                with self._stage_cond:
                    job.stage_failed = True
                    self._stage_cond.notify_all()
                return False  # the put thread finishes the job, refused
            with self._stage_cond:
                job.staged = hi
                self._stage_cond.notify_all()
        return True

    def submit_load(self, job_id: Hashable, chunks: Sequence[ChunkRef]) -> bool:
        """Queue a load of ``chunks``; False if the queue is full (job finishes failed)."""
        job = _Job(
            job_id, "load", sorted(chunks, key=lambda c: (c.group, c.chunk)), time.monotonic()
        )
        with self._counting():
            self._stats.loads_submitted += 1
        if self.load_mode == "staged":
            with self._done_cond:
                self._pending_loads[id(job)] = job
        try:
            self._load_q.put_nowait(job)
        except queue.Full:
            self._finish_load(job, dict.fromkeys((c.key for c in job.chunks), Status.UNAVAILABLE))
            return False
        return True

    def poll(self) -> list[JobResult]:
        """Finished jobs since the last poll, oldest first; never blocks."""
        if self._load_timeout is not None and self._pending_loads:
            self._abandon_late_loads()
        out = []
        with self._done_cond:
            while self._done:
                out.append(self._done.popleft())
        return out

    def wait_any(self, timeout: float) -> bool:
        """Block until some job finished (its result waits for ``poll``) or ``timeout``
        seconds passed; whether a result is ready."""
        with self._done_cond:
            return self._done_cond.wait_for(lambda: bool(self._done), timeout)

    def wait(self, job_ids: Iterable[Hashable], timeout: float | None = None) -> list[JobResult]:
        """Block until every job in ``job_ids`` finished (or ``timeout``); return those.

        Results of other jobs stay queued for ``poll``.
        """
        want = set(job_ids)
        got: list[JobResult] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._done_cond:
            while True:
                keep: deque[JobResult] = deque()
                for r in self._done:
                    (got if r.job_id in want else keep).append(r)
                self._done = keep
                want -= {r.job_id for r in got}
                if not want:
                    return got
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return got
                self._done_cond.wait(left)

    @property
    def can_abandon(self) -> bool:
        """Loads can be reported early (staged mode): see ``abandon_loads``."""
        return self.load_mode == "staged"

    def _abandon_late_loads(self) -> None:
        """Report loads past their deadline as TIMED_OUT; their gets may still run."""
        assert self._load_timeout is not None
        cutoff = time.monotonic() - self._load_timeout
        with self._done_cond:
            late = [j for j in self._pending_loads.values() if j.submitted < cutoff]
        # A job copying into the KV tensors right now holds its lock for a few ms and
        # then finishes normally: never wait for it here.
        for job in self._abandon(late, Status.TIMED_OUT, block=False):
            with self._counting():
                self._stats.loads_timed_out += 1
            logger.warning(
                "load %r had no answer after %.1f s; reported failed (recompute)",
                job.job_id,
                self._load_timeout,
            )

    def abandon_loads(self, status: Status = Status.UNAVAILABLE) -> int:
        """Report every unfinished staged load as failed with ``status`` now (for
        ``poll``), e.g. before this engine is replaced; their gets may still run but
        copy nothing. Direct loads cannot be abandoned. Returns how many."""
        with self._done_cond:
            jobs = list(self._pending_loads.values())
        return len(self._abandon(jobs, status, block=True))

    def _abandon(self, jobs: Iterable[_Job], status: Status, block: bool) -> list[_Job]:
        """Publish each of ``jobs`` not reported yet as failed with ``status``; those
        it published. Without ``block``, a job holding its lock (copying) is skipped."""
        out = []
        for job in jobs:
            if not job.lock.acquire(blocking=block):
                continue
            try:
                if job.reported:
                    continue
                self._finish_load_locked(job, dict.fromkeys((c.key for c in job.chunks), status))
                out.append(job)
            finally:
                job.lock.release()
        return out

    def stats(self) -> TransferStats:
        with self._stats_lock:
            s = self._stats
            return TransferStats(
                s.saves_submitted,
                Counter(s.saves_refused),
                s.chunks_put,
                s.chunks_skipped_known,
                s.chunks_skipped_exist,
                s.bytes_put,
                s.loads_submitted,
                s.chunks_loaded,
                s.bytes_loaded,
                Counter(s.failures),
                s.backpressure_events,
                s.loads_timed_out,
            )

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        """Hold the stats lock to change ``_stats``; bumps ``stats_version``."""
        with self._stats_lock:
            self._stats_version += 1
            yield

    @property
    def stats_version(self) -> int:
        """Changes whenever ``stats()`` would: callers polling every engine step skip
        building a snapshot while it stays the same."""
        return self._stats_version

    @property
    def in_backpressure(self) -> bool:
        return time.monotonic() < self._pressure_until

    @property
    def queue_depth(self) -> int:
        return self._save_q.qsize() + self._load_q.qsize()

    def close(self) -> None:
        """Finish queued jobs, stop the threads, unregister staging memory."""
        if self._closed:
            return
        self._closed = True
        for q in (self._save_q, self._load_q):
            q.put(None)  # the load thread passes it on to the scatter thread
        for thread in self._threads:
            thread.join()

    # -- copies between KV tensors and staging ----------------------------------

    def _stage_rows(
        self, chunks: Sequence[ChunkRef], offsets: Sequence[int]
    ) -> Iterable[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Per (group, region) entry: (group, region, staging rows view, row indices).

        ``chunks`` are sorted by group, each group's objects back to back in staging
        from the offset of its first chunk, so they move with one indexed copy per
        region.
        """
        i = 0
        while i < len(chunks):
            g = chunks[i].group
            j = i
            while j < len(chunks) and chunks[j].group == g:
                j += 1
            spec = self.groups[g]
            ids = np.array([c.block_ids for c in chunks[i:j]], dtype=np.int64)
            pos = offsets[i]
            for region, rows in spec.rows(ids):
                row_bytes = spec.regions[region].row_bytes
                n = rows.size * row_bytes
                dst = self._staging[pos : pos + n].view(_word(row_bytes)).view(rows.size, -1)
                yield g, region, dst, torch.from_numpy(rows)
                pos += n
            i = j

    def _gather(self, chunks: Sequence[ChunkRef], offsets: Sequence[int]) -> None:
        for g, region, dst, rows in self._stage_rows(chunks, offsets):
            torch.index_select(self._views[g][region], 0, rows, out=dst)

    def _scatter(self, job: _Job, lo: int, hi: int, ok: Sequence[bool]) -> None:
        """Copy the staged objects of ``job.chunks[lo:hi]`` that arrived into the KV
        tensors, but only of chunks before the first failed one of the job so far:
        later chunks are reported invalid anyway, and what is copied of each group
        must stay back to back (``_stage_rows``)."""
        chunks = job.chunks[lo:hi]
        for c, k in zip(chunks, ok, strict=True):
            if not k and (job.first_failed is None or c.chunk < job.first_failed):
                job.first_failed = c.chunk
        end = job.first_failed
        keep = [k and (end is None or c.chunk < end) for c, k in zip(chunks, ok, strict=True)]
        offsets = [o for o, k in zip(job.offsets[lo:hi], keep, strict=True) if k]
        kept = [c for c, k in zip(chunks, keep, strict=True) if k]
        for g, region, src, rows in self._stage_rows(kept, offsets):
            view = self._views[g][region]
            if view.device.type == "cpu":
                # numpy's fancy assignment releases the GIL and is ~2x index_copy_
                view.numpy()[rows.numpy()] = src.numpy()
            else:
                view.index_copy_(0, rows, src)

    def _kv_segments(self, chunks: Sequence[ChunkRef]) -> Scatter:
        """Per chunk, its object's scatter list in the KV tensors themselves (one
        vectorised call per run of chunks of one group and block count)."""
        addrs: list[list[int]] = []
        sizes: list[list[int]] = []
        i = 0
        while i < len(chunks):
            g, n = chunks[i].group, len(chunks[i].block_ids)
            j = i
            while j < len(chunks) and chunks[j].group == g and len(chunks[j].block_ids) == n:
                j += 1
            ids = np.array([c.block_ids for c in chunks[i:j]], dtype=np.int64)
            a, z = self.groups[g].columns(ids)
            addrs += a
            sizes += z
            i = j
        return Scatter(addrs, sizes)  # kvcache builds valid columns

    def _pieces(self, chunks: Sequence[ChunkRef]) -> list[tuple[int, int]]:
        """``chunks`` cut into ranges of about ``piece_bytes`` (at least one chunk each):
        the units a save is put in and a staged load is fetched and copied in.

        Mooncake pays ~0.4 ms per batch call (measured on shared memory), so
        pieces stay large: 16 MiB by default, where throughput levels off.
        """
        out, lo, size = [], 0, 0
        for i, c in enumerate(chunks):
            size += self._object_nbytes(c)
            if size >= self.piece_bytes:
                out.append((lo, i + 1))
                lo, size = i + 1, 0
        if lo < len(chunks):
            out.append((lo, len(chunks)))
        return out

    # -- background threads -------------------------------------------------------

    def _loop(self, q: queue.Queue[_Job | None]) -> None:
        """Saves (puts) and loads, stage 1 (gets)."""
        while (job := q.get()) is not None:
            try:
                if job.kind == "save":
                    self._run_save(job)
                else:
                    self._run_load(job)
            except Exception:  # a bug here must not kill the thread or hang the engine
                logger.exception("transfer job %r failed", job.job_id)
                status = Status.UNAVAILABLE
                statuses = {c.key: status for c in job.chunks}
                if job.kind == "save":
                    self._finish(job, statuses)
                elif job.staging is None:  # else the scatter thread finishes it
                    self._finish_load(job, statuses)
        if q is self._load_q:
            self._scatter_q.put(None)

    def _run_save(self, job: _Job) -> None:
        """Put each piece once the caller has staged it (zero copy: straight away)."""
        statuses: dict[str, Status] = {}
        put: list[Status] = []
        nbytes = 0
        ok, exists = Status.OK, Status.EXISTS
        for lo, hi in job.pieces:
            if not self._wait_staged(job, hi):
                with self._counting():
                    self._stats.saves_refused["staging_error"] += 1
                job.skipped += len(job.chunks) - lo
                break
            chunks = job.chunks[lo:hi]
            keys = [c.key for c in chunks]
            sizes = self._sizes(chunks)
            if self.zero_copy:
                segs = self._kv_segments(chunks)
            else:
                segs = self._staged(job.offsets[lo:hi], sizes)
            got = self.store.batch_put(keys, segs)
            statuses.update(zip(keys, got, strict=True))
            if got.count(ok) == len(got):
                nbytes += sum(sizes)
            else:
                nbytes += sum(n for n, st in zip(sizes, got, strict=True) if st is ok)
            put += got
        done, dup = put.count(ok), put.count(exists)
        clean = done + dup == len(put)  # every put stored: no per-chunk pass below
        self._remember(statuses if clean else (k for k, s in statuses.items() if s.stored))
        pressing = (Status.NO_SPACE, Status.TRANSFER_FAILED, Status.UNAVAILABLE)
        trouble = None if clean else next((s for s in put if s in pressing), None)
        if trouble is not None:
            self._enter_backpressure(trouble)
        elif put:
            self._backoff_next = self._backoff[0]
        with self._counting():
            self._stats.chunks_skipped_exist += dup
            self._stats.chunks_put += done
            self._stats.bytes_put += nbytes
            if not clean:
                self._stats.failures.update(s.value for s in put if not s.stored)
        self._finish(job, statuses, nbytes)

    def _wait_staged(self, job: _Job, hi: int) -> bool:
        """Wait until the caller staged ``job.chunks[:hi]``; False if staging failed."""
        with self._stage_cond:
            while job.staged < hi and not job.stage_failed:
                self._stage_cond.wait()
            return job.staged >= hi

    def _run_load(self, job: _Job) -> None:
        """Direct: one get into the KV tensors. Staged: get piece by piece into staging
        and hand each piece to the scatter thread, which copies and finishes."""
        keys = [c.key for c in job.chunks]
        if job.reported:  # timed out while queued
            return
        if not keys:
            self._finish_load(job, {})
            return
        if self.load_mode == "direct":
            got = self.store.batch_get(keys, self._kv_segments(job.chunks))
            self._settle_load(job, dict(zip(keys, got, strict=True)))
            return
        offsets, total = self._place(job.chunks)
        # Loads wait for staging space (saves never do); too big a load fails.
        start = self._arena.alloc(total, wait=True)
        if start is None:
            self._finish_load(job, dict.fromkeys(keys, Status.UNAVAILABLE))
            return
        job.staging = start
        job.offsets = [start + o for o in offsets]
        job.pieces = self._pieces(job.chunks)
        for n, (lo, hi) in enumerate(job.pieces):
            piece = _Piece(job, lo, hi, last=n == len(job.pieces) - 1)
            if job.is_reported():  # abandoned: fetch nothing more, let the scatter free
                piece.statuses = [Status.TIMED_OUT] * (hi - lo)
            else:
                segs = self._staged(job.offsets[lo:hi], self._sizes(job.chunks[lo:hi]))
                t0 = time.perf_counter()
                try:
                    piece.statuses = self.store.batch_get(keys[lo:hi], segs)
                except Exception:  # a bug: the piece fails, the pipeline goes on
                    logger.exception("load %r: get failed", job.job_id)
                    piece.statuses = [Status.UNAVAILABLE] * (hi - lo)
                piece.get_s = time.perf_counter() - t0
            self._scatter_q.put(piece)

    def _scatter_loop(self) -> None:
        """Staged loads, stage 2: copy each verified piece into the KV tensors (never
        after the job was reported), and finish the job with its last piece."""
        while (piece := self._scatter_q.get()) is not None:
            job = piece.job
            t0 = time.perf_counter()
            try:
                with job.lock:
                    if not job.is_reported():  # TIMED_OUT: its blocks may be reused
                        self._scatter(job, piece.lo, piece.hi, [s.ok for s in piece.statuses])
            except Exception:
                logger.exception("load %r: copy into KV failed", job.job_id)
                piece.statuses = [Status.UNAVAILABLE] * (piece.hi - piece.lo)
            logger.debug(
                "load %r chunks %d-%d: get %.1f ms, copy into KV %.1f ms",
                job.job_id,
                piece.lo,
                piece.hi,
                piece.get_s * 1e3,
                (time.perf_counter() - t0) * 1e3,
            )
            for c, st in zip(job.chunks[piece.lo : piece.hi], piece.statuses, strict=True):
                job.got[c.key] = st
            if piece.last:
                try:
                    self._settle_load(job, job.got)
                except Exception:
                    logger.exception("load %r: finishing failed", job.job_id)
                    self._finish_load(job, dict.fromkeys(job.got, Status.UNAVAILABLE))
                finally:
                    if job.staging is not None:
                        self._arena.free(job.staging)
                        job.staging = None

    def _settle_load(self, job: _Job, statuses: dict[str, Status]) -> None:
        """Remember what loaded, forget and remove (if corrupt) what did not, publish."""
        if _all_ok(statuses):  # the common case
            self._remember(statuses)
            self._finish_load(job, statuses)
            return
        self._remember(k for k, s in statuses.items() if s.ok)
        bad = [k for k, s in statuses.items() if not s.ok]
        self.forget(bad)
        corrupt = [k for k in bad if statuses[k] is Status.CORRUPT]
        if corrupt:  # an object that fails its checks is removed, so it misses next time
            self.store.batch_remove(corrupt, force=True)
        self._finish_load(job, statuses)

    # -- bookkeeping ----------------------------------------------------------------

    def _place(self, chunks: Sequence[ChunkRef]) -> tuple[list[int], int]:
        """Staging offsets of ``chunks`` (sorted by group) and their total extent.

        A group's objects lie back to back; each group starts 64-byte aligned, so
        word views of staging line up with the word views of the KV tensors.
        """
        offsets, pos, group = [], 0, None
        for c in chunks:
            if c.group != group:
                pos = -(-pos // 64) * 64
                group = c.group
            offsets.append(pos)
            pos += self._object_nbytes(c)
        return offsets, pos

    def _object_nbytes(self, c: ChunkRef) -> int:
        return self.groups[c.group].object_nbytes(len(c.block_ids))

    def _staged(self, offsets: Sequence[int], sizes: Sequence[int]) -> Scatter:
        """One-segment objects at ``offsets`` (absolute, in the arena) of staging."""
        base = self._staging_base
        return Scatter([[base + o] for o in offsets], [[n] for n in sizes])

    def _sizes(self, chunks: Sequence[ChunkRef]) -> list[int]:
        """``_object_nbytes`` of each chunk (one computation when all are alike)."""
        if not chunks:
            return []
        first = chunks[0]
        n = self._object_nbytes(first)
        g, b = first.group, len(first.block_ids)
        if all(c.group == g and len(c.block_ids) == b for c in chunks):
            return [n] * len(chunks)
        return [self._object_nbytes(c) for c in chunks]

    def _remember(self, keys: Iterable[str]) -> None:
        with self._known_lock:
            for k in keys:
                self._known[k] = None
                self._known.move_to_end(k)
            while len(self._known) > self._known_max:
                self._known.popitem(last=False)

    def forget(self, keys: Iterable[str]) -> None:
        """Drop keys from the recently-stored set (e.g. after a failed load of them)."""
        with self._known_lock:
            for k in keys:
                self._known.pop(k, None)

    def _enter_backpressure(self, cause: Status) -> None:
        delay = self._backoff_next
        self._backoff_next = min(self._backoff[1], delay * 2)
        self._pressure_until = time.monotonic() + delay
        with self._counting():
            self._stats.backpressure_events += 1
        logger.warning("pool put failed (%s); skipping saves for %.1f s", cause.value, delay)

    def _refuse(self, job: _Job, reason: str) -> bool:
        if job.staging is not None:
            self._arena.free(job.staging)
            job.staging = None
        with self._counting():
            self._stats.saves_refused[reason] += 1
        job.skipped += len(job.chunks)
        job.chunks = []
        self._finish(job, {})
        return False

    def _finish(self, job: _Job, statuses: dict[str, Status], nbytes: int = 0) -> None:
        if job.staging is not None:
            self._arena.free(job.staging)
            job.staging = None
        skipped = job.skipped + list(statuses.values()).count(Status.EXISTS)
        self._publish(
            JobResult(
                job.job_id,
                job.kind,
                statuses,
                frozenset(),
                skipped,
                nbytes,
                time.monotonic() - job.submitted,
                tuple(job.known),
            )
        )

    def _finish_load(self, job: _Job, statuses: dict[str, Status]) -> None:
        """Publish ``job``'s result unless it was published already (timed out)."""
        with job.lock:
            if not job.reported:
                self._finish_load_locked(job, statuses)

    def _finish_load_locked(self, job: _Job, statuses: dict[str, Status]) -> None:
        job.reported = True
        with self._done_cond:
            self._pending_loads.pop(id(job), None)
        invalid: set[int] = set()
        all_ok = _all_ok(statuses)
        if all_ok:
            ok_chunks: Sequence[ChunkRef] = job.chunks
        else:
            failed = [c.chunk for c in job.chunks if not statuses[c.key].ok]
            first = min(failed)
            for c in job.chunks:
                if c.chunk >= first:
                    invalid.update(c.block_ids)
            ok_chunks = [c for c in job.chunks if statuses[c.key].ok]
        nbytes = sum(self._sizes(ok_chunks))
        with self._counting():
            self._stats.chunks_loaded += len(ok_chunks)
            self._stats.bytes_loaded += nbytes
            if not all_ok:
                self._stats.failures.update(s.value for s in statuses.values() if not s.ok)
        self._publish(
            JobResult(
                job.job_id,
                "load",
                statuses,
                frozenset(invalid),
                0,
                nbytes,
                time.monotonic() - job.submitted,
            )
        )

    def _publish(self, result: JobResult) -> None:
        with self._done_cond:
            self._done.append(result)
            self._done_cond.notify_all()


def _all_ok(statuses: dict[str, Status]) -> bool:
    """Every key OK (one C-level count, not a property call per key)."""
    return list(statuses.values()).count(Status.OK) == len(statuses)

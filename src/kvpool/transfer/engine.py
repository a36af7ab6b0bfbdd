"""TransferEngine: moves chunk objects between this rank's KV tensors and the pool.

    TransferEngine(store, groups, num_blocks)  describe the KV tensors (``kvcache``),
                                   register each distinct allocation once
    submit_save(job_id, chunks)    stage the chunks' blocks piece by piece *now*
                                   and put each piece on a background thread as
                                   soon as it is staged; False when some of the
                                   job was refused (its result says which chunks)
    submit_load(job_id, chunks)    get the chunks on a background thread into the KV
                                   tensors (zero-copy, ``load_mode="direct"``) or
                                   piece by piece through staging (``"staged"``,
                                   forced when the store moves bytes only through
                                   its own buffers, as Mooncake's shared memory)
    wait_any(timeout)              block until some job finished (or timeout)
    poll()                         finished jobs (``JobResult``); never blocks; a
                                   staged load older than ``load_timeout_s`` is
                                   reported here as TIMED_OUT and abandoned
    wait(job_ids, timeout)         block until those jobs finish
    abandon_loads()                report every unfinished staged load failed now
    close()                        stop the threads after the queued jobs

Any job size moves through bounded staging (``pieces``): staging is split between
saves and staged loads, each piece reserves only its own bytes and releases them
when its put (or its copy into the KV tensors) is done. A save bigger than its
staging waits, inside ``submit_save``, for earlier pieces' puts to free space: the
staging size sets speed, not whether a chunk is saved. A wait that sees no piece
freed for ``save_wait_s`` (the pool stopped taking puts) refuses the rest of the
job ("staging_busy", retryable) and later saves refuse at once, without waiting,
until a put frees space again. Objects must fit the staging (checked at start).

Zero copy (``zero_copy=True``): the store moves bytes straight between the KV
tensors and the pool; the KV tensors must lie in memory it reaches
(``KVStore.reaches``; on Mooncake's shared memory, ``kvpool.placement``). Loads
are direct, with no deadline; a save reads its blocks until its job finished.

Guarantees:

* A staged save reads KV blocks only inside ``submit_save``: once it returns, the
  blocks may be reused; the pool gets the bytes they held at submit time (or
  nothing). Zero copy: until the job finished instead.
* A refused chunk is never put and never reported stored: ``JobResult.refused``
  names the cause and ``refused_from`` the first refused chunk (all later chunks
  of the job were refused too); ``retry`` says whether submitting it again may
  succeed. Refusals are counted by cause and logged (one line per cause and
  minute, with what to change); they never read as a store failure.
* A load job reports, in ``JobResult.invalid_block_ids``, the blocks of every chunk
  that failed (missing, evicted, corrupt, transfer failure, refused) and of every
  later chunk of the job, so the engine recomputes exactly those.
* In staged load mode, bytes reach the KV tensors only after their header and
  checksum were verified, and never after the job was reported (TIMED_OUT).
* A CORRUPT object (header or checksum mismatch) is removed from the pool.
* NO_SPACE, TRANSFER_FAILED or UNAVAILABLE on a put switch saves into
  backpressure: further saves are refused until a growing back-off expires.
* Nothing raises into the caller for store faults; they become statuses.

The caller decides which chunks this rank writes (``layout.Layout.writes``);
chunks whose keys were stored (or loaded) recently are skipped without a store
round trip; the rest are put without asking first (a duplicate put keeps the old
value and costs Mooncake no bytes moved, so an exists check cost more than it saved).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Literal

import numpy as np
import torch

from kvpool.kvcache import GroupKV, describe_group
from kvpool.store.base import KVStore, Scatter, Status
from kvpool.transfer import pieces
from kvpool.transfer.arena import StagingArena
from kvpool.transfer.copies import KVCopier
from kvpool.transfer.records import ChunkRef, Job, JobResult, Piece, TransferStats

__all__ = ["PIECE_BYTES", "TransferEngine"]

logger = logging.getLogger(__name__)

PIECE_BYTES = 16 << 20  # Mooncake pays ~0.4 ms per batch call: pieces stay large
NOTE_INTERVAL_S = 60.0  # one log line per refusal cause at most this often

_ADVICE = {
    "staging_busy": "the pool freed no save staging for {wait:.1f} s; raise staging_bytes "
    "if the pool is healthy but slower than the engine",
    "backpressure": "puts failed recently and saves back off (see the warning before)",
    "staging_error": "copying KV blocks into staging failed (see the error before)",
    "queue_full": "the load queue is full",
}


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
        known_keys: int = 65536,
        backoff_s: tuple[float, float] = (1.0, 30.0),
        load_timeout_s: float | None = None,
        piece_bytes: int = PIECE_BYTES,
        zero_copy: bool = False,
        blocks_per_object: int = 1,
        save_wait_s: float = 1.0,
    ) -> None:
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
        self.store = store
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
            self.load_mode: str = "direct"
        else:
            # Stores that move bytes only through their own buffers (Mooncake's
            # same-host shared memory) cannot reach the KV tensors: stage loads too.
            self.load_mode = "staged" if store.requires_staging else load_mode
        if not store.requires_staging:
            registered: set[int] = set()
            for spec in self.groups:
                for region in spec.regions:
                    if region.base not in registered:
                        store.register_memory(region.base, region.nbytes)
                        registered.add(region.base)
        if zero_copy:  # nothing is staged
            staging = torch.empty(0, dtype=torch.uint8)
        elif staging is None:  # registered memory from the store (shared with the holder)
            staging = torch.from_numpy(store.alloc_staging(staging_bytes))
        else:
            store.register_memory(int(staging.data_ptr()), staging.numel())
        self._staging_base = int(staging.data_ptr())
        self._copier = KVCopier(self.groups, groups, staging)
        save_bytes, load_bytes = pieces.split_staging(
            staging.numel(), staged_loads=self.load_mode == "staged"
        )
        largest = max(spec.object_nbytes(blocks_per_object) for spec in self.groups)
        if not zero_copy:
            pieces.check_fits(largest, save_bytes, "saves")
        if self.load_mode == "staged":
            pieces.check_fits(largest, load_bytes, "loads")
        self._save_arena = StagingArena(save_bytes)
        self._load_arena = StagingArena(load_bytes)
        self._load_base = save_bytes  # the load arena's offset 0 in staging
        n = len(self.groups)
        self._save_budget = pieces.piece_budget(piece_bytes, save_bytes, n)
        self._load_budget = pieces.piece_budget(piece_bytes, load_bytes, n)
        if zero_copy:  # no staging: pieces only bound the size of one store call
            self._save_budget = self._load_budget = piece_bytes
        self._save_wait_s = save_wait_s
        self._save_stuck = False  # a wait saw no put free staging: refuse at once
        self._known: OrderedDict[str, None] = OrderedDict()
        self._known_max = known_keys
        self._known_lock = threading.Lock()
        self._backoff = backoff_s
        self._backoff_next = backoff_s[0]
        self._pressure_until = 0.0
        self._stats = TransferStats()
        self._stats_lock = threading.Lock()
        self._stats_version = 0  # bumped by _counting, with every change of _stats
        self._noted: dict[str, tuple[float, int]] = {}  # cause -> (last log, chunks since)
        self._done: deque[JobResult] = deque()
        self._done_cond = threading.Condition()
        self._stage_cond = threading.Condition()  # a save's staging progress
        # Unbounded: a staged save's bytes are in staging before it is queued, and
        # loads are bounded by the requests waiting for them.
        self._save_q: queue.Queue[Job | None] = queue.Queue()
        self._load_q: queue.Queue[Job | None] = queue.Queue()
        self._scatter_q: queue.Queue[Piece | None] = queue.Queue()
        self._load_timeout = load_timeout_s if self.load_mode == "staged" else None
        if load_timeout_s is not None and self._load_timeout is None:
            logger.info("direct loads cannot be abandoned: load_timeout_s is not enforced")
        # Unreported staged loads (id(job) -> job): what a deadline or
        # ``abandon_loads`` may report early. Direct loads are never reported early.
        self._pending_loads: dict[int, Job] = {}
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
        """Stage ``chunks`` now and queue their puts; False if some were refused."""
        job = Job(job_id, "save", [], time.monotonic())
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
            self._refuse(job, 0, "backpressure")
            self._finish(job, {})
            return False
        job.pieces = pieces.cut(self._sizes(job.chunks), self._save_budget)
        if self.zero_copy:  # put straight from the KV tensors
            job.staged = [Piece(job, lo, hi, last=False) for lo, hi in job.pieces]
            self._save_q.put(job)
            return True
        self._save_q.put(job)  # queued first: its first put starts once a piece is in
        for lo, hi in job.pieces:
            piece = self._stage(job, lo, hi)
            with self._stage_cond:
                if isinstance(piece, str):  # refused from here on; the put thread finishes
                    self._refuse(job, lo, piece)
                else:
                    job.staged.append(piece)
                self._stage_cond.notify_all()
            if isinstance(piece, str):
                return False
        return True

    def submit_load(self, job_id: Hashable, chunks: Sequence[ChunkRef]) -> bool:
        """Queue a load of ``chunks`` (always accepted; returns True)."""
        job = Job(
            job_id, "load", sorted(chunks, key=lambda c: (c.group, c.chunk)), time.monotonic()
        )
        with self._counting():
            self._stats.loads_submitted += 1
        if self.load_mode == "staged":
            with self._done_cond:
                self._pending_loads[id(job)] = job
        self._load_q.put(job)
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

    def abandon_loads(self, status: Status = Status.UNAVAILABLE) -> int:
        """Report every unfinished staged load as failed with ``status`` now (for
        ``poll``), e.g. before this engine is replaced; their gets may still run but
        copy nothing. Direct loads cannot be abandoned. Returns how many."""
        with self._done_cond:
            jobs = list(self._pending_loads.values())
        return len(self._abandon(jobs, status, block=True))

    def stats(self) -> TransferStats:
        with self._stats_lock:
            return self._stats.copy()

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
        """Finish queued jobs, stop the threads (staging belongs to the store)."""
        if self._closed:
            return
        self._closed = True
        for q in (self._save_q, self._load_q):
            q.put(None)  # the load thread passes it on to the scatter thread
        for thread in self._threads:
            thread.join()

    # -- saves -----------------------------------------------------------------------

    def _stage(self, job: Job, lo: int, hi: int) -> Piece | str:
        """Reserve save staging for ``job.chunks[lo:hi]`` and copy their blocks in;
        the reason when refused instead."""
        chunks = job.chunks[lo:hi]
        offsets, extent = pieces.place([c.group for c in chunks], self._sizes(chunks))
        arena = self._save_arena
        start = arena.alloc(extent)
        if start is None and not self._save_stuck:  # wait while puts free space
            t0 = time.monotonic()
            start = arena.alloc(extent, wait=True, timeout=self._save_wait_s)
            with self._counting():
                self._stats.save_wait_s += time.monotonic() - t0
            self._save_stuck = start is None
        if start is None:
            return "staging_busy"
        piece = Piece(job, lo, hi, last=False, staging=start)
        piece.offsets = [start + o for o in offsets]
        try:
            self._copier.gather(chunks, piece.offsets)
        except Exception:
            logger.exception("kvpool: copying KV blocks into staging failed; save refused")
            arena.free(start)
            return "staging_error"
        return piece

    def _run_save(self, job: Job) -> None:
        """Put each piece once the caller has staged it, then free its staging."""
        statuses: dict[str, Status] = {}
        put: list[Status] = []
        nbytes = 0
        ok, exists = Status.OK, Status.EXISTS
        for n in range(len(job.pieces)):
            piece = self._wait_staged(job, n)
            if piece is None:  # the caller refused the rest (counted there)
                break
            chunks = job.chunks[piece.lo : piece.hi]
            keys = [c.key for c in chunks]
            sizes = self._sizes(chunks)
            if self.zero_copy:
                segs = self._kv_segments(chunks)
            else:
                segs = self._staged(piece.offsets, sizes)
            try:
                got = self.store.batch_put(keys, segs)
            finally:
                if piece.staging is not None:
                    self._save_arena.free(piece.staging)
                    self._save_stuck = False
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

    def _wait_staged(self, job: Job, n: int) -> Piece | None:
        """Piece ``n`` of ``job`` once the caller staged it; None if it was refused."""
        with self._stage_cond:
            while len(job.staged) <= n and not job.refused:
                self._stage_cond.wait()
            return job.staged[n] if len(job.staged) > n else None

    def _refuse(self, job: Job, lo: int, reason: str) -> None:
        """Count chunks ``lo:`` of a save as refused for ``reason`` (never put)."""
        rest = job.chunks[lo:]
        job.refused = reason
        job.skipped += len(rest)
        job.chunks = job.chunks[:lo]
        job.refused_from = min(c.chunk for c in rest)
        with self._counting():
            self._stats.saves_refused[reason] += 1
            self._stats.chunks_refused[reason] += len(rest)
        self._note(reason, len(rest))

    def _note(self, reason: str, chunks: int) -> None:
        """Log a refusal: the first at once, then one line per cause and interval."""
        now = time.monotonic()
        last, count = self._noted.get(reason, (-NOTE_INTERVAL_S, 0))
        count += chunks
        if now - last < NOTE_INTERVAL_S:
            self._noted[reason] = (last, count)
            return
        self._noted[reason] = (now, 0)
        advice = _ADVICE.get(reason, reason).format(wait=self._save_wait_s)
        logger.warning("kvpool: %d chunk(s) not saved (%s): %s", count, reason, advice)

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

    # -- loads -----------------------------------------------------------------------

    def _run_load(self, job: Job) -> None:
        """Direct: one get into the KV tensors. Staged: get piece by piece into
        staging and hand each piece to the scatter thread, which copies and finishes."""
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
        spans = pieces.cut(self._sizes(job.chunks), self._load_budget)
        for n, (lo, hi) in enumerate(spans):
            piece = Piece(job, lo, hi, last=n == len(spans) - 1)
            if job.is_reported():  # abandoned: fetch nothing more
                piece.statuses = [Status.TIMED_OUT] * (hi - lo)
            else:
                self._get_piece(piece, keys[lo:hi])
            self._scatter_q.put(piece)

    def _get_piece(self, piece: Piece, keys: list[str]) -> None:
        """Reserve load staging for ``piece`` (waiting for earlier pieces' copies)
        and get its objects into it."""
        chunks = piece.job.chunks[piece.lo : piece.hi]
        sizes = self._sizes(chunks)
        offsets, extent = pieces.place([c.group for c in chunks], sizes)
        start = self._load_arena.alloc(extent, wait=True)
        if start is None:  # larger than the arena: check_fits rules it out
            piece.statuses = [Status.REFUSED] * len(keys)
            return
        piece.staging = start
        piece.offsets = [self._load_base + start + o for o in offsets]
        t0 = time.perf_counter()
        try:
            piece.statuses = self.store.batch_get(keys, self._staged(piece.offsets, sizes))
        except Exception:  # a bug: the piece fails, the pipeline goes on
            logger.exception("load %r: get failed", piece.job.job_id)
            piece.statuses = [Status.UNAVAILABLE] * len(keys)
        piece.get_s = time.perf_counter() - t0

    def _scatter_loop(self) -> None:
        """Staged loads, stage 2: copy each verified piece into the KV tensors (never
        after the job was reported), free its staging, finish the job with its last."""
        while (piece := self._scatter_q.get()) is not None:
            job = piece.job
            t0 = time.perf_counter()
            try:
                with job.lock:
                    if not job.is_reported():  # TIMED_OUT: its blocks may be reused
                        self._scatter(piece, [s.ok for s in piece.statuses])
            except Exception:
                logger.exception("load %r: copy into KV failed", job.job_id)
                piece.statuses = [Status.UNAVAILABLE] * (piece.hi - piece.lo)
            finally:
                if piece.staging is not None:
                    self._load_arena.free(piece.staging)
                    piece.staging = None
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

    def _scatter(self, piece: Piece, ok: Sequence[bool]) -> None:
        """Copy the piece's objects that arrived into the KV tensors, but only of
        chunks before the first failed one of the job so far: later chunks are
        reported invalid anyway, and what is copied of each group must stay back to
        back from the group's first offset (``KVCopier``)."""
        job = piece.job
        chunks = job.chunks[piece.lo : piece.hi]
        for c, k in zip(chunks, ok, strict=True):
            if not k and (job.first_failed is None or c.chunk < job.first_failed):
                job.first_failed = c.chunk
        end = job.first_failed
        keep = [k and (end is None or c.chunk < end) for c, k in zip(chunks, ok, strict=True)]
        offsets = [o for o, k in zip(piece.offsets, keep, strict=True) if k]
        kept = [c for c, k in zip(chunks, keep, strict=True) if k]
        self._copier.scatter(kept, offsets)

    def _settle_load(self, job: Job, statuses: dict[str, Status]) -> None:
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

    def _abandon(self, jobs: Iterable[Job], status: Status, block: bool) -> list[Job]:
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

    # -- background threads -------------------------------------------------------

    def _loop(self, q: queue.Queue[Job | None]) -> None:
        """Saves (puts), or loads' first stage (gets)."""
        while (job := q.get()) is not None:
            try:
                if job.kind == "save":
                    self._run_save(job)
                else:
                    self._run_load(job)
            except Exception:  # a bug here must not kill the thread or hang the engine
                logger.exception("transfer job %r failed", job.job_id)
                statuses = dict.fromkeys((c.key for c in job.chunks), Status.UNAVAILABLE)
                if job.kind == "save":
                    self._finish(job, statuses)
                else:
                    self._finish_load(job, statuses)
        if q is self._load_q:
            self._scatter_q.put(None)

    # -- bookkeeping ----------------------------------------------------------------

    def _object_nbytes(self, c: ChunkRef) -> int:
        return self.groups[c.group].object_nbytes(len(c.block_ids))

    def _staged(self, offsets: Sequence[int], sizes: Sequence[int]) -> Scatter:
        """One-segment objects at ``offsets`` (absolute) of staging."""
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

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        """Hold the stats lock to change ``_stats``; bumps ``stats_version``."""
        with self._stats_lock:
            self._stats_version += 1
            yield

    def _finish(self, job: Job, statuses: dict[str, Status], nbytes: int = 0) -> None:
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
                job.refused,
                job.refused_from,
            )
        )

    def _finish_load(self, job: Job, statuses: dict[str, Status]) -> None:
        """Publish ``job``'s result unless it was published already (timed out)."""
        with job.lock:
            if not job.reported:
                self._finish_load_locked(job, statuses)

    def _finish_load_locked(self, job: Job, statuses: dict[str, Status]) -> None:
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

"""The load path: get a job's chunks, straight into the KV tensors or piece by piece
through staging, and report which blocks to recompute.

    Loads(core, arena, base, budget, mode, timeout_s, enqueue, scatter_q)
                             ``base``: the arena's offset 0 in staging; ``budget``:
                             bytes per piece; ``enqueue`` hands a job to the load
                             thread; ``scatter_q`` feeds the scatter thread
    submit(job_id, chunks)   the caller's thread: the job, for the load thread
    run(job)                 the load thread. Direct: one get into the KV tensors.
                             Staged: per piece (``pieces.job_budget``), reserve
                             staging (waiting for earlier pieces' copies), get into
                             it, hand it to the scatter thread
    scatter_loop(q)          the scatter thread: check each piece's payloads (the
                             checksums its get left, ``batch_get_deferred``, unless
                             the load thread found it behind and checked), copy
                             what passed into the KV tensors, free its staging,
                             finish the job with its last
    abandon_late()           report staged loads past ``timeout_s`` as TIMED_OUT
    abandon(status)          report every unfinished staged load failed now

Rules (the contract is ``kvpool.transfer.engine``'s): a result lists the blocks
of every chunk that failed and of every later chunk; staged bytes reach the KV
tensors only after their checks passed, only for chunks before the job's first
failure, and never after the job was reported; a CORRUPT object is removed
(``Shared.discard``: never forced).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence

from kvpool.store.base import Status
from kvpool.store.scatter import take
from kvpool.transfer import pieces
from kvpool.transfer.arena import StagingArena
from kvpool.transfer.records import ChunkRef, Job, JobResult, Piece
from kvpool.transfer.shared import Shared, all_ok

__all__ = ["Loads"]

_DISCARDED = (Status.CORRUPT, Status.FORGED)  # removed after a failed load

logger = logging.getLogger("kvpool.transfer.engine")


class Loads:
    """See the module docstring."""

    def __init__(
        self,
        core: Shared,
        arena: StagingArena,
        base: int,
        budget: int,
        mode: str,
        timeout_s: float | None,
        enqueue: Callable[[Job], None],
        scatter_q: queue.Queue[Piece | None],
    ) -> None:
        self.core = core
        self.arena = arena
        self.base = base  # the arena's offset 0 in staging
        self.budget = budget
        self.mode = mode
        self.timeout_s = timeout_s if mode == "staged" else None
        self.enqueue = enqueue  # hands a job to the load thread
        self.scatter_q = scatter_q
        # Unreported staged loads (id(job) -> job): what a deadline or ``abandon``
        # may report early. Direct loads are never reported early.
        self.pending: dict[int, Job] = {}
        self._pending_lock = threading.Lock()

    def submit(self, job_id: Hashable, chunks: Sequence[ChunkRef]) -> None:
        job = Job(
            job_id, "load", sorted(chunks, key=lambda c: (c.group, c.chunk)), time.monotonic()
        )
        with self.core.counting():
            self.core.stats.loads_submitted += 1
        if self.mode == "staged":
            with self._pending_lock:
                self.pending[id(job)] = job
        self.enqueue(job)

    # -- the load thread ---------------------------------------------------------------

    def run(self, job: Job) -> None:
        keys = [c.key for c in job.chunks]
        if job.reported:  # timed out while queued
            return
        # A load's time counts from here (the deadline from submission): loads by
        # layer submit a job per band at once, each band's time is its own.
        job.started = time.monotonic()
        if not keys:
            self.finish(job, {})
            return
        core = self.core
        if self.mode == "direct":
            order = pieces.last_first(job.chunks)  # a read renews leases: keep the start
            keys = [keys[i] for i in order]
            got = core.store.batch_get(keys, take(core.kv_segments(job.chunks), order))
            self._settle(job, dict(zip(keys, got, strict=True)))
            return
        sizes = core.sizes(job.chunks)
        spans = pieces.cut(sizes, pieces.job_budget(sum(sizes), self.budget))
        for n, (lo, hi) in enumerate(spans):
            piece = Piece(job, lo, hi, last=n == len(spans) - 1)
            if job.is_reported():  # abandoned: fetch nothing more
                piece.statuses = [Status.TIMED_OUT] * (hi - lo)
            else:
                self._get_piece(piece, keys[lo:hi])
            self.scatter_q.put(piece)

    def _get_piece(self, piece: Piece, keys: list[str]) -> None:
        """Reserve staging for ``piece`` (waiting for earlier pieces' copies) and get
        its objects into it."""
        chunks = piece.job.chunks[piece.lo : piece.hi]
        sizes = self.core.sizes(chunks)
        offsets, extent = pieces.place([c.group for c in chunks], sizes)
        start = self.arena.alloc(extent, wait=True)
        if start is None:  # larger than the arena: check_fits rules it out
            piece.statuses = [Status.REFUSED] * len(keys)
            return
        piece.staging = start
        piece.offsets = [self.base + start + o for o in offsets]
        # A read renews the objects' leases in this order: the start of a prompt last.
        order = pieces.last_first(chunks)
        segs = take(self.core.staged(piece.offsets, sizes), order)
        t0 = time.perf_counter()
        try:
            # The payload check is left to the scatter thread, so that this thread's
            # next get starts at once (the holder's copy beside the check and the
            # copy into KV); made here instead when the scatter thread is behind.
            got, piece.check = self.core.store.batch_get_deferred([keys[i] for i in order], segs)
            piece.get_s = time.perf_counter() - t0
            piece.order = order
            piece.statuses = [Status.UNAVAILABLE] * len(keys)
            for i, st in zip(order, got, strict=True):
                piece.statuses[i] = st
            if not self.scatter_q.empty():  # the scatter thread is behind: check here
                self._verify(piece)
        except Exception:  # a bug: the piece fails, the pipeline goes on
            logger.exception("load %r: get failed", piece.job.job_id)
            piece.statuses = [Status.UNAVAILABLE] * len(keys)
            piece.check = None
            piece.get_s = time.perf_counter() - t0

    # -- the scatter thread ------------------------------------------------------------

    def scatter_loop(self) -> None:
        while (piece := self.scatter_q.get()) is not None:
            job = piece.job
            t0 = time.perf_counter()
            late = False
            try:
                self._verify(piece)  # outside the lock: abandon() never waits for it
                with job.lock:
                    late = job.is_reported()  # TIMED_OUT: its blocks may be reused
                    if not late:
                        self._scatter(piece, [s.ok for s in piece.statuses])
            except Exception:
                logger.exception("load %r: copy into KV failed", job.job_id)
                piece.statuses = [Status.UNAVAILABLE] * (piece.hi - piece.lo)
            finally:
                if piece.staging is not None:
                    self.arena.free(piece.staging)
                    piece.staging = None
            logger.debug(
                "load %r chunks %d-%d: get %.1f ms, check and copy into KV %.1f ms",
                job.job_id,
                piece.lo,
                piece.hi,
                piece.get_s * 1e3,
                (time.perf_counter() - t0) * 1e3,
            )
            if late and piece.get_s:  # the store held this client until now
                logger.info(
                    "load %r: a get of a load given up returned after %.1f s; "
                    "its bytes are dropped",
                    job.job_id,
                    piece.get_s,
                )
            for c, st in zip(job.chunks[piece.lo : piece.hi], piece.statuses, strict=True):
                job.got[c.key] = st
            if piece.last:
                try:
                    self._settle(job, job.got)
                except Exception:
                    logger.exception("load %r: finishing failed", job.job_id)
                    self.finish(job, dict.fromkeys(job.got, Status.UNAVAILABLE))

    def _verify(self, piece: Piece) -> None:
        """Run the payload check the piece's get left (``batch_get_deferred``):
        objects that fail it read CORRUPT, so they are neither copied nor kept, and
        are removed. A late piece is checked too: an OK must mean checked, even of
        bytes that are dropped (loaded keys are remembered as stored)."""
        check, piece.check = piece.check, None
        if check is None:
            return
        for j in check.failed():
            piece.statuses[piece.order[j]] = Status.CORRUPT

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
        self.core.copier.scatter(kept, offsets)

    def _settle(self, job: Job, statuses: dict[str, Status]) -> None:
        """Remember what loaded, forget and remove (if corrupt) what did not, publish."""
        core = self.core
        if all_ok(statuses):  # the common case
            core.remember(statuses)
            self.finish(job, statuses)
            return
        core.remember(k for k, s in statuses.items() if s.ok)
        bad = [k for k, s in statuses.items() if not s.ok]
        core.forget(bad)
        # A damaged or forged object is removed (not forced: other readers' leases
        # hold), so it misses next time and a save can replace it; a MISMATCH
        # (another config's or mode's object) stays.
        core.discard([k for k in bad if statuses[k] in _DISCARDED])
        self.finish(job, statuses)

    # -- reporting ---------------------------------------------------------------------

    def abandon_late(self) -> None:
        """Report loads past their deadline as TIMED_OUT; their gets may still run."""
        if self.timeout_s is None or not self.pending:
            return
        cutoff = time.monotonic() - self.timeout_s
        with self._pending_lock:
            late = [j for j in self.pending.values() if j.submitted < cutoff]
        # A job copying into the KV tensors right now holds its lock for a few ms and
        # then finishes normally: never wait for it here.
        for job in self._abandon(late, Status.TIMED_OUT, block=False):
            with self.core.counting():
                self.core.stats.loads_timed_out += 1
            logger.warning(
                "load %r had no answer after %.1f s; reported failed (recompute)",
                job.job_id,
                self.timeout_s,
            )

    def abandon(self, status: Status) -> int:
        with self._pending_lock:
            jobs = list(self.pending.values())
        return len(self._abandon(jobs, status, block=True))

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
                self._finish_locked(job, dict.fromkeys((c.key for c in job.chunks), status))
                out.append(job)
            finally:
                job.lock.release()
        return out

    def finish(self, job: Job, statuses: dict[str, Status]) -> None:
        """Publish ``job``'s result unless it was published already (timed out)."""
        with job.lock:
            if not job.reported:
                self._finish_locked(job, statuses)

    def _finish_locked(self, job: Job, statuses: dict[str, Status]) -> None:
        core = self.core
        job.reported = True
        with self._pending_lock:
            self.pending.pop(id(job), None)
        invalid: set[int] = set()
        ok_all = all_ok(statuses)
        if ok_all:
            ok_chunks: Sequence[ChunkRef] = job.chunks
        else:
            first = min(c.chunk for c in job.chunks if not statuses[c.key].ok)
            for c in job.chunks:
                if c.chunk >= first:
                    invalid.update(c.block_ids)
            ok_chunks = [c for c in job.chunks if statuses[c.key].ok]
        nbytes = sum(core.sizes(ok_chunks))
        seconds = time.monotonic() - (job.started or job.submitted)
        with core.counting():
            core.stats.load_s += seconds
            core.stats.chunks_loaded += len(ok_chunks)
            core.stats.bytes_loaded += nbytes
            if not ok_all:
                core.stats.failures.update(s.value for s in statuses.values() if not s.ok)
        core.publish(
            JobResult(
                job.job_id,
                "load",
                statuses,
                frozenset(invalid),
                0,
                nbytes,
                seconds,
            )
        )

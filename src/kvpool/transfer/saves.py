"""The save path: stage a job's chunks piece by piece, put each piece, free it.

    Saves(core, arena, budget, wait_s, backoff_s, zero_copy, enqueue, backlog,
          stage_later=None)
    submit(job_id, chunks)   the caller's thread: skip keys stored recently or being
                             put by another job, queue the job, then stage it piece
                             by piece (waiting while puts free staging), or hand it
                             to ``stage_later`` (the stage thread then calls
                             ``stage``); False when some of it was refused by then
    stage(job)               copy a queued job's blocks into staging, piece by piece
    reading(job_ids)         those jobs that may still read KV blocks (zero copy:
                             until they end; ``stage_later``: until staged)
    wait_reads(job_ids)      block until none of them reads KV blocks
    run(job)                 the save thread: put each piece once staged, free its
                             staging, remember what is stored, publish the result
    in_backpressure          saves are refused until a put failure's back-off ends

Rules (the contract is ``kvpool.transfer.engine``'s): a staged save reads KV
blocks only inside ``stage``: within ``submit``, or on the stage thread with
``stage_later`` (the caller then keeps the blocks until the job ended, as for zero
copy, and the forward never waits for a copy); a wait for a piece's space that does not end
within ``wait_s`` refuses the rest of the job ("staging_busy") and later saves
refuse at once until a put frees staging;
zero-copy saves (no staging bounds them) refuse past ``ZERO_COPY_BACKLOG`` queued
jobs ("queue_full"); NO_SPACE,
TRANSFER_FAILED or UNAVAILABLE on a put starts a growing back-off
("backpressure"). Refusals are counted per cause
and logged at most once a minute per cause, saying what to change.

A full pool: Mooncake answers a put that finds no free memory NO_SPACE and starts
an eviction (its eviction thread looks every 10 ms; measured here, a put retried
10-20 ms later lands). So the save thread puts NO_SPACE objects again, with a
growing pause, for up to ``FULL_RETRY_S``, still holding their staging (which
slows the engine's saves as a full pool should, rather than dropping them); only
what is still refused then is dropped, counted (``failures["no_space"]``) and
logged with what to change. ``puts_no_space`` counts objects that met a full
pool at least once.

Duplicates: a key that another save job of this engine is putting (claimed at its
submit, until it finished) is skipped, as a key stored recently is, but is not
reported stored: the job putting it reports it. Without this, every request that
hits a prefix in vLLM's local cache while that prefix's save is still queued put
it again (a local hit saves its whole prompt: the pool may have lost it).

Eviction order: Mooncake evicts the objects whose last put or read is oldest
first, and the objects of one put call in the order given. A put call lists its
objects last chunk first (all of a chunk's shards together), so a prompt that is
partly evicted loses its end and keeps a usable prefix: in the order of the
staging (a group's chunks in a row) it lost its first chunks, and so all of it.
(Under load Mooncake was seen to evict a call's objects from anywhere in it.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence

from kvpool.store.base import Status
from kvpool.store.scatter import Segments, take
from kvpool.transfer import pieces
from kvpool.transfer.arena import StagingArena
from kvpool.transfer.records import ChunkRef, Job, JobResult, Piece
from kvpool.transfer.shared import Shared

__all__ = ["NOTE_INTERVAL_S", "Saves"]

logger = logging.getLogger("kvpool.transfer.engine")

NOTE_INTERVAL_S = 60.0  # one log line per refusal cause at most this often
FULL_RETRY_S = 2.0  # a put refused for lack of space goes again for this long
FULL_PAUSE_S = (0.01, 0.2)  # first and longest pause between those puts
ZERO_COPY_BACKLOG = 64  # zero-copy save jobs queued at most (a flush waits behind them)

_ADVICE = {
    "staging_busy": "the pool freed no save staging for {wait:.1f} s; raise staging_bytes "
    "if the pool is healthy but slower than the engine",
    "backpressure": "puts failed recently and saves back off (see the warning before)",
    "staging_error": "copying KV blocks into staging failed (see the error before)",
    "queue_full": f"{ZERO_COPY_BACKLOG} zero-copy saves are queued: the pool is slower "
    "than the engine",
    "no_space": f"the pool stayed full for {FULL_RETRY_S:.0f} s: nothing in it could be "
    "evicted (every object read or looked up within the pool's lease TTL, or pinned); "
    "give the pool more memory or lower kvpool up --lease-ttl-ms",
}


class Saves:
    """See the module docstring."""

    def __init__(
        self,
        core: Shared,
        arena: StagingArena,
        budget: int,
        wait_s: float,
        backoff_s: tuple[float, float],
        zero_copy: bool,
        enqueue: Callable[[Job], None],
        backlog: Callable[[], int] = lambda: 0,
        stage_later: Callable[[Job], None] | None = None,
    ) -> None:
        self.core = core
        self.enqueue = enqueue  # hands a job to the save thread
        self.moved: Callable[[], None] = lambda: None  # a piece was staged or put
        self.stage_later = stage_later  # hands a job to the stage thread (None: stage now)
        self.backlog = backlog  # save jobs queued now
        self.arena = arena
        self.budget = budget
        self._pins_taken = True  # the store's batch_put takes pin_ms (until it says not)
        self.wait_s = wait_s
        self.zero_copy = zero_copy
        self._stuck_at: int | None = None  # arena.frees when a wait for space ran out
        self._backoff = backoff_s
        self._backoff_next = backoff_s[0]
        self._pressure_until = 0.0
        self._noted: dict[str, tuple[float, int]] = {}  # cause -> (last log, chunks since)
        self._staged = threading.Condition()  # a job's staging progress (Job.staged)
        self._reading: set[Hashable] = set()  # jobs that may still read KV blocks

    @property
    def in_backpressure(self) -> bool:
        return time.monotonic() < self._pressure_until

    # -- the caller's thread ---------------------------------------------------------

    def submit(self, job_id: Hashable, chunks: Sequence[ChunkRef]) -> bool:
        """Stage ``chunks``, the job queued for the put thread before its first piece
        is staged; False if some were refused."""
        core = self.core
        job = Job(job_id, "save", [], time.monotonic())
        putting = 0
        with core.known_lock:
            for c in sorted(chunks, key=lambda c: (c.group, c.chunk)):
                if c.key in core.known:
                    job.known.append(c.key)
                elif c.key in core.putting:
                    putting += 1
                else:
                    job.chunks.append(c)
            job.claimed = tuple(c.key for c in job.chunks)
            core.putting.update(job.claimed)
        job.skipped = len(job.known) + putting
        with core.counting():
            core.stats.saves_submitted += 1
            core.stats.chunks_skipped_known += len(job.known)
            core.stats.chunks_skipped_putting += putting
        if not job.chunks:
            self.finish(job, {})
            return True
        if self.in_backpressure:
            self._refuse(job, 0, "backpressure")
            self.finish(job, {})
            return False
        job.pieces = pieces.cut(core.sizes(job.chunks), self.budget)
        if self.zero_copy:  # put straight from the KV tensors
            if self.backlog() >= ZERO_COPY_BACKLOG:  # nothing else bounds it: no staging
                self._refuse(job, 0, "queue_full")
                self.finish(job, {})
                return False
            job.staged = [Piece(job, lo, hi, last=False) for lo, hi in job.pieces]
            with self._staged:
                self._reading.add(job_id)  # until the job ends
            self.enqueue(job)
            return True
        self.enqueue(job)  # queued first: its first put starts once a piece is in
        if self.stage_later is not None:
            with self._staged:
                self._reading.add(job_id)  # until ``stage`` ends
            self.stage_later(job)
            return True
        return self.stage(job)

    def reading(self, job_ids: Iterable[Hashable]) -> set[Hashable]:
        with self._staged:
            return self._reading.intersection(job_ids)

    def wait_reads(self, job_ids: Iterable[Hashable]) -> None:
        want = set(job_ids)
        with self._staged:
            while self._reading & want:
                self._staged.wait()

    def _read_done(self, job_id: Hashable) -> None:
        with self._staged:
            if job_id in self._reading:
                self._reading.discard(job_id)
                self._staged.notify_all()

    def stage(self, job: Job) -> bool:
        """Copy ``job``'s pieces into staging in turn, each handed to the save thread
        as it is in; False when the rest was refused (counted, and the save thread
        finishes the job)."""
        try:
            return self._stage_pieces(job)
        finally:
            self._read_done(job.job_id)  # its blocks are read (or never will be)

    def _stage_pieces(self, job: Job) -> bool:
        for lo, hi in job.pieces:
            try:
                piece = self._stage(job, lo, hi)
            except Exception:  # a bug: the put thread must still learn where staging ended
                logger.exception("kvpool: staging a save failed; the rest is refused")
                piece = "staging_error"
            with self._staged:
                if isinstance(piece, str):  # refused from here on; the put thread finishes
                    self._refuse(job, lo, piece)
                else:
                    job.staged.append(piece)
                self._staged.notify_all()
            if isinstance(piece, str):
                return False
        return True

    @property
    def stuck(self) -> bool:
        """A wait for staging ran out and nothing was freed since (by a put, or by
        whoever else held staging): a save now is refused at once."""
        return self._stuck_at is not None and self._stuck_at == self.arena.frees

    def _stage(self, job: Job, lo: int, hi: int) -> Piece | str:
        """Reserve staging for ``job.chunks[lo:hi]`` and copy their blocks in; the
        reason when refused instead."""
        chunks = job.chunks[lo:hi]
        offsets, extent = pieces.place([c.group for c in chunks], self.core.sizes(chunks))
        start = self.arena.alloc(extent)
        if start is None and not self.stuck:  # wait while puts free space
            t0 = time.monotonic()
            start = self.arena.alloc(extent, wait=True, timeout=self.wait_s)
            with self.core.counting():
                self.core.stats.save_wait_s += time.monotonic() - t0
            self._stuck_at = self.arena.frees if start is None else None
        if start is None:
            return "staging_busy"
        piece = Piece(job, lo, hi, last=False, staging=start)
        piece.offsets = [start + o for o in offsets]
        try:
            self.core.copier.gather(chunks, piece.offsets)
        except Exception:
            logger.exception("kvpool: copying KV blocks into staging failed; save refused")
            self.arena.free(start)
            return "staging_error"
        self.moved()
        return piece

    def _refuse(self, job: Job, lo: int, reason: str) -> None:
        """Count chunks ``lo:`` of a save as refused for ``reason`` (never put)."""
        rest = job.chunks[lo:]
        job.refused = reason
        job.skipped += len(rest)
        job.chunks = job.chunks[:lo]
        job.refused_from = min(c.chunk for c in rest)
        with self.core.counting():
            self.core.stats.saves_refused[reason] += 1
            self.core.stats.chunks_refused[reason] += len(rest)
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
        advice = _ADVICE.get(reason, reason).format(wait=self.wait_s)
        logger.warning("kvpool: %d chunk(s) not saved (%s): %s", count, reason, advice)

    # -- the save thread ---------------------------------------------------------------

    def run(self, job: Job) -> None:
        """Put each piece once the caller has staged it, then free its staging."""
        core = self.core
        statuses: dict[str, Status] = {}
        put: list[Status] = []
        nbytes = 0
        ok, exists = Status.OK, Status.EXISTS
        for n in range(len(job.pieces)):
            piece = self._wait_staged(job, n)
            if piece is None:  # the caller refused the rest (counted there)
                break
            chunks = job.chunks[piece.lo : piece.hi]
            sizes = core.sizes(chunks)
            # zero copy: straight from the KV tensors
            segs = core.kv_segments(chunks) if self.zero_copy else core.staged(piece.offsets, sizes)
            # Last chunk first (see the module docstring: the order of eviction).
            order = pieces.last_first(chunks)
            keys = [chunks[i].key for i in order]
            try:
                got = self._put([chunks[i] for i in order], keys, take(segs, order))
            finally:
                if piece.staging is not None:
                    self.arena.free(piece.staging)
            self.moved()
            statuses.update(zip(keys, got, strict=True))
            sizes = [sizes[i] for i in order]
            if got.count(ok) == len(got):
                nbytes += sum(sizes)
            else:
                nbytes += sum(n for n, st in zip(sizes, got, strict=True) if st is ok)
            put += got
        done, dup = put.count(ok), put.count(exists)
        clean = done + dup == len(put)  # every put stored: no per-chunk pass below
        core.remember(statuses if clean else (k for k, s in statuses.items() if s.stored))
        pressing = (Status.NO_SPACE, Status.TRANSFER_FAILED, Status.UNAVAILABLE)
        trouble = None if clean else next((s for s in put if s in pressing), None)
        if trouble is not None:
            self._enter_backpressure(trouble)
        elif put:
            self._backoff_next = self._backoff[0]
        with core.counting():
            core.stats.chunks_skipped_exist += dup
            core.stats.chunks_put += done
            core.stats.bytes_put += nbytes
            if not clean:
                core.stats.failures.update(s.value for s in put if not s.stored)
        self.finish(job, statuses, nbytes)

    def _put(
        self, chunks: Sequence[ChunkRef], keys: list[str], segs: Sequence[Segments]
    ) -> list[Status]:
        """One piece's puts; objects refused for lack of space go again while the
        pool evicts, for up to ``FULL_RETRY_S``."""
        core = self.core
        pins = [c.pin_ms for c in chunks]
        got = self._batch_put(keys, segs, pins)
        todo = [i for i, st in enumerate(got) if st is Status.NO_SPACE]
        if not todo:
            return got
        with core.counting():
            core.stats.puts_no_space += len(todo)
        t0 = time.monotonic()
        pause = FULL_PAUSE_S[0]
        while todo and time.monotonic() - t0 + pause <= FULL_RETRY_S:
            time.sleep(pause)  # Mooncake's eviction runs on its own clock: nothing to await
            pause = min(FULL_PAUSE_S[1], pause * 2)
            again = self._batch_put(
                [keys[i] for i in todo], take(segs, todo), [pins[i] for i in todo]
            )
            for i, st in zip(todo, again, strict=True):
                got[i] = st
            todo = [i for i in todo if got[i] is Status.NO_SPACE]
        with core.counting():
            core.stats.full_wait_s += time.monotonic() - t0
        if todo:
            self._note("no_space", len({chunks[i].chunk for i in todo}))
        return got

    def _batch_put(
        self, keys: list[str], segs: Sequence[Segments], pins: list[int]
    ) -> list[Status]:
        """One store call per pin among ``pins`` (one, but for a job of several
        requests' retries); a status per key, in order."""
        store = self.core.store

        def put(ks: list[str], ss: Sequence[Segments], pin: int) -> list[Status]:
            # No pin: the two-argument call every store takes; a store of another
            # package whose batch_put takes no pin stores unpinned (said once).
            if pin and self._pins_taken:
                try:
                    return store.batch_put(ks, ss, pin_ms=pin)
                except TypeError as exc:
                    if "pin_ms" not in str(exc):
                        raise
                    self._pins_taken = False
                    logger.warning(
                        "kvpool: %s.batch_put takes no pin_ms: pinned saves go unpinned",
                        type(store).__name__,
                    )
            return store.batch_put(ks, ss)

        try:
            if len(set(pins)) <= 1:
                got = put(keys, segs, pins[0] if pins else 0)
            else:
                got = [Status.UNAVAILABLE] * len(keys)
                for pin in set(pins):
                    idx = [i for i, p in enumerate(pins) if p == pin]
                    part = put([keys[i] for i in idx], take(segs, idx), pin)
                    for i, st in zip(idx, part, strict=True):
                        got[i] = st
            if len(got) != len(keys):
                raise RuntimeError(f"{len(got)} statuses for {len(keys)} keys")
        except Exception:  # a bug: this piece fails, the later ones are still freed
            logger.exception("kvpool: a put failed")
            got = [Status.UNAVAILABLE] * len(keys)
        return got

    def _wait_staged(self, job: Job, n: int) -> Piece | None:
        """Piece ``n`` of ``job`` once it is staged; None if it was refused."""
        with self._staged:
            while len(job.staged) <= n and not job.refused:
                self._staged.wait()
            return job.staged[n] if len(job.staged) > n else None

    def _enter_backpressure(self, cause: Status) -> None:
        delay = self._backoff_next
        self._backoff_next = min(self._backoff[1], delay * 2)
        self._pressure_until = time.monotonic() + delay
        with self.core.counting():
            self.core.stats.backpressure_events += 1
        logger.warning(
            "kvpool: pool put failed (%s); skipping saves for %.1f s", cause.value, delay
        )

    def finish(self, job: Job, statuses: dict[str, Status], nbytes: int = 0) -> None:
        self._read_done(job.job_id)  # zero copy: read until now
        with self.core.known_lock:  # after ``run``'s remember: no gap for a duplicate
            self.core.putting.difference_update(job.claimed)
        skipped = job.skipped + list(statuses.values()).count(Status.EXISTS)
        self.core.publish(
            JobResult(
                job.job_id,
                "save",
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

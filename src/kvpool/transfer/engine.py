"""TransferEngine: moves chunk objects between this rank's KV tensors and the pool.

    TransferEngine(store, groups, num_blocks)  describe the KV tensors (``kvcache``),
                                   register each distinct allocation once
    submit_save(job_id, chunks)    stage the chunks' blocks piece by piece *now*
                                   (``deferred_saves``: on the stage thread, the
                                   caller's step not held) and put each piece on a
                                   background thread as soon as it is staged; False
                                   when some of the job was refused by then (its
                                   result says which chunks)
    reads_blocks_until_done        a save may read its blocks after ``submit_save``
                                   returned (zero copy: until its job ended;
                                   deferred saves: until staged): the caller keeps
                                   them until then
    reading(job_ids) / wait_reads(job_ids)
                                   the save jobs that may still read KV blocks /
                                   block until none does
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
    wait_loads(job_ids)            block until those loads finish, staged ones at
                                   most ``load_timeout_s`` (then TIMED_OUT)
    saves_blocked                  a save now would be refused at once
    abandon_loads()                report every unfinished staged load failed now
    close()                        stop the threads after the queued jobs

With ``save_priority="idle"`` the save and stage threads run under Linux's
``SCHED_IDLE``, raised to normal priority while saves starve (``priority``): a save
takes CPU time the engine's forward and scheduling do not want.

With ``prefault`` (the connector's workers), a store that moves bytes through its
own memory (Mooncake's shared memory) touches all of it, staging and a zero-copy KV
cache, at start (``KVStore.prefault``, reads only; construction waits up to
``PREFAULT_WAIT_S``, then it goes on in the background; ``prefaulted`` is set when
it ended): a fresh engine's first loads run at full speed.

Any job size moves through bounded staging (``pieces``): staging is split between
saves and staged loads, each piece reserves only its own bytes and releases them
when its put (or its copy into the KV tensors) is done. A staged load's pieces
are got one after another on the load thread, while the scatter thread checks the
previous piece's payloads (the checksums the get left it, ``batch_get_deferred``)
and copies them into the KV tensors. A save bigger than its
staging waits, inside ``submit_save`` (deferred: on the stage thread), for earlier
pieces' puts to free space: the
staging size sets speed, not whether a chunk is saved. A wait for a piece's space
that does not end within ``save_wait_s`` (the pool stopped taking puts) refuses
the rest of the job ("staging_busy", retryable) and later saves refuse at once,
without waiting, until a put frees space again.
Zero-copy saves refuse past 64 queued jobs ("queue_full"). Objects must fit the
staging (checked at start).

Zero copy (``zero_copy=True``): the store moves bytes straight between the KV
tensors and the pool; the KV tensors must lie in memory it reaches
(``KVStore.reaches``; on Mooncake's shared memory, ``kvpool.placement``). Loads
are direct, with no deadline; a save reads its blocks until its job finished.

Guarantees:

* A staged save reads KV blocks only inside ``submit_save``: once it returns, the
  blocks may be reused; the pool gets the bytes they held at submit time (or
  nothing). Zero copy: until the job finished instead; ``deferred_saves``: until
  its staging ended, on the stage thread, so no copy of a save runs on the
  caller's step (``reads_blocks_until_done``, ``reading``: the caller keeps the
  blocks meanwhile, as vLLM lets a connector keep a finished request's blocks
  until its saves are done).
* A refused chunk is never put and never reported stored: ``JobResult.refused``
  names the cause and ``refused_from`` the lowest chunk index refused (a job
  moves in (group, chunk) order and is refused from some point of it on, so
  chunks of earlier groups above that index may have been put); ``retry`` says
  whether submitting it again may succeed. Refusals are counted by cause and
  logged (one line per cause and minute, with what to change); they never read
  as a store failure.
* A load job reports, in ``JobResult.invalid_block_ids``, the blocks of every chunk
  that failed (missing, evicted, corrupt, transfer failure, refused) and of every
  later chunk of the job, so the engine recomputes exactly those.
* In staged load mode, bytes reach the KV tensors only after their header and
  checksum were verified, and never after the job was reported (TIMED_OUT).
* A CORRUPT object (header or checksum mismatch) is removed from the pool, never
  forced: once the leases of its readers (this one's get included) end.
* NO_SPACE, TRANSFER_FAILED or UNAVAILABLE on a put switch saves into
  backpressure: further saves are refused until a growing back-off expires.
* Nothing raises into the caller for store faults; they become statuses.

The caller decides which chunks this rank writes (``layout.Layout.writes``);
chunks whose keys were stored (or loaded) recently are skipped without a store
round trip; the rest are put without asking first (a duplicate put keeps the old
value and costs Mooncake no bytes moved, so an exists check cost more than it saved).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Literal

import torch

from kvpool.kvcache import GroupKV, describe_group
from kvpool.store.base import KVStore, Status
from kvpool.transfer import pieces
from kvpool.transfer.arena import StagingArena
from kvpool.transfer.copies import KVCopier
from kvpool.transfer.loads import Loads
from kvpool.transfer.priority import SaveThreads
from kvpool.transfer.records import ChunkRef, Job, JobResult, Piece, TransferStats
from kvpool.transfer.saves import Saves
from kvpool.transfer.shared import Shared

__all__ = ["LOAD_PIECE_BYTES", "PIECE_BYTES", "TransferEngine"]

logger = logging.getLogger(__name__)

PIECE_BYTES = 16 << 20  # Mooncake pays ~0.4 ms per batch call: pieces stay large
# A staged load's largest piece: 32 MiB loaded 1000 MiB 8-10% sooner than 16 MiB
# (fewer batch calls), 64 MiB no sooner (measured, shared memory, checksums on).
# Smaller jobs move in smaller pieces (``pieces.job_budget``).
LOAD_PIECE_BYTES = 32 << 20
# What construction waits for the prefault (~60 ms a GiB of staging and zero-copy KV
# cache on a quiet host): an engine is ready with it done, so a holder lost after
# that never stalls a prefault put ahead of the loads. Longer, it goes on meanwhile.
PREFAULT_WAIT_S = 10.0


class TransferEngine:
    """See the module docstring. One engine per worker rank; its saves are
    ``kvpool.transfer.saves``, its loads ``kvpool.transfer.loads``."""

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
        load_piece_bytes: int = LOAD_PIECE_BYTES,
        zero_copy: bool = False,
        blocks_per_object: int = 1,
        save_wait_s: float = 1.0,
        prefault: bool = False,
        deferred_saves: bool = False,
        save_priority: Literal["idle", "normal"] = "normal",
    ) -> None:
        if min(piece_bytes, load_piece_bytes) < 1:
            raise ValueError(f"piece sizes must be >= 1, got {piece_bytes}, {load_piece_bytes}")
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
        staged_loads = self.load_mode == "staged"
        save_bytes, load_bytes = pieces.split_staging(staging.numel(), staged_loads)
        largest = max(spec.object_nbytes(blocks_per_object) for spec in self.groups)
        if not zero_copy:
            pieces.check_fits(largest, save_bytes, "saves")
        if staged_loads:
            pieces.check_fits(largest, load_bytes, "loads")
        n = len(self.groups)
        save_budget = pieces.piece_budget(piece_bytes, save_bytes, n)
        load_budget = pieces.piece_budget(load_piece_bytes, load_bytes, n)
        if zero_copy:  # no staging: pieces only bound the size of one store call
            save_budget, load_budget = piece_bytes, load_piece_bytes
        self._copier = KVCopier(self.groups, groups, staging)
        self._core = Shared(store, self.groups, self._copier, int(staging.data_ptr()), known_keys)
        self._save_arena = StagingArena(save_bytes)
        self._load_arena = StagingArena(load_bytes)
        # Unbounded: a staged save's bytes are in staging before it is queued, and
        # loads are bounded by the requests waiting for them.
        self._save_q: queue.Queue[Job | None] = queue.Queue()
        self._save_threads = SaveThreads(save_priority)  # their CPU priority
        self._stage_q: queue.Queue[Job | None] = queue.Queue()  # deferred saves
        self._load_q: queue.Queue[Job | None] = queue.Queue()
        self.deferred_saves = deferred_saves and not zero_copy
        scatter_q: queue.Queue[Piece | None] = queue.Queue()
        self._saves = Saves(
            self._core,
            self._save_arena,
            save_budget,
            save_wait_s,
            backoff_s,
            zero_copy,
            self._queue_save,
            self._save_q.qsize,
            self._queue_stage if self.deferred_saves else None,
        )
        self._loads = Loads(
            self._core,
            self._load_arena,
            save_bytes,
            load_budget,
            self.load_mode,
            load_timeout_s,
            self._load_q.put,
            scatter_q,
        )
        if load_timeout_s is not None and not staged_loads:
            logger.info("direct loads cannot be abandoned: load_timeout_s is not enforced")
        self._saves.moved = self._save_threads.moved
        self._threads = [
            threading.Thread(
                target=self._loop,
                args=(self._save_q, self._saves.run, self._saves.finish, self._save_threads),
                name="kvpool-save",
            ),
            threading.Thread(
                target=self._loop,
                args=(self._load_q, self._loads.run, self._loads.finish),
                name="kvpool-load",
            ),
            threading.Thread(target=self._loads.scatter_loop, name="kvpool-scatter"),
            threading.Thread(target=self._stage_loop, name="kvpool-stage"),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()
        self._closed = False
        self.prefaulted = threading.Event()
        spans = [(int(staging.data_ptr()), staging.numel())] if staging.numel() else []
        if zero_copy:
            spans += sorted({r.base: r.nbytes for g in self.groups for r in g.regions}.items())
        if prefault and spans and store.requires_staging:
            self._prefault(store, spans)
        else:
            self.prefaulted.set()

    def _prefault(self, store: KVStore, spans: list[tuple[int, int]]) -> None:
        """Have the store touch ``spans`` (staging; the KV tensors with zero copy) on
        a thread (``KVStore.prefault``, which only reads), waiting up to
        ``PREFAULT_WAIT_S`` for it: transfers may go on meanwhile, and one that meets
        a page not touched yet only pays for its fault. ``prefaulted`` is set when
        it ended."""

        def touch() -> None:
            t0 = time.monotonic()
            try:
                done = [store.prefault(addr, nbytes) for addr, nbytes in spans]
            finally:
                self.prefaulted.set()
            logger.debug(
                "kvpool: %.0f MiB prefaulted (%s) in %.0f ms",
                sum(n for _, n in spans) / 2**20,
                all(done),
                (time.monotonic() - t0) * 1e3,
            )

        thread = threading.Thread(target=touch, name="kvpool-prefault", daemon=True)
        thread.start()
        thread.join(PREFAULT_WAIT_S)

    # -- public --------------------------------------------------------------------

    def submit_save(self, job_id: Hashable, chunks: Sequence[ChunkRef]) -> bool:
        """Stage ``chunks`` (now, or on the stage thread with ``deferred_saves``) and
        queue their puts; False if some were refused by the time it returns."""
        return self._saves.submit(job_id, chunks)

    @property
    def reads_blocks_until_done(self) -> bool:
        """A save may read its KV blocks after ``submit_save`` returned (zero copy,
        deferred saves): the caller keeps them while ``reading`` lists its job."""
        return self.zero_copy or self.deferred_saves

    def reading(self, job_ids: Iterable[Hashable]) -> set[Hashable]:
        """The save jobs of ``job_ids`` that may still read KV blocks (zero copy:
        until they end; deferred saves: until their staging ended)."""
        return self._saves.reading(job_ids)

    def wait_reads(self, job_ids: Iterable[Hashable]) -> None:
        """Block until none of ``job_ids`` reads KV blocks (see ``reading``)."""
        self._saves.wait_reads(job_ids)

    def submit_load(self, job_id: Hashable, chunks: Sequence[ChunkRef]) -> None:
        """Queue a load of ``chunks`` (always accepted)."""
        self._loads.submit(job_id, chunks)

    def poll(self) -> list[JobResult]:
        """Finished jobs since the last poll, oldest first; never blocks."""
        self._loads.abandon_late()
        return self._core.take()

    def wait_any(self, timeout: float) -> bool:
        """Block until some job finished (its result waits for ``poll``) or ``timeout``
        seconds passed; whether a result is ready."""
        return self._core.wait_any(timeout)

    def wait(self, job_ids: Iterable[Hashable], timeout: float | None = None) -> list[JobResult]:
        """Block until every job in ``job_ids`` finished (or ``timeout``); return those.

        Results of other jobs stay queued for ``poll``.
        """
        return self._core.wait(job_ids, timeout)

    def wait_loads(self, job_ids: Iterable[Hashable]) -> list[JobResult]:
        """``wait`` for loads, reporting staged ones past ``load_timeout_s`` as
        TIMED_OUT meanwhile (as ``poll`` does); without a deadline (or direct) as
        long as the store takes."""
        want = set(job_ids)
        got: list[JobResult] = []
        step = None if self._loads.timeout_s is None else 0.05
        while want:
            done = self._core.wait(want, step)
            got += done
            want -= {r.job_id for r in done}
            self._loads.abandon_late()
        return got

    @property
    def can_abandon(self) -> bool:
        """Loads can be reported early (staged mode): see ``abandon_loads``."""
        return self.load_mode == "staged"

    def abandon_loads(self, status: Status = Status.UNAVAILABLE) -> int:
        """Report every unfinished staged load as failed with ``status`` now (for
        ``poll``), e.g. before this engine is replaced; their gets may still run but
        copy nothing. Direct loads cannot be abandoned. Returns how many."""
        return self._loads.abandon(status)

    def forget(self, keys: Iterable[str]) -> None:
        """Drop keys from the recently-stored set (e.g. after a failed load of them)."""
        self._core.forget(keys)

    def stats(self) -> TransferStats:
        return self._core.snapshot()

    @property
    def stats_version(self) -> int:
        """Changes whenever ``stats()`` would: callers polling every engine step skip
        building a snapshot while it stays the same."""
        return self._core.version

    @property
    def in_backpressure(self) -> bool:
        return self._saves.in_backpressure

    @property
    def saves_blocked(self) -> bool:
        """A save submitted now would be refused at once: back-off after a failed
        put, or staging still full since a wait for it ran out."""
        return self._saves.stuck or self._saves.in_backpressure

    @property
    def queue_depth(self) -> int:
        return self._save_q.qsize() + self._load_q.qsize()

    def close(self) -> None:
        """Finish queued jobs, stop the threads (staging belongs to the store)."""
        if self._closed:
            return
        self._closed = True
        for q in (self._stage_q, self._save_q, self._load_q):
            q.put(None)
        for thread in (self._threads[3], *self._threads[:2]):  # staged before put
            thread.join()
        self._loads.scatter_q.put(None)  # after the load thread's last piece
        self._threads[2].join()
        self._save_threads.close()

    # -- background threads -------------------------------------------------------

    def _stage_loop(self) -> None:
        """The stage thread (deferred saves): copy each queued job's blocks into
        staging; ``Saves.stage`` refuses, never raises, on a copy that fails."""
        self._save_threads.enter()
        while (job := self._stage_q.get()) is not None:
            try:
                self._saves.stage(job)
            finally:
                self._save_threads.done()

    def _queue_save(self, job: Job) -> None:
        self._save_threads.queued()
        self._save_q.put(job)

    def _queue_stage(self, job: Job) -> None:
        self._save_threads.queued()
        self._stage_q.put(job)

    @staticmethod
    def _loop(
        q: queue.Queue[Job | None],
        run: Callable[[Job], None],
        fail: Callable[[Job, dict[str, Status]], None],
        save_threads: SaveThreads | None = None,
    ) -> None:
        """A save or load thread: run each job; a bug fails the job, never the thread."""
        if save_threads is not None:
            save_threads.enter()
        while (job := q.get()) is not None:
            try:
                run(job)
            except Exception:  # a bug here must not kill the thread or hang the engine
                logger.exception("transfer job %r failed", job.job_id)
                fail(job, dict.fromkeys((c.key for c in job.chunks), Status.UNAVAILABLE))
            finally:
                if save_threads is not None:
                    save_threads.done()

"""The worker half of the connector: turns each step's plan into transfer jobs.
(A little over 500 lines: one worker's session, from open to reopen, and its steps.)

    Worker(identity, rank, settings, pool, kv_cache_config, open_store, events,
           layer_index=layer_number, new_report=WorkerReport)
        ``layer_index(name)``: a KV layer's model layer index (for layer bands);
        ``new_report``: the record ``worker_meta`` returns. ``kvpool.vllm.worker``
        gives vLLM's.

    Worker.register(kv_caches)  describe the KV tensors per group and open the
        pool (a FramedStore over Mooncake) and the TransferEngine; a pool that
        cannot be reached leaves the worker idle (every load then fails fast)
    Worker.start_loads(meta)    queue this step's loads (background); a load by
        layer (``RequestOps.by_layer``) as one job per layer band, first band first
    Worker.wait_layer(name)     before the forward reads KV layer ``name``: this
        step's loads by layer of its band and those before it have ended (their
        failures go to ``load_errors``, never to ``finished``); "" waits for all
    Worker.start_saves(meta)    queue saves of the chunks this rank writes (the
        layout's striping rule): staged on the transfer engine's stage thread
        while vLLM keeps a finished request's blocks for its saves (no KV events,
        every group keeps a running request's blocks), else staged here; then
        submit again the objects of saves refused for local pressure (staging
        busy), unless saves are still blocked; called after the forward
    Worker.flush_saves(freed)   zero copy, deferred saves: wait for the saves still
        reading blocks of requests that finished or were preempted (before the
        next forward)
    Worker.finished(idle)       (finished loads, failed loads) by request id;
        in an idle step it first blocks up to IDLE_WAIT_S (on its transfers, or
        asleep when it has none: no rank spins while another's transfer runs)
    Worker.load_errors()        block ids to recompute, reported no later than
        the step that returns their request as finished (none with several KV
        groups: failures go by request then, ``connector.results``)
    Worker.results(plan)        the step's ``StepResults`` for vLLM: ``finished``
        (idle when ``plan`` is) and ``released``
    Worker.released()           finished requests whose blocks vLLM kept
        (``meta.finishing``) and whose saves are now done: no save job in flight
        and no refused object left to retry, or retries given up after
        ``drain.DRAIN_LIMIT_S``; each reported once (vLLM's finished sending)
    Worker.step_began()         the forward is about to run (vLLM binds the
        step's plan): the forward's time is taken from here to ``start_saves``,
        less the time spent in this worker meanwhile
    Worker.saves_put            a ``threading.Event`` set once ``close`` has put
        every save queued (the transfer engine closed), before the store's own
        close (a client of HA masters takes ~30 s): what a process that exits
        right after its engine's shutdown waits for
    Worker.worker_meta()        chunk hashes that failed to load, for the
        scheduler's lookup suppression; (``events``) the objects per chunk hash
        that this worker's saves put in the pool; and the time of this step's
        forward (``kvpool.connector.costs``)

A request whose load finished is always reported finished, failed or not.

Zero copy (setting ``zero_copy``): at the first open the KV tensors move into the
store's shared memory (``kvpool.placement``) and the transfer engine puts and gets
them in place. That store is kept open until ``close`` (the KV cache lives in its
memory); a reopened store cannot reach it, so the new engine stages. Direct loads
cannot be abandoned, so a zero-copy worker does not reconnect.

Reconnect: a job whose every key came back UNAVAILABLE means the store client
itself may be dead (a same-host shared-memory client whose holder was killed
never recovers by itself). The worker then reports its unfinished loads failed,
retires the store and transfer engine (closed on a background thread), and opens
new ones on a background thread, retrying with a growing back-off; meanwhile
loads fail fast and saves are skipped. A worker whose pool was unreachable at
start stays idle (so does the scheduler's lookup service).

HA masters (``etcd://`` master address): a dead leader also answers UNAVAILABLE,
but Mooncake's client follows the new leader by itself (~10 s), and a reconnect
in the middle of a failover only starts over against a master that is not ready.
So the worker reconnects only once every job has come back UNAVAILABLE for
``HA_RECONNECT_AFTER_S``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kvpool.config import PoolConfig, is_ha
from kvpool.connector.counters import interval_empty, stats_delta
from kvpool.connector.drain import SaveBook
from kvpool.connector.identity import EngineIdentity
from kvpool.connector.results import StepResults, step_results
from kvpool.connector.shards import layer_number, shard_views
from kvpool.connector.steps import NULL_BLOCK, RequestOps, StepPlan, WorkerReport
from kvpool.errors import ConfigError, KVPoolError
from kvpool.layout import ContentId
from kvpool.placement import place_kv
from kvpool.settings import ConnectorSettings
from kvpool.store.base import KVStore, Status
from kvpool.transfer import ChunkRef, JobResult, TransferEngine, TransferStats

__all__ = ["IDLE_WAIT_S", "RECONNECT_BACKOFF_S", "Worker"]

logger = logging.getLogger(__name__)

RECONNECT_BACKOFF_S = (1.0, 30.0)  # first and longest wait between reconnects
HA_RECONNECT_AFTER_S = 20.0  # HA masters: UNAVAILABLE this long before a reconnect
UNAVAILABLE_STALL_S = 2.0  # a load failed UNAVAILABLE after this long stalled: suppressed
IDLE_WAIT_S = 0.01  # longest wait for a transfer in a step with nothing else to do


class Worker:
    """See the module docstring."""

    def __init__(
        self,
        identity: EngineIdentity,
        rank: int,
        settings: ConnectorSettings,
        pool: PoolConfig,
        kv_cache_config: Any,
        open_store: Callable[[PoolConfig], KVStore],
        events: bool = False,
        *,
        layer_index: Callable[[str], int] = layer_number,
        new_report: Callable[..., WorkerReport] = WorkerReport,
    ) -> None:
        self._layer_index = layer_index
        self._new_report = new_report
        self.identity = identity
        self.rank = rank
        self.settings = settings
        self.pool = pool
        self.kv_cache_config = kv_cache_config
        self._open_store = open_store
        self._ha = is_ha(pool.master_address)
        self._dead_since: float | None = None  # HA: since when every job was UNAVAILABLE
        self.engine: TransferEngine | None = None
        self.store: KVStore | None = None
        self.saves_put = threading.Event()
        self._local: dict[int, int] = {}  # vLLM group index -> index in _groups
        self._jobs = itertools.count()
        self._loads: dict[object, tuple[str, dict[str, bytes]]] = {}  # job -> (req, key->hash)
        self._forward: tuple[int, float] | None = None  # this step's (tokens, seconds)
        self._step_t0: float | None = None  # perf_counter at step_began
        self._own_s = 0.0  # time spent in this worker since step_began
        self._invalid: set[int] = set()
        self._failed_hashes: set[bytes] = set()
        self._events = events  # report stored chunks (for vLLM's KV events)
        self._saves: dict[object, dict[str, bytes]] = {}  # job -> key -> chunk hash
        self._stored: dict[bytes, int] = {}  # chunk hash -> objects stored
        self._fresh: set[bytes] = set()  # chunk hashes with an object put (not found)
        # Save jobs by request, refused objects to retry, finishing requests (set
        # up in ``register``, once the groups tell whether retries are allowed)
        self._book = SaveBook(retries=False)
        self._released: set[str] = set()  # to report as finished sending
        self._unfinished_without_engine: set[str] = set()
        # Loads by layer (``RequestOps.by_layer``): this step's jobs per layer band,
        # each waited for at the band's first layer; job -> (req, key -> hash).
        self._band_jobs: dict[int, list[object]] = {}
        self._layered: dict[object, tuple[str, dict[str, bytes]]] = {}
        self._band_of_layer: dict[str, int] = {}  # KV layer name -> its layer band
        self._band_of_group: dict[int, int] = {}  # engine group (shard view) -> band
        self._layered_done: list[JobResult] = []
        self._last_stats = TransferStats()
        self._last_version = -1  # of the engine that _last_stats came from
        self._retired = TransferStats()  # counters of replaced engines
        self._groups: list[list[tuple[str, torch.Tensor]]] = []
        # Per local group: (shard, engine group index, key template) for each shard this
        # rank holds (one per local KV head; the engine describes each head's view of
        # the tensors; a key is the template and a chunk hash's hex, ``KeySpace.template``).
        self._shards: dict[int, list[tuple[ContentId, int, str]]] = {}
        # zero_copy: the store whose memory holds the KV cache (kept open until
        # close: the KV tensors live there).
        self._kv_home: KVStore | None = None
        self._lock = threading.Lock()
        self._reopening = False  # a background open runs
        self._reopened: tuple[KVStore, TransferEngine] | None = None
        self._retry_at = 0.0
        self._backoff_s = RECONNECT_BACKOFF_S[0]

    # -- set-up ------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups: list[list[tuple[str, torch.Tensor]]] = []
        for g, spec in enumerate(self.kv_cache_config.kv_cache_groups):
            layers = [(n, kv_caches[n]) for n in spec.layer_names if n in kv_caches]
            if layers:  # a PP stage holds only its own layers
                self._local[g] = len(groups)
                groups.append(layers)
        if not groups:
            logger.warning("kvpool: no KV tensors on this worker; the connector stays idle")
            return
        devices = sorted({t.device.type for layers in groups for _, t in layers} - {"cpu"})
        if devices:  # the copies are host memmoves: a device pointer must never reach them
            logger.error(
                "kvpool: KV tensors on %s; kvpool moves host memory only so far: the worker "
                "connector stays idle (loads miss, nothing is saved)",
                ", ".join(devices),
            )
            return
        self._groups = groups
        self._book = SaveBook(retries=self.identity.holds_for_saves(self._events))
        try:
            self.store, self.engine = self._open()
        except ConfigError:
            raise  # a setting to fix (e.g. staging smaller than one chunk): fail loudly
        except KVPoolError as exc:
            logger.error("kvpool: %s; the worker connector stays idle (loads miss)", exc)

    def _open(self) -> tuple[KVStore, TransferEngine]:
        store = self._open_store(self.pool)
        try:
            mode = self.settings.load_mode
            zero_copy = self._zero_copy(store)  # may move the tensors: views come after
            engine = TransferEngine(
                store,
                self._shard_views(),
                int(self.kv_cache_config.num_blocks),
                staging_bytes=self.settings.staging_bytes,
                # Staged by default: bytes reach the KV cache only after their header
                # and checksum were checked, and each object moves as one segment.
                load_mode="staged" if mode == "auto" else mode,
                load_timeout_s=self.settings.load_timeout_s or None,
                zero_copy=zero_copy,
                blocks_per_object=self.identity.blocks_per_chunk,
                prefault=True,  # a fresh engine's first loads at full speed
                # vLLM keeps the blocks until saves are done: copy them off the step
                deferred_saves=self.identity.holds_for_saves(self._events),
                save_priority=self.settings.save_priority,
            )
        except BaseException:
            if store is not self._kv_home:
                store.close()
            raise
        return store, engine

    def _shard_views(self) -> list[list[tuple[str, torch.Tensor]]]:
        """This rank's shards' views (``connector.shards``); fills ``_shards``."""
        local = {g: self._groups[i] for g, i in self._local.items()}
        views, shards = shard_views(self.identity.layout, self.rank, local, self._layer_index)
        space = self.identity.space
        self._shards = {
            g: [(content, i, space.template(content)) for content, i in pairs]
            for g, pairs in shards.items()
        }
        for pairs in shards.values():
            for content, i in pairs:
                self._band_of_group[i] = content.band
                self._band_of_layer.update((name, content.band) for name, _ in views[i])
        return views

    def _zero_copy(self, store: KVStore) -> bool:
        """Whether ``store`` can move blocks straight from the KV tensors, placing
        them in its memory first where it needs that (once, at the first open)."""
        if not self.settings.zero_copy:
            return False
        odd = self.identity.frees_blocks_early(self._local)
        if store is not self._kv_home and odd is not None:
            logger.warning(
                "kvpool: zero_copy off: KV group kind %s frees blocks of running "
                "requests, which a save in flight may still read",
                odd.kind.name.lower() + (f" (window {odd.window})" if odd.window else ""),
            )
            return False
        if not store.requires_staging and self.settings.load_by_layer:
            logger.warning(
                "kvpool: zero_copy off: with load_by_layer the forward waits for each load, "
                "and a direct get from another host has no deadline; loads are staged"
            )
            return False
        if not store.requires_staging or store is self._kv_home:
            return True
        if self._kv_home is not None:  # placed in a retired store's memory
            logger.warning("kvpool: the KV cache lives in an old client's memory; staging")
            return False
        try:
            place_kv(self._groups, store.alloc_staging)
        except (KVPoolError, ValueError) as exc:
            logger.warning("kvpool: zero_copy off, the KV cache stays where it is (%s)", exc)
            return False
        self._kv_home = store
        return True

    # -- reconnect -------------------------------------------------------------------

    def _check_store(self, results: list[JobResult]) -> list[JobResult]:
        """Retire a store that stopped answering; adopt a reopened one. Returns the
        results of loads that the retired engine had not finished (all failed)."""
        if self.engine is None:
            self._adopt()
            return []
        dead = any(
            r.statuses and all(s is Status.UNAVAILABLE for s in r.statuses.values())
            for r in results
        )
        now = time.monotonic()
        if self._ha:  # the client follows a new leader by itself: give it the time
            alive = any(s is not Status.UNAVAILABLE for r in results for s in r.statuses.values())
            if alive:
                self._dead_since = None
            elif dead and self._dead_since is None:
                self._dead_since = now
            since = self._dead_since
            dead = dead and since is not None and now - since >= HA_RECONNECT_AFTER_S
        if not dead or not self.engine.can_abandon or now < self._retry_at:
            return []
        self._dead_since = None
        engine, store = self.engine, self.store
        self.engine = self.store = None
        self._saves.clear()  # the retired engine reports no more saves
        self._book.clear()  # its jobs report no more; its refusals: the pool is gone
        engine.abandon_loads()
        stale = engine.poll()
        self._retired = self._retired + engine.stats()
        self._last_stats = TransferStats()
        self._last_version = -1  # of the engine that _last_stats came from
        logger.warning("kvpool: the pool stopped answering (unavailable); reconnecting")
        self._start_reopen(engine, store)
        return stale

    def _start_reopen(self, engine: TransferEngine | None, store: KVStore | None) -> None:
        self._reopening = True
        threading.Thread(
            target=self._reopen, args=(engine, store), name="kvpool-reconnect", daemon=True
        ).start()

    def _reopen(self, engine: TransferEngine | None, store: KVStore | None) -> None:
        """Background: close the retired engine and store, then open new ones."""
        try:
            if engine is not None:
                engine.close()
            if store is not None and store is not self._kv_home:
                store.close()
            opened: tuple[KVStore, TransferEngine] | None = self._open()
        except Exception as exc:  # KVPoolError, or anything a dying client raises
            logger.warning("kvpool: reconnect failed (%s); retrying later", exc)
            opened = None
        with self._lock:
            if opened is not None and not self._groups:  # closed meanwhile
                opened[1].close()
                opened[0].close()
                opened = None
            self._reopened = opened
            now = time.monotonic()
            if opened is None:
                self._retry_at = now + self._backoff_s
                self._backoff_s = min(self._backoff_s * 2, RECONNECT_BACKOFF_S[1])
            else:
                self._retry_at = now + RECONNECT_BACKOFF_S[0]
                self._backoff_s = RECONNECT_BACKOFF_S[0]
            self._reopening = False

    def _adopt(self) -> None:
        with self._lock:
            opened, self._reopened = self._reopened, None
            retry = (
                opened is None
                and not self._reopening
                and self._groups
                and self._retry_at > 0
                and time.monotonic() >= self._retry_at
            )
        if opened is not None:
            self.store, self.engine = opened
            logger.warning("kvpool: worker reconnected to the pool")
        elif retry:
            self._start_reopen(None, None)

    # -- per step ------------------------------------------------------------------

    def _refs(self, ops: RequestOps, writing: bool) -> list[tuple[ChunkRef, bytes]]:
        """This rank's chunk objects of ``ops`` (only those it writes, when writing).
        Keys are ``KeySpace.key``'s, built from each shard's template and the chunk
        hash's hex once per chunk (a warm request builds them for every object it
        loads, then again for its save plan)."""
        layout, rank, pin_ms = self.identity.layout, self.rank, ops.pin_ms
        refs = []
        for c in ops.chunks:
            h, chunk_hash, chunk = c.chunk_hash.hex(), c.chunk_hash, c.chunk
            for g, shards in self._shards.items():
                blocks = c.block_ids[g]
                if NULL_BLOCK in blocks:  # a window's dropped block: no bytes
                    continue
                for content, engine_group, template in shards:
                    if writing and not layout.writes(rank, content, chunk):
                        continue
                    ref = ChunkRef(template + h, engine_group, chunk, blocks, pin_ms)
                    refs.append((ref, chunk_hash))
        return refs

    def _requests_ended(self, meta: StepPlan) -> None:
        """Finishing and freed requests of this step; from ``start_loads`` and
        ``start_saves`` alike (vLLM may skip the latter on some ranks)."""
        self._book.finishing(meta.finishing, time.monotonic())
        self._book.freed(meta.freed)  # their blocks may hold other bytes from now on

    def step_began(self) -> None:
        self._step_t0 = time.perf_counter()
        self._own_s = 0.0

    def start_loads(self, meta: StepPlan) -> None:
        start = time.perf_counter()
        try:
            self._start_loads(meta)
        finally:
            self._own_s += time.perf_counter() - start

    def _start_loads(self, meta: StepPlan) -> None:
        self._requests_ended(meta)
        for ops in meta.loads:
            if self.engine is None:
                if not ops.by_layer:  # reported as a finished (failed) load
                    self._unfinished_without_engine.add(ops.req_id)
                for c in ops.chunks:
                    self._invalid.update(b for ids in c.block_ids for b in ids if b != NULL_BLOCK)
                continue
            refs = self._refs(ops, writing=False)
            if ops.by_layer:
                self._load_by_band(ops.req_id, refs)
                continue
            job = ("load", next(self._jobs))
            self._loads[job] = (ops.req_id, {r.key: h for r, h in refs})
            self.engine.submit_load(job, [r for r, _ in refs])

    def _load_by_band(self, req_id: str, refs: list[tuple[ChunkRef, bytes]]) -> None:
        """One load job per layer band, the first band first (the load thread takes
        jobs in order): the forward waits for each band at its first layer."""
        assert self.engine is not None
        bands: dict[int, list[tuple[ChunkRef, bytes]]] = {}
        for ref, h in refs:
            bands.setdefault(self._band_of_group[ref.group], []).append((ref, h))
        for band in sorted(bands):
            job = ("load", next(self._jobs))
            self._layered[job] = (req_id, {r.key: h for r, h in bands[band]})
            self._band_jobs.setdefault(band, []).append(job)
            self.engine.submit_load(job, [r for r, _ in bands[band]])

    def wait_layer(self, layer_name: str) -> None:
        """Before the forward reads ``layer_name``: this step's loads of its layer
        band (and of every band before it) are in the KV cache, or failed (their
        blocks are then reported for recompute, ``load_errors``)."""
        if not self._band_jobs:
            return
        band = self._band_of_layer.get(layer_name)
        upto = max(self._band_jobs) if band is None else band
        jobs = [j for b in sorted(self._band_jobs) if b <= upto for j in self._band_jobs.pop(b)]
        if jobs and self.engine is not None:
            start = time.perf_counter()
            for result in self.engine.wait_loads(jobs):
                req_id, hashes = self._layered.pop(result.job_id)
                self._load_ended(req_id, hashes, result)
                self._layered_done.append(result)  # for the next ``finished``'s health check
            self._own_s += time.perf_counter() - start
            logger.debug(
                "kvpool: waited %.1f ms for layer band(s) up to %d",
                (time.perf_counter() - start) * 1e3,
                upto,
            )

    def _load_ended(self, req_id: str, hashes: dict[str, bytes], result: JobResult) -> bool:
        """Note a load's failures (blocks to recompute, chunks to suppress); True if
        it failed."""
        logger.debug(
            "kvpool: load of %s: %d chunk(s), %.1f MiB in %.1f ms",
            req_id,
            len(result.statuses),
            result.nbytes / 2**20,
            result.seconds * 1e3,
        )
        bad = [k for k, s in result.statuses.items() if not s.ok]
        if not bad:
            return False
        self._invalid |= result.invalid_block_ids
        # A chunk refused locally says nothing about its object: no suppression. Nor
        # does one the pool answered UNAVAILABLE for at once (a master failing over, a
        # holder mounting again); one that stalled first (a holder cut off: a zero-copy
        # get waits out Mooncake's RPC timeout) is suppressed, or the next request
        # would stall as long.
        transient = {Status.REFUSED}
        if result.seconds < UNAVAILABLE_STALL_S:
            transient.add(Status.UNAVAILABLE)
        self._failed_hashes.update(hashes[k] for k in bad if result.statuses[k] not in transient)
        causes = sorted({result.statuses[k].value for k in bad})
        logger.warning(
            "kvpool: load of %d chunk(s) of %s failed (%s); recomputing",
            len(bad),
            req_id,
            ", ".join(causes),
        )
        return True

    def start_saves(self, meta: StepPlan) -> None:
        if self._step_t0 is not None and meta.tokens > 0:
            seconds = time.perf_counter() - self._step_t0 - self._own_s
            self._forward = (meta.tokens, seconds)
        self._step_t0 = None
        self._requests_ended(meta)
        if self.engine is None:
            return
        self.wait_layer("")  # a band the forward never asked for: done before saves
        for ops in meta.saves:
            pairs = self._refs(ops, writing=True)
            if pairs and ops.fresh_from is not None:
                # Missing from the pool at the lookup: put even if put before (evicted).
                self.engine.forget(r.key for r, _ in pairs if r.chunk >= ops.fresh_from)
            if pairs:
                hashes = {r.key: h for r, h in pairs} if self._events else None
                self._submit_save(ops.req_id, [r for r, _ in pairs], hashes)
        if self._book.pending_retries and not self.engine.saves_blocked:
            for req_id, refs in self._book.take_retries().items():
                self._submit_save(req_id, refs, None)

    def _submit_save(
        self, req_id: str, refs: list[ChunkRef], hashes: dict[str, bytes] | None
    ) -> None:
        assert self.engine is not None
        job = ("save", next(self._jobs))
        if hashes is not None:
            self._saves[job] = hashes
        self._book.submitted(job, req_id, refs)
        self.engine.submit_save(job, refs)

    def flush_saves(self, freed: frozenset[str]) -> None:
        """Zero copy, deferred saves: wait for the saves still reading blocks of
        ``freed`` requests, before this step's forward may overwrite those blocks."""
        if not freed or not self._book.has_jobs or self.engine is None:
            return
        if not self.engine.reads_blocks_until_done:
            return  # the saves copied their blocks when they were submitted
        jobs = self._book.jobs_of(freed)
        if not jobs:
            return
        start = time.perf_counter()
        self.engine.wait_reads(jobs)
        self._own_s += time.perf_counter() - start
        self._book.drop_jobs(jobs)  # freed: their refusals are not retried
        logger.debug(
            "kvpool: waited %.1f ms for %d save(s) of freed requests",
            (time.perf_counter() - start) * 1e3,
            len(jobs),
        )

    def finished(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """(request ids whose load finished, the subset that failed).

        With ``idle`` (no tokens scheduled this step) first block up to
        ``IDLE_WAIT_S``: on this rank's transfers if any are in flight, else asleep.
        vLLM's engine and workers spin (``sched_yield``) while one waits for
        another, and on a small host those spinners starved the pool's processes:
        a TP2 load waited 30 s on a holder that got no CPU, and the master expired
        the holder meanwhile. So every rank blocks, not only one with a transfer.
        """
        done, failed = set(self._unfinished_without_engine), set(self._unfinished_without_engine)
        self._unfinished_without_engine.clear()
        self.wait_layer("")  # loads by layer end in their step (vLLM may skip saves)
        if idle:
            if self.engine is not None and (self._loads or self._book.has_finishing):
                self.engine.wait_any(IDLE_WAIT_S)
            elif not done:  # nothing to report: no reason to hurry
                time.sleep(IDLE_WAIT_S)
        results = self.engine.poll() if self.engine is not None else []
        results += self._check_store(results + self._layered_done)
        self._layered_done = []
        for result in results:
            if result.kind != "load":
                self._book.ended(result.job_id, result)
                self._note_stored(result)
                continue
            req_id, hashes = self._loads.pop(result.job_id)
            done.add(req_id)
            if self._load_ended(req_id, hashes, result):
                failed.add(req_id)
        reading = (
            self.engine.reading(self._book.jobs)
            if self.engine is not None and self._book.has_finishing
            else ()
        )
        self._released |= self._book.release(
            time.monotonic(), pool=self.engine is not None, reading=reading
        )
        return done, failed

    def released(self) -> set[str]:
        """Finishing requests whose saves are done, each once (see the module docstring)."""
        out, self._released = self._released, set()
        return out

    def _note_stored(self, result: JobResult) -> None:
        hashes = self._saves.pop(result.job_id, None)
        if hashes is None:
            return
        keys = [k for k, st in result.statuses.items() if st.stored] + list(result.known)
        for k in keys:
            h = hashes[k]
            self._stored[h] = self._stored.get(h, 0) + 1
        self._fresh.update(hashes[k] for k, st in result.statuses.items() if st is Status.OK)

    @property
    def saves_in_flight(self) -> int:
        """Save work not done yet: jobs whose results ``finished`` has not taken,
        requests with refused objects to retry, finishing requests not released."""
        return self._book.outstanding

    def results(self, plan: StepPlan | None) -> StepResults:
        """This step's results for vLLM (``plan``: the step's, None if none bound)."""
        return step_results(self, plan, len(self.kv_cache_config.kv_cache_groups))

    def load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out if len(self.kv_cache_config.kv_cache_groups) == 1 else set()

    def worker_meta(self) -> WorkerReport | None:
        if not (self._failed_hashes or self._stored or self._forward):
            return None
        out = self._new_report(self._failed_hashes, self._stored, self._fresh, self._forward)
        self._failed_hashes, self._stored, self._fresh = set(), {}, set()
        self._forward = None
        return out

    def stats(self) -> TransferStats | None:
        if self.engine is None:
            return None if not self._groups else self._retired
        return self._retired + self.engine.stats()

    def interval_stats(self) -> dict[str, Any] | None:
        """Counters since the previous call (None when idle or nothing happened)."""
        if self.engine is None or self.engine.stats_version == self._last_version:
            return None  # nothing happened: the common idle step costs one comparison
        self._last_version = self.engine.stats_version
        now = self.engine.stats()
        data = stats_delta(
            now, self._last_stats, self.engine.queue_depth, self.engine.in_backpressure
        )
        self._last_stats = now
        return None if interval_empty(data) else data

    def close(self) -> None:
        with self._lock:
            self._groups = []  # a reopen still running closes what it opens
            opened, self._reopened = self._reopened, None
        if opened is not None:
            opened[1].close()
            opened[0].close()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.saves_put.set()
        if self.store is not None and self.store is not self._kv_home:
            self.store.close()
        self.store = None
        if self._kv_home is not None:  # closed last: the KV tensors live in its memory
            self._kv_home.close()
            self._kv_home = None

"""What a transfer engine's saves and loads share.

    Shared(store, groups, copier, staging_base)
    sizes(chunks), staged(offsets, sizes), kv_segments(chunks)
                        object sizes, and scatter lists in staging or in the KV
                        tensors themselves
    known / remember(keys) / forget(keys)
                        keys stored or loaded recently (saves skip them without
                        a store call); bounded, oldest dropped first
    putting             keys a save job of this engine is putting now (a later
                        save skips them: see ``kvpool.transfer.saves``)
    counting()          hold the counters' lock to change ``stats``
    snapshot()          a copy of the counters; ``version`` changes with them
    publish(result)     a finished job, for ``take``, ``wait_any`` and ``wait``
    discard(keys)       remove damaged objects, never forced: one another reader
                        (or this one's own get) holds a lease on is removed once
                        the lease ends (retried after 1, 2, 4 ... 32 s)

Thread safe: saves, loads and the caller's thread use one Shared.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Iterator, Sequence

import numpy as np

from kvpool.kvcache import GroupKV
from kvpool.store.base import KVStore, Status
from kvpool.store.scatter import Scatter
from kvpool.transfer.copies import KVCopier
from kvpool.transfer.records import ChunkRef, JobResult, TransferStats

__all__ = ["Shared", "all_ok"]

logger = logging.getLogger("kvpool.transfer.engine")

DISCARD_RETRY_S = (1.0, 32.0)  # first and last wait before retrying a leased removal
_GONE = frozenset({Status.OK, Status.MISSING})


class Shared:
    """See the module docstring."""

    def __init__(
        self,
        store: KVStore,
        groups: list[GroupKV],
        copier: KVCopier,
        staging_base: int,
        known_keys: int = 65536,
    ) -> None:
        self.store = store
        self.groups = groups
        self.copier = copier
        self.staging_base = staging_base
        self.known: OrderedDict[str, None] = OrderedDict()
        self.known_lock = threading.Lock()
        self.putting: set[str] = set()  # under known_lock
        self._known_max = known_keys
        self.stats = TransferStats()
        self._stats_lock = threading.Lock()
        self.version = 0  # bumped by counting, with every change of stats
        self._done: deque[JobResult] = deque()
        self._done_cond = threading.Condition()

    # -- sizes and scatter lists ---------------------------------------------------

    def object_nbytes(self, c: ChunkRef) -> int:
        return self.groups[c.group].object_nbytes(len(c.block_ids))

    def sizes(self, chunks: Sequence[ChunkRef]) -> list[int]:
        """``object_nbytes`` of each chunk (one computation when all are alike)."""
        if not chunks:
            return []
        first = chunks[0]
        n = self.object_nbytes(first)
        g, b = first.group, len(first.block_ids)
        if all(c.group == g and len(c.block_ids) == b for c in chunks):
            return [n] * len(chunks)
        return [self.object_nbytes(c) for c in chunks]

    def staged(self, offsets: Sequence[int], sizes: Sequence[int]) -> Scatter:
        """One-segment objects at ``offsets`` (absolute) of staging."""
        base = self.staging_base
        return Scatter([[base + o] for o in offsets], [[n] for n in sizes])

    def kv_segments(self, chunks: Sequence[ChunkRef]) -> Scatter:
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

    # -- keys stored recently --------------------------------------------------------

    def remember(self, keys: Iterable[str]) -> None:
        with self.known_lock:
            for k in keys:
                self.known[k] = None
                self.known.move_to_end(k)
            while len(self.known) > self._known_max:
                self.known.popitem(last=False)

    def forget(self, keys: Iterable[str]) -> None:
        with self.known_lock:
            for k in keys:
                self.known.pop(k, None)

    # -- counters --------------------------------------------------------------------

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Hold the counters' lock to change ``stats``; bumps ``version``."""
        with self._stats_lock:
            self.version += 1
            yield

    def snapshot(self) -> TransferStats:
        with self._stats_lock:
            return self.stats.copy()

    # -- finished jobs ---------------------------------------------------------------

    def discard(self, keys: Sequence[str], wait_s: float | None = None) -> None:
        """Remove damaged objects without force: a reader holding a lease (a get
        takes one, ours included) keeps its bytes until it ends. Leased objects are
        tried again after ``wait_s``, doubling, until ``DISCARD_RETRY_S[1]``; past
        that they stay until evicted (lookups skip them meanwhile: failed chunks
        are suppressed)."""
        if not keys:
            return
        first, last = DISCARD_RETRY_S
        wait_s = first if wait_s is None else wait_s
        try:
            statuses = self.store.batch_remove(list(keys), force=False)
        except Exception:  # a bug: the object stays, it is only a miss
            logger.exception("removing %d damaged objects failed", len(keys))
            return
        removed = [k for k, st in zip(keys, statuses, strict=True) if st in _GONE]
        if removed:
            self.forget(removed)  # a save since (a duplicate put) stored nothing
            with self.counting():
                self.stats.chunks_discarded += len(removed)
        leased = [k for k, st in zip(keys, statuses, strict=True) if st is Status.LEASED]
        if leased and wait_s <= last:
            timer = threading.Timer(wait_s, self.discard, (leased, 2 * wait_s))
            timer.daemon = True
            timer.start()

    def publish(self, result: JobResult) -> None:
        with self._done_cond:
            self._done.append(result)
            self._done_cond.notify_all()

    def take(self) -> list[JobResult]:
        """Every published result not taken yet, oldest first."""
        with self._done_cond:
            out = list(self._done)
            self._done.clear()
            return out

    def wait_any(self, timeout: float) -> bool:
        with self._done_cond:
            return self._done_cond.wait_for(lambda: bool(self._done), timeout)

    def wait(self, job_ids: Iterable[Hashable], timeout: float | None) -> list[JobResult]:
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


def all_ok(statuses: dict[str, Status]) -> bool:
    """Every key OK (one C-level count, not a property call per key)."""
    return list(statuses.values()).count(Status.OK) == len(statuses)

"""A worker's save jobs by request, refused objects to submit again, and finished
requests whose blocks vLLM keeps until their saves are done.

    SaveBook(retries)          ``retries``: whether refused saves go again (the
                               worker's rule: no KV events, every group keeps a
                               running request's blocks)
    book.submitted(job, req, refs)  a save job handed to the transfer engine
    book.ended(job, result)    its result came back: with a retryable refusal,
                               the objects neither put nor known are kept for
                               their request
    book.freed(reqs)           their blocks may hold other bytes now: drop what
                               was kept to retry
    book.finishing(reqs, now)  finished, blocks kept by vLLM; each is released
                               once no job of it is in flight and nothing is left
                               to retry, or ``DRAIN_LIMIT_S`` after it finished
    book.take_retries()        {request: objects} to submit again now (the caller
                               checks that saves are not blocked)
    book.release(now, pool, reading)
                               the finishing requests done now, each once; with
                               no pool (``pool=False``) nothing is retried; past
                               the limit a job still in flight no longer holds
                               its request, unless it is in ``reading`` (the jobs
                               that may still read their blocks: zero copy,
                               deferred saves not staged yet)
    book.jobs_of(reqs) / book.drop_jobs(jobs)   the flush of freed requests' saves
    book.jobs, book.retrying    save jobs in flight; requests with objects to retry
    book.clear()               the transfer engine was retired: no job reports
    book.outstanding           jobs in flight + requests to retry + finishing

Pure bookkeeping: no I/O, no tensors, no clock of its own (callers pass ``now``).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable

from kvpool.transfer.records import ChunkRef, JobResult

__all__ = ["DRAIN_LIMIT_S", "SaveBook"]

logger = logging.getLogger(__name__)

# A finished request's refused saves are retried this long at most; then its
# blocks go back to vLLM and those objects stay out of the pool.
DRAIN_LIMIT_S = 15.0
NOTE_INTERVAL_S = 60.0  # one "gave up" line at most this often


class SaveBook:
    """See the module docstring."""

    def __init__(self, retries: bool) -> None:
        self.retries = retries
        self._reqs: dict[Hashable, str] = {}  # job in flight -> request
        self._refs: dict[Hashable, list[ChunkRef]] = {}  # job -> its objects (retries on)
        self._retry: dict[str, list[ChunkRef]] = {}  # request -> objects to submit again
        self._finishing: dict[str, float] = {}  # request -> when retries give up
        self._noted = -NOTE_INTERVAL_S

    def submitted(self, job: Hashable, req_id: str, refs: list[ChunkRef]) -> None:
        self._reqs[job] = req_id
        if self.retries:
            self._refs[job] = refs

    def ended(self, job: Hashable, result: JobResult) -> str | None:
        """The request of a finished job (None if unknown or flushed), keeping its
        refused objects to retry when the refusal may pass later."""
        req_id = self._reqs.pop(job, None)
        refs = self._refs.pop(job, None)
        if req_id is None or not refs or not result.retry:
            return req_id
        known = set(result.known)
        again = [r for r in refs if r.key not in result.statuses and r.key not in known]
        if again:
            self._retry.setdefault(req_id, []).extend(again)
        return req_id

    def freed(self, req_ids: Iterable[str]) -> None:
        """Their blocks may hold other bytes now: nothing of them goes again, not
        even what a job still in flight reports refused later."""
        gone = set(req_ids)
        for req_id in gone:
            self._retry.pop(req_id, None)
        if gone:
            for job in [j for j, r in self._reqs.items() if r in gone]:
                self._refs.pop(job, None)

    def finishing(self, req_ids: Iterable[str], now: float) -> None:
        for req_id in req_ids:
            self._finishing.setdefault(req_id, now + DRAIN_LIMIT_S)

    def take_retries(self) -> dict[str, list[ChunkRef]]:
        out, self._retry = self._retry, {}
        return out

    def release(self, now: float, pool: bool = True, reading: Iterable[Hashable] = ()) -> set[str]:
        if not self._finishing:
            return set()
        busy = set(self._reqs.values())
        # A job that may still read its blocks always holds them; one that read them
        # is left behind past the limit (a put that never returns).
        held = {self._reqs[j] for j in reading if j in self._reqs}
        done: set[str] = set()
        for req_id, until in list(self._finishing.items()):
            late = now >= until or not pool
            if req_id in held or (req_id in busy and not late):
                continue
            if req_id in self._retry and not late:
                continue
            left = self._retry.pop(req_id, None)
            self.freed([req_id])  # what its jobs in flight refuse later stays out
            if left and now - self._noted >= NOTE_INTERVAL_S:
                self._noted = now
                logger.warning(
                    "kvpool: gave up saving %d object(s) of %s after %.0f s: the pool took "
                    "too few puts meanwhile (staging busy or backing off); raise "
                    "staging_bytes if the pool is healthy but slower than the engine",
                    len(left),
                    req_id,
                    DRAIN_LIMIT_S,
                )
            del self._finishing[req_id]
            done.add(req_id)
        return done

    def jobs_of(self, req_ids: frozenset[str]) -> list[Hashable]:
        return [j for j, r in self._reqs.items() if r in req_ids]

    def drop_jobs(self, jobs: Iterable[Hashable]) -> None:
        for j in jobs:
            self._reqs.pop(j, None)
            self._refs.pop(j, None)

    def clear(self) -> None:
        self._reqs.clear()
        self._refs.clear()
        self._retry.clear()

    @property
    def has_jobs(self) -> bool:
        return bool(self._reqs)

    @property
    def has_finishing(self) -> bool:
        return bool(self._finishing)

    @property
    def pending_retries(self) -> bool:
        return bool(self._retry)

    @property
    def retrying(self) -> frozenset[str]:
        """Requests with objects to submit again."""
        return frozenset(self._retry)

    @property
    def jobs(self) -> list[Hashable]:
        """Save jobs in flight, oldest first."""
        return list(self._reqs)

    @property
    def outstanding(self) -> int:
        return len(self._reqs) + len(self._retry) + len(self._finishing)

"""What the lookup service answers: how many prompt tokens of a request are in the pool.

    LookupAnswers(store, layout, space, chunk_size, exact=False)
                               validate; holds no socket and starts no thread
    answers.answer(frame)      the reply to one request frame (never raises)
    answers.stats              counters (``ServerStats``)
    SupportsRemovePrefix       the optional store ability that ``reset`` needs

Answers, one per request frame, always (a ``wire.ErrorReply`` for anything it
cannot serve; the thread survives malformed, multipart, empty and huge frames):

* ``LookupRequest`` -> ``LookupReply(hit_tokens)``: the chunks that may count
  are the first ``min(len(chunk_hashes), (num_tokens - 1) // chunk_size)``, so
  only whole chunks count and a full-prompt hit leaves the last token to
  compute. A chunk counts only if every key the ranks would read for it is
  present (``chunks.ChunkObjects``: every distinct content of every group; chunks
  whose load failed are kept out by the scheduler, ``connector.planner``); a
  sliding-window group (``GroupSpec.window``) needs only the chunks of its
  window before the hit, a Mamba group only the hit's last chunk (its state;
  ``GroupSpec.needed_chunks``), so the hit is the longest one whose every group
  has what it needs. Mamba states exist only at the chunks where an engine step
  ended, so one probe asks for the state of every chunk the full-attention
  search found and the hit ends at the last present. A chunk's KV heads are
  written together (by one rank, or by each rank for its own), so outside
  ``exact`` mode the search asks for one head of each slice class (group, token
  class, stage) per chunk, rotating the head with the chunk index; a head
  missing between probes is found by the load, as a chunk missing between probed
  chunks is (see ``lookup.search``). The boundary is searched in a few
  ``store.batch_exists`` rounds (``lookup.search.find_prefix``: one round over
  every chunk for a short prompt, two or three of a few dozen chunks for a long
  one; none when no chunk may count), windows in a few more. ``hit_tokens`` is
  the counted chunks times ``chunk_size``. If the prefix ends at a chunk the
  store could not answer for (no key MISSING, some key UNAVAILABLE), the reply
  is ``ErrorReply(store_unavailable)``.
* ``ResetRequest`` -> ``ResetReply``: removes every object under
  ``KeySpace.prefix`` through the store's ``remove_prefix`` and reports what it
  did; ``ErrorReply(unsupported)`` for a store without that ability. It runs on
  the serving thread: lookups wait behind it.

``LookupServer`` (``lookup.server``) serves these answers on a ZMQ endpoint; the
store must accept calls from its thread (``KVStore`` requires thread safety).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvpool.chunks import ChunkObjects, countable_chunks
from kvpool.errors import ConfigError, StoreError
from kvpool.keys import KeySpace
from kvpool.layout import Layout
from kvpool.lookup import wire
from kvpool.lookup.search import find_prefix
from kvpool.store.base import KVStore, Status

__all__ = ["LookupAnswers", "ServerStats", "SupportsRemovePrefix"]

WINDOW_ROUNDS = 4  # hits tried against sliding windows before answering 0

logger = logging.getLogger(__name__)


@runtime_checkable
class SupportsRemovePrefix(Protocol):
    """A store that can remove every object whose key starts with a prefix."""

    def remove_prefix(self, prefix: str, force: bool = False) -> int:
        """Remove them; return how many were removed. Objects under a read lease
        are kept unless ``force``. Raises ``StoreError`` if the store cannot."""
        ...


@dataclass
class ServerStats:
    """What the server has answered since it started."""

    lookups: int = 0  # LookupReply sent
    hit_tokens: int = 0  # sum of hit_tokens answered
    keys_probed: int = 0  # keys checked in the store
    store_calls: int = 0  # batch_exists calls
    resets: int = 0  # ResetReply sent
    errors: Counter[str] = field(default_factory=Counter)  # ErrorReply sent, by code


class LookupAnswers:
    """The answers of one DP engine's lookup service. See the module docstring."""

    def __init__(
        self,
        store: KVStore,
        layout: Layout,
        space: KeySpace,
        chunk_size: int,
        *,
        max_frame_bytes: int = wire.MAX_FRAME_BYTES,
        exact: bool = False,
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ConfigError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.store = store
        self.layout = layout
        self.space = space
        self.chunk_size = chunk_size
        self.max_frame_bytes = max_frame_bytes
        self.exact = exact  # probe every chunk (a failed load would fail the request)
        self.stats = ServerStats()
        # Full-attention groups need every chunk of a hit; sliding-window groups
        # (``GroupSpec.window``) only the chunks of their window before it, Mamba
        # groups the last chunk's state (``GroupSpec.needed_chunks``). Exact mode
        # probes every head of a chunk, the search one per slice class (rotating).
        objects = ChunkObjects.of(layout, space)
        self._full = objects.full
        self._windowed = objects.windowed
        self._states = objects.states
        self._classes = objects.classes

    def answer(self, frame: bytes | memoryview) -> wire.Reply:
        """The reply to one request frame (what the serving thread sends back).

        Never raises: a bug becomes ``ErrorReply(internal)``, logged here.
        """
        msg = wire.decode_request(frame, self.max_frame_bytes)
        try:
            match msg:
                case wire.PackedLookup() | wire.LookupRequest():
                    reply = self._lookup(msg)
                case wire.ResetRequest():
                    reply = self._reset(msg)
                case wire.ErrorReply():
                    reply = msg
        except Exception:  # the thread must outlive any bug; the client gets a miss
            logger.exception("kvpool: lookup server failed to answer %s", type(msg).__name__)
            reply = wire.ErrorReply(
                seq=msg.seq, code=wire.ErrorCode.INTERNAL, message="server error; see its log"
            )
        match reply:
            case wire.LookupReply():
                self.stats.lookups += 1
                self.stats.hit_tokens += reply.hit_tokens
            case wire.ResetReply():
                self.stats.resets += 1
            case wire.ErrorReply():
                self.stats.errors[reply.code] += 1
        return reply

    def _lookup(self, req: wire.PackedLookup | wire.LookupRequest) -> wire.Reply:
        chunk = self.chunk_size
        hash_of: Callable[[int], bytes]
        if isinstance(req, wire.PackedLookup):
            count, hash_of = req.count, req.hash
        else:  # proto 1: a list of hashes, maybe of mixed lengths
            count, hash_of = len(req.chunk_hashes), req.chunk_hashes.__getitem__
        usable = countable_chunks(req.num_tokens, chunk, count)
        per_chunk = len(self._full) if self.exact else len(self._classes)
        probed = 0
        bound: Status | None = None  # why the last absent probe was absent

        def exists(keys: list[str]) -> list[Status]:
            nonlocal probed
            statuses = self.store.batch_exists(keys)
            if len(statuses) != len(keys):  # a store bug: answered as INTERNAL
                raise RuntimeError(f"the store answered {len(statuses)} of {len(keys)} keys")
            probed += len(keys)
            self.stats.store_calls += 1
            return statuses

        def probe(chunks: Sequence[int]) -> list[bool]:
            nonlocal bound
            statuses = exists(self._probe_keys(chunks, hash_of))
            present = [
                all(s is Status.OK for s in statuses[j * per_chunk : (j + 1) * per_chunk])
                for j in range(len(chunks))
            ]
            if not all(present):  # this round's first absent chunk bounds the answer
                first = present.index(False)
                bound = _why_absent(statuses[first * per_chunk : (first + 1) * per_chunk])
            return present

        hit = find_prefix(usable, per_chunk, probe, exact=self.exact) if self._full else usable
        if (self._windowed or self._states) and hit:
            shorter, why = self._fit_partial(hit, hash_of, exists)
            if shorter < hit:
                hit, bound = shorter, why
        self.stats.keys_probed += probed
        if hit < usable and bound is not Status.MISSING:
            return wire.ErrorReply(
                seq=req.seq,
                code=wire.ErrorCode.STORE_UNAVAILABLE,
                message=f"the store answered {bound.name if bound else '?'} for chunk {hit}",
            )
        return wire.LookupReply(seq=req.seq, hit_tokens=hit * chunk, keys_probed=probed)

    def _fit_partial(
        self,
        hit: int,
        hash_of: Callable[[int], bytes],
        exists: Callable[[list[str]], list[Status]],
    ) -> tuple[int, Status | None]:
        """The longest hit <= ``hit`` chunks whose sliding-window groups have every
        chunk of their window before it and whose Mamba groups have the state of
        its last chunk, and why a shorter one was chosen.

        Mamba states of chunks ``[0, hit)`` are probed once; a hit must end at a
        chunk with every state present. A missing window chunk m rules out every
        hit above it (m is in each of their windows, since the windows before
        ``hit`` reach m), so the next candidate is m; after ``WINDOW_ROUNDS``
        candidates the answer is 0."""
        why: Status | None = None
        states: list[Status | None] = []  # per chunk: None (every state there) or why not
        if self._states:
            n = len(self._states)
            got = exists([t + hash_of(k).hex() for k in range(hit) for t in self._states])
            for k in range(hit):
                part = got[k * n : (k + 1) * n]
                states.append(None if all(st is Status.OK for st in part) else _why_absent(part))
        for _ in range(WINDOW_ROUNDS):
            if self._states:  # end at the last chunk with its states; an unreadable
                end = hit  # one above it is the reason (the hit may be longer)
                while hit and states[hit - 1] is not None:
                    hit -= 1
                skipped = [w for w in states[hit:end] if w is not None]
                if skipped:
                    why = next((w for w in skipped if w is not Status.MISSING), skipped[0])
                if hit == 0:
                    return 0, why
            wanted = [(k, t) for t, g in self._windowed
                      for k in g.needed_chunks(hit, self.chunk_size)]  # fmt: skip
            if not wanted:
                return hit, why
            statuses = exists([t + hash_of(k).hex() for k, t in wanted])
            absent = [(k, st) for (k, _), st in zip(wanted, statuses, strict=True)
                      if st is not Status.OK]  # fmt: skip
            if not absent:
                return hit, why
            hit = max(k for k, _ in absent)
            why = _why_absent([st for k, st in absent if k == hit])
            if hit == 0:
                return 0, why
        return 0, why

    def _probe_keys(self, chunks: Sequence[int], hash_of: Callable[[int], bytes]) -> list[str]:
        """Chunk-major keys a search round asks for: every full-attention key of each
        chunk in exact mode; else, per slice class, head ``chunk % heads``."""
        if self.exact:
            return [t + hash_of(i).hex() for i in chunks for t in self._full]
        return [ts[i % len(ts)] + hash_of(i).hex() for i in chunks for ts in self._classes]

    def _reset(self, req: wire.ResetRequest) -> wire.Reply:
        prefix = self.space.prefix
        if not isinstance(self.store, SupportsRemovePrefix):
            return wire.ErrorReply(
                seq=req.seq,
                code=wire.ErrorCode.UNSUPPORTED,
                message=f"{type(self.store).__name__} cannot remove objects by key prefix "
                "(no remove_prefix); nothing was removed",
            )
        try:
            removed = self.store.remove_prefix(prefix, force=req.force)
        except StoreError as exc:
            logger.warning("kvpool: reset of %s failed: %s", prefix, exc)
            return wire.ResetReply(seq=req.seq, ok=False, removed=0, message=str(exc))
        logger.info("kvpool: reset removed %d objects under %s", removed, prefix)
        kept = "" if req.force else " (objects under a read lease are kept)"
        return wire.ResetReply(
            seq=req.seq, ok=True, removed=removed, message=f"removed {removed} objects{kept}"
        )


def _why_absent(answers: Sequence[Status]) -> Status:
    """MISSING when any key is; else the first failure (the store could not say)."""
    if Status.MISSING in answers:
        return Status.MISSING
    return next(s for s in answers if s is not Status.OK)

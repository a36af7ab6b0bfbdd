"""The lookup server of one DP engine: how many prompt tokens are in the pool?

    LookupServer(endpoint, store, layout, space, chunk_size)
                               validate; binds nothing, starts no thread
    server.start()             bind the endpoint (IPC: take its lock, clear a stale
                               socket file) and start the serving thread; raises
                               ``LookupEndpointInUse`` or ``ConfigError``
    server.close(timeout_s)    stop the thread, close the socket, unlink the IPC
                               socket file and drop its lock; idempotent
    server.stats               counters (``ServerStats``)
    SupportsRemovePrefix       the optional store ability that ``reset`` needs

Answers, one per request frame, always (a ``wire.ErrorReply`` for anything it
cannot serve; the thread survives malformed, multipart, empty and huge frames):

* ``LookupRequest`` -> ``LookupReply(hit_tokens)``: the chunks that may count
  are the first ``min(len(chunk_hashes), (num_tokens - 1) // chunk_size)``, so
  only whole chunks count and a full-prompt hit leaves the last token to
  compute. A chunk counts only if every key the ranks would read for it is
  present (``chunks.ChunkObjects``: every distinct content of every group; chunks
  whose load failed are kept out by the scheduler, ``vllm.scheduler``); a
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

Threading: ``start`` and ``close`` come from the owner's thread; the serving
thread alone uses the ZMQ socket. The store must accept calls from that thread
(``KVStore`` requires thread safety).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import zmq

from kvpool.chunks import ChunkObjects, countable_chunks
from kvpool.errors import ConfigError, StoreError
from kvpool.keys import KeySpace
from kvpool.layout import Layout
from kvpool.lookup import wire
from kvpool.lookup.endpoint import Endpoint, LookupEndpointInUse, PathLock
from kvpool.lookup.search import find_prefix
from kvpool.store.base import KVStore, Status

__all__ = ["LookupServer", "ServerStats", "SupportsRemovePrefix"]

WINDOW_ROUNDS = 4  # hits tried against sliding windows before answering 0

logger = logging.getLogger(__name__)

_BURST = 64  # requests answered per wake-up before polling the stop signal again


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


class LookupServer:
    """Serves lookups for one DP engine. See the module docstring."""

    def __init__(
        self,
        endpoint: str,
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
        self.endpoint = Endpoint.parse(endpoint)
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
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._wake: zmq.Socket[bytes] | None = None  # owner's end of the stop signal
        self._thread: threading.Thread | None = None
        self._lock: PathLock | None = None
        self._bound = ""

    @property
    def bound_url(self) -> str:
        """The URL actually bound (a tcp port 0 resolved); "" before ``start``."""
        return self._bound

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Bind and start serving. Raises ``LookupEndpointInUse`` if the endpoint is
        served already, ``ConfigError`` if it cannot be bound; starts nothing then."""
        if self._thread is not None:
            raise RuntimeError("LookupServer.start() called twice")
        lock = PathLock.acquire(self.endpoint) if self.endpoint.kind == "ipc" else None
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        wake_url = f"inproc://kvpool-lookup-stop-{id(self):x}"
        try:
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            # A memory guard only: frames over max_frame_bytes get an ErrorReply, but
            # ZMQ drops a peer that sends more than four times that in one message.
            sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_frame_bytes)
            stop = ctx.socket(zmq.PAIR)
            stop.bind(wake_url)
            wake = ctx.socket(zmq.PAIR)
            wake.connect(wake_url)
            sock.bind(self.endpoint.bind_url)
            if self.endpoint.kind == "ipc":
                os.chmod(self.endpoint.path, 0o600)  # only this user may ask or reset
        except (zmq.ZMQError, OSError) as exc:
            ctx.destroy(linger=0)
            if lock is not None:
                lock.release()
            if isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EADDRINUSE:
                raise LookupEndpointInUse(f"{self.endpoint.url} is in use: {exc}") from None
            raise ConfigError(f"cannot bind lookup endpoint {self.endpoint.url}: {exc}") from None
        self._bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ctx, self._wake, self._lock = ctx, wake, lock
        self._thread = threading.Thread(
            target=self._serve,
            args=(sock, stop),
            name=f"kvpool-lookup-dp{self.layout.dp_index}",
            daemon=True,  # never hold up interpreter exit; close() still joins it
        )
        self._thread.start()
        logger.info("kvpool: lookup server listening on %s", self._bound)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (waiting up to ``timeout_s`` for a store call in flight),
        close the socket, unlink the IPC socket file and drop its lock. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        assert self._wake is not None and self._ctx is not None
        self._wake.send(b"")
        thread.join(timeout_s)
        self._wake.close(linger=0)
        if thread.is_alive():
            # Its sockets stay open with it; terminating the context would hang.
            logger.error("kvpool: lookup server thread did not stop within %.1f s", timeout_s)
        else:
            self._ctx.term()
        if self._lock is not None:
            self._lock.release()
        self._ctx = self._wake = self._lock = None
        logger.info("kvpool: lookup server on %s closed", self._bound)

    def __enter__(self) -> LookupServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- answering ----------------------------------------------------------------

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

    # -- serving thread ---------------------------------------------------------------

    def _serve(self, sock: zmq.Socket[bytes], stop: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if stop in ready:
                    return
                for _ in range(_BURST):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._reply(sock, frames)
        except zmq.ZMQError:
            logger.exception("kvpool: lookup server socket failed; lookups now miss")
        finally:
            sock.close(linger=0)
            stop.close(linger=0)

    def _reply(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """Answer one ROUTER message: [peer identity, request frame]."""
        peer, body = frames[0], frames[1:]
        if len(body) == 1:
            reply = self.answer(body[0])
        else:
            seq = wire.decode_request(body[0]).seq if body else -1
            reply = wire.ErrorReply(
                seq=seq,
                code=wire.ErrorCode.MALFORMED,
                message=f"expected one frame per request, got {len(body)}",
            )
            self.stats.errors[reply.code] += 1
        try:
            sock.send_multipart([peer, wire.encode_reply(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer is gone or not reading: drop the reply
            logger.debug("kvpool: lookup reply dropped: %s", exc)


def _why_absent(answers: Sequence[Status]) -> Status:
    """MISSING when any key is; else the first failure (the store could not say)."""
    if Status.MISSING in answers:
        return Status.MISSING
    return next(s for s in answers if s is not Status.OK)

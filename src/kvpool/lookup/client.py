"""The scheduler's side of lookups: a deadline on every call, and a miss when in doubt.

    LookupClient(endpoint, timeout_ms=5.0)   connect (no thread of its own)
    client.lookup(req_id, hashes, n) -> int  blocks at most ``timeout_ms``; hit
                                             tokens, 0 on a miss, timeout or error
    client.start(req_id, hashes, n)          send without waiting (never blocks; if no
                                             server is connected yet, poll() sends it)
    client.poll(req_id) -> int | None        None: not answered yet and within the
                                             deadline; else the answer, once (0 after
                                             the deadline, or for an unknown id)
    client.cancel(req_id)                    forget it; a late reply is dropped
    client.reset(force, timeout_ms)          the server's ``ResetReply`` or
                                             ``ErrorReply``; an ``ErrorReply`` made up
                                             here if none came (``timeout``, ...)
    client.close()                           idempotent; later lookups answer 0
    client.stats                             answers, and misses by reason

Every failure is a miss (0 tokens), counted in ``stats.misses[code]`` and
logged at most once per ``log_every_s`` with the counts since the last line.
The codes are ``wire.ErrorCode`` values: those the server sends
(``store_unavailable``, ``malformed``, ...) and those made up here:
``timeout`` (sent, no reply by the deadline), ``unreachable`` (no server
connected by the deadline, nothing sent), ``backoff`` (not sent: the server
failed moments ago), ``rebuilt`` (the socket was rebuilt while waiting) and
``closed``.

Socket: one ZMQ DEALER with ``IMMEDIATE`` (nothing queues while no server is
connected) and a sequence number per request; replies are matched by it and
stale ones dropped, so a missed reply never wedges the socket. After a timeout
the socket is rebuilt (requests queued in it are discarded). While the server
keeps failing, lookups are not sent for a backoff that doubles from
``timeout_ms`` up to ``max_backoff_s``; any reply resets it.

Not thread-safe: one thread (the scheduler's) makes every call.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq

from kvpool.errors import ConfigError
from kvpool.lookup import wire
from kvpool.lookup.endpoint import Endpoint

__all__ = ["ClientStats", "LookupClient"]

logger = logging.getLogger(__name__)

_ASYNC_KEEP = 4096  # started ids never polled nor cancelled beyond this are dropped
_Code = wire.ErrorCode


@dataclass
class ClientStats:
    """What the client has answered since it was made."""

    lookups: int = 0  # answers handed to the caller (hits, empty hits and misses)
    hits: int = 0  # answers > 0
    hit_tokens: int = 0
    misses: Counter[str] = field(default_factory=Counter)  # failures by ErrorCode value
    stale_replies: int = 0  # replies to requests no longer awaited
    rebuilds: int = 0  # sockets rebuilt


@dataclass(slots=True)
class _Pending:
    deadline: float  # clock time
    data: bytes | None  # the request frame, until it is sent
    reply: wire.Reply | None = None  # the answer (made up here on failure)

    def settled(self) -> bool:  # a method: mypy narrows attributes, not calls
        return self.reply is not None


class _RateLimitedLog:
    """One warning per ``interval_s`` at most, with the reasons counted in between."""

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last = -math.inf
        self._since: Counter[str] = Counter()

    def record(self, reason: str, detail: str) -> None:
        self._since[reason] += 1
        now = self._clock()
        if now - self._last < self.interval_s:
            return
        counts = ", ".join(f"{r}={n}" for r, n in sorted(self._since.items()))
        logger.warning("kvpool: lookup answered as a miss (%s: %s); since last: %s",
                       reason, detail, counts)  # fmt: skip
        self._last = now
        self._since.clear()


class LookupClient:
    """Asks a ``LookupServer`` with a deadline. See the module docstring."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_ms: float = 5.0,
        max_backoff_s: float = 1.0,
        log_every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not timeout_ms > 0:
            raise ConfigError(f"lookup timeout_ms must be > 0, got {timeout_ms!r}")
        self.endpoint = Endpoint.parse(endpoint)
        if self.endpoint.kind == "tcp" and not self.endpoint.port:
            raise ConfigError(f"lookup endpoint {endpoint!r}: a client needs the server's port")
        self.timeout_s = timeout_ms / 1000
        self.max_backoff_s = max(max_backoff_s, self.timeout_s)
        self.stats = ClientStats()
        self._clock = clock
        self._log = _RateLimitedLog(log_every_s, clock)
        self._seq = itertools.count(1)
        self._pending: dict[int, _Pending] = {}  # seq -> request not yet handed back
        self._async: dict[str, int] = {}  # req_id -> seq, for start/poll
        self._backoff_s = self.timeout_s
        self._backoff_until = -math.inf
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = self._connect(self._ctx)

    # -- calls ----------------------------------------------------------------------

    def lookup(self, req_id: str, chunk_hashes: Sequence[bytes], num_tokens: int) -> int:
        """Hit tokens for this prompt; waits at most ``timeout_ms``; 0 on any failure."""
        seq = self._submit(req_id, chunk_hashes, num_tokens)
        return self._result(self._advance(seq, wait=True), seq)

    def start(self, req_id: str, chunk_hashes: Sequence[bytes], num_tokens: int) -> None:
        """Send a lookup and return at once; ``poll(req_id)`` reads the answer.

        A second ``start`` for the same id replaces the first.
        """
        self.cancel(req_id)
        self._async[req_id] = self._submit(req_id, chunk_hashes, num_tokens)
        if len(self._async) > _ASYNC_KEEP:
            self.cancel(next(iter(self._async)))

    def poll(self, req_id: str) -> int | None:
        """None while unanswered within the deadline; else the answer, once.

        0 after the deadline, after any failure, and for an id that was never
        started (or was answered or cancelled already). Never blocks.
        """
        seq = self._async.get(req_id)
        if seq is None:
            return 0
        pending = self._advance(seq, wait=False)
        if pending.reply is None:
            return None
        del self._async[req_id]
        return self._result(pending, seq)

    def cancel(self, req_id: str) -> None:
        """Stop waiting for ``req_id`` (e.g. the request finished); unknown ids are ignored."""
        seq = self._async.pop(req_id, None)
        if seq is not None:
            self._pending.pop(seq, None)

    def reset(self, force: bool = False, timeout_ms: float = 5000.0) -> wire.Reply:
        """Ask the server to remove its key space's objects and wait for the outcome."""
        seq = next(self._seq)
        data = wire.encode_request(wire.ResetRequest(seq=seq, force=force))
        self._pending[seq] = _Pending(self._clock() + timeout_ms / 1000, data)
        reply = self._advance(seq, wait=True).reply
        del self._pending[seq]
        assert reply is not None  # _advance(wait=True) always settles it
        return reply

    def close(self) -> None:
        """Close the socket; later calls answer 0 (``closed``). Idempotent."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for seq, p in self._pending.items():
            self._settle(p, seq, _Code.CLOSED, "the client is closed")

    def __enter__(self) -> LookupClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------

    def _submit(self, req_id: str, chunk_hashes: Sequence[bytes], num_tokens: int) -> int:
        """Register a lookup (sent now if a server is connected); its seq."""
        seq = next(self._seq)
        now = self._clock()
        pending = self._pending[seq] = _Pending(now + self.timeout_s, None)
        if self._sock is None:
            self._settle(pending, seq, _Code.CLOSED, "the client is closed")
        elif not chunk_hashes or num_tokens <= 1:  # nothing could count: no need to ask
            pending.reply = wire.LookupReply(seq=seq, hit_tokens=0, keys_probed=0)
        elif now < self._backoff_until:
            self._settle(pending, seq, _Code.BACKOFF, f"{self.endpoint.url} failed moments ago")
        else:
            try:
                request = wire.PackedLookup.pack(
                    seq,
                    req_id[: wire.MAX_REQ_ID],
                    # A prefix of the hashes still answers for a prefix of the prompt.
                    chunk_hashes[: wire.MAX_CHUNK_HASHES],
                    num_tokens,
                )
            except ValueError as exc:
                self._settle(pending, seq, _Code.MALFORMED, f"cannot send the lookup: {exc}")
            else:
                pending.data = wire.encode_request(request)
                self._try_send(pending)
        return seq

    def _advance(self, seq: int, wait: bool) -> _Pending:
        """Send, read replies and apply the deadline for request ``seq``.

        ``wait``: block until it is settled (at most until its deadline).
        """
        p = self._pending[seq]
        while not p.settled():
            sock = self._sock
            if sock is None:
                self._settle(p, seq, _Code.CLOSED, "the client is closed")
                break
            remaining_ms = math.ceil((p.deadline - self._clock()) * 1000)
            if p.data is not None and not self._try_send(p):
                if remaining_ms <= 0:
                    self._failed(p, seq, _Code.UNREACHABLE, "no lookup server connected")
                elif wait:
                    sock.poll(remaining_ms, zmq.POLLOUT)
                    continue
                break
            self._drain()
            if p.settled():
                break
            if remaining_ms <= 0:
                self._failed(p, seq, _Code.TIMEOUT, f"no reply in {self.timeout_s * 1000:g} ms")
                self._rebuild()
            elif not wait:
                break
            else:
                sock.poll(remaining_ms, zmq.POLLIN)
        return p

    def _try_send(self, p: _Pending) -> bool:
        """Send ``p``'s frame if a server is connected; True once it is sent."""
        if p.data is None:
            return True
        if self._sock is None:
            return False
        try:
            self._sock.send(p.data, zmq.NOBLOCK)
        except zmq.Again:  # IMMEDIATE: no server connected (or its queue is full)
            return False
        p.data = None
        return True

    def _drain(self) -> None:
        """Route every reply waiting in the socket, without blocking."""
        while self._sock is not None:
            try:
                reply = wire.decode_reply(self._sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            pending = self._pending.get(reply.seq)
            if pending is None or pending.reply is not None or pending.data is not None:
                self.stats.stale_replies += 1
                continue
            pending.reply = reply
            self._backoff_s = self.timeout_s  # the server answers
            self._backoff_until = -math.inf

    def _failed(self, p: _Pending, seq: int, code: wire.ErrorCode, message: str) -> None:
        """The server did not answer in time: settle ``p`` and back off."""
        self._settle(p, seq, code, f"{message} ({self.endpoint.url})")
        self._backoff_until = self._clock() + self._backoff_s
        self._backoff_s = min(2 * self._backoff_s, self.max_backoff_s)

    def _rebuild(self) -> None:
        """Replace the socket, dropping requests queued in it; fail those sent on it."""
        if self._sock is None or self._ctx is None:
            return
        self._sock.close(linger=0)
        self._sock = self._connect(self._ctx)
        self.stats.rebuilds += 1
        for seq, p in self._pending.items():
            if p.reply is None and p.data is None:  # sent on the old socket
                self._settle(p, seq, _Code.REBUILT, "socket rebuilt after a timeout")

    def _connect(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 10)  # ms: a restarted server is found quickly
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 100)
        sock.connect(self.endpoint.url)
        return sock

    @staticmethod
    def _settle(p: _Pending, seq: int, code: wire.ErrorCode, message: str) -> None:
        if p.reply is None:
            p.data = None
            p.reply = wire.ErrorReply(seq=seq, code=code, message=message)

    def _result(self, p: _Pending, seq: int) -> int:
        """Hand back the answer of a settled lookup (once): count it, forget it."""
        self._pending.pop(seq, None)
        self.stats.lookups += 1
        match p.reply:
            case wire.LookupReply(hit_tokens=hit):
                if hit > 0:
                    self.stats.hits += 1
                    self.stats.hit_tokens += hit
                return hit
            case wire.ErrorReply(code=code, message=message):
                reason = str(code)
            case other:
                reason, message = str(_Code.MALFORMED), f"{type(other).__name__} to a lookup"
        self.stats.misses[reason] += 1
        self._log.record(reason, message)
        return 0

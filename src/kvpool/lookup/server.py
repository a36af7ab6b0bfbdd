"""The lookup server of one DP engine: ``LookupAnswers`` served on a ZMQ endpoint.

    LookupServer(endpoint, store, layout, space, chunk_size)
                               validate; binds nothing, starts no thread
    server.start()             bind the endpoint (IPC: take its lock, clear a stale
                               socket file) and start the serving thread; raises
                               ``LookupEndpointInUse`` or ``ConfigError``
    start_first_free(endpoints, make)
                               start ``make(url)`` on the first endpoint that no
                               live server holds (several servers of one config on
                               one host); ``LookupEndpointInUse`` if all are held
    server.close(timeout_s)    stop the thread, close the socket, unlink the IPC
                               socket file and drop its lock; idempotent
    server.answer(frame), server.stats
                               as ``LookupAnswers`` (``lookup.answers``: what a
                               lookup or a reset answers, and why)

One reply per request frame, always: the thread survives malformed, multipart,
empty and huge frames (a ``wire.ErrorReply`` for each).

Threading: ``start`` and ``close`` come from the owner's thread; the serving
thread alone uses the ZMQ socket. The store must accept calls from that thread
(``KVStore`` requires thread safety).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

import zmq

from kvpool.errors import ConfigError
from kvpool.keys import KeySpace
from kvpool.layout import Layout
from kvpool.lookup import wire
from kvpool.lookup.answers import LookupAnswers, ServerStats, SupportsRemovePrefix
from kvpool.lookup.endpoint import Endpoint, LookupEndpointInUse, PathLock
from kvpool.store.base import KVStore

__all__ = ["LookupServer", "ServerStats", "SupportsRemovePrefix", "start_first_free"]

logger = logging.getLogger(__name__)

_BURST = 64  # requests answered per wake-up before polling the stop signal again


class LookupServer(LookupAnswers):
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
        super().__init__(
            store, layout, space, chunk_size, max_frame_bytes=max_frame_bytes, exact=exact
        )
        self.endpoint = Endpoint.parse(endpoint)
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


def start_first_free(endpoints: Sequence[str], make: Callable[[str], LookupServer]) -> LookupServer:
    """Start the server ``make(url)`` builds on the first of ``endpoints`` that no
    live server holds, and return it. Two servers racing for one endpoint never
    both take it (its lock, ``PathLock``); the loser tries the next. Raises
    ``LookupEndpointInUse`` when every endpoint is held, ``ConfigError`` as
    ``start`` does."""
    for url in endpoints:
        server = make(url)
        try:
            server.start()
        except LookupEndpointInUse:
            continue
        return server
    raise LookupEndpointInUse(
        f"live lookup servers hold all {len(endpoints)} endpoints from {endpoints[0]} on: "
        "stop some servers of this config on this host, or give them another run_dir"
    )

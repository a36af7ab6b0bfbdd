"""Replay a trace's turns against a fleet of OpenAI-compatible servers, as clients send them.

    replay(turns, urls, model, Pacing(...)) -> [Answer], one per turn, in turn order
    ask(url, model, turn, pacing, server=0)  -> one turn's ``Answer`` from one server
    Router(kind, servers).pick(turn, in_flight) -> the server a turn goes to

A turn is sent once (1) the turn it continues has been answered (a session's
next turn waits for its previous answer, as a user or an agent does), (2) its
arrival time, divided by ``speedup``, has passed (``speedup`` None: at once),
and (3) fewer than ``concurrency`` requests are in flight (None: no cap); ready
turns go in trace order. A failed turn counts as answered: its session goes on.

Routers: ``round-robin`` (the n-th request sent goes to server n mod K: what a
plain load balancer does, and the hardest case for per-server caches),
``session`` (every turn of a session to one server, sessions dealt round-robin:
a cache-aware router) and ``least-loaded`` (the server with the fewest requests
in flight, the lowest index on a tie).

Each request is one streamed greedy completion of the turn's token ids
(``ignore_eos``: exactly ``output_tokens`` tokens), its text and logprobs kept.
TTFT is the time from sending it to its first streamed token; the prompt tokens the server found
cached come from the usage of its last event (vLLM's
``--enable-prompt-tokens-details``). A request that fails (an HTTP error, a
broken stream, ``timeout_s``) is an ``Answer`` with ``error`` set, never an
exception: the replay always finishes.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvpool.bench.trace import Turn

__all__ = ["ROUTERS", "Answer", "Pacing", "Router", "ask", "replay"]

ROUTERS = ("round-robin", "session", "least-loaded")


@dataclass(frozen=True, slots=True)
class Pacing:
    """How the turns are sent (see the module docstring)."""

    block_tokens: int = 32  # the scaled block size the turns' prompts are made at
    output_tokens: int = 8
    router: str = "round-robin"
    concurrency: int | None = None
    speedup: float | None = None  # None: no arrival times, only the other rules
    timeout_s: float = 600.0


@dataclass(frozen=True, slots=True)
class Answer:
    turn: int
    server: int
    sent_s: float  # from the replay's start
    ttft_s: float | None  # None when it failed before its first token
    e2e_s: float | None  # None when it failed
    prompt_tokens: int
    cached_tokens: int  # as the server's usage says (its own cache and the pool)
    output_tokens: int
    error: str | None = None
    text: str = ""
    logprobs: tuple[float, ...] = ()  # of each generated token


class Router:
    """Picks a server per turn. Not thread-safe: the replay calls it from one thread."""

    def __init__(self, kind: str, servers: int) -> None:
        if kind not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {kind!r}")
        if servers < 1:
            raise ValueError("a fleet needs at least one server")
        self.kind, self.servers = kind, servers
        self._sent = 0
        self._sessions: dict[int, int] = {}

    def pick(self, turn: Turn, in_flight: Sequence[int]) -> int:
        if self.kind == "round-robin":
            server = self._sent % self.servers
        elif self.kind == "session":
            server = self._sessions.setdefault(turn.session, len(self._sessions) % self.servers)
        else:
            server = min(range(self.servers), key=lambda s: (in_flight[s], s))
        self._sent += 1
        return server


def replay(turns: Sequence[Turn], urls: Sequence[str], model: str, pacing: Pacing) -> list[Answer]:
    """Send every turn (see the module docstring); one ``Answer`` per turn, in order."""
    router = Router(pacing.router, len(urls))
    answers: dict[int, Answer] = {}
    in_flight = [0] * len(urls)
    pending = list(turns)  # trace order
    done = threading.Condition()
    start = time.monotonic()
    workers = pacing.concurrency or max(1, len(turns))

    def send(turn: Turn, server: int, sent: float) -> None:
        answer = ask(urls[server], model, turn, pacing, server, sent)
        with done:
            answers[turn.index] = answer
            in_flight[server] -= 1
            done.notify_all()

    executor = ThreadPoolExecutor(max_workers=min(workers, 64), thread_name_prefix="replay")
    with executor as pool, done:
        while pending:
            now = time.monotonic() - start
            busy = sum(in_flight)
            wake: float | None = None
            for turn in list(pending):
                if pacing.concurrency is not None and busy >= pacing.concurrency:
                    break
                if turn.parent is not None and turn.parent not in answers:
                    continue
                due = turn.arrival_s / pacing.speedup if pacing.speedup else 0.0
                if due > now:
                    wake = due if wake is None else min(wake, due)
                    continue
                server = router.pick(turn, in_flight)
                in_flight[server] += 1
                busy += 1
                pending.remove(turn)
                pool.submit(send, turn, server, now)
            if pending:
                # An answer (or the next arrival) is the event that may free a turn.
                done.wait(None if wake is None else max(0.0, wake - now))
    return [answers[t.index] for t in turns]


def ask(
    url: str, model: str, turn: Turn, pacing: Pacing, server: int = 0, sent: float = 0.0
) -> Answer:
    """One streamed completion of ``turn`` from the server at ``url`` (see the module
    docstring); ``server`` and ``sent`` are only recorded."""
    ids = turn.token_ids(pacing.block_tokens)
    body = json.dumps(
        {
            "model": model,
            "prompt": ids,
            "max_tokens": pacing.output_tokens,
            "temperature": 0.0,
            "logprobs": 1,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    parts = urllib.parse.urlsplit(url)
    t0 = time.monotonic()
    ttft: float | None = None
    usage: dict[str, object] = {}
    tokens = 0
    text: list[str] = []
    logprobs: list[float] = []

    def failed(why: str) -> Answer:
        return Answer(turn.index, server, sent, ttft, None, len(ids), 0, tokens, why)

    conn = http.client.HTTPConnection(
        parts.hostname or "127.0.0.1", parts.port, timeout=pacing.timeout_s
    )
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return failed(f"HTTP {resp.status}: {resp.read(300).decode(errors='replace')}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices") or ():
                if ttft is None:
                    ttft = time.monotonic() - t0
                text.append(choice.get("text") or "")
                logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or ()
                tokens = len(logprobs)
            if event.get("usage"):
                usage = event["usage"]
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return failed(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    if ttft is None:
        return failed("the stream ended before a token")
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Answer(
        turn.index,
        server,
        sent,
        ttft,
        time.monotonic() - t0,
        int(usage.get("prompt_tokens") or len(ids)),  # type: ignore[call-overload]
        int(cached or 0),
        int(usage.get("completion_tokens") or tokens),  # type: ignore[call-overload]
        text="".join(text),
        logprobs=tuple(logprobs),
    )

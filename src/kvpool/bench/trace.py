"""Request traces in Mooncake's FAST'25 format: parse, sessions, prompts, reuse references.

    read_trace(path) / parse_trace(lines, source)
                                  (``.gz``: gzip)
                                  -> [TraceRequest]: one JSON object a line
                                     (``timestamp`` ms, ``input_length``,
                                     ``output_length``, ``hash_ids``); TraceError
                                     naming the line and what to fix otherwise
    link_sessions(requests)       -> per request, the earlier turn it continues
                                     (its parent) or None
    select(requests, sample)      -> the requests of the sessions a ``Sample``
                                     keeps, in trace order, as ``Turn`` s: token
                                     prompts at the scaled block size, parents
                                     re-indexed
    reuse(turns, block_tokens, capacity_blocks=None)
                                  -> per turn, prompt tokens an ideal cache (every
                                     whole block computed earlier) or an LRU cache
                                     of ``capacity_blocks`` blocks would serve
    reuse_after(turns, block_tokens, sent, finished)
                                  -> per turn, what turns answered before it was
                                     sent had computed (a replay's actual order)

A hash id names one block of ``trace_block`` (512) prompt tokens; two requests
whose lists start alike share those blocks. Scaled to ``block_tokens`` (say 32)
a block becomes that many token ids drawn from a generator seeded by the id, so
requests share exactly the prefixes the trace says; a prompt is cut to its
scaled input length. Sessions with a prompt longer than ``max_prompt`` are
left out whole: cut, a long session's later turns would all be one prompt,
reused in full.

A *session* is a conversation: a request continues the earlier request whose
whole prompt but its last (partial) block starts its own, the longest such
(its previous turn), if that part is at least ``MIN_SHARED`` blocks; the bench
sends a turn only after its parent's answer. Requests that share only a short
common prefix (the conversation trace starts every prompt with one block, a
system prompt) are separate sessions: with one block enough, 12,007 of its
12,031 requests fell into one session.

The references count what a cache could serve in trace order, as vLLM counts
a hit: whole blocks only, a block only after every block before it, and never
the prompt's last token (vLLM computes at least one). ``reuse`` with no
capacity is the ideal (an infinite cache); with one, an LRU cache of that many
blocks, a request's blocks used last block first (a prefix loses its end first).
Pure: no I/O beyond ``read_trace``.
"""

from __future__ import annotations

import gzip
import json
import random
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpool.errors import KVPoolError

__all__ = [
    "Sample",
    "TraceError",
    "TraceRequest",
    "Turn",
    "link_sessions",
    "parse_trace",
    "read_trace",
    "reuse",
    "reuse_after",
    "select",
]

TRACE_BLOCK = 512  # tokens per hash id in Mooncake's traces
MIN_SHARED = 2  # blocks a turn shares with the turn it continues, at least
VOCAB = (10, 1000)  # token ids drawn in [low, high): the bench's random models' vocabulary


class TraceError(KVPoolError):
    """A trace file that is not in the expected format; the message says where."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_trace(lines: Iterable[str], source: str = "trace") -> list[TraceRequest]:
    """One request per non-empty line; ``TraceError`` names the first bad line."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}, line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in ("timestamp", "input_length", "hash_ids") if k not in obj]
        if missing:
            raise TraceError(
                f"{where}: missing {', '.join(missing)} (each line needs timestamp, "
                "input_length, hash_ids; output_length is optional)"
            )
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
            raise TraceError(f"{where}: hash_ids must be a non-empty list of integers")
        fields = {k: obj.get(k, 0) for k in ("timestamp", "input_length", "output_length")}
        for k, v in fields.items():
            if not (_is_int(v) or (isinstance(v, float) and v.is_integer())) or v < 0:
                raise TraceError(f"{where}: {k} must be a non-negative integer, got {v!r}")
        if fields["input_length"] < 1:
            raise TraceError(f"{where}: input_length must be at least 1")
        out.append(
            TraceRequest(
                int(fields["timestamp"]),
                int(fields["input_length"]),
                int(fields["output_length"]),
                tuple(ids),
            )
        )
    if not out:
        raise TraceError(f"{source}: no requests")
    return out


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_trace(path: str | Path) -> list[TraceRequest]:
    """``parse_trace`` of a file; one whose name ends in ``.gz`` is read through gzip."""
    try:
        if str(path).endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return parse_trace(f, str(path))
        with open(path, encoding="utf-8") as f:
            return parse_trace(f, str(path))
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None


def link_sessions(requests: Sequence[TraceRequest]) -> list[int | None]:
    """Per request, the index of the earlier request it continues (see the module
    docstring), or None. Linear in the trace's hash ids (a trie of prompts)."""
    trie = _Trie()
    ends: dict[int, int] = {}  # node -> the latest request whose body (all but its last) ends there
    parents: list[int | None] = []
    for i, r in enumerate(requests):
        body = trie.nodes(r.hash_ids[:-1])  # a parent's body is a proper prefix of this prompt
        parents.append(next((ends[n] for n in reversed(body) if n in ends), None))
        if len(body) >= MIN_SHARED:
            ends[body[-1]] = i
    return parents


@dataclass(frozen=True, slots=True)
class Sample:
    """Which part of a trace to replay, and at what scale."""

    block_tokens: int = 32  # tokens per hash id in the replay (the trace's 512, scaled)
    start_s: float = 0.0  # sessions whose first request arrives in [start, start + duration)
    duration_s: float | None = None  # None: to the trace's end
    sessions: int | None = None  # keep this many of them (seeded sample); None: all
    min_turns: int = 1  # only sessions of at least this many requests
    max_prompt: int | None = None  # leave out sessions with a longer prompt (after scaling)
    seed: int = 0
    trace_block: int = TRACE_BLOCK


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of the replay."""

    index: int  # in the replay, trace order
    trace_index: int  # in the trace file (0-based line of a request)
    arrival_s: float  # from the first kept request's arrival
    session: int  # the replay index of the session's first request
    parent: int | None  # the replay index of the turn this one continues
    hash_ids: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int  # as the trace says (the bench may send fewer)

    def token_ids(self, block_tokens: int) -> list[int]:
        """The prompt: each hash id's own ``block_tokens`` ids, cut to its length."""
        ids: list[int] = []
        for h in self.hash_ids:
            if len(ids) >= self.prompt_tokens:
                break
            rng = random.Random(h)
            ids += [rng.randrange(*VOCAB) for _ in range(block_tokens)]
        return ids[: self.prompt_tokens]


def select(requests: Sequence[TraceRequest], sample: Sample) -> list[Turn]:
    """The turns ``sample`` keeps (whole sessions), in trace order."""
    if sample.block_tokens < 1 or sample.trace_block < 1:
        raise ValueError("block sizes must be at least 1 token")
    parents = link_sessions(requests)
    roots: list[int] = []
    for i, p in enumerate(parents):
        roots.append(i if p is None else roots[p])
    t0 = requests[0].timestamp_ms
    members: dict[int, list[int]] = {}
    for i, root in enumerate(roots):
        members.setdefault(root, []).append(i)
    end = None if sample.duration_s is None else sample.start_s + sample.duration_s
    scale = sample.block_tokens / sample.trace_block

    def length(r: TraceRequest) -> int:
        return max(1, min(round(r.input_length * scale), len(r.hash_ids) * sample.block_tokens))

    kept = [
        root
        for root, idx in members.items()
        if len(idx) >= sample.min_turns
        and (requests[root].timestamp_ms - t0) / 1000 >= sample.start_s
        and (end is None or (requests[root].timestamp_ms - t0) / 1000 < end)
        and (
            sample.max_prompt is None or max(length(requests[i]) for i in idx) <= sample.max_prompt
        )
    ]
    if sample.sessions is not None and sample.sessions < len(kept):
        kept = random.Random(sample.seed).sample(kept, sample.sessions)
    chosen = sorted(i for root in kept for i in members[root])
    if not chosen:
        raise TraceError(
            "no session of the trace matches the sample (window, min turns, max prompt): widen it"
        )
    first = requests[chosen[0]].timestamp_ms
    index = {t: n for n, t in enumerate(chosen)}
    turns = []
    for n, t in enumerate(chosen):
        r = requests[t]
        parent = parents[t]
        turns.append(
            Turn(
                index=n,
                trace_index=t,
                arrival_s=(r.timestamp_ms - first) / 1000,
                session=index[roots[t]],
                parent=None if parent is None else index[parent],
                hash_ids=r.hash_ids,
                prompt_tokens=length(r),
                output_tokens=r.output_length,
            )
        )
    return turns


class _Trie:
    """Prefixes of hash-id lists as nodes: equal prefixes, one node."""

    def __init__(self) -> None:
        self._children: list[dict[int, int]] = [{}]

    def nodes(self, ids: Sequence[int]) -> list[int]:
        """The node of each prefix of ``ids``, shortest first (made where missing)."""
        out: list[int] = []
        node = 0
        for h in ids:
            nxt = self._children[node].get(h)
            if nxt is None:
                nxt = len(self._children)
                self._children.append({})
                self._children[node][h] = nxt
            node = nxt
            out.append(node)
        return out


def _whole_blocks(trie: _Trie, turn: Turn, block_tokens: int) -> list[int]:
    """The nodes of ``turn``'s whole blocks, first block first."""
    return trie.nodes(turn.hash_ids[: turn.prompt_tokens // block_tokens])


def _hit(turn: Turn, nodes: Sequence[int], cached: Container[int], block_tokens: int) -> int:
    """Tokens of the leading blocks in ``cached``, never the prompt's last token."""
    usable = min((turn.prompt_tokens - 1) // block_tokens, len(nodes))
    hit = 0
    while hit < usable and nodes[hit] in cached:
        hit += 1
    return hit * block_tokens


def reuse(
    turns: Sequence[Turn], block_tokens: int, capacity_blocks: int | None = None
) -> list[int]:
    """Per turn, in order, the prompt tokens a cache serves (see the module
    docstring): every whole block computed earlier (``capacity_blocks`` None), or
    what an LRU cache of that many blocks still holds."""
    trie = _Trie()
    cached: OrderedDict[int, None] = OrderedDict()  # node -> None, least recent first
    out = []
    for t in turns:
        nodes = _whole_blocks(trie, t, block_tokens)
        out.append(_hit(t, nodes, cached, block_tokens))
        for node in reversed(nodes):  # the first block used last: evicted last
            cached[node] = None
            cached.move_to_end(node)
        if capacity_blocks is not None:
            while len(cached) > capacity_blocks:
                cached.popitem(last=False)
    return out


def reuse_after(
    turns: Sequence[Turn],
    block_tokens: int,
    sent: Sequence[float],
    finished: Sequence[float | None],
) -> list[int]:
    """Per turn, the prompt tokens of whole blocks that turns answered before it was
    sent (``finished`` earlier than its ``sent`` time; None: never answered) had
    computed: what a cache with instant saves could have served it."""
    trie = _Trie()
    nodes = [_whole_blocks(trie, t, block_tokens) for t in turns]
    done = sorted((f, i) for i, f in enumerate(finished) if f is not None)
    computed: set[int] = set()
    out = [0] * len(turns)
    d = 0
    for i in sorted(range(len(turns)), key=lambda i: sent[i]):
        while d < len(done) and done[d][0] <= sent[i]:
            computed.update(nodes[done[d][1]])
            d += 1
        out[i] = _hit(turns[i], nodes[i], computed, block_tokens)
    return out

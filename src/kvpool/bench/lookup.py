"""Lookup latency as the scheduler sees it, over the socket, against a real pool.

    LAYOUTS                                 named layouts the bench knows
    TARGETS_MS                              p50 targets per (layout, prompt tokens)
    run_lookup_bench(config, ...) -> LookupBench   measure; prints nothing

For each layout and prompt length (tokens), it writes the keys of a prompt's
chunks (64-byte objects), starts a ``LookupServer`` on a thread of this
process (as the connector does) on a temporary IPC endpoint, and times
``LookupClient.lookup`` calls with ``time.perf_counter``, in turn: a full hit
(every chunk present), a partial hit (the first 5/8 of the chunks present,
then chunks never written) and a miss (no chunk written). Every answer is
checked. One untimed warm-up round first. Then the same lookups are answered
again in this thread without the socket (``LookupAnswers.answer`` on an encoded
request, ``direct_p50_ms``): the socket's share is the difference. The
connector keeps the socket even inside one process, for its deadline
(``kvpool.vllm.connector``). ``keys`` is what probing every key
would cost (``(prompt - 1) // chunk_size`` chunks times the layout's
namespaces); the server's search (``lookup.search``) probes fewer.

Per lookup it also reports the server's ``batch_exists`` calls (its search
rounds; at most ``search.MAX_ROUNDS``), the store's share of the latency (the
median time of one call), and the store round trips: the master's own counter
``master_batch_exist_key_requests_total`` over the timed lookups (None if the
pool has no metrics URL). On a shared pool, other clients' probes inflate it.
Written keys are removed (forced) after each case.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvpool.config import PoolConfig
from kvpool.errors import StoreError
from kvpool.keys import KeySpace, lookup_endpoint
from kvpool.layout import Layout
from kvpool.plan import chunk_hashes, probe_keys
from kvpool.pool import master_metrics
from kvpool.store.base import KVStore, Status
from kvpool.store.mooncake import MooncakeStore
from kvpool.store.scatter import Segments

if TYPE_CHECKING:
    from kvpool.lookup.answers import LookupAnswers
    from kvpool.lookup.client import LookupClient
    from kvpool.lookup.server import LookupServer

__all__ = [
    "DEFAULT_PROMPTS",
    "LAYOUTS",
    "TARGETS_MS",
    "LookupBench",
    "LookupCase",
    "run_lookup_bench",
]

DEFAULT_PROMPTS = (1024, 3072, 32768, 131072)
LAYOUTS: dict[str, Layout] = {
    # Keys per chunk (one per KV head and token class); a search probes one per class.
    "tp1": Layout.create(tp=1, groups=("gqa:8",)),  # 8 keys, 1 class
    "tp8-mla-dcp2": Layout.create(tp=8, dcp=2, groups=("mla",)),  # 2 keys, 2 classes
    "tp8-gqa8": Layout.create(tp=8, groups=("gqa:8",)),  # 8 keys, 1 class
}
# p50 targets (every lookup kind), ms: a 3k prompt within a millisecond, long
# contexts within a few.
TARGETS_MS: dict[tuple[str, int], float] = {
    ("tp1", 3072): 1.0,
    ("tp1", 32768): 1.0,
    ("tp1", 131072): 3.0,
    ("tp8-gqa8", 32768): 3.0,
}
_KINDS = ("hit", "partial", "miss")
_EXISTS_RPCS = "master_batch_exist_key_requests_total"
_OBJECT = np.ones(64, dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class LookupCase:
    """One layout and prompt length. Latencies in milliseconds, client side."""

    layout: str  # a LAYOUTS name
    prompt_tokens: int
    keys: int  # keys of the prompt's chunks: what probing every key would check
    keys_probed: float  # per lookup, mean over every kind
    hit_p50_ms: float
    partial_p50_ms: float
    miss_p50_ms: float
    p99_ms: float  # over every kind
    store_p50_ms: float  # median duration of one batch_exists call of the server
    direct_p50_ms: float  # every kind, answered in this thread without the socket
    exists_calls_max: int  # the most batch_exists calls (search rounds) of one lookup
    round_trips_per_lookup: float | None  # master's batch-exist RPCs; None without metrics
    failures: int  # lookups whose answer was not the expected one

    @property
    def target_ms(self) -> float | None:
        """The p50 target of this row, if it has one (``TARGETS_MS``)."""
        return TARGETS_MS.get((self.layout, self.prompt_tokens))

    @property
    def on_target(self) -> bool | None:
        """Every kind's p50 within the target; None without one."""
        target = self.target_ms
        if target is None:
            return None
        return max(self.hit_p50_ms, self.partial_p50_ms, self.miss_p50_ms) <= target


@dataclass(frozen=True, slots=True)
class LookupBench:
    cases: tuple[LookupCase, ...]
    master_address: str
    chunk_size: int
    lookups: int  # timed lookups per case (half hits, half misses)


class _TimedStore(KVStore):
    """Passes each ``batch_exists`` whole to ``inner`` and times it."""

    max_batch = max_key_batch = sys.maxsize

    def __init__(self, inner: KVStore) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0
        self.seconds: list[float] = []

    def _exists(self, keys: Sequence[str]) -> list[Status]:
        start = time.perf_counter()
        out = self.inner.batch_exists(keys)
        self.seconds.append(time.perf_counter() - start)
        self.calls += 1
        return out

    def _put(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        return self.inner.batch_put(keys, segments)

    def _put_pinned(
        self, keys: Sequence[str], segments: Sequence[Segments], pin_ms: int
    ) -> list[Status]:
        return self.inner.batch_put(keys, segments, pin_ms)

    def _get(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        return self.inner.batch_get(keys, segments)

    def _remove(self, keys: Sequence[str], force: bool) -> list[Status]:
        return self.inner.batch_remove(keys, force)


def _ms(seconds: Sequence[float], q: float) -> float:
    ordered = sorted(seconds)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _exists_rpcs(config: PoolConfig) -> float | None:
    if not config.metrics_url:
        return None
    return master_metrics(config.metrics_url).get(_EXISTS_RPCS)


def run_lookup_bench(
    config: PoolConfig,
    prompts: Sequence[int] = DEFAULT_PROMPTS,
    layouts: Sequence[str] = tuple(LAYOUTS),
    chunk_size: int = 16,
    lookups: int = 400,
) -> LookupBench:
    """Measure every layout and prompt length; raises ``StoreError`` if the pool
    cannot be used, ``ValueError`` for an unknown layout or a bad size."""
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise ValueError(f"unknown layout(s) {unknown}; known: {', '.join(LAYOUTS)}")
    if chunk_size < 1 or lookups < 2 or any(p <= chunk_size for p in prompts):
        raise ValueError("need chunk_size >= 1, lookups >= 2 and prompts longer than a chunk")
    store = MooncakeStore(config)
    try:
        cases = tuple(
            _case(store, config, name, prompt, chunk_size, lookups)
            for name in layouts
            for prompt in prompts
        )
    finally:
        store.close()
    return LookupBench(cases, config.master_address, chunk_size, lookups)


@contextlib.contextmanager
def _service(
    store: KVStore, layout: Layout, space: KeySpace, chunk_size: int
) -> Iterator[tuple[LookupClient, LookupServer]]:
    # pyzmq is an optional extra: imported only when measuring, not by `kvpool --help`.
    from kvpool.lookup.client import LookupClient
    from kvpool.lookup.server import LookupServer

    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as run_dir:
        endpoint = lookup_endpoint(run_dir, "bench", layout.dp_index)
        server = LookupServer(endpoint, store, layout, space, chunk_size)
        server.start()
        client = LookupClient(endpoint, timeout_ms=1000.0)
        try:
            yield client, server
        finally:
            client.close()
            server.close()


@dataclass(slots=True)
class _Direct:
    seconds: list[float]
    answers: list[tuple[str, int]]  # (kind, hit tokens)


def _direct(
    answers: LookupAnswers, prompts: dict[str, tuple[list[bytes], int]], prompt: int, lookups: int
) -> _Direct:
    """The same lookups answered in this thread, no socket: encode, answer, read."""
    from kvpool.lookup import wire

    out = _Direct([], [])
    for i in range(lookups):
        kind = _KINDS[i % len(_KINDS)]
        start = time.perf_counter()
        frame = wire.encode_request(wire.PackedLookup.pack(i, f"d{i}", prompts[kind][0], prompt))
        reply = answers.answer(frame)
        out.seconds.append(time.perf_counter() - start)
        out.answers.append((kind, reply.hit_tokens if isinstance(reply, wire.LookupReply) else -1))
    return out


def _case(
    store: MooncakeStore,
    config: PoolConfig,
    name: str,
    prompt: int,
    chunk_size: int,
    lookups: int,
) -> LookupCase:
    layout = LAYOUTS[name]
    space = KeySpace.create(
        model="kvpool-bench/lookup",
        layout=layout,
        kv_dtype="bfloat16",
        model_dtype="bfloat16",
        chunk_size=chunk_size,
        head_size=128,
        num_layers=1,
        extra={"run": uuid.uuid4().hex},  # a key space of its own
    )
    chunks = prompt // chunk_size
    usable = (prompt - 1) // chunk_size
    hit_hashes = chunk_hashes(chunks, seed=b"hit" + space.fingerprint.encode())
    miss_hashes = chunk_hashes(chunks, seed=b"miss" + space.fingerprint.encode())
    part = usable * 5 // 8
    prompts = {
        "hit": (hit_hashes, usable * chunk_size),
        "partial": (hit_hashes[:part] + miss_hashes[part:], part * chunk_size),
        "miss": (miss_hashes, 0),
    }
    written = [k for ks in probe_keys(layout, space, hit_hashes) for k in ks]
    segment = [(_OBJECT.ctypes.data, _OBJECT.nbytes)]
    try:
        if not all(s.stored for s in store.batch_put(written, [segment] * len(written))):
            raise StoreError(f"could not write the bench's keys to {config.master_address}")
        timed = _TimedStore(store)
        times: dict[str, list[float]] = {kind: [] for kind in _KINDS}
        failures = calls_max = 0
        with _service(timed, layout, space, chunk_size) as (client, server):
            for kind in _KINDS:  # warm-up: connect, first RPCs
                client.lookup("warm", prompts[kind][0], prompt)
            timed.calls, timed.seconds = 0, []
            probed_before = server.stats.keys_probed
            before = _exists_rpcs(config)
            for i in range(lookups):
                kind = _KINDS[i % len(_KINDS)]
                hashes, expected = prompts[kind]
                calls = timed.calls
                start = time.perf_counter()
                answer = client.lookup(f"r{i}", hashes, prompt)
                times[kind].append(time.perf_counter() - start)
                calls_max = max(calls_max, timed.calls - calls)
                failures += answer != expected
            after = _exists_rpcs(config)
            probed = (server.stats.keys_probed - probed_before) / lookups
            direct = _direct(server, prompts, prompt, lookups)
            failures += sum(hit != prompts[kind][1] for kind, hit in direct.answers)
    finally:
        store.batch_remove(written, force=True)
    round_trips = (after - before) / lookups if before is not None and after is not None else None
    every = [t for kind in _KINDS for t in times[kind]]
    return LookupCase(
        layout=name,
        prompt_tokens=prompt,
        keys=usable * len(probe_keys(layout, space, [b"\x01"])[0]),
        keys_probed=probed,
        hit_p50_ms=_ms(times["hit"], 0.5),
        partial_p50_ms=_ms(times["partial"], 0.5),
        miss_p50_ms=_ms(times["miss"], 0.5),
        p99_ms=_ms(every, 0.99),
        store_p50_ms=1000 * statistics.median(timed.seconds) if timed.seconds else 0.0,
        direct_p50_ms=_ms(direct.seconds, 0.5),
        exists_calls_max=calls_max,
        round_trips_per_lookup=round_trips,
        failures=failures,
    )

"""The fault matrix: one row per fault, each against a fresh real pool.

    ROWS                         every row, in run order: name, fault, promise
    ChaosContext(workdir)        what the rows share, made once: a tiny random Llama,
                                 prompt families, the outputs of a run *without* the
                                 connector (the baseline), and the objects a clean
                                 engine saved (seeded into each row's pool)
    run_row(ctx, row) -> Outcome one row on its own pool, stopped afterwards
    run_matrix(workdir, names=None, progress=None) -> list[Outcome]

The promise every engine row checks: the engine process stays up, every request
completes, its greedy tokens and logprobs equal the baseline's, the fault shows
in the connector's counters or log with its cause, and, where the fault ends,
service recovers (new saves land in the pool, or a fresh engine hits again).
A failed check raises ``RowFailed``; ``run_row`` turns it into a failed Outcome.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.demo.run import distinct_chunks, outputs_match
from kvpool.demo.session import EngineFailed, EngineSession
from kvpool.demo.tiny_model import build_tiny_llama
from kvpool.errors import ConfigError, KVPoolError
from kvpool.keys import lookup_endpoint, parse_key
from kvpool.pool import LocalPool, master_keys, master_metrics, wait_until

__all__ = ["ROWS", "ChaosContext", "Outcome", "Row", "RowFailed", "run_matrix", "run_row"]

logger = logging.getLogger(__name__)

PREFIX = 256  # shared tokens per prompt family (8 chunks of 32)
FAMILIES = 6
FAULTS = "kvpool.chaos.faults"
Progress = Callable[[str, int, int], None]


class RowFailed(AssertionError):
    """A promise of the row did not hold; the message says which and how."""


@dataclass(frozen=True, slots=True)
class Outcome:
    row: str
    fault: str
    expected: str
    passed: bool
    observed: str  # what happened (figures), or why the row failed
    seconds: float


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    fault: str
    expected: str
    run: Callable[[ChaosContext, RowEnv], str]  # returns what was observed
    engines: int  # vLLM engine processes the row starts (for time estimates)


def families(seed: int = 7) -> list[list[list[int]]]:
    """``FAMILIES`` families of two prompts; a family shares a ``PREFIX``-token prefix."""
    rng = random.Random(seed)
    out = []
    for _ in range(FAMILIES):
        shared = [rng.randrange(10, 1000) for _ in range(PREFIX)]
        out.append(
            [shared + [rng.randrange(10, 1000) for _ in range(40 + 7 * i)] for i in range(2)]
        )
    return out


@dataclass
class ChaosContext:
    """Shared by all rows; ``prepare`` makes the model, baseline and seed once."""

    workdir: Path
    progress: Progress = field(default=lambda *_: None)
    model: Path = field(init=False)
    families: list[list[list[int]]] = field(init=False, default_factory=families)
    baseline: dict[tuple[int, ...], dict[str, Any]] = field(init=False, default_factory=dict)
    seed: dict[str, bytes] = field(init=False, default_factory=dict)
    _ready: bool = field(init=False, default=False)

    def prepare(self) -> None:
        if self._ready:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model = build_tiny_llama(self.workdir / "model")
        prompts = [p for fam in self.families for p in fam]
        base = self.run_engine(self.spec(None, [prompts], connector="none"), "baseline")
        for ids, result in zip(prompts, base["results"], strict=True):
            self.baseline[tuple(ids)] = result
        # Objects of families 0 and 1 as a clean engine saves them.
        with contextlib.ExitStack() as stack:
            pool = LocalPool.start(self.workdir / "seed-pool", segment_size=256 << 20)
            stack.callback(pool.stop)
            seed_prompts = self.families[0] + self.families[1]
            self.run_engine(self.spec(pool, [seed_prompts]), "seed")
            wanted = distinct_chunks(seed_prompts)
            wait_until(lambda: len(_keys(pool)) >= wanted, 30.0)
            with _raw_client(pool) as raw:
                for key in _keys(pool):
                    value = raw.get(key)
                    if value:
                        self.seed[key] = bytes(value)
        if not self.seed:
            raise RowFailed("the seed engine saved nothing to the pool")
        self._ready = True

    # -- building blocks for rows ----------------------------------------------

    def spec(
        self,
        pool: LocalPool | None,
        phases: Sequence[Sequence[Sequence[int]]],
        connector: str = "kvpool",
        hold: bool = False,
        **extra: Any,
    ) -> dict[str, Any]:
        """An engine spec running ``phases`` (lists of prompts) on ``pool``."""
        dtype = extra.pop("dtype", None)
        spec: dict[str, Any] = {
            "model": str(self.model),
            "phases": [[list(p) for p in phase] for phase in phases],
            "max_tokens": 8,
            "connector": connector,
            "block_size": 32,
            "hold": hold,
        }
        if connector == "kvpool":
            pool_file = extra.pop("pool_file", None)
            if pool_file is None and pool is not None:
                pool_file = str(pool.write_pool_file(pool.home / "pool.json"))
            # Rows assert hits and misses, not lookup latency: a loaded machine must not
            # turn a slow lookup into a miss (a row that tests the deadline sets its own).
            spec["extra"] = {"pool_file": pool_file, "lookup_timeout_ms": 2000, **extra}
        if dtype:
            spec["dtype"] = dtype
        return spec

    def session(self, spec: dict[str, Any], name: str, **env: str) -> EngineSession:
        return EngineSession.start(spec, self.workdir / "engines", name, env=env)

    def run_engine(self, spec: dict[str, Any], name: str, **env: str) -> dict[str, Any]:
        """Run every phase of ``spec`` without interruption; the final result."""
        return EngineSession.run(spec, self.workdir / "engines", name, env=env)

    def check_outputs(
        self, results: Sequence[dict[str, Any]], prompts: Sequence[Sequence[int]]
    ) -> None:
        """Every result equals the baseline's for its prompt (tokens, logprobs)."""
        if len(results) != len(prompts):
            raise RowFailed(f"{len(results)} results for {len(prompts)} prompts")
        bad = [
            i
            for i, (r, p) in enumerate(zip(results, prompts, strict=True))
            if not outputs_match(r, self.baseline[tuple(p)])
        ]
        if bad:
            raise RowFailed(f"outputs differ from the baseline for prompt(s) {bad}")

    def seed_pool(
        self, pool: LocalPool, transform: Callable[[str, bytes], bytes] | None = None
    ) -> int:
        """Put the seed objects into ``pool`` (optionally altered); how many."""
        with _raw_client(pool) as raw:
            for key, value in self.seed.items():
                data = transform(key, value) if transform else value
                if raw.put(key, data) != 0:
                    raise RowFailed(f"could not seed {key}")
        return len(self.seed)


@dataclass
class RowEnv:
    """One row's own pools (stopped when the row ends) and work folder."""

    ctx: ChaosContext
    name: str
    pools: list[LocalPool] = field(default_factory=list)

    def pool(
        self, segment_size: int = 64 << 20, client_ttl: int = 2, lease_ttl_ms: int = 1000
    ) -> LocalPool:
        pool = LocalPool.start(
            self.ctx.workdir / self.name / f"pool{len(self.pools)}",
            segment_size=segment_size,
            client_ttl=client_ttl,
            lease_ttl_ms=lease_ttl_ms,
        )
        self.pools.append(pool)
        return pool


# -- helpers ----------------------------------------------------------------------


@contextlib.contextmanager
def _raw_client(pool: LocalPool) -> Iterator[Any]:
    """A plain Mooncake client of ``pool`` (bytes in, bytes out), closed afterwards."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", pool.master_address)
    if rc != 0:
        raise RowFailed(f"cannot connect a client to {pool.master_address} (rc {rc})")
    try:
        yield store
    finally:
        store.close()


def _count(log: str, needle: str) -> int:
    return sum(1 for line in log.splitlines() if needle in line)


def _counts(by_cause: dict[str, int] | None) -> str:
    """``{"missing": 2, "corrupt": 1}`` -> "1 corrupt, 2 missing" ("none" if empty)."""
    return ", ".join(f"{n} {cause}" for cause, n in sorted((by_cause or {}).items())) or "none"


def _failures(stats: dict[str, Any]) -> str:
    return _counts(stats.get("failures"))


def _keys(pool: LocalPool) -> list[str]:
    """The pool's kvpool keys (``kvpool/...``), not other clients' keys."""
    return [k for k in master_keys(pool.metrics_url) if k.startswith("kvpool/")]


def _run_until_saved(
    s: EngineSession, pool: LocalPool, phases: int, before: set[str]
) -> tuple[int, float]:
    """Run up to ``phases`` more phases until keys not in ``before`` reach the
    pool; (new keys, seconds). Saves may be paused by back-off after a fault."""
    t0 = time.monotonic()
    for _ in range(phases):
        s.next_phase()
        if wait_until(lambda: bool(set(_keys(pool)) - before), 3.0):
            break
    new = set(_keys(pool)) - before
    return len(new), time.monotonic() - t0


# -- rows -------------------------------------------------------------------------


def _master_restart(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    ctx.seed_pool(pool)
    f = ctx.families
    spec = ctx.spec(pool, [f[0], f[2], f[3], f[4], f[5]])
    with ctx.session(spec, "master-restart") as s:
        p0 = s.next_phase()
        ctx.check_outputs(p0["results"], f[0])
        hit = p0["results"][0]["cached_tokens"]
        pool.kill_master()
        p1 = s.next_phase()
        ctx.check_outputs(p1["results"], f[2])
        misses = p1["connector"].get("lookup_failures") or {}
        pool.restart_master()
        new, secs = _run_until_saved(s, pool, 3, set())
        log = s.log()
        s.finish()
    if hit < PREFIX:
        raise RowFailed(f"the seeded prefix was not loaded before the fault ({hit} tokens)")
    if not misses:  # the fault must show where an operator looks: lookups failed
        raise RowFailed("the master was down, yet no lookup was counted as failed")
    if not new:
        raise RowFailed("no save reached the restarted master")
    causes = _counts(misses)
    return (
        f"before: {hit} tokens from the pool; master down: outputs equal, lookups that "
        f"failed: {causes}, {_count(log, 'pool put failed')} put back-offs; restarted: "
        f"{new} objects saved within {secs:.1f} s"
    )


def _holder_killed(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    ctx.seed_pool(pool)
    f = ctx.families
    spec = ctx.spec(pool, [f[0], f[2], f[3], f[4]], hold=True)
    with ctx.session(spec, "holder-killed") as s:
        s.ready()
        pool.kill_holder()
        p0 = s.next_phase()
        ctx.check_outputs(p0["results"], f[0])
        stats = p0["connector"]
        pool.restart_holder()
        new, secs = _run_until_saved(s, pool, 3, set(_keys(pool)))
        s.finish()
    if not stats.get("failures"):  # its objects were on the dead holder: loads failed
        raise RowFailed(f"the holder was dead, yet no load failure was counted: {stats}")
    if not new:
        raise RowFailed("no save landed after the holder came back")
    return (
        f"holder gone: outputs equal, store failures: {_failures(stats)}, "
        f"{stats.get('hit_tokens', 0)} hit tokens looked up; new holder: {new} objects "
        f"saved within {secs:.1f} s"
    )


ZERO_COPY_STALL_S = 30.0  # Mooncake's RPC timeout to a same-host holder (measured)


@contextlib.contextmanager
def _frozen_phase(
    ctx: ChaosContext, env: RowEnv, name: str, **extra: Any
) -> Iterator[tuple[LocalPool, EngineSession, dict[str, Any]]]:
    """An engine's first phase run while the holder is stopped (SIGSTOP), outputs
    checked: (pool, the engine session, the phase's result)."""
    # A long client TTL keeps the frozen holder's segment listed, as a master that
    # has not noticed a cut-off host yet: lookups hit, and the loads hang.
    pool = env.pool(client_ttl=60)
    ctx.seed_pool(pool)
    f = ctx.families
    spec = ctx.spec(pool, [f[0], f[2], f[3], f[4]], hold=True, **extra)
    with ctx.session(spec, name) as s:
        s.ready()
        pool.freeze_holder()
        try:
            p0 = s.next_phase()
        finally:
            pool.thaw_holder()
        ctx.check_outputs(p0["results"], f[0])
        yield pool, s, p0


def _holder_frozen(ctx: ChaosContext, env: RowEnv) -> str:
    timeout_s = 2.0
    with _frozen_phase(ctx, env, "holder-frozen", load_timeout_s=timeout_s) as (pool, s, p0):
        stats = p0["connector"]
        slowest = max(r["total_s"] for r in p0["results"])
        new, secs = _run_until_saved(s, pool, 3, set(_keys(pool)))
        s.finish()
    if not stats.get("loads_timed_out"):
        raise RowFailed(f"no load timed out (failures: {_failures(stats)})")
    if slowest > timeout_s + 10:
        raise RowFailed(f"a request took {slowest:.1f} s: the load deadline did not bound it")
    if not new:
        raise RowFailed("no save landed after the holder thawed")
    return (
        f"holder frozen: {stats['loads_timed_out']} load(s) abandoned at {timeout_s:.0f} s, "
        f"slowest request {slowest:.1f} s, outputs equal; thawed: {new} objects saved "
        f"within {secs:.1f} s"
    )


def _holder_frozen_zero_copy(ctx: ChaosContext, env: RowEnv) -> str:
    # Zero copy: the holder itself copies between its segment and the KV cache (in
    # its shared memory), so a load cannot be abandoned early (late bytes would land
    # in reused blocks): Mooncake's own RPC timeout to the holder bounds it.
    with _frozen_phase(ctx, env, "holder-frozen-zero-copy", zero_copy=True) as (_, s, p0):
        stats = p0["connector"]
        slowest = max(r["total_s"] for r in p0["results"])
        s.finish()
    failed = sum((stats.get("failures") or {}).values())
    if not failed:
        raise RowFailed(f"no load failed while the holder was frozen ({_failures(stats)})")
    if slowest > ZERO_COPY_STALL_S + 15:
        raise RowFailed(f"a request took {slowest:.1f} s: no bound on zero-copy loads")
    return (
        f"zero copy, holder frozen: {failed} chunk load(s) failed after Mooncake's RPC "
        f"timeout ({_failures(stats)}), slowest request {slowest:.1f} s, outputs equal"
    )


def _pool_full(ctx: ChaosContext, env: RowEnv) -> str:
    # The smallest holder Mooncake takes (16 MiB), filled to ~94 % by another
    # tenant's objects first: the engines' saves run into the high watermark.
    pool = env.pool(segment_size=16 << 20)
    filler = bytes(256 << 10)
    with _raw_client(pool) as raw:
        placed = sum(raw.put(f"chaos/filler/{i}", filler) == 0 for i in range(60))
    prompts = [p for fam in ctx.families for p in fam]
    a = ctx.run_engine(ctx.spec(pool, [prompts]), "pool-full-a")
    ctx.check_outputs(a["results"], prompts)
    with _raw_client(pool) as raw:  # a second wave: the pool must evict to take it
        placed += sum(raw.put(f"chaos/filler2/{i}", filler) == 0 for i in range(60))
    kept = len(_keys(pool))
    b = ctx.run_engine(ctx.spec(pool, [prompts]), "pool-full-b")
    ctx.check_outputs(b["results"], prompts)
    m = master_metrics(pool.metrics_url)
    ca, cb = a["connector"], b["connector"]
    evicted = int(m.get("master_evicted_key_count", 0))
    refused = sum((ca.get("saves_refused") or {}).values())
    put_fail = _count(a["log"], "pool put failed")
    if not (evicted or refused or put_fail):
        raise RowFailed("the pool never filled up: the row tested nothing")
    return (
        f"{placed} x 256 KiB filler in two waves around engine A; A saved "
        f"{ca.get('chunks_saved', 0)} objects, {put_fail} put back-offs, {refused} saves "
        f"refused; {evicted} keys evicted, {kept} of A's objects left; B loaded "
        f"{cb.get('chunks_loaded', 0)} objects (failed: {_failures(cb)}); all outputs equal"
    )


def _evicted_before_load(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    ctx.seed_pool(pool)
    prompts = ctx.families[0]
    b = ctx.run_engine(ctx.spec(pool, [prompts], store=f"{FAULTS}:VanishingStore"), "vanishing")
    ctx.check_outputs(b["results"], prompts)
    failed = _count(b["log"], "failed (missing)")
    if not 1 <= failed <= len(prompts):
        raise RowFailed(f"{failed} failed loads for {len(prompts)} prompts")
    # B saved what it recomputed: the keys are back.
    if not wait_until(lambda: set(ctx.seed) <= set(_keys(pool)), 10.0):
        raise RowFailed("the recomputed chunks were not saved again")
    return f"{failed} load(s) found nothing and were recomputed; the chunks were saved again"


def _load_fails_always(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    ctx.seed_pool(pool)
    prompts = ctx.families[0] + ctx.families[1]
    t0 = time.monotonic()
    b = ctx.run_engine(ctx.spec(pool, [prompts], store=f"{FAULTS}:BrokenLoadStore"), "broken")
    secs = time.monotonic() - t0
    ctx.check_outputs(b["results"], prompts)
    failed = _count(b["log"], "failed (transfer_failed)")
    if not 1 <= failed <= len(prompts):
        raise RowFailed(f"{failed} failed load jobs for {len(prompts)} prompts: a retry loop?")
    return (
        f"{failed} failed load job(s) for {len(prompts)} prompts (each chunk tried once, then "
        f"read as a miss), engine done in {secs:.0f} s"
    )


def _rewritten_objects(
    ctx: ChaosContext, env: RowEnv, name: str, alter: Callable[[str, bytes], bytes]
) -> str:
    pool = env.pool()
    ctx.seed_pool(pool, alter)
    bad = {k: alter(k, v) for k, v in ctx.seed.items()}
    prompts = ctx.families[0] + ctx.families[1]
    b = ctx.run_engine(ctx.spec(pool, [prompts]), name)
    ctx.check_outputs(b["results"], prompts)
    failed = _count(b["log"], "failed (corrupt)")
    if not 1 <= failed <= len(prompts):
        raise RowFailed(f"{failed} failed loads for {len(prompts)} prompts")

    # Bad objects a load read are removed, never forced: once the reader's own
    # lease (and any other reader's) ended. A key removed before a later save of
    # its chunk holds good bytes again; one removed after it is simply gone.
    discarded = int(b["connector"].get("chunks_discarded", 0))
    if discarded < 1:
        raise RowFailed("no damaged object was removed (a removal retried past the run?)")
    with _raw_client(pool) as raw:
        good = sum(raw.get(k) == ctx.seed[k] for k in bad)
        left = sum(raw.get(k) == v for k, v in bad.items())
    if left > len(bad) - discarded:
        raise RowFailed(f"{left} bad objects left though {discarded} were removed")
    return (
        f"{failed} load(s) rejected as corrupt and recomputed; {discarded} of {len(bad)} bad "
        f"objects removed once their leases ended ({good} hold good bytes again), {left} "
        "never read (their prefix is suppressed)"
    )


def _aliased(ctx: ChaosContext, env: RowEnv) -> str:
    keys = sorted(ctx.seed)
    by_size: dict[int, list[str]] = {}
    for k in keys:
        by_size.setdefault(len(ctx.seed[k]), []).append(k)
    other = {}
    for group in by_size.values():  # each key gets another key's object of its size
        for i, k in enumerate(group):
            other[k] = group[(i + 1) % len(group)]

    def alias(key: str, value: bytes) -> bytes:
        return ctx.seed[other[key]] if other[key] != key else value[:-1] + bytes([value[-1] ^ 1])

    return _rewritten_objects(ctx, env, "aliased", alias)


def _flipped(ctx: ChaosContext, env: RowEnv) -> str:
    def flip(key: str, value: bytes) -> bytes:
        i = 64 + zlib.crc32(key.encode()) % (len(value) - 64)  # a payload byte
        return value[:i] + bytes([value[i] ^ 0x10]) + value[i + 1 :]

    return _rewritten_objects(ctx, env, "flipped", flip)


def _two_configs(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    ctx.seed_pool(pool)  # float32 objects
    prompts = ctx.families[0]
    base = ctx.run_engine(
        ctx.spec(None, [prompts], connector="none", dtype="bfloat16"), "bf16-base"
    )
    b = ctx.run_engine(ctx.spec(pool, [prompts], dtype="bfloat16"), "bf16")
    for r, want in zip(b["results"], base["results"], strict=True):
        if not outputs_match(r, want):
            raise RowFailed("the bfloat16 engine's outputs differ from its own baseline")
    stats = b["connector"]
    if stats.get("failures") or stats.get("hit_tokens"):
        raise RowFailed(f"the bfloat16 engine hit float32 keys: {stats}")
    spaces = {parse_key(k).fingerprint for k in _keys(pool)}
    return (
        f"bfloat16 engine on a float32 pool: 0 hits, 0 failed loads, outputs equal its own "
        f"baseline; {len(spaces)} config fingerprints now share the pool"
    )


def _lookup_garbage(ctx: ChaosContext, env: RowEnv) -> str:
    import zmq

    pool = env.pool()
    ctx.seed_pool(pool)
    run_dir = ctx.workdir / env.name / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    prompts = ctx.families[0]
    spec = ctx.spec(pool, [prompts], hold=True, run_dir=str(run_dir), instance="chaos")
    rng = random.Random(3)
    sent = 0
    with ctx.session(spec, "lookup-garbage") as s:
        s.ready()
        endpoint = lookup_endpoint(str(run_dir), "chaos", 0)
        zctx = zmq.Context()
        sock = zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        answered = 0
        try:
            for _ in range(300):
                frames = [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 4))]
                sock.send_multipart(frames)
                sent += 1
            # Each frame is answered (an error reply): read the answers, so the
            # garbage surely reached the server (a socket closed at once drops what
            # it has not sent yet).
            deadline = time.monotonic() + 20
            while answered < sent and time.monotonic() < deadline:
                if sock.poll(200):
                    sock.recv_multipart()
                    answered += 1
        finally:
            sock.close()
            zctx.term()
        p0 = s.next_phase()
        s.finish()
    ctx.check_outputs(p0["results"], prompts)
    hit = p0["results"][0]["cached_tokens"]
    if hit < PREFIX:
        raise RowFailed(f"after the garbage the lookup no longer hits ({hit} tokens)")
    refused = sum(p0["connector"].get("lookup_server_errors", {}).values())
    if answered < sent or refused < sent:  # every garbage frame reached the server
        raise RowFailed(f"{sent} frames sent, {answered} answered, {refused} counted as errors")
    return (
        f"{sent} random frames sent to the engine's lookup socket, each answered as an "
        f"error ({refused} counted); next lookup hit {hit} tokens"
    )


def _lookup_slow(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    ctx.seed_pool(pool)
    prompts = ctx.families[0]
    spec = ctx.spec(pool, [prompts], store=f"{FAULTS}:SlowExistsStore", lookup_timeout_ms=50)
    b = ctx.run_engine(spec, "lookup-slow", KVPOOL_CHAOS_EXISTS_DELAY_S="0.5")
    ctx.check_outputs(b["results"], prompts)
    misses = b["connector"].get("lookup_failures") or {}
    if not misses:
        raise RowFailed("no lookup ran into its deadline")
    causes = _counts(misses)
    return f"lookups answered as misses at their 50 ms deadline ({causes}); outputs equal"


def _lookup_stopped(ctx: ChaosContext, env: RowEnv) -> str:
    """The lookup service alone (no engine): stop the server, then start a new one."""
    from kvpool.keys import KeySpace
    from kvpool.layout import Layout
    from kvpool.lookup.client import LookupClient
    from kvpool.lookup.server import LookupServer
    from kvpool.store.mooncake import MooncakeStore

    pool = env.pool()
    layout = Layout.create(tp=1, groups=["gqa:2"])
    space = KeySpace.create(
        model="chaos/lookup",
        layout=layout,
        kv_dtype="float32",
        model_dtype="float32",
        chunk_size=32,
        head_size=32,
        num_layers=2,
    )
    run_dir = ctx.workdir / env.name / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    endpoint = lookup_endpoint(str(run_dir), "stopped", 0)
    hashes = [bytes([i]) * 16 for i in range(1, 9)]
    import numpy as np

    one = np.ones(64, dtype=np.uint8)
    with MooncakeStore(pool.config()) as store:
        keys = [space.key(c, h) for h in hashes for c in layout.holdings(0, 0)]
        store.batch_put(keys, [[(one.ctypes.data, one.nbytes)]] * len(keys))
        server = LookupServer(endpoint, store, layout, space, 32)
        server.start()
        with LookupClient(endpoint, timeout_ms=50.0) as client:
            before = client.lookup("r0", hashes, 32 * 9)
            server.close()
            t0 = time.monotonic()
            during = client.lookup("r1", hashes, 32 * 9)
            waited = time.monotonic() - t0
            server = LookupServer(endpoint, store, layout, space, 32)
            server.start()
            after = 0
            if not wait_until(lambda: client.lookup("r2", hashes, 32 * 9) > 0, 10.0):
                raise RowFailed("the client never found the restarted server")
            after = client.lookup("r3", hashes, 32 * 9)
            server.close()
    if before != 256 or during != 0 or after != 256:
        raise RowFailed(f"hits before/during/after: {before}/{during}/{after}")
    if waited > 1.0:
        raise RowFailed(f"a lookup against a stopped server took {waited:.2f} s")
    return (
        f"hit {before} tokens; server stopped: miss in {waited * 1e3:.0f} ms; "
        f"restarted: hit {after}"
    )


def _lease(ctx: ChaosContext, env: RowEnv) -> str:
    """A read lease blocks a plain remove, never a forced one; it ends by itself."""
    import numpy as np

    from kvpool.store.base import Status
    from kvpool.store.mooncake import MooncakeStore

    pool = env.pool(lease_ttl_ms=1000)
    buf = np.arange(4096, dtype=np.uint8)
    out = np.zeros_like(buf)
    seg = [(buf.ctypes.data, buf.nbytes)]
    with MooncakeStore(pool.config()) as store:
        store.batch_put(["chaos/a", "chaos/b"], [seg, seg])
        store.batch_get(["chaos/a", "chaos/b"], [[(out.ctypes.data, out.nbytes)]] * 2)
        (plain,) = store.batch_remove(["chaos/a"])
        (forced,) = store.batch_remove(["chaos/b"], force=True)
        t0 = time.monotonic()
        ok = wait_until(lambda: store.batch_remove(["chaos/a"])[0] is Status.OK, 10.0)
        waited = time.monotonic() - t0
    if plain is not Status.LEASED or forced is not Status.OK or not ok:
        raise RowFailed(f"remove under lease: {plain}, forced: {forced}, later: {ok}")
    return f"remove under a read lease: leased; forced: ok; plain remove ok {waited:.1f} s later"


def _bad_config(ctx: ChaosContext, env: RowEnv) -> str:
    """One rule for a pool file: absent, the engine serves without the pool and says
    so; there but malformed, the engine stops at start with one line naming it."""
    prompts = ctx.families[0]
    folder = ctx.workdir / env.name
    folder.mkdir(parents=True, exist_ok=True)
    absent, bad = folder / "absent.json", folder / "pool.json"
    bad.write_text('{"master_address": "127.0.0.1:1", ')  # cut short
    r = ctx.run_engine(ctx.spec(None, [prompts], pool_file=str(absent)), "config-missing")
    ctx.check_outputs(r["results"], prompts)
    lines = [ln for ln in r["log"].splitlines() if "connector stays idle" in ln]
    if not lines or str(absent) not in lines[0]:
        raise RowFailed(f"no clear line naming {absent} for the missing pool file")
    try:
        ctx.run_engine(ctx.spec(None, [prompts], pool_file=str(bad)), "config-malformed")
    except EngineFailed as exc:
        if str(bad) not in str(exc) or "not valid JSON" not in str(exc):
            raise RowFailed(f"the malformed pool file's error does not name it: {exc}") from None
        stopped = str(exc).split(": ", 2)[-1][:90]
    else:
        raise RowFailed("an engine started on a malformed pool file")
    return f"missing: served without the pool ({lines[0].split('kvpool: ', 1)[-1][:60]}); " + (
        f"malformed: stopped at start ({stopped})"
    )


def _engine_killed(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    prompts = ctx.families[2]
    spec = ctx.spec(pool, [prompts, prompts], store=f"{FAULTS}:SlowPutStore")
    with ctx.session(spec, "killed", KVPOOL_CHAOS_PUT_DELAY_S="30") as a:
        a.next_phase()
        a.kill()  # its saves are still queued behind the slow put
    left = len(_keys(pool))
    # The kill must have cut saves short (build_tiny_llama: 2 KV heads, an object each).
    if left >= 2 * distinct_chunks(prompts):
        raise RowFailed(f"every object ({left}) had landed before the kill: nothing was queued")
    b = ctx.run_engine(ctx.spec(pool, [prompts]), "after-kill")
    ctx.check_outputs(b["results"], prompts)
    if b["connector"].get("failures"):
        raise RowFailed(f"the restarted engine failed loads: {b['connector']['failures']}")
    if not wait_until(lambda: len(_keys(pool)) >= distinct_chunks(prompts), 10.0):
        raise RowFailed("the restarted engine's saves did not land")
    return (
        f"killed with saves queued ({left} objects had landed); the restarted engine "
        f"recomputed, outputs equal, saved {len(_keys(pool))} objects"
    )


ROWS: list[Row] = [
    Row(
        "master-restart",
        "master killed mid-workload, then restarted",
        "misses while down; saves land again after restart",
        _master_restart,
        1,
    ),
    Row(
        "holder-killed",
        "holder (mooncake_client) killed before loads",
        "failed loads recomputed; saves land on a new holder",
        _holder_killed,
        1,
    ),
    Row(
        "holder-frozen-zero-copy",
        "holder cut off (SIGSTOP), zero_copy on",
        "loads fail at Mooncake's RPC timeout (~30 s), recomputed",
        _holder_frozen_zero_copy,
        1,
    ),
    Row(
        "holder-frozen",
        "holder host cut off (SIGSTOP): gets hang",
        "loads abandoned at the deadline, recomputed",
        _holder_frozen,
        1,
    ),
    Row(
        "pool-full",
        "pool filled to its high watermark by other tenants",
        "eviction/back-off, never a wrong byte",
        _pool_full,
        2,
    ),
    Row("lease", "read lease blocks removal", "leased reported; forced remove works", _lease, 0),
    Row(
        "evicted-before-load",
        "objects vanish between lookup and load",
        "recomputed once, saved again",
        _evicted_before_load,
        1,
    ),
    Row(
        "aliased-object",
        "another key's valid object under a live key",
        "rejected (key digest), removed once leases end",
        _aliased,
        1,
    ),
    Row(
        "flipped-byte",
        "one payload byte flipped in every object",
        "rejected (checksum), removed once leases end",
        _flipped,
        1,
    ),
    Row(
        "two-configs",
        "bfloat16 and float32 engines share one pool",
        "no cross hits, no failed loads",
        _two_configs,
        2,
    ),
    Row(
        "lookup-stopped",
        "lookup server stopped, then restarted",
        "miss within the deadline; hits again",
        _lookup_stopped,
        0,
    ),
    Row(
        "lookup-slow",
        "lookup answers slower than the deadline",
        "misses at the deadline",
        _lookup_slow,
        1,
    ),
    Row(
        "lookup-garbage",
        "random bytes on the engine's lookup socket",
        "server keeps serving; next lookup hits",
        _lookup_garbage,
        1,
    ),
    Row(
        "load-fails-always",
        "pool lists objects that never load",
        "each chunk tried once, no loop",
        _load_fails_always,
        1,
    ),
    Row(
        "bad-config",
        "pool file missing (serve without it) or malformed (stop at start)",
        "one clear line each; a missing file serves without the pool",
        _bad_config,
        2,
    ),
    Row(
        "engine-killed",
        "engine killed with saves queued",
        "restarted engine recomputes and saves",
        _engine_killed,
        2,
    ),
]


def run_row(ctx: ChaosContext, row: Row) -> Outcome:
    t0 = time.monotonic()
    env = RowEnv(ctx, row.name)
    try:
        ctx.prepare()
        observed = row.run(ctx, env)
        passed = True
    except (RowFailed, EngineFailed, KVPoolError) as exc:
        observed, passed = f"{type(exc).__name__}: {exc}", False
    finally:
        for pool in reversed(env.pools):
            pool.stop(kill=True)  # the row's own pools: nothing to shut down cleanly
    return Outcome(row.name, row.fault, row.expected, passed, observed, time.monotonic() - t0)


def run_matrix(
    workdir: Path, names: Sequence[str] | None = None, progress: Progress | None = None
) -> list[Outcome]:
    """Run the named rows (all by default) in ``ROWS`` order."""
    by_name = {r.name: r for r in ROWS}
    unknown = sorted(set(names or ()) - set(by_name))
    if unknown:
        raise ConfigError(f"unknown row(s) {', '.join(unknown)}; rows: {', '.join(by_name)}")
    rows = [r for r in ROWS if names is None or r.name in names]
    report = progress or (lambda *_: None)
    ctx = ChaosContext(workdir, report)
    report("set-up", 0, 1)
    ctx.prepare()
    report("set-up", 1, 1)
    out = []
    for i, row in enumerate(rows):
        report("rows", i, len(rows))
        out.append(run_row(ctx, row))
    report("rows", len(rows), len(rows))
    return out

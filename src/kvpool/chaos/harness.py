"""The chaos harness: what every fault row shares, and running one row.

    ChaosContext(workdir)        made once: a tiny random Llama, prompt families,
                                 the outputs of a run *without* the connector (the
                                 baseline), and the objects a clean engine saved
                                 (seeded into each row's pool)
    RowEnv(ctx, name)            one row's own pools, stopped when the row ends
    Row, Outcome, RowFailed      a row of the matrix, what it gave, a broken promise
    run_row(ctx, row) -> Outcome one row on its own pool, stopped afterwards
    raw_client, pool_keys, run_until_saved, count_lines, cause_counts, failure_counts
                                 helpers of the rows (``pool_rows``, ``engine_rows``)

A failed check raises ``RowFailed``; ``run_row`` turns it (and an engine that
failed, or a kvpool error) into a failed Outcome.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.demo.run import distinct_chunks, outputs_match
from kvpool.demo.session import EngineFailed, EngineSession
from kvpool.demo.tiny_model import build_tiny_llama
from kvpool.errors import KVPoolError, StoreUnavailable
from kvpool.pool import LocalPool, master_keys, wait_until
from kvpool.store.mooncake_setup import raw_client as mooncake_client

__all__ = [
    "FAMILIES",
    "FAULTS",
    "PREFIX",
    "ChaosContext",
    "Outcome",
    "Progress",
    "Row",
    "RowEnv",
    "RowFailed",
    "cause_counts",
    "count_lines",
    "failure_counts",
    "families",
    "pool_keys",
    "raw_client",
    "run_row",
    "run_until_saved",
]


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
            wait_until(lambda: len(pool_keys(pool)) >= wanted, 30.0)
            with raw_client(pool) as raw:
                for key in pool_keys(pool):
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
            # turn a slow lookup into a miss (a row that tests the deadline sets its own),
            # nor a tiny model's cheap forward a hit into a recompute (load_decision).
            spec["extra"] = {"pool_file": pool_file, "lookup_timeout_ms": 2000,
                             "load_decision": "load", **extra}  # fmt: skip
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
        with raw_client(pool) as raw:
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
        self,
        segment_size: int = 64 << 20,
        client_ttl: int = 2,
        lease_ttl_ms: int = 1000,
        ha: bool = False,
    ) -> LocalPool:
        pool = LocalPool.start(
            self.ctx.workdir / self.name / f"pool{len(self.pools)}",
            segment_size=segment_size,
            client_ttl=client_ttl,
            lease_ttl_ms=lease_ttl_ms,
            ha=ha,
        )
        self.pools.append(pool)
        return pool


# -- helpers ----------------------------------------------------------------------


@contextlib.contextmanager
def raw_client(pool: LocalPool) -> Iterator[Any]:
    """A plain Mooncake client of ``pool`` (bytes in, bytes out), closed afterwards."""
    # HA: the leader itself (Mooncake has one etcd client per process, and rows of
    # several HA pools run in this one)
    master = pool.leader_address() if pool.ha_masters else pool.master_address
    with contextlib.ExitStack() as stack:
        try:  # a client that cannot connect fails the row; the caller's errors are its own
            store = stack.enter_context(mooncake_client(master))
        except StoreUnavailable as exc:
            raise RowFailed(str(exc)) from None
        yield store


def count_lines(log: str, needle: str) -> int:
    return sum(1 for line in log.splitlines() if needle in line)


def cause_counts(by_cause: dict[str, int] | None) -> str:
    """``{"missing": 2, "corrupt": 1}`` -> "1 corrupt, 2 missing" ("none" if empty)."""
    return ", ".join(f"{n} {cause}" for cause, n in sorted((by_cause or {}).items())) or "none"


def failure_counts(stats: dict[str, Any]) -> str:
    return cause_counts(stats.get("failures"))


def pool_keys(pool: LocalPool) -> list[str]:
    """The pool's kvpool keys (``kvpool/...``), not other clients' keys."""
    return [k for k in master_keys(pool.metrics_url) if k.startswith("kvpool/")]


def run_until_saved(
    s: EngineSession, pool: LocalPool, phases: int, before: set[str]
) -> tuple[int, float]:
    """Run up to ``phases`` more phases until keys not in ``before`` reach the
    pool; (new keys, seconds). Saves may be paused by back-off after a fault."""
    t0 = time.monotonic()
    for _ in range(phases):
        s.next_phase()
        if wait_until(lambda: bool(set(pool_keys(pool)) - before), 3.0):
            break
    new = set(pool_keys(pool)) - before
    return len(new), time.monotonic() - t0


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

"""``kvpool bench trace``: a fleet of ``vllm serve`` servers replaying a production trace.

    run_trace_bench(workdir, turns, fleet=Fleet(...), pacing=Pacing(), configs=...) -> TraceBench

For each configuration (``none``: each server's own prefix cache only;
``kvpool``; ``mooncake``: vLLM's in-tree MooncakeStoreConnector over TCP, as
``bench vllm`` runs it) on a fresh pool of ``pool_bytes`` started as ``kvpool up``
starts one: ``servers`` ``vllm serve`` processes of one random model (a real
model's KV shape, ``hidden`` and ``intermediate`` sizes chosen for its compute
per KV byte), every server with the same command line (the config ``kvpool up``
prints, nothing per server), each bound to its own core where there are enough
(``VLLM_CPU_OMP_THREADS_BIND``, as one server per NUMA node or GPU). Each server
answers one prompt shorter than a block first (never pooled, never counted),
then the replay (``kvpool.bench.replay``) sends every turn, and the servers
stop. Every configuration gets the same turns, pacing, binding and warm-up.

Per configuration: each answer (TTFT, end-to-end time, cached tokens), the
replay's wall time, the prompt tokens the servers took from their own prefix
cache, from the connector and computed (vLLM's ``prompt_tokens_by_source``,
summed over servers, over the replay only), the objects the pool evicted and
the puts it refused (the master's counters), and the *missed* reuse: prompt
tokens of whole blocks that a turn already answered before this one was sent
had computed, and that this one computed again (a save still in flight, an
eviction, another server's cache). And, for a connector, up to ``checks`` answers
that found tokens cached, each asked again of another server that then finds as
many cached (its own cache and the pool): the greedy tokens must be the same
and the logprobs as close as the same computation on another split allows
(``Check``; a wrong KV byte moves them by whole units). References from the turns alone
(``kvpool.bench.trace.reuse``): an ideal cache, and an LRU cache of the pool's
size.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvpool.bench.engines import BLOCK, RESERVED_CPUS, mooncake_env
from kvpool.bench.replay import Answer, Pacing, ask, replay
from kvpool.bench.trace import Turn, reuse, reuse_after
from kvpool.demo.server import ServerFailed, VllmServer, kv_transfer_config
from kvpool.demo.shapes import ModelShape
from kvpool.demo.tiny_model import build_shaped_llama
from kvpool.pool import LocalPool, free_ports, master_metrics, parse_metrics

__all__ = [
    "CONFIGS",
    "Check",
    "ConfigRun",
    "Fleet",
    "TraceBench",
    "percentile",
    "run_trace_bench",
]

CONFIGS = ("none", "kvpool", "mooncake")
SOURCES = ("local_cache_hit", "external_kv_transfer", "local_compute")

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class Fleet:
    """The servers and the pool of every configuration."""

    shape: ModelShape
    hidden: int = 1536
    intermediate: int = 5376
    servers: int = 2
    pool_bytes: int = 2 << 30
    kv_cache_bytes: int = 1 << 30  # each server's own KV cache
    max_num_seqs: int = 8
    bind_cores: bool = True  # server k's forward on core k, when there are enough
    checks: int = 8  # answers asked again of another server, per connector
    load_decision: str = "measured"  # kvpool's setting: load or recompute a hit

    @property
    def flop_per_kv_byte(self) -> float:
        return self.shape.flop_per_kv_byte(self.hidden, self.intermediate)


@dataclass(frozen=True, slots=True)
class Check:
    """One turn answered by two servers that found as many of its tokens cached."""

    turn: int
    servers: tuple[int, int]  # the replay's, then the one asked again
    cached_tokens: int
    same_tokens: bool
    logprob_diff: float  # the largest difference of a token's logprob


@dataclass(frozen=True, slots=True)
class ConfigRun:
    name: str
    answers: tuple[Answer, ...]
    wall_s: float
    tokens: dict[str, int]  # SOURCES -> prompt tokens over the replay, all servers
    evicted: int  # objects the pool evicted during the replay
    refused_puts: int  # puts the pool refused for lack of space
    missed_tokens: int  # see the module docstring
    checks: tuple[Check, ...] = ()
    recomputed_tokens: int = 0  # kvpool: tokens of pool hits computed instead (load_decision)
    # kvpool: payload bytes its servers wrote to the pool and read from it, over the replay
    bytes_saved: int = 0
    bytes_loaded: int = 0

    @property
    def write_efficiency(self) -> float | None:
        """Bytes read from the pool per byte written to it (None: nothing written)."""
        return self.bytes_loaded / self.bytes_saved if self.bytes_saved else None

    @property
    def errors(self) -> int:
        return sum(a.error is not None for a in self.answers)

    def ttfts_ms(self) -> list[float]:
        return sorted(a.ttft_s * 1000 for a in self.answers if a.ttft_s is not None and not a.error)


@dataclass(frozen=True, slots=True)
class TraceBench:
    trace: str
    fleet: Fleet
    pacing: Pacing
    turns: int
    sessions: int
    prompt_tokens: int  # of every turn, as sent
    ideal_tokens: int  # an infinite cache would serve
    lru_tokens: int  # an LRU cache of the pool's size would serve
    pool_blocks: int  # the LRU's size in blocks
    runs: tuple[ConfigRun, ...] = field(default_factory=tuple)


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of sorted values, nearest rank; None if empty."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(min(rank, len(sorted_values))) - 1]


# ConfigRun fields -> kvpool's counters on each server's /metrics
_KVPOOL_COUNTERS = {
    "recomputed_tokens": "vllm:kvpool_tokens_recomputed_total",
    "bytes_saved": "vllm:kvpool_bytes_saved_total",
    "bytes_loaded": "vllm:kvpool_bytes_loaded_total",
}


def _counters(servers: Sequence[VllmServer]) -> dict[str, int]:
    """One read of every server's ``/metrics``: prompt tokens by source (``SOURCES``)
    and kvpool's counters (``_KVPOOL_COUNTERS``' keys; 0 without kvpool), each
    summed over servers and labels."""
    names = {metric: field for field, metric in _KVPOOL_COUNTERS.items()}
    out = dict.fromkeys([*SOURCES, *_KVPOOL_COUNTERS], 0)
    for server in servers:
        for key, value in parse_metrics(server.metrics()).items():
            name = key.split("{", 1)[0]
            if name in names:
                out[names[name]] += int(value)
            elif name == "vllm:prompt_tokens_by_source_total":
                for source in SOURCES:
                    if f'source="{source}"' in key:
                        out[source] += int(value)
    return out


def _engine_args(fleet: Fleet, max_len: int) -> list[str]:
    return [
        "--block-size", str(BLOCK), "--max-model-len", str(max_len),
        "--kv-cache-memory-bytes", str(fleet.kv_cache_bytes), "--dtype", fleet.shape.dtype,
        "--enforce-eager", "--max-num-seqs", str(fleet.max_num_seqs),
    ]  # fmt: skip


def _binding(fleet: Fleet, k: int) -> dict[str, str]:
    cores = os.cpu_count() or 1
    if not fleet.bind_cores or fleet.servers > cores:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(k * (cores // fleet.servers))}


def run_trace_bench(
    workdir: Path,
    turns: Sequence[Turn],
    *,
    trace: str = "",
    fleet: Fleet,
    pacing: Pacing | None = None,
    configs: Sequence[str] = CONFIGS,
    on_progress: Progress | None = None,
) -> TraceBench:
    progress = on_progress or (lambda *_: None)
    pacing = pacing or Pacing()
    unknown = set(configs) - set(CONFIGS)
    if unknown or not configs:
        raise ValueError(f"configs must be among {', '.join(CONFIGS)}, got {configs}")
    workdir.mkdir(parents=True, exist_ok=True)
    max_len = max(t.prompt_tokens for t in turns) + pacing.output_tokens + 2 * BLOCK
    model = build_shaped_llama(
        workdir / "model", fleet.shape, fleet.hidden, max_len, intermediate=fleet.intermediate
    )
    block_bytes = pacing.block_tokens * fleet.shape.kv_bytes_per_token
    pool_blocks = fleet.pool_bytes // block_bytes
    bench = TraceBench(
        trace=trace,
        fleet=fleet,
        pacing=pacing,
        turns=len(turns),
        sessions=len({t.session for t in turns}),
        prompt_tokens=sum(t.prompt_tokens for t in turns),
        ideal_tokens=sum(reuse(turns, pacing.block_tokens)),
        lru_tokens=sum(reuse(turns, pacing.block_tokens, pool_blocks)),
        pool_blocks=pool_blocks,
    )
    runs = []
    for n, name in enumerate(configs):
        progress(f"trace: {name}", n, len(configs))
        runs.append(_run_config(workdir / name, name, model, turns, fleet, pacing, max_len))
    progress("trace", len(configs), len(configs))
    return replace(bench, runs=tuple(runs))


def _run_config(
    workdir: Path,
    name: str,
    model: Path,
    turns: Sequence[Turn],
    fleet: Fleet,
    pacing: Pacing,
    max_len: int,
) -> ConfigRun:
    workdir.mkdir(parents=True, exist_ok=True)
    pool = LocalPool.start(workdir / "pool", segment_size=fleet.pool_bytes)
    servers: list[VllmServer] = []
    try:
        cfg = pool.config()
        args, env = _engine_args(fleet, max_len), dict(RESERVED_CPUS)
        if name == "kvpool":
            pool_file = pool.write_pool_file(workdir / "pool.json")
            config = kv_transfer_config(str(pool_file), load_decision=fleet.load_decision)
            args += ["--kv-transfer-config", config]
        elif name == "mooncake":
            args += ["--kv-transfer-config", json.dumps({
                "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute"})]  # fmt: skip
            env.update(mooncake_env(workdir, cfg.master_address))
        ports = free_ports(fleet.servers)
        for k in range(fleet.servers):
            bound = {**env, **_binding(fleet, k)}
            server = VllmServer(model, workdir, ports[k], args, name=f"{name}-{k}", env=bound)
            servers.append(server)
            server.start(timeout_s=600)
        for server in servers:  # the process's first-request costs, on no pooled prompt
            server.complete([11] * (BLOCK // 2), max_tokens=2)
        before, evict0 = _counters(servers), master_metrics(cfg.metrics_url)
        t0 = time.monotonic()
        answers = replay(turns, [s.url for s in servers], str(model), pacing)
        wall = time.monotonic() - t0
        after, evict1 = _counters(servers), master_metrics(cfg.metrics_url)
        urls = [s.url for s in servers]
        checks = _check(turns, answers, urls, str(model), pacing, fleet.checks * (name != "none"))
        for server in servers:  # a dead engine leaves its API server answering 500s
            if (why := server.failure()) is not None:
                raise ServerFailed(why)
    finally:
        for server in servers:
            server.stop()
        pool.stop()

    def grew(metric: str) -> int:
        return int(evict1.get(metric, 0) - evict0.get(metric, 0))

    moved = {field: after[field] - before[field] for field in _KVPOOL_COUNTERS}

    finished = [(a.sent_s + a.e2e_s) if a.e2e_s is not None else None for a in answers]
    reachable = reuse_after(turns, pacing.block_tokens, [a.sent_s for a in answers], finished)
    missed = sum(max(0, r - a.cached_tokens) for r, a in zip(reachable, answers, strict=True))
    return ConfigRun(
        name=name,
        answers=tuple(answers),
        wall_s=wall,
        tokens={s: after[s] - before[s] for s in SOURCES},
        evicted=grew("master_evicted_key_count"),
        refused_puts=grew("master_put_start_alloc_failures_total"),
        missed_tokens=missed,
        checks=tuple(checks),
        **moved,
    )


def _check(
    turns: Sequence[Turn],
    answers: Sequence[Answer],
    urls: Sequence[str],
    model: str,
    pacing: Pacing,
    limit: int,
) -> list[Check]:
    """Up to ``limit`` answers that found tokens cached (most first), each asked
    again of the other servers until one finds as many cached (see the module
    docstring); at most ``3 * limit`` answers tried."""
    if len(urls) < 2:
        return []
    found = sorted((a for a in answers if a.cached_tokens and a.error is None),
                   key=lambda a: (-a.cached_tokens, a.turn))  # fmt: skip
    out: list[Check] = []
    for a in found[: 3 * limit]:
        if len(out) >= limit:
            break
        for k in (k for k in range(len(urls)) if k != a.server):
            again = ask(urls[k], model, turns[a.turn], pacing, k)
            if again.error is None and again.cached_tokens == a.cached_tokens:
                diff = max(
                    (abs(x - y) for x, y in zip(a.logprobs, again.logprobs, strict=False)),
                    default=0.0,
                )
                same = a.text == again.text and len(a.logprobs) == len(again.logprobs)
                out.append(Check(a.turn, (a.server, k), a.cached_tokens, same, diff))
                break
    return out

"""``kvpool bench serve``: vLLM's own benchmark client against real ``vllm serve``.

    run_serve_bench(workdir, shape=..., workload=Workload(), connectors=...) -> ServeBench
    read_bench_result(path)   -> the figures of one ``vllm bench serve --save-result`` file
    cache_counts(metrics)     -> (queries, local hits, pool hits) in a /metrics text

For each connector (``none``, ``kvpool``, ``mooncake``: vLLM's in-tree
MooncakeStoreConnector) on one private pool: start ``vllm serve`` on a random
model with a real model's KV shape (``kvpool.demo.shapes``), run ``vllm bench
serve`` with its prefix-repetition dataset (the *cold* phase; a connector's
saves are waited for), restart the whole server (local caches empty, the pool
kept), and run the same prompts again (the *warm* phase: the prompts a
restarted server, or another replica, sees again). Per phase: TTFT p50 and p90,
request throughput, and the prompt tokens found in vLLM's local prefix cache
and in the pool (vLLM's ``prefix_cache`` and ``external_prefix_cache``
counters over the phase). A warm phase with no pool hits is reported as "no
hits", never as a speedup; otherwise the verdict is the connector's cold TTFT
p50 over its warm one (one server configuration: the same prefill speed).
"""

from __future__ import annotations

import functools
import json
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.bench.engines import BLOCK, RESERVED_CPUS, mooncake_env
from kvpool.demo.failure import failure_line
from kvpool.demo.server import ServerFailed, VllmServer, kv_transfer_config, vllm_command
from kvpool.demo.shapes import SHAPES, TINY_HIDDEN, ModelShape
from kvpool.demo.tiny_model import build_shaped_llama
from kvpool.errors import KVPoolError
from kvpool.pool import (
    LocalPool,
    completed_puts,
    free_ports,
    master_metrics,
    parse_metrics,
    wait_until,
)

__all__ = [
    "CONNECTORS",
    "BenchFailed",
    "Phase",
    "ServeBench",
    "ServeRun",
    "Workload",
    "cache_counts",
    "read_bench_result",
    "run_serve_bench",
]

CONNECTORS = ("none", "kvpool", "mooncake")


class BenchFailed(KVPoolError):
    """A step of the bench failed; the message is one line, with the log's path."""


Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class Workload:
    """``vllm bench serve --dataset-name prefix_repetition`` parameters."""

    prompts: int = 8
    prefixes: int = 8  # distinct prefixes; prompts share them in turn
    prefix_tokens: int = 1024
    suffix_tokens: int = 64
    output_tokens: int = 8
    concurrency: int = 1
    seed: int = 0

    def args(self) -> list[str]:
        return [
            "--dataset-name", "prefix_repetition",
            "--num-prompts", str(self.prompts),
            "--prefix-repetition-num-prefixes", str(self.prefixes),
            "--prefix-repetition-prefix-len", str(self.prefix_tokens),
            "--prefix-repetition-suffix-len", str(self.suffix_tokens),
            "--prefix-repetition-output-len", str(self.output_tokens),
            "--max-concurrency", str(self.concurrency),
            "--seed", str(self.seed),
        ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Phase:
    """One ``vllm bench serve`` run and the server's cache counters over it."""

    ttft_p50_ms: float
    ttft_p90_ms: float
    request_throughput: float  # requests per second
    completed: int
    failed: int
    queried_tokens: int  # prompt tokens looked up in vLLM's prefix cache
    local_hit_tokens: int  # found in the server's own prefix cache
    pool_hit_tokens: int  # found through the connector

    @property
    def pool_hit_rate(self) -> float:
        return self.pool_hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True, slots=True)
class ServeRun:
    name: str
    cold: Phase
    warm: Phase


@dataclass(frozen=True, slots=True)
class ServeBench:
    shape: ModelShape
    workload: Workload
    runs: tuple[ServeRun, ...]
    restart_s: dict[str, float] = field(default_factory=dict)  # server start, per connector

    def verdict(self, run: ServeRun) -> str:
        """The run's cold TTFT p50 over its warm one (the same server settings, so the
        same prefill speed), or why there is none."""
        if run.name == "none":
            return "baseline"
        if run.warm.failed or not run.warm.completed:
            return "failed requests"
        if run.warm.pool_hit_tokens == 0:
            return "no hits"
        if not run.warm.ttft_p50_ms:
            return "-"
        return f"{run.cold.ttft_p50_ms / run.warm.ttft_p50_ms:.1f}x"


def read_bench_result(path: str | Path) -> dict[str, float]:
    """TTFT p50/p90, throughput and counts from a ``--save-result`` JSON file."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    completed = int(data.get("completed", 0))
    prompts = int(data.get("num_prompts", completed))
    return {
        "ttft_p50_ms": float(data.get("median_ttft_ms") or data.get("p50_ttft_ms") or 0.0),
        "ttft_p90_ms": float(data.get("p90_ttft_ms", 0.0)),
        "request_throughput": float(data.get("request_throughput", 0.0)),
        "completed": completed,
        "failed": int(data.get("failed", prompts - completed)),
    }


def cache_counts(metrics_text: str) -> tuple[int, int, int]:
    """(queried, local hits, pool hits) in prompt tokens, summed over engines."""
    values = parse_metrics(metrics_text)

    def total(name: str) -> int:
        return int(sum(v for k, v in values.items() if k.split("{", 1)[0] == name))

    return (
        total("vllm:prefix_cache_queries_total"),
        total("vllm:prefix_cache_hits_total"),
        total("vllm:external_prefix_cache_hits_total"),
    )


def _bench_client(
    server: VllmServer, tokenizer: Path, workload: Workload, out: Path, log: Path
) -> dict[str, float]:
    out.unlink(missing_ok=True)
    cmd = [
        vllm_command(), "bench", "serve",
        "--backend", "vllm",
        "--base-url", server.url,
        "--model", server.model,
        "--tokenizer", str(tokenizer),
        *workload.args(),
        "--percentile-metrics", "ttft",
        "--metric-percentiles", "50,90",
        "--save-result",
        "--result-dir", str(out.parent),
        "--result-filename", out.name,
    ]  # fmt: skip
    with log.open("ab") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0 or not out.exists():
        raise BenchFailed(failure_line(f"vllm bench serve against {server.name}", rc, log))
    return read_bench_result(out)


def _phase(server: VllmServer, run: Callable[[], dict[str, float]]) -> Phase:
    """One phase's figures; a server or engine that died during it ends the bench with
    ``ServerFailed`` (one line naming the server and its last error)."""
    try:
        before = cache_counts(server.metrics())
        figures = run()
        after = cache_counts(server.metrics())
    except (OSError, BenchFailed) as exc:  # URLError is an OSError
        raise ServerFailed(server.failure() or f"{server.name}: {exc}") from None
    if (why := server.failure()) is not None:
        raise ServerFailed(why)
    queried, local, pool = (a - b for a, b in zip(after, before, strict=True))
    return Phase(
        ttft_p50_ms=figures["ttft_p50_ms"],
        ttft_p90_ms=figures["ttft_p90_ms"],
        request_throughput=figures["request_throughput"],
        completed=int(figures["completed"]),
        failed=int(figures["failed"]),
        queried_tokens=queried,
        local_hit_tokens=local,
        pool_hit_tokens=pool,
    )


def _settled_puts(metrics_url: str, name: str, timeout_s: float = 120.0) -> None:
    """Wait until the pool's completed puts stop growing (the saves landed); a pool
    still taking puts after ``timeout_s`` fails the bench."""
    last = [-1.0]

    def still() -> bool:
        now = completed_puts(master_metrics(metrics_url))
        done = now == last[0]
        last[0] = now
        return done

    if not wait_until(still, timeout_s, step=2.0):
        raise BenchFailed(f"the {name} server's saves were still landing after {timeout_s:.0f} s")


def run_serve_bench(
    workdir: Path,
    *,
    shape: ModelShape = SHAPES["llama3-8b"],
    workload: Workload = Workload(),
    connectors: Sequence[str] = CONNECTORS,
    on_progress: Progress | None = None,
) -> ServeBench:
    progress = on_progress or (lambda *_: None)
    unknown = set(connectors) - set(CONNECTORS)
    if unknown or not connectors:
        raise ValueError(f"connectors must be among {', '.join(CONNECTORS)}, got {connectors}")
    workdir.mkdir(parents=True, exist_ok=True)
    tokens = workload.prefix_tokens + workload.suffix_tokens
    max_len = tokens + workload.output_tokens + 2 * BLOCK
    model = build_shaped_llama(workdir / "model", shape, TINY_HIDDEN, max_len)
    kv_bytes = shape.kv_cache_gib(workload.concurrency * max_len + 4 * BLOCK) << 30
    engine_args = [
        "--block-size", str(BLOCK), "--max-model-len", str(max_len),
        "--kv-cache-memory-bytes", str(kv_bytes), "--dtype", shape.dtype,
        "--enforce-eager", "--max-num-seqs", str(max(4, workload.concurrency)),
    ]  # fmt: skip
    pool_bytes = max(2 << 30, 2 * workload.prompts * tokens * shape.kv_bytes_per_token)
    pool = LocalPool.start(workdir / "pool", segment_size=pool_bytes)
    runs: list[ServeRun] = []
    starts: dict[str, float] = {}
    steps = 4 * len(connectors)
    done = 0
    try:
        cfg = pool.config()
        pool_file = str(pool.write_pool_file(workdir / "pool.json"))
        for name in connectors:
            # Every server reserves the same cores for vLLM's other processes: with a KV
            # connector vLLM reserves one more per worker, and on this 2-core machine
            # the server without a connector ran one OpenMP thread against the
            # connectors' two (its prefill took 16.8 s against 9.7 s: not a connector's
            # doing).
            args, env = list(engine_args), dict(RESERVED_CPUS)
            if name == "kvpool":
                # Measures the pool's hits: loaded whatever the model's compute costs.
                config = kv_transfer_config(pool_file, load_decision="load")
                args += ["--kv-transfer-config", config]
            elif name == "mooncake":
                args += ["--kv-transfer-config", json.dumps({
                    "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                    "kv_load_failure_policy": "recompute"})]  # fmt: skip
                env.update(mooncake_env(workdir, cfg.master_address))
            phases = []
            for phase in ("cold", "warm"):
                server = VllmServer(
                    model, workdir, free_ports(1)[0], args, name=f"{name}-{phase}", env=env
                )
                t0 = time.monotonic()
                try:
                    server.start(timeout_s=600)
                    starts[name] = time.monotonic() - t0
                    done += 1
                    progress("serve bench", done, steps)
                    out = workdir / f"{name}-{phase}.json"
                    log = workdir / f"{name}-{phase}-client.log"
                    client = functools.partial(_bench_client, server, model, workload, out, log)
                    phases.append(_phase(server, client))
                    if phase == "cold" and name != "none" and cfg.metrics_url:
                        _settled_puts(cfg.metrics_url, name)
                finally:
                    server.stop()
                done += 1
                progress("serve bench", done, steps)
            runs.append(ServeRun(name, phases[0], phases[1]))
    finally:
        pool.stop()
    return ServeBench(shape, workload, tuple(runs), starts)

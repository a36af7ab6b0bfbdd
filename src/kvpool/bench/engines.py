"""``kvpool bench vllm``: kvpool's connector beside vLLM's in-tree Mooncake connector.

    run_engine_bench(workdir, ...) -> EngineBench

One workload, one engine build, one pool: for each connector a *cold* engine
(saves) and then a *warm* engine in a fresh process (loads) run the same
prompts one at a time; the cold engine stays up until its saves are in the
pool (or 60 s passed). Reported per connector: cold and warm time to first
token (medians over the prompts), bytes the pool holds after the cold run,
keys probed per lookup, and whether the warm outputs equal the cold ones.
A run without any connector gives the compute-only baseline.
"""

from __future__ import annotations

import json
import os
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.demo.run import distinct_chunks, outputs_match, run_engine
from kvpool.demo.session import EngineSession
from kvpool.demo.tiny_model import build_tiny_llama
from kvpool.pool import LocalPool, completed_puts, master_metrics, wait_until

__all__ = ["ConnectorRun", "EngineBench", "run_engine_bench"]

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class ConnectorRun:
    name: str
    cold_ttft_s: float  # median over prompts
    warm_ttft_s: float
    bytes_stored: int  # pool bytes added by the cold run
    keys_stored: int
    warm_hit_tokens: int
    identical: bool  # warm outputs == no-connector outputs


@dataclass(frozen=True, slots=True)
class EngineBench:
    baseline_ttft_s: float
    runs: tuple[ConnectorRun, ...]
    prompt_tokens: tuple[int, ...]


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _median_ttft(result: dict[str, Any]) -> float:
    return float(statistics.median(r["ttft_s"] for r in result["results"]))


def _run_cold(
    spec: dict[str, Any],
    workdir: Path,
    name: str,
    progress: Progress,
    metrics_url: str,
    before: dict[str, float],
    prompts: list[list[int]],
) -> dict[str, Any]:
    """The cold engine, kept alive until its saves completed in the pool (every
    connector saves in the background; an engine that exits at once loses the
    last prompt's saves, and its warm run then misses them). Completed, not
    merely counted: the master counts a key from the start of its put."""
    chunks = distinct_chunks(prompts)
    phase = f"{name} cold"
    progress(phase, 0, len(prompts))
    cold_spec = {**spec, "phases": [spec["prompts"]]}
    del cold_spec["prompts"]
    session = EngineSession.start(
        cold_spec, workdir, f"{name}-cold", on_progress=lambda n: progress(phase, n, len(prompts))
    )
    with session:
        session.next_phase(timeout=900)
        base = completed_puts(before)
        wait_until(
            lambda: completed_puts(master_metrics(metrics_url)) - base >= chunks,
            60.0,
            step=0.2,
        )
        return session.finish(timeout=120)


def run_engine_bench(
    workdir: Path,
    *,
    prompts: int = 4,
    min_tokens: int = 2000,
    max_tokens: int = 3000,
    layers: int = 8,
    hidden: int = 512,
    connectors: tuple[str, ...] = ("kvpool", "mooncake"),
    on_progress: Progress | None = None,
) -> EngineBench:
    progress = on_progress or (lambda *_: None)
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(
        workdir / "model", layers=layers, hidden=hidden, heads=hidden // 64, kv_heads=hidden // 64
    )
    ids = _prompts(prompts, min_tokens, max_tokens)
    base_spec: dict[str, Any] = {
        "model": str(model),
        "prompts": ids,
        "max_tokens": 4,
        "block_size": 32,
        "progress": True,
    }
    baseline = run_engine(
        {**base_spec, "connector": "none"}, workdir / "none.json", "no connector", progress
    )
    runs = []
    pool = LocalPool.start(workdir / "pool", segment_size=2 << 30)
    try:
        cfg = pool.config()
        pool_file = pool.write_pool_file(workdir / "pool.json")
        mc_config = workdir / "mooncake.json"
        mc_config.write_text(
            json.dumps(
                {
                    "local_hostname": "127.0.0.1",
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": cfg.master_address,
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",
                    "global_segment_size": 0,
                    "local_buffer_size": "64MB",
                }
            )
        )
        env = {
            "MOONCAKE_CONFIG_PATH": str(mc_config),
            "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1",
        }
        for name in connectors:
            spec = {**base_spec, "connector": name}
            if name == "kvpool":
                spec["extra"] = {"pool_file": str(pool_file)}
            before = master_metrics(cfg.metrics_url)
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                cold = _run_cold(spec, workdir, name, progress, cfg.metrics_url, before, ids)
                after = master_metrics(cfg.metrics_url)
                warm = run_engine(spec, workdir / f"{name}-warm.json", f"{name} warm", progress)
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            same = all(
                outputs_match(w, b)
                for w, b in zip(warm["results"], baseline["results"], strict=True)
            )
            runs.append(
                ConnectorRun(
                    name,
                    _median_ttft(cold),
                    _median_ttft(warm),
                    int(
                        after.get("master_allocated_bytes", 0)
                        - before.get("master_allocated_bytes", 0)
                    ),
                    int(after.get("master_key_count", 0) - before.get("master_key_count", 0)),
                    sum(r["cached_tokens"] for r in warm["results"]),
                    same,
                )
            )
    finally:
        pool.stop()
    return EngineBench(_median_ttft(baseline), tuple(runs), tuple(len(p) for p in ids))

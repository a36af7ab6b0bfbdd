"""``kvpool demo``: a cold and a warm vLLM engine sharing prefixes through a pool.

    run_demo(workdir, conversations=4, turns=2, on_progress=...) -> DemoReport

Starts a private pool (master + holder on loopback), builds a tiny random
Llama, then runs two engines, each in a fresh process with the kvpool
connector: the *cold* one finds an empty pool and saves what it computes; the
*warm* one (an empty local prefix cache, as after a restart or on another
replica) finds the prefixes in the pool and loads them. The pool is stopped at
the end, also on failure.

The cold engine runs each request twice in a row: a prefill (what it saves),
then a *local hit* of the same prompt (its own prefix cache supplies whole
blocks, it computes the rest): the best any cache can do, and the reference
for the warm engine's answer. The warm engine's own prefix cache is off, so
every token it finds cached came from the pool, with exactly the split of the
local hit (whole chunks, never the last token): its answers must equal the
local hit's token for token and logprob for logprob, in bfloat16 as in float32
(a cold prefill splits the work otherwise, and in bfloat16 answers differently).
Each engine first runs a prompt shorter than a block: no measured request pays
the process's first-request costs, and the pool never sees it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.demo.session import EngineFailed, EngineSession
from kvpool.demo.shapes import TINY_HIDDEN, ModelShape
from kvpool.demo.tiny_model import build_shaped_llama
from kvpool.pool import LocalPool, master_metrics

__all__ = [
    "DemoReport",
    "RequestRow",
    "distinct_chunks",
    "outputs_match",
    "run_demo",
    "run_engine",
    "workload",
]

# vLLM's own prefix cache moves decode logprobs in the 6th decimal on these models
# (a prompt run twice in one engine: -5.695924 cold, -5.695923 with a local hit),
# so outputs "match" when the tokens are equal and logprobs agree to this.
LOGPROB_TOLERANCE = 1e-4


def outputs_match(a: dict[str, Any], b: dict[str, Any], tol: float = LOGPROB_TOLERANCE) -> bool:
    """Same greedy tokens, and logprobs equal within ``tol``."""
    return a["tokens"] == b["tokens"] and all(
        abs(x - y) <= tol for x, y in zip(a["logprobs"], b["logprobs"], strict=True)
    )


Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass(frozen=True, slots=True)
class RequestRow:
    name: str
    prompt_tokens: int
    cold_cached: int  # prompt tokens the cold engine's prefix cache had at its prefill
    warm_cached: int  # prompt tokens the warm engine loaded from the pool
    cold_ttft_s: float  # the cold engine's prefill
    warm_ttft_s: float
    identical: bool  # the warm answer equals the local hit's, exactly
    local_ttft_s: float = 0.0  # the cold engine's local hit of the same prompt

    @property
    def hit(self) -> bool:
        return self.warm_cached > 0


@dataclass
class DemoReport:
    rows: list[RequestRow]
    cold: dict[str, Any]  # connector counters of the cold engine
    warm: dict[str, Any]
    pool_keys: int
    pool_bytes: int
    model: str
    extra: dict[str, Any] = field(default_factory=dict)
    shape: str = ""  # the KV shape, described

    @property
    def identical(self) -> bool:
        return all(r.identical for r in self.rows)

    @property
    def warm_hit_tokens(self) -> int:
        return sum(r.warm_cached for r in self.rows)

    @property
    def warm_ttft_s(self) -> float:
        return sum(r.warm_ttft_s for r in self.rows)

    @property
    def passed(self) -> bool:
        """Every measured request hit the pool, and answered like the local hit."""
        return bool(self.rows) and all(r.hit and r.identical for r in self.rows)


def workload(
    conversations: int, turns: int, system: int, document: int, user: int, seed: int = 0
) -> list[tuple[str, list[int]]]:
    """Multi-turn chats about long documents, sharing one system prompt.

    Turn t of chat c is: system prompt + document c + t user messages. Within one
    engine, a chat's later turns hit its local prefix cache; a fresh engine finds
    every document in the pool.
    """
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, 1000) for _ in range(n)]

    sys_prompt = tokens(system)
    out = []
    for c in range(conversations):
        history = sys_prompt + tokens(document)
        for t in range(turns):
            history += tokens(user)
            out.append((f"chat {c + 1} turn {t + 1}", list(history)))
    return out


def distinct_chunks(prompts: Sequence[Sequence[int]], chunk: int = 32) -> int:
    """Distinct full chunks among ``prompts`` (prefix-shared chunks count once): the
    objects a TP=1 engine with one KV group saves for them."""
    return len({tuple(p[: (i + 1) * chunk]) for p in prompts for i in range(len(p) // chunk)})


def run_engine(spec: dict[str, Any], path: Path, phase: str, progress: Progress) -> dict[str, Any]:
    """Run one engine over ``spec``'s prompts (spec at ``path``, log beside it)."""
    total = len(spec["prompts"])
    progress(phase, 0, total)
    try:
        return EngineSession.run(
            spec, path.parent, path.stem, on_progress=lambda n: progress(phase, n, total)
        )
    except EngineFailed as exc:
        raise EngineFailed(f"the {phase} engine failed: {exc}") from None


def run_demo(
    workdir: Path,
    *,
    conversations: int = 4,
    turns: int = 2,
    system_tokens: int = 256,
    document_tokens: int = 1536,
    user_tokens: int = 96,
    layers: int = 4,
    hidden: int = 256,
    shape: ModelShape | None = None,
    on_progress: Progress | None = None,
) -> DemoReport:
    """``shape``: a real model's KV shape (``kvpool.demo.shapes``) instead of the
    small default model (``layers``, ``hidden``, head size 64, float32)."""
    progress = on_progress or (lambda *_: None)
    workdir.mkdir(parents=True, exist_ok=True)
    progress("model", 0, 1)
    requests = workload(conversations, turns, system_tokens, document_tokens, user_tokens)
    longest = max(len(ids) for _, ids in requests)
    max_len = max(4096, longest + 64)
    model_hidden = TINY_HIDDEN
    if shape is None:
        shape, model_hidden = ModelShape("demo", layers, hidden // 64, 64, "float32"), hidden
    model = build_shaped_llama(workdir / "model", shape, model_hidden, max_len)
    progress("model", 1, 1)
    # Room for every distinct token of the workload twice over.
    distinct = distinct_chunks([ids for _, ids in requests]) * 32
    segment = max(1 << 30, 2 * distinct * shape.kv_bytes_per_token)
    pool = LocalPool.start(workdir / "pool", segment_size=segment)
    try:
        pool_file = pool.write_pool_file(workdir / "pool.json")
        prompts = [ids for _, ids in requests]
        spec = {
            "model": str(model),
            "max_tokens": 8,
            "connector": "kvpool",
            "block_size": 32,
            # The demo shows what a pool hit is (loads, answers like a local hit): its
            # small model computes a prefix faster than it loads, so the measured
            # load_decision would recompute most hits. Forced to load.
            "extra": {"pool_file": str(pool_file), "load_decision": "load"},
            "progress": True,
            "warmup": True,
            "warmup_tokens": 16,  # shorter than a block: the pool never sees it
            "settle_saves": True,  # the cold engine's saves are all in before it exits
            "dtype": shape.dtype,
            "max_model_len": max_len,
            # every distinct token of the workload, so no local hit is recomputed
            "env": {"VLLM_CPU_KVCACHE_SPACE": str(shape.kv_cache_gib(distinct + 2 * longest))},
        }
        twice = [p for p in prompts for _ in range(2)]
        cold = run_engine(
            {**spec, "prompts": twice}, workdir / "cold.json", "cold engine", progress
        )
        warm_spec = {**spec, "prompts": prompts, "prefix_caching": False}
        warm = run_engine(warm_spec, workdir / "warm.json", "warm engine", progress)
        metrics = master_metrics(pool.config().metrics_url)
    finally:
        pool.stop()
    prefill, local = cold["results"][0::2], cold["results"][1::2]
    rows = [
        RequestRow(
            name,
            len(ids),
            c["cached_tokens"],
            w["cached_tokens"],
            c["ttft_s"],
            w["ttft_s"],
            outputs_match(h, w, tol=0.0),
            h["ttft_s"],
        )
        for (name, ids), c, h, w in zip(requests, prefill, local, warm["results"], strict=True)
    ]
    return DemoReport(
        rows,
        cold.get("connector", {}),
        warm.get("connector", {}),
        int(metrics.get("master_key_count", 0)),
        int(metrics.get("master_allocated_bytes", 0)),
        str(model),
        {"cold_startup_s": cold["startup_s"], "warm_startup_s": warm["startup_s"]},
        shape.describe(),
    )

"""A full pool under real engines: the workload of issue "a full pool" at a small size.

A random Llama with 32 KiB of KV per token (8 layers, 8 KV heads of 64, float32),
512-token prompts (16 MiB of KV each), a 96 MiB pool. A hot prompt H is asked by
each of four fresh engines in turn; each engine also runs three one-off prompts,
so 208 MiB pass through the pool (H and one engine's one-offs fill two thirds of
it: the pool keeps what was used last, as an LRU cache of its size would). Every
later engine loads H; nothing is dropped (puts that find the pool full go again
once it evicted); and a fresh engine at
the end loads the two newest one-offs whole. vLLM's own prefix cache is off, so
every reuse comes from the pool.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tests.vllm.conftest import RunEngine

from kvpool.pool.quotas import tenant_usage

BLOCK = 32
PROMPT = 512


@pytest.fixture(scope="module")
def small_kv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(
        tmp_path_factory.mktemp("small-kv"), layers=8, heads=8, kv_heads=8, head_dim=64
    )


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(PROMPT + 8)]


def test_a_pool_written_over_and_over_keeps_the_hot_prompt_and_the_newest(
    small_kv_model: Path, run_engine: RunEngine, pool_factory: Any, tmp_path: Path
) -> None:
    pool = pool_factory(segment_size=96 << 20)
    pool_file = str(pool.write_pool_file(tmp_path / "pool.json"))
    hot = _prompt(0)

    def engine(prompts: list[list[int]]) -> dict[str, Any]:
        return run_engine(
            {
                "model": str(small_kv_model),
                "prompts": prompts,
                "max_tokens": 2,
                "connector": "kvpool",
                "block_size": BLOCK,
                "extra": {"pool_file": pool_file},
                "prefix_caching": False,
                "settle_saves": True,
                "max_model_len": 1024,
            }
        )

    one_offs = [[_prompt(10 * e + i) for i in range(1, 4)] for e in range(4)]
    runs = [engine([hot, *one_offs[e]]) for e in range(4)]
    hit = (PROMPT + 8 - 1) // BLOCK * BLOCK  # whole chunks, never the last token
    assert runs[0]["results"][0]["cached_tokens"] == 0
    for later in runs[1:]:
        assert later["results"][0]["cached_tokens"] == hit  # H, from the pool
    for run in runs:
        stats = run["connector"]
        assert "error" not in stats, stats
        assert stats["failures"].get("no_space", 0) == 0, stats  # nothing dropped
    assert sum(r["connector"]["puts_no_space"] for r in runs) > 0  # it was full
    newest = engine([one_offs[-1][-1], one_offs[-1][-2]])
    assert [r["cached_tokens"] for r in newest["results"]] == [hit, hit]


def test_a_tenant_writing_four_times_the_pool_leaves_another_tenants_prompt_whole(
    small_kv_model: Path, run_engine: RunEngine, pool_factory: Any, tmp_path: Path
) -> None:
    """``kvpool up --quota``: a 96 MiB pool, tenants A and B with 32 MiB each. An
    engine of B saves its prompt and never reads it again; an engine of A then
    runs 24 one-off prompts (384 MiB: four times the pool), every one admitted
    (A evicts its own); a fresh engine of B loads its prompt whole. Without quotas
    the same flood evicts it (the store tier's control)."""
    pool = pool_factory(segment_size=96 << 20, quotas={"A": 32 << 20, "B": 32 << 20})
    pool_file = str(pool.write_pool_file(tmp_path / "pool.json"))

    def engine(tenant: str, prompts: list[list[int]]) -> dict[str, Any]:
        run = run_engine(
            {
                "model": str(small_kv_model),
                "prompts": prompts,
                "max_tokens": 2,
                "connector": "kvpool",
                "block_size": BLOCK,
                "extra": {"pool_file": pool_file, "tenant": tenant},
                "prefix_caching": False,
                "settle_saves": True,
                "max_model_len": 1024,
            }
        )
        assert "error" not in run["connector"], run["connector"]
        return run

    hit = (PROMPT + 8 - 1) // BLOCK * BLOCK
    mine = _prompt(100)
    assert engine("B", [mine])["results"][0]["cached_tokens"] == 0
    flood = engine("A", [_prompt(200 + i) for i in range(24)])
    assert flood["connector"]["failures"].get("no_space", 0) == 0  # all admitted
    assert flood["connector"]["chunks_saved"] >= 24 * (PROMPT // BLOCK)
    assert engine("B", [mine])["results"][0]["cached_tokens"] == hit  # whole
    # Each tenant within its quota: A at it (it evicted its own), B holds its prompt.
    usage = tenant_usage(pool.metrics())
    assert 0 < usage["A"][0] <= usage["A"][1]
    assert usage["B"][0] >= PROMPT * 32 << 10  # its prompt's KV (32 KiB per token)

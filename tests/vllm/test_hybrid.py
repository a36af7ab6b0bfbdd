"""A hybrid model (sliding-window layers beside full attention) under vLLM's hybrid
KV cache manager: vLLM keeps the manager on with kvpool configured, a fresh
engine reuses the pool's prefix, and answers like an engine without kvpool."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

RunEngine = Callable[[dict[str, Any]], dict[str, Any]]
WINDOW = 64
BLOCK = 32
KV_HEADS = 2  # build_tiny_gemma3's default; kvpool stores one object per KV head


def spec(model: Path, connector: str, pool_file: str = "") -> dict[str, Any]:
    """Three prompts sharing a 256-token prefix (four windows), distinct tails."""
    rng = random.Random(1)
    shared = [rng.randrange(10, 1000) for _ in range(256)]
    prompts = [shared + [rng.randrange(10, 1000) for _ in range(40 + 7 * i)] for i in range(3)]
    s: dict[str, Any] = {"model": str(model), "prompts": prompts, "max_tokens": 8,
                         "connector": connector, "block_size": BLOCK}  # fmt: skip
    if pool_file:
        s["extra"] = {"pool_file": pool_file}
    return s


def assert_same_outputs(run: dict[str, Any], base: dict[str, Any]) -> None:
    assert [r["tokens"] for r in run["results"]] == [r["tokens"] for r in base["results"]]
    assert [r["logprobs"] for r in run["results"]] == [r["logprobs"] for r in base["results"]]


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.demo.tiny_model import build_tiny_gemma3

    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), window=WINDOW)


def test_a_sliding_window_model_shares_prefixes_with_the_hybrid_manager_on(
    tiny_gemma3: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    base = run_engine(spec(tiny_gemma3, "none"))
    a = run_engine(spec(tiny_gemma3, "kvpool", pool_file))
    b = run_engine(spec(tiny_gemma3, "kvpool", pool_file))
    for run in (a, b):
        assert "Turning off hybrid kv cache manager" not in run["log"]
        assert "stays idle" not in run["log"]
    assert_same_outputs(a, base)
    assert_same_outputs(b, base)
    # B's local cache was empty: the 256-token shared prefix came from the pool.
    assert a["results"][0]["cached_tokens"] == 0
    assert b["results"][0]["cached_tokens"] >= 256
    # B looked its three prompts up together: each hit 288 tokens (9 chunks). The
    # full-attention group loads all 9; each of the 3 sliding-window groups only
    # the 2 chunks holding the window's last 63 tokens before the hit; one object
    # per KV head of each.
    stats = b["connector"]
    assert stats["hit_tokens"] == 3 * 288
    assert stats["chunks_loaded"] == 3 * (9 + 3 * 2) * KV_HEADS
    assert not stats["failures"]

"""A hybrid model (sliding-window layers beside full attention) under vLLM's hybrid
KV cache manager: vLLM keeps the manager on with kvpool configured, a fresh
engine reuses the pool's prefix, and answers like an engine without kvpool. A
Mamba hybrid starts and serves with kvpool configured (its state is not pooled)."""

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


def test_a_mamba_hybrid_serves_with_kvpool_configured_and_the_connector_idle(
    run_engine: RunEngine,
    local_pool: Any,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A random Granite-4-style model (three Mamba-2 layers, one attention layer).
    vLLM's CPU build runs it only with prefix caching off: with it on, vLLM keeps
    Mamba states at block boundaries ("align" mode), and its CPU path for that
    fails (an IndexError in mamba_mixer2), so no state can be pooled here. With
    kvpool configured the engine starts with the hybrid manager on, the connector
    says it stays idle, and the answers equal an engine's without kvpool."""
    from kvpool.demo.tiny_model import build_tiny_granite_hybrid

    model = build_tiny_granite_hybrid(tmp_path_factory.mktemp("tiny-granite-hybrid"))
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    base = run_engine(dict(spec(model, "none"), prefix_caching=False))
    a = run_engine(dict(spec(model, "kvpool", pool_file), prefix_caching=False))
    assert "Turning off hybrid kv cache manager" not in a["log"]
    assert "Mamba / linear-attention state is not pooled yet" in a["log"]
    assert "stays idle" in a["log"]
    assert_same_outputs(a, base)
    assert not a["connector"].get("bytes_saved")  # nothing saved (no counters at all)

"""A hybrid model (sliding-window layers beside full attention) under vLLM's hybrid
KV cache manager: vLLM keeps the manager on with kvpool configured, a fresh
engine reuses the pool's prefix, and answers like an engine without kvpool. So
does a Mamba hybrid with prefix caching on (the state at the hit is pooled)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.factories import base_and_two, same_outputs

RunEngine = Callable[[dict[str, Any]], dict[str, Any]]
WINDOW = 64
BLOCK = 32
KV_HEADS = 2  # build_tiny_gemma3's and build_tiny_granite_hybrid's default
MAMBA_BLOCK = 64
MAMBA_LAYERS = 3  # build_tiny_granite_hybrid's default: 4 layers, the 4th attention


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


def assert_pooled(run: dict[str, Any]) -> None:
    """vLLM kept its hybrid manager on and the connector worked (not idle)."""
    assert "Turning off hybrid kv cache manager" not in run["log"]
    assert "stays idle" not in run["log"]


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.demo.tiny_model import build_tiny_gemma3

    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), window=WINDOW)


def test_a_sliding_window_model_shares_prefixes_with_the_hybrid_manager_on(
    tiny_gemma3: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    base, a, b = base_and_two(run_engine, lambda c: spec(tiny_gemma3, c, pool_file))
    for run in (a, b):
        assert_pooled(run)
    same_outputs(a, base)
    same_outputs(b, base)
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


@pytest.fixture(scope="session")
def tiny_granite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.demo.tiny_model import build_tiny_granite_hybrid

    return build_tiny_granite_hybrid(tmp_path_factory.mktemp("tiny-granite-hybrid"))


def mamba_spec(model: Path, connector: str, pool_file: str = "") -> dict[str, Any]:
    """Prefix caching on (vLLM's "align" mode: a Mamba state per block), one block
    per step: vLLM's CPU SSD kernel returns no state from inside a step."""
    return dict(spec(model, connector, pool_file), block_size=MAMBA_BLOCK,
                max_num_batched_tokens=MAMBA_BLOCK)  # fmt: skip


def test_a_mamba_hybrid_loads_attention_and_the_state_at_the_hit_from_the_pool(
    tiny_granite: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    """A random Granite-4-style model (three Mamba-2 layers, one attention layer).
    Engine A saves each chunk's attention KV and the Mamba states vLLM hands over
    (its boundary-state hand-offs). Fresh engine B hits the 256-token shared
    prefix: it loads the attention chunks and only the state after them, and
    answers exactly as an engine without kvpool."""
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    base, a, b = base_and_two(run_engine, lambda c: mamba_spec(tiny_granite, c, pool_file))
    for run in (a, b):
        assert_pooled(run)
        same_outputs(run, base)
    assert [r["cached_tokens"] for r in a["results"]] == [0, 256, 256]  # its own cache
    assert [r["cached_tokens"] for r in b["results"]] == [256, 256, 256]  # the pool, then local
    # 4 chunks of 64 tokens of attention, an object per KV head; of each Mamba
    # layer (a KV group each) the one state vLLM handed over, after token 256 (the
    # last block boundary of the first prompt: the state it keeps for reuse).
    assert a["connector"]["chunks_saved"] == 4 * KV_HEADS + MAMBA_LAYERS
    stats = b["connector"]
    assert stats["hit_tokens"] == 256
    assert stats["chunks_loaded"] == 4 * KV_HEADS + MAMBA_LAYERS
    assert not stats["failures"]


def test_at_tp2_each_rank_pools_its_own_slice_of_the_mamba_state(
    tiny_granite: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    """TP2 shards each Mamba layer's state (heads) and the attention KV heads over
    two ranks: each rank writes and reads its own objects, one state slice per
    layer and rank. A fresh TP2 engine loads the shared prefix and answers exactly
    as the TP2 engine that computed it."""
    from kvpool.keys import parse_key
    from kvpool.pool import master_keys

    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    tp2 = {"tp": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
    a = run_engine(dict(mamba_spec(tiny_granite, "kvpool", pool_file), **tp2))
    keys = [parse_key(k) for k in master_keys(local_pool.config().metrics_url)]
    # 4 attention chunks of 2 KV heads (one per rank); 3 layers x 2 slices of the state.
    assert len(keys) == 4 * KV_HEADS + MAMBA_LAYERS * 2
    b = run_engine(dict(mamba_spec(tiny_granite, "kvpool", pool_file), **tp2))
    assert [r["cached_tokens"] for r in b["results"]] == [256, 256, 256]
    same_outputs(b, a)


def test_a_mamba_hybrid_without_prefix_caching_serves_with_the_connector_idle(
    tiny_granite: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    """With prefix caching off vLLM keeps no Mamba state per block, so there is
    nothing to pool: the engine starts with the hybrid manager on, the connector
    says why it stays idle, and the answers equal an engine's without kvpool."""
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    base = run_engine(dict(spec(tiny_granite, "none"), prefix_caching=False))
    a = run_engine(dict(spec(tiny_granite, "kvpool", pool_file), prefix_caching=False))
    assert "Turning off hybrid kv cache manager" not in a["log"]
    assert "pooled only with vLLM's prefix caching on" in a["log"]
    assert "stays idle" in a["log"]
    same_outputs(a, base)
    assert not a["connector"].get("bytes_saved")  # nothing saved (no counters at all)


def test_mamba_states_at_granite_4_h_tiny_size_round_trip_exactly(
    run_engine: RunEngine,
    local_pool: Any,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Granite-4.0-H-Tiny's Mamba state (hidden 1536, 48 heads of 64 channels,
    state 128: ~0.8 MiB per layer in bf16) beside one attention layer of 4 KV
    heads x 128. vLLM pads the attention page to the state's, so a block, and a
    chunk, is 832 tokens here. A fresh engine loads the 832-token prefix of a
    1,000-token prompt (4 attention objects and 3 states) and answers exactly as
    an engine without kvpool."""
    from kvpool.demo.tiny_model import build_tiny_granite_hybrid

    model = build_tiny_granite_hybrid(
        tmp_path_factory.mktemp("granite-4-h-tiny-state"),
        hidden=1536, heads=12, kv_heads=4, mamba_heads=48, mamba_d_state=128,
    )  # fmt: skip
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    rng = random.Random(3)
    long = [rng.randrange(10, 1000) for _ in range(1000)]

    def run(connector: str) -> dict[str, Any]:
        s = dict(mamba_spec(model, connector, pool_file if connector == "kvpool" else ""),
                 prompts=[long, long], dtype="bfloat16", max_tokens=4)  # fmt: skip
        return run_engine(s)

    base, a, b = run("none"), run("kvpool"), run("kvpool")
    assert [r["cached_tokens"] for r in base["results"]] == [0, 832]  # vLLM's own block
    assert [r["cached_tokens"] for r in b["results"]] == [832, 832]  # the pool, then local
    same_outputs(a, base)
    same_outputs(b, base)
    stats = b["connector"]
    assert stats["chunks_loaded"] == 4 + MAMBA_LAYERS and not stats["failures"]
    assert stats["bytes_loaded"] > MAMBA_LAYERS * 48 * 64 * 128 * 2  # the ssm states alone

"""Real vLLM engines share prefixes through a real pool, with identical outputs."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

RunEngine = Callable[[dict[str, Any]], dict[str, Any]]

BLOCK = 32


def prompts(seed: int = 0) -> list[list[int]]:
    """Three prompts sharing a 256-token prefix, with distinct tails."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 1000) for _ in range(256)]
    return [shared + [rng.randrange(10, 1000) for _ in range(40 + 7 * i)] for i in range(3)]


def assert_same_outputs(run: dict[str, Any], base: dict[str, Any]) -> None:
    """Exactly the same greedy tokens and logprobs, prompt by prompt."""
    assert [r["tokens"] for r in run["results"]] == [r["tokens"] for r in base["results"]]
    assert [r["logprobs"] for r in run["results"]] == [r["logprobs"] for r in base["results"]]


def spec(model: Path, connector: str, pool_file: str = "", **kw: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "model": str(model),
        "prompts": prompts(),
        "max_tokens": 8,
        "connector": connector,
        "block_size": BLOCK,
    }
    if pool_file:
        s["extra"] = {"pool_file": pool_file}
    s.update(kw)
    return s


def test_fresh_engine_loads_shared_prefix_with_identical_outputs(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    base = run_engine(spec(tiny_model, "none"))
    a = run_engine(spec(tiny_model, "kvpool", pool_file))
    b = run_engine(spec(tiny_model, "kvpool", pool_file))
    for r0, ra, rb in zip(base["results"], a["results"], b["results"], strict=True):
        assert ra["tokens"] == r0["tokens"] and rb["tokens"] == r0["tokens"]
        assert rb["logprobs"] == r0["logprobs"]
    # Engine B had an empty local cache: its first prompt's prefix came from the pool.
    assert a["results"][0]["cached_tokens"] == 0
    assert b["results"][0]["cached_tokens"] >= 256


def test_pool_stopped_between_engines_is_a_miss_not_a_failure(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    base = run_engine(spec(tiny_model, "none"))
    run_engine(spec(tiny_model, "kvpool", pool_file))
    local_pool.stop()
    b = run_engine(spec(tiny_model, "kvpool", pool_file))
    assert_same_outputs(b, base)
    assert b["results"][0]["cached_tokens"] == 0
    assert "cannot reach mooncake_master" in b["log"] and "stays idle" in b["log"]


def test_corrupt_objects_are_recomputed_removed_and_never_loop(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    from mooncake.store import MooncakeDistributedStore

    from kvpool.pool import master_keys

    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    base = run_engine(spec(tiny_model, "none"))
    run_engine(spec(tiny_model, "kvpool", pool_file))
    cfg = local_pool.config()
    keys = master_keys(cfg.metrics_url)
    assert keys, "engine A saved nothing"
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", cfg.master_address) == 0
    try:
        for key in keys:  # same size, other bytes: a stale or aliased object
            size = store.get_size(key)
            assert store.remove(key, True) == 0
            assert store.put(key, bytes([0xA5]) * size) == 0
    finally:
        store.close()
    b = run_engine(spec(tiny_model, "kvpool", pool_file))
    assert_same_outputs(b, base)
    failures = b["log"].count("failed (corrupt)")
    assert 1 <= failures <= len(b["results"])  # reported, and never retried in a loop
    # The bad objects were removed and B saved its recomputed KV: the pool has healed.
    c = run_engine(spec(tiny_model, "kvpool", pool_file))
    assert c["results"][0]["cached_tokens"] >= 256
    assert [r["logprobs"] for r in c["results"]] == [r["logprobs"] for r in base["results"]]


def test_chunks_gone_between_lookup_and_load_are_recomputed(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    base = run_engine(spec(tiny_model, "none"))
    run_engine(spec(tiny_model, "kvpool", pool_file))
    vanishing = spec(tiny_model, "kvpool", pool_file)
    vanishing["extra"]["store"] = "faulty_store:VanishingStore"
    b = run_engine(vanishing)
    assert_same_outputs(b, base)
    failures = b["log"].count("failed (missing)")
    assert 1 <= failures <= len(b["results"])  # every lookup hit, each load missed once
    # B saved what it recomputed, so a later engine hits again.
    c = run_engine(spec(tiny_model, "kvpool", pool_file))
    assert c["results"][0]["cached_tokens"] >= 256

"""Real vLLM engines share prefixes through a real pool, with identical outputs.

Faults (corrupt or vanishing objects, dead pool processes, ...) are the chaos
tier's rows: tests/chaos and ``kvpool.chaos.matrix``.
"""

from __future__ import annotations

import ctypes
import os
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.factories import base_and_two, same_outputs

RunEngine = Callable[[dict[str, Any]], dict[str, Any]]

BLOCK = 32
FAULTS = "kvpool.chaos.faults"
TINY_KV_HEADS = 2  # build_tiny_llama's default; kvpool stores one object per KV head


def pool_objects(
    local_pool: Any, texts: list[list[int]], chunk: int = BLOCK
) -> tuple[list[Any], int]:
    """The pool's keys, parsed, and how many distinct chunks of ``chunk`` tokens
    ``texts`` hold (a chunk is named by its whole prefix)."""
    from kvpool.keys import parse_key
    from kvpool.pool import master_keys

    keys = [parse_key(k) for k in master_keys(local_pool.config().metrics_url)]
    chunks = {tuple(t[: (i + 1) * chunk]) for t in texts for i in range(len(t) // chunk)}
    return keys, len(chunks)


def prompts(seed: int = 0) -> list[list[int]]:
    """Three prompts sharing a 256-token prefix, with distinct tails."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 1000) for _ in range(256)]
    return [shared + [rng.randrange(10, 1000) for _ in range(40 + 7 * i)] for i in range(3)]


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
    base, a, b = base_and_two(run_engine, lambda c: spec(tiny_model, c, pool_file))
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
    same_outputs(b, base)
    assert b["results"][0]["cached_tokens"] == 0
    assert "cannot reach mooncake_master" in b["log"] and "stays idle" in b["log"]


def test_kv_events_announce_each_chunk_once_it_is_in_the_pool(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    import threading

    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    # vLLM's publisher connects to a tcp://HOST:PORT endpoint (it binds only to "*"),
    # so the subscriber binds.
    batches: list[bytes] = []
    stop = threading.Event()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"

    def listen() -> None:
        while not stop.is_set():
            if sub.poll(100):
                batches.append(sub.recv_multipart()[-1])

    listener = threading.Thread(target=listen)
    listener.start()
    try:
        pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
        # settle_saves: the last chunks' events need engine steps after their saves
        run_engine(
            spec(tiny_model, "kvpool", pool_file, kv_events_endpoint=endpoint, settle_saves=True)
        )
    finally:
        stop.set()
        listener.join()
        sub.close()
        ctx.term()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    events = [e for b in batches for e in decoder.decode(b).events]
    ours = [e for e in events if isinstance(e, BlockStored) and e.medium == "cpu"]
    keys, chunks = pool_objects(local_pool, prompts())
    # One event per chunk; the pool holds one object per KV head of each chunk.
    assert len(ours) == chunks == len({k.chunk_hash for k in keys})
    assert len(keys) == TINY_KV_HEADS * chunks
    assert all(e.block_size == BLOCK and len(e.token_ids) == BLOCK for e in ours)
    by_tokens = {tuple(e.token_ids): e for e in ours}
    for p in prompts():  # each chunk's parent is the chunk before it in the prompt
        first = by_tokens[tuple(p[:BLOCK])]
        second = by_tokens[tuple(p[BLOCK : 2 * BLOCK])]
        assert first.parent_block_hash is None
        assert second.parent_block_hash == first.block_hashes[0]


def test_chunks_of_two_blocks_round_trip_with_identical_outputs(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:

    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    base = run_engine(spec(tiny_model, "none"))
    two = {"pool_file": pool_file, "chunk_size": 2 * BLOCK}
    run_engine(spec(tiny_model, "kvpool", extra=two))
    keys, chunks = pool_objects(local_pool, prompts(), chunk=2 * BLOCK)
    assert len({k.chunk_hash for k in keys}) == chunks == 4
    assert len(keys) == TINY_KV_HEADS * chunks  # one object per KV head
    b = run_engine(spec(tiny_model, "kvpool", extra=two))
    same_outputs(b, base)
    assert b["results"][0]["cached_tokens"] >= 256


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 on the CPU needs 2 cores")
def test_engines_at_tp2_and_tp1_share_prefixes_both_ways(
    run_engine: RunEngine,
    local_pool: Any,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A model with real-sized KV heads (8 KV heads of 128): a TP=2 engine (worker
    processes, 4 heads each) writes one object per KV head of every chunk; a TP=1
    engine loads all of them (each prompt's 288 full-block tokens) and answers like
    a TP=1 engine without kvpool; its own new prompts are then loaded by a TP=2
    engine, which answers like a TP=2 engine without kvpool.

    Tolerance: KV computed at TP=2 sums a layer's partial products across ranks
    (an all-reduce) where TP=1 sums them in one matmul, so its float32 values may
    differ in the last bits. Greedy tokens must be equal and logprobs within
    ``LOGPROB_TOLERANCE`` (1e-4, what vLLM's own prefix cache already moves them by);
    a wrong head or a wrong byte order moves them by whole units, and the tokens."""
    from kvpool.demo.run import outputs_match
    from kvpool.demo.tiny_model import build_tiny_llama

    model = build_tiny_llama(
        tmp_path_factory.mktemp("llama-8kv"), layers=4, heads=8, kv_heads=8, head_dim=128
    )
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    tp2: dict[str, Any] = {"tp": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
    p, q = prompts(1), prompts(2)
    base1 = run_engine(spec(model, "none", prompts=p + q))
    base2 = run_engine(spec(model, "none", prompts=q, **tp2))

    a = run_engine(spec(model, "kvpool", pool_file, prompts=p, **tp2))
    keys, chunks = pool_objects(local_pool, p)
    assert sorted({k.content.head for k in keys}) == list(range(8))
    assert len(keys) == 8 * chunks  # one object per KV head and chunk, none twice
    assert a["results"][0]["cached_tokens"] == 0

    b = run_engine(spec(model, "kvpool", pool_file, prompts=p + q))
    assert [r["cached_tokens"] for r in b["results"][:3]] == [288, 288, 288]
    for got, want in zip(b["results"], base1["results"], strict=True):
        assert outputs_match(got, want), (got, want)

    c = run_engine(spec(model, "kvpool", pool_file, prompts=q, **tp2))
    assert [r["cached_tokens"] for r in c["results"]] == [288, 288, 288]
    for got, want in zip(c["results"], base2["results"], strict=True):
        assert outputs_match(got, want), (got, want)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="PP=2 on the CPU needs 2 cores")
def test_engines_at_pp2_and_pp1_share_prefixes_both_ways_on_one_layer_band_grid(
    run_engine: RunEngine,
    local_pool: Any,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Four layers of 8 KV heads of 128, in layer bands 0-1 and 2-3 (``layer_bands``
    [0, 2], the same on every engine): a PP=2 engine (two stage processes) writes
    one object per KV head and band of every chunk; a PP=1 engine loads all of
    them (both bands from the two stages) and answers like a PP=1 engine without
    kvpool; its own new prompts are then loaded by a PP=2 engine, whose stages
    each read only their band.

    Tolerance: vLLM's CPU build runs PP>1 compiled (its eager path cannot pass
    tensors between stages) and PP=1 eager, so float32 values may differ in the
    last bits. Greedy tokens must be equal and logprobs within 1e-4; a wrong band
    or layer order moves them by whole units, and the tokens."""
    from kvpool.demo.run import outputs_match
    from kvpool.demo.tiny_model import build_tiny_llama

    model = build_tiny_llama(
        tmp_path_factory.mktemp("llama-8kv-4l"), layers=4, heads=8, kv_heads=8, head_dim=128
    )
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    bands = {"pool_file": pool_file, "layer_bands": [0, 2]}
    pp2: dict[str, Any] = {"pp": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
    p, q = prompts(3), prompts(4)
    base = run_engine(spec(model, "none", prompts=p + q))

    a = run_engine(spec(model, "kvpool", prompts=p, extra=bands, **pp2))
    keys, chunks = pool_objects(local_pool, p)
    assert {(k.content.head, k.content.band) for k in keys} == {
        (h, b) for h in range(8) for b in (0, 1)
    }
    assert len(keys) == 8 * 2 * chunks  # one object per head, band and chunk
    for got, want in zip(a["results"], base["results"], strict=False):
        assert outputs_match(got, want), (got, want)

    b = run_engine(spec(model, "kvpool", prompts=p + q, extra=bands))
    assert [r["cached_tokens"] for r in b["results"][:3]] == [288, 288, 288]
    for got, want in zip(b["results"], base["results"], strict=True):
        assert outputs_match(got, want), (got, want)

    c = run_engine(spec(model, "kvpool", prompts=q, extra=bands, **pp2))
    assert [r["cached_tokens"] for r in c["results"]] == [288, 288, 288]
    for got, want in zip(c["results"], base["results"][3:], strict=True):
        assert outputs_match(got, want), (got, want)


def test_heads_per_object_stores_fewer_larger_objects_and_engines_share_them(
    run_engine: RunEngine,
    local_pool: Any,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """8 KV heads of 128, ``heads_per_object`` 4: an engine writes two objects per
    chunk (heads 0-3 and 4-7, each a run of its tensors' head axis), a fresh
    engine loads every full block from them and answers exactly like an engine
    without kvpool."""
    from kvpool.demo.tiny_model import build_tiny_llama

    model = build_tiny_llama(
        tmp_path_factory.mktemp("llama-8kv-g4"), layers=2, heads=8, kv_heads=8, head_dim=128
    )
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    extra = {"pool_file": pool_file, "heads_per_object": 4}
    base = run_engine(spec(model, "none"))
    a = run_engine(spec(model, "kvpool", extra=extra))
    keys, chunks = pool_objects(local_pool, prompts())
    assert sorted({k.content.head for k in keys}) == [0, 1]
    assert len(keys) == 2 * chunks
    b = run_engine(spec(model, "kvpool", extra=extra))
    same_outputs(a, base)
    same_outputs(b, base)
    assert [r["cached_tokens"] for r in b["results"]] == [288, 288, 288]


def test_token_classes_cut_each_block_into_strided_objects_that_load_back_exactly(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    """``token_classes`` 2 at DCP1 (what a pool shared with DCP2 engines needs): each
    object of a chunk holds every other token of its block (a strided view of the
    KV tensors, no copy), two per KV head. A fresh engine loads every full block
    from them and answers exactly like an engine without kvpool: the strided
    rows went back where they came from. (vLLM's CPU build runs no DCP.)"""

    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    extra = {"pool_file": pool_file, "token_classes": 2}
    base = run_engine(spec(tiny_model, "none"))
    a = run_engine(spec(tiny_model, "kvpool", extra=extra))
    keys, chunks = pool_objects(local_pool, prompts())
    assert {(k.content.head, k.content.dcp_rank) for k in keys} == {
        (h, c) for h in range(2) for c in range(2)
    }
    assert len(keys) == 2 * 2 * chunks
    b = run_engine(spec(tiny_model, "kvpool", extra=extra))
    same_outputs(a, base)
    same_outputs(b, base)
    assert [r["cached_tokens"] for r in b["results"]] == [288, 288, 288]


def test_engines_with_other_hash_settings_share_and_other_block_sizes_never_alias(
    tiny_model: Path,
    run_engine: RunEngine,
    local_pool: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kvpool names a chunk by its own hash chain over the tokens, not by vLLM's
    block hashes (whose values depend on the hash algorithm and, for xxhash, a
    per-process seed, and which vLLM computes only with prefix caching on). An
    engine saves 64-token chunks of two blocks; one with xxhash and no
    PYTHONHASHSEED, and one with vLLM's prefix caching off, load every full chunk
    and answer exactly like an engine without kvpool. An engine at block size 64
    names the chunks alike, but vLLM's CPU kernel lays a block's K out by block
    (head_size-major), so the fingerprint keeps it apart: no hit, and answers like
    the others (read across, its KV was wrong: greedy tokens changed)."""

    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    extra = {"pool_file": pool_file, "chunk_size": 2 * BLOCK}
    base = run_engine(spec(tiny_model, "none"))
    run_engine(spec(tiny_model, "kvpool", extra=extra))
    keys, chunks = pool_objects(local_pool, prompts(), chunk=2 * BLOCK)
    assert len(keys) == TINY_KV_HEADS * chunks and chunks == 4
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # xxhash: random per process
    fast = run_engine(spec(tiny_model, "kvpool", extra=extra, hash_algo="xxhash"))
    same_outputs(fast, base)
    assert [r["cached_tokens"] for r in fast["results"]] == [256, 256, 256]
    uncached = run_engine(spec(tiny_model, "kvpool", extra=extra, prefix_caching=False))
    same_outputs(uncached, base)
    assert [r["cached_tokens"] for r in uncached["results"]] == [256, 256, 256]
    wide = run_engine(spec(tiny_model, "kvpool", extra=extra, block_size=2 * BLOCK))
    assert wide["results"][0]["cached_tokens"] == 0
    assert [r["tokens"] for r in wide["results"]] == [r["tokens"] for r in base["results"]]
    for r, r0 in zip(wide["results"], base["results"], strict=True):
        assert r["logprobs"] == pytest.approx(r0["logprobs"], abs=1e-4)


def test_zero_copy_engines_share_prefixes_with_identical_outputs(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    """The KV cache placed in the holder's shared memory; blocks move with no copy."""
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    base = run_engine(spec(tiny_model, "none"))
    zero = {"pool_file": pool_file, "zero_copy": True}
    a = run_engine(spec(tiny_model, "kvpool", extra=zero, log_level="INFO"))
    same_outputs(a, base)
    assert "KV cache placed in pool memory" in a["log"]
    b = run_engine(spec(tiny_model, "kvpool", extra=zero, log_level="INFO"))
    same_outputs(b, base)
    assert b["results"][0]["cached_tokens"] >= 256


def test_a_prompt_whose_kv_is_many_times_the_staging_area_is_saved_and_loaded_whole(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    """2,000 tokens of 1 KiB of KV each through 256 KiB of staging (128 KiB a
    direction): before, a job bigger than the staging was refused whole and the
    prompt was never saved. The warm engine computes only the last 16 tokens, as
    an engine without kvpool does on a local prefix-cache hit: that is the run
    its output must equal bit for bit (a full prefill sums in another order)."""
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    rng = random.Random(7)
    long = [rng.randrange(10, 1000) for _ in range(2000)]
    extra = {"pool_file": pool_file, "staging_bytes": "256KiB"}
    base = run_engine(spec(tiny_model, "none", prompts=[long, long]))
    a = run_engine(spec(tiny_model, "kvpool", prompts=[long], extra=extra))
    b = run_engine(spec(tiny_model, "kvpool", prompts=[long], extra=extra))
    cold, local_hit = base["results"]
    assert local_hit["cached_tokens"] == 1984
    for run, want in ((a, cold), (b, local_hit)):
        (got,) = run["results"]
        assert (got["tokens"], got["logprobs"]) == (want["tokens"], want["logprobs"])
    assert a["results"][0]["cached_tokens"] == 0
    assert b["results"][0]["cached_tokens"] == 1984  # every whole chunk but the last token's
    assert "not saved" not in a["log"] + b["log"]


def test_saves_refused_by_a_pool_slower_than_the_engine_still_land_after_the_request_ends(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    """Every put takes 1.5 s, longer than a save waits for staging (1 s): most of
    the prompt's objects are refused ("staging_busy") while the engine computes,
    and the one-token request ends right after its prefill. vLLM keeps its blocks
    until the worker's retries have stored every object; a fresh engine then
    loads every whole chunk. (Before, the refused chunks were lost with the
    request: a partial prefix, and loads failing on chunks whose first head was
    in the pool but not the others.)"""
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    rng = random.Random(11)
    long = [rng.randrange(10, 1000) for _ in range(512)]
    base = run_engine(spec(tiny_model, "none", prompts=[long, long], max_tokens=1))
    slow = {"pool_file": pool_file, "staging_bytes": "256KiB", "store": f"{FAULTS}:SlowPutStore"}
    a = run_engine(
        spec(
            tiny_model, "kvpool", prompts=[long], max_tokens=1, extra=slow, settle_saves=True,
            env={"KVPOOL_CHAOS_PUT_DELAY_S": "1.5"},
        )
    )  # fmt: skip
    assert "not saved (staging_busy)" in a["log"]  # the pool was slower, as meant
    assert "gave up saving" not in a["log"]
    keys, _ = pool_objects(local_pool, [long])
    assert len(keys) == 16 * TINY_KV_HEADS  # every object of the 16 chunks
    b = run_engine(spec(tiny_model, "kvpool", pool_file, prompts=[long], max_tokens=1))
    (got,) = b["results"]
    assert got["cached_tokens"] == 480  # every whole chunk but the last token's
    local_hit = base["results"][1]
    assert (got["tokens"], got["logprobs"]) == (local_hit["tokens"], local_hit["logprobs"])
    assert "failed" not in b["log"]


def test_an_engine_shut_down_right_after_its_last_request_puts_every_save_it_queued(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    """vLLM's teardown shuts the connector down; kvpool then puts what it has
    queued before the process ends. Every put takes 1 s here, so the one-token
    request's saves are still queued when the engine shuts down (no settling)."""
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    rng = random.Random(12)
    long = [rng.randrange(10, 1000) for _ in range(512)]
    slow = {"pool_file": pool_file, "store": f"{FAULTS}:SlowPutStore"}
    a = run_engine(
        spec(tiny_model, "kvpool", prompts=[long], max_tokens=1, extra=slow,
             env={"KVPOOL_CHAOS_PUT_DELAY_S": "4"})
    )  # fmt: skip
    assert a["connector"]["chunks_saved"] < 16  # not all in when the request ended
    keys, _ = pool_objects(local_pool, [long])
    assert len(keys) == 16 * TINY_KV_HEADS  # every object, put during the shutdown


@pytest.mark.parametrize("tp", [1, 2])
def test_finished_requests_give_their_blocks_back_once_their_saves_are_done(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path, tp: int
) -> None:
    """vLLM keeps a finished request's blocks until every worker lists it as
    finished sending (kvpool's saves done). A KV cache of 40 blocks serves six
    prompts of 16 blocks each, one after the other, only if each request's
    blocks come back: a request never released would leave the next one waiting
    for blocks for ever (at TP2, both ranks must report it)."""
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    rng = random.Random(5)
    many = [[rng.randrange(10, 1000) for _ in range(16 * BLOCK)] for _ in range(6)]
    small: dict[str, Any] = {"prompts": many, "max_tokens": 2, "num_blocks": 40,
                             "max_model_len": 1024, "settle_saves": True}  # fmt: skip
    if tp > 1:
        small.update(tp=tp, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    base = run_engine(spec(tiny_model, "none", **small))
    a = run_engine(spec(tiny_model, "kvpool", pool_file, **small))
    assert [r["tokens"] for r in a["results"]] == [r["tokens"] for r in base["results"]]
    keys, chunks = pool_objects(local_pool, many)
    assert len(keys) == chunks * TINY_KV_HEADS == 6 * 16 * TINY_KV_HEADS  # all saved


def test_a_typo_in_the_connector_settings_stops_the_engine_at_start(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    from kvpool.demo.session import EngineFailed

    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    typo = spec(tiny_model, "kvpool", extra={"pool_file": pool_file, "lookup_timeout": 5})
    with pytest.raises(EngineFailed) as failed:
        run_engine(typo)
    message = str(failed.value)
    assert "unknown kv_connector_extra_config key(s) lookup_timeout;" in message
    assert "lookup_timeout_ms" in message  # the valid keys are listed
    # A pool that is merely absent (no pool file yet) still serves without the pool.
    absent = run_engine(spec(tiny_model, "kvpool", str(tmp_path / "no-pool-yet.json")))
    assert absent["results"][0]["cached_tokens"] == 0
    assert "connector stays idle" in absent["log"]


def test_a_pool_secret_signs_objects_and_forged_ones_are_refused(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    """Engines with a pool secret share prefixes as before (every object signed).
    Then a client without the secret rewrites every object under its live key,
    well-formed (a payload byte changed and its xxh3 checksum recomputed, half
    unsigned, half keeping the old signature): an engine with the secret refuses
    each as forged, counts them, recomputes, and answers like an engine without
    kvpool; it writes nothing forged into its KV cache."""
    from mooncake.store import MooncakeDistributedStore

    from kvpool.header import FLAG_SIGNED, HEADER_SIZE, payload_checksum, unpack
    from kvpool.pool import LocalPool, master_keys

    secret = "5e" * 32
    signed = LocalPool.attach(local_pool.write_pool_file(tmp_path / "pool.json"))
    signed.secret = secret
    pool_file = str(signed.write_pool_file(tmp_path / "signed.json"))
    base, a, b = base_and_two(run_engine, lambda c: spec(tiny_model, c, pool_file))
    same_outputs(b, base)
    assert a["results"][0]["cached_tokens"] == 0
    assert b["results"][0]["cached_tokens"] >= 256
    assert not b["connector"]["failures"]

    keys = sorted(master_keys(local_pool.config().metrics_url))
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "",
                     local_pool.master_address) == 0  # fmt: skip
    try:
        for i, key in enumerate(keys):
            obj = bytearray(raw.get(key))
            assert unpack(bytes(obj)).signed  # A signed what it wrote
            obj[HEADER_SIZE + 7] ^= 0x40
            payload = (ctypes.c_char * (len(obj) - HEADER_SIZE)).from_buffer(obj, HEADER_SIZE)
            cs = payload_checksum([(ctypes.addressof(payload), len(payload))])
            obj[32:40] = cs.to_bytes(8, "little")
            if i % 2:
                obj[6] &= ~FLAG_SIGNED
                obj[40:56] = bytes(16)
            del payload
            assert raw.remove(key, True) == 0 and raw.put(key, bytes(obj)) == 0
    finally:
        raw.close()

    c = run_engine(spec(tiny_model, "kvpool", pool_file))
    same_outputs(c, base)  # nothing forged reached its KV cache
    assert c["results"][0]["cached_tokens"] == 0
    assert c["connector"]["failures"].get("forged", 0) >= 1
    assert set(c["connector"]["failures"]) == {"forged"}


def test_a_producer_fills_the_pool_and_a_consumer_only_reads_it(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    """vLLM's kv_role: the prefill side (kv_producer) saves and never looks up; the
    decode side (kv_consumer) loads every chunk, answers like an engine without
    kvpool, and adds nothing to the pool, not even for prompts new to it."""
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    base = run_engine(spec(tiny_model, "none"))
    producer = run_engine(spec(tiny_model, "kvpool", pool_file, kv_role="kv_producer"))
    assert producer["connector"]["lookups"] == 0 and producer["connector"]["hit_tokens"] == 0
    keys, chunks = pool_objects(local_pool, prompts())
    assert len(keys) == chunks * TINY_KV_HEADS  # every chunk saved
    fresh = prompts(seed=9)  # prompts the pool has never seen
    consumer = run_engine(
        spec(tiny_model, "kvpool", pool_file, kv_role="kv_consumer", prompts=[*prompts(), *fresh])
    )
    same_outputs({"results": consumer["results"][:3]}, base)
    assert consumer["results"][0]["cached_tokens"] >= 256  # from the pool
    stats = consumer["connector"]
    assert stats["chunks_saved"] == 0 and stats["bytes_saved"] == 0
    assert len(pool_objects(local_pool, prompts())[0]) == len(keys)  # not one key more


def test_engines_of_two_tenants_never_read_each_others_objects(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path
) -> None:
    """The ``tenant`` setting: the same prompts of the same model in two tenants'
    spaces are two sets of objects. An engine of tenant B misses everything tenant
    A saved (and saves its own); a fresh engine of A hits A's objects."""
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))

    def of(tenant: str) -> dict[str, Any]:
        s = spec(tiny_model, "kvpool", pool_file)
        s["extra"]["tenant"] = tenant
        return s

    base = run_engine(spec(tiny_model, "none"))
    run_engine(of("team-a"))
    keys, chunks = pool_objects(local_pool, prompts())
    assert len(keys) == chunks * TINY_KV_HEADS and {k.tenant for k in keys} == {"team-a"}
    b = run_engine(of("team-b"))
    assert b["connector"]["hit_tokens"] == 0  # not one token of team-a's
    same_outputs(b, base)
    keys = pool_objects(local_pool, prompts())[0]
    assert Counter(k.tenant for k in keys) == {"team-a": len(keys) // 2, "team-b": len(keys) // 2}
    a = run_engine(of("team-a"))
    assert a["results"][0]["cached_tokens"] >= 256  # from team-a's objects
    same_outputs(a, base)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["staged", "zero_copy"])
def test_loads_by_layer_land_band_by_band_and_a_failed_band_is_recomputed(
    tiny_model: Path, run_engine: RunEngine, local_pool: Any, tmp_path: Path, zero_copy: bool
) -> None:
    """``load_by_layer`` with two layer bands, staged or zero copy: a fresh engine
    loads the pool's prefixes in the step that computes the rest (vLLM's sync
    load), waiting for band 0 at layer 0 and band 1 at layer 1, and answers exactly
    like an engine without kvpool. Then every band-1 object of one KV head is
    corrupted (the lookup finds them present): the next fresh engine's band-1 loads
    fail (with zero copy the bad bytes are already in its KV cache), vLLM
    recomputes those blocks and drops that step's output, and the answers are
    still exact."""
    from mooncake.store import MooncakeDistributedStore

    from kvpool.header import HEADER_SIZE
    from kvpool.keys import parse_key
    from kvpool.pool import master_keys

    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    bands = {"pool_file": pool_file, "layer_bands": [0, 1]}
    by_layer = {**bands, "load_by_layer": True, "zero_copy": zero_copy}
    base = run_engine(spec(tiny_model, "none"))
    run_engine(spec(tiny_model, "kvpool", extra=bands))
    b = run_engine(spec(tiny_model, "kvpool", extra=by_layer, log_level="DEBUG"))
    same_outputs(b, base)
    assert [r["cached_tokens"] for r in b["results"]] == [288, 288, 288]
    assert not b["connector"]["failures"]
    assert "waited" in b["log"] and "for layer band(s) up to 0" in b["log"]
    assert ("KV cache placed in pool memory" in b["log"]) is zero_copy

    keys = [k for k in master_keys(local_pool.config().metrics_url)
            if parse_key(k).content.band == 1 and parse_key(k).content.head == 0]  # fmt: skip
    assert keys
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "",
                     local_pool.master_address) == 0  # fmt: skip
    try:
        for key in keys:  # a payload byte flipped, the checksum left: corrupt
            obj = bytearray(raw.get(key))
            obj[HEADER_SIZE + 5] ^= 0x10
            assert raw.remove(key, True) == 0 and raw.put(key, bytes(obj)) == 0
    finally:
        raw.close()
    c = run_engine(spec(tiny_model, "kvpool", extra=by_layer))
    same_outputs(c, base)
    assert c["connector"]["failures"].get("corrupt", 0) >= 1


def test_a_tp2_engine_loads_by_layer_each_rank_its_heads_band_by_band(
    run_engine: RunEngine,
    local_pool: Any,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``load_by_layer`` under TP=2 (worker processes, 4 of 8 KV heads each, two
    layer bands): a TP=1 engine writes the prompts, a fresh TP=2 engine loads each
    rank's heads band by band in the computing step and answers like a TP=2 engine
    without kvpool (greedy tokens equal, logprobs within the cross-TP tolerance of
    ``test_engines_at_tp2_and_tp1_share_prefixes_both_ways``)."""
    from kvpool.demo.run import outputs_match
    from kvpool.demo.tiny_model import build_tiny_llama

    model = build_tiny_llama(
        tmp_path_factory.mktemp("llama-8kv-bands"), layers=4, heads=8, kv_heads=8, head_dim=128
    )
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    bands = {"pool_file": pool_file, "layer_bands": [0, 2]}
    tp2: dict[str, Any] = {"tp": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
    q = prompts(2)
    base2 = run_engine(spec(model, "none", prompts=q, **tp2))
    run_engine(spec(model, "kvpool", prompts=q, extra=bands))
    c = run_engine(spec(model, "kvpool", prompts=q, extra={**bands, "load_by_layer": True}, **tp2))
    assert [r["cached_tokens"] for r in c["results"]] == [288, 288, 288]
    # No load failed: each rank logs its own failures, and both ranks' lines are here.
    assert c["log"].count("kvpool: worker moves KV to the pool") == 2
    assert "recomputing" not in c["log"]
    for got, want in zip(c["results"], base2["results"], strict=True):
        assert outputs_match(got, want), (got, want)

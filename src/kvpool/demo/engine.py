"""Run one vLLM engine (CPU, one process) over a list of prompts; print JSON results.

    python -m kvpool.demo.engine SPEC.json

SPEC: {"model": folder, "prompts": [[token ids], ...], "max_tokens": n,
       "connector": "kvpool" | "mooncake" | "none", "extra": {...},
       "dtype": "float32", "block_size": 32, "failure_policy": "recompute",
       "warmup": bool, "warmup_tokens": n, "progress": bool,
       "kv_events_endpoint": "tcp://127.0.0.1:PORT", "tp": 1, "pp": 1,
       "env": {"NAME": "value"}, "log_level": "DEBUG", "settle_saves": bool,
       "max_num_batched_tokens": n, "num_blocks": n, "prefix_caching": bool,
       "kv_role": "kv_both" | "kv_producer" | "kv_consumer"}

Prompts are sent one at a time, so each one's time to first token is its own.
With ``"settle_saves": true`` the engine keeps stepping after the last prompt
(of each phase) with short prompts of no full chunk, not in the results, until
kvpool's worker has no save outstanding (refused saves retried, finished
requests released), plus one more step: what a save reports (KV events) then
reaches the scheduler before the engine exits. (vLLM's offline ``LLM`` steps
only while a request is unfinished; a server keeps stepping by itself.)

With ``"phases": [[prompts], [prompts], ...]`` instead of ``"prompts"``, the
engine runs one phase, prints ``KVPOOL-PHASE <i> <json>`` (that phase's results
and the connector's counters so far), then waits for a line on stdin before the
next phase: a harness changes the world between phases (kills a pool process,
corrupts objects) while the engine stays up. With ``"hold": true`` it prints
``KVPOOL-READY`` once started and waits for a line before phase 0 as well.
After the result the engine shuts down as vLLM's teardown does (bounded), so
the saves kvpool had queued are in the pool once the process has exited.
The result on stdout (last line) is JSON: per prompt the generated token ids,
their logprobs, the prompt tokens vLLM found cached (locally or in the pool),
the time to first token and the total time. Each engine is its own process:
a fresh process has an empty local prefix cache, as a restarted engine would.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def warmup_prompt(n: int) -> list[int]:
    """The unrelated prompt of ``n`` tokens that ``"warmup"`` runs first (a
    connector saves it like any other prompt)."""
    return [5 + (i * 7919) % 991 for i in range(n)]


def log_level(spec: dict[str, Any], environ: Mapping[str, str]) -> str:
    """kvpool's log level in the engine: ``spec["log_level"]``, else vLLM's own
    ``VLLM_LOGGING_LEVEL`` (as under ``vllm serve``, where kvpool follows vLLM's
    logger), else WARNING. ``VLLM_LOGGING_LEVEL=DEBUG`` thus shows each load
    piece's times in the engine's log (``kvpool bench vllm --workdir`` keeps it)."""
    level = str(spec.get("log_level") or environ.get("VLLM_LOGGING_LEVEL") or "WARNING")
    return level.upper()


def run(spec: dict[str, Any], engines: list[Any] | None = None) -> dict[str, Any]:
    """Run ``spec``; its result. The engine started is appended to ``engines``
    (the caller shuts it down)."""
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    os.environ.update(spec.get("env", {}))  # e.g. VLLM_CPU_OMP_THREADS_BIND for tp > 1
    # kvpool's own log on stderr (stdout carries the KVPOOL- lines).
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logging.getLogger("kvpool").addHandler(handler)
    logging.getLogger("kvpool").setLevel(log_level(spec, os.environ))
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    connector = spec.get("connector", "none")
    transfer = None
    if connector == "kvpool":
        transfer = KVTransferConfig(
            kv_connector="KVPoolConnector",
            kv_connector_module_path="kvpool.vllm",
            kv_role=spec.get("kv_role", "kv_both"),
            kv_load_failure_policy=spec.get("failure_policy", "recompute"),
            kv_connector_extra_config=spec.get("extra", {}),
        )
    elif connector == "mooncake":
        transfer = KVTransferConfig(
            kv_connector="MooncakeStoreConnector",
            kv_role="kv_both",
            kv_load_failure_policy=spec.get("failure_policy", "recompute"),
            kv_connector_extra_config=spec.get("extra", {}),
        )
    events = None
    if spec.get("kv_events_endpoint"):  # publish vLLM's KV events there (zmq)
        from vllm.config import KVEventsConfig

        events = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=spec["kv_events_endpoint"],
            topic="kv",
        )
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 4096),
        max_num_seqs=4,
        # vLLM's CPU runner allocates the tensors that pass between PP stages only
        # in its compiled path's dummy run: eager mode fails at pp > 1.
        enforce_eager=spec.get("pp", 1) == 1,
        seed=0,
        block_size=spec.get("block_size", 32),
        # Mamba hybrids on vLLM's CPU build: one block per step (its SSD kernel
        # returns no states inside a step, which prefix caching then needs).
        max_num_batched_tokens=spec.get("max_num_batched_tokens"),  # None: vLLM's default
        num_gpu_blocks_override=spec.get("num_blocks"),  # None: as memory allows
        kv_transfer_config=transfer,
        kv_events_config=events,
        tensor_parallel_size=spec.get("tp", 1),
        pipeline_parallel_size=spec.get("pp", 1),
        enable_prefix_caching=spec.get("prefix_caching", True),
        prefix_caching_hash_algo=spec.get("hash_algo", "sha256"),
        disable_log_stats=False,  # per-request metrics: time to first token
    )
    startup = time.perf_counter() - t0
    if engines is not None:
        engines.append(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), logprobs=1)
    if spec.get("warmup"):
        # A process's first request costs 2-4 s more: vLLM compiles its logprobs
        # kernel the first time a request asks for logprobs (and memory is touched
        # for the first time). Run one unrelated prompt as long as the longest so
        # that no measured request pays it.
        prompts = spec.get("prompts") or [p for phase in spec["phases"] for p in phase]
        # "warmup_tokens": shorter than a block, the pool never sees the warm-up.
        n = spec.get("warmup_tokens") or max(len(p) for p in prompts)
        warm = TokensPrompt(prompt_token_ids=warmup_prompt(n))
        llm.generate([warm], greedy, use_tqdm=False)
    if "phases" in spec:
        phases: list[list[dict[str, Any]]] = []
        if spec.get("hold"):  # wait for the harness before the first phase too
            sys.stdout.write("\nKVPOOL-READY\n")
            sys.stdout.flush()
            if not sys.stdin.readline():
                spec["phases"] = []
        done_prompts = 0
        for i, batch in enumerate(spec["phases"]):
            phases.append([])
            for ids in batch:
                phases[-1].append(_generate(llm, greedy, ids))
                done_prompts += 1
                if spec.get("progress"):
                    sys.stdout.write(f"\nKVPOOL-PROGRESS {done_prompts}\n")
                    sys.stdout.flush()
            if spec.get("settle_saves"):
                _settle_saves(llm, greedy)
            done = {"results": phases[-1], "connector": _connector_stats(llm)}
            sys.stdout.write(f"\nKVPOOL-PHASE {i} " + json.dumps(done) + "\n")
            sys.stdout.flush()
            if i + 1 < len(spec["phases"]) and not sys.stdin.readline():
                break  # the harness went away
        results = [r for phase in phases for r in phase]
        return {"startup_s": startup, "results": results, "connector": _connector_stats(llm)}
    results = []
    for i, ids in enumerate(spec["prompts"]):
        if spec.get("progress"):
            sys.stdout.write(f"\nKVPOOL-PROGRESS {i}\n")
            sys.stdout.flush()
        results.append(_generate(llm, greedy, ids))
    if spec.get("progress"):
        sys.stdout.write(f"\nKVPOOL-PROGRESS {len(spec['prompts'])}\n")
    if spec.get("settle_saves"):
        _settle_saves(llm, greedy)
    return {"startup_s": startup, "results": results, "connector": _connector_stats(llm)}


def _settle_saves(llm: Any, greedy: Any, timeout_s: float = 30.0) -> None:
    """Step the engine until kvpool's worker has no save outstanding, then once more.

    A save's completion reaches the scheduler only in a later engine step, and
    after the last prompt there is none; each flush prompt is 3 tokens (no full
    chunk: nothing to save or load) and makes a few steps.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    from vllm.inputs import TokensPrompt

    if not has_kv_transfer_group():  # no connector: no saves to wait for
        return
    worker = getattr(get_kv_transfer_group(), "worker", None)
    flush = TokensPrompt(prompt_token_ids=[7, 8, 9])
    deadline = time.monotonic() + timeout_s
    while worker is not None and worker.saves_in_flight and time.monotonic() < deadline:
        llm.generate([flush], greedy, use_tqdm=False)
    llm.generate([flush], greedy, use_tqdm=False)


def _generate(llm: Any, greedy: Any, ids: list[int]) -> dict[str, Any]:
    """One prompt alone: its tokens, logprobs, cached prompt tokens and timings."""
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(ids))
    t = time.perf_counter()
    (out,) = llm.generate([prompt], greedy, use_tqdm=False)
    total = time.perf_counter() - t
    metrics = getattr(out, "metrics", None)
    ttft = float(getattr(metrics, "first_token_latency", 0.0) or total)
    comp = out.outputs[0]
    logprobs = [
        float(step[tok].logprob)
        for tok, step in zip(comp.token_ids, comp.logprobs or [], strict=False)
    ]
    return {
        "tokens": list(comp.token_ids),
        "logprobs": logprobs,
        "cached_tokens": int(out.num_cached_tokens or 0),
        "ttft_s": ttft,
        "total_s": total,
    }


def _connector_stats(llm: Any) -> dict[str, Any]:
    """kvpool's counters from both halves (one process: multiprocessing is off),
    through the connector's public ``counters()``; {} for an engine without kvpool."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    worker = get_kv_transfer_group()
    if type(worker).__name__ != "KVPoolConnector":
        return {}
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    out: dict[str, Any] = dict(worker.counters())
    out.update(scheduler.counters())
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    engines: list[Any] = []
    result = run(spec, engines)
    sys.stdout.write("\nKVPOOL-RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    for llm in engines:
        _shut_down(llm)
    os._exit(0)  # skip vLLM's slow interpreter teardown


def _shut_down(llm: Any, timeout_s: float = 60.0) -> None:
    """vLLM's own engine teardown, which ``os._exit`` would skip: each worker
    (in this process, or TP/PP workers in theirs) shuts its connector down, and
    kvpool puts the saves it has queued before the process ends, so a harness
    that reads the pool after the exit sees them. An in-process worker is waited
    for until its transfer engine is closed (its saves put), not for the store's
    own close (~30 s for a client of HA masters); workers in other processes for
    vLLM's whole teardown. Bounded: a store that hangs costs the wait, never the
    exit."""
    import threading

    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    worker = getattr(connector, "worker", None)  # KVPoolConnector.worker: None if idle
    saves_put: threading.Event | None = getattr(worker, "saves_put", None)
    closing = threading.Thread(target=llm.llm_engine.engine_core.shutdown, daemon=True)
    closing.start()
    deadline = time.monotonic() + timeout_s
    while closing.is_alive() and time.monotonic() < deadline:
        if saves_put is not None and saves_put.wait(0.05):
            return  # saves put; the rest of the teardown is not waited for
        closing.join(0.05)


if __name__ == "__main__":
    main()

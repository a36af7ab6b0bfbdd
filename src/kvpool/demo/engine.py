"""Run one vLLM engine (CPU, one process) over a list of prompts; print JSON results.

    python -m kvpool.demo.engine SPEC.json

SPEC: {"model": folder, "prompts": [[token ids], ...], "max_tokens": n,
       "connector": "kvpool" | "mooncake" | "none", "extra": {...},
       "dtype": "float32", "block_size": 32, "failure_policy": "recompute",
       "warmup": bool, "progress": bool}

Prompts are sent one at a time, so each one's time to first token is its own.
The result on stdout (last line) is JSON: per prompt the generated token ids,
their logprobs, the prompt tokens vLLM found cached (locally or in the pool),
the time to first token and the total time. Each engine is its own process:
a fresh process has an empty local prefix cache, as a restarted engine would.
"""

from __future__ import annotations

import json
import os
import sys
import time
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


def run(spec: dict[str, Any]) -> dict[str, Any]:
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    connector = spec.get("connector", "none")
    transfer = None
    if connector == "kvpool":
        transfer = KVTransferConfig(
            kv_connector="KVPoolConnector",
            kv_connector_module_path="kvpool.vllm",
            kv_role="kv_both",
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
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 4096),
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
        block_size=spec.get("block_size", 32),
        kv_transfer_config=transfer,
        enable_prefix_caching=spec.get("prefix_caching", True),
        disable_log_stats=False,  # per-request metrics: time to first token
    )
    startup = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), logprobs=1)
    if spec.get("warmup"):
        # The first long forward of a process costs ~1.5 s more (first touch of KV
        # and activation memory): run one unrelated prompt as long as the longest
        # so that no measured request pays it.
        n = max(len(p) for p in spec["prompts"])
        warm = TokensPrompt(prompt_token_ids=[5 + (i * 7919) % 991 for i in range(n)])
        llm.generate([warm], greedy, use_tqdm=False)
    results = []
    for i, ids in enumerate(spec["prompts"]):
        if spec.get("progress"):
            sys.stdout.write(f"\nKVPOOL-PROGRESS {i}\n")
            sys.stdout.flush()
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
        results.append(
            {
                "tokens": list(comp.token_ids),
                "logprobs": logprobs,
                "cached_tokens": int(out.num_cached_tokens or 0),
                "ttft_s": ttft,
                "total_s": total,
            }
        )
    if spec.get("progress"):
        sys.stdout.write(f"\nKVPOOL-PROGRESS {len(spec['prompts'])}\n")
    return {"startup_s": startup, "results": results, "connector": _connector_stats(llm)}


def _connector_stats(llm: Any) -> dict[str, Any]:
    """kvpool's counters from both halves (one process: multiprocessing is off)."""
    out: dict[str, Any] = {}
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = getattr(get_kv_transfer_group(), "_worker", None)
        stats = worker.stats() if worker is not None else None
        if stats is not None:
            out.update(
                bytes_saved=stats.bytes_put,
                bytes_loaded=stats.bytes_loaded,
                chunks_saved=stats.chunks_put,
                chunks_loaded=stats.chunks_loaded,
                failures=dict(stats.failures),
            )
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector._sched
        if sched is not None:
            out.update(lookups=sched.lookups, hit_tokens=sched.hit_tokens)
    except Exception as exc:  # stats are a nicety of the demo, never its failure
        out["error"] = repr(exc)
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = run(spec)
    sys.stdout.write("\nKVPOOL-RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    main()

"""``kvpool bench vllm``: connectors at a real model's KV size, a row per prompt length.

    run_engine_bench(workdir, shape=..., lengths=(1000, 4000), ...) -> EngineBench

One random model with a real model's KV shape (``kvpool.demo.shapes``), one
pool, one prompt per length (``samples`` of them: distinct random tokens). A *baseline* engine with
no connector runs each prompt twice: a full prefill, then a local prefix-cache
hit (what the best possible load would leave to compute). For each connector a
*cold* engine saves and stays up, stepping, until its saves are in the pool (a
connector whose saves did not all land in ``SAVE_WAIT_S`` gets the verdict
"lost N", N objects never stored, never a speed-up), then a *warm* engine in
a fresh process (empty local cache, as after a restart or on another replica)
runs the same prompts. Every engine first runs one unrelated prompt shorter than
a block, so no measured request pays the process's first-request costs (vLLM
compiles its logprobs kernel on the first request that asks for logprobs: 2-4 s
here) and no pool ever sees the warm-up. Every engine reserves the same cores
for vLLM's other processes (``VLLM_CPU_NUM_OF_RESERVED_CPU``, as ``bench serve``):
without it the baseline ran another OpenMP thread count than the connectors.

With ``samples`` > 1 each length has that many distinct prompts, each measured
once by every engine, and a row gives their medians (``collapse``): one request
of a 2-core machine varies by a third from run to run.

Per connector and length: cold and warm TTFT, hit tokens and hit rate, the warm
TTFT over the prefill's, the load rate (kvpool's own load time per request;
for other connectors hit bytes over the warm TTFT minus the local-hit TTFT), and
that load time over one plain memory copy of the same bytes (``copy_seconds``,
measured in the same run). A warm run with no hits is a "no hits" verdict,
and one whose answer differs from the baseline's is "differs": never a speedup.
Outputs are compared with the baseline run that computed the
same tokens: the local hit (only the uncached tail), or the full prefill for a
warm run that hit nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.demo.run import distinct_chunks, outputs_match, run_engine
from kvpool.demo.session import EngineSession
from kvpool.demo.shapes import SHAPES, TINY_HIDDEN, ModelShape
from kvpool.demo.tiny_model import build_shaped_llama
from kvpool.layout import Layout
from kvpool.pool import LocalPool, completed_puts, master_metrics, wait_until
from kvpool.settings import parse_extra

__all__ = [
    "ConnectorRun",
    "EngineBench",
    "LengthRow",
    "collapse",
    "copy_seconds",
    "run_engine_bench",
]

Progress = Callable[[str, int, int], None]


BLOCK = 32
MAX_TOKENS = 12  # tokens out per request: a whole request's time includes decode steps
WARMUP_TOKENS = BLOCK // 2  # the warm-up prompt: shorter than a block, never pooled
SAVE_WAIT_S = 120.0  # a cold engine's saves must be in the pool by then (verdict "lost N")
# Every engine and server of the benches reserves the same cores for vLLM's other
# processes: vLLM reserves one more per worker when a KV connector is configured, so
# without it the baseline ran another OpenMP thread count than the connectors.
RESERVED_CPUS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


@dataclass(frozen=True, slots=True)
class LengthRow:
    """One connector at one prompt length."""

    tokens: int  # prompt length
    cold_ttft_s: float
    warm_ttft_s: float
    hit_tokens: int  # prompt tokens the warm engine found cached (all from the pool)
    identical: bool  # warm output == the baseline's run that computed the same tokens
    # kvpool's own account of the warm request's load (0 for other connectors):
    # payload bytes and the load job's time from submit to finish
    load_bytes: int = 0
    load_s: float = 0.0
    cold_total_s: float = 0.0  # the cold request whole: prompt in, last token out

    @property
    def hit_rate(self) -> float:
        """Hit tokens over what any connector can hit (whole chunks, never the last token)."""
        return self.hit_tokens / _hittable(self.tokens)


def _hittable(tokens: int) -> int:
    """Prompt tokens a connector can supply: whole chunks, never the last token."""
    return max(1, (tokens - 1) // BLOCK * BLOCK)


def copy_seconds(nbytes: int, repeats: int = 3) -> float:
    """Median time of one numpy copy of ``nbytes`` between two touched buffers: the
    memory-speed yardstick a load is measured against, on this machine, now."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


@dataclass(frozen=True, slots=True)
class ConnectorRun:
    name: str
    rows: tuple[LengthRow, ...]
    bytes_stored: int  # pool bytes added by the cold run
    keys_stored: int
    saves_landed: int = 0  # objects the cold engine's saves completed in the pool ...
    saves_expected: int = 0  # ... of those its prompts make (0: not counted)

    @property
    def saves_complete(self) -> bool:
        return self.saves_landed >= self.saves_expected

    @property
    def warm_hit_tokens(self) -> int:
        return sum(r.hit_tokens for r in self.rows)

    @property
    def identical(self) -> bool:
        return all(r.identical for r in self.rows)


@dataclass(frozen=True, slots=True)
class EngineBench:
    shape: ModelShape
    lengths: tuple[int, ...]
    prefill_s: tuple[float, ...]  # baseline TTFT per length: a full prefill
    local_hit_s: tuple[float, ...]  # baseline TTFT per length: a local prefix-cache hit
    runs: tuple[ConnectorRun, ...]
    copy_s: tuple[float, ...] = ()  # per length: one memory copy of a full hit's bytes
    samples: int = 1  # distinct prompts per length; times are their medians
    prefill_total_s: tuple[float, ...] = ()  # baseline, per length: a full prefill's whole request

    def _load(self, run: ConnectorRun, i: int) -> tuple[float, float] | None:
        """(bytes, seconds) of the warm request's load: the connector's own account
        where it gives one (kvpool), else the hit bytes over the time the warm
        request spent beyond a local hit (an estimate inside TTFT noise)."""
        row = run.rows[i]
        if row.hit_tokens == 0:
            return None
        if row.load_s > 0:
            return row.load_bytes, row.load_s
        extra = row.warm_ttft_s - self.local_hit_s[i]
        return (row.hit_tokens * self.shape.kv_bytes_per_token, extra) if extra > 0 else None

    def load_gbps(self, run: ConnectorRun, i: int) -> float | None:
        load = self._load(run, i)
        return None if load is None else load[0] / load[1] / 1e9

    def load_vs_copy(self, run: ConnectorRun, i: int) -> float | None:
        """The load's time over one plain memory copy of its bytes (same run)."""
        load = self._load(run, i)
        if load is None or not self.copy_s:
            return None
        return load[1] / (self.copy_s[i] * load[0] / self._full_hit_bytes(i))

    def _full_hit_bytes(self, i: int) -> int:
        """The KV bytes of every whole chunk a prompt of length ``i`` may hit."""
        return _hittable(self.lengths[i]) * self.shape.kv_bytes_per_token

    def one_copy_s(self, i: int) -> float | None:
        """The fastest TTFT a load that does not overlap the forward could give at
        length ``i``: the local hit plus one memory copy of a full hit's bytes, both
        measured in this run; None without a copy time."""
        return self.local_hit_s[i] + self.copy_s[i] if self.copy_s else None

    def copy_gbps(self, i: int) -> float | None:
        """The rate of that one memory copy."""
        if not self.copy_s or self.copy_s[i] <= 0:
            return None
        return self._full_hit_bytes(i) / self.copy_s[i] / 1e9

    def vs_local(self, run: ConnectorRun, i: int) -> float | None:
        """Warm TTFT over the local prefix-cache hit's (a load's whole cost); None
        without hits."""
        row = run.rows[i]
        if row.hit_tokens == 0 or not self.local_hit_s[i]:
            return None
        return row.warm_ttft_s / self.local_hit_s[i]

    def cold_ratio(self, run: ConnectorRun, i: int) -> float:
        """What a miss costs: the connector's cold TTFT over the prefill's without a
        connector (same prompts, same run)."""
        return run.rows[i].cold_ttft_s / self.prefill_s[i]

    def cold_request_ratio(self, run: ConnectorRun, i: int) -> float | None:
        """The same for the whole request (its decode steps run beside the saves);
        None when either time is missing."""
        row = run.rows[i]
        if not self.prefill_total_s or not row.cold_total_s:
            return None
        return row.cold_total_s / self.prefill_total_s[i]

    def verdict(self, run: ConnectorRun, i: int) -> str:
        row = run.rows[i]
        if not run.saves_complete:
            return f"lost {run.saves_expected - run.saves_landed}"
        if row.hit_tokens == 0:
            return "no hits"
        if not row.identical:
            return "differs"
        return f"{self.prefill_s[i] / row.warm_ttft_s:.1f}x"


def _prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in lengths]


def _objects(name: str, spec: dict[str, Any], shape: ModelShape) -> tuple[int, int]:
    """(objects per chunk, tokens per chunk) a connector's engine saves: kvpool
    writes an object per shard of its layout (a KV head at the defaults), other
    connectors are counted one per block."""
    if name != "kvpool":
        return 1, BLOCK
    settings, _ = parse_extra(spec["extra"])
    layout = Layout.create(
        groups=[f"gqa:{shape.kv_heads}"],
        layers=shape.layers,
        layer_bands=list(settings.layer_bands) or None,
        heads_per_object=settings.heads_per_object,
        token_classes=settings.token_classes or None,
    )
    return len(layout.contents(0)), settings.chunk_size or BLOCK


FLUSH = [7, 8, 9]  # a prompt of no full chunk: it makes engine steps, saves nothing


def _run_cold(
    spec: dict[str, Any],
    workdir: Path,
    name: str,
    progress: Progress,
    metrics_url: str,
    objects_per_chunk: int = 1,
    chunk: int = BLOCK,
) -> tuple[dict[str, Any], int, int]:
    """The cold engine, kept alive and stepping until its saves completed in the
    pool (every connector saves in the background, and some only progress while the
    engine steps; an engine that exits at once loses the last prompt's saves):
    ``objects_per_chunk`` objects for each distinct chunk of ``chunk`` tokens.
    Every connector gets the same: after its prompts, phases of one prompt of no
    full chunk while its saves are missing, for up to ``SAVE_WAIT_S``. Completed,
    not merely counted: the master counts a key from the start of its put.
    Returns (result, objects landed, objects expected)."""
    prompts = spec["prompts"]
    objects = distinct_chunks(prompts, chunk) * objects_per_chunk
    phase = f"{name} cold"
    progress(phase, 0, len(prompts))
    flushes = int(SAVE_WAIT_S / 0.2)
    # held until started: puts the engine made while starting are not saves
    cold_spec = {**spec, "phases": [prompts] + [[FLUSH]] * flushes, "hold": True}
    del cold_spec["prompts"]
    session = EngineSession.start(
        cold_spec,
        workdir,
        f"{name}-cold",
        on_progress=lambda n: progress(phase, min(n, len(prompts)), len(prompts)),
    )
    with session:
        session.ready(timeout=600)
        base = completed_puts(master_metrics(metrics_url))
        session.next_phase(timeout=3600)

        def done() -> int:
            return int(completed_puts(master_metrics(metrics_url)) - base)

        deadline = time.monotonic() + SAVE_WAIT_S
        for _ in range(flushes):
            if wait_until(lambda: done() >= objects, 0.2, step=0.05):
                break
            if time.monotonic() > deadline:
                break
            session.next_phase(timeout=300)
        landed = done()
        result = session.finish(timeout=300)
    result["results"] = result["results"][: len(prompts)]  # not the flush prompts
    return result, landed, objects


def _run_warm(
    spec: dict[str, Any], workdir: Path, name: str, progress: Progress
) -> list[tuple[dict[str, Any], int, float]]:
    """The warm engine, one prompt per phase: per prompt its result and the bytes
    and seconds kvpool's loads took for it (0 for other connectors)."""
    prompts = spec["prompts"]
    phase = f"{name} warm"
    progress(phase, 0, len(prompts))
    warm_spec = {**spec, "phases": [[p] for p in prompts]}
    del warm_spec["prompts"]
    result = EngineSession.run(
        warm_spec, workdir, f"{name}-warm", on_progress=lambda n: progress(phase, n, len(prompts))
    )
    out = []
    before: dict[str, Any] = {}
    for done in result["phases"]:
        now = done["connector"]
        nbytes = int(now.get("bytes_loaded", 0) - before.get("bytes_loaded", 0))
        seconds = float(now.get("load_s", 0.0) - before.get("load_s", 0.0))
        out.append((done["results"][0], nbytes, seconds))
        before = now
    return out


def mooncake_env(workdir: Path, master_address: str) -> dict[str, str]:
    """vLLM's in-tree Mooncake connector reads its settings from a file."""
    mc_config = workdir / "mooncake.json"
    mc_config.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": master_address,
                "protocol": "tcp",
                "device_name": "",
                "mode": "standalone-store",
                "global_segment_size": 0,
                "local_buffer_size": "64MB",
            }
        )
    )
    return {
        "MOONCAKE_CONFIG_PATH": str(mc_config),
        "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1",
    }


def run_engine_bench(
    workdir: Path,
    *,
    shape: ModelShape = SHAPES["llama3-8b"],
    lengths: Sequence[int] = (1000, 4000),
    connectors: tuple[str, ...] = ("kvpool", "mooncake"),
    extra: dict[str, Any] | None = None,
    on_progress: Progress | None = None,
    samples: int = 1,
) -> EngineBench:
    """``extra``: kvpool connector settings (``kv_connector_extra_config``).
    ``samples``: distinct prompts per length, each measured once per engine; a
    row gives their medians (``collapse``)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    progress = on_progress or (lambda *_: None)
    workdir.mkdir(parents=True, exist_ok=True)
    asked = tuple(lengths)
    lengths = [n for n in asked for _ in range(samples)]
    longest = max(lengths)
    max_len = longest + 2 * MAX_TOKENS + BLOCK
    model = build_shaped_llama(workdir / "model", shape, TINY_HIDDEN, max_len)
    ids = _prompts(lengths)
    kv_bytes = sum(lengths) * shape.kv_bytes_per_token
    # The engine's KV cache holds the longest prompt and the warm-up one beside it,
    # with a GiB to spare.
    kv_gib = shape.kv_cache_gib(2 * (longest + BLOCK)) + 1
    base_spec: dict[str, Any] = {
        "model": str(model),
        "max_tokens": MAX_TOKENS,
        "block_size": BLOCK,
        "dtype": shape.dtype,
        "max_model_len": max_len,
        # A prompt shorter than a block first: no measured request pays the first
        # request's costs (2-4 s of kernel compiles), and no pool sees it.
        "warmup": True,
        "warmup_tokens": WARMUP_TOKENS,
        "progress": True,
        "env": {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), **RESERVED_CPUS},
    }
    twice = [p for p in ids for _ in range(2)]
    baseline = run_engine(
        {**base_spec, "prompts": twice, "connector": "none"},
        workdir / "none.json",
        "no connector",
        progress,
    )
    full, local_hit = baseline["results"][0::2], baseline["results"][1::2]
    runs = []
    # Room for every connector's objects (each also saves its engine's warm-up
    # prompt, as long as the longest), with headroom for headers and slack: a
    # pool that fills up evicts the first connector's objects under the second.
    saved = kv_bytes + longest * shape.kv_bytes_per_token
    pool = LocalPool.start(
        workdir / "pool", segment_size=max(2 << 30, len(connectors) * saved * 5 // 4)
    )
    try:
        cfg = pool.config()
        pool_file = pool.write_pool_file(workdir / "pool.json")
        env = mooncake_env(workdir, cfg.master_address)
        for name in connectors:
            spec = {**base_spec, "prompts": ids, "connector": name}
            if name == "kvpool":
                # Measures the load path: hits load whatever the model's compute
                # costs, unless ``extra`` says otherwise.
                spec["extra"] = {"pool_file": str(pool_file), "load_decision": "load",
                                 **(extra or {})}  # fmt: skip
            before = master_metrics(cfg.metrics_url)
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                cold, landed, expected = _run_cold(
                    spec,
                    workdir,
                    name,
                    progress,
                    cfg.metrics_url,
                    *_objects(name, spec, shape),
                )
                after = master_metrics(cfg.metrics_url)
                loads = _run_warm(spec, workdir, name, progress)
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            rows = tuple(
                LengthRow(
                    n,
                    c["ttft_s"],
                    w["ttft_s"],
                    w["cached_tokens"],
                    # a warm run that hit nothing computed what the prefill did
                    outputs_match(w, h if w["cached_tokens"] else f),
                    nbytes,
                    seconds,
                    c["total_s"],
                )
                for n, c, (w, nbytes, seconds), h, f in zip(
                    lengths, cold["results"], loads, local_hit, full, strict=True
                )
            )
            runs.append(
                ConnectorRun(
                    name,
                    rows,
                    int(
                        after.get("master_allocated_bytes", 0)
                        - before.get("master_allocated_bytes", 0)
                    ),
                    int(after.get("master_key_count", 0) - before.get("master_key_count", 0)),
                    landed,
                    expected,
                )
            )
    finally:
        pool.stop()
    progress("memory copy", 0, 1)
    copies = tuple(copy_seconds(_hittable(n) * shape.kv_bytes_per_token) for n in asked)
    progress("memory copy", 1, 1)
    return collapse(
        EngineBench(
            shape,
            tuple(lengths),
            tuple(r["ttft_s"] for r in full),
            tuple(r["ttft_s"] for r in local_hit),
            tuple(runs),
            prefill_total_s=tuple(r["total_s"] for r in full),
        ),
        samples,
        copies,
    )


def collapse(bench: EngineBench, samples: int, copies: tuple[float, ...]) -> EngineBench:
    """A bench of ``samples`` consecutive prompts per length (``bench.lengths``
    lists each length that many times) as one row per length: medians of every
    time and of the load's bytes and seconds; the fewest hit tokens of any sample
    (a sample that hit nothing makes the row "no hits"); outputs identical only
    if every sample's were. ``copies``: the memory copy per length."""

    def med(xs: Sequence[float], i: int) -> float:
        return float(statistics.median(xs[i * samples : (i + 1) * samples]))

    n, left = divmod(len(bench.lengths), samples)
    groups = {bench.lengths[i * samples : (i + 1) * samples] for i in range(n)}
    if left or len(copies) != n or any(len(set(g)) != 1 for g in groups):
        raise ValueError(f"{bench.lengths}: not {samples} consecutive prompts per length")
    runs = []
    for run in bench.runs:
        rows = []
        for i in range(n):
            part = run.rows[i * samples : (i + 1) * samples]
            rows.append(
                LengthRow(
                    part[0].tokens,
                    statistics.median(r.cold_ttft_s for r in part),
                    statistics.median(r.warm_ttft_s for r in part),
                    min(r.hit_tokens for r in part),
                    all(r.identical for r in part),
                    int(statistics.median(r.load_bytes for r in part)),
                    statistics.median(r.load_s for r in part),
                    statistics.median(r.cold_total_s for r in part),
                )
            )
        runs.append(dataclasses.replace(run, rows=tuple(rows)))
    return EngineBench(
        bench.shape,
        bench.lengths[::samples],
        tuple(med(bench.prefill_s, i) for i in range(n)),
        tuple(med(bench.local_hit_s, i) for i in range(n)),
        tuple(runs),
        copies,
        samples,
        tuple(med(bench.prefill_total_s, i) for i in range(n)) if bench.prefill_total_s else (),
    )

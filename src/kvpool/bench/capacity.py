"""``kvpool bench capacity``: a pool whose working set is N times its memory.

    zipf_trace(prefixes, requests, alpha, seed) -> prefix index per request
    lru_hits(trace, chunks, capacity)       -> per request, the leading chunks an LRU
                                               cache of ``capacity`` chunks holds
    run_capacity_bench(workdir, shape=..., workload=CapacityWorkload(), ...)
                                            -> CapacityBench, a row per N and run
    CapacityBench.summary()                 -> per N, the median over runs

For each N (``ratios``): a fresh pool of ``pool_mib``, and ``N x pool / prefix``
distinct prefixes of ``prefix_tokens`` tokens (random tokens each) whose
popularity is Zipf(``alpha``): a few hot, a long tail seen once. A trace of
``requests_per_prefix x prefixes`` requests (prefix + a suffix of its own) is
split into ``engines`` consecutive slices, each replayed by a fresh engine
process, one request at a time. vLLM's own prefix cache is off in these engines
(``local_cache=False``), so every reuse is a pool hit: the bench measures what
the pool keeps, not what an engine keeps.

Per N: the pool hit rate (prompt tokens loaded from the pool over the tokens any
cache could supply: whole chunks of the prefix), against an LRU cache of the same
bytes replaying the same trace (chunk-granular, a request's chunks used last
chunk first); bytes and objects the pool evicted and puts it refused for lack of
space (the master's counters over the run); the engines' puts that met a full
pool and went again, objects dropped after that (none is the target), loads
that found an object evicted since the lookup; TTFT medians of requests that hit
and that missed. After the trace, one more fresh engine asks the ``NEWEST``
prefixes the trace used last (a new suffix each): the share of their prefix
tokens it loads is what a full pool keeps of what it was given last (the
target: all of it). With ``repeats`` > 1 each N runs that many times, each on a
fresh pool with fresh engines and the same trace (runs differ by what the
engines' timing leaves leased when the pool evicts); ``summary`` takes the
median of each figure over the runs, and sums the drops. Nothing is counted
from a warm-up: each engine first runs one
unrelated prompt shorter than a block, which the pool never sees.
"""

from __future__ import annotations

import random
import statistics
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpool.demo.run import run_engine
from kvpool.demo.shapes import SHAPES, TINY_HIDDEN, ModelShape
from kvpool.demo.tiny_model import build_shaped_llama
from kvpool.pool import LocalPool, master_metrics
from kvpool.pool.local import LEASE_TTL_MS

__all__ = [
    "CapacityBench",
    "CapacityRow",
    "CapacityWorkload",
    "lru_hits",
    "run_capacity_bench",
    "zipf_trace",
]

Progress = Callable[[str, int, int], None]
BLOCK = 32
NEWEST = 4  # the distinct prefixes, last used first, that the final engine asks again


@dataclass(frozen=True, slots=True)
class CapacityWorkload:
    pool_mib: int = 128
    prefix_tokens: int = 512  # a multiple of BLOCK
    suffix_tokens: int = 16
    ratios: tuple[int, ...] = (1, 2, 4, 8)  # working set over pool memory
    requests_per_prefix: int = 3  # trace length per distinct prefix
    alpha: float = 1.0  # Zipf exponent of prefix popularity
    engines: int = 3  # fresh engine processes that replay a trace in turn
    lease_ttl_ms: int = LEASE_TTL_MS  # the pool's read lease (kvpool up's default)
    local_cache: bool = False  # vLLM's own prefix cache in the engines
    seed: int = 0
    repeats: int = 1  # runs per N, each on a fresh pool (medians are reported)


def zipf_trace(prefixes: int, requests: int, alpha: float, seed: int = 0) -> list[int]:
    """``requests`` prefix indices drawn with P(i) ~ 1 / (i + 1) ** alpha."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** alpha for i in range(prefixes)]
    return rng.choices(range(prefixes), weights=weights, k=requests)


def lru_hits(trace: Sequence[int], chunks: int, capacity: int) -> list[int]:
    """Per request of ``trace``, the leading chunks of its prefix (of ``chunks``) that
    an LRU cache of ``capacity`` chunks holds; then the request uses all of them,
    last chunk first (so a prefix loses its end first, as kvpool orders them)."""
    cache: OrderedDict[tuple[int, int], None] = OrderedDict()
    out = []
    for p in trace:
        hit = 0
        while hit < chunks and (p, hit) in cache:
            hit += 1
        out.append(hit)
        for c in reversed(range(chunks)):
            cache[(p, c)] = None
            cache.move_to_end((p, c))
        while len(cache) > capacity:
            cache.popitem(last=False)
    return out


@dataclass(frozen=True, slots=True)
class CapacityRow:
    """One working-set ratio N."""

    ratio: int
    prefixes: int  # distinct prefixes (working set: ratio x pool)
    requests: int
    hittable_tokens: int  # prompt tokens any cache could supply (whole prefix chunks)
    pool_hit_tokens: int  # loaded from the pool
    lru_hit_tokens: int  # an LRU cache of the pool's bytes, same trace
    evicted_bytes: int  # the master's counters over the run
    evicted_objects: int
    pool_refused_puts: int  # the master: puts that found no space (then retried)
    puts_retried: int  # the engines: objects whose put met a full pool
    dropped: int  # the engines: objects still refused after retrying (target: 0)
    missing_loads: int  # loads that found an object evicted since the lookup
    ttft_hit_s: float | None  # median TTFT of requests with a pool hit
    ttft_miss_s: float | None  # of requests without
    newest_kept: float  # after the trace, a fresh engine's hit rate on its newest prefixes
    run: int = 0  # which of the workload's repeats
    hit_spread: float = 0.0  # in a summary row: max - min of the runs' pool hit rates

    @property
    def pool_hit_rate(self) -> float:
        return self.pool_hit_tokens / self.hittable_tokens if self.hittable_tokens else 0.0

    @property
    def lru_hit_rate(self) -> float:
        return self.lru_hit_tokens / self.hittable_tokens if self.hittable_tokens else 0.0


@dataclass(frozen=True, slots=True)
class CapacityBench:
    shape: ModelShape
    workload: CapacityWorkload
    rows: tuple[CapacityRow, ...]  # a row per N and run

    def summary(self) -> list[CapacityRow]:
        """Per N (in run order), one row of the runs' medians: counts and TTFTs
        are medians, ``dropped`` the sum, ``hit_spread`` the range of hit rates."""
        out = []
        for ratio in dict.fromkeys(r.ratio for r in self.rows):
            runs = [r for r in self.rows if r.ratio == ratio]
            if len(runs) == 1:
                out.append(runs[0])
                continue

            def med_int(name: str, runs: list[CapacityRow] = runs) -> int:
                return round(float(statistics.median(getattr(r, name) for r in runs)))

            rates = [r.pool_hit_rate for r in runs]
            hits = [r.ttft_hit_s for r in runs if r.ttft_hit_s is not None]
            misses = [r.ttft_miss_s for r in runs if r.ttft_miss_s is not None]
            out.append(
                CapacityRow(
                    ratio=ratio,
                    prefixes=runs[0].prefixes,
                    requests=runs[0].requests,
                    hittable_tokens=runs[0].hittable_tokens,
                    pool_hit_tokens=round(statistics.median(rates) * runs[0].hittable_tokens),
                    lru_hit_tokens=runs[0].lru_hit_tokens,
                    evicted_bytes=med_int("evicted_bytes"),
                    evicted_objects=med_int("evicted_objects"),
                    pool_refused_puts=med_int("pool_refused_puts"),
                    puts_retried=med_int("puts_retried"),
                    dropped=sum(r.dropped for r in runs),
                    missing_loads=med_int("missing_loads"),
                    ttft_hit_s=_median(hits),
                    ttft_miss_s=_median(misses),
                    newest_kept=statistics.median(r.newest_kept for r in runs),
                    run=len(runs),
                    hit_spread=max(rates) - min(rates),
                )
            )
        return out


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def _median(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def run_capacity_bench(
    workdir: Path,
    *,
    shape: ModelShape = SHAPES["small"],
    workload: CapacityWorkload = CapacityWorkload(),
    on_progress: Progress | None = None,
) -> CapacityBench:
    progress = on_progress or (lambda *_: None)
    w = workload
    if w.prefix_tokens % BLOCK:
        raise ValueError(f"prefix_tokens must be a multiple of {BLOCK}, got {w.prefix_tokens}")
    workdir.mkdir(parents=True, exist_ok=True)
    tokens = w.prefix_tokens + w.suffix_tokens
    max_len = tokens + 2 * BLOCK
    model = build_shaped_llama(workdir / "model", shape, TINY_HIDDEN, max_len)
    pool_bytes = w.pool_mib << 20
    prefix_bytes = w.prefix_tokens * shape.kv_bytes_per_token
    chunk_bytes = BLOCK * shape.kv_bytes_per_token
    chunks = w.prefix_tokens // BLOCK
    rows = []
    for ratio in w.ratios:
        prefixes = max(1, ratio * pool_bytes // prefix_bytes)
        trace = zipf_trace(prefixes, w.requests_per_prefix * prefixes, w.alpha, w.seed + ratio)
        lru = lru_hits(trace, chunks, pool_bytes // chunk_bytes)
        prompts = [
            _tokens(1000 * ratio + p, w.prefix_tokens) + _tokens(-1 - i, w.suffix_tokens)
            for i, p in enumerate(trace)
        ]
        newest = list(dict.fromkeys(reversed(trace)))[:NEWEST]
        again = [
            _tokens(1000 * ratio + p, w.prefix_tokens) + _tokens(-(10**6) - p, w.suffix_tokens)
            for p in newest
        ]
        for run in range(w.repeats):
            row = _run_ratio(
                workdir / f"n{ratio}-{run}", model, shape, w, ratio, prefixes, prompts, again,
                lru, progress if w.repeats == 1 else _tagged(progress, run, w.repeats),
            )  # fmt: skip
            rows.append(replace(row, run=run))
    return CapacityBench(shape, workload, tuple(rows))


def _tagged(progress: Progress, run: int, runs: int) -> Progress:
    return lambda phase, done, total: progress(f"{phase} (run {run + 1}/{runs})", done, total)


def _run_ratio(
    workdir: Path,
    model: Path,
    shape: ModelShape,
    w: CapacityWorkload,
    ratio: int,
    prefixes: int,
    prompts: list[list[int]],
    again: list[list[int]],
    lru: list[int],
    progress: Progress,
) -> CapacityRow:
    workdir.mkdir(parents=True, exist_ok=True)
    pool = LocalPool.start(
        workdir / "pool", segment_size=w.pool_mib << 20, lease_ttl_ms=w.lease_ttl_ms
    )
    results: list[dict[str, Any]] = []
    stats: list[dict[str, Any]] = []
    try:
        before = master_metrics(pool.metrics_url)
        pool_file = pool.write_pool_file(workdir / "pool.json")
        n = len(prompts)
        cuts = [n * e // w.engines for e in range(w.engines + 1)]
        parts = [prompts[cuts[e] : cuts[e + 1]] for e in range(w.engines)]
        for e, part in enumerate([*parts, again]):
            if not part:
                continue
            spec = {
                "model": str(model),
                "prompts": part,
                "max_tokens": 2,
                "block_size": BLOCK,
                "dtype": shape.dtype,
                "max_model_len": w.prefix_tokens + w.suffix_tokens + 2 * BLOCK,
                "connector": "kvpool",
                # Measures the pool's hits: loaded whatever the model's compute costs.
                "extra": {"pool_file": str(pool_file), "load_decision": "load"},
                "prefix_caching": w.local_cache,
                # An unrelated prompt first, shorter than a block: no request pays the
                # process's first-request costs, and the pool never sees it.
                "warmup": True,
                "warmup_tokens": BLOCK // 2,
                "progress": True,
                "settle_saves": True,
            }
            if e == len(parts):  # the final engine: what the pool kept of the newest
                after = master_metrics(pool.metrics_url)
                out = run_engine(spec, workdir / "newest.json", f"N={ratio} newest", progress)
                kept = sum(min(r["cached_tokens"], w.prefix_tokens) for r in out["results"])
                break
            phase = f"N={ratio} engine {e + 1}/{w.engines}"
            out = run_engine(spec, workdir / f"engine{e}.json", phase, progress)
            results += out["results"]
            stats.append(out.get("connector", {}))
    finally:
        pool.stop()

    def grew(name: str) -> int:
        return int(after.get(name, 0) - before.get(name, 0))

    def total(key: str, cause: str | None = None) -> int:
        if cause is None:
            return sum(int(s.get(key, 0)) for s in stats)
        return sum(int(s.get(key, {}).get(cause, 0)) for s in stats)

    hits = [r for r in results if r["cached_tokens"] > 0]
    misses = [r for r in results if r["cached_tokens"] == 0]
    return CapacityRow(
        ratio=ratio,
        prefixes=prefixes,
        requests=len(results),
        hittable_tokens=len(results) * w.prefix_tokens,
        pool_hit_tokens=sum(min(r["cached_tokens"], w.prefix_tokens) for r in results),
        lru_hit_tokens=sum(lru) * BLOCK,
        evicted_bytes=grew("master_evicted_size_bytes"),
        evicted_objects=grew("master_evicted_key_count"),
        pool_refused_puts=grew("master_put_start_alloc_failures_total"),
        puts_retried=total("puts_no_space"),
        dropped=total("failures", "no_space"),
        missing_loads=total("failures", "missing"),
        ttft_hit_s=_median([r["ttft_s"] for r in hits]),
        ttft_miss_s=_median([r["ttft_s"] for r in misses]),
        newest_kept=kept / (len(again) * w.prefix_tokens),
    )

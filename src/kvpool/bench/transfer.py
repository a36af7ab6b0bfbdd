"""Transfer throughput: paged KV tensors -> pool -> KV tensors through ``TransferEngine``.
(A little over 500 lines: six variants on two paths, each timed and verified alike.)

    run_transfer_bench(config, ...) -> TransferBench   measure; prints nothing

KV caches and their shapes are ``kvpool.bench.paged_kv``'s; the worker hooks'
idle cost (``HookOverhead``) is measured by ``kvpool.bench.hooks``.

For each path (``tcp``: ``MooncakeStore(shared_memory=False)``; ``shm``:
``shared_memory=True``), with staged loads as the vLLM connector runs them
(``load_mode="auto"``: verified in staging, then copied in), and object size,
two KV caches are built in vLLM's CPU layout (one contiguous float32
allocation; per layer a view ``[num_blocks, 2, block_size, kv_heads*head_size]``;
a chunk object is one block over all layers). Every repeat saves ``total //
size`` chunks from randomly chosen blocks of the first cache with
``submit_save`` + ``wait`` (in jobs of ``job_bytes``, at most 1024 segments:
``job_size``), then loads them into other random blocks of the second cache
with ``submit_load`` + ``wait``, through (each on a pool client of its own, as
a worker runs one of them)

* ``kvpool``: ``TransferEngine`` over ``FramedStore(checksum=False)``,
* ``kvpool+checksum``: the same with payload checksums (xxh3) written and verified,
* ``kvpool+secret``: the same with a pool secret too (every object signed with
  HMAC-SHA256 and the signature checked on load): what signing costs,
* ``zero-copy`` and ``zero-copy+checksum``: ``TransferEngine(zero_copy=True)``
  over KV caches in memory the store reaches (shared memory: from
  ``alloc_staging``, as the connector's ``zero_copy`` places vLLM's), no staging,
* ``raw``: a separate Mooncake client's ``batch_put_from_multi_buffers`` /
  ``batch_get_into_multi_buffers`` on the same per-object segments (one per
  layer), one batch per job. TCP: a pure client with both KV caches
  registered. Shared memory: a dummy client whose two buffers from
  ``alloc_from_mem_pool`` (registered whole) are replicas of the KV caches.

The order of the six rotates every repeat; keys are fresh each repeat and
removed (forced, untimed) after it. A numpy copy of the same bytes is the
memory-bandwidth baseline. Repeat 0 warms up, is not counted, and verifies the
bytes of every object of every variant (into a zeroed destination).
Figures are medians over ``repeats``; GB/s counts payload bytes, GB = 1e9
bytes; end to end is bytes / median(save + load).
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
import uuid
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvpool.bench.hooks import HookOverhead, measure_hook_overhead
from kvpool.bench.paged_kv import KiB, KVShape, MiB, PagedKV, Progress, kv_shape_for
from kvpool.config import PoolConfig
from kvpool.errors import StoreError
from kvpool.store.base import Status
from kvpool.store.framed import FramedStore
from kvpool.store.mooncake import MooncakeStore
from kvpool.store.scatter import Segment
from kvpool.transfer import ChunkRef, JobResult, TransferEngine

__all__ = [
    "DEFAULT_SIZES",
    "PATHS",
    "SizeResult",
    "TransferBench",
    "VariantResult",
    "job_size",
    "run_transfer_bench",
]

DEFAULT_SIZES = (32 * KiB, 256 * KiB, 1 * MiB)
PATHS = ("tcp", "shm")
VARIANTS = ("raw", "kvpool", "kvpool+checksum", "kvpool+secret", "zero-copy", "zero-copy+checksum")
_BENCH_SECRET = bytes(range(32))  # any 32 bytes: the cost does not depend on them
_BENCH_FP = "6b76706f6f6c6265"  # b"kvpoolbe": the bench's own key space
_WAIT_S = 120.0  # a job that takes longer than this is a hung pool
MAX_SLICES = 1024  # segments per batch call kept well below the TCP lane queue (2048)


@dataclass(frozen=True, slots=True)
class VariantResult:
    """Median throughputs of one way of moving the bytes, in GB/s."""

    name: str  # one of VARIANTS
    save: float
    load: float
    end_to_end: float  # bytes / median(save + load seconds)
    submit: float  # bytes / median time the caller spent in submit_save (0 for raw)
    failures: int  # objects not OK, refused, or not byte-equal (over all repeats)


@dataclass(frozen=True, slots=True)
class SizeResult:
    """One path and object size."""

    path: str  # "tcp" or "shm" (as asked)
    transport: str  # "tcp" or "shared memory" (as used: shm falls back to TCP)
    load_mode: str  # the engine's: "direct" or "staged"
    size: int  # bytes per object
    objects: int  # objects per repeat
    jobs: int  # save (and load) jobs per repeat
    shape: KVShape
    raw: VariantResult
    kvpool: VariantResult  # checksum off
    checksum: VariantResult  # kvpool with checksum on
    copy: float  # GB/s of a numpy copy of the same bytes
    zero: VariantResult | None = None  # zero copy, checksum off
    zero_checksum: VariantResult | None = None  # zero copy, checksum on
    secret: VariantResult | None = None  # kvpool with checksum on and a pool secret

    @property
    def save_ratio(self) -> float:
        return _ratio(self.kvpool.save, self.raw.save)

    @property
    def load_ratio(self) -> float:
        return _ratio(self.kvpool.load, self.raw.load)

    @property
    def checksum_save_ratio(self) -> float:
        return _ratio(self.checksum.save, self.raw.save)

    @property
    def checksum_load_ratio(self) -> float:
        return _ratio(self.checksum.load, self.raw.load)

    @property
    def zero_save_ratio(self) -> float:
        return _ratio(self.zero.save, self.raw.save) if self.zero else 0.0

    @property
    def zero_load_ratio(self) -> float:
        return _ratio(self.zero.load, self.raw.load) if self.zero else 0.0

    @property
    def zero_checksum_save_ratio(self) -> float:
        return _ratio(self.zero_checksum.save, self.raw.save) if self.zero_checksum else 0.0

    @property
    def zero_checksum_load_ratio(self) -> float:
        return _ratio(self.zero_checksum.load, self.raw.load) if self.zero_checksum else 0.0

    @property
    def failures(self) -> int:
        return sum(v.failures for v in self.variants)

    @property
    def variants(self) -> tuple[VariantResult, ...]:
        out = (self.raw, self.kvpool, self.checksum)
        more = (self.secret, self.zero, self.zero_checksum)
        return out + tuple(v for v in more if v is not None)

    @property
    def secret_cost(self) -> float:
        """End-to-end seconds with a pool secret over those without (checksum on)."""
        if self.secret is None or not self.secret.end_to_end:
            return 0.0
        return _ratio(self.checksum.end_to_end, self.secret.end_to_end)


@dataclass(frozen=True, slots=True)
class TransferBench:
    """The whole run."""

    results: tuple[SizeResult, ...]
    master_address: str
    repeats: int
    total_bytes: int  # bytes per repeat (objects * size)
    job_bytes: int  # bytes per save/load job
    hooks: HookOverhead | None = None

    @property
    def failures(self) -> int:
        return sum(r.failures for r in self.results)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _gbps(nbytes: int, seconds: Sequence[float]) -> float:
    if not seconds:
        return 0.0
    median = statistics.median(seconds)
    return nbytes / median / 1e9 if median > 0 else 0.0


# --------------------------------------------------------------------------- one size


@dataclass
class _Times:
    save: list[float]
    load: list[float]
    both: list[float]
    submit: list[float]
    failures: int = 0

    @classmethod
    def empty(cls) -> _Times:
        return cls([], [], [], [])

    def result(self, name: str, nbytes: int) -> VariantResult:
        return VariantResult(
            name,
            save=_gbps(nbytes, self.save),
            load=_gbps(nbytes, self.load),
            end_to_end=_gbps(nbytes, self.both),
            submit=_gbps(nbytes, self.submit) if self.submit else 0.0,
            failures=self.failures,
        )


def _wait(engine: TransferEngine, ids: list[Hashable]) -> list[JobResult]:
    results = engine.wait(ids, timeout=_WAIT_S)
    if len(results) != len(ids):
        raise StoreError(f"{len(ids) - len(results)} transfer jobs did not finish in {_WAIT_S} s")
    return results


def _engine_round(
    saver: TransferEngine,
    loader: TransferEngine,
    keys: list[str],
    src_ids: npt.NDArray[np.int64],
    dst_ids: npt.NDArray[np.int64],
    jobs: list[tuple[int, int]],
) -> tuple[float, float, float, npt.NDArray[np.bool_]]:
    """(save s, time in submit_save s, load s, per object: saved and loaded OK)."""
    tag = keys[0]
    saves = [
        ChunkRef(k, 0, i, (int(b),)) for i, (k, b) in enumerate(zip(keys, src_ids, strict=True))
    ]
    loads = [
        ChunkRef(k, 0, i, (int(b),)) for i, (k, b) in enumerate(zip(keys, dst_ids, strict=True))
    ]
    ok = np.ones(len(keys), dtype=np.bool_)
    save_ids: list[Hashable] = [(tag, "save", j) for j in range(len(jobs))]
    load_ids: list[Hashable] = [(tag, "load", j) for j in range(len(jobs))]
    submit = 0.0
    start = time.perf_counter()
    for job, (a, b) in zip(save_ids, jobs, strict=True):
        t = time.perf_counter()
        saver.submit_save(job, saves[a:b])
        submit += time.perf_counter() - t
    saved = _wait(saver, save_ids)
    t_save = time.perf_counter() - start
    start = time.perf_counter()
    for job, (a, b) in zip(load_ids, jobs, strict=True):
        loader.submit_load(job, loads[a:b])
    loaded = _wait(loader, load_ids)
    t_load = time.perf_counter() - start
    index = {k: i for i, k in enumerate(keys)}
    span = dict(zip(save_ids, jobs, strict=True))
    for r in saved:
        for i in (index[k] for k, s in r.statuses.items() if not s.stored):
            ok[i] = False
        if r.skipped:  # refused (backpressure, staging or queue full): nothing written
            a, b = span[r.job_id]
            ok[a:b] = False
    for r in loaded:
        for i in (index[k] for k, s in r.statuses.items() if not s.ok):
            ok[i] = False
    return t_save, submit, t_load, ok


def _raw_round(
    raw: Any,
    keys: list[str],
    put: tuple[list[list[int]], list[list[int]]],
    get: tuple[list[list[int]], list[list[int]]],
    size: int,
    jobs: list[tuple[int, int]],
) -> tuple[float, float, npt.NDArray[np.bool_]]:
    """(put s, get s, per object OK): Mooncake's multi-buffer batch calls, one per job."""
    put_one = raw.batch_put_from_multi_buffers
    get_one = raw.batch_get_into_multi_buffers
    codes_put: list[int] = []
    codes_get: list[int] = []
    start = time.perf_counter()
    for a, b in jobs:
        codes_put += put_one(keys[a:b], put[0][a:b], put[1][a:b])
    t_put = time.perf_counter() - start
    start = time.perf_counter()
    for a, b in jobs:
        codes_get += get_one(keys[a:b], get[0][a:b], get[1][a:b])
    t_get = time.perf_counter() - start
    ok = (np.array(codes_put) == 0) & (np.array(codes_get) == size)
    return t_put, t_get, ok


def _split(segments: list[list[Segment]]) -> tuple[list[list[int]], list[list[int]]]:
    return [[a for a, _ in s] for s in segments], [[n for _, n in s] for s in segments]


@dataclass(frozen=True, slots=True)
class _Variant:
    """One way of moving the bytes: engines on a pool client of its own."""

    saver: TransferEngine
    loader: TransferEngine
    src: PagedKV
    dst: PagedKV


def _variant(
    stack: contextlib.ExitStack,
    config: PoolConfig,
    shm: bool,
    name: str,
    src: PagedKV,
    dst: PagedKV,
    staging_bytes: int,
) -> _Variant:
    """The engines of variant ``name`` over a new ``FramedStore(MooncakeStore)``, as a
    worker runs one of them (sharing a client between variants slowed the later
    ones' Mooncake calls in one process by up to a third, measured; raw has its own).
    Staged variants move the shared KV caches ``src`` and ``dst``; zero-copy ones
    copies of them in memory their client reaches."""
    checksum = name.endswith(("+checksum", "+secret"))
    secret = _BENCH_SECRET if name.endswith("+secret") else None
    framed = FramedStore(
        MooncakeStore(config, shared_memory=shm), _BENCH_FP, checksum=checksum, secret=secret
    )
    stack.callback(framed.close)

    def engine(cache: PagedKV, **options: Any) -> TransferEngine:
        out = TransferEngine(framed, [cache.layers], cache.num_blocks, **options)
        stack.callback(out.close)
        return out

    if not name.startswith("zero"):
        saver = engine(src, staging_bytes=staging_bytes)
        loader = engine(dst, staging_bytes=staging_bytes, load_mode="staged")
        return _Variant(saver, loader, src, dst)

    def home(n: int) -> torch.Tensor | None:
        return torch.from_numpy(framed.alloc_staging(n)) if shm else None

    zsrc = PagedKV(src.shape, src.num_blocks, home(src.nbytes))
    zsrc.bytes[:] = src.bytes
    zdst = PagedKV(dst.shape, dst.num_blocks, home(dst.nbytes))
    return _Variant(engine(zsrc, zero_copy=True), engine(zdst, zero_copy=True), zsrc, zdst)


def _bench_size(
    config: PoolConfig,
    path: str,
    shape: KVShape,
    objects: int,
    repeats: int,
    job_chunks: int,
    staging_bytes: int,
    tick: Callable[[], None],
) -> SizeResult:
    size = shape.object_nbytes
    nbytes = size * objects
    jobs = [(a, min(a + job_chunks, objects)) for a in range(0, objects, job_chunks)]
    rng = np.random.default_rng(size)
    src = PagedKV(shape, objects)
    src.bytes[:] = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
    dst = PagedKV(shape, objects)
    copy_dst = np.empty(src.nbytes, dtype=np.uint8)
    times = {v: _Times.empty() for v in VARIANTS}
    copies: list[float] = []
    shm = path == "shm"
    with contextlib.ExitStack() as stack:
        raw_store = MooncakeStore(config, shared_memory=shm)
        stack.callback(raw_store.close)
        # Raw puts and gets need memory their client can use: the KV caches themselves
        # over TCP, replicas in the dummy client's shared memory otherwise.
        if raw_store.shared_memory:
            raw_src = PagedKV(shape, objects, torch.from_numpy(raw_store.alloc_staging(src.nbytes)))
            raw_src.bytes[:] = src.bytes
            raw_dst = PagedKV(shape, objects, torch.from_numpy(raw_store.alloc_staging(dst.nbytes)))
        else:
            raw_src, raw_dst = src, dst
            raw_store.register_memory(src.base, src.nbytes)
            raw_store.register_memory(dst.base, dst.nbytes)
        ways = {
            name: _variant(stack, config, shm, name, src, dst, staging_bytes)
            for name in VARIANTS
            if name != "raw"
        }
        transport = "shared memory" if raw_store.shared_memory else config.protocol
        load_mode = ways["kvpool"].loader.load_mode
        for rep in range(repeats + 1):  # repeat 0 warms up and verifies; not counted
            src_ids = rng.permutation(objects).astype(np.int64)
            dst_ids = rng.permutation(objects).astype(np.int64)
            put = _split(raw_src.segments(src_ids))
            get = _split(raw_dst.segments(dst_ids))
            tag = uuid.uuid4().hex[:12]
            order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
            for name in order:
                keys = [f"kvpool-bench/transfer/{tag}/{name}/{i}" for i in range(objects)]
                t = times[name]
                way = ways.get(name)
                pair = (raw_src, raw_dst) if way is None else (way.src, way.dst)
                if rep == 0:
                    pair[1].flat.zero_()
                if way is None:
                    t_save, t_load, ok = _raw_round(raw_store.raw, keys, put, get, size, jobs)
                    t_submit = None
                else:
                    t_save, t_submit, t_load, ok = _engine_round(
                        way.saver, way.loader, keys, src_ids, dst_ids, jobs
                    )
                if rep == 0:
                    ok &= pair[1].equal(dst_ids, pair[0], src_ids)
                else:
                    t.save.append(t_save)
                    t.load.append(t_load)
                    t.both.append(t_save + t_load)
                    if t_submit is not None:
                        t.submit.append(t_submit)
                t.failures += int(objects - ok.sum())
                # Each variant's objects go before the next one writes: the holder
                # need hold one variant's bytes, not all six (at real KV sizes
                # the later variants' puts otherwise met a full pool).
                removed = raw_store.batch_remove(keys, force=True)
                if Status.UNAVAILABLE in removed:
                    raise StoreError(f"the pool at {config.master_address} stopped answering")
            start = time.perf_counter()
            np.copyto(copy_dst, src.bytes)
            if rep:
                copies.append(time.perf_counter() - start)
            tick()
    return SizeResult(
        path=path,
        transport=transport,
        load_mode=load_mode,
        size=size,
        objects=objects,
        jobs=len(jobs),
        shape=shape,
        raw=times["raw"].result("raw", nbytes),
        kvpool=times["kvpool"].result("kvpool", nbytes),
        checksum=times["kvpool+checksum"].result("kvpool+checksum", nbytes),
        copy=_gbps(nbytes, copies),
        zero=times["zero-copy"].result("zero-copy", nbytes),
        zero_checksum=times["zero-copy+checksum"].result("zero-copy+checksum", nbytes),
        secret=times["kvpool+secret"].result("kvpool+secret", nbytes),
    )


# --------------------------------------------------------------------------- the run


def job_size(shape: KVShape, objects: int, job_bytes: int) -> int:
    """Chunks per save/load job: ``job_bytes`` worth, at most ``MAX_SLICES`` segments.

    Mooncake's TCP transport queues about 2048 slices in flight; a batch call
    that overflows it (a direct load moves one segment per layer and object)
    fails the excess objects with -800, at times only after blocking 60 s, and
    so does the raw baseline. Half of that keeps clear of it (measured).
    """
    per_object = max(shape.layers, 2)  # direct loads: one per layer; saves: header + payload
    return max(1, min(objects, job_bytes // shape.object_nbytes, MAX_SLICES // per_object))


def run_transfer_bench(
    config: PoolConfig,
    sizes: Sequence[int] = DEFAULT_SIZES,
    total_bytes: int = 64 * MiB,
    repeats: int = 5,
    paths: Sequence[str] = PATHS,
    layers: int = 8,
    job_bytes: int = 16 * MiB,
    hook_steps: int = 10_000,
    on_progress: Progress | None = None,
    staging_bytes: int | None = None,
) -> TransferBench:
    """Measure every path and size (and the idle hooks unless ``hook_steps`` is 0).

    ``staging_bytes`` per engine defaults to vLLM's connector default (256 MiB)
    or twice ``total_bytes`` if larger. Raises ``ValueError`` for sizes no KV
    shape gives or that exceed ``total_bytes``, and ``StoreError`` if the pool
    cannot be used.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"paths must be among {', '.join(PATHS)}")
    if any(s <= 0 or s > total_bytes for s in sizes):
        raise ValueError(f"every object size must be in 1..{total_bytes} bytes (--total)")
    shapes = [kv_shape_for(s, layers) for s in sizes]
    progress = on_progress or (lambda *_: None)
    staging = staging_bytes or max(256 * MiB, 2 * total_bytes)
    results = []
    steps = len(shapes) * (repeats + 1)
    for path in paths:
        progress(path, 0, steps)
        counter = itertools.count(1)
        for shape in shapes:

            def tick(p: str = path, c: Iterator[int] = counter) -> None:
                progress(p, next(c), steps)

            objects = total_bytes // shape.object_nbytes
            job_chunks = job_size(shape, objects, job_bytes)
            results.append(
                _bench_size(config, path, shape, objects, repeats, job_chunks, staging, tick)
            )
    hooks = None
    if hook_steps > 0:
        hooks = measure_hook_overhead(config, hook_steps, progress)
    return TransferBench(
        tuple(results), config.master_address, repeats, total_bytes, job_bytes, hooks
    )

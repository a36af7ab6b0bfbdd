"""Store throughput: our framed Mooncake layer against raw Mooncake calls, same bytes.

    run_store_bench(config, ...) -> StoreBench   measure; prints nothing

For each object size, one batch of ``total_bytes // size`` objects is written
and read back. Each object is a scatter list of ``segments`` slices of one
registered buffer, none adjacent (slice ``j`` of every object lies in region
``j``, like one layer of a KV cache), through

* ``kvpool``: ``FramedStore`` over ``MooncakeStore`` (header segment, checksum
  if configured, status mapping), given the segments as a ``Scatter`` (as
  ``TransferEngine`` does), and
* ``raw``: the same Mooncake client's ``batch_put_from_multi_buffers`` /
  ``batch_get_into_multi_buffers`` on the same segments,

alternating the two paths within every repeat, with fresh keys each time, and
verifying the bytes read back (untimed). ``numpy`` copies the same bytes once
per repeat as a memory-bandwidth baseline. Objects are removed (forced) after
each repeat. Figures are medians over ``repeats`` after one untimed warm-up.
GB/s counts payload bytes only, GB = 1e9 bytes.
"""

from __future__ import annotations

import itertools
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvpool.config import PoolConfig
from kvpool.errors import StoreError
from kvpool.store.base import Status
from kvpool.store.framed import FramedStore
from kvpool.store.mooncake import MooncakeStore
from kvpool.store.scatter import Scatter, Segment

__all__ = ["DEFAULT_SIZES", "SizeResult", "StoreBench", "run_store_bench"]

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = (256 * KiB, 1 * MiB, 4 * MiB)
_BENCH_FP = "6b76706f6f6c6265"  # b"kvpoolbe": the bench's own key space


@dataclass(frozen=True, slots=True)
class SizeResult:
    """Median throughputs for one object size, in GB/s (1e9 bytes per second)."""

    size: int  # bytes per object (payload)
    objects: int  # objects per batch
    ours_put: float
    ours_get: float
    raw_put: float
    raw_get: float
    numpy_copy: float
    failures: int = 0  # objects not OK or not byte-equal, over all repeats and paths

    @property
    def put_ratio(self) -> float:
        return self.ours_put / self.raw_put if self.raw_put else 0.0

    @property
    def get_ratio(self) -> float:
        return self.ours_get / self.raw_get if self.raw_get else 0.0


@dataclass(frozen=True, slots=True)
class StoreBench:
    """The whole run: one row per size, and how it was measured."""

    results: tuple[SizeResult, ...]
    master_address: str
    repeats: int
    segments: int  # scatter segments per object
    checksum: bool  # did the kvpool path write and verify checksums
    transport: str = "tcp"  # "tcp", "rdma" or "shared memory" (both paths use it)


def _gbps(nbytes: int, seconds: Sequence[float]) -> float:
    median = statistics.median(seconds)
    return nbytes / median / 1e9 if median > 0 else 0.0


def _timed(fn: Callable[[list[str]], list[bool]], keys: list[str]) -> tuple[float, list[bool]]:
    start = time.perf_counter()
    ok = fn(keys)
    return time.perf_counter() - start, ok


class _Layout:
    """Where each object's segments lie in a buffer: segment ``j`` of every object
    sits in region ``j`` (like one layer of a KV cache), so no two segments of an
    object are adjacent and none can be merged."""

    def __init__(self, size: int, objects: int, segments: int) -> None:
        self.size, self.objects = size, objects
        self.cuts = [size * i // segments for i in range(segments + 1)]

    def scatter(self, base: int) -> list[list[Segment]]:
        return [
            [
                (base + self.objects * a + k * (b - a), b - a)
                for a, b in itertools.pairwise(self.cuts)
                if b > a
            ]
            for k in range(self.objects)
        ]

    def equal(self, x: npt.NDArray[np.uint8], y: npt.NDArray[np.uint8]) -> npt.NDArray[np.bool_]:
        """Per object: are its bytes equal in ``x`` and ``y``?"""
        same = np.ones(self.objects, dtype=np.bool_)
        for a, b in itertools.pairwise(self.cuts):
            if b > a:
                lo, hi = self.objects * a, self.objects * b
                shape = (self.objects, b - a)
                same &= (x[lo:hi].reshape(shape) == y[lo:hi].reshape(shape)).all(axis=1)
        return same


def run_store_bench(
    config: PoolConfig,
    sizes: Sequence[int] = DEFAULT_SIZES,
    total_bytes: int = 64 * MiB,
    repeats: int = 5,
    segments: int = 4,
    shared_memory: bool = False,
) -> StoreBench:
    """Measure every size; raises ``StoreError`` if the pool cannot be used at all.

    ``shared_memory`` asks for Mooncake's same-host mode (falls back to TCP).
    """
    if repeats < 1 or segments < 1:
        raise ValueError("repeats and segments must be >= 1")
    if any(s <= 0 or s > total_bytes for s in sizes):
        raise ValueError(f"every size must be in 1..{total_bytes} bytes (--total)")
    store = MooncakeStore(config, shared_memory=shared_memory)
    framed = FramedStore(store, _BENCH_FP, checksum=config.checksum, secret=config.secret)
    transport = "shared memory" if store.shared_memory else config.protocol
    try:
        src = framed.alloc_staging(total_bytes)
        src[:] = np.random.default_rng(0).integers(0, 256, total_bytes, dtype=np.uint8)
        dst = framed.alloc_staging(total_bytes)
        dst[:] = 0
        ref = np.zeros(total_bytes, dtype=np.uint8)  # numpy-copy target
        results = tuple(
            _bench_size(framed, store, src, dst, ref, size, total_bytes // size, repeats, segments)
            for size in sizes
        )
    finally:
        framed.close()
    return StoreBench(results, config.master_address, repeats, segments, config.checksum, transport)


def _bench_size(
    framed: FramedStore,
    store: MooncakeStore,
    src: npt.NDArray[np.uint8],
    dst: npt.NDArray[np.uint8],
    ref: npt.NDArray[np.uint8],
    size: int,
    objects: int,
    repeats: int,
    segments: int,
) -> SizeResult:
    raw = store.raw
    nbytes = size * objects
    layout = _Layout(size, objects, segments)
    put_lists = layout.scatter(src.ctypes.data)
    get_lists = layout.scatter(dst.ctypes.data)
    put_ptrs = [[a for a, _ in s] for s in put_lists]
    get_ptrs = [[a for a, _ in s] for s in get_lists]
    lens = [[n for _, n in s] for s in put_lists]
    put_segs = Scatter.from_lists(put_ptrs, lens)  # the form TransferEngine hands over
    get_segs = Scatter.from_lists(get_ptrs, lens)
    times: dict[str, list[float]] = {k: [] for k in ("op", "og", "rp", "rg", "np")}
    failures = 0

    def equal_rows() -> npt.NDArray[np.bool_]:
        """Per object: did it arrive byte-exact? Clears ``dst`` for the next path."""
        same = layout.equal(src, dst)
        dst[:nbytes] = 0
        return same

    Op = Callable[[list[str]], list[bool]]  # per object: did it succeed
    paths: dict[str, tuple[Op, Op]] = {
        "o": (
            lambda keys: [s.ok for s in framed.batch_put(keys, put_segs)],
            lambda keys: [s.ok for s in framed.batch_get(keys, get_segs)],
        ),
        "r": (
            lambda keys: [c == 0 for c in raw.batch_put_from_multi_buffers(keys, put_ptrs, lens)],
            lambda keys: [
                c == size for c in raw.batch_get_into_multi_buffers(keys, get_ptrs, lens)
            ],
        ),
    }
    for rep in range(repeats + 1):  # repeat 0 warms up and is not counted
        tag = uuid.uuid4().hex[:12]
        keys = {
            name: [f"kvpool-bench/{tag}/{name}/{size}/{k}" for k in range(objects)]
            for name in paths
        }
        order = ["o", "r"] if rep % 2 else ["r", "o"]  # alternate which path goes first
        for name in order:
            put, get = paths[name]
            t_put, put_ok = _timed(put, keys[name])
            t_get, get_ok = _timed(get, keys[name])
            ok = np.logical_and(np.logical_and(put_ok, get_ok), equal_rows())
            if rep:
                times[name + "p"].append(t_put)
                times[name + "g"].append(t_get)
                failures += int(objects - ok.sum())
        start = time.perf_counter()
        np.copyto(ref[:nbytes], src[:nbytes])
        if rep:
            times["np"].append(time.perf_counter() - start)
        removed = framed.batch_remove(keys["o"] + keys["r"], force=True)
        if Status.UNAVAILABLE in removed:
            raise StoreError(f"the pool at {store.config.master_address} stopped answering")
    return SizeResult(
        size,
        objects,
        ours_put=_gbps(nbytes, times["op"]),
        ours_get=_gbps(nbytes, times["og"]),
        raw_put=_gbps(nbytes, times["rp"]),
        raw_get=_gbps(nbytes, times["rg"]),
        numpy_copy=_gbps(nbytes, times["np"]),
        failures=failures,
    )

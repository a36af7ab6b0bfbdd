"""TransferEngine over the in-memory store: layouts, striping, reuse, failures."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from tests.factories import key_space, wait_until

from kvpool.header import CheckFailure
from kvpool.kvcache import block_runs, describe_group
from kvpool.layout import Layout
from kvpool.plan import chunk_hashes
from kvpool.store.base import KVStore, Status
from kvpool.store.memory import MemoryStore
from kvpool.transfer import ChunkRef, StagingArena, TransferEngine, saves

NB, BS = 64, 32  # blocks, tokens per block


def cpu_layers(n: int, heads: int = 2, head: int = 32) -> list[tuple[str, torch.Tensor]]:
    """vLLM CPU backend: one allocation, per layer [blocks, 2, block_size, heads*head]."""
    per = NB * 2 * BS * heads * head
    cache = torch.empty(n * per, dtype=torch.float32)
    return [
        (f"l{i}", cache[i * per : (i + 1) * per].view(NB, 2, BS, heads * head)) for i in range(n)
    ]


def flash_layers(n: int) -> list[tuple[str, torch.Tensor]]:
    """GPU flash-attention style: per layer [2, blocks, block_size, heads, head]."""
    return [(f"l{i}", torch.empty(2, NB, BS, 2, 32, dtype=torch.bfloat16)) for i in range(n)]


def mla_layers(n: int) -> list[tuple[str, torch.Tensor]]:
    """MLA: per layer [blocks, block_size, latent]."""
    return [(f"l{i}", torch.empty(NB, BS, 96, dtype=torch.float16)) for i in range(n)]


LAYOUTS: dict[str, Callable[[int], list[tuple[str, torch.Tensor]]]] = {
    "cpu": cpu_layers,
    "flash": flash_layers,
    "mla": mla_layers,
}


def randomize(layers: list[tuple[str, torch.Tensor]], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _, t in layers:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def blocks_of(layers: list[tuple[str, torch.Tensor]], ids: list[int]) -> list[torch.Tensor]:
    out = []
    for _, t in layers:
        dim = 1 if t.shape[0] == 2 and t.shape[1] == NB else 0
        out.append(t.index_select(dim, torch.tensor(ids)).clone())
    return out


@pytest.fixture
def store() -> Iterator[KVStore]:
    s = MemoryStore(capacity=1 << 30)
    yield s
    s.close()


def engine(store: KVStore, layers: list[tuple[str, torch.Tensor]], **kw: object) -> TransferEngine:
    return TransferEngine(store, [layers], NB, staging_bytes=64 << 20, **kw)  # type: ignore[arg-type]


def test_block_runs_of_known_layouts() -> None:
    assert block_runs((NB, 2, BS, 64), (2 * BS * 64, BS * 64, 64, 1), 4, 0) == (
        (0, 2 * BS * 64 * 4),
    )
    k, v = block_runs((2, NB, BS, 2, 32), (NB * BS * 64, BS * 64, 64, 32, 1), 2, 1)
    assert k == (0, BS * 64 * 2) and v == (NB * BS * 64 * 2, BS * 64 * 2)


def test_one_allocation_is_one_region() -> None:
    spec = describe_group(cpu_layers(4), NB)
    assert len(spec.regions) == 1
    assert spec.block_nbytes == 4 * 2 * BS * 64 * 4


def _byte_runs(addrs: list[int], sizes: list[int]) -> list[tuple[int, int]]:
    """(start, end) byte ranges in order, touching ones merged: what a scatter list means."""
    out: list[tuple[int, int]] = []
    for a, n in zip(addrs, sizes, strict=True):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], a + n)
        else:
            out.append((a, a + n))
    return out


def shared_layers(n: int) -> list[tuple[str, torch.Tensor]]:
    """Layers back to back in one allocation, each [blocks, block_size, 64] (the
    block stride equals the layer size only for NB = 1: no merging across layers)."""
    cache = torch.empty(n * NB * BS * 64, dtype=torch.float16)
    per = NB * BS * 64
    return [(f"l{i}", cache[i * per : (i + 1) * per].view(NB, BS, 64)) for i in range(n)]


def interleaved_layers(n: int) -> list[tuple[str, torch.Tensor]]:
    """One tensor [blocks, layers, block_size, 64]: a block over all layers is contiguous."""
    cache = torch.empty(NB, n, BS, 64, dtype=torch.float16)
    return [(f"l{i}", cache[:, i]) for i in range(n)]


# Segments of one block over 3 layers: one per layer where K and V of a block sit
# together (cpu, mla, shared), K and V apart (flash), or all layers merged (interleaved).
SEGMENTS = {"cpu": 3, "flash": 6, "mla": 3, "shared": 3, "interleaved": 1}


@pytest.mark.parametrize("kind", [*LAYOUTS, "shared", "interleaved"])
def test_one_block_columns_cover_exactly_the_rows_of_the_block(kind: str) -> None:
    """The per-block plan (no numpy work per object) against the rows it stands for."""
    extra = {"shared": shared_layers, "interleaved": interleaved_layers}
    layers = (extra.get(kind) or LAYOUTS[kind])(3)
    spec = describe_group(layers, NB)
    ids = np.array([[0], [NB - 1], [7], [7], [30]], dtype=np.int64)
    addrs, sizes = spec.columns(ids)
    for obj, (a, n) in enumerate(zip(addrs, sizes, strict=True)):
        expected = []
        for region, rows in spec.rows(ids[obj : obj + 1]):
            reg = spec.regions[region]
            expected += [(reg.base + int(r) * reg.row_bytes, reg.row_bytes) for r in rows]
        assert _byte_runs(a, n) == _byte_runs(*map(list, zip(*expected, strict=True)))
        assert sum(n) == spec.block_nbytes and all(type(x) is int for x in a + n)
        assert len(a) == SEGMENTS[kind], (kind, len(a))  # merged where contiguous, or not
    assert spec.segments(ids[:2]) == [
        list(zip(a, n, strict=True)) for a, n in zip(addrs[:2], sizes[:2], strict=True)
    ]


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("load_mode", ["direct", "staged"])
@pytest.mark.parametrize("blocks", [1, 2])
def test_round_trip_is_bit_exact(store: KVStore, kind: str, load_mode: str, blocks: int) -> None:
    src = LAYOUTS[kind](3)
    randomize(src, 1)
    ids = [tuple(range(2 * i + 5, 2 * i + 5 + blocks)) for i in range(8)]
    chunks = [ChunkRef(f"k{i}", 0, i, b) for i, b in enumerate(ids)]
    with_engine = engine(store, src)
    assert with_engine.submit_save("s", chunks)
    (res,) = with_engine.wait(["s"], timeout=30)
    with_engine.close()
    assert res.ok and set(res.statuses.values()) == {Status.OK}

    dst = LAYOUTS[kind](3)
    randomize(dst, 2)
    reader = engine(store, dst, load_mode=load_mode)
    # Load into other blocks than those saved from.
    targets = [
        ChunkRef(c.key, 0, c.chunk, tuple(range(40 + 2 * c.chunk, 40 + 2 * c.chunk + blocks)))
        for c in chunks
    ]
    reader.submit_load("l", targets)
    (res,) = reader.wait(["l"], timeout=30)
    reader.close()
    assert res.ok and not res.invalid_block_ids
    for c, t in zip(chunks, targets, strict=True):
        for a, b in zip(
            blocks_of(src, list(c.block_ids)), blocks_of(dst, list(t.block_ids)), strict=True
        ):
            assert torch.equal(a, b)


def test_striped_ranks_write_shares_and_a_fresh_rank_reads_all(store: KVStore) -> None:
    """Four TP ranks of an MLA model hold the same bytes; each writes its quarter."""
    layout = Layout.create(tp=4, groups=["mla"])
    space = key_space(layout, dtype="f16", chunk_size=2 * BS, head_size=96)
    hashes = chunk_hashes(12)
    (content,) = layout.holdings(0, 0)
    keys = [space.key(content, h) for h in hashes]
    src = mla_layers(2)
    randomize(src, 3)
    written = []
    for rank in layout.ranks:
        mine = layout.chunks_written(rank, content, range(12))
        e = engine(store, src)
        e.submit_save(rank, [ChunkRef(keys[k], 0, k, (2 * k, 2 * k + 1)) for k in mine])
        (res,) = e.wait([rank], timeout=30)
        e.close()
        assert res.ok
        written += mine
    assert sorted(written) == list(range(12))
    dst = mla_layers(2)
    reader = engine(store, dst)
    reader.submit_load("all", [ChunkRef(keys[k], 0, k, (2 * k, 2 * k + 1)) for k in range(12)])
    (res,) = reader.wait(["all"], timeout=30)
    reader.close()
    assert res.ok
    for (_, a), (_, b) in zip(src, dst, strict=True):
        assert torch.equal(a[:24], b[:24])


def test_blocks_reused_after_submit_do_not_change_what_is_stored(store: KVStore) -> None:
    src = cpu_layers(2)
    randomize(src, 4)
    before = blocks_of(src, [3, 4])
    e = engine(store, src)
    e.submit_save("s", [ChunkRef("reused", 0, 0, (3, 4))])
    # The engine frees the blocks and another request overwrites them at once.
    for _, t in src:
        t[3:5].fill_(7.0)
    (res,) = e.wait(["s"], timeout=30)
    assert res.ok
    dst = cpu_layers(2)
    e2 = engine(store, dst)
    e2.submit_load("l", [ChunkRef("reused", 0, 0, (9, 10))])
    (res,) = e2.wait(["l"], timeout=30)
    e.close()
    e2.close()
    assert res.ok
    for a, b in zip(before, blocks_of(dst, [9, 10]), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_chunk_another_engine_stored_keeps_its_bytes_and_counts_as_existing(
    store: KVStore, zero_copy: bool
) -> None:
    """No exists check before a put: the duplicate put itself keeps the old value."""
    first, second = cpu_layers(2), cpu_layers(2)
    randomize(first, 5)
    randomize(second, 6)
    a = engine(store, first)
    a.submit_save("a", [ChunkRef("shared", 0, 0, (1,))])
    assert a.wait(["a"], timeout=30)[0].ok
    b = engine(store, second, zero_copy=zero_copy)  # a fresh engine: the key is not known
    b.submit_save("b", [ChunkRef("shared", 0, 0, (2,)), ChunkRef("new", 0, 1, (3,))])
    (res,) = b.wait(["b"], timeout=30)
    assert res.statuses == {"shared": Status.EXISTS, "new": Status.OK} and res.skipped == 1
    stats = b.stats()
    assert (stats.chunks_put, stats.chunks_skipped_exist) == (1, 1)
    assert stats.bytes_put == b.groups[0].object_nbytes(1)
    out = cpu_layers(2)
    reader = engine(store, out)
    reader.submit_load("l", [ChunkRef("shared", 0, 0, (4,))])
    assert reader.wait(["l"], timeout=30)[0].ok
    for x, y in zip(blocks_of(first, [1]), blocks_of(out, [4]), strict=True):
        assert torch.equal(x, y)  # the first engine's bytes, not the second's
    for e in (a, b, reader):
        e.close()


def test_missing_chunk_invalidates_it_and_every_later_chunk(store: KVStore) -> None:
    src = cpu_layers(1)
    randomize(src, 5)
    e = engine(store, src)
    chunks = [ChunkRef(f"c{i}", 0, i, (2 * i, 2 * i + 1)) for i in range(6)]
    e.submit_save("s", chunks)
    assert e.wait(["s"], timeout=30)[0].ok
    assert store.batch_remove(["c2"], force=True) == [Status.OK]
    e.forget(["c2"])
    e.submit_load("l", chunks)
    (res,) = e.wait(["l"], timeout=30)
    e.close()
    assert res.statuses["c2"] is Status.MISSING
    assert res.invalid_block_ids == frozenset(range(4, 12))


def test_corrupt_object_is_invalid_and_staged_load_leaves_kv_untouched() -> None:
    from kvpool.store.framed import FramedStore

    inner = MemoryStore(capacity=1 << 28)
    framed = FramedStore(inner, "00" * 8)
    src = cpu_layers(1)
    randomize(src, 6)
    e = engine(framed, src)
    e.submit_save("s", [ChunkRef("x", 0, 0, (1, 2))])
    assert e.wait(["s"], timeout=30)[0].ok
    e.close()
    other = FramedStore(MemoryStore(capacity=1 << 28), "11" * 8)  # another fingerprint
    # Copy the raw object (header + payload) under the same key into the other store.
    n = 64 + 2 * 2 * BS * 64 * 4
    raw = np.empty(n, dtype=np.uint8)
    assert inner.batch_get(["x"], [[(raw.ctypes.data, n)]]) == [Status.OK]
    assert other.inner.batch_put(["x"], [[(raw.ctypes.data, n)]]) == [Status.OK]
    dst = cpu_layers(1)
    dst[0][1].fill_(3.0)
    r = engine(other, dst, load_mode="staged")
    r.submit_load("l", [ChunkRef("x", 0, 0, (1, 2))])
    (res,) = r.wait(["l"], timeout=30)
    r.close()
    framed.close()
    other.close()
    assert res.statuses["x"] is Status.CORRUPT
    assert res.invalid_block_ids == {1, 2}
    assert bool((dst[0][1] == 3.0).all())  # nothing written into the KV cache


def test_no_space_switches_to_backpressure_then_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(saves, "FULL_RETRY_S", 0.1)  # a pool that never evicts: give up soon
    block = 2 * BS * 64 * 4
    store = MemoryStore(capacity=block + block // 2)  # a one-block object fits, two do not
    src = cpu_layers(1)
    randomize(src, 7)
    e = TransferEngine(store, [src], NB, staging_bytes=16 << 20, backoff_s=(0.2, 0.4))
    e.submit_save("big", [ChunkRef("big", 0, 0, (0, 1))])
    (res,) = e.wait(["big"], timeout=30)
    assert res.statuses == {"big": Status.NO_SPACE}
    assert e.stats().puts_no_space == 1 and e.stats().failures["no_space"] == 1
    assert e.in_backpressure
    assert e.submit_save("during", [ChunkRef("small", 0, 0, (2,))]) is False
    stats = e.stats()
    assert stats.saves_refused["backpressure"] == 1 and stats.backpressure_events == 1
    time.sleep(0.25)  # the back-off is a timer: let it run out
    assert e.submit_save("after", [ChunkRef("small", 0, 0, (2,))])
    assert e.wait(["after"], timeout=30)[0].statuses == {"small": Status.OK}
    e.close()
    store.close()


class _FullThenEvicting(MemoryStore):
    """A full pool that evicts on its own clock: each key's first ``refusals`` puts
    are NO_SPACE, later ones land. Records the key order of every call."""

    def __init__(self, refusals: int) -> None:
        super().__init__(capacity=1 << 30)
        self.refusals = refusals
        self.tries: dict[str, int] = {}
        self.calls: list[tuple[str, list[str]]] = []

    def _put(self, keys: Any, segments: Any) -> list[Status]:
        self.calls.append(("put", list(keys)))
        out = super()._put(keys, segments)
        for i, k in enumerate(keys):
            self.tries[k] = self.tries.get(k, 0) + 1
            if self.tries[k] <= self.refusals:
                self._remove([k], force=True)
                out[i] = Status.NO_SPACE
        return out

    def _get(self, keys: Any, segments: Any) -> list[Status]:
        self.calls.append(("get", list(keys)))
        return super()._get(keys, segments)


def test_a_put_that_meets_a_full_pool_goes_again_until_the_pool_has_evicted() -> None:
    """Mooncake answers NO_SPACE and evicts on its own clock: the save thread puts
    those objects again (holding their staging) and none is dropped."""
    store = _FullThenEvicting(refusals=2)
    src = cpu_layers(1)
    randomize(src, 3)
    e = engine(store, src)
    chunks = [ChunkRef(f"k{i}", 0, i, (2 * i, 2 * i + 1)) for i in range(6)]
    assert e.submit_save("s", chunks)
    (res,) = e.wait(["s"], timeout=30)
    assert res.ok and all(st is Status.OK for st in res.statuses.values()), res.statuses
    stats = e.stats()
    assert stats.puts_no_space == 6 and not stats.failures and stats.full_wait_s > 0
    assert not e.in_backpressure
    assert [len(keys) for op, keys in store.calls if op == "put"] == [6, 6, 6]
    e.close()
    store.close()


def test_store_calls_list_a_prompts_last_chunk_first() -> None:
    """Mooncake evicts the objects of one call in the order listed (measured): saves
    and loads list the last chunk first, a chunk's shards together, so a partly
    evicted prompt loses its end and keeps a usable start."""
    store = _FullThenEvicting(refusals=0)
    src = [cpu_layers(1), cpu_layers(1)]  # two shard views: a chunk is two objects
    for i, layers in enumerate(src):
        randomize(layers, i)
    e = TransferEngine(store, src, NB, staging_bytes=64 << 20)
    chunks = [ChunkRef(f"g{g}c{c}", g, c, (c,)) for g in (0, 1) for c in range(4)]
    e.submit_save("s", chunks)
    assert e.wait(["s"], timeout=30)[0].ok
    e.submit_load("l", chunks)
    assert e.wait(["l"], timeout=30)[0].ok
    want = ["g0c3", "g1c3", "g0c2", "g1c2", "g0c1", "g1c1", "g0c0", "g1c0"]
    assert store.calls == [("put", want), ("get", want)]
    e.close()
    store.close()


def test_staging_arena_wraps_and_refuses_when_full() -> None:
    a = StagingArena(1024, align=64)
    x = a.alloc(512)
    y = a.alloc(256)
    assert (x, y) == (0, 512)
    assert a.alloc(512) is None
    a.free(0)
    assert a.alloc(448) == 0  # wraps to the front
    assert a.alloc(2048) is None
    a.free(512)
    assert a.used == 448


def test_staged_load_writes_nothing_at_or_after_a_failed_chunk(store: KVStore) -> None:
    src = cpu_layers(2)
    randomize(src, 8)
    chunks = [ChunkRef(f"s{i}", 0, i, (2 * i, 2 * i + 1)) for i in range(6)]
    e = engine(store, src)
    e.submit_save("s", chunks)
    assert e.wait(["s"], timeout=30)[0].ok
    e.close()
    assert store.batch_remove(["s2"], force=True) == [Status.OK]
    dst = cpu_layers(2)
    for _, t in dst:
        t.fill_(-1.0)
    r = engine(store, dst, load_mode="staged")
    r.submit_load("l", chunks)
    (res,) = r.wait(["l"], timeout=30)
    r.close()
    assert res.invalid_block_ids == frozenset(range(4, 12))
    for (_, a), (_, b) in zip(src, dst, strict=True):
        assert torch.equal(a[:4], b[:4])  # chunks 0 and 1 arrived
        assert bool((b[4:12] == -1.0).all())  # the failed chunk and later ones untouched


def test_two_groups_round_trip_through_staged_loads(store: KVStore) -> None:
    src_a, src_b = cpu_layers(2), mla_layers(1)
    randomize(src_a, 9)
    randomize(src_b, 10)
    chunks = [
        ChunkRef(f"g{g}c{i}", g, i, (2 * i + g, 2 * i + g + 1)) for i in range(5) for g in (0, 1)
    ]
    e = TransferEngine(store, [src_a, src_b], NB, staging_bytes=16 << 20)
    e.submit_save("s", chunks)
    assert e.wait(["s"], timeout=30)[0].ok
    e.close()
    dst_a, dst_b = cpu_layers(2), mla_layers(1)
    r = TransferEngine(store, [dst_a, dst_b], NB, staging_bytes=16 << 20, load_mode="staged")
    r.submit_load("l", chunks)
    (res,) = r.wait(["l"], timeout=30)
    r.close()
    assert res.ok
    for src, dst, blocks in ((src_a, dst_a, slice(0, 10)), (src_b, dst_b, slice(1, 11))):
        for (_, a), (_, b) in zip(src, dst, strict=True):
            assert torch.equal(a[blocks], b[blocks])


class _FrozenStore(MemoryStore):
    """Gets block until ``thaw`` is set: a holder that stopped answering."""

    def __init__(self) -> None:
        super().__init__(capacity=1 << 30)
        self.entered = threading.Event()
        self.thaw = threading.Event()

    def _get(self, keys, segments):  # type: ignore[no-untyped-def]
        self.entered.set()
        assert self.thaw.wait(30)
        return super()._get(keys, segments)


def _poll_until(eng: TransferEngine, timeout: float = 10.0) -> list[Any]:
    """Poll like an engine step loop until a result arrives (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := eng.poll():
            return got
        time.sleep(0.01)
    return []


def test_late_staged_load_is_reported_timed_out_and_never_written_into_kv() -> None:
    store = _FrozenStore()
    src = cpu_layers(2)
    randomize(src, 1)
    chunks = [ChunkRef(f"k{i}", 0, i, (i,)) for i in range(3)]
    writer = engine(store, src)
    writer.submit_save("s", chunks)
    assert writer.wait(["s"], timeout=30)[0].ok
    writer.close()

    dst = cpu_layers(2)
    randomize(dst, 2)
    before = [t.clone() for _, t in dst]
    reader = engine(store, dst, load_mode="staged", load_timeout_s=0.2)
    reader.submit_load("l", [ChunkRef(c.key, 0, c.chunk, (10 + c.chunk,)) for c in chunks])
    assert store.entered.wait(10)
    (res,) = _poll_until(reader)
    assert res.job_id == "l" and set(res.statuses.values()) == {Status.TIMED_OUT}
    assert res.invalid_block_ids == {10, 11, 12}
    assert reader.stats().loads_timed_out == 1
    # A second load queued behind the frozen one also times out, exactly once.
    reader.submit_load("l2", [ChunkRef("k0", 0, 0, (20,))])
    (res2,) = _poll_until(reader)
    assert res2.job_id == "l2" and not res2.ok
    store.thaw.set()  # the holder answers at last: nothing may reach the KV cache
    reader.submit_load("l3", [ChunkRef("k1", 0, 1, (30,))])
    (res3,) = _poll_until(reader)
    assert res3.job_id == "l3" and res3.ok
    reader.close()
    assert reader.poll() == []  # the abandoned jobs published nothing more
    for (_, t), old in zip(dst, before, strict=True):
        changed = (t != old).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [30]


def test_wait_any_wakes_on_a_finished_job_and_times_out_without_one(store: KVStore) -> None:
    layers = cpu_layers(1)
    eng = engine(store, layers)
    assert eng.wait_any(0.05) is False  # nothing in flight: the timeout
    eng.submit_save("s", [ChunkRef("k", 0, 0, (1,))])
    assert eng.wait_any(10.0) is True
    assert [r.job_id for r in eng.poll()] == ["s"]
    eng.close()


def _object_bytes(layers: list[tuple[str, torch.Tensor]], blocks: int) -> int:
    return describe_group(layers, NB).object_nbytes(blocks)


class _Counting(MemoryStore):
    """Records each batch call to the backend as (kind, keys)."""

    def __init__(self) -> None:
        super().__init__(capacity=1 << 28)
        self.calls: list[tuple[str, int]] = []

    def _put(self, keys, segments):  # type: ignore[no-untyped-def]
        self.calls.append(("put", len(keys)))
        return super()._put(keys, segments)

    def _get(self, keys, segments):  # type: ignore[no-untyped-def]
        self.calls.append(("get", len(keys)))
        return super()._get(keys, segments)


def test_saves_and_staged_loads_move_in_pieces_bit_exact(store: KVStore) -> None:
    """Jobs larger than ``piece_bytes`` go in several puts and gets; two groups mixed."""
    src_a, src_b = cpu_layers(2), mla_layers(1)
    randomize(src_a, 11)
    randomize(src_b, 12)
    chunks = [
        ChunkRef(f"p{g}c{i}", g, i, (2 * i + g, 2 * i + g + 1)) for i in range(7) for g in (0, 1)
    ]
    piece = 2 * _object_bytes(src_a, 2)  # about two chunks per piece
    counting = _Counting()
    calls = counting.calls
    e = TransferEngine(counting, [src_a, src_b], NB, staging_bytes=16 << 20, piece_bytes=piece)
    assert e.submit_save("s", chunks)
    assert e.wait(["s"], timeout=30)[0].ok
    e.close()
    puts = [n for op, n in calls if op == "put"]
    assert len(puts) > 3 and sum(puts) == len(chunks)
    dst_a, dst_b = cpu_layers(2), mla_layers(1)
    r = TransferEngine(
        counting,
        [dst_a, dst_b],
        NB,
        staging_bytes=16 << 20,
        load_mode="staged",
        load_piece_bytes=piece,
    )
    r.submit_load("l", chunks)
    (res,) = r.wait(["l"], timeout=30)
    r.close()
    assert res.ok
    gets = [n for op, n in calls if op == "get"]
    assert len(gets) > 3 and sum(gets) == len(chunks)
    for src, dst, blocks in ((src_a, dst_a, slice(0, 14)), (src_b, dst_b, slice(1, 15))):
        for (_, a), (_, b) in zip(src, dst, strict=True):
            assert torch.equal(a[blocks], b[blocks])


def _load_with_one_chunk_removed(
    store: KVStore,
    chunks: list[ChunkRef],
    missing: str,
    make: Callable[..., TransferEngine],
    seed: int,
) -> tuple[Any, list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]], TransferEngine]:
    """Save ``chunks`` from random KV, remove ``missing`` from the pool, and load them
    all staged into KV filled with -1: (result, source layers, loaded layers, reader)."""
    src = cpu_layers(2)
    randomize(src, seed)
    w = make(src)
    assert w.submit_save("s", chunks) and w.wait(["s"], timeout=30)[0].ok
    w.close()
    assert store.batch_remove([missing], force=True) == [Status.OK]
    dst = cpu_layers(2)
    for _, t in dst:
        t.fill_(-1.0)
    r = make(dst, load_mode="staged")
    r.submit_load("l", chunks)
    (res,) = r.wait(["l"], timeout=30)
    r.close()
    assert res.statuses[missing] is Status.MISSING
    return res, src, dst, r


def test_a_failed_chunk_in_a_middle_piece_stops_the_copy_there(store: KVStore) -> None:
    chunks = [ChunkRef(f"m{i}", 0, i, (2 * i, 2 * i + 1)) for i in range(8)]
    piece = 2 * _object_bytes(cpu_layers(2), 2)  # pieces of chunks 0-1, 2-3, 4-5, 6-7

    def make(layers: list[tuple[str, torch.Tensor]], **kw: Any) -> TransferEngine:
        return engine(store, layers, piece_bytes=piece, load_piece_bytes=piece, **kw)

    res, src, dst, r = _load_with_one_chunk_removed(store, chunks, "m3", make, 13)
    assert res.invalid_block_ids == frozenset(range(6, 16))
    for (_, a), (_, b) in zip(src, dst, strict=True):
        assert torch.equal(a[:6], b[:6])  # chunks 0-2 arrived, across two pieces
        assert bool((b[6:16] == -1.0).all())  # chunk 3 and the later pieces: untouched
    assert r._load_arena.used == 0  # every piece's staging was given back


def test_a_failed_staging_copy_refuses_the_save_and_frees_staging(store: KVStore) -> None:
    src = cpu_layers(1)
    e = engine(store, src, piece_bytes=_object_bytes(src, 1))
    gathered: list[int] = []
    real_gather = e._copier.gather

    def failing(chunks, offsets):  # type: ignore[no-untyped-def]
        if gathered:
            raise RuntimeError("injected")
        gathered.append(len(chunks))
        real_gather(chunks, offsets)

    e._copier.gather = failing  # type: ignore[method-assign]
    chunks = [ChunkRef(f"f{i}", 0, i, (i,)) for i in range(3)]
    assert not e.submit_save("s", chunks)
    (res,) = e.wait(["s"], timeout=30)
    assert res.skipped == 2 and list(res.statuses) == ["f0"]  # the first piece was put
    assert e.stats().saves_refused["staging_error"] == 1
    assert res.refused == "staging_error" and res.refused_from == 1 and not res.retry
    assert e._save_arena.used == 0
    e.close()
    assert store.batch_exists(["f0", "f1", "f2"]) == [Status.OK, Status.MISSING, Status.MISSING]


class _StagingOnly(MemoryStore):
    """A store that, like Mooncake's shared-memory client, reaches only its own memory."""

    @property
    def requires_staging(self) -> bool:
        return True


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_zero_copy_round_trip_from_kv_placed_in_store_memory(kind: str) -> None:
    from kvpool.placement import place_kv

    store = _StagingOnly(capacity=1 << 28)
    src, dst = LAYOUTS[kind](3), LAYOUTS[kind](3)
    randomize(src, 21)
    randomize(dst, 22)
    with pytest.raises(ValueError, match="outside the store's memory"):
        engine(store, src, zero_copy=True)
    place_kv([src], store.alloc_staging)
    place_kv([dst], store.alloc_staging)
    saved_from = blocks_of(src, [1, 2, 3, 4])
    chunks = [ChunkRef(f"z{i}", 0, i, (2 * i + 1, 2 * i + 2)) for i in range(2)]
    w = engine(store, src, zero_copy=True)
    assert w.zero_copy and w.load_mode == "direct"
    assert w.submit_save("s", chunks)
    (res,) = w.wait(["s"], timeout=30)
    w.close()
    assert res.ok and res.nbytes == 2 * _object_bytes(src, 2)
    r = engine(store, dst, zero_copy=True)
    r.submit_load("l", [ChunkRef(c.key, 0, c.chunk, (30 + c.chunk, 40 + c.chunk)) for c in chunks])
    (res,) = r.wait(["l"], timeout=30)
    r.close()
    assert res.ok
    got = blocks_of(dst, [30, 40, 31, 41])
    for a, b in zip(saved_from, got, strict=True):
        assert torch.equal(a, b)
    store.close()


# -- jobs larger than the staging area ------------------------------------------------

SMALL_STAGING = 256 << 10  # 128 KiB for saves and 128 KiB for staged loads: 4 objects each


@pytest.mark.parametrize("load_mode", ["staged", "direct"])
def test_jobs_many_times_the_staging_area_move_piece_by_piece_bit_exact(load_mode: str) -> None:
    """48 one-block objects of 32 KiB (1.5 MiB) through 128 KiB of staging per direction."""
    store = _Counting()
    calls = store.calls
    src = cpu_layers(2)
    randomize(src, 31)
    assert _object_bytes(src, 1) == 32 << 10
    chunks = [ChunkRef(f"big{i}", 0, i, (i,)) for i in range(48)]
    w = TransferEngine(store, [src], NB, staging_bytes=SMALL_STAGING, load_mode="staged")
    assert w.submit_save("s", chunks)  # waits for puts to free staging: never refused
    (res,) = w.wait(["s"], timeout=30)
    assert res.ok and len(res.statuses) == 48 and not res.refused
    assert w._save_arena.used == 0 and w.stats().chunks_refused == {}
    w.close()
    puts = [n for op, n in calls if op == "put"]
    assert len(puts) >= 48 * 32 // 128 and sum(puts) == 48
    dst = cpu_layers(2)
    randomize(dst, 32)
    r = TransferEngine(store, [dst], NB, staging_bytes=SMALL_STAGING, load_mode=load_mode)  # type: ignore[arg-type]
    targets = [ChunkRef(c.key, 0, c.chunk, (63 - c.chunk,)) for c in chunks]
    r.submit_load("l", targets)
    (res,) = r.wait(["l"], timeout=30)
    assert res.ok and len(res.statuses) == 48
    assert r._load_arena.used == 0
    assert r.stats().load_s > 0 and r.stats().bytes_loaded == 48 * (32 << 10)
    r.close()
    for c, t in zip(chunks, targets, strict=True):
        for a, b in zip(
            blocks_of(src, list(c.block_ids)), blocks_of(dst, list(t.block_ids)), strict=True
        ):
            assert torch.equal(a, b)
    if load_mode == "staged":
        gets = [n for op, n in calls if op == "get"]
        assert len(gets) >= 48 * 32 // 128 and sum(gets) == 48


def test_a_chunk_missing_deep_in_a_job_larger_than_staging_stops_the_copy_there(
    store: KVStore,
) -> None:
    chunks = [ChunkRef(f"d{i}", 0, i, (i,)) for i in range(40)]

    def make(layers: list[tuple[str, torch.Tensor]], **kw: Any) -> TransferEngine:
        return TransferEngine(store, [layers], NB, staging_bytes=SMALL_STAGING, **kw)

    res, src, dst, r = _load_with_one_chunk_removed(store, chunks, "d29", make, 33)
    assert res.invalid_block_ids == frozenset(range(29, 40))
    for (_, a), (_, b) in zip(src, dst, strict=True):
        assert torch.equal(a[:29], b[:29])  # 29 chunks arrived, over several pieces
        assert bool((b[29:40] == -1.0).all())  # the missing chunk and later: untouched
    assert r._load_arena.used == 0


class _StuckPuts(MemoryStore):
    """Puts wait until ``release`` is set: a pool that stopped taking puts."""

    def __init__(self) -> None:
        super().__init__(capacity=1 << 28)
        self.release = threading.Event()

    def _put(self, keys, segments):  # type: ignore[no-untyped-def]
        assert self.release.wait(30)
        return super()._put(keys, segments)


def test_a_save_that_sees_no_staging_freed_is_refused_as_retryable_and_never_stored() -> None:
    store = _StuckPuts()
    src = cpu_layers(2)
    randomize(src, 34)
    e = TransferEngine(store, [src], NB, staging_bytes=SMALL_STAGING, save_wait_s=0.2)
    first = [ChunkRef(f"a{i}", 0, i, (i,)) for i in range(10)]
    second = [ChunkRef(f"b{i}", 0, i, (20 + i,)) for i in range(3)]
    # 256 KiB of staging for saves (loads are direct here), pieces of three 32 KiB
    # objects: two pieces fit, the third waits for a put that never frees any.
    assert e.submit_save("a", first) is False
    waited = e.stats().save_wait_s
    assert waited > 0
    # A later save that finds no space is refused at once, without a second wait.
    assert e.submit_save("b", second) is False
    assert e.stats().save_wait_s == waited
    store.release.set()
    ra, rb = sorted(e.wait(["a", "b"], timeout=30), key=lambda r: str(r.job_id))
    assert ra.refused == "staging_busy" and ra.retry and ra.refused_from == 6
    assert sorted(ra.statuses) == [f"a{i}" for i in range(6)] and ra.skipped == 4
    assert all(s is Status.OK for s in ra.statuses.values()) and not ra.ok  # not all saved
    assert rb.refused == "staging_busy" and rb.refused_from == 0 and rb.statuses == {}
    stats = e.stats()
    assert stats.chunks_refused == {"staging_busy": 7} and stats.saves_refused["staging_busy"] == 2
    assert not e.in_backpressure  # local pressure is not a store failure
    # Once puts free staging again, the refused chunks save (what a retry does).
    assert e.submit_save("again", [*first[6:], *second])
    (again,) = e.wait(["again"], timeout=30)
    assert again.ok and len(again.statuses) == 7 and not again.refused
    e.close()
    keys = [c.key for c in first + second]
    assert store.batch_exists(keys) == [Status.OK] * 13


def test_a_key_another_save_is_putting_is_skipped_and_reported_only_by_that_save() -> None:
    """A local prefix hit saves its whole prompt; while the first save of that prefix
    is still putting, the second one puts only what is new. The keys it skipped are
    not reported stored by it (KV events count each object once)."""
    store = _StuckPuts()
    src = cpu_layers(2)
    randomize(src, 35)
    e = TransferEngine(store, [src], NB, staging_bytes=64 << 20)
    prefix = [ChunkRef(f"p{i}", 0, i, (i,)) for i in range(4)]
    assert e.submit_save("first", prefix)
    assert e.submit_save("again", [*prefix, ChunkRef("new", 0, 4, (4,))])
    store.release.set()
    results = {r.job_id: r for r in e.wait(["first", "again"], timeout=30)}
    first, again = results["first"], results["again"]
    assert first.statuses == {f"p{i}": Status.OK for i in range(4)}
    assert again.statuses == {"new": Status.OK} and again.skipped == 4 and again.known == ()
    assert again.ok  # nothing refused: the skipped keys are the first save's to report
    stats = e.stats()
    assert (stats.chunks_put, stats.chunks_skipped_putting, stats.chunks_skipped_known) == (5, 4, 0)
    # Once put, the keys are known: a third save skips them as stored recently.
    assert e.submit_save("third", prefix[:2])
    (third,) = e.wait(["third"], timeout=30)
    assert third.known == ("p0", "p1") and third.statuses == {}
    e.close()


class _SlowPrefault(_StagingOnly):
    """A shared-memory store whose ``prefault`` runs until ``done`` is set: a
    loaded host where touching staging takes long."""

    def __init__(self) -> None:
        super().__init__(capacity=1 << 28)
        self.done = threading.Event()

    def prefault(self, addr: int, nbytes: int) -> bool:
        return self.done.wait(30)


def test_a_slow_prefault_holds_nothing_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefault only reads (``KVStore.prefault``), so one longer than construction
    waits for goes on on its own thread while saves and loads go on through
    staging; ``prefaulted`` is set when it ended. (It used to hold all of staging:
    saves were refused until it ended.)"""
    from kvpool.transfer import engine as engine_module

    monkeypatch.setattr(engine_module, "PREFAULT_WAIT_S", 0.05)
    store = _SlowPrefault()
    src = cpu_layers(2)
    randomize(src, 35)
    e = TransferEngine(
        store, [src], NB, staging_bytes=SMALL_STAGING, save_wait_s=0.1, prefault=True
    )
    chunks = [ChunkRef(f"p{i}", 0, i, (i,)) for i in range(3)]
    assert e.submit_save("during", chunks) and not e.saves_blocked
    assert e.wait(["during"], timeout=30)[0].ok
    before = [t.clone() for _, t in src]
    for _, t in src:
        t.zero_()
    e.submit_load("load", chunks)
    assert e.wait(["load"], timeout=30)[0].ok
    assert all(torch.equal(t[:3], b[:3]) for (_, t), b in zip(src, before, strict=True))
    assert not e.prefaulted.is_set()
    store.done.set()
    assert e.prefaulted.wait(10)
    e.close()


def test_a_zero_copy_engine_prefaults_each_kv_allocation_once_and_a_staged_one_its_staging() -> (
    None
):
    """What ``prefault`` touches: a staged engine its staging; a zero-copy engine
    (no staging) each distinct KV allocation once, whole, however many layers
    share it; an engine built without ``prefault`` nothing."""
    from kvpool.placement import place_kv

    class Recording(_StagingOnly):
        def __init__(self) -> None:
            super().__init__(capacity=1 << 28)
            self.calls: list[tuple[int, int]] = []

        def prefault(self, addr: int, nbytes: int) -> bool:
            self.calls.append((addr, nbytes))
            return True

    store = Recording()
    staged = engine(store, cpu_layers(2), prefault=True)
    assert staged.prefaulted.wait(10)
    assert store.calls == [(store._staging[-1].ctypes.data, 64 << 20)]
    staged.close()
    store.calls.clear()
    src = flash_layers(3)  # a tensor per layer: three allocations
    place_kv([src], store.alloc_staging)
    zero = engine(store, src, zero_copy=True, prefault=True)
    assert zero.prefaulted.wait(10)
    want = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for _, t in src}
    assert len(want) == 3 and sorted(store.calls) == sorted(want)
    zero.close()
    store.calls.clear()
    quiet = engine(store, src, zero_copy=True)
    assert quiet.prefaulted.is_set() and store.calls == []
    quiet.close()


def test_staging_smaller_than_one_chunk_object_is_a_config_error(store: KVStore) -> None:
    from kvpool.errors import ConfigError

    src = cpu_layers(2)  # 32 KiB per one-block object
    with pytest.raises(ConfigError, match="raise staging_bytes"):
        TransferEngine(store, [src], NB, staging_bytes=48 << 10, load_mode="staged")
    with pytest.raises(ConfigError, match="raise staging_bytes"):
        TransferEngine(store, [src], NB, staging_bytes=SMALL_STAGING, blocks_per_object=9)


def test_a_put_that_raises_fails_its_piece_and_still_frees_every_piece() -> None:
    class Raising(MemoryStore):
        calls = 0

        def batch_put(self, keys, segments, pin_ms=0):  # type: ignore[no-untyped-def]
            Raising.calls += 1
            if Raising.calls == 2:
                raise RuntimeError("injected")
            return super().batch_put(keys, segments, pin_ms)

    store = Raising(capacity=1 << 28)
    src = cpu_layers(2)
    # no back-off after the failed piece, so the save after it is not refused for it
    e = TransferEngine(store, [src], NB, staging_bytes=SMALL_STAGING, backoff_s=(0.0, 0.0))
    chunks = [ChunkRef(f"r{i}", 0, i, (i,)) for i in range(20)]
    assert e.submit_save("s", chunks)
    (res,) = e.wait(["s"], timeout=30)
    failed = [k for k, s in res.statuses.items() if s is Status.UNAVAILABLE]
    assert failed and len(failed) < 20 and not res.ok  # the second piece only
    assert all(s is Status.OK for k, s in res.statuses.items() if k not in failed)
    assert e._save_arena.used == 0
    assert e.submit_save("again", chunks) and e.wait(["again"], timeout=30)[0].ok
    e.close()


def test_pinned_saves_reach_a_store_without_pins_unpinned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store of another package whose batch_put takes no pin_ms stores pinned
    saves unpinned (one warning), never failing them; pins reach one that does."""

    class NoPins(MemoryStore):
        def batch_put(self, keys, segments):  # type: ignore[no-untyped-def,override]
            return super().batch_put(keys, segments)

    src = cpu_layers(2)
    for store, pinned in ((NoPins(capacity=1 << 28), False), (MemoryStore(1 << 28), True)):
        e = TransferEngine(store, [src], NB, staging_bytes=SMALL_STAGING)
        chunks = [ChunkRef(f"p{i}", 0, i, (i,), pin_ms=60_000) for i in range(4)]
        assert e.submit_save("s", chunks) and e.wait(["s"], timeout=30)[0].ok
        assert [store.pinned(c.key) for c in chunks] == [pinned] * 4
        e.close()
    assert caplog.text.count("NoPins.batch_put takes no pin_ms") == 1


def test_a_staging_step_that_raises_refuses_the_rest_and_never_hangs_the_put_thread(
    store: KVStore,
) -> None:
    src = cpu_layers(2)
    e = TransferEngine(store, [src], NB, staging_bytes=SMALL_STAGING)
    real = e._saves._stage
    calls = []

    def failing(job, lo, hi):  # type: ignore[no-untyped-def]
        calls.append(lo)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(job, lo, hi)

    e._saves._stage = failing  # type: ignore[method-assign]
    chunks = [ChunkRef(f"h{i}", 0, i, (i,)) for i in range(20)]
    assert e.submit_save("s", chunks) is False
    (res,) = e.wait(["s"], timeout=30)
    assert res.refused == "staging_error" and res.refused_from == calls[1]
    assert sorted(res.statuses) == sorted(c.key for c in chunks[: calls[1]])
    assert e._save_arena.used == 0
    e.close()  # returns: the put thread is not stuck waiting for a piece


def test_zero_copy_saves_are_refused_past_a_bounded_backlog() -> None:
    from kvpool.transfer.saves import ZERO_COPY_BACKLOG

    store = _StuckPuts()
    src = cpu_layers(1)
    e = TransferEngine(store, [src], NB, zero_copy=True)
    accepted = 0
    while e.submit_save(accepted, [ChunkRef(f"z{accepted}", 0, 0, (accepted % NB,))]):
        accepted += 1
        assert accepted <= ZERO_COPY_BACKLOG + 1  # one job in the stuck put, the rest queued
    assert accepted >= ZERO_COPY_BACKLOG
    store.release.set()
    (refused,) = e.wait([accepted], timeout=30)
    assert refused.refused == "queue_full" and refused.retry
    assert e.stats().chunks_refused == {"queue_full": 1}
    e.close()


def test_a_damaged_object_is_removed_once_leases_end_never_forced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader's own get leases the object: the removal waits for the lease
    (LEASED, retried), and never forces other readers' leases away."""
    from kvpool.store.framed import FramedStore
    from kvpool.transfer import shared

    monkeypatch.setattr(shared, "DISCARD_RETRY_S", (0.05, 3.2))
    inner = MemoryStore(capacity=1 << 28, lease_s=0.5)
    framed = FramedStore(inner, "00" * 8)
    src = cpu_layers(1)
    randomize(src, 6)
    w = engine(framed, src)
    assert w.submit_save("s", [ChunkRef("x", 0, 0, (1, 2))]) and w.wait(["s"], timeout=30)[0].ok
    w.close()
    inner.tamper("x", 64 + 100)  # one payload byte flipped: the checksum fails
    r = engine(framed, cpu_layers(1), load_mode="staged")
    r.submit_load("l", [ChunkRef("x", 0, 0, (1, 2))])
    (res,) = r.wait(["l"], timeout=30)
    assert res.statuses["x"] is Status.CORRUPT
    stored = inner.keys  # a listing takes no lease (exists and get do)
    assert "x" in stored()  # our own get's lease holds it
    assert wait_until(lambda: "x" not in stored(), timeout=10)
    r.close()
    framed.close()


def test_a_forged_object_never_reaches_the_kv_cache_and_is_removed() -> None:
    """A pool with a secret: an object put under a live key by a client without it
    (well-formed, checksum and all) loads as FORGED, writes nothing into the KV
    cache, and is removed so that an honest save can replace it."""
    from kvpool.store.framed import FramedStore

    inner = MemoryStore(capacity=1 << 28)
    secret = bytes(range(32))
    honest = FramedStore(inner, "00" * 8, secret=secret)
    forger = FramedStore(inner, "00" * 8)  # the same pool, no secret
    src = cpu_layers(1)
    randomize(src, 6)
    w = engine(forger, src)
    assert w.submit_save("s", [ChunkRef("x", 0, 0, (1, 2))]) and w.wait(["s"], timeout=30)[0].ok
    w.close()
    dst = cpu_layers(1)
    dst[0][1].fill_(3.0)
    r = engine(honest, dst, load_mode="staged")
    r.submit_load("l", [ChunkRef("x", 0, 0, (1, 2))])
    (res,) = r.wait(["l"], timeout=30)
    assert res.statuses["x"] is Status.FORGED
    assert res.invalid_block_ids == {1, 2}
    assert bool((dst[0][1] == 3.0).all())  # nothing written into the KV cache
    assert r.stats().failures == {"forged": 1}
    stored = inner.keys  # a listing takes no lease (exists and get do)
    assert wait_until(lambda: "x" not in stored(), timeout=10)
    r.close()
    honest.close()


@pytest.mark.parametrize("behind", [False, True])
def test_a_payload_damaged_in_a_middle_piece_stops_the_copy_there_and_is_removed(
    monkeypatch: pytest.MonkeyPatch, behind: bool
) -> None:
    """A staged load leaves the checksums to the scatter thread (``batch_get_deferred``)
    or, when that thread is behind, checks in the load thread: either way a damaged
    payload reads CORRUPT, nothing of it or after it reaches the KV cache, the chunks
    before it do, and the object is removed."""
    from kvpool.store.framed import FramedStore
    from kvpool.transfer import loads

    inner = MemoryStore(capacity=1 << 28)
    framed = FramedStore(inner, "00" * 8)
    chunks = [ChunkRef(f"d{i}", 0, i, (2 * i, 2 * i + 1)) for i in range(8)]
    piece = 2 * _object_bytes(cpu_layers(2), 2)  # pieces of chunks 0-1, 2-3, 4-5, 6-7
    src = cpu_layers(2)
    randomize(src, 17)
    w = engine(framed, src, piece_bytes=piece)
    assert w.submit_save("s", chunks) and w.wait(["s"], timeout=30)[0].ok
    w.close()
    inner.tamper("d3", 64 + 1000)  # a payload byte of chunk 3: only the checksum sees it
    verified = []
    real = loads.Loads._verify

    def spy(self: loads.Loads, p: Any) -> None:
        if p.check is not None:
            verified.append(threading.current_thread().name)
        real(self, p)

    monkeypatch.setattr(loads.Loads, "_verify", spy)
    dst = cpu_layers(2)
    for _, t in dst:
        t.fill_(-1.0)
    r = engine(framed, dst, load_piece_bytes=piece, load_mode="staged")
    # behind: every get finds a piece waiting for the scatter thread, so the load
    # thread checks; else never (the rule's two branches, made deterministic).
    monkeypatch.setattr(r._loads.scatter_q, "empty", lambda: not behind)
    r.submit_load("l", chunks)
    (res,) = r.wait(["l"], timeout=30)
    assert res.statuses["d3"] is Status.CORRUPT
    assert all(res.statuses[f"d{i}"] is Status.OK for i in (0, 1, 2, 4, 5, 6, 7))
    assert res.invalid_block_ids == frozenset(range(6, 16))
    for (_, a), (_, b) in zip(src, dst, strict=True):
        assert torch.equal(a[:6], b[:6])  # chunks 0-2 arrived, across two pieces
        assert bool((b[6:16] == -1.0).all())  # the damaged chunk and later: untouched
    assert framed.corrupt_counts == {CheckFailure.CHECKSUM: 1}
    assert len(verified) == 4  # one check per piece, in the thread the rule picks
    assert {name.split("-")[-1] for name in verified} == ({"load"} if behind else {"scatter"})
    stored = inner.keys  # a listing takes no lease
    assert wait_until(lambda: "d3" not in stored(), timeout=10)  # removed once unleased
    r.close()
    framed.close()


def test_a_late_piece_is_still_checked_and_its_damaged_object_removed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load given up (TIMED_OUT) whose get answers later writes nothing, but its
    deferred checksums still run: a damaged object is counted and removed, never
    remembered as loaded."""
    from kvpool.store.framed import FramedStore
    from kvpool.transfer import shared

    monkeypatch.setattr(shared, "DISCARD_RETRY_S", (0.05, 3.2))
    inner = _FrozenStore()
    inner.thaw.set()  # the save goes through
    framed = FramedStore(inner, "00" * 8)
    src = cpu_layers(2)
    randomize(src, 41)
    w = engine(framed, src)
    assert w.submit_save("s", [ChunkRef("z", 0, 0, (1,))]) and w.wait(["s"], timeout=30)[0].ok
    w.close()
    inner.tamper("z", 64 + 5)
    inner.thaw.clear()
    dst = cpu_layers(2)
    before = [t.clone() for _, t in dst]
    r = engine(framed, dst, load_mode="staged", load_timeout_s=0.2)
    r.submit_load("l", [ChunkRef("z", 0, 0, (7,))])
    (res,) = _poll_until(r)
    assert res.statuses == {"z": Status.TIMED_OUT}
    inner.thaw.set()  # the get answers now, long after the load was reported
    stored = inner.keys
    assert wait_until(lambda: "z" not in stored(), timeout=10)
    assert framed.corrupt_counts == {CheckFailure.CHECKSUM: 1}
    assert "z" not in r._core.known
    r.close()
    framed.close()
    for (_, t), old in zip(dst, before, strict=True):
        assert torch.equal(t, old)  # nothing reached the KV cache


def test_the_staging_gather_copies_the_rows_asked_and_refuses_rows_outside() -> None:
    """Staging copies on the calling thread (numpy's take, no OpenMP team beside the
    forward); a row outside the cache raises instead of being clipped to the last."""
    from kvpool.transfer.copies import _take

    src = np.arange(40, dtype=np.int16).reshape(10, 4)
    out = np.zeros((3, 4), dtype=np.int16)
    _take(src, np.array([7, 0, 9]), out)
    assert (out == src[[7, 0, 9]]).all()
    for bad in ([10], [-1]):
        with pytest.raises(IndexError, match=r"outside 0\.\.9"):
            _take(src, np.array(bad), np.zeros((1, 4), dtype=np.int16))


@pytest.mark.parametrize("priority", ["idle", "normal"])
def test_save_threads_take_only_idle_cpu_time_when_asked(store: KVStore, priority: str) -> None:
    """``save_priority="idle"``: the save and stage threads run under Linux's
    SCHED_IDLE, the load threads as any thread; "normal" leaves them all alone.
    A save still lands (this test's machine has idle time)."""
    layers = cpu_layers(2)
    randomize(layers, 1)
    eng = engine(store, layers, deferred_saves=True, save_priority=priority)
    try:
        idle = os.SCHED_IDLE if priority == "idle" else os.SCHED_OTHER
        expected = {
            "kvpool-save": idle,
            "kvpool-stage": idle,
            "kvpool-load": os.SCHED_OTHER,
            "kvpool-scatter": os.SCHED_OTHER,
        }

        def policies() -> dict[str, int]:
            return {t.name: os.sched_getscheduler(t.native_id or 0) for t in eng._threads}

        assert wait_until(lambda: policies() == expected, 10), policies()  # once started
        eng.submit_save("s", [ChunkRef(f"k{i}", 0, i, (i,)) for i in range(4)])
        (result,) = eng.wait(["s"], timeout=30)
        assert result.ok and store.batch_exists(["k0", "k1", "k2", "k3"]) == [Status.OK] * 4
    finally:
        eng.close()

"""The worker half (``kvpool.connector.worker``) over in-memory stores, in the fast tier:
reconnects, zero copy, idle waits, pins, refused saves and their drain, shards.
``tests/vllm/test_worker_side.py`` checks vLLM's parts."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import torch
from tests.factories import key_space, wait_until

from kvpool.config import PoolConfig
from kvpool.connector.identity import EngineIdentity
from kvpool.connector.steps import ChunkOp, RequestOps, StepPlan
from kvpool.connector.worker import IDLE_WAIT_S, Worker
from kvpool.layout import Layout
from kvpool.settings import ConnectorSettings
from kvpool.store.base import KVStore, Status
from kvpool.store.memory import MemoryStore
from kvpool.store.scatter import Segments
from kvpool.transfer import TransferStats

B, NB = 32, 16  # tokens per block, blocks


def identity(tp: int = 1, kv_heads: int = 1, window: int = 0) -> EngineIdentity:
    layout = Layout.create(tp=tp, groups=[f"gqa:{kv_heads}" + (f":w{window}" if window else "")])
    space = key_space(layout, chunk_size=B)
    return EngineIdentity(layout, space, B, B, 0)


def kv_caches(heads: int = 1) -> dict[str, torch.Tensor]:
    """Two layers in vLLM's per-layer view [blocks, heads, block_size, K and V]
    (the CPU backend's): 32 KiB per chunk of one KV head."""
    return {f"l{i}": torch.randn(NB, heads, B, 128) for i in range(2)}


def ops(req: str, blocks: list[int]) -> RequestOps:
    chunks = tuple(ChunkOp(i, bytes([i + 1]) * 8, ((b,),)) for i, b in enumerate(blocks))
    return RequestOps(req, chunks)


def finished_within(worker: Worker, req: str, timeout: float = 10.0) -> tuple[bool, bool]:
    """Poll like vLLM's step loop until ``req`` is reported; (done, failed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = worker.finished()
        if req in done:
            return True, req in failed
        time.sleep(0.01)
    return False, False


def test_a_dead_store_client_is_replaced_and_service_resumes() -> None:
    worker, opened, caches = dying_client_worker(PoolConfig())
    first = opened[0]
    assert isinstance(first, DyingClient)
    first.dead = True  # e.g. a same-host client whose holder was killed
    worker.start_loads(StepPlan(loads=[ops("b", [5, 6])]))
    assert finished_within(worker, "b") == (True, True)
    assert worker.load_errors() == {5, 6}
    # A new client is opened in the background and adopted at a later step.
    deadline = time.monotonic() + 10
    while not (len(opened) == 2 and worker.engine is not None) and time.monotonic() < deadline:
        worker.finished()
        time.sleep(0.01)
    assert len(opened) == 2 and worker.engine is not None and worker.store is opened[1]
    worker.start_loads(StepPlan(loads=[ops("c", [9, 10])]))
    assert finished_within(worker, "c") == (True, False)
    for src, dst in ((1, 9), (2, 10)):
        for t in caches.values():
            assert torch.equal(t[src], t[dst])
    stats = worker.stats()
    assert stats is not None and stats.chunks_loaded == 2 and stats.chunks_put == 2
    worker.close()


def test_a_client_of_ha_masters_gets_the_failover_time_before_a_reconnect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Of HA masters, UNAVAILABLE is most often a failover that Mooncake's client rides
    out by itself: the worker reconnects only after HA_RECONNECT_AFTER_S of it."""
    import kvpool.connector.worker as worker_module

    worker, opened, _ = dying_client_worker(PoolConfig(master_address="etcd://127.0.0.1:1"))
    first = opened[0]
    assert isinstance(first, DyingClient)
    first.dead = True
    worker.start_loads(StepPlan(loads=[ops("b", [5, 6])]))
    assert finished_within(worker, "b") == (True, True)
    worker.finished()
    assert len(opened) == 1 and worker.store is first  # no reconnect within the grace
    # Failed UNAVAILABLE at once: the chunks are fine, lookups keep finding them.
    report = worker.worker_meta()
    assert report is None or not report.failed_hashes
    first.dead = False  # the new leader serves: the same client works again
    worker.start_loads(StepPlan(loads=[ops("c", [9, 10])]))
    assert finished_within(worker, "c") == (True, False)
    monkeypatch.setattr(worker_module, "HA_RECONNECT_AFTER_S", 0.0)
    # A failure that stalled first (as against a holder cut off) is kept out of
    # lookups, or the next request would stall as long.
    monkeypatch.setattr(worker_module, "UNAVAILABLE_STALL_S", 0.0)
    first.dead = True  # and now for longer than the grace: a reconnect
    worker.start_loads(StepPlan(loads=[ops("d", [5, 6])]))
    assert finished_within(worker, "d") == (True, True)
    report = worker.worker_meta()
    assert report is not None and report.failed_hashes == {bytes([1]) * 8, bytes([2]) * 8}
    deadline = time.monotonic() + 10
    while not (len(opened) == 2 and worker.engine is not None) and time.monotonic() < deadline:
        worker.finished()
        time.sleep(0.01)
    assert len(opened) == 2 and worker.store is opened[1]
    worker.close()


class DyingClient(MemoryStore):
    """A client of ``shared`` that can die (then every get is UNAVAILABLE)."""

    def __init__(self, shared: MemoryStore) -> None:
        super().__init__(capacity=1 << 30)
        self._objects = shared._objects
        self.dead = False

    def _get(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        return [Status.UNAVAILABLE] * len(keys) if self.dead else super()._get(keys, segments)

    def close(self) -> None:  # closing a client keeps the pool's objects
        self._objects = OrderedDict()
        super().close()


def dying_client_worker(
    pool: PoolConfig,
) -> tuple[Worker, list[KVStore], dict[str, torch.Tensor]]:
    """A worker whose every store is a ``DyingClient`` of one pool (opened in order),
    with chunks of blocks 1 and 2 saved."""
    shared = MemoryStore(capacity=1 << 30)  # the pool; each client is a view of it
    opened: list[KVStore] = []

    def open_store(_: PoolConfig) -> KVStore:
        opened.append(DyingClient(shared))
        return opened[-1]

    kv_config = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )
    caches = kv_caches()
    worker = Worker(identity(), 0, ConnectorSettings(), pool, kv_config, open_store)
    worker.register(caches)
    worker.start_saves(StepPlan(saves=[ops("a", [1, 2])]))
    assert worker.engine is not None
    worker.engine.wait([("save", 0)], timeout=10)
    return worker, opened, caches


def test_zero_copy_places_kv_in_store_memory_and_flushes_saves_of_freed_requests() -> None:
    import threading

    release = threading.Event()
    puts: list[int] = []

    class Pool(MemoryStore):
        """Reaches only its own memory (like a shared-memory client); puts wait."""

        @property
        def requires_staging(self) -> bool:
            return True

        def _put(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
            assert release.wait(10)
            puts.append(len(keys))
            return super()._put(keys, segments)

    store = Pool(capacity=1 << 30)
    kv_config = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )
    caches = kv_caches()
    before = {n: t.clone() for n, t in caches.items()}
    settings = ConnectorSettings(zero_copy=True)
    worker = Worker(identity(), 0, settings, PoolConfig(), kv_config, lambda _: store, events=True)
    worker.register(caches)
    assert worker.engine is not None and worker.engine.zero_copy
    for n, t in caches.items():  # same tensors, now in the store's memory, same bytes
        assert store.reaches(t.data_ptr(), t.nbytes) and torch.equal(t, before[n])
    worker.start_saves(StepPlan(saves=[ops("a", [1, 2]), ops("b", [3])]))
    assert worker.saves_in_flight > 0
    worker.flush_saves(frozenset({"other"}))  # no save of a freed request: returns at once
    assert puts == []
    flusher = threading.Thread(target=worker.flush_saves, args=(frozenset({"a"}),))
    flusher.start()
    flusher.join(0.2)
    assert flusher.is_alive()  # blocks of "a" are still being read: the step waits
    release.set()
    flusher.join(10)
    assert not flusher.is_alive() and sum(puts) >= 2
    # The save results taken by the flush still reach the scheduler.
    worker.finished()
    deadline = time.monotonic() + 10
    stored: dict[bytes, int] = {}
    while len(stored) < 2 and time.monotonic() < deadline:
        worker.finished()
        meta = worker.worker_meta()
        if meta is not None:
            stored.update(meta.stored)
        time.sleep(0.01)
    assert len(stored) == 2  # a's two chunks (b's chunk 0 shares a's first hash)
    assert worker.saves_in_flight == 0
    worker.start_loads(StepPlan(loads=[ops("c", [9, 10])]))
    assert finished_within(worker, "c") == (True, False)
    for t in caches.values():
        assert torch.equal(t[1], t[9]) and torch.equal(t[2], t[10])
    worker.close()


def test_zero_copy_stays_off_for_kv_groups_that_free_blocks_of_running_requests() -> None:
    """One rule (``EngineIdentity.frees_blocks_early``) for drains and zero copy: a
    sliding-window group frees blocks of running requests, so zero copy stays off."""
    full, windowed = identity(), identity(window=64)
    assert full.keeps_blocks and full.frees_blocks_early() is None
    odd = windowed.frees_blocks_early()
    assert not windowed.keeps_blocks and odd is not None and odd.window == 64
    assert windowed.frees_blocks_early([]) is None  # a rank holding none of its groups
    kv = SimpleNamespace(num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])])
    store = MemoryStore(capacity=1 << 28)
    settings = ConnectorSettings(zero_copy=True)
    worker = Worker(windowed, 0, settings, PoolConfig(), kv, lambda _: store)
    worker.register(kv_caches())
    assert worker.engine is not None and not worker.engine.zero_copy
    worker.close()
    other = MemoryStore(capacity=1 << 28)  # the worker closed the first one
    worker = Worker(full, 0, settings, PoolConfig(), kv, lambda _: other)
    worker.register(kv_caches())
    assert worker.engine is not None and worker.engine.zero_copy  # the control
    worker.close()


def test_with_load_by_layer_zero_copy_stays_off_unless_the_store_is_this_hosts_holder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Loads by layer are waited for inside the forward. Zero copy over a store that
    reaches any memory (TCP, RDMA: another host's holder) would be a direct get with
    no deadline there, so it stays off and loads are staged, said. Through a store
    that moves bytes only via its own memory (this host's holder), it stays on."""

    class Holder(MemoryStore):
        @property
        def requires_staging(self) -> bool:
            return True

    kv = SimpleNamespace(num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])])
    settings = ConnectorSettings(zero_copy=True, load_by_layer=True)
    remote = MemoryStore(capacity=1 << 28)
    worker = Worker(identity(), 0, settings, PoolConfig(), kv, lambda _: remote)
    worker.register(kv_caches())
    assert worker.engine is not None and not worker.engine.zero_copy
    assert worker.engine.load_mode == "staged" and "loads are staged" in caplog.text
    worker.close()
    local = Holder(capacity=1 << 28)
    worker = Worker(identity(), 0, settings, PoolConfig(), kv, lambda _: local)
    worker.register(kv_caches())
    assert worker.engine is not None and worker.engine.zero_copy  # the control
    worker.close()


def test_interval_stats_report_each_change_once_and_idle_steps_build_nothing() -> None:
    store = MemoryStore(capacity=1 << 30)
    kv_config = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )
    settings, pool = ConnectorSettings(), PoolConfig()
    worker = Worker(identity(), 0, settings, pool, kv_config, lambda _: store)
    worker.register(kv_caches())
    engine = worker.engine
    assert engine is not None
    assert worker.interval_stats() is None  # nothing happened yet
    version = engine.stats_version
    worker.start_saves(StepPlan(saves=[ops("a", [1, 2])]))
    engine.wait([("save", 0)], timeout=10)
    assert engine.stats_version != version
    data = worker.interval_stats()
    assert data is not None and data["chunks_saved"] == 2
    snapshots = 0
    real_stats = engine.stats

    def counted() -> TransferStats:
        nonlocal snapshots
        snapshots += 1
        return real_stats()

    engine.stats = counted  # type: ignore[method-assign]
    for _ in range(100):  # idle steps: reported once, then no snapshot at all
        assert worker.interval_stats() is None
    assert snapshots == 0
    worker.start_loads(StepPlan(loads=[ops("b", [5, 6])]))
    assert finished_within(worker, "b") == (True, False)
    data = worker.interval_stats()
    assert data is not None and data["chunks_loaded"] == 2 and data["chunks_saved"] == 0
    assert snapshots == 1
    worker.close()


def plain_worker() -> tuple[Worker, MemoryStore]:
    """A registered TP1 worker over a 1 GiB memory store, default settings."""
    store = MemoryStore(capacity=1 << 30)
    kv_config = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )
    worker = Worker(identity(), 0, ConnectorSettings(), PoolConfig(), kv_config, lambda _: store)
    worker.register(kv_caches())
    return worker, store


def test_a_save_copies_off_the_forwards_path_and_holds_its_blocks_until_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM keeps a finished request's blocks for its saves, so a save's copy into
    staging runs on the stage thread: ``start_saves`` returns while the copy has not
    run; meanwhile the request is never released (past the drain limit too), a
    flush of its freed blocks waits for the copy, and the pool gets the bytes the
    blocks held when they were copied."""
    import kvpool.connector.drain as drain_module

    worker, store = plain_worker()
    engine = worker.engine
    assert engine is not None and engine.deferred_saves and engine.reads_blocks_until_done
    copier = engine._core.copier
    copying, go = threading.Event(), threading.Event()
    gather = copier.gather

    def held_gather(*args: object, **kwargs: object) -> None:
        copying.set()
        assert go.wait(30)
        gather(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(copier, "gather", held_gather)
    monkeypatch.setattr(drain_module, "DRAIN_LIMIT_S", 0.0)
    worker.start_saves(StepPlan(saves=[ops("a", [1, 2])]))  # returns: nothing copied yet
    assert copying.wait(10) and engine.reading(worker._book.jobs)
    worker.start_saves(StepPlan(finishing=frozenset({"a"})))
    worker.finished()
    assert worker.released() == set()  # its blocks are still to be read
    flushed = threading.Thread(target=worker.flush_saves, args=(frozenset({"a"}),))
    flushed.start()
    flushed.join(0.2)
    assert flushed.is_alive()  # the next forward may not overwrite them yet
    go.set()
    flushed.join(10)
    assert not flushed.is_alive()
    keys = [worker.identity.space.key(worker.identity.layout.holdings(0, 0)[0], bytes([i]) * 8)
            for i in (1, 2)]  # fmt: skip
    assert wait_until(lambda: set(keys) <= set(store.keys()), 10)
    worker.close()


def test_saves_put_is_set_by_close_once_every_queued_save_is_in_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``close`` puts what was queued before it returns; ``saves_put`` tells a
    process about to exit that it may (the demo engine waits for it, not for the
    store's own close)."""
    worker, store = plain_worker()
    engine = worker.engine
    assert engine is not None
    copier = engine._core.copier
    copying, go, store_may_close = threading.Event(), threading.Event(), threading.Event()
    gather, close_store = copier.gather, store.close

    def held_gather(*args: object, **kwargs: object) -> None:
        copying.set()
        assert go.wait(30)
        gather(*args, **kwargs)  # type: ignore[arg-type]

    def held_close() -> None:  # a memory store forgets its objects at close
        assert store_may_close.wait(30)
        close_store()

    monkeypatch.setattr(copier, "gather", held_gather)
    monkeypatch.setattr(store, "close", held_close)
    worker.start_saves(StepPlan(saves=[ops("a", [1, 2])]))
    assert copying.wait(10)
    closing = threading.Thread(target=worker.close)
    closing.start()
    assert not worker.saves_put.wait(0.2)  # the save is still queued
    go.set()
    assert worker.saves_put.wait(10)
    keys = [worker.identity.space.key(worker.identity.layout.holdings(0, 0)[0], bytes([i]) * 8)
            for i in (1, 2)]  # fmt: skip
    assert set(keys) <= set(store.keys())
    store_may_close.set()
    closing.join(10)
    assert not closing.is_alive()


def test_every_rank_blocks_in_an_idle_step_even_with_no_transfer_of_its_own() -> None:
    """vLLM's engine and workers spin while one waits for another; a rank with no
    load of its own that returned at once spun beside them and, on two cores,
    starved the holder serving the other rank's load (30 s, then a miss)."""
    worker, _ = plain_worker()
    for _ in range(3):
        start = time.monotonic()
        assert worker.finished(idle=True) == (set(), set())
        assert time.monotonic() - start >= IDLE_WAIT_S
    worker.close()


def test_a_save_of_a_request_with_a_pin_pins_its_objects() -> None:
    """RequestOps.pin_ms (the request's pin_seconds) reaches the store's put, through
    the framing, for that request's objects only."""
    worker, store = plain_worker()
    a, b = ops("a", [1, 2]), RequestOps("b", (ChunkOp(0, b"\x09" * 8, ((3,),)),))
    pinned = RequestOps(a.req_id, a.chunks, a.fresh_from, pin_ms=60_000)
    worker.start_saves(StepPlan(saves=[pinned, b]))
    assert worker.engine is not None and worker.engine.wait_any(10)
    deadline = time.monotonic() + 10
    while len(store.keys()) < 3 and time.monotonic() < deadline:
        worker.engine.wait_any(0.1)
    stored = store.keys()  # a list, not a dict's view
    assert len(stored) == 3
    assert sorted(map(store.pinned, stored)) == [False, True, True]
    worker.close()


class SlowPuts(MemoryStore):
    """Puts wait for ``release``: a pool slower than the engine for a while."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__(capacity=1 << 30)
        self.release = release

    def _put(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        assert self.release.wait(30)
        return super()._put(keys, segments)


def slow_worker(release: threading.Event) -> tuple[Worker, SlowPuts, dict[str, torch.Tensor]]:
    """A worker whose save staging holds two chunk objects, over a ``SlowPuts`` pool."""
    store = SlowPuts(release)
    kv_config = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )
    caches = kv_caches()  # 32 KiB per chunk object
    # 128 KiB of staging: 64 KiB for saves (two objects), 64 KiB for staged loads.
    settings = ConnectorSettings(staging_bytes=128 << 10)
    worker = Worker(identity(), 0, settings, PoolConfig(), kv_config, lambda _: store)
    worker.register(caches)
    return worker, store, caches


def test_a_save_refused_for_busy_staging_is_retried_by_the_worker_until_stored() -> None:
    release = threading.Event()
    worker, store, caches = slow_worker(release)
    engine = worker.engine
    assert engine is not None and engine.load_mode == "staged"
    worker.start_saves(StepPlan(saves=[ops("a", [1, 2, 3, 4, 5])]))  # returns at once
    # Staged on the stage thread: staging full, its wait ran out: refused at once now.
    assert wait_until(lambda: engine.saves_blocked, 10)
    # Saves stall, loads do not: they have staging of their own. Objects written
    # before (by "another engine") load while the puts are stuck.
    chunk_hash = bytes([1]) * 8
    key = worker.identity.space.key(worker.identity.layout.holdings(0, 0)[0], chunk_hash)
    other = MemoryStore(capacity=1 << 20)
    other._objects = store._objects  # the same pool, a client whose puts are not stuck
    obj = torch.full((2, 1, B, 128), 3.0)
    assert other.batch_put([key], [[(obj.data_ptr(), obj.nbytes)]]) == [Status.OK]
    worker.start_loads(StepPlan(loads=[ops("b", [9])]))
    assert finished_within(worker, "b") == (True, False)
    assert all(bool((t[9] == 3.0).all()) for t in caches.values())
    release.set()
    keys = {worker.identity.space.key(worker.identity.layout.holdings(0, 0)[0], bytes([i]) * 8)
            for i in range(2, 6)}  # fmt: skip
    deadline = time.monotonic() + 10
    while not keys <= store._objects.keys() and time.monotonic() < deadline:
        worker.finished()
        worker.start_saves(StepPlan())  # each step: refused objects go again
        time.sleep(0.01)
    assert keys <= store._objects.keys()  # chunks 2-4, refused at first, are in the pool
    assert worker.worker_meta() is None  # nothing for the scheduler to plan again
    assert worker.engine is engine and worker.store is store  # not retired
    stats = worker.stats()
    assert stats is not None and stats.chunks_refused["staging_busy"] >= 3
    assert stats.chunks_put + stats.chunks_skipped_exist == 5  # chunk 0 was there already
    worker.close()


def test_a_finished_request_is_released_once_its_refused_saves_are_stored() -> None:
    release = threading.Event()
    worker, store, _ = slow_worker(release)
    worker.start_saves(StepPlan(saves=[ops("a", [1, 2, 3, 4])]))
    # "a" finished; vLLM keeps its blocks. Another finishing request had no save
    # on this rank: it is released at the next poll.
    worker.start_saves(StepPlan(finishing=frozenset({"a", "idle"})))
    worker.finished()
    assert worker.released() == {"idle"}
    for _ in range(3):  # its puts are stuck: not released
        worker.finished()
        worker.start_saves(StepPlan())
        assert worker.released() == set()
    release.set()
    got: set[str] = set()
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        worker.finished(idle=True)
        got = worker.released()
        worker.start_saves(StepPlan())
    assert got == {"a"}
    assert len(store._objects) == 4  # every object, the refused ones too
    worker.finished()
    assert worker.released() == set()  # reported once
    worker.close()


def test_retries_stop_at_the_drain_limit_and_when_the_blocks_are_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvpool.connector.drain as drain_module

    release = threading.Event()
    worker, _, _ = slow_worker(release)
    p = RequestOps("p", tuple(ChunkOp(i, bytes([20 + i]) * 8, ((4 + i,),)) for i in range(3)))
    worker.start_saves(StepPlan(saves=[ops("a", [1, 2, 3]), p]))  # other prompts

    def refused() -> int:  # a's third object, after its wait for staging, then all of p's
        stats = worker.stats()
        return 0 if stats is None else stats.chunks_refused["staging_busy"]

    assert wait_until(lambda: refused() >= 4, 10)
    release.set()
    deadline = time.monotonic() + 10
    while worker._book.has_jobs and time.monotonic() < deadline:  # the first jobs end
        worker.finished()
        time.sleep(0.01)
    assert worker._book.retrying == {"a", "p"}
    # "p" is preempted (its blocks are freed): its refused objects are dropped.
    # "a" finished; a new save fills staging again, so saves are blocked and its
    # retry waits, past the drain limit.
    release.clear()
    monkeypatch.setattr(drain_module, "DRAIN_LIMIT_S", 0.0)
    other = RequestOps("x", tuple(ChunkOp(i, bytes([50 + i]) * 8, ((7 + i,),)) for i in range(3)))
    worker.start_saves(StepPlan(saves=[other], freed=frozenset({"p"}), finishing=frozenset({"a"})))
    engine = worker.engine
    assert engine is not None and wait_until(lambda: engine.saves_blocked, 10)
    assert "p" not in worker._book.retrying  # a's retry went again, and is refused again
    got: set[str] = set()
    while not got and time.monotonic() < deadline:
        worker.finished()
        got = worker.released()
        time.sleep(0.01)
    assert got == {"a"}  # given up: its blocks go back to vLLM (the warning: test_drain)
    assert not worker._book.retrying  # and nothing of it goes again
    release.set()
    worker.close()


def test_a_rank_holding_two_kv_heads_writes_an_object_per_head_that_tp2_ranks_read() -> None:
    """TP1 with 2 KV heads saves one object per head, each that head's slice of
    every layer; the two ranks of a TP2 engine (one head each) load them into
    their own tensors, byte for byte. And the other way round."""
    store = MemoryStore(capacity=1 << 30)
    kv_config = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )

    class View(MemoryStore):
        """Each worker's own client of one pool: closing it leaves the pool alone."""

        def __init__(self, _: PoolConfig) -> None:
            super().__init__(capacity=1 << 30)
            self._objects = store._objects

        def close(self) -> None:
            self._objects = OrderedDict()
            super().close()

    client = View

    def worker(tp: int, rank: int, caches: dict[str, torch.Tensor]) -> Worker:
        w = Worker(identity(tp, 2), rank, ConnectorSettings(), PoolConfig(), kv_config,
                       client)  # fmt: skip
        w.register(caches)
        return w

    def save(w: Worker, blocks: list[int]) -> None:
        w.start_saves(StepPlan(saves=[ops("s", blocks)]))
        assert w.engine is not None
        results = w.engine.wait(w._book.jobs, timeout=10)
        assert results and all(r.ok for r in results)

    one = kv_caches(heads=2)
    tp1 = worker(1, 0, one)
    save(tp1, [3, 4])
    assert len(store._objects) == 2 * 2  # chunks x heads
    # the worker's keys (templates and hashes' hex) are KeySpace.key's, one per head
    space = identity(1, 2).space
    heads = identity(1, 2).layout.contents(0)
    want = {space.key(c, bytes([i + 1]) * 8) for c in heads for i in range(2)}
    assert set(store._objects) == want and len({c.head for c in heads}) == 2
    halves = [kv_caches(heads=1) for _ in range(2)]
    for rank, caches in enumerate(halves):
        w = worker(2, rank, caches)
        w.start_loads(StepPlan(loads=[ops("l", [7, 8])]))
        assert finished_within(w, "l") == (True, False)
        for name, t in caches.items():
            assert torch.equal(t[7:9, 0], one[name][3:5, rank])
        w.close()
    tp1.close()
    # TP2 ranks write chunks of other hashes (blocks 1, 2); TP1 reads both heads.
    store._objects.clear()
    for rank, caches in enumerate(halves):
        w = worker(2, rank, caches)
        save(w, [7, 8])
        w.close()
    fresh = kv_caches(heads=2)
    tp1 = worker(1, 0, fresh)
    tp1.start_loads(StepPlan(loads=[ops("l", [10, 11])]))
    assert finished_within(tp1, "l") == (True, False)
    for name, t in fresh.items():
        for head in range(2):
            assert torch.equal(t[10:12, head], halves[head][name][7:9, 0])
    tp1.close()


def banded_workers(
    store: KVStore, token_classes: int = 1
) -> tuple[list[str], dict[str, torch.Tensor], Worker, dict[str, torch.Tensor], Worker]:
    """A saver and a fresh loader of a 2-layer model in two layer bands (one object
    per band, token class and chunk) over ``store``: (layer names, saver's KV,
    saver, loader's KV (zeros), loader)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    kv_config = SimpleNamespace(num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=names)])
    layout = Layout.create(
        groups=["gqa:1"], layers=2, layer_bands=[0, 1], token_classes=token_classes
    )
    ident = EngineIdentity(layout, key_space(layout, chunk_size=B), B, B, 0)

    def worker(caches: dict[str, torch.Tensor]) -> Worker:
        w = Worker(ident, 0, ConnectorSettings(), PoolConfig(), kv_config, lambda _: store)
        w.register(caches)
        assert w.engine is not None
        return w

    saved = {n: t for n, t in zip(names, kv_caches().values(), strict=True)}
    fresh = {n: torch.zeros_like(t) for n, t in saved.items()}
    return names, saved, worker(saved), fresh, worker(fresh)


def test_a_rank_holding_two_bands_and_two_token_classes_writes_and_reads_each_alone() -> None:
    """Two layers in bands 0 and 1, two token classes: one object per band and
    class of each chunk, each that band's layer and every other token; a fresh
    worker loads them back into other blocks byte for byte."""
    store = MemoryStore(capacity=1 << 30)
    names, saved, w, fresh, r = banded_workers(store, token_classes=2)
    w.start_saves(StepPlan(saves=[ops("s", [3])]))
    assert w.engine is not None
    assert all(x.ok for x in w.engine.wait(w._book.jobs, timeout=10))
    assert len(store._objects) == 2 * 2  # bands x token classes
    r.start_loads(StepPlan(loads=[ops("l", [9])]))
    assert finished_within(r, "l") == (True, False)
    for n in names:
        assert torch.equal(fresh[n][9], saved[n][3])


def test_a_kv_tensor_whose_heads_cannot_be_found_leaves_the_worker_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kv_config = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )
    w = Worker(identity(1, 2), 0, ConnectorSettings(), PoolConfig(), kv_config,
                   lambda _: MemoryStore(capacity=1 << 30))  # fmt: skip
    with caplog.at_level(logging.ERROR):
        w.register({f"l{i}": torch.randn(NB, B, 256) for i in range(2)})  # no head axis
    assert w.engine is None
    assert "kvpool cannot name its heads" in caplog.text


def test_staging_smaller_than_one_chunk_stops_the_engine_at_start_with_the_size_to_set() -> None:
    import pytest

    from kvpool.errors import ConfigError

    store = MemoryStore(capacity=1 << 30)
    kv_config = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )
    settings = ConnectorSettings(staging_bytes=32 << 10, load_mode="staged")  # 16 KiB a side
    worker = Worker(identity(), 0, settings, PoolConfig(), kv_config, lambda _: store)
    with pytest.raises(ConfigError, match=r"raise staging_bytes to at least \d+ bytes"):
        worker.register(kv_caches())  # one chunk object is 32 KiB


def test_refused_saves_are_not_retried_with_kv_events_or_groups_that_free_blocks() -> None:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    store = MemoryStore(capacity=1 << 28)
    full = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )
    window = SlidingWindowSpec.__new__(SlidingWindowSpec)  # only its kind is read
    sliding = SimpleNamespace(
        num_blocks=NB,
        kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=window)],
    )
    for config, events, retry in (
        (full, False, True),
        (full, True, False),
        (sliding, False, False),
    ):
        ident = identity(window=64 if config is sliding else 0)  # as vLLM's groups say
        worker = Worker(
            ident, 0, ConnectorSettings(), PoolConfig(), config, lambda _: store, events=events
        )
        worker.register(kv_caches())
        assert ident.holds_for_saves(events) is retry, (events, config is sliding)
        assert worker._book.retries is retry  # the worker follows the one rule
        worker.close()


def test_kv_tensors_off_the_host_are_refused_and_the_worker_stays_idle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    opened: list[KVStore] = []

    def open_store(_: PoolConfig) -> KVStore:
        opened.append(MemoryStore())
        return opened[-1]

    kv_config = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )
    # "meta" tensors stand in for device memory: no host address behind them.
    caches = {f"l{i}": torch.empty(NB, 2, B, 64, device="meta") for i in range(2)}
    worker = Worker(identity(), 0, ConnectorSettings(), PoolConfig(), kv_config, open_store)
    with caplog.at_level(logging.ERROR, logger="kvpool"):
        worker.register(caches)
    assert worker.engine is None and not opened  # no store opened, no copy planned
    assert "KV tensors on meta" in caplog.text and "stays idle" in caplog.text
    worker.start_loads(StepPlan(loads=[ops("b", [5, 6])]))
    assert finished_within(worker, "b") == (True, True)  # a miss: vLLM recomputes


def test_a_finishing_request_is_noted_at_load_time_too() -> None:
    """vLLM may skip a rank's ``wait_for_save`` (spec decode defers it; a non-last
    PP rank may return early): finishing requests are noted from ``start_loads``
    as well, so every rank reports them."""
    worker, _, _ = slow_worker(threading.Event())
    worker.start_loads(StepPlan(finishing=frozenset({"x"})))
    worker.finished()
    assert worker.released() == {"x"}
    worker.close()


def test_chunks_the_lookup_found_missing_are_put_again_though_put_before() -> None:
    """A worker skips keys it stored recently without a store call; once the pool
    evicted them, the scheduler's lookup says so (``fresh_from``) and they go again."""
    worker, store = plain_worker()

    def save(fresh_from: int | None) -> None:
        worker.start_saves(
            StepPlan(saves=[RequestOps("a", ops("a", [1, 2, 3]).chunks, fresh_from)])
        )
        assert worker.engine is not None and worker.engine.wait_any(10)
        worker.finished()

    save(None)
    assert len(store._objects) == 3
    store.batch_remove(list(store._objects), force=True)  # the pool evicted them
    save(None)  # no lookup said: remembered, skipped
    assert not store._objects
    save(fresh_from=1)  # the lookup found chunks 1 and 2 missing
    assert len(store._objects) == 2
    worker.close()


def by_layer(req: str, blocks: list[int]) -> RequestOps:
    o = ops(req, blocks)
    return RequestOps(o.req_id, o.chunks, by_layer=True)


def test_a_load_by_layer_is_in_each_band_before_its_layer_and_never_reported_finished() -> None:
    """vLLM's sync load: one job per layer band, first band first; waiting for
    layer 0 leaves band 1 to come; after layer 1 both bands' bytes are in place;
    ``finished`` never names the request (vLLM expects no finished load)."""
    store = MemoryStore(capacity=1 << 30)
    names, saved, saver, fresh, loader = banded_workers(store)
    saver.start_saves(StepPlan(saves=[ops("s", [3, 4])]))
    assert saver.engine is not None
    assert all(r.ok for r in saver.engine.wait(saver._book.jobs, timeout=10))
    loader.start_loads(StepPlan(loads=[by_layer("l", [9, 10])]))
    assert sorted(loader._band_jobs) == [0, 1]
    loader.wait_layer(names[0])
    assert list(loader._band_jobs) == [1]  # band 1 not waited for yet
    assert torch.equal(fresh[names[0]][9], saved[names[0]][3])
    loader.wait_layer(names[1])
    assert not loader._band_jobs and not loader._layered
    for n in names:
        assert torch.equal(fresh[n][9], saved[n][3]) and torch.equal(fresh[n][10], saved[n][4])
    assert loader.finished() == (set(), set())
    assert loader.load_errors() == set()
    stats = loader.stats()
    assert stats is not None and stats.chunks_loaded == 4  # 2 chunks x 2 bands
    saver.close()
    loader.close()


def test_a_failed_load_by_layer_reports_its_blocks_for_recompute_not_a_finished_load() -> None:
    """Band 1's object of chunk 1 is gone: the blocks of chunk 1 go to
    ``load_errors`` (vLLM recomputes them and drops that step's output for the
    request), its hash to the lookups' suppression, and ``finished`` never names
    the request; band 0 and chunk 0 of band 1 landed."""
    store = MemoryStore(capacity=1 << 30)
    names, saved, saver, fresh, loader = banded_workers(store)
    saver.start_saves(StepPlan(saves=[ops("s", [3, 4])]))
    assert saver.engine is not None
    assert all(r.ok for r in saver.engine.wait(saver._book.jobs, timeout=10))
    band1 = next(c for c, *_ in loader._shards[0] if c.band == 1)
    gone = loader.identity.space.key(band1, bytes([2]) * 8)
    assert store.batch_remove([gone], force=True)[0].ok
    loader.start_loads(StepPlan(loads=[by_layer("l", [9, 10])]))
    for n in names:
        loader.wait_layer(n)
    assert loader.load_errors() == {10}
    assert torch.equal(fresh[names[0]][10], saved[names[0]][4])  # band 0 landed
    assert torch.equal(fresh[names[1]][9], saved[names[1]][3])
    assert not torch.equal(fresh[names[1]][10], saved[names[1]][4])
    assert loader.finished() == (set(), set())
    report = loader.worker_meta()
    assert report is not None and bytes([2]) * 8 in report.failed_hashes
    saver.close()
    loader.close()


def test_loads_by_layer_not_waited_for_by_the_forward_end_before_saves_and_finished() -> None:
    """A band whose first layer the forward never announced is waited for by
    ``start_saves`` (and ``finished``): no load by layer outlives its step."""
    store = MemoryStore(capacity=1 << 30)
    names, saved, saver, fresh, loader = banded_workers(store)
    saver.start_saves(StepPlan(saves=[ops("s", [3])]))
    assert saver.engine is not None
    assert all(r.ok for r in saver.engine.wait(saver._book.jobs, timeout=10))
    loader.start_loads(StepPlan(loads=[by_layer("l", [9])]))
    loader.start_saves(StepPlan())
    assert not loader._band_jobs and not loader._layered
    for n in names:
        assert torch.equal(fresh[n][9], saved[n][3])
    assert loader.finished() == (set(), set()) and loader.load_errors() == set()
    saver.close()
    loader.close()


def test_a_step_reports_its_forwards_time_without_the_workers_own() -> None:
    """The forward's time is taken from ``step_began`` to ``start_saves``, less the
    time spent in the worker between (a flush of freed requests' saves, loads by
    layer): what computing the step's tokens cost, for the load-or-recompute
    decision (``kvpool.connector.costs``)."""
    worker, _ = plain_worker()
    worker.step_began()
    start = time.perf_counter()
    time.sleep(0.05)  # the forward
    worker.start_saves(StepPlan(tokens=300))
    took = time.perf_counter() - start
    report = worker.worker_meta()
    assert report is not None and report.forward is not None
    tokens, seconds = report.forward
    assert tokens == 300 and 0.05 <= seconds <= took
    assert worker.worker_meta() is None  # reported once
    # A step with no tokens (vLLM's empty steps) is no sample; nor one not begun.
    worker.step_began()
    worker.start_saves(StepPlan(tokens=0))
    worker.start_saves(StepPlan(tokens=10))
    assert worker.worker_meta() is None
    worker.close()

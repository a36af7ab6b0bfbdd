"""A full pool on a real Mooncake master: it keeps admitting, keeps what is read and
the newest prompts, and evicts what is never read.

The pool (64 MiB) takes 4 MiB prompts (32 chunk objects of 128 KiB), four times
its size in all. A hot prompt is loaded after every second new one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvpool.pool import LocalPool, wait_until
from kvpool.pool.master_api import segment_capacities
from kvpool.pool.status import pool_status
from kvpool.store.base import Status
from kvpool.store.mooncake import MooncakeStore
from kvpool.transfer import ChunkRef, TransferEngine

PoolFactory = Callable[..., LocalPool]  # the conftest fixture's type

NB, BS, ROW = 40, 32, 512  # blocks; a block is 2 x 32 x 512 float32 = 128 KiB
CHUNKS = 32  # objects per prompt: 4 MiB
POOL = 64 << 20


def _prompt(name: str) -> list[ChunkRef]:
    return [ChunkRef(f"{name}/{c:02d}", 0, c, (c,)) for c in range(CHUNKS)]


def _present(store: MooncakeStore, name: str) -> str:
    got = store.batch_exists([c.key for c in _prompt(name)])
    return "".join("x" if s is Status.OK else "." for s in got)


def test_a_pool_filled_four_times_over_keeps_admitting_and_keeps_what_is_read(
    pool_factory: PoolFactory,
) -> None:
    pool = pool_factory(segment_size=POOL, lease_ttl_ms=200)
    kv = torch.randn(NB, 2, BS, ROW)
    with MooncakeStore(pool.config(), shared_memory=True) as store:
        engine = TransferEngine(store, [[("l0", kv)]], NB, staging_bytes=32 << 20)
        try:
            assert engine.submit_save("hot", _prompt("hot"))
            assert engine.wait(["hot"], timeout=60)[0].ok
            # The control: written with it, never read.
            assert engine.submit_save("cold", _prompt("cold"))
            assert engine.wait(["cold"], timeout=60)[0].ok
            names = [f"p{i:02d}" for i in range(4 * POOL // (CHUNKS * 128 << 10))]
            for i, name in enumerate(names):
                assert engine.submit_save(name, _prompt(name)), name
                (saved,) = engine.wait([name], timeout=60)
                assert saved.ok, (name, saved.statuses)  # nothing dropped: retried
                if i % 2:
                    engine.submit_load(f"r{i}", _prompt("hot"))
                    (read,) = engine.wait([f"r{i}"], timeout=60)
                    assert read.ok, (i, read.statuses)
            stats = engine.stats()
        finally:
            engine.close()
        # Whether a put ever met a full pool depends on the master's eviction keeping
        # ahead of the puts (under CI load it did, every time): counted, not required.
        assert not stats.failures and stats.backpressure_events == 0
        assert _present(store, "hot") == "x" * CHUNKS  # read: kept
        # Never read, and 4 pools' worth written after it: every object evicted
        # (Mooncake's eviction takes the objects whose read lease ended first: reads
        # count; here 0 of 32 kept in each run, and the 51 prompts after it too).
        assert "x" not in _present(store, "cold")
        for name in names[-8:]:  # the newest prompts: whole
            assert _present(store, name) == "x" * CHUNKS, name
        # Which objects of a partly evicted prompt go is Mooncake's choice: calm, it
        # takes a call's objects in its order (the put order, last chunk first, is
        # checked in tests/unit/test_transfer.py); under CI load it took them from
        # anywhere (2 of 3 runs on one host: 15 of 32 kept with holes; 30 of 32, chunks
        # 10 and 15 gone), so no order is asserted here.
    # What an operator sees: evictions, and the puts that found the pool full.
    status = pool_status(pool, list_keys=False)
    assert status.evicted_bytes is not None and status.evicted_bytes >= 2 * POOL
    assert status.refused_puts is not None and status.refused_puts >= stats.puts_no_space


def test_a_pool_with_a_disk_reads_evicted_objects_back_even_after_a_holder_restart(
    pool_factory: PoolFactory, tmp_path: Path
) -> None:
    """``kvpool up --disk``: what the pool evicts from its 32 MiB of memory goes to
    files, reads back with its own bytes, and survives a restart of the holder."""
    pool = pool_factory(segment_size=32 << 20, lease_ttl_ms=500, disk_dir=tmp_path / "disk")
    size, count = 256 << 10, 384  # 96 MiB: three times the memory
    with MooncakeStore(pool.config(), shared_memory=True) as store:
        buf = store.alloc_staging(size)
        addr = buf.ctypes.data

        def put(i: int) -> Status:
            buf[:] = i % 251
            deadline = time.monotonic() + 30
            while (st := store.batch_put([f"d/{i}"], [[(addr, size)]])[0]) is Status.NO_SPACE:
                assert time.monotonic() < deadline, "the pool never made room"
                time.sleep(0.02)  # the holder writes to disk, then memory is freed
            return st

        assert all(put(i) is Status.OK for i in range(count))

        def first_quarter_reads_back() -> bool:
            for i in range(count // 4):
                buf[:] = 0
                if store.batch_get([f"d/{i}"], [[(addr, size)]]) != [Status.OK]:
                    return False
                assert int(buf.min()) == int(buf.max()) == i % 251, i  # its own bytes
            return True

        assert first_quarter_reads_back()
    # The holder dies; once the master has dropped it (client_ttl), a new one on the
    # same folder finds the files and registers them again.
    pool.kill_holder()
    assert wait_until(lambda: not segment_capacities(pool.metrics()), 30, step=0.2)
    pool.restart_holder()
    with MooncakeStore(pool.config(), shared_memory=True) as store:
        buf = store.alloc_staging(size)
        addr = buf.ctypes.data
        assert wait_until(first_quarter_reads_back, 30, step=0.2)


def test_a_pinned_prompt_outlives_a_flood_that_evicts_an_unpinned_one(
    pool_factory: PoolFactory,
) -> None:
    """A request's ``pin_seconds`` reaches Mooncake as a soft pin on the objects its
    saves put (shared-memory path): a pool written four times over, never reading
    either prompt, evicts the unpinned prompt and keeps the pinned one whole."""
    pool = pool_factory(segment_size=POOL, lease_ttl_ms=200)
    kv = torch.randn(NB, 2, BS, ROW)
    pinned = [
        ChunkRef(r.key, r.group, r.chunk, r.block_ids, pin_ms=600_000) for r in _prompt("pin")
    ]
    with MooncakeStore(pool.config(), shared_memory=True) as store:
        engine = TransferEngine(store, [[("l0", kv)]], NB, staging_bytes=32 << 20)
        try:
            assert engine.submit_save("pin", pinned) and engine.submit_save("free", _prompt("free"))
            assert all(r.ok for r in engine.wait(["pin", "free"], timeout=60))
            for i in range(4 * POOL // (CHUNKS * 128 << 10)):
                assert engine.submit_save(f"p{i}", _prompt(f"p{i}"))
                (saved,) = engine.wait([f"p{i}"], timeout=60)
                assert saved.ok, (i, saved.statuses)
        finally:
            engine.close()
        assert _present(store, "pin") == "x" * CHUNKS
        assert _present(store, "free") == "." * CHUNKS

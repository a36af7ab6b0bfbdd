"""MooncakeStore against real processes: setup failures, dead holders, pure clients,
and the same-host shared-memory mode."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvpool.config import PoolConfig
from kvpool.errors import StoreError, StoreUnavailable
from kvpool.pool import LocalPool
from kvpool.store import Status, open_store
from kvpool.store.framed import FramedStore
from kvpool.store.mooncake import MooncakeStore

MiB = 1 << 20
FP = "0123456789abcdef"


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def seg(a: np.ndarray) -> list[tuple[int, int]]:
    return [(a.ctypes.data, a.nbytes)]


def test_unreachable_master_fails_fast_naming_the_address() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"mooncake_master at {address}.*kvpool up"):
        open_store("mooncake", PoolConfig(master_address=address))
    assert time.monotonic() - start < 10


def test_an_endpoint_that_is_no_master_fails_setup_within_the_setup_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MC_RPC_TIMEOUT_MS", raising=False)  # let the adapter bound it
    with socket.socket() as listener:  # accepts TCP, never answers RPC
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match=f"setup against mooncake_master at {address}"):
            MooncakeStore(PoolConfig(master_address=address, setup_timeout_s=2))
    assert time.monotonic() - start < 10


def test_objects_outlive_the_pure_client_that_wrote_them(local_pool: LocalPool) -> None:
    a = rand(2 * MiB, 1)
    with MooncakeStore(local_pool.config()) as writer:
        assert writer.batch_put(["keep"], [seg(a)]) == [Status.OK]
    out = np.zeros_like(a)
    with MooncakeStore(local_pool.config()) as reader:
        assert reader.batch_get(["keep"], [seg(out)]) == [Status.OK]
    assert np.array_equal(a, out)


def test_a_killed_holder_gives_typed_failures_never_exceptions(
    pool_factory: Callable[..., LocalPool],
) -> None:
    pool = pool_factory(segment_size=64 * MiB, client_ttl=2)
    a = rand(MiB, 2)
    out = np.zeros_like(a)
    with MooncakeStore(pool.config(transfer_timeout_s=2)) as store:
        assert store.batch_put(["before"], [seg(a)]) == [Status.OK]
        pool.kill_holder()
        # the master still lists the dead holder's segment: transfers to it fail
        puts = store.batch_put([f"after/{i}" for i in range(4)], [seg(a)] * 4)
        assert Status.TRANSFER_FAILED in puts
        assert not any(p.ok for p in puts)
        got = store.batch_get(["before"], [seg(out)])
        assert got[0] in (Status.TRANSFER_FAILED, Status.MISSING)
        assert not np.array_equal(out, a)  # a failed get leaves no bytes behind
        # once the master drops the segment (client_ttl), there is just no space
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            status = store.batch_put(["later"], [seg(a)])[0]
            assert not status.ok
            if status is not Status.TRANSFER_FAILED:
                break
            time.sleep(0.2)
        assert status is Status.NO_SPACE
        assert store.batch_exists(["before"]) == [Status.MISSING]


def test_a_stopped_master_gives_unavailable_health_and_typed_statuses(
    pool_factory: Callable[..., LocalPool],
) -> None:
    pool = pool_factory(segment_size=64 * MiB)
    a = rand(1000, 3)
    with MooncakeStore(pool.config(transfer_timeout_s=2)) as store:
        assert store.health()
        pool.stop()
        start = time.monotonic()
        assert not store.health()
        assert store.batch_exists(["x"]) == [Status.UNAVAILABLE]
        assert store.batch_put(["x"], [seg(a)]) == [Status.UNAVAILABLE]
        assert store.batch_get(["x"], [seg(a)]) == [Status.UNAVAILABLE]
        assert time.monotonic() - start < 30


# -- same-host shared-memory mode ------------------------------------------------------


def test_shared_memory_round_trip_is_visible_to_tcp_clients(local_pool: LocalPool) -> None:
    data = rand(3 * MiB, 4)
    with (
        MooncakeStore(local_pool.config(), shared_memory=True) as shm,
        MooncakeStore(local_pool.config()) as tcp,
    ):
        assert shm.shared_memory and shm.requires_staging and not tcp.requires_staging
        src = shm.alloc_staging(data.nbytes)
        src[:] = data
        dst = shm.alloc_staging(data.nbytes)
        dst[:] = 0
        base = src.ctypes.data
        segs = [(base + 2 * MiB, MiB), (base, 2 * MiB)]  # out of order on purpose
        assert shm.batch_put(["shm/a"], [segs]) == [Status.OK]
        expected = np.concatenate([data[2 * MiB :], data[: 2 * MiB]])
        out = np.zeros_like(data)
        assert tcp.batch_get(["shm/a"], [seg(out)]) == [Status.OK]
        assert np.array_equal(out, expected)
        assert tcp.batch_put(["tcp/b"], [seg(data)]) == [Status.OK]
        assert shm.batch_get(["tcp/b"], [[(dst.ctypes.data, dst.nbytes)]]) == [Status.OK]
        assert np.array_equal(dst, data)
        assert shm.batch_exists(["shm/a", "nope"]) == [Status.OK, Status.MISSING]


def test_shared_memory_refuses_other_memory_as_values(local_pool: LocalPool) -> None:
    plain = rand(1000, 5)
    with MooncakeStore(local_pool.config(), shared_memory=True) as shm:
        assert shm.batch_put(["plain"], [seg(plain)]) == [Status.INVALID]
        with pytest.raises(StoreError, match="refused to register"):
            shm.register_memory(plain.ctypes.data, plain.nbytes)


def test_framed_store_over_shared_memory(local_pool: LocalPool) -> None:
    data = rand(MiB, 6)
    with FramedStore(MooncakeStore(local_pool.config(), shared_memory=True), FP) as framed:
        assert framed.requires_staging
        src, dst = framed.alloc_staging(MiB), framed.alloc_staging(MiB)
        src[:] = data
        assert framed.batch_put(["f/shm"], [seg(src)]) == [Status.OK]
        assert framed.batch_get(["f/shm"], [seg(dst)]) == [Status.OK]
        assert np.array_equal(dst, data)


@pytest.mark.parametrize("holder", ["", "master"])
def test_shared_memory_falls_back_to_tcp(
    local_pool: LocalPool, caplog: pytest.LogCaptureFixture, holder: str
) -> None:
    address = local_pool.master_address if holder == "master" else ""
    with MooncakeStore(local_pool.config(holder_address=address), shared_memory=True) as store:
        assert not store.shared_memory and not store.requires_staging
        a = rand(1000, 7)
        assert store.batch_put(["fb"], [seg(a)]) == [Status.OK]
    assert "shared memory with the holder" in caplog.text and "using tcp" in caplog.text


def test_remove_prefix_removes_only_keys_under_the_prefix(local_pool: Any) -> None:
    store = MooncakeStore(local_pool.config())
    try:
        buf = np.full(1024, 7, dtype=np.uint8)
        seg = [[(buf.ctypes.data, 1024)]]
        keys = ["kvpool/1/m/a.b/x", "kvpool/1/m/a.b/y", "kvpool/1/m/aXb/z", "x/kvpool/1/m/a.b/"]
        for k in keys:
            assert store.batch_put([k], seg) == [Status.OK]
        assert store.remove_prefix("kvpool/1/m/a.b/", force=True) == 2
        assert store.batch_exists(keys) == [Status.MISSING, Status.MISSING, Status.OK, Status.OK]
    finally:
        store.close()


def test_batches_beyond_mooncakes_segments_in_flight_all_succeed(local_pool: Any) -> None:
    """3,200 segments in one call: Mooncake's TCP transport alone fails or stalls past ~2,048."""
    objects, parts, size = 400, 8, 4096
    src = np.random.default_rng(0).integers(0, 255, objects * parts * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    with MooncakeStore(local_pool.config()) as store:
        store.register_memory(src.ctypes.data, src.nbytes)
        store.register_memory(dst.ctypes.data, dst.nbytes)
        keys = [f"segs/{i}" for i in range(objects)]

        def scatter(base: int) -> list[list[tuple[int, int]]]:
            # Every other 4 KiB piece first, so that no two segments of an object are adjacent.
            order = [*range(0, parts, 2), *range(1, parts, 2)]
            return [[(base + (i * parts + j) * size, size) for j in order] for i in range(objects)]

        started = time.monotonic()
        assert store.batch_put(keys, scatter(src.ctypes.data)) == [Status.OK] * objects
        assert store.batch_get(keys, scatter(dst.ctypes.data)) == [Status.OK] * objects
        assert time.monotonic() - started < 30
        assert np.array_equal(src, dst)
        store.batch_remove(keys, force=True)


def _minor_faults(pid: int) -> int:
    """The process's minor page faults so far (``/proc/<pid>/stat``, field 10)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2 :].split()[7])


def test_a_prefault_maps_memory_in_the_holder_reading_only_and_leaves_nothing_behind(
    local_pool: LocalPool,
) -> None:
    """``prefault``: shared memory only. The holder maps every page of the buffer
    then, not in the first get: a get of 32 MiB into a prefaulted buffer costs the
    holder under a tenth of the page faults of one into a buffer it never touched
    (8192 pages, whether this process wrote the buffer or not). It only reads (the
    buffer's bytes stay), its transient objects are gone afterwards, and a transfer
    engine built with it saves and loads the right bytes."""
    import torch

    from kvpool.pool import completed_puts, master_keys, master_metrics
    from kvpool.transfer import ChunkRef, TransferEngine

    holder = local_pool.holder_pid
    assert holder is not None
    n = 32 * MiB
    with (
        MooncakeStore(local_pool.config(), shared_memory=True) as shm,
        MooncakeStore(local_pool.config()) as tcp,
    ):
        src = shm.alloc_staging(n)
        src[:] = rand(n, 9)
        keys = [f"pf/{i}" for i in range(n // MiB)]
        assert (
            shm.batch_put(keys, [seg(src[i * MiB : (i + 1) * MiB]) for i in range(32)])
            == [Status.OK] * 32
        )
        faults = {}
        for name in ("fresh", "written", "prefaulted"):
            dst = shm.alloc_staging(n)  # never written by this process but in "written"
            if name == "written":
                dst[:] = 7  # this process's own touch does not map the holder's pages
            if name == "prefaulted":
                assert shm.prefault(dst.ctypes.data, n)
            start = _minor_faults(holder)
            got = shm.batch_get(keys, [seg(dst[i * MiB : (i + 1) * MiB]) for i in range(32)])
            faults[name] = _minor_faults(holder) - start
            assert got == [Status.OK] * 32 and np.array_equal(dst, src)
        # a fault per page, written by this process first or not: the controls
        assert min(faults["fresh"], faults["written"]) >= n // 4096, faults
        assert faults["prefaulted"] < faults["fresh"] // 10, faults
        data = shm.alloc_staging(n + 100)  # not a whole number of strides
        data[:] = rand(n + 100, 5)
        snapshot = data.copy()
        assert shm.prefault(data.ctypes.data, data.nbytes)
        assert np.array_equal(data, snapshot)  # it only reads
        assert not tcp.prefault(src.ctypes.data, n)  # TCP: nothing to do
        shm.batch_remove(keys, force=True)
        assert master_keys(local_pool.metrics_url) == []

        kv = torch.randn(16, 2, 32, 512)  # 16 blocks of 128 KiB
        puts = completed_puts(master_metrics(local_pool.metrics_url))
        engine = TransferEngine(
            FramedStore(shm, FP), [[("l0", kv)]], 16, staging_bytes=32 * MiB, prefault=True
        )
        try:
            assert engine.prefaulted.wait(30)
            chunks = [ChunkRef(f"pf/{b}", 0, b, (b,)) for b in range(4)]
            assert engine.submit_save("s", chunks)
            assert engine.wait(["s"], timeout=30)[0].ok
            before = kv[:4].clone()
            kv[:4] = 0
            engine.submit_load("l", chunks)
            assert engine.wait(["l"], timeout=30)[0].ok
            assert torch.equal(kv[:4], before)
        finally:
            engine.close()
        assert sorted(master_keys(local_pool.metrics_url)) == [c.key for c in chunks]
        # the engine's prefault: one transient put, then the 4 chunks
        assert completed_puts(master_metrics(local_pool.metrics_url)) - puts == 1 + 4


def test_a_quota_tenants_client_prefaults_256_mib_and_puts_after(
    pool_factory: Callable[..., LocalPool],
) -> None:
    """A quota tenant's holder refuses a put of over 2048 segments (a prefault of
    256 MiB in one put failed, and that tenant's engines then saved nothing in
    CI): prefault puts go 1000 touches at a time, and the client's puts after it
    land."""
    pool = pool_factory(segment_size=96 * MiB, quotas={"A": 32 * MiB, "B": 32 * MiB})
    with MooncakeStore(pool.config().for_tenant("A"), shared_memory=True) as shm:
        assert shm.shared_memory
        buf = shm.alloc_staging(256 * MiB)
        assert shm.prefault(buf.ctypes.data, buf.nbytes)
        src = shm.alloc_staging(MiB)
        src[:] = rand(MiB, 3)
        assert shm.batch_put(["after"], [seg(src)]) == [Status.OK]

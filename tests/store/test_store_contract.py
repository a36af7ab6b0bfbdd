"""The KVStore contract, run against the memory store and a real Mooncake pool.

Every test takes ``make_store(capacity)``: a fresh empty store holding about
``capacity`` bytes (a MemoryStore, or a pure Mooncake client of a fresh pool
whose holder contributes that much), with 500 ms read leases.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from tests.factories import wait_until

from kvpool import header
from kvpool.header import HEADER_SIZE, CheckFailure
from kvpool.pool import LocalPool
from kvpool.store import KVStore, Status
from kvpool.store.framed import FramedStore
from kvpool.store.memory import MemoryStore
from kvpool.store.mooncake import MooncakeStore

MiB = 1 << 20
LEASE_S = 0.5
FP = "0123456789abcdef"
OTHER_FP = "00000000000000ff"

MakeStore = Callable[..., KVStore]


@pytest.fixture(params=["memory", "mooncake"])
def make_store(
    request: pytest.FixtureRequest, pool_factory: Callable[..., LocalPool]
) -> Iterator[MakeStore]:
    stores: list[KVStore] = []

    def make(capacity: int = 64 * MiB) -> KVStore:
        store: KVStore
        if request.param == "memory":
            store = MemoryStore(capacity, lease_s=LEASE_S)
        else:
            pool = pool_factory(segment_size=capacity, lease_ttl_ms=int(LEASE_S * 1000))
            store = MooncakeStore(pool.config())
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def split(a: np.ndarray, *cuts: int) -> list[tuple[int, int]]:
    bounds = [0, *cuts, a.nbytes]
    return [(a.ctypes.data + x, y - x) for x, y in itertools.pairwise(bounds)]


def registered(store: KVStore, *arrays: np.ndarray) -> None:
    for a in arrays:
        store.register_memory(a.ctypes.data, a.nbytes)


def test_round_trip_of_multi_segment_objects_is_byte_exact(make_store: MakeStore) -> None:
    store = make_store()
    sizes = [1, 4096, 256 * 1024 + 3, 1 * MiB]
    data = [rand(n, i) for i, n in enumerate(sizes)]
    outs = [np.zeros_like(d) for d in data]
    registered(store, *data, *outs)
    keys = [f"rt/{n}" for n in sizes]
    put_segs = [split(d, len(d) // 3, len(d) // 2) if len(d) > 2 else split(d) for d in data]
    assert store.batch_put(keys, put_segs) == [Status.OK] * 4
    get_segs = [split(o, len(o) // 5) if len(o) > 1 else split(o) for o in outs]
    assert store.batch_get(keys, get_segs) == [Status.OK] * 4
    for d, o in zip(data, outs, strict=True):
        assert np.array_equal(d, o)


def test_exists_and_remove(make_store: MakeStore) -> None:
    store = make_store()
    a = rand(1000, 1)
    assert store.batch_put(["x/a", "x/b"], [split(a), split(a)]) == [Status.OK] * 2
    assert store.batch_exists(["x/a", "x/nope", "x/b"]) == [Status.OK, Status.MISSING, Status.OK]
    assert store.batch_remove(["x/a", "x/nope"], force=True) == [Status.OK, Status.MISSING]
    assert store.batch_exists(["x/a", "x/b"]) == [Status.MISSING, Status.OK]
    out = np.zeros_like(a)
    assert store.batch_get(["x/a"], [split(out)]) == [Status.MISSING]


def test_duplicate_put_keeps_the_old_value(make_store: MakeStore) -> None:
    store = make_store()
    old, new = rand(5000, 1), rand(5000, 2)
    assert store.batch_put(["dup"], [split(old)]) == [Status.OK]
    again = store.batch_put(["dup"], [split(new)])
    assert again == [Status.EXISTS if store.reports_duplicates else Status.OK]
    other_size = rand(100, 3)
    assert store.batch_put(["dup"], [split(other_size)])[0].stored
    out = np.zeros_like(old)
    assert store.batch_get(["dup"], [split(out)]) == [Status.OK]
    assert np.array_equal(out, old)


def test_remove_is_refused_during_a_read_lease_unless_forced(make_store: MakeStore) -> None:
    store = make_store()
    assert store.supports_leases
    a = rand(1000, 1)
    store.batch_put(["l/a", "l/b"], [split(a), split(a)])
    out = np.zeros_like(a)
    assert store.batch_get(["l/a"], [split(out)]) == [Status.OK]
    assert store.batch_exists(["l/b"]) == [Status.OK]
    assert store.batch_remove(["l/a", "l/b"]) == [Status.LEASED] * 2
    assert store.batch_remove(["l/a"], force=True) == [Status.OK]
    # the lease of l/b ends after LEASE_S; then a plain remove succeeds
    assert wait_until(lambda: store.batch_remove(["l/b"]) == [Status.OK], LEASE_S * 10)


def test_a_get_of_another_size_is_corrupt_never_ok(make_store: MakeStore) -> None:
    store = make_store()
    a = rand(4000, 1)
    store.batch_put(["sz"], [split(a)])
    small, big = np.zeros(3000, np.uint8), np.zeros(5000, np.uint8)
    assert store.batch_get(["sz"], [split(small)]) == [Status.CORRUPT]
    assert store.batch_get(["sz"], [split(big, 2000)]) == [Status.CORRUPT]
    exact = np.zeros_like(a)
    assert store.batch_get(["sz"], [split(exact)]) == [Status.OK]
    assert np.array_equal(exact, a)


def test_no_space_for_an_object_larger_than_the_pool(make_store: MakeStore) -> None:
    store = make_store(16 * MiB)
    chunk = rand(8 * MiB, 1)
    too_big = [(chunk.ctypes.data, chunk.nbytes)] * 3  # 24 MiB
    fits = rand(1 * MiB, 2)
    assert store.batch_put(["big", "small"], [too_big, split(fits)]) == [
        Status.NO_SPACE,
        Status.OK,
    ]
    assert store.batch_exists(["big"]) == [Status.MISSING]


def test_eviction_under_pressure_reads_missing_never_garbage(make_store: MakeStore) -> None:
    store = make_store(32 * MiB)
    n = 64  # 64 MiB into a 32 MiB pool; Mooncake evicts in the background and may
    data = [rand(MiB, i) for i in range(n)]  # refuse puts (NO_SPACE) while it catches up
    keys = [f"ev/{i}" for i in range(n)]
    puts = [store.batch_put([k], [split(d)])[0] for k, d in zip(keys, data, strict=True)]
    assert set(puts) <= {Status.OK, Status.NO_SPACE}
    # Mooncake evicts in a background thread: the get below may come before it ran.
    # A put that finds space again shows it has (asking with exists would not do:
    # it grants read leases, and leased objects are never evicted).
    probe = rand(MiB, n)
    assert wait_until(lambda: store.batch_put(["ev/probe"], [split(probe)]) == [Status.OK], 10)
    outs = [np.zeros(MiB, np.uint8) for _ in range(n)]
    results = store.batch_get(keys, [split(o) for o in outs])
    assert set(results) <= {Status.OK, Status.MISSING}
    for d, o, r in zip(data, outs, results, strict=True):
        if r is Status.OK:
            assert np.array_equal(d, o)
    evicted = [k for k, p, r in zip(keys, puts, results, strict=True) if p.ok and not r.ok]
    assert evicted, "some stored objects must have been evicted"
    assert results[0] is Status.MISSING, "the oldest object goes first"
    assert Status.OK in results


def test_malformed_entries_are_invalid_and_the_rest_proceed(make_store: MakeStore) -> None:
    store = make_store()
    a = rand(100, 1)
    assert store.batch_put(["", "m/ok", "m/zero"], [split(a), split(a), [(a.ctypes.data, 0)]]) == [
        Status.INVALID,
        Status.OK,
        Status.INVALID,
    ]
    assert store.batch_exists(["m/ok", "m/zero"]) == [Status.OK, Status.MISSING]


def test_a_closed_store_reports_unavailable_and_never_raises(make_store: MakeStore) -> None:
    store = make_store()
    a = rand(100, 1)
    store.batch_put(["c/a"], [split(a)])
    assert store.health()
    store.close()
    store.close()
    assert not store.health()
    assert store.batch_exists(["c/a"]) == [Status.UNAVAILABLE]
    assert store.batch_put(["c/b"], [split(a)]) == [Status.UNAVAILABLE]
    assert store.batch_get(["c/a"], [split(a)]) == [Status.UNAVAILABLE]
    assert store.batch_remove(["c/a"], force=True) == [Status.UNAVAILABLE]


# -- FramedStore on each backend ----------------------------------------------------


def test_framed_round_trip(make_store: MakeStore) -> None:
    framed = FramedStore(make_store(), FP)
    a = rand(3 * MiB, 7)
    out = np.zeros_like(a)
    registered(framed, a, out)
    assert framed.batch_put(["f/a"], [split(a, 100, MiB)]) == [Status.OK]
    assert framed.batch_get(["f/a"], [split(out, 5)]) == [Status.OK]
    assert np.array_equal(a, out)
    assert framed.batch_exists(["f/a"]) == [Status.OK]


def test_framed_rejects_another_fingerprint_and_a_flipped_payload_byte(
    make_store: MakeStore,
) -> None:
    raw = make_store()
    framed = FramedStore(raw, FP, checksum=True)
    payload = rand(100_000, 8)
    n = payload.nbytes

    def put_raw(key: str, hdr: bytes, body: np.ndarray) -> None:
        h = np.frombuffer(bytearray(hdr), np.uint8)
        assert raw.batch_put([key], [[(h.ctypes.data, HEADER_SIZE), *split(body)]]) == [Status.OK]

    checksum = header.payload_checksum(split(payload))
    put_raw("f/other-fp", header.pack(bytes.fromhex(OTHER_FP), "f/other-fp", n, checksum), payload)
    flipped = payload.copy()
    flipped[n // 2] ^= 0x01
    put_raw("f/flipped", header.pack(bytes.fromhex(FP), "f/flipped", n, checksum), flipped)
    put_raw("f/other-key", header.pack(bytes.fromhex(FP), "f/elsewhere", n, checksum), payload)
    put_raw("f/good", header.pack(bytes.fromhex(FP), "f/good", n, checksum), payload)

    keys = ["f/other-fp", "f/flipped", "f/other-key", "f/good"]
    outs = [np.zeros_like(payload) for _ in keys]
    assert framed.batch_get(keys, [split(o) for o in outs]) == [
        Status.CORRUPT,
        Status.CORRUPT,
        Status.CORRUPT,
        Status.OK,
    ]
    assert np.array_equal(outs[3], payload)
    assert framed.corrupt_counts == {
        CheckFailure.FINGERPRINT: 1,
        CheckFailure.CHECKSUM: 1,
        CheckFailure.KEY: 1,
    }
    framed.close()

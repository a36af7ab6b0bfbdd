"""MemoryStore specifics and the KVStore base (validation, sub-batching, factory).

The semantics it shares with Mooncake are tested for both in
tests/store/test_store_contract.py.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from kvpool.errors import ConfigError, StoreUnavailable
from kvpool.store import KVStore, Segments, Status, open_store, register_store, store_names
from kvpool.store import base as store_base
from kvpool.store.memory import MemoryStore


class Clock:
    """A settable clock for leases."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def buf(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def whole(a: np.ndarray) -> list[tuple[int, int]]:
    return [(a.ctypes.data, a.nbytes)]


def test_evicts_oldest_first_and_evicted_keys_read_missing() -> None:
    store = MemoryStore(capacity=300)
    data = [buf(100, i) for i in range(5)]
    assert store.batch_put([f"k{i}" for i in range(5)], [whole(d) for d in data]) == [Status.OK] * 5
    assert store.keys() == ["k2", "k3", "k4"]
    assert store.evictions == 2 and store.used_bytes == 300
    out = np.zeros(100, dtype=np.uint8)
    assert store.batch_get(["k0", "k4"], [whole(out), whole(out)]) == [
        Status.MISSING,
        Status.OK,
    ]
    assert np.array_equal(out, data[4])


def test_pinned_objects_are_evicted_after_unpinned_ones_until_their_pin_ends() -> None:
    clock = Clock()
    store = MemoryStore(capacity=300, clock=clock)
    d = [whole(buf(100, i)) for i in range(6)]
    assert store.batch_put(["p0"], d[:1], pin_ms=10_000) == [Status.OK]
    assert store.batch_put(["k1", "k2", "k3"], d[1:4]) == [Status.OK] * 3
    assert store.keys() == ["p0", "k2", "k3"]  # k1 went, not the older pinned p0
    assert store.pinned("p0") and not store.pinned("k2")
    assert store.batch_put(["p4", "p5"], d[4:6], pin_ms=10_000) == [Status.OK] * 2
    assert store.keys() == ["p0", "p4", "p5"]
    assert store.batch_put(["k6"], d[:1]) == [Status.OK]  # all pinned: oldest pin goes
    assert store.keys() == ["p4", "p5", "k6"]
    clock.now = 11.0  # the pins ended: plain oldest-first again
    assert not store.pinned("p4")
    assert store.batch_put(["k7"], d[:1]) == [Status.OK]
    assert store.keys() == ["p5", "k6", "k7"]


def test_leased_objects_are_not_evicted_and_may_cause_no_space() -> None:
    clock = Clock()
    store = MemoryStore(capacity=200, lease_s=1.0, clock=clock)
    a, b, c = buf(100, 1), buf(100, 2), buf(100, 3)
    store.batch_put(["a", "b"], [whole(a), whole(b)])
    assert store.batch_exists(["a"]) == [Status.OK]  # grants a lease on a
    assert store.batch_put(["c"], [whole(c)]) == [Status.OK]
    assert store.keys() == ["a", "c"]  # b (unleased) went, a stayed
    store.batch_exists(["c"])
    assert store.batch_put(["d"], [whole(a)]) == [Status.NO_SPACE]  # both leased
    assert store.keys() == ["a", "c"]
    clock.now = 1.5
    assert store.batch_put(["d"], [whole(a)]) == [Status.OK]


def test_lease_refuses_remove_until_it_ends_or_force() -> None:
    clock = Clock()
    store = MemoryStore(lease_s=0.5, clock=clock)
    a = buf(10)
    store.batch_put(["a", "b"], [whole(a), whole(a)])
    assert store.batch_remove(["a"]) == [Status.OK]  # never read: no lease
    store.batch_get(["b"], [whole(np.zeros(10, np.uint8))])
    assert store.batch_remove(["b"]) == [Status.LEASED]
    clock.now = 0.6
    assert store.batch_remove(["b"]) == [Status.OK]
    assert store.supports_leases and not MemoryStore().supports_leases


def test_without_leases_remove_is_never_refused() -> None:
    store = MemoryStore()
    a = buf(10)
    store.batch_put(["a"], [whole(a)])
    store.batch_exists(["a"])
    assert store.batch_remove(["a"]) == [Status.OK]


def test_inject_and_tamper_hooks() -> None:
    store = MemoryStore()
    a = buf(10)
    store.inject("x", Status.TRANSFER_FAILED)
    assert store.batch_put(["x", "y"], [whole(a), whole(a)]) == [
        Status.TRANSFER_FAILED,
        Status.OK,
    ]
    store.inject("x", None)
    assert store.batch_put(["x"], [whole(a)]) == [Status.OK]
    store.tamper("x", 3)
    out = np.zeros(10, np.uint8)
    store.batch_get(["x"], [whole(out)])
    assert out[3] == a[3] ^ 0xFF and np.array_equal(np.delete(out, 3), np.delete(a, 3))


def test_require_registration_refuses_unregistered_segments() -> None:
    store = MemoryStore(require_registration=True)
    assert store.requires_registration
    a = buf(100)
    assert store.batch_put(["a"], [whole(a)]) == [Status.INVALID]
    store.register_memory(a.ctypes.data, 100)
    assert store.batch_put(["a"], [[(a.ctypes.data + 10, 90)]]) == [Status.OK]
    assert store.batch_put(["b"], [[(a.ctypes.data + 10, 91)]]) == [Status.INVALID]
    store.unregister_memory(a.ctypes.data)
    assert store.batch_put(["c"], [whole(a)]) == [Status.INVALID]


def test_malformed_entries_are_invalid_and_do_not_disturb_others() -> None:
    store = MemoryStore()
    a = buf(8)
    seg = whole(a)
    keys = ["", "ok", "zero", "neg", "null"]
    segs: list[Segments] = [seg, seg, [(a.ctypes.data, 0)], [(a.ctypes.data, -1)], [(0, 8)]]
    assert store.batch_put(keys, segs) == [Status.INVALID, Status.OK, *[Status.INVALID] * 3]
    assert store.batch_put(["empty"], [[]]) == [Status.INVALID]
    assert store.batch_exists(["", "ok"]) == [Status.INVALID, Status.OK]
    with pytest.raises(TypeError, match="equal lengths"):
        store.batch_get(["ok"], [])


class Recording(MemoryStore):
    """Records the batch sizes the base hands to the backend."""

    max_batch = max_key_batch = 2

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def _exists(self, keys: Sequence[str]) -> list[Status]:
        self.calls.append(len(keys))
        return super()._exists(keys)


def test_large_batches_are_split_and_results_keep_input_order() -> None:
    store = Recording()
    a = buf(4)
    store.batch_put(["k1", "k3"], [whole(a), whole(a)])
    assert store.batch_exists(["k0", "k1", "", "k3", "k4"]) == [
        Status.MISSING,
        Status.OK,
        Status.INVALID,
        Status.OK,
        Status.MISSING,
    ]
    assert store.calls == [2, 2]  # the invalid key never reached the backend
    assert store.batch_exists([]) == []


def test_closed_store_answers_unavailable_per_key() -> None:
    a = buf(4)
    with MemoryStore() as store:
        store.batch_put(["a"], [whole(a)])
        assert store.health()
    assert store.closed and not store.health()
    assert store.batch_exists(["a", "b"]) == [Status.UNAVAILABLE] * 2
    assert store.batch_get(["a"], [whole(a)]) == [Status.UNAVAILABLE]
    assert store.batch_remove(["a"], force=True) == [Status.UNAVAILABLE]
    store.close()  # idempotent
    with pytest.raises(StoreUnavailable, match="closed"):
        store.register_memory(a.ctypes.data, 4)


def test_concurrent_puts_and_gets_stay_consistent() -> None:
    store = MemoryStore(capacity=1 << 24)
    errors: list[str] = []

    def worker(t: int) -> None:
        for i in range(50):
            a = buf(1000, t * 1000 + i)
            key = f"t{t}/{i}"
            if store.batch_put([key], [whole(a)]) != [Status.OK]:
                errors.append(f"put {key}")
            out = np.zeros(1000, np.uint8)
            if store.batch_get([key], [whole(out)]) != [Status.OK] or not np.array_equal(a, out):
                errors.append(f"get {key}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == [] and len(store.keys()) == 400


def test_status_properties() -> None:
    assert Status.OK.stored and Status.EXISTS.stored and not Status.MISSING.stored
    assert Status.OK.ok and not Status.EXISTS.ok
    assert Status.TRANSFER_FAILED.transient and not Status.INVALID.transient
    assert not Status.CORRUPT.transient


def test_factory_builds_by_name_and_refuses_unknown_or_duplicate_names() -> None:
    store = open_store("memory", capacity=1000, lease_s=0.1)
    assert isinstance(store, MemoryStore) and store.capacity == 1000
    assert isinstance(store, KVStore)
    assert {"memory", "mooncake"} <= set(store_names())
    with pytest.raises(ConfigError, match=r"unknown store 'nope'.*memory"):
        open_store("nope")
    with pytest.raises(ValueError, match="registered already"):
        register_store("memory", "x", "Y")


def test_importing_the_store_package_imports_no_backend() -> None:
    code = (
        "import sys, kvpool.store, kvpool.store.framed, kvpool.store.mooncake, kvpool.header\n"
        "print(sorted({'mooncake', 'torch', 'zmq', 'click', 'rich'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_alloc_staging_gives_registered_memory_until_close() -> None:
    store = MemoryStore(require_registration=True)
    assert not store.requires_staging
    buf = store.alloc_staging(4096)
    buf[:] = 7
    assert store.batch_put(["s"], [[(buf.ctypes.data + 96, 4000)]]) == [Status.OK]
    store.close()
    with pytest.raises(StoreUnavailable):
        store.alloc_staging(10)


def test_numpy_integers_are_invalid_and_the_reason_is_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_base, "_reported", set())  # forget earlier tests' reports
    store = MemoryStore()
    a = buf(8)
    seg = [(np.int64(a.ctypes.data), 8)]
    with caplog.at_level(logging.WARNING, logger="kvpool.store.base"):
        assert store.batch_put(["np1", "np2"], [seg, seg]) == [Status.INVALID] * 2  # type: ignore[list-item]
    assert caplog.text.count("must be Python ints: got (int64, int)") == 1


_SEGMENT_CASES: list[object] = [
    [(8, 8)],
    ((8, 8), (16, 0)),
    [(8, 0)],
    [(8, -1)],
    [(0, 8)],
    [(-8, 8)],
    [[8, 8]],
    [(8, 8, 8)],
    [(8,)],
    [(8, 8), (16, 8, 1)],
    [(8, 8), (16,)],
    [(True, 8)],
    [(8, True)],
    [(8.0, 8)],
    [(8, 8.0)],
    [(np.int64(8), 8)],
    [],
    (),
    [(8, 2**70)],
    [(2**70, 8)],
    "ab",
    None,
]


@pytest.mark.parametrize("segments", _SEGMENT_CASES, ids=repr)
def test_the_fast_segment_check_agrees_with_the_full_one(segments: object) -> None:
    """``_plainly_valid`` may only say yes where the full loop finds nothing wrong."""
    from kvpool.store import base, scatter

    full = base._malformed("k", segments)
    if isinstance(segments, list | tuple) and segments:
        fast_yes = scatter._plainly_valid(segments)
        assert not fast_yes or full is None, segments
        if all(type(s) is tuple for s in segments):
            assert fast_yes == (full is None), segments

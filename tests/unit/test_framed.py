"""FramedStore over the memory store: headers are written, checked, and never leak."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import numpy as np
import pytest

from kvpool import header
from kvpool.header import HEADER_SIZE, CheckFailure
from kvpool.store import Status
from kvpool.store.framed import FramedStore
from kvpool.store.memory import MemoryStore

FP = "0123456789abcdef"
OTHER_FP = "fedcba9876543210"


def buf(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def split(a: np.ndarray, *cuts: int) -> list[tuple[int, int]]:
    bounds = [0, *cuts, a.nbytes]
    return [(a.ctypes.data + x, y - x) for x, y in itertools.pairwise(bounds)]


@pytest.fixture
def inner() -> MemoryStore:
    return MemoryStore(capacity=1 << 24, require_registration=False)


@pytest.fixture
def framed(inner: MemoryStore) -> FramedStore:
    return FramedStore(inner, FP, checksum=True)


def stored_bytes(inner: MemoryStore, key: str, n: int) -> np.ndarray:
    out = np.zeros(n, np.uint8)
    assert inner.batch_get([key], [[(out.ctypes.data, n)]]) == [Status.OK]
    return out


def test_round_trip_with_different_segmentations(framed: FramedStore) -> None:
    a = buf(10_000, 1)
    assert framed.batch_put(["k"], [split(a, 10, 4000)]) == [Status.OK]
    out = np.zeros_like(a)
    assert framed.batch_get(["k"], [split(out, 1, 2, 9999)]) == [Status.OK]
    assert np.array_equal(a, out)


def test_the_header_is_stored_first_and_describes_the_payload(
    inner: MemoryStore, framed: FramedStore
) -> None:
    a = buf(300, 2)
    before = int(time.time() * 1000)
    framed.batch_put(["k"], [split(a, 100)])
    after = int(time.time() * 1000)
    raw = stored_bytes(inner, "k", HEADER_SIZE + 300)
    h = header.unpack(raw.tobytes())
    assert before <= h.written_ms <= after  # the put's wall-clock time
    assert header.written_at(raw.tobytes(), bytes.fromhex(FP), "k") == h.written_ms
    assert h.fingerprint == bytes.fromhex(FP) and h.payload_len == 300
    assert h.key_digest == header.key_digest("k")
    assert h.checksum == header.payload_checksum([(a.ctypes.data, a.nbytes)]) and h.has_checksum
    assert np.array_equal(raw[HEADER_SIZE:], a)


def test_checksum_off_writes_no_checksum(inner: MemoryStore) -> None:
    framed = FramedStore(inner, FP, checksum=False)
    a = buf(50)
    framed.batch_put(["k"], [split(a)])
    h = header.unpack(stored_bytes(inner, "k", HEADER_SIZE + 50).tobytes())
    assert not h.has_checksum and h.checksum == 0


@pytest.mark.parametrize(
    ("offset", "cause"),
    [
        (0, CheckFailure.MAGIC),
        (4, CheckFailure.VERSION),
        (7, CheckFailure.FLAGS),
        (9, CheckFailure.FINGERPRINT),
        (20, CheckFailure.KEY),
        (30, CheckFailure.LENGTH),
        (35, CheckFailure.CHECKSUM),
        (50, CheckFailure.RESERVED),
        (HEADER_SIZE + 123, CheckFailure.CHECKSUM),  # a payload byte
    ],
)
def test_a_flipped_byte_reads_corrupt_with_its_cause(
    inner: MemoryStore, framed: FramedStore, offset: int, cause: CheckFailure
) -> None:
    a = buf(1000, 3)
    framed.batch_put(["k", "good"], [split(a), split(a)])
    inner.tamper("k", offset)
    out, out2 = np.zeros_like(a), np.zeros_like(a)
    assert framed.batch_get(["k", "good"], [split(out), split(out2)]) == [
        Status.CORRUPT,
        Status.OK,
    ]
    assert framed.corrupt_counts == {cause: 1}


def test_a_verifying_reader_refuses_objects_written_without_checksum(inner: MemoryStore) -> None:
    """Checksums on insists on them: an object of a checksum-off writer is a miss
    (MISMATCH, not damage: it stays), never a read whose verification was skipped."""
    writer = FramedStore(inner, FP, checksum=False)
    a = buf(64)
    writer.batch_put(["k"], [split(a)])
    out = np.zeros_like(a)
    reader = FramedStore(inner, FP, checksum=True)
    assert reader.batch_get(["k"], [split(out)]) == [Status.MISMATCH]
    assert reader.corrupt_counts == {CheckFailure.NO_CHECKSUM: 1}
    # A reader without verification takes it; the writer's own reads too.
    lax = FramedStore(inner, FP, checksum=False)
    assert lax.batch_get(["k"], [split(out)]) == [Status.OK]
    assert np.array_equal(out, a)


def test_object_written_under_another_fingerprint_reads_corrupt(inner: MemoryStore) -> None:
    writer = FramedStore(inner, OTHER_FP)
    reader = FramedStore(inner, FP)
    a = buf(64)
    writer.batch_put(["k"], [split(a)])
    out = np.zeros_like(a)
    assert reader.batch_get(["k"], [split(out)]) == [Status.CORRUPT]
    assert reader.corrupt_counts == {CheckFailure.FINGERPRINT: 1}


def test_object_stored_under_another_key_reads_corrupt(
    inner: MemoryStore, framed: FramedStore
) -> None:
    a = buf(64)
    framed.batch_put(["a"], [split(a)])
    raw = stored_bytes(inner, "a", HEADER_SIZE + 64)
    inner.batch_put(["b"], [[(raw.ctypes.data, raw.nbytes)]])  # copied under another key
    out = np.zeros_like(a)
    assert framed.batch_get(["b"], [split(out)]) == [Status.CORRUPT]
    assert framed.corrupt_counts == {CheckFailure.KEY: 1}


def test_a_read_of_another_size_reads_corrupt(framed: FramedStore) -> None:
    a = buf(64)
    framed.batch_put(["k"], [split(a)])
    small, big = np.zeros(63, np.uint8), np.zeros(65, np.uint8)  # distinct destinations
    assert framed.batch_get(["k", "k"], [split(small), split(big)]) == [Status.CORRUPT] * 2
    assert framed.corrupt_counts == {CheckFailure.LENGTH: 2}


def test_verify_off_skips_only_the_checksum(inner: MemoryStore) -> None:
    framed = FramedStore(inner, FP, checksum=True, verify=False)
    a = buf(100)
    framed.batch_put(["k"], [split(a)])
    inner.tamper("k", HEADER_SIZE + 5)
    out = np.zeros_like(a)
    assert framed.batch_get(["k"], [split(out)]) == [Status.OK]  # payload not verified
    inner.tamper("k", 10)  # a fingerprint byte is still checked
    assert framed.batch_get(["k"], [split(out)]) == [Status.CORRUPT]


def test_each_cause_is_logged_once(
    inner: MemoryStore, framed: FramedStore, caplog: pytest.LogCaptureFixture
) -> None:
    a = buf(100)
    keys = ["a", "b", "c"]
    framed.batch_put(keys, [split(a)] * 3)
    for k in keys:
        inner.tamper(k, HEADER_SIZE)
    outs = [np.zeros_like(a) for _ in keys]
    with caplog.at_level(logging.WARNING, logger="kvpool.store.framed"):
        assert framed.batch_get(keys, [split(o) for o in outs]) == [Status.CORRUPT] * 3
        framed.batch_get(["a"], [split(outs[0])])
    assert len(caplog.records) == 1 and "payload checksum mismatch" in caplog.text
    assert framed.corrupt_counts[CheckFailure.CHECKSUM] == 4


def test_failures_of_the_inner_store_pass_through(inner: MemoryStore, framed: FramedStore) -> None:
    a = buf(10)
    inner.inject("bad", Status.TRANSFER_FAILED)
    assert framed.batch_put(["bad", "k"], [split(a), split(a)]) == [
        Status.TRANSFER_FAILED,
        Status.OK,
    ]
    assert framed.batch_put(["k"], [split(a)]) == [Status.EXISTS]
    assert framed.reports_duplicates
    out = np.zeros_like(a)
    assert framed.batch_get(["missing"], [split(out)]) == [Status.MISSING]
    assert framed.batch_exists(["k", "missing"]) == [Status.OK, Status.MISSING]
    assert framed.batch_remove(["k", "missing"]) == [Status.OK, Status.MISSING]
    assert framed.corrupt_counts == {}


def test_batches_larger_than_the_arena_and_concurrent_callers(inner: MemoryStore) -> None:
    framed = FramedStore(inner, FP, slots=4)
    data = {f"k{i}": buf(200, i) for i in range(40)}
    errors: list[str] = []

    def worker(names: list[str]) -> None:
        if framed.batch_put(names, [split(data[k], 50) for k in names]) != [Status.OK] * len(names):
            errors.append("put")
        outs = [np.zeros(200, np.uint8) for _ in names]
        if framed.batch_get(names, [split(o, 7) for o in outs]) != [Status.OK] * len(names):
            errors.append("get")
        errors.extend(k for k, o in zip(names, outs, strict=True) if not np.array_equal(o, data[k]))

    names = sorted(data)
    threads = [threading.Thread(target=worker, args=(names[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(framed._free) == [0, 1, 2, 3]  # every slot came back


def test_close_closes_the_inner_store(inner: MemoryStore) -> None:
    with FramedStore(inner, FP) as framed:
        assert framed.health()
    assert inner.closed and not framed.health()
    assert framed.batch_exists(["k"]) == [Status.UNAVAILABLE]


def test_arena_is_registered_with_the_inner_store() -> None:
    inner = MemoryStore(require_registration=True)
    framed = FramedStore(inner, FP)
    a = buf(100)
    assert framed.batch_put(["k"], [split(a)]) == [Status.INVALID]  # payload not registered
    framed.register_memory(a.ctypes.data, a.nbytes)
    assert framed.batch_put(["k"], [split(a)]) == [Status.OK]
    out = np.zeros_like(a)
    framed.register_memory(out.ctypes.data, out.nbytes)
    assert framed.batch_get(["k"], [split(out)]) == [Status.OK] and np.array_equal(a, out)


class _SliceCounter(MemoryStore):
    """Records how many scatter segments each object travels in."""

    def __init__(self) -> None:
        super().__init__(capacity=1 << 24, require_registration=False)
        self.segments: list[int] = []

    def _put(self, keys, segments):  # type: ignore[no-untyped-def]
        self.segments += [len(s) for s in segments]
        return super()._put(keys, segments)

    def _get(self, keys, segments):  # type: ignore[no-untyped-def]
        self.segments += [len(s) for s in segments]
        return super()._get(keys, segments)


def test_a_small_first_segment_travels_in_the_header_slot_as_the_same_object() -> None:
    inner = _SliceCounter()
    inline = FramedStore(inner, FP, checksum=True, inline_bytes=4096)
    plain = FramedStore(inner, FP, checksum=True, inline_bytes=0)
    a = buf(20_000, 7)
    inline.batch_put(["small-first"], [split(a, 1000, 9000)])  # 1000 <= 4096: inlined
    inline.batch_put(["big-first"], [split(a, 5000, 9000)])  # 5000 > 4096: not inlined
    plain.batch_put(["plain"], [split(a, 1000, 9000)])
    assert inner.segments == [3, 4, 4]  # header + 1000 bytes in one segment
    n = HEADER_SIZE + a.nbytes
    stored = {k: stored_bytes(inner, k, n) for k in ("small-first", "big-first", "plain")}
    assert all(np.array_equal(v[HEADER_SIZE:], a) for v in stored.values())
    # the same format whichever way it travelled: each store reads the other's objects
    for reader, key in ((plain, "small-first"), (inline, "plain"), (inline, "big-first")):
        out = np.zeros_like(a)
        inner.segments.clear()
        assert reader.batch_get([key], [split(out, 1000, 2000)]) == [Status.OK]
        assert np.array_equal(out, a), key
        assert inner.segments == [3 if reader is inline else 4]


def test_a_flipped_byte_in_an_inlined_segment_reads_corrupt(inner: MemoryStore) -> None:
    framed = FramedStore(inner, FP, checksum=True, inline_bytes=4096)
    a = buf(8000, 8)
    framed.batch_put(["k"], [split(a, 100)])
    raw = stored_bytes(inner, "k", HEADER_SIZE + a.nbytes)
    raw[HEADER_SIZE + 50] ^= 1  # inside the inlined first segment
    inner.batch_remove(["k"], force=True)
    inner.batch_put(["k"], [[(raw.ctypes.data, raw.nbytes)]])
    out = np.zeros_like(a)
    assert framed.batch_get(["k"], [split(out, 100)]) == [Status.CORRUPT]
    assert framed.corrupt_counts[CheckFailure.CHECKSUM] == 1


def test_inline_slots_shrink_to_the_inline_arena(inner: MemoryStore) -> None:
    framed = FramedStore(inner, FP, inline_bytes=1 << 20)
    assert framed.max_batch == 16  # at least 16 slots, even of 1 MiB
    framed = FramedStore(inner, FP, inline_bytes=64 << 10)
    assert framed.max_batch == FramedStore.INLINE_ARENA // (HEADER_SIZE + (64 << 10))
    with pytest.raises(ValueError, match="inline_bytes"):
        FramedStore(inner, FP, inline_bytes=-1)


SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))


def _forge(inner: MemoryStore, key: str, raw: np.ndarray) -> None:
    """What anyone on the pool network can do: replace a live key's bytes."""
    inner.batch_remove([key], force=True)
    inner.batch_put([key], [[(raw.ctypes.data, raw.nbytes)]])


def test_a_pool_secret_signs_objects_and_a_reader_with_it_reads_them(inner: MemoryStore) -> None:
    writer = FramedStore(inner, FP, secret=SECRET, inline_bytes=4096)
    a = buf(9000, 11)
    assert writer.batch_put(["k"], [split(a, 100, 5000)]) == [Status.OK]
    h = header.unpack(stored_bytes(inner, "k", HEADER_SIZE + a.nbytes).tobytes())
    assert h.signed and h.has_checksum and h.signature != bytes(16)
    for reader in (
        FramedStore(inner, FP, secret=SECRET, inline_bytes=0),
        FramedStore(inner, FP),  # a reader without a secret ignores signatures
    ):
        out = np.zeros_like(a)
        assert reader.batch_get(["k"], [split(out, 7)]) == [Status.OK]
        assert np.array_equal(out, a)
        assert not reader.corrupt_counts


@pytest.mark.parametrize("forger", ["no secret", "other secret"])
def test_an_object_forged_under_a_live_key_is_refused_and_counted(
    inner: MemoryStore, forger: str
) -> None:
    """A forger without the secret writes a well-formed object (right fingerprint,
    key digest, length and checksum) under a key the pool's engines use: a reader
    with the secret refuses it as FORGED, counted by cause; the honest object and
    the forged one read differently only in that verdict."""
    honest = FramedStore(inner, FP, secret=SECRET)
    a = buf(2000, 12)
    honest.batch_put(["live", "other"], [split(a), split(a)])
    elsewhere = MemoryStore(capacity=1 << 20, require_registration=False)
    evil = FramedStore(elsewhere, FP, secret=None if forger == "no secret" else OTHER_SECRET)
    bad = a.copy()
    bad[:16] = 0
    evil.batch_put(["live"], [split(bad)])
    _forge(inner, "live", stored_bytes(elsewhere, "live", HEADER_SIZE + bad.nbytes))
    out, out2 = np.zeros_like(a), np.zeros_like(a)
    assert honest.batch_get(["live", "other"], [split(out), split(out2)]) == [
        Status.FORGED,
        Status.OK,
    ]
    cause = CheckFailure.UNSIGNED if forger == "no secret" else CheckFailure.FORGED
    assert honest.corrupt_counts == {cause: 1}
    assert np.array_equal(out2, a)


def test_a_signed_object_copied_to_another_key_or_altered_is_forged(inner: MemoryStore) -> None:
    """The signature covers the key itself and every payload byte: an honest object
    copied under another key (its key digest patched to match) or with a payload
    byte changed and its xxh3 checksum recomputed, reads FORGED."""
    framed = FramedStore(inner, FP, secret=SECRET)
    a = buf(512, 13)
    framed.batch_put(["a", "c"], [split(a), split(a)])
    moved = stored_bytes(inner, "a", HEADER_SIZE + a.nbytes)
    moved[16:24] = np.frombuffer(header.key_digest("b").to_bytes(8, "little"), np.uint8)
    inner.batch_put(["b"], [[(moved.ctypes.data, moved.nbytes)]])
    altered = stored_bytes(inner, "c", HEADER_SIZE + a.nbytes)
    altered[HEADER_SIZE + 5] ^= 0xFF
    payload = altered[HEADER_SIZE:]
    checksum = header.payload_checksum([(payload.ctypes.data, payload.nbytes)])
    altered[32:40] = np.frombuffer(checksum.to_bytes(8, "little"), np.uint8)
    _forge(inner, "c", altered)
    out = np.zeros_like(a)
    assert framed.batch_get(["b"], [split(out)]) == [Status.FORGED]
    assert framed.batch_get(["c"], [split(out)]) == [Status.FORGED]
    assert framed.corrupt_counts == {CheckFailure.FORGED: 2}


def test_an_empty_secret_is_refused(inner: MemoryStore) -> None:
    with pytest.raises(ValueError, match="secret"):
        FramedStore(inner, FP, secret=b"")


def test_a_deferred_get_checks_all_but_the_checksum_and_leaves_that_to_its_check(
    inner: MemoryStore, framed: FramedStore
) -> None:
    """``batch_get_deferred``: header damage, a missing object and an object without
    checksum answer at once, as ``batch_get`` does; a damaged payload reads OK until
    the returned check runs, which names it (by its index in the call) and counts it."""
    a, b, c = buf(3000, 11), buf(3000, 12), buf(3000, 13)
    framed.batch_put(["a", "b", "c", "hdr"], [split(a), split(b), split(c), split(a)])
    FramedStore(inner, FP, checksum=False).batch_put(["plain"], [split(a)])
    inner.tamper("c", HEADER_SIZE + 2999)  # the payload's last byte
    inner.tamper("hdr", 20)  # the key digest
    keys = ["gone", "a", "c", "hdr", "plain", "b"]
    outs = [np.zeros(3000, np.uint8) for _ in keys]
    statuses, check = framed.batch_get_deferred(keys, [split(o, 1000) for o in outs])
    assert statuses == [
        Status.MISSING,
        Status.OK,
        Status.OK,  # not checked yet
        Status.CORRUPT,
        Status.MISMATCH,
        Status.OK,
    ]
    assert framed.corrupt_counts == {CheckFailure.KEY: 1, CheckFailure.NO_CHECKSUM: 1}
    assert check is not None
    assert check.failed() == [2]
    assert framed.corrupt_counts[CheckFailure.CHECKSUM] == 1
    assert np.array_equal(outs[1], a) and np.array_equal(outs[5], b)


def test_a_deferred_get_of_sound_objects_leaves_a_check_that_passes(framed: FramedStore) -> None:
    objs = [buf(70_000 + i, i) for i in range(5)]  # past one hashing slice
    keys = [f"k{i}" for i in range(5)]
    framed.batch_put(keys, [split(o, 5) for o in objs])
    outs = [np.zeros_like(o) for o in objs]
    statuses, check = framed.batch_get_deferred(keys, [split(o, 40_000) for o in outs])
    assert statuses == [Status.OK] * 5 and check is not None
    assert check.failed() == []
    assert not framed.corrupt_counts
    assert all(np.array_equal(o, x) for o, x in zip(objs, outs, strict=True))


def test_without_verification_or_with_a_secret_a_deferred_get_checks_everything_itself(
    inner: MemoryStore,
) -> None:
    """Nothing to defer without verification; with a pool secret the signature reads
    the payload anyway, so the get checks it all (a damaged payload: CORRUPT at once)."""
    a = buf(500, 4)
    lax = FramedStore(inner, FP, checksum=False)
    lax.batch_put(["k"], [split(a)])
    out = np.zeros_like(a)
    assert lax.batch_get_deferred(["k"], [split(out)]) == ([Status.OK], None)
    secret = bytes(range(32))
    signed = FramedStore(inner, FP, secret=secret)
    signed.batch_put(["s"], [split(a)])
    inner.tamper("s", HEADER_SIZE + 7)
    assert signed.batch_get_deferred(["s"], [split(out)]) == ([Status.CORRUPT], None)
    assert signed.corrupt_counts == {CheckFailure.CHECKSUM: 1}

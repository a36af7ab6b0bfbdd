"""Object header: round trips, and every single-field corruption is named."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from tests.factories import key_space

from kvpool import header
from kvpool.errors import HeaderError
from kvpool.header import HEADER_SIZE, CheckFailure, Header, check, pack, unpack
from kvpool.layout import Layout

FP = bytes.fromhex("0123456789abcdef")
fingerprints = st.binary(min_size=8, max_size=8)
keys = st.text(min_size=1, max_size=200)
lengths = st.integers(min_value=0, max_value=2**64 - 1)
checksums = st.none() | st.integers(min_value=0, max_value=2**64 - 1)

# Byte ranges of each field, and the failure a change there must produce.
_FIELDS = [
    (range(0, 4), CheckFailure.MAGIC),
    (range(4, 6), CheckFailure.VERSION),
    (range(6, 8), CheckFailure.FLAGS),
    (range(8, 16), CheckFailure.FINGERPRINT),
    (range(16, 24), CheckFailure.KEY),
    (range(24, 32), CheckFailure.LENGTH),
    (range(32, 40), CheckFailure.CHECKSUM),
    (range(40, 56), CheckFailure.RESERVED),  # signature bytes of an unsigned header
    (range(56, 64), None),  # the write time: advisory, any value reads
]


def _segments(data: np.ndarray, cuts: list[int]) -> list[tuple[int, int]]:
    bounds = [0, *sorted(c % (data.nbytes + 1) for c in cuts), data.nbytes]
    return [(data.ctypes.data + a, b - a) for a, b in itertools.pairwise(bounds)]


def test_header_is_64_bytes_and_starts_with_magic() -> None:
    raw = pack(FP, "k", 10, 7)
    assert HEADER_SIZE == 64 and len(raw) == 64
    assert raw[:4] == b"KVPL"
    assert raw[40:] == bytes(24)
    stamped = pack(FP, "k", 10, 7, written_ms=1_765_000_000_000)
    assert stamped[:56] == raw[:56] and stamped[56:] != bytes(8)
    assert unpack(stamped).written_ms == 1_765_000_000_000


def test_written_at_reads_the_time_of_this_keys_header_only() -> None:
    stamped = pack(FP, "k", 10, 7, written_ms=123_456)
    assert header.written_at(stamped, FP, "k") == 123_456
    assert header.written_at(stamped + b"payload", FP, "k") == 123_456
    assert header.written_at(stamped, FP, "other") is None  # another key's object
    assert header.written_at(stamped, bytes(8), "k") is None  # another config's
    assert header.written_at(pack(FP, "k", 10, 7), FP, "k") is None  # no time said
    assert header.written_at(stamped[:63], FP, "k") is None  # too short
    old = bytearray(stamped)
    old[4] = 2  # format 2 had no time there
    assert header.written_at(bytes(old), FP, "k") is None


@given(fingerprints, keys, lengths, checksums)
def test_pack_unpack_round_trip(fp: bytes, key: str, n: int, cs: int | None) -> None:
    h = unpack(pack(fp, key, n, cs))
    assert h == Header(fp, header.key_digest(key), n, cs or 0, 1 if cs is not None else 0)
    assert h.has_checksum is (cs is not None)
    assert check(h, fp, key, n, cs) is None


@given(fingerprints, keys, lengths, checksums, st.integers(0, 100))
def test_pack_into_writes_the_same_bytes(
    fp: bytes, key: str, n: int, cs: int | None, offset: int
) -> None:
    buf = bytearray(offset + HEADER_SIZE + 3)
    header.pack_into(buf, offset, fp, key, n, cs)
    assert bytes(buf[offset : offset + HEADER_SIZE]) == pack(fp, key, n, cs)
    assert unpack(buf, offset) == unpack(pack(fp, key, n, cs))


@given(
    fingerprints,
    keys,
    st.binary(min_size=1, max_size=300),
    st.booleans(),
    st.integers(0, 63),
    st.integers(0, 7),
)
def test_every_single_bit_flip_is_detected_and_named(
    fp: bytes, key: str, payload: bytes, with_checksum: bool, byte: int, bit: int
) -> None:
    real = xxhash.xxh3_64_intdigest(payload)
    raw = bytearray(pack(fp, key, len(payload), real if with_checksum else None))
    raw[byte] ^= 1 << bit
    failure = check(unpack(raw), fp, key, len(payload), real)
    expected = next(f for r, f in _FIELDS if byte in r)
    if byte == 6 and bit == 0:  # the checksum flag itself
        # on -> off leaves a checksum without its flag; off -> on claims checksum 0
        expected = CheckFailure.FLAGS if with_checksum else CheckFailure.CHECKSUM
    elif byte == 6 and bit == 1:  # the signed flag: a signature of zeros is no signature
        expected = CheckFailure.FLAGS
    elif 32 <= byte < 40 and not with_checksum:
        expected = CheckFailure.FLAGS  # a checksum value without the flag
    assert failure is expected


@given(fingerprints, fingerprints, keys, keys, st.integers(0, 2**40), st.integers(0, 2**40))
def test_each_mismatched_argument_is_named(
    fp: bytes, other_fp: bytes, key: str, other_key: str, n: int, other_n: int
) -> None:
    h = unpack(pack(fp, key, n, 1234))
    if other_fp != fp:
        assert check(h, other_fp, key, n) is CheckFailure.FINGERPRINT
    if header.key_digest(other_key) != header.key_digest(key):
        assert check(h, fp, other_key, n) is CheckFailure.KEY
    if other_n != n:
        assert check(h, fp, key, other_n) is CheckFailure.LENGTH
    assert check(h, fp, key, n, 1235) is CheckFailure.CHECKSUM
    assert check(h, fp, key, n, None) is None  # checksum not verified


def test_a_reader_that_verifies_refuses_a_header_without_checksum() -> None:
    h = unpack(pack(FP, "k", 5))
    assert check(h, FP, "k", 5) is None  # a reader that does not verify accepts it
    failure = check(h, FP, "k", 5, 999)  # one that does insists on a checksum
    assert failure is CheckFailure.NO_CHECKSUM and not failure.damaged
    assert CheckFailure.CHECKSUM.damaged and CheckFailure.VERSION.damaged


def test_unpack_too_short_raises_header_error() -> None:
    with pytest.raises(HeaderError, match="64 bytes, got 63"):
        unpack(bytes(63))
    with pytest.raises(HeaderError, match="got 0"):
        unpack(bytes(64), offset=64)


def test_pack_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="8 bytes"):
        pack(b"short", "k", 1)
    with pytest.raises(ValueError, match="payload_len"):
        pack(FP, "k", -1)


@given(st.binary(max_size=5000), st.lists(st.integers(0, 5000), max_size=6))
def test_payload_checksum_over_segments_equals_checksum_of_concatenation(
    payload: bytes, cuts: list[int]
) -> None:
    data = np.frombuffer(bytearray(payload or b"\0"), dtype=np.uint8)
    segs = _segments(data, cuts)
    assert header.payload_checksum(segs) == xxh3(data.tobytes())


def xxh3(data: bytes) -> int:
    """Reference: xxh3-64 of the bytes in one piece."""
    return xxhash.xxh3_64_intdigest(data)


@given(st.integers(1, 6), st.integers(1, 64), st.integers(0, 3), st.data())
def test_batch_checksums_equal_per_object_checksums(
    n: int, words: int, gap_words: int, data: st.DataObject
) -> None:
    size, stride = 8 * words, 8 * (words + gap_words)
    buf = np.frombuffer(
        data.draw(st.binary(min_size=n * stride, max_size=n * stride)), dtype=np.uint8
    ).copy()
    base = buf.ctypes.data
    strided = [[(base + i * stride, size)] for i in range(n)]
    mixed = [*strided, [(base, 3), (base + 8, 5)]]
    assert header.batch_checksums(strided) == [header.payload_checksum(p) for p in strided]
    assert header.batch_checksums(mixed) == [header.payload_checksum(p) for p in mixed]
    assert header.batch_checksums(strided) == [
        xxh3(buf[i * stride : i * stride + size].tobytes()) for i in range(n)
    ]


def test_checksums_of_payloads_hashed_in_slices() -> None:
    """Segments longer than a slice are hashed in pieces: the value is the one of the
    concatenation, for one payload and for each of a batch."""
    rng = np.random.default_rng(7)
    buf = rng.integers(0, 256, 3 * header._SLICE + 5, dtype=np.uint8)
    base = buf.ctypes.data
    cuts = [(base, header._SLICE + 3), (base + header._SLICE + 3, 2 * header._SLICE + 2)]
    assert header.payload_checksum(cuts) == xxh3(buf.tobytes())
    exact = [(base, header._SLICE), (base + header._SLICE, buf.nbytes - header._SLICE)]
    assert header.payload_checksum(exact) == xxh3(buf.tobytes())
    assert header.payload_checksum([(base, buf.nbytes)]) == xxh3(buf.tobytes())
    size = header._SLICE + 8
    objects = [[(base + i * 8, size)] for i in range(5)]
    assert header.batch_checksums(objects) == [
        xxh3(buf[i * 8 : i * 8 + size].tobytes()) for i in range(5)
    ]
    assert header.payload_checksum([]) == xxh3(b"")


@given(st.binary(min_size=1, max_size=512), st.data())
def test_any_flipped_bit_changes_the_checksum(payload: bytes, data: st.DataObject) -> None:
    buf = np.frombuffer(bytearray(payload), dtype=np.uint8)
    before = header.payload_checksum([(buf.ctypes.data, buf.nbytes)])
    bit = data.draw(st.integers(0, 8 * len(payload) - 1))
    buf[bit // 8] ^= 1 << (bit % 8)
    assert header.payload_checksum([(buf.ctypes.data, buf.nbytes)]) != before


def test_fingerprint_bytes_of_a_key_space() -> None:
    space = key_space(
        Layout.create(groups=["gqa:8"]), "org/m", dtype="bfloat16", chunk_size=16, head_size=128
    )
    fp = header.fingerprint_bytes(space.fingerprint)
    assert fp.hex() == space.fingerprint and len(fp) == 8
    assert header.fingerprint_bytes(fp) == fp
    with pytest.raises(ValueError, match="8 bytes"):
        header.fingerprint_bytes("abcd")


@given(st.lists(st.lists(st.integers(0, 15), min_size=2, max_size=5), min_size=1, max_size=6),
       st.data())  # fmt: skip
def test_multi_segment_batch_checksums_equal_the_checksum_of_the_concatenation(
    layouts: list[list[int]], data: st.DataObject
) -> None:
    """Scatter lists (a KV block per layer, some segments adjacent or repeated) hash as
    their concatenation."""
    seed = data.draw(st.integers(0, 2**32 - 1))
    buf = np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8)
    base = buf.ctypes.data
    rows = 4096 // 64
    payloads = []
    for picks in layouts:  # segments of 64 bytes at drawn rows, some adjacent or repeated
        payloads.append([(base + 64 * (p % rows), 64) for p in picks])
    payloads.append([(base + 3, 9), (base + 100, 7)])  # unaligned
    got = header.batch_checksums(payloads)
    for payload, checksum in zip(payloads, got, strict=True):
        joined = b"".join(buf[a - base : a - base + n].tobytes() for a, n in payload)
        assert checksum == header.payload_checksum(payload)
        assert checksum == xxh3(joined)


_rows = st.lists(st.tuples(keys, lengths, st.integers(0, 2**64 - 1)), min_size=1, max_size=8)


@given(fingerprints, _rows, st.booleans(), st.sampled_from([64, 128, 4160]))
def test_header_table_packs_the_bytes_pack_writes(
    fp: bytes, rows: list[tuple[str, int, int]], with_sums: bool, stride: int
) -> None:
    buf = np.full(stride * (len(rows) + 1), 0xAB, dtype=np.uint8)
    table = header.HeaderTable(buf, stride)
    slots = list(range(len(rows), 0, -1))  # any order of slots
    sums = [c for _, _, c in rows] if with_sums else None
    table.pack_rows(slots, fp, [k for k, _, _ in rows], [n for _, n, _ in rows], sums)
    for slot, (key, n, cs) in zip(slots, rows, strict=True):
        got = buf[slot * stride : slot * stride + HEADER_SIZE].tobytes()
        assert got == pack(fp, key, n, cs if with_sums else None)
        assert buf[slot * stride + HEADER_SIZE : (slot + 1) * stride].tobytes() == bytes(
            [0xAB] * (stride - HEADER_SIZE)
        )  # what follows a header (an inlined segment) is left alone
    assert buf[:HEADER_SIZE].tobytes() == bytes([0xAB] * HEADER_SIZE)  # slot 0 untouched


@given(
    fingerprints,
    keys,
    lengths,
    checksums,
    st.integers(0, HEADER_SIZE - 1),
    st.integers(1, 255),
    st.sampled_from(["stored", "fp", "key", "length", "checksum"]),
)
def test_header_table_checks_agree_with_check(
    fp: bytes, key: str, n: int, cs: int | None, pos: int, xor: int, ask: str
) -> None:
    """Any corrupted byte, or a question about another object: valid_rows says
    valid exactly when ``check`` finds nothing."""
    raw = bytearray(pack(fp, key, n, cs))
    if ask == "stored":
        raw[pos] ^= xor
    buf = np.zeros(2 * HEADER_SIZE, dtype=np.uint8)
    buf[HEADER_SIZE:] = np.frombuffer(bytes(raw), dtype=np.uint8)
    want_fp = bytes([fp[0] ^ xor, *fp[1:]]) if ask == "fp" else fp
    want_key = key + "x" if ask == "key" else key
    want_n = (n + xor) % 2**64 if ask == "length" else n
    got_cs = ((cs or 0) + xor) % 2**64 if ask == "checksum" else cs
    valid = header.HeaderTable(buf, HEADER_SIZE).valid_rows(
        [1], want_fp, [want_key], [want_n], None if got_cs is None else [got_cs]
    )
    expected = check(unpack(bytes(raw)), want_fp, want_key, want_n, got_cs)
    assert bool(valid[0]) is (expected is None)


SECRET = b"s" * 32


def _signed(
    fp: bytes, key: str, payload: bytes, cs: int | None
) -> tuple[np.ndarray, tuple[np.ndarray, list[tuple[int, int]]]]:
    """A buffer of two header slots with ``pack`` in slot 1, signed over ``payload``."""
    data = np.frombuffer(payload, np.uint8).copy()
    segs = [(data.ctypes.data, data.nbytes)] if data.nbytes else []
    buf = np.zeros(2 * HEADER_SIZE, dtype=np.uint8)
    buf[HEADER_SIZE:] = np.frombuffer(pack(fp, key, len(payload), cs), np.uint8)
    header.HeaderTable(buf, HEADER_SIZE).sign_rows([1], [key], [segs], SECRET)
    return buf, (data, segs)


@given(fingerprints, keys, st.binary(max_size=300), checksums)
def test_a_signed_header_checks_with_its_secret_only(
    fp: bytes, key: str, payload: bytes, cs: int | None
) -> None:
    buf, (_, segs) = _signed(fp, key, payload, cs)
    raw = buf[HEADER_SIZE:].tobytes()
    h = unpack(raw)
    assert h.signed and raw[56:] == bytes(8)
    # Only the signed flag and the signature differ from ``pack``'s header.
    plain = bytearray(raw)
    plain[6] &= ~header.FLAG_SIGNED
    plain[40:56] = bytes(16)
    assert bytes(plain) == pack(fp, key, len(payload), cs)
    table = header.HeaderTable(buf, HEADER_SIZE)
    mine = table.signatures([1], [key], [segs], SECRET)
    other = table.signatures([1], [key], [segs], b"t" * 32)
    assert mine[0] == h.signature == header.payload_signature(SECRET, raw[:40], key, segs)
    assert check(h, fp, key, len(payload), None, mine[0]) is None
    assert check(h, fp, key, len(payload)) is None  # a reader without a secret
    assert check(h, fp, key, len(payload), None, other[0]) is CheckFailure.FORGED
    assert table.valid_rows([1], fp, [key], [len(payload)], None, mine) == [True]
    assert table.valid_rows([1], fp, [key], [len(payload)], None, other) == [False]
    unsigned = unpack(pack(fp, key, len(payload), cs))
    assert check(unsigned, fp, key, len(payload), None, mine[0]) is CheckFailure.UNSIGNED


@given(
    fingerprints,
    keys,
    st.binary(min_size=1, max_size=200),
    checksums,
    st.integers(0, HEADER_SIZE - 1),
    st.integers(1, 255),
    st.booleans(),
)
def test_signed_header_table_checks_agree_with_check(
    fp: bytes, key: str, payload: bytes, cs: int | None, pos: int, xor: int, flip_payload: bool
) -> None:
    """Any byte of a signed object changed (header or payload): the reader's
    signature no longer matches, valid_rows refuses it, and ``check`` names a cause."""
    buf, (data, segs) = _signed(fp, key, payload, cs)
    if flip_payload:
        data[pos % data.nbytes] ^= xor
    else:
        buf[HEADER_SIZE + pos] ^= xor
    table = header.HeaderTable(buf, HEADER_SIZE)
    sigs = table.signatures([1], [key], [segs], SECRET)
    valid = table.valid_rows([1], fp, [key], [len(payload)], None, sigs)
    failure = check(unpack(buf[HEADER_SIZE:].tobytes()), fp, key, len(payload), None, sigs[0])
    assert valid == [False] and failure is not None

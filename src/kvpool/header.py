"""The 64-byte header at the start of every stored object, and its checks.

    pack(fp, key, n, checksum)     header bytes for an ``n``-byte payload of ``key``
    pack_into(buf, off, ...)       the same, written into a buffer (no allocation)
    unpack(buf) -> Header          parse; raises ``HeaderError`` only if too short
    check(h, fp, key, n, cs)       None if ``h`` describes this object, else the
                                   ``CheckFailure`` naming the first bad field
    payload_checksum(segments)     the payload checksum over a scatter list, read in place
    batch_checksums(payloads)      the same for many payloads, a few numpy calls per batch
    key_digest(key)                xxh3-64 of the key's UTF-8
    HeaderTable(buffer, stride)    the headers at offsets 0, stride, 2*stride, ... of a
                                   buffer, packed (``pack_rows``) and checked
                                   (``valid_rows``) a batch at a time; the same
                                   bytes and verdicts as ``pack``/``check``
    fingerprint_bytes(fp)          a ``KeySpace.fingerprint`` (16 hex) as 8 bytes

Layout (little-endian, offsets in bytes)::

     0  magic        4s   b"KVPL"
     4  version      u16  FORMAT_VERSION
     6  flags        u16  bit 0: checksum present; other bits must be 0
     8  fingerprint  8s   config fingerprint of the key space
    16  key digest   u64  xxh3-64 of the key
    24  payload len  u64  bytes after the header
    32  checksum     u64  wsum64 of the payload, 0 when bit 0 is clear
    40  reserved     24s  zero

A header that fails ``check`` means the bytes are not this object: the reader
treats it as a miss, never loads it. Pure: no I/O; reading memory at an
address is the only unsafe thing here, and only the checksum functions do it.

wsum64: the payload, zero-padded to whole 64-bit little-endian words ``w_i``,
sums to ``sum(w_i * K_i) mod 2**64`` with odd weights ``K_i = splitmix64(i) | 1``.
Any one flipped bit changes it. It is a matrix product in numpy, so a batch of
objects costs one call that releases the GIL once: per-object hashing (xxh3)
ran 25-150x slower in vLLM's process, where a busy engine thread makes every
GIL hand-off wait a full switch interval (measured: 89 objects of 1 MiB, 3 ms
alone, 80-475 ms next to a busy thread; one matrix product, 10 ms).
"""

from __future__ import annotations

import ctypes
import enum
import os
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from kvpool.errors import HeaderError

__all__ = [
    "FLAG_CHECKSUM",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "CheckFailure",
    "Header",
    "HeaderTable",
    "batch_checksums",
    "check",
    "fingerprint_bytes",
    "key_digest",
    "pack",
    "pack_into",
    "payload_checksum",
    "unpack",
]

MAGIC = b"KVPL"
FORMAT_VERSION = 1
FLAG_CHECKSUM = 0x0001
_KNOWN_FLAGS = FLAG_CHECKSUM
_STRUCT = struct.Struct("<4sHH8sQQQ24s")
HEADER_SIZE = _STRUCT.size  # 64
_ZERO = bytes(24)
_FP_LEN = 8


class CheckFailure(enum.Enum):
    """Why a header does not describe the object it was read for."""

    MAGIC = "bad magic: not a kvpool object"
    VERSION = "unsupported header format version"
    FLAGS = "unknown or inconsistent header flags"
    RESERVED = "reserved header bytes are not zero"
    FINGERPRINT = "written under another config fingerprint"
    KEY = "written for another key"
    LENGTH = "payload length differs from the expected length"
    CHECKSUM = "payload checksum mismatch"


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed header, valid or not; ``check`` says which."""

    fingerprint: bytes  # 8 bytes
    key_digest: int  # xxh3-64 of the key's UTF-8
    payload_len: int  # bytes after the header
    checksum: int  # xxh3-64 of the payload; 0 without FLAG_CHECKSUM
    flags: int = 0
    version: int = FORMAT_VERSION
    magic: bytes = MAGIC
    reserved: bytes = _ZERO

    @property
    def has_checksum(self) -> bool:
        return bool(self.flags & FLAG_CHECKSUM)


def fingerprint_bytes(fingerprint: str | bytes) -> bytes:
    """``KeySpace.fingerprint`` (16 lowercase hex) as the 8 header bytes."""
    raw = bytes.fromhex(fingerprint) if isinstance(fingerprint, str) else bytes(fingerprint)
    if len(raw) != _FP_LEN:
        raise ValueError(f"a fingerprint is 8 bytes (16 hex digits), got {fingerprint!r}")
    return raw


def key_digest(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


_WEIGHTS = np.zeros(0, dtype=np.uint64)
_WEIGHTS_LOCK = threading.Lock()


def _weights(n: int) -> npt.NDArray[np.uint64]:
    """The first ``n`` wsum64 weights (splitmix64 of the word index, made odd)."""
    global _WEIGHTS
    if len(_WEIGHTS) < n:
        with _WEIGHTS_LOCK, np.errstate(over="ignore"):
            size = max(n, 2 * len(_WEIGHTS), 1 << 16)
            x = (np.arange(size, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            _WEIGHTS = (x ^ (x >> np.uint64(31))) | np.uint64(1)
    return _WEIGHTS[:n]


def _words(addr: int, size: int) -> npt.NDArray[np.uint64]:
    """The payload at ``addr`` as 64-bit words (copied and zero-padded if needed)."""
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))
    if size % 8 or addr % 8:
        padded = np.zeros(-(-size // 8) * 8, dtype=np.uint8)
        padded[:size] = raw
        raw = padded
    return raw.view(np.uint64)


def payload_checksum(segments: Sequence[tuple[int, int]]) -> int:
    """wsum64 over a scatter list of ``(address, size)``: of their concatenation."""
    sizes = [size for _, size in segments if size]
    if len(sizes) > 1 and any(s % 8 for s in sizes[:-1]):  # words straddle segments
        data = np.concatenate(
            [np.ctypeslib.as_array((ctypes.c_uint8 * s).from_address(a)) for a, s in segments if s]
        )
        return payload_checksum([(data.ctypes.data, data.nbytes)])
    total, pos = 0, 0
    with np.errstate(over="ignore"):
        for addr, size in segments:
            if size:
                w = _words(addr, size)
                total += int(np.dot(w, _weights(pos + len(w))[pos:]))
                pos += len(w)
    return total % (1 << 64)


_PARALLEL_BYTES = 8 << 20  # a run this big is summed on two threads
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _row_sums(
    rows: npt.NDArray[np.uint64], weights: npt.NDArray[np.uint64]
) -> npt.NDArray[np.uint64]:
    """``rows @ weights`` mod 2**64. ``np.dot`` releases the GIL (``@`` holds it for
    the whole product: a stall of several ms for any other Python thread, such as
    vLLM's engine loop), so a big run is split between this thread and a helper."""
    global _POOL
    with np.errstate(over="ignore"):
        if rows.nbytes < _PARALLEL_BYTES or len(rows) < 2 or (os.cpu_count() or 1) < 2:
            out: npt.NDArray[np.uint64] = np.dot(rows, weights)
            return out
        half = len(rows) // 2
        first = _helper().submit(np.dot, rows[:half], weights)
        rest = np.dot(rows[half:], weights)
        return np.concatenate([first.result(), rest])


def _aligned(payload: Sequence[tuple[int, int]]) -> bool:
    return all((a | n) % 8 == 0 for a, n in payload)


def _span_checksums(payloads: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """``payload_checksum`` of 8-byte aligned multi-segment payloads (one segment per
    layer of a KV block, say) through one word view spanning them all: per segment a
    slice and a dot product, no ctypes array per segment (several times faster)."""
    lo = min(a for p in payloads for a, n in p if n)
    hi = max(a + n for p in payloads for a, n in p if n)
    words = np.ctypeslib.as_array((ctypes.c_uint64 * ((hi - lo) // 8)).from_address(lo))
    weights = _weights(max(sum(n for _, n in p) // 8 for p in payloads))
    out = []
    for payload in payloads:  # integer dot products do not overflow-check
        total, pos = 0, 0
        for addr, size in payload:
            n, first = size // 8, (addr - lo) // 8
            total += int(np.dot(words[first : first + n], weights[pos : pos + n]))
            pos += n
        out.append(total % (1 << 64))
    return out


def _helper() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = ThreadPoolExecutor(1, thread_name_prefix="kvpool-checksum")
    return _POOL


def batch_checksums(payloads: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """``payload_checksum`` of each payload; runs of one-segment payloads of one size
    at a constant stride (objects back to back in staging) take one matrix product,
    runs of aligned multi-segment payloads one shared word view."""
    out: list[int] = []
    i = 0
    while i < len(payloads):
        j = i + 1
        if len(payloads[i]) > 1 and _aligned(payloads[i]):
            while j < len(payloads) and len(payloads[j]) > 1 and _aligned(payloads[j]):
                j += 1
            out += _span_checksums(payloads[i:j])
            i = j
            continue
        if len(payloads[i]) == 1:
            (addr, size), stride = payloads[i][0], None
            while (
                j < len(payloads)
                and len(payloads[j]) == 1
                and payloads[j][0][1] == size
                and (stride is None or payloads[j][0][0] - payloads[j - 1][0][0] == stride)
            ):
                stride = payloads[j][0][0] - payloads[j - 1][0][0]
                j += 1
            if j - i > 1 and stride is not None and stride > 0 and (addr | stride | size) % 8 == 0:
                n = j - i
                span = (n - 1) * stride + size
                base = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(addr))
                rows = np.lib.stride_tricks.as_strided(
                    base.view(np.uint64), shape=(n, size // 8), strides=(stride, 8), writeable=False
                )
                out.extend(int(v) for v in _row_sums(rows, _weights(size // 8)))
                i = j
                continue
        out.append(payload_checksum(payloads[i]))
        i += 1
    return out


def _fields(
    fingerprint: bytes, key: str, payload_len: int, checksum: int | None
) -> tuple[bytes, int, int, bytes, int, int, int, bytes]:
    if len(fingerprint) != _FP_LEN:
        raise ValueError(f"fingerprint must be 8 bytes, got {len(fingerprint)}")
    if not 0 <= payload_len < 1 << 64:
        raise ValueError(f"payload_len must be in [0, 2**64), got {payload_len}")
    if checksum is not None and not 0 <= checksum < 1 << 64:
        raise ValueError(f"checksum must be in [0, 2**64), got {checksum}")
    flags = 0 if checksum is None else FLAG_CHECKSUM
    return (
        MAGIC,
        FORMAT_VERSION,
        flags,
        fingerprint,
        key_digest(key),
        payload_len,
        checksum or 0,
        _ZERO,
    )


def pack(fingerprint: bytes, key: str, payload_len: int, checksum: int | None = None) -> bytes:
    """The header of a ``payload_len``-byte payload of ``key``; no checksum if None."""
    return _STRUCT.pack(*_fields(fingerprint, key, payload_len, checksum))


def pack_into(
    buffer: bytearray | memoryview,
    offset: int,
    fingerprint: bytes,
    key: str,
    payload_len: int,
    checksum: int | None = None,
) -> None:
    """``pack`` written into ``buffer[offset:offset + HEADER_SIZE]``."""
    _STRUCT.pack_into(buffer, offset, *_fields(fingerprint, key, payload_len, checksum))


def unpack(buffer: bytes | bytearray | memoryview, offset: int = 0) -> Header:
    """Parse the header at ``offset``; ``HeaderError`` if fewer than 64 bytes remain
    there (or ``offset`` is negative)."""
    if offset < 0:
        raise HeaderError(f"header offset must be >= 0, got {offset}")
    if len(buffer) - offset < HEADER_SIZE:
        raise HeaderError(
            f"an object header is {HEADER_SIZE} bytes, got {max(0, len(buffer) - offset)}"
        )
    magic, version, flags, fp, digest, length, checksum, reserved = _STRUCT.unpack_from(
        buffer, offset
    )
    return Header(fp, digest, length, checksum, flags, version, magic, reserved)


def check(
    header: Header,
    fingerprint: bytes,
    key: str,
    payload_len: int,
    checksum: int | None = None,
) -> CheckFailure | None:
    """None if ``header`` describes ``payload_len`` bytes of ``key`` under ``fingerprint``.

    ``checksum`` is the checksum the reader computed over the payload, or None
    to skip that check; it is compared only when the header carries one.
    Fields are checked in layout order and the first bad one is returned.
    """
    if header.magic != MAGIC:
        return CheckFailure.MAGIC
    if header.version != FORMAT_VERSION:
        return CheckFailure.VERSION
    if header.flags & ~_KNOWN_FLAGS or (not header.has_checksum and header.checksum):
        return CheckFailure.FLAGS
    if header.reserved != _ZERO:
        return CheckFailure.RESERVED
    if header.fingerprint != fingerprint:
        return CheckFailure.FINGERPRINT
    if header.key_digest != key_digest(key):
        return CheckFailure.KEY
    if header.payload_len != payload_len:
        return CheckFailure.LENGTH
    if checksum is not None and header.has_checksum and header.checksum != checksum:
        return CheckFailure.CHECKSUM
    return None


class HeaderTable:
    """Headers at offsets ``0, stride, 2 * stride, ...`` of a uint8 ``buffer`` (one per
    slot), written and checked a batch at a time.

    A lean loop over ``struct`` with no ``Header`` objects: per row about 0.5 us, and
    the loop stays fast right after a transfer has flushed the CPU caches (numpy's
    per-call machinery measured 4x slower than this loop then, for 16 rows).
    """

    def __init__(self, buffer: npt.NDArray[np.uint8], stride: int) -> None:
        if stride < HEADER_SIZE or stride % 8:
            raise ValueError(f"stride must be a multiple of 8 and >= {HEADER_SIZE}, got {stride}")
        self._view = buffer.data.cast("B")
        self._stride = stride

    def pack_rows(
        self,
        rows: Sequence[int],
        fingerprint: bytes,
        keys: Sequence[str],
        lengths: Sequence[int],
        checksums: Sequence[int] | None,
    ) -> None:
        """``pack(fingerprint, keys[i], lengths[i], checksums[i])`` into row ``rows[i]``."""
        if len(fingerprint) != _FP_LEN:
            raise ValueError(f"fingerprint must be 8 bytes, got {len(fingerprint)}")
        put, view, stride, digest = _STRUCT.pack_into, self._view, self._stride, _DIGEST
        if checksums is None:
            for row, key, n in zip(rows, keys, lengths, strict=True):
                put(view, row * stride, MAGIC, FORMAT_VERSION, 0, fingerprint,
                    digest(key.encode()), n, 0, _ZERO)  # fmt: skip
        else:
            for row, key, n, cs in zip(rows, keys, lengths, checksums, strict=True):
                put(view, row * stride, MAGIC, FORMAT_VERSION, FLAG_CHECKSUM, fingerprint,
                    digest(key.encode()), n, cs, _ZERO)  # fmt: skip

    def valid_rows(
        self,
        rows: Sequence[int],
        fingerprint: bytes,
        keys: Sequence[str],
        lengths: Sequence[int],
        checksums: Sequence[int] | None = None,
    ) -> list[bool]:
        """Per row: would ``check(unpack(row), fingerprint, keys[i], lengths[i],
        checksums[i])`` return None? (``checksums`` None: not compared.)"""
        get, view, stride, digest = _STRUCT.unpack_from, self._view, self._stride, _DIGEST
        out = []
        for i, (row, key, n) in enumerate(zip(rows, keys, lengths, strict=True)):
            magic, version, flags, fp, dig, length, cs, reserved = get(view, row * stride)
            out.append(
                magic == MAGIC
                and version == FORMAT_VERSION
                and (flags == FLAG_CHECKSUM or (flags == 0 and cs == 0))
                and reserved == _ZERO
                and fp == fingerprint
                and length == n
                and (checksums is None or flags == 0 or cs == checksums[i])
                and dig == digest(key.encode())
            )
        return out


_DIGEST = xxhash.xxh3_64_intdigest

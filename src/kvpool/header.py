"""The 64-byte header at the start of every stored object, and its checks.

    pack(fp, key, n, checksum, written_ms=0)
                                   header bytes for an ``n``-byte payload of ``key``
    pack_into(buf, off, ...)       the same, written into a buffer (no allocation)
    unpack(buf) -> Header          parse; raises ``HeaderError`` only if too short
    check(h, fp, key, n, cs)       None if ``h`` describes this object, else the
                                   ``CheckFailure`` naming the first bad field
    payload_checksum(segments)     the payload checksum over a scatter list, read in place
    batch_checksums(payloads)      the same for many payloads
    key_digest(key)                xxh3-64 of the key's UTF-8
    payload_signature(secret, head, key, segments)
                                   the 16-byte signature a pool secret gives an object
    HeaderTable(buffer, stride)    the headers at offsets 0, stride, 2*stride, ... of a
                                   buffer, packed (``pack_rows``) and checked
                                   (``valid_rows``) a batch at a time; the same
                                   bytes and verdicts as ``pack``/``check``;
                                   ``sign_rows``/``signatures`` sign and re-sign them
    fingerprint_bytes(fp)          a ``KeySpace.fingerprint`` (16 hex) as 8 bytes
    written_at(buf, fp, key)       when the object whose header is ``buf`` was
                                   written (ms since the epoch), None if unknown

Layout (little-endian, offsets in bytes)::

     0  magic        4s   b"KVPL"
     4  version      u16  FORMAT_VERSION
     6  flags        u16  bit 0: checksum present; bit 1: signed; other bits 0
     8  fingerprint  8s   config fingerprint of the key space
    16  key digest   u64  xxh3-64 of the key
    24  payload len  u64  bytes after the header
    32  checksum     u64  xxh3-64 of the payload, 0 when bit 0 is clear
    40  signature    16s  with bit 1: HMAC-SHA256 under the pool secret, cut to
                          16 bytes, of bytes 0-39, the key and the payload (never
                          16 zero bytes: those read as a flipped flag); else zero
    56  written      u64  when the writer framed the object: ms since the Unix
                          epoch on its wall clock; 0 if it did not say

A header that fails ``check`` means the bytes are not this object: the reader
treats it as a miss, never loads it. The write time is advisory (for ``kvpool
status`` and ``kvpool purge --older-than``): it is neither checked nor signed,
and a host with a wrong clock writes wrong times, never wrong KV. Pure: no I/O; reading memory at an
address is the only unsafe thing here, and only the checksum functions do it.

Signatures (``PoolConfig.pool_secret``): Mooncake has no authentication, so
anyone on the pool network can put bytes under a live key, with a header whose
checksum matches them. A writer with a secret signs each object; a reader with
one refuses objects unsigned (``UNSIGNED``) or signed with another secret
(``FORGED``). The signature covers the key itself (not only its 64-bit digest)
and the whole payload (not its xxh3, which is no defence against a chosen
payload), so an object is trusted only if a holder of the secret wrote those
bytes for that key. A reader without a secret ignores signatures.

The checksum is xxh3-64 of the payload (the concatenation of its scatter
list), hashed in place in slices small enough that xxhash keeps the GIL. A call
that releases the GIL waits a full switch interval (5 ms) to get it back whenever
another thread runs Python, so per-call releases starve the hashing thread next
to a busy engine thread. Measured, 16 MiB in 64 objects next to a thread spinning
in Python: one call per object (releases) 147 ms; in slices 0.74-0.79 ms, and
1.6-1.9 ms for objects of 8 segments (zero copy), the same as alone. Format 1
used a weighted word sum in numpy (wsum64): half as fast, and its per-segment
calls released the GIL (630 ms for those zero-copy objects next to that thread).
``FORMAT_VERSION`` is ``keys.OBJECT_FORMAT``, part of the key space's
fingerprint: objects of another format are other keys (misses), never read.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import hmac
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from kvpool.errors import HeaderError
from kvpool.keys import OBJECT_FORMAT

__all__ = [
    "FLAG_CHECKSUM",
    "FLAG_SIGNED",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "SIGNATURE_SIZE",
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
    "payload_signature",
    "unpack",
    "written_at",
]

MAGIC = b"KVPL"
FORMAT_VERSION = OBJECT_FORMAT  # 3: a write time (2: xxh3-64 checksums; 1: wsum64)
FLAG_CHECKSUM = 0x0001
FLAG_SIGNED = 0x0002
_KNOWN_FLAGS = FLAG_CHECKSUM | FLAG_SIGNED
_STRUCT = struct.Struct("<4sHH8sQQQ16sQ")
HEADER_SIZE = _STRUCT.size  # 64
SIGNED_BYTES = 40  # the header bytes a signature covers: all before it
SIGNATURE_SIZE = 16
_ZERO_SIG = bytes(SIGNATURE_SIZE)
_FLAGS = struct.Struct("<H")
_FLAGS_AT = 6
_FP_LEN = 8


class CheckFailure(enum.Enum):
    """Why a header does not describe the object it was read for."""

    MAGIC = "bad magic: not a kvpool object"
    VERSION = "unsupported header format version"
    FLAGS = "unknown or inconsistent header flags"
    RESERVED = "signature bytes set without the signed flag"
    FINGERPRINT = "written under another config fingerprint"
    KEY = "written for another key"
    LENGTH = "payload length differs from the expected length"
    CHECKSUM = "payload checksum mismatch"
    NO_CHECKSUM = "written without a checksum, which this reader requires"
    UNSIGNED = "not signed, and this reader's pool has a secret"
    FORGED = "signature does not match: not written with this pool's secret"

    @property
    def damaged(self) -> bool:
        """The object's bytes are wrong, as opposed to written by a healthy writer
        under other settings (checksums off). The format version is part of the
        key, so another version under this key is damage too."""
        return self is not CheckFailure.NO_CHECKSUM

    @property
    def untrusted(self) -> bool:
        """Refused for its signature: not written by a holder of the pool secret."""
        return self in (CheckFailure.UNSIGNED, CheckFailure.FORGED)


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
    signature: bytes = _ZERO_SIG  # 16 bytes, zero when unsigned
    written_ms: int = 0  # ms since the epoch at the writer; 0: not said

    @property
    def has_checksum(self) -> bool:
        return bool(self.flags & FLAG_CHECKSUM)

    @property
    def signed(self) -> bool:
        return bool(self.flags & FLAG_SIGNED)


def fingerprint_bytes(fingerprint: str | bytes) -> bytes:
    """``KeySpace.fingerprint`` (16 lowercase hex) as the 8 header bytes."""
    raw = bytes.fromhex(fingerprint) if isinstance(fingerprint, str) else bytes(fingerprint)
    if len(raw) != _FP_LEN:
        raise ValueError(f"a fingerprint is 8 bytes (16 hex digits), got {fingerprint!r}")
    return raw


def key_digest(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


# xxhash releases the GIL only for an update above a threshold (64 KiB in 4.x,
# more in 3.x). A thread that releases the GIL waits up to a switch interval (5 ms)
# to get it back from a thread running Python, so payloads are hashed in slices of
# at most this size, a few us each with the GIL held; other threads get the GIL
# through CPython's forced switch, as from any Python code.
_SLICE = 64 << 10


def _update(h: xxhash.xxh3_64, addr: int, size: int) -> None:
    view = memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
    for off in range(0, size, _SLICE):
        h.update(view[off : off + _SLICE])


def payload_checksum(segments: Sequence[tuple[int, int]]) -> int:
    """xxh3-64 of the concatenation of a scatter list of ``(address, size)``, read in place."""
    if len(segments) == 1 and 0 < segments[0][1] <= _SLICE:
        addr, size = segments[0]
        return xxhash.xxh3_64_intdigest((ctypes.c_char * size).from_address(addr))
    h, char = xxhash.xxh3_64(), ctypes.c_char
    for addr, size in segments:
        if size > _SLICE:
            _update(h, addr, size)
        elif size:  # a ctypes array is a buffer: 3x less per segment than a memoryview
            h.update((char * size).from_address(addr))
    return h.intdigest()


# hashlib releases the GIL for an update of 2048 bytes or more, and a thread that
# releases it waits for it again while another thread runs Python (see the
# checksum's slices below): signatures are fed in slices one byte shorter.
_SIGN_SLICE = 2047


def payload_signature(
    secret: bytes, head: bytes | memoryview, key: str, segments: Sequence[tuple[int, int]]
) -> bytes:
    """HMAC-SHA256 under ``secret`` of the header's first 40 bytes ``head``, the key
    (length-prefixed UTF-8) and the payload's scatter list, read in place; the
    first 16 bytes.

    Fed in slices that keep the GIL. Measured, 16 MiB in 64 objects of 8 segments:
    14 ms alone (1.2 GB/s; SHA extensions), 29 ms next to a thread spinning in
    Python (a fair share). HMAC over whole segments: 10 ms alone, 348 ms next to
    it; keyed BLAKE3 (the ``blake3`` wheel): 7 ms alone, 1247 ms next to it, as it
    releases the GIL on every update, however small.
    """
    if len(head) != SIGNED_BYTES:
        raise ValueError(f"a signature covers the header's first {SIGNED_BYTES} bytes")
    raw = key.encode()
    mac = hmac.new(secret, bytes(head) + len(raw).to_bytes(4, "little") + raw, hashlib.sha256)
    update, char, step = mac.update, ctypes.c_char, _SIGN_SLICE
    for addr, size in segments:
        if size <= step:
            if size:
                update((char * size).from_address(addr))
            continue
        view = memoryview((char * size).from_address(addr)).cast("B")
        for off in range(0, size, step):
            update(view[off : off + step])
    return mac.digest()[:SIGNATURE_SIZE]


def batch_checksums(payloads: Iterable[Sequence[tuple[int, int]]]) -> list[int]:
    """``payload_checksum`` of each payload."""
    return list(map(payload_checksum, payloads))


def _fields(
    fingerprint: bytes, key: str, payload_len: int, checksum: int | None, written_ms: int
) -> tuple[bytes, int, int, bytes, int, int, int, bytes, int]:
    if len(fingerprint) != _FP_LEN:
        raise ValueError(f"fingerprint must be 8 bytes, got {len(fingerprint)}")
    if not 0 <= payload_len < 1 << 64:
        raise ValueError(f"payload_len must be in [0, 2**64), got {payload_len}")
    if checksum is not None and not 0 <= checksum < 1 << 64:
        raise ValueError(f"checksum must be in [0, 2**64), got {checksum}")
    if not 0 <= written_ms < 1 << 64:
        raise ValueError(f"written_ms must be in [0, 2**64), got {written_ms}")
    flags = 0 if checksum is None else FLAG_CHECKSUM
    return (
        MAGIC,
        FORMAT_VERSION,
        flags,
        fingerprint,
        key_digest(key),
        payload_len,
        checksum or 0,
        _ZERO_SIG,
        written_ms,
    )


def pack(
    fingerprint: bytes,
    key: str,
    payload_len: int,
    checksum: int | None = None,
    written_ms: int = 0,
) -> bytes:
    """The header of a ``payload_len``-byte payload of ``key``; no checksum if None."""
    return _STRUCT.pack(*_fields(fingerprint, key, payload_len, checksum, written_ms))


def pack_into(
    buffer: bytearray | memoryview,
    offset: int,
    fingerprint: bytes,
    key: str,
    payload_len: int,
    checksum: int | None = None,
    written_ms: int = 0,
) -> None:
    """``pack`` written into ``buffer[offset:offset + HEADER_SIZE]``."""
    _STRUCT.pack_into(buffer, offset, *_fields(fingerprint, key, payload_len, checksum, written_ms))


def unpack(buffer: bytes | bytearray | memoryview, offset: int = 0) -> Header:
    """Parse the header at ``offset``; ``HeaderError`` if fewer than 64 bytes remain
    there (or ``offset`` is negative)."""
    if offset < 0:
        raise HeaderError(f"header offset must be >= 0, got {offset}")
    if len(buffer) - offset < HEADER_SIZE:
        raise HeaderError(
            f"an object header is {HEADER_SIZE} bytes, got {max(0, len(buffer) - offset)}"
        )
    magic, version, flags, fp, digest, length, checksum, sig, written = _STRUCT.unpack_from(
        buffer, offset
    )
    return Header(fp, digest, length, checksum, flags, version, magic, sig, written)


def written_at(buffer: bytes | bytearray | memoryview, fingerprint: bytes, key: str) -> int | None:
    """When the object of ``key`` whose first bytes are ``buffer`` was written (ms since
    the epoch, the writer's clock); None unless ``check`` takes the header for this key
    and fingerprint (its own length; the payload is not read) and it carries a time."""
    if len(buffer) < HEADER_SIZE:
        return None
    h = unpack(buffer)
    valid = check(h, fingerprint, key, h.payload_len) is None
    return h.written_ms if valid and h.written_ms else None


def check(
    header: Header,
    fingerprint: bytes,
    key: str,
    payload_len: int,
    checksum: int | None = None,
    signature: bytes | None = None,
) -> CheckFailure | None:
    """None if ``header`` describes ``payload_len`` bytes of ``key`` under ``fingerprint``.

    ``checksum`` is the checksum the reader computed over the payload, or None
    to skip that check; a reader that gives one requires the header to carry
    one (``NO_CHECKSUM`` otherwise). ``signature`` likewise: the one the reader's
    pool secret gives this header's first 40 bytes, key and payload
    (``payload_signature``), or None for a reader without a secret. Fields are
    checked in layout order and the first bad one is returned.
    """
    if header.magic != MAGIC:
        return CheckFailure.MAGIC
    if header.version != FORMAT_VERSION:
        return CheckFailure.VERSION
    if header.flags & ~_KNOWN_FLAGS or (not header.has_checksum and header.checksum):
        return CheckFailure.FLAGS
    if header.signed and header.signature == _ZERO_SIG:
        return CheckFailure.FLAGS  # a signature of 16 zero bytes: the flag alone flipped
    if not header.signed and header.signature != _ZERO_SIG:
        return CheckFailure.RESERVED
    if header.fingerprint != fingerprint:
        return CheckFailure.FINGERPRINT
    if header.key_digest != key_digest(key):
        return CheckFailure.KEY
    if header.payload_len != payload_len:
        return CheckFailure.LENGTH
    if checksum is not None and not header.has_checksum:
        return CheckFailure.NO_CHECKSUM
    if checksum is not None and header.checksum != checksum:
        return CheckFailure.CHECKSUM
    if signature is not None and not header.signed:
        return CheckFailure.UNSIGNED
    if signature is not None and not hmac.compare_digest(header.signature, signature):
        return CheckFailure.FORGED
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
        written_ms: int = 0,
    ) -> None:
        """``pack(fingerprint, keys[i], lengths[i], checksums[i], written_ms)`` into
        row ``rows[i]``."""
        if len(fingerprint) != _FP_LEN:
            raise ValueError(f"fingerprint must be 8 bytes, got {len(fingerprint)}")
        put, view, stride, digest = _STRUCT.pack_into, self._view, self._stride, _DIGEST
        if checksums is None:
            for row, key, n in zip(rows, keys, lengths, strict=True):
                put(view, row * stride, MAGIC, FORMAT_VERSION, 0, fingerprint,
                    digest(key.encode()), n, 0, _ZERO_SIG, written_ms)  # fmt: skip
        else:
            for row, key, n, cs in zip(rows, keys, lengths, checksums, strict=True):
                put(view, row * stride, MAGIC, FORMAT_VERSION, FLAG_CHECKSUM, fingerprint,
                    digest(key.encode()), n, cs, _ZERO_SIG, written_ms)  # fmt: skip

    def valid_rows(
        self,
        rows: Sequence[int],
        fingerprint: bytes,
        keys: Sequence[str],
        lengths: Sequence[int],
        checksums: Sequence[int] | None = None,
        signatures: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Per row: would ``check(unpack(row), fingerprint, keys[i], lengths[i],
        checksums[i], signatures[i])`` return None? (None: not compared.)"""
        get, view, stride, digest = _STRUCT.unpack_from, self._view, self._stride, _DIGEST
        zero_sig = _ZERO_SIG
        out = []
        for i, (row, key, n) in enumerate(zip(rows, keys, lengths, strict=True)):
            magic, version, flags, fp, dig, length, cs, sig, _ = get(view, row * stride)
            signed, plain = flags & FLAG_SIGNED, flags & ~FLAG_SIGNED
            out.append(
                magic == MAGIC
                and version == FORMAT_VERSION
                and (plain == FLAG_CHECKSUM or (plain == 0 and cs == 0))
                and (sig != zero_sig if signed else sig == zero_sig)
                and fp == fingerprint
                and length == n
                and (checksums is None or (plain == FLAG_CHECKSUM and cs == checksums[i]))
                and dig == digest(key.encode())
                and (
                    signatures is None or (bool(signed) and hmac.compare_digest(sig, signatures[i]))
                )
            )
        return out

    def checksums(self, rows: Sequence[int]) -> list[int | None]:
        """Per row, the payload checksum its header carries (None: it carries none)."""
        get, view, stride = _STRUCT.unpack_from, self._view, self._stride
        out: list[int | None] = []
        for row in rows:
            fields = get(view, row * stride)
            out.append(fields[6] if fields[2] & FLAG_CHECKSUM else None)
        return out

    def sign_rows(
        self,
        rows: Sequence[int],
        keys: Sequence[str],
        payloads: Iterable[Sequence[tuple[int, int]]],
        secret: bytes,
    ) -> None:
        """Mark the packed headers in ``rows`` signed and write their signatures
        (``signatures`` of the headers so marked)."""
        view, stride = self._view, self._stride
        for row in rows:
            (flags,) = _FLAGS.unpack_from(view, row * stride + _FLAGS_AT)
            _FLAGS.pack_into(view, row * stride + _FLAGS_AT, flags | FLAG_SIGNED)
        for row, sig in zip(rows, self.signatures(rows, keys, payloads, secret), strict=True):
            view[row * stride + SIGNED_BYTES : row * stride + SIGNED_BYTES + SIGNATURE_SIZE] = sig

    def signatures(
        self,
        rows: Sequence[int],
        keys: Sequence[str],
        payloads: Iterable[Sequence[tuple[int, int]]],
        secret: bytes,
    ) -> list[bytes]:
        """The signature ``secret`` gives each row's header as it stands (read from
        the pool), its key and its payload: what ``valid_rows`` compares."""
        view, stride = self._view, self._stride
        return [
            payload_signature(secret, view[r * stride : r * stride + SIGNED_BYTES], k, p)
            for r, k, p in zip(rows, keys, payloads, strict=True)
        ]


_DIGEST = xxhash.xxh3_64_intdigest

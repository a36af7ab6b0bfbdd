"""The 64-byte header at the start of every stored object, and its checks.

    pack(fp, key, n, checksum)     header bytes for an ``n``-byte payload of ``key``
    pack_into(buf, off, ...)       the same, written into a buffer (no allocation)
    unpack(buf) -> Header          parse; raises ``HeaderError`` only if too short
    check(h, fp, key, n, cs)       None if ``h`` describes this object, else the
                                   ``CheckFailure`` naming the first bad field
    payload_checksum(segments)     xxh3-64 over a scatter list, read in place
    key_digest(key)                xxh3-64 of the key's UTF-8
    fingerprint_bytes(fp)          a ``KeySpace.fingerprint`` (16 hex) as 8 bytes

Layout (little-endian, offsets in bytes)::

     0  magic        4s   b"KVPL"
     4  version      u16  FORMAT_VERSION
     6  flags        u16  bit 0: checksum present; other bits must be 0
     8  fingerprint  8s   config fingerprint of the key space
    16  key digest   u64  xxh3-64 of the key
    24  payload len  u64  bytes after the header
    32  checksum     u64  xxh3-64 of the payload, 0 when bit 0 is clear
    40  reserved     24s  zero

A header that fails ``check`` means the bytes are not this object: the reader
treats it as a miss, never loads it. Pure: no I/O; reading memory at an
address is the only unsafe thing here, and only ``payload_checksum`` does it.
"""

from __future__ import annotations

import ctypes
import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvpool.errors import HeaderError

__all__ = [
    "FLAG_CHECKSUM",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "CheckFailure",
    "Header",
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


def payload_checksum(segments: Sequence[tuple[int, int]]) -> int:
    """xxh3-64 over a scatter list of ``(address, size)``, in order, without copying."""
    h = xxhash.xxh3_64()
    for addr, size in segments:
        if size:
            h.update(memoryview((ctypes.c_char * size).from_address(addr)))
    return h.intdigest()


def _fields(
    fingerprint: bytes, key: str, payload_len: int, checksum: int | None
) -> tuple[bytes, int, int, bytes, int, int, int, bytes]:
    if len(fingerprint) != _FP_LEN:
        raise ValueError(f"fingerprint must be 8 bytes, got {len(fingerprint)}")
    if payload_len < 0:
        raise ValueError(f"payload_len must be >= 0, got {payload_len}")
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
    """Parse the header at ``offset``; ``HeaderError`` if fewer than 64 bytes remain."""
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

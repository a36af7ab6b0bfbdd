"""Chunk names: kvpool's own hash chain over a prompt's token ids.

    link(parent, tokens, extra=b"")   one chunk's hash: sha256 of its parent's
                                      hash, its token ids and its extras
    ROOT                              the parent of chunk 0
    encode_extra(value)               vLLM's extra keys of a token range (LoRA,
                                      multimodal items, cache salt, prompt-embeds
                                      digests) as canonical bytes; ``TypeError``
                                      for a value it cannot encode
    ChunkChain(chunk_size)            one request's chain, extended as its tokens
                                      grow; ``advance`` returns every full chunk's hash

Chunk k's hash covers tokens ``[0, (k + 1) * C)`` and the extras of chunks 0..k,
so equal hashes mean equal prefixes (up to sha256). It depends on nothing of the
engine's: not vLLM's block size (which DCP scales: one hash block spans
``block_size * dcp`` tokens), not its hash algorithm or seed. Engines that hash
their blocks differently therefore name a chunk alike; the chunk size C is in
the config fingerprint (``keys``).

A request with extras the chain cannot encode is named only up to the chunk before
the first such chunk (``ChunkChain.broken`` says why): those chunks are looked up
and saved like any, the rest never are. Under-hashing would hand one prompt
another's KV.
Pure: no I/O, no torch, no vLLM.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ROOT", "ChunkChain", "encode_extra", "link"]

ROOT = hashlib.sha256(b"kvpool chunk chain 1").digest()
_U32 = struct.Struct("<I")


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 (``OverflowError`` outside 0 .. 2**32-1)."""
    a = array("I", tokens)
    if a.itemsize != 4:  # pragma: no cover - every platform CPython runs on has 4
        raise OverflowError("array('I') is not 32 bits here")
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def link(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """The hash of a chunk holding ``tokens`` after the chunk hashed ``parent``."""
    h = hashlib.sha256(parent)
    h.update(_U32.pack(len(tokens)))
    h.update(_token_bytes(tokens))
    h.update(_U32.pack(len(extra)))
    h.update(extra)
    return h.digest()


def encode_extra(value: Any) -> bytes:
    """Canonical, type-tagged bytes of ``value``: None, bool, int, str, bytes and
    tuples or lists of them (vLLM's extra keys are such tuples). Each tag and
    length is explicit, so distinct values never encode alike."""
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        text = str(value).encode()
        return b"I" + _U32.pack(len(text)) + text
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        return b"S" + _U32.pack(len(data)) + data
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return b"B" + _U32.pack(len(data)) + data
    if isinstance(value, tuple | list):
        return b"L" + _U32.pack(len(value)) + b"".join(encode_extra(v) for v in value)
    raise TypeError(f"kvpool cannot hash an extra key of type {type(value).__name__}")


class ChunkChain:
    """One request's chunk hashes, extended as its tokens grow (tokens are only
    ever appended, so a full chunk's hash never changes).

    ``extras(start, end)`` gives the extra keys of tokens ``[start, end)`` (None
    for none); vLLM's ``generate_block_hash_extra_keys`` in the connector.
    """

    __slots__ = ("broken", "chunk_size", "hashes")

    def __init__(self, chunk_size: int) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self.hashes: list[bytes] = []
        self.broken: str | None = None  # why this request has no names

    def advance(
        self,
        tokens: Sequence[int],
        num_tokens: int,
        extras: Callable[[int, int], Any] | None = None,
    ) -> list[bytes]:
        """The hashes of every full chunk of ``tokens[:num_tokens]`` (the list is
        the chain's own: do not change it)."""
        if self.broken is not None:
            return self.hashes
        c = self.chunk_size
        k = len(self.hashes)
        parent = self.hashes[-1] if self.hashes else ROOT
        while (k + 1) * c <= num_tokens:
            a, b = k * c, (k + 1) * c
            try:
                value = None if extras is None else extras(a, b)
                extra = b"" if value is None else encode_extra(value)
                parent = link(parent, tokens[a:b], extra)
            except (TypeError, OverflowError, ValueError) as exc:
                self.broken = str(exc)
                break
            self.hashes.append(parent)
            k += 1
        return self.hashes

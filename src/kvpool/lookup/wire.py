"""Lookup wire format: versioned msgspec messages, msgpack-encoded. No sockets.

    Request  = PackedLookup | LookupRequest | ResetRequest  scheduler -> server
    Reply    = LookupReply | ResetReply | ErrorReply        server -> scheduler
    encode_request(msg) / decode_request(frame)             the scheduler->server codec
    encode_reply(msg) / decode_reply(frame)                 the server->scheduler codec

Every message is a tagged ``msgspec.Struct`` (tag field ``type``) encoded as a
msgpack map, and carries ``proto``: the revision of this schema its sender
speaks. Evolution rules:

* A compatible change adds a field with a default. Receivers ignore fields
  they do not know, so old and new peers keep talking; ``proto`` goes up.
* A breaking change gets a new tag (e.g. ``"lookup.2"``); a tag is never
  reused with another meaning. A receiver answers a tag it does not know with
  ``ErrorReply(code="unsupported")``.

Decoding never raises. ``decode_request`` returns the request, or the
``ErrorReply`` to send back (its ``seq`` is recovered from the frame when it
can be, else -1); ``decode_reply`` returns the reply, or an ``ErrorReply`` that
describes what was wrong with it.

Bounds (checked where a frame arrives): a frame of at most ``MAX_FRAME_BYTES``;
at most ``MAX_CHUNK_HASHES`` chunk hashes of 1 to ``MAX_HASH_BYTES`` bytes each;
a request id of at most ``MAX_REQ_ID`` characters.

Lookups: ``PackedLookup`` (tag ``lookup.2``, what clients send) carries the
chunk hashes as one byte string of equal-width hashes, so a 128k-token prompt
costs one copy to send and none to receive; ``LookupRequest`` (``lookup``, a
list of hashes, proto 1) is still answered.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Annotated, TypeAlias, TypeVar

import msgspec
from msgspec import Meta

__all__ = [
    "MAX_CHUNK_HASHES",
    "MAX_FRAME_BYTES",
    "MAX_HASH_BYTES",
    "MAX_REQ_ID",
    "PROTO",
    "ErrorCode",
    "ErrorReply",
    "LookupReply",
    "LookupRequest",
    "PackedLookup",
    "Reply",
    "Request",
    "ResetReply",
    "ResetRequest",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
]

PROTO = 2  # the schema revision this module speaks (2: PackedLookup)
_T = TypeVar("_T")

MAX_CHUNK_HASHES = 1 << 20
MAX_HASH_BYTES = 64
MAX_REQ_ID = 256
# The largest request within the bounds above: every hash as msgpack bin8 (2 header
# bytes), plus room for the other fields and map keys.
MAX_FRAME_BYTES = MAX_CHUNK_HASHES * (MAX_HASH_BYTES + 2) + 4096

_U63 = (1 << 63) - 1
Seq = Annotated[int, Meta(ge=0, le=_U63)]
ReplySeq = Annotated[int, Meta(ge=-1, le=_U63)]  # -1: the request's seq was unreadable
Count = Annotated[int, Meta(ge=0, le=_U63)]
Proto = Annotated[int, Meta(ge=1)]
ChunkHash = Annotated[bytes, Meta(min_length=1, max_length=MAX_HASH_BYTES)]
ChunkHashes = Annotated[list[ChunkHash], Meta(max_length=MAX_CHUNK_HASHES)]
HashBytes = Annotated[int, Meta(ge=1, le=MAX_HASH_BYTES)]
PackedHashes = Annotated[bytes, Meta(max_length=MAX_CHUNK_HASHES * MAX_HASH_BYTES)]
ReqId = Annotated[str, Meta(max_length=MAX_REQ_ID)]


class ErrorCode(enum.StrEnum):
    """``ErrorReply.code`` values. The field is a plain string on the wire, so a
    peer may send codes this revision does not list; treat those as INTERNAL."""

    MALFORMED = "malformed"  # not msgpack, wrong fields or types, wrong frame count
    TOO_LARGE = "too_large"  # frame over the receiver's size bound
    UNSUPPORTED = "unsupported"  # unknown message type, or the store lacks the ability
    STORE_UNAVAILABLE = "store_unavailable"  # the store could not answer
    INTERNAL = "internal"  # a bug on the server; logged there
    # Made up by the client for its caller, never sent by a server:
    TIMEOUT = "timeout"  # no reply before the deadline
    UNREACHABLE = "unreachable"  # no server connected before the deadline; nothing sent
    BACKOFF = "backoff"  # not sent: the server failed to answer moments ago
    REBUILT = "rebuilt"  # the socket was rebuilt while the reply was awaited
    CLOSED = "closed"  # the client is closed


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    proto: Proto = PROTO


class LookupRequest(_Message, frozen=True, tag="lookup"):
    """How many leading tokens of this prompt are in the pool?

    ``chunk_hashes[i]`` is the hash of the prompt's chunk i (chained, so it
    names the whole prefix); ``num_tokens`` is the prompt's length in tokens.
    """

    seq: Seq  # chosen by the client; echoed in the reply
    req_id: ReqId  # vLLM's request id, for logs
    chunk_hashes: ChunkHashes
    num_tokens: Count


class PackedLookup(_Message, frozen=True, tag="lookup.2"):
    """``LookupRequest`` with its hashes packed: ``chunk_hashes`` is the
    concatenation of ``count`` hashes of ``hash_bytes`` bytes each (build it
    with ``pack``); chunk i's hash is ``hash(i)``."""

    seq: Seq
    req_id: ReqId
    hash_bytes: HashBytes
    chunk_hashes: PackedHashes
    num_tokens: Count

    def __post_init__(self) -> None:
        if len(self.chunk_hashes) % self.hash_bytes:
            raise ValueError(
                f"chunk_hashes holds {len(self.chunk_hashes)} bytes, not a whole number of "
                f"{self.hash_bytes}-byte hashes"
            )

    @classmethod
    def pack(cls, seq: int, req_id: str, hashes: Sequence[bytes], num_tokens: int) -> PackedLookup:
        """Pack ``hashes`` (all of one length). Raises ``ValueError`` when their
        lengths differ or are out of bounds."""
        widths = set(map(len, hashes))  # one pass in C: ~0.1 ms for 2k hashes
        if len(widths) > 1:
            raise ValueError("chunk hashes of different lengths cannot be packed")
        width = widths.pop() if widths else 1
        blob = b"".join(hashes)
        if not 1 <= width <= MAX_HASH_BYTES or len(hashes) > MAX_CHUNK_HASHES:
            raise ValueError(
                f"{len(hashes)} chunk hashes of {width} bytes: at most {MAX_CHUNK_HASHES} "
                f"hashes of 1 to {MAX_HASH_BYTES} bytes fit a lookup"
            )
        return cls(
            seq=seq, req_id=req_id, hash_bytes=width, chunk_hashes=blob, num_tokens=num_tokens
        )

    @property
    def count(self) -> int:
        return len(self.chunk_hashes) // self.hash_bytes

    def hash(self, i: int) -> bytes:
        w = self.hash_bytes
        return self.chunk_hashes[i * w : (i + 1) * w]


class ResetRequest(_Message, frozen=True, tag="reset"):
    """Remove every object of the server's key space (``KeySpace.prefix``).

    ``force`` also removes objects under a read lease (Mooncake: and with a
    replication task running); without it those are kept.
    """

    seq: Seq
    force: bool = False


class LookupReply(_Message, frozen=True, tag="lookup_reply"):
    """``hit_tokens``: whole chunks, present in every namespace of every group,
    never reaching the prompt's last token. ``keys_probed``: store keys checked."""

    seq: Seq
    hit_tokens: Count
    keys_probed: Count


class ResetReply(_Message, frozen=True, tag="reset_reply"):
    """The real outcome of a reset: ``ok`` only if the store did it; ``removed``
    counts objects removed; ``message`` says what happened in words."""

    seq: Seq
    ok: bool
    removed: Count
    message: str = ""


class ErrorReply(_Message, frozen=True, tag="error"):
    """The request could not be answered; ``code`` is an ``ErrorCode`` value."""

    seq: ReplySeq
    code: str
    message: str


Request: TypeAlias = PackedLookup | LookupRequest | ResetRequest
Reply: TypeAlias = LookupReply | ResetReply | ErrorReply

_REQUEST_TAGS = ("lookup.2", "lookup", "reset")
_REPLY_TAGS = ("lookup_reply", "reset_reply", "error")


class _Envelope(msgspec.Struct):
    """What can be read of any map-shaped frame, to describe a bad one. The fields
    stay undecoded (``Raw``), so a huge or deep value costs no memory here."""

    type: msgspec.Raw = msgspec.Raw()
    seq: msgspec.Raw = msgspec.Raw()
    proto: msgspec.Raw = msgspec.Raw()


_request_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def encode_request(msg: Request) -> bytes:
    return _request_encoder.encode(msg)


def encode_reply(msg: Reply) -> bytes:
    return _reply_encoder.encode(msg)


def decode_request(
    frame: bytes | memoryview, max_bytes: int = MAX_FRAME_BYTES
) -> Request | ErrorReply:
    """The request in ``frame``, or the ``ErrorReply`` to answer it with.

    A frame over ``max_bytes`` (at most ``MAX_FRAME_BYTES``) is refused unread,
    apart from its ``seq``.
    """
    limit = min(max_bytes, MAX_FRAME_BYTES)
    if len(frame) > limit:
        return ErrorReply(
            seq=_peek_seq(frame),
            code=ErrorCode.TOO_LARGE,
            message=f"request of {len(frame)} bytes exceeds {limit} bytes (at most "
            f"{MAX_CHUNK_HASHES} chunk hashes of at most {MAX_HASH_BYTES} bytes each)",
        )
    try:
        return _request_decoder.decode(frame)
    except (msgspec.DecodeError, RecursionError) as exc:  # deep nesting: RecursionError
        return _describe(frame, exc, _REQUEST_TAGS)


def decode_reply(frame: bytes | memoryview) -> Reply:
    """The reply in ``frame``; a bad frame becomes an ``ErrorReply`` describing it."""
    try:
        return _reply_decoder.decode(frame)
    except (msgspec.DecodeError, RecursionError) as exc:  # deep nesting: RecursionError
        return _describe(frame, exc, _REPLY_TAGS)


def _envelope(frame: bytes | memoryview) -> _Envelope:
    try:
        return _envelope_decoder.decode(frame)
    except (msgspec.DecodeError, RecursionError):
        return _Envelope()


def _field(raw: msgspec.Raw, kind: type[_T]) -> _T | None:
    """An envelope field as ``kind``, or None if absent or of another type."""
    try:
        return msgspec.msgpack.decode(raw, type=kind) if len(raw) else None
    except (msgspec.DecodeError, RecursionError):
        return None


def _peek_seq(frame: bytes | memoryview, env: _Envelope | None = None) -> int:
    """The frame's ``seq`` if it is a map holding a valid one, else -1."""
    seq = _field((env if env is not None else _envelope(frame)).seq, int)
    return seq if seq is not None and 0 <= seq <= _U63 else -1


def _describe(
    frame: bytes | memoryview, exc: msgspec.DecodeError | RecursionError, known: tuple[str, ...]
) -> ErrorReply:
    """An ErrorReply for an undecodable frame, with its seq if one can be read."""
    if not len(frame):
        return ErrorReply(seq=-1, code=ErrorCode.MALFORMED, message="empty frame")
    env = _envelope(frame)
    seq = _peek_seq(frame, env)
    tag = _field(env.type, str)
    if tag is not None and tag not in known:
        proto = _field(env.proto, int)
        return ErrorReply(
            seq=seq,
            code=ErrorCode.UNSUPPORTED,
            message=f"unknown message type {tag[:64]!r} (proto {repr(proto)[:20]}); "
            f"this peer speaks {', '.join(known)} at proto {PROTO}",
        )
    what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
    return ErrorReply(seq=seq, code=ErrorCode.MALFORMED, message=f"malformed message: {what}")

"""The lookup wire format: round trips, stored samples, evolution rules, bounds, fuzz."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.lookup import wire
from kvpool.lookup.wire import ErrorCode, ErrorReply

MESSAGES: list[wire.Request | wire.Reply] = [
    wire.LookupRequest(seq=7, req_id="req-1", chunk_hashes=[b"\x01" * 32, b"\x02"], num_tokens=40),
    wire.PackedLookup.pack(6, "req-0", [b"\x01" * 32, b"\x02" * 32], 80),
    wire.PackedLookup.pack(5, "", [], 0),
    wire.ResetRequest(seq=8),
    wire.ResetRequest(seq=9, force=True),
    wire.LookupReply(seq=7, hit_tokens=32, keys_probed=4),
    wire.ResetReply(seq=8, ok=True, removed=3, message="removed 3 objects"),
    ErrorReply(seq=-1, code=ErrorCode.MALFORMED, message="empty frame"),
]

# Frames written once by this module (proto 1, then 2); they must decode forever.
STORED_SAMPLES: dict[str, tuple[str, wire.Request | wire.Reply]] = {
    "lookup": (
        "86a474797065a66c6f6f6b7570a373657105a67265715f6964a161ac6368756e6b5f6861736865739"
        "1c402abcdaa6e756d5f746f6b656e730aa570726f746f01",
        wire.LookupRequest(seq=5, req_id="a", chunk_hashes=[b"\xab\xcd"], num_tokens=10, proto=1),
    ),
    "reset": (
        "84a474797065a57265736574a373657102a5666f726365c2a570726f746f01",
        wire.ResetRequest(seq=2, proto=1),
    ),
    "lookup_reply": (
        "85a474797065ac6c6f6f6b75705f7265706c79a373657101aa6869745f746f6b656e7320ab6b6579735f"
        "70726f62656404a570726f746f01",
        wire.LookupReply(seq=1, hit_tokens=32, keys_probed=4, proto=1),
    ),
    "reset_reply": (
        "86a474797065ab72657365745f7265706c79a373657101a26f6bc3a772656d6f76656404a76d657373616765"
        "a16da570726f746f01",
        wire.ResetReply(seq=1, ok=True, removed=4, message="m", proto=1),
    ),
    "error": (
        "85a474797065a56572726f72a373657103a4636f6465a96d616c666f726d6564a76d657373616765a16da5"
        "70726f746f01",
        ErrorReply(seq=3, code="malformed", message="m", proto=1),
    ),
    # proto 2 added the packed lookup
    "lookup.2": (
        "87a474797065a86c6f6f6b75702e32a373657105a67265715f6964a161aa686173685f627974657302ac"
        "6368756e6b5f686173686573c404abcd0102aa6e756d5f746f6b656e730aa570726f746f02",
        wire.PackedLookup.pack(5, "a", [b"\xab\xcd", b"\x01\x02"], 10),
    ),
}


def _decode_any(frame: bytes) -> wire.Request | wire.Reply:
    msg = wire.decode_request(frame)
    return wire.decode_reply(frame) if isinstance(msg, ErrorReply) else msg


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: wire.Request | wire.Reply) -> None:
    if isinstance(msg, wire.PackedLookup | wire.LookupRequest | wire.ResetRequest):
        assert wire.decode_request(wire.encode_request(msg)) == msg
    else:
        assert wire.decode_reply(wire.encode_reply(msg)) == msg
    assert msg.proto == wire.PROTO


@pytest.mark.parametrize("tag", sorted(STORED_SAMPLES))
def test_stored_samples_still_decode(tag: str) -> None:
    frame, expected = STORED_SAMPLES[tag]
    assert _decode_any(bytes.fromhex(frame)) == expected


def test_a_newer_peer_with_extra_fields_is_understood() -> None:
    frame = msgspec.msgpack.encode(
        {"type": "lookup", "proto": 9, "seq": 4, "req_id": "r", "chunk_hashes": [b"h"],
         "num_tokens": 9, "priority": "high"}
    )  # fmt: skip
    msg = wire.decode_request(frame)
    assert isinstance(msg, wire.LookupRequest)
    assert (msg.seq, msg.proto, msg.chunk_hashes) == (4, 9, [b"h"])


def test_a_missing_field_with_a_default_takes_it() -> None:
    msg = wire.decode_request(msgspec.msgpack.encode({"type": "reset", "seq": 1}))
    assert msg == wire.ResetRequest(seq=1, force=False, proto=wire.PROTO)


def test_an_unknown_tag_is_unsupported_and_keeps_its_seq() -> None:
    frame = msgspec.msgpack.encode({"type": "lookup.9", "proto": 3, "seq": 11})
    reply = wire.decode_request(frame)
    assert isinstance(reply, ErrorReply)
    assert (reply.seq, reply.code) == (11, ErrorCode.UNSUPPORTED)
    assert "lookup.9" in reply.message and "lookup.2, lookup, reset" in reply.message
    # A reply tag the client does not know is described the same way.
    answer = wire.decode_reply(frame)
    assert isinstance(answer, ErrorReply) and answer.code == ErrorCode.UNSUPPORTED


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"chunk_hashes": [b"x" * (wire.MAX_HASH_BYTES + 1)]}, "length <= 64"),
        ({"chunk_hashes": [b""]}, "length >= 1"),
        ({"chunk_hashes": ["text"]}, "Expected `bytes`"),
        ({"num_tokens": -1}, ">= 0"),
        ({"req_id": "r" * (wire.MAX_REQ_ID + 1)}, "length <= 256"),
        ({"proto": 0}, ">= 1"),
    ],
)
def test_invalid_fields_are_malformed_with_a_clear_message(
    fields: dict[str, object], needle: str
) -> None:
    base: dict[str, object] = {
        "type": "lookup", "seq": 3, "req_id": "r", "chunk_hashes": [b"h"], "num_tokens": 5
    }  # fmt: skip
    reply = wire.decode_request(msgspec.msgpack.encode(base | fields))
    assert isinstance(reply, ErrorReply)
    assert (reply.seq, reply.code) == (3, ErrorCode.MALFORMED)
    assert needle in reply.message


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"chunk_hashes": b"abc", "hash_bytes": 2}, "not a whole number of 2-byte hashes"),
        ({"hash_bytes": 0}, ">= 1"),
        ({"hash_bytes": wire.MAX_HASH_BYTES + 1}, "<= 64"),
        ({"chunk_hashes": [b"ab"]}, "Expected `bytes`"),
    ],
)
def test_a_bad_packed_lookup_is_malformed_with_a_clear_message(
    fields: dict[str, object], needle: str
) -> None:
    base: dict[str, object] = {
        "type": "lookup.2", "seq": 3, "req_id": "r", "hash_bytes": 2, "chunk_hashes": b"abcd",
        "num_tokens": 5,
    }  # fmt: skip
    reply = wire.decode_request(msgspec.msgpack.encode(base | fields))
    assert isinstance(reply, ErrorReply)
    assert (reply.seq, reply.code) == (3, ErrorCode.MALFORMED)
    assert needle in reply.message


def test_packing_keeps_hashes_in_order_and_refuses_what_cannot_be_packed() -> None:
    hashes = [bytes([i]) * 16 for i in range(5)]
    msg = wire.PackedLookup.pack(1, "r", hashes, 100)
    assert (msg.count, msg.hash_bytes) == (5, 16)
    assert [msg.hash(i) for i in range(msg.count)] == hashes
    with pytest.raises(ValueError, match="different lengths"):
        wire.PackedLookup.pack(1, "r", [b"ab", b"abc"], 100)
    with pytest.raises(ValueError, match="different lengths"):  # totals that add up
        wire.PackedLookup.pack(1, "r", [b"ab", b"abc", b"a"], 100)
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        wire.PackedLookup.pack(1, "r", [b"x" * 65], 100)


def test_too_many_chunk_hashes_are_refused() -> None:
    hashes = [b"\x01"] * (wire.MAX_CHUNK_HASHES + 1)
    frame = msgspec.msgpack.encode(
        {"type": "lookup", "seq": 1, "req_id": "r", "chunk_hashes": hashes, "num_tokens": 5}
    )
    reply = wire.decode_request(frame)
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.MALFORMED
    assert f"length <= {wire.MAX_CHUNK_HASHES}" in reply.message


def test_a_frame_over_the_bound_is_too_large_and_keeps_its_seq() -> None:
    msg = wire.LookupRequest(seq=12, req_id="r", chunk_hashes=[b"h" * 32] * 100, num_tokens=9)
    frame = wire.encode_request(msg)
    reply = wire.decode_request(frame, max_bytes=len(frame) - 1)
    assert isinstance(reply, ErrorReply)
    assert (reply.seq, reply.code) == (12, ErrorCode.TOO_LARGE)
    assert wire.decode_request(frame, max_bytes=len(frame)) == msg
    # Any frame larger than the largest valid request is refused unread.
    assert wire.MAX_FRAME_BYTES > wire.MAX_CHUNK_HASHES * wire.MAX_HASH_BYTES


@pytest.mark.parametrize(
    "frame", [b"", b"\xc1", b"\x91\x01", b"\xa3abc", b"\x81\xa4type\x05", b"\xde\xff\xff"]
)
def test_garbage_becomes_an_error_reply(frame: bytes) -> None:
    reply = wire.decode_request(frame)
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.MALFORMED
    assert reply.seq == -1


@settings(max_examples=500)
@given(st.binary(max_size=512))
def test_random_bytes_never_raise(frame: bytes) -> None:
    request = wire.decode_request(frame)
    assert isinstance(request, wire.LookupRequest | wire.ResetRequest | ErrorReply)
    reply = wire.decode_reply(frame)
    assert isinstance(reply, wire.LookupReply | wire.ResetReply | ErrorReply)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary()
)
_values = st.recursive(
    _scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(), kids, max_size=4)
)


@settings(max_examples=500)
@given(
    st.dictionaries(
        st.sampled_from(["type", "seq", "proto", "req_id", "chunk_hashes", "num_tokens", "x"]),
        _values | st.sampled_from(["lookup", "reset", "lookup_reply", "error"]),
    )
)
def test_random_maps_with_our_field_names_never_raise(fields: dict[str, object]) -> None:
    frame = msgspec.msgpack.encode(fields)
    request = wire.decode_request(frame)
    if isinstance(request, ErrorReply):
        seq = fields.get("seq")
        valid_seq = type(seq) is int and 0 <= seq < 1 << 63
        assert request.seq == (seq if valid_seq else -1)
    assert isinstance(wire.decode_reply(frame), wire.LookupReply | wire.ResetReply | ErrorReply)


def test_wire_imports_no_sockets() -> None:
    code = (
        "import sys, kvpool.lookup, kvpool.lookup.wire, kvpool.lookup.endpoint; "
        "print(sorted(m for m in ('zmq', 'mooncake', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

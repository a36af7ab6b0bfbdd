"""Fuzzing every input a user or another process controls, against its documented contract.

lookup wire   decode_request / decode_reply never raise; a bad frame becomes an
              ErrorReply with a sensible code and the frame's seq when readable;
              the server answers any frame (single or multipart), never "internal"
header        unpack raises only HeaderError; check never raises; any flipped bit of
              a header or a checksummed payload is detected
keys          parse_key returns a key that formats back exactly, or KeyFormatError
config        parse_size, read_pool_file, load_config raise only ConfigError, naming
              the field or the file
cli           bad arguments and bad pool files: non-zero exit, one line, no traceback
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np
import pytest
import zmq
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from tests.factories import key_space

from kvpool import config, header
from kvpool.cli import main
from kvpool.config import PoolConfig
from kvpool.errors import ConfigError, HeaderError, KeyFormatError, LayoutError
from kvpool.header import HEADER_SIZE, CheckFailure
from kvpool.keys import ParsedKey, parse_key
from kvpool.layout import ContentId, Layout
from kvpool.lookup import wire
from kvpool.lookup.server import LookupServer
from kvpool.lookup.wire import ErrorCode, ErrorReply
from kvpool.settings import ConnectorSettings, parse_extra
from kvpool.store.memory import MemoryStore

FAST = settings(max_examples=60, deadline=None)
MORE = settings(max_examples=150, deadline=None)
WITH_TMP = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

U63 = (1 << 63) - 1
U64 = (1 << 64) - 1

# --------------------------------------------------------------------------- lookup wire

seqs = st.integers(0, U63)
counts = st.integers(0, U63)
chunk_hashes = st.lists(st.binary(min_size=1, max_size=wire.MAX_HASH_BYTES), max_size=12)
texts = st.text(max_size=40)

requests: st.SearchStrategy[wire.Request] = st.one_of(
    st.builds(
        wire.LookupRequest,
        seq=seqs,
        req_id=st.text(max_size=wire.MAX_REQ_ID),
        chunk_hashes=chunk_hashes,
        num_tokens=counts,
        proto=st.integers(1, U63),
    ),
    st.builds(
        wire.PackedLookup.pack,
        seq=seqs,
        req_id=st.text(max_size=wire.MAX_REQ_ID),
        hashes=st.integers(1, wire.MAX_HASH_BYTES).flatmap(
            lambda w: st.lists(st.binary(min_size=w, max_size=w), max_size=12)
        ),
        num_tokens=counts,
    ),
    st.builds(wire.ResetRequest, seq=seqs, force=st.booleans(), proto=st.integers(1, U63)),
)
replies: st.SearchStrategy[wire.Reply] = st.one_of(
    st.builds(wire.LookupReply, seq=seqs, hit_tokens=counts, keys_probed=counts),
    st.builds(wire.ResetReply, seq=seqs, ok=st.booleans(), removed=counts, message=texts),
    st.builds(ErrorReply, seq=st.integers(-1, U63), code=texts, message=texts),
)

# Any msgpack value; ints across every msgpack int width.
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), U64)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=80),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=20,
)
_FIELD_NAMES = ["type", "seq", "proto", "req_id", "chunk_hashes", "num_tokens", "force"]
_FIELD_NAMES += ["hash_bytes"]
_FIELD_NAMES += ["hit_tokens", "keys_probed", "ok", "removed", "message", "code"]
_TAGS = ["lookup", "reset", "lookup_reply", "reset_reply", "error", "lookup.2", ""]
# Maps shaped like messages: a known or unknown tag, known fields of any type, extras.
message_maps = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(_TAGS) | msgpack_values,
        "seq": st.integers(-2, 3) | st.just(U63) | st.just(U63 + 1) | msgpack_values,
        "proto": st.integers(0, 3) | msgpack_values,
        "req_id": st.text(max_size=wire.MAX_REQ_ID + 2) | msgpack_values,
        "chunk_hashes": chunk_hashes
        | st.binary(max_size=200)
        | st.lists(msgpack_values, max_size=4)
        | msgpack_values,
        "hash_bytes": st.integers(0, wire.MAX_HASH_BYTES + 1) | msgpack_values,
        "num_tokens": counts | msgpack_values,
        "force": st.booleans() | msgpack_values,
        "hit_tokens": counts | msgpack_values,
        "keys_probed": counts | msgpack_values,
        "ok": st.booleans() | msgpack_values,
        "removed": counts | msgpack_values,
        "message": texts | msgpack_values,
        "code": st.sampled_from(list(ErrorCode)) | msgpack_values,
    },
).flatmap(
    lambda d: st.dictionaries(st.text(max_size=10), msgpack_values, max_size=3).map(
        lambda extra: {**extra, **d}
    )
)


def _valid_seq(d: dict[str, Any]) -> int:
    seq = d.get("seq")
    return seq if type(seq) is int and 0 <= seq <= U63 else -1


def _assert_request_or_error(frame: bytes) -> wire.Request | ErrorReply:
    """decode_request's contract for any frame, and the answer must survive the wire."""
    msg = wire.decode_request(frame)
    assert isinstance(msg, wire.PackedLookup | wire.LookupRequest | wire.ResetRequest | ErrorReply)
    if isinstance(msg, ErrorReply):
        assert msg.code in (ErrorCode.MALFORMED, ErrorCode.UNSUPPORTED, ErrorCode.TOO_LARGE)
        assert -1 <= msg.seq <= U63 and msg.message
        assert wire.decode_reply(wire.encode_reply(msg)) == msg
    else:
        assert 0 <= msg.seq <= U63 and msg.proto >= 1
    if isinstance(msg, wire.LookupRequest):
        assert len(msg.chunk_hashes) <= wire.MAX_CHUNK_HASHES
        assert all(1 <= len(h) <= wire.MAX_HASH_BYTES for h in msg.chunk_hashes)
        assert len(msg.req_id) <= wire.MAX_REQ_ID and msg.num_tokens >= 0
    if isinstance(msg, wire.PackedLookup):
        assert 1 <= msg.hash_bytes <= wire.MAX_HASH_BYTES
        assert msg.count <= wire.MAX_CHUNK_HASHES
        assert len(msg.chunk_hashes) == msg.count * msg.hash_bytes
        assert len(msg.req_id) <= wire.MAX_REQ_ID and msg.num_tokens >= 0
    return msg


def _assert_reply(frame: bytes) -> wire.Reply:
    msg = wire.decode_reply(frame)
    assert isinstance(msg, wire.LookupReply | wire.ResetReply | ErrorReply)
    assert wire.decode_reply(wire.encode_reply(msg)) == msg
    return msg


@FAST
@given(requests)
def test_every_valid_request_round_trips(msg: wire.Request) -> None:
    assert wire.decode_request(wire.encode_request(msg)) == msg


@FAST
@given(replies)
def test_every_valid_reply_round_trips(msg: wire.Reply) -> None:
    assert wire.decode_reply(wire.encode_reply(msg)) == msg


@FAST
@given(requests, replies)
def test_a_message_sent_the_wrong_way_is_unsupported_and_keeps_its_seq(
    req: wire.Request, reply: wire.Reply
) -> None:
    as_request = wire.decode_request(wire.encode_reply(reply))
    assert isinstance(as_request, ErrorReply) and as_request.code == ErrorCode.UNSUPPORTED
    assert as_request.seq == reply.seq
    as_reply = wire.decode_reply(wire.encode_request(req))
    assert isinstance(as_reply, ErrorReply) and as_reply.code == ErrorCode.UNSUPPORTED
    assert as_reply.seq == req.seq


@MORE
@given(st.binary(max_size=300))
@example(b"")
@example(b"\xc1")  # never used in msgpack
@example(b"\x81\xa4type" + b"\x91" * 100_000 + b"\xc0")  # nested past any recursion limit
@example(b"\x82\xa3seq\x05\xa1x" + b"\x91" * 100_000 + b"\xc0")
@example(b"\x81\xa4type" + b"\xdd\xff\xff\xff\xff")  # claims a 4-billion-item array
def test_arbitrary_bytes_never_raise(frame: bytes) -> None:
    _assert_request_or_error(frame)
    _assert_reply(frame)


@MORE
@given(message_maps)
def test_message_shaped_maps_decode_or_name_the_problem_and_keep_the_seq(
    d: dict[str, Any],
) -> None:
    frame = msgspec.msgpack.encode(d)
    msg = _assert_request_or_error(frame)
    if isinstance(msg, ErrorReply):
        assert msg.seq == _valid_seq(d)
        if msg.code == ErrorCode.UNSUPPORTED:
            assert isinstance(d.get("type"), str) and d["type"] not in ("lookup", "reset")
    reply = _assert_reply(frame)
    if isinstance(reply, ErrorReply):  # described, or a valid ErrorReply (seq -1 allowed)
        assert reply.seq == _valid_seq(d)


@FAST
@given(requests | replies, st.data())
def test_truncated_and_extended_frames_are_malformed(
    msg: wire.Request | wire.Reply, data: st.DataObject
) -> None:
    if isinstance(msg, wire.PackedLookup | wire.LookupRequest | wire.ResetRequest):
        frame = wire.encode_request(msg)
    else:
        frame = wire.encode_reply(msg)
    cut = data.draw(st.integers(0, len(frame) - 1), label="cut")
    extra = data.draw(st.binary(min_size=1, max_size=8), label="extra")
    for bad in (frame[:cut], frame + extra):
        for got in (_assert_request_or_error(bad), _assert_reply(bad)):
            assert isinstance(got, ErrorReply) and got.code == ErrorCode.MALFORMED
    # One byte changed: anything may come out, but nothing raises.
    pos = data.draw(st.integers(0, len(frame) - 1), label="pos")
    mutated = bytearray(frame)
    mutated[pos] = data.draw(st.integers(0, 255), label="byte")
    _assert_request_or_error(bytes(mutated))
    _assert_reply(bytes(mutated))


@FAST
@given(requests, st.data())
def test_frames_over_the_bound_are_too_large_and_keep_their_seq(
    msg: wire.Request, data: st.DataObject
) -> None:
    frame = wire.encode_request(msg)
    bound = data.draw(st.integers(0, len(frame) - 1), label="max_bytes")
    reply = wire.decode_request(frame, max_bytes=bound)
    assert isinstance(reply, ErrorReply)
    assert (reply.code, reply.seq) == (ErrorCode.TOO_LARGE, msg.seq)
    assert wire.decode_request(frame, max_bytes=len(frame)) == msg


def test_a_frame_over_max_frame_bytes_is_refused_without_decoding_it() -> None:
    # A valid-looking map whose "type" would be a 20-million-item list if decoded.
    items = wire.MAX_FRAME_BYTES // 4 + 1
    frame = (
        b"\x82\xa3seq\x07\xa4type\xdd" + items.to_bytes(4, "big") + b"\xce\xff\xff\xff\xff" * items
    )
    assert len(frame) > wire.MAX_FRAME_BYTES
    reply = wire.decode_request(frame)
    assert isinstance(reply, ErrorReply)
    assert (reply.code, reply.seq) == (ErrorCode.TOO_LARGE, 7)
    assert str(wire.MAX_FRAME_BYTES) in reply.message


def test_huge_lists_of_the_wrong_type_are_malformed() -> None:
    frame = msgspec.msgpack.encode(
        {"type": "lookup", "seq": 5, "req_id": "r", "num_tokens": 1, "chunk_hashes": [7] * 200_000}
    )
    reply = wire.decode_request(frame)
    assert isinstance(reply, ErrorReply)
    assert (reply.code, reply.seq) == (ErrorCode.MALFORMED, 5)
    assert "chunk_hashes" in reply.message


class _Socket:
    """What ``LookupServer._reply`` needs of a ROUTER socket: it records what is sent."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append(frames)


@pytest.fixture(scope="module")
def server() -> Iterator[LookupServer]:
    layout = Layout.create(tp=2, groups=("gqa:2", "mla"))
    space = key_space(layout, "org/fuzz", dtype="bfloat16", chunk_size=4, num_layers=1)
    with tempfile.TemporaryDirectory() as run_dir:  # never bound: start() is not called
        yield LookupServer(f"ipc://{run_dir}/fuzz.sock", MemoryStore(), layout, space, 4)


@WITH_TMP
@given(
    st.lists(
        st.binary(max_size=120)
        | requests.map(wire.encode_request)
        | message_maps.map(msgspec.msgpack.encode),
        min_size=0,
        max_size=3,
    )
)
def test_the_server_answers_every_router_message_once_and_never_internal(
    server: LookupServer, body: list[bytes]
) -> None:
    sock = _Socket()
    server._reply(cast(zmq.Socket[bytes], sock), [b"peer-7", *body])
    ((peer, frame),) = sock.sent
    assert peer == b"peer-7"
    reply = _assert_reply(frame)
    if isinstance(reply, ErrorReply):
        assert reply.code != ErrorCode.INTERNAL
        if len(body) != 1:
            assert reply.code == ErrorCode.MALFORMED and f"got {len(body)}" in reply.message
    if len(body) == 1:
        request = wire.decode_request(body[0])
        if not isinstance(request, ErrorReply):
            assert reply.seq == request.seq
            if isinstance(request, wire.LookupRequest):
                assert isinstance(reply, wire.LookupReply) and reply.hit_tokens == 0


# --------------------------------------------------------------------------- header

fingerprints = st.binary(min_size=8, max_size=8)
key_texts = st.text(min_size=1, max_size=60)


@MORE
@given(st.binary(max_size=150), st.integers(-80, 160), fingerprints, key_texts, st.data())
def test_unpack_and_check_of_arbitrary_bytes(
    buf: bytes, offset: int, fp: bytes, key: str, data: st.DataObject
) -> None:
    try:
        h = header.unpack(buf, offset)
    except HeaderError as exc:
        assert offset < 0 or len(buf) - offset < HEADER_SIZE
        assert "header" in str(exc)
        return
    assert offset >= 0 and len(buf) - offset >= HEADER_SIZE
    n = data.draw(st.sampled_from([h.payload_len, 0, 1 << 20]), label="payload_len")
    cs = data.draw(st.sampled_from([None, h.checksum, 0]), label="checksum")
    failure = header.check(h, fp, key, n, cs)
    if failure is None:  # it passes only if it is exactly the header pack() writes
        expected = header.pack(fp, key, n, h.checksum if h.has_checksum else None)
        assert buf[offset : offset + HEADER_SIZE] == expected
    else:
        assert isinstance(failure, CheckFailure)


@MORE
@given(
    fingerprints,
    key_texts,
    st.integers(0, U64),
    st.none() | st.integers(0, U64),
    st.integers(0, HEADER_SIZE - 1),
    st.integers(0, 255),
)
def test_overwritten_header_bytes_are_detected_or_harmless(
    fp: bytes, key: str, n: int, cs: int | None, pos: int, byte: int
) -> None:
    packed = bytearray(header.pack(fp, key, n, cs))
    h = header.unpack(packed)
    assert (h.fingerprint, h.key_digest, h.payload_len) == (fp, header.key_digest(key), n)
    assert header.check(h, fp, key, n, cs) is None
    changed = packed[pos] != byte
    packed[pos] = byte
    failure = header.check(header.unpack(bytes(packed)), fp, key, n, cs)
    # Only a change of the checksum flag that leaves another valid header goes unseen:
    # setting it with a zero checksum when the reader verifies none, or clearing it
    # where the checksum is 0. Either way the header is exactly what pack() would write.
    # The write time (bytes 56-63) is advisory: any value reads.
    benign = pos >= 56 or (pos == 6 and (byte, cs) in ((1, None), (0, 0)))
    assert (failure is None) == (not changed or benign)


@FAST
@given(fingerprints, key_texts, st.binary(max_size=200), st.data())
def test_any_flipped_bit_of_a_checksummed_object_is_detected(
    fp: bytes, key: str, payload: bytes, data: st.DataObject
) -> None:
    def read_check(obj: bytes) -> CheckFailure | None:
        body = np.frombuffer(obj, dtype=np.uint8)[HEADER_SIZE:]
        got = header.payload_checksum([(body.ctypes.data, body.nbytes)] if body.nbytes else [])
        return header.check(header.unpack(obj), fp, key, len(payload), got)

    arr = np.frombuffer(payload, dtype=np.uint8)
    cs = header.payload_checksum([(arr.ctypes.data, arr.nbytes)] if arr.nbytes else [])
    obj = bytearray(header.pack(fp, key, len(payload), cs) + payload)
    assert read_check(bytes(obj)) is None
    bit = data.draw(st.integers(0, 8 * len(obj) - 1), label="bit")
    obj[bit // 8] ^= 1 << (bit % 8)
    failure = read_check(bytes(obj))
    if bit == 48 and cs == 0:  # the checksum flag cleared with a checksum of 0: the header
        assert failure is None  # is that of an unchecked object, and the payload is intact
    elif 56 * 8 <= bit < 8 * HEADER_SIZE:  # the write time: advisory, never checked
        assert failure is None
    else:
        assert failure is not None
    if bit >= 8 * HEADER_SIZE:
        assert failure is CheckFailure.CHECKSUM


@FAST
@given(fingerprints, key_texts, st.integers(-(1 << 70), 1 << 70), st.integers(-(1 << 70), 1 << 70))
def test_pack_refuses_out_of_range_fields_with_value_error(
    fp: bytes, key: str, n: int, cs: int
) -> None:
    try:
        packed = header.pack(fp, key, n, cs)
    except ValueError as exc:
        assert not (0 <= n <= U64 and 0 <= cs <= U64)
        assert "payload_len" in str(exc) or "checksum" in str(exc)
    else:
        assert header.unpack(packed).payload_len == n and header.unpack(packed).checksum == cs


# --------------------------------------------------------------------------- keys

any_text = st.text(st.characters(exclude_categories=()), max_size=80)  # surrogates too
hex_hashes = st.binary(min_size=1, max_size=32).map(bytes.hex)
contents = st.builds(
    ContentId,
    head=st.integers(0, 64),
    dcp_rank=st.integers(0, 8),
    pcp_rank=st.integers(0, 8),
    band=st.integers(0, 8),
    group=st.integers(0, 4),
)
valid_keys = st.builds(
    lambda model, fp, c, h: str(ParsedKey(model, fp, c, h)),
    st.text(min_size=1, max_size=40),
    st.binary(min_size=8, max_size=8).map(bytes.hex),
    contents,
    hex_hashes,
)


def _parse_or_refuse(text: str) -> None:
    try:
        parsed = parse_key(text)
    except KeyFormatError as exc:
        assert repr(text) in str(exc)  # every refusal quotes the string it refused
        return
    assert str(parsed) == text


@MORE
@given(any_text)
@example("kvpool/²/m/0123456789abcdef/g0.h0.d0.c0.b0/ab")  # isdigit() but not int()
@example("kvpool/1/\udc80/0123456789abcdef/g0.h0.d0.c0.b0/ab")  # not encodable
@example("kvpool/1/m/0123456789abcdef/g" + "9" * 5000 + ".h0.d0.c0.b0/ab")  # over int()'s limit
@example("kvpool/" + "1" * 5000 + "/m/0123456789abcdef/g0.h0.d0.c0.b0/ab")
def test_arbitrary_strings_parse_exactly_or_raise_key_format_error(text: str) -> None:
    _parse_or_refuse(text)


@MORE
@given(valid_keys, st.data())
def test_mutated_keys_parse_exactly_or_raise_key_format_error(
    key: str, data: st.DataObject
) -> None:
    parsed = parse_key(key)
    assert str(parsed) == key
    pos = data.draw(st.integers(0, len(key)), label="pos")
    junk = data.draw(
        st.sampled_from(["", "0", "/", "%", "%2F", ".", "a", "G", "²", "\udc80", "99999999999"])
        | st.text(st.characters(exclude_categories=()), max_size=3),
        label="junk",
    )
    cut = data.draw(st.integers(0, 2), label="cut")
    _parse_or_refuse(key[:pos] + junk + key[pos + cut :])


@FAST
@given(any_text)
@example("\udc80weights")
def test_any_model_name_makes_keys_that_parse_back_or_is_refused(model: str) -> None:
    layout = Layout.create(tp=2, groups=("mla",))
    try:
        space = key_space(layout, model, dtype="bfloat16", chunk_size=16, num_layers=1)
    except LayoutError as exc:
        assert "model" in str(exc)
        return
    key = space.key(layout.holdings(0, 0)[0], b"\x01\x02")
    assert key.startswith(space.prefix)
    parsed = parse_key(key)
    assert (parsed.model, parsed.fingerprint, str(parsed)) == (model, space.fingerprint, key)


# --------------------------------------------------------------------------- config

size_like = st.from_regex(config._SIZE_RE, fullmatch=True)


@MORE
@given(st.one_of(st.text(max_size=30), size_like, st.integers(), st.floats(), st.booleans()))
@example("1" * 400)  # overflowed a float
@example("1" * 300 + "T")
@example("9" * 5000)
@example("9223372036854775808")
def test_parse_size_returns_a_byte_count_or_names_the_field(value: Any) -> None:
    try:
        size = config.parse_size(value, "segment_size")
    except ConfigError as exc:
        assert "segment_size" in str(exc)
        return
    assert isinstance(size, int) and 0 <= size <= U63


@FAST
@given(st.integers(0, U63), st.sampled_from(["", "B", "k", "KB", "KiB", "m", "GiB", "t", "TB"]))
def test_parse_size_is_exact(n: int, unit: str) -> None:
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(unit[:1].lower(), 1)
    assert config.parse_size(n) == n
    try:
        assert config.parse_size(f"{n} {unit}") == n * scale
    except ConfigError:
        assert n * scale > U63


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=20), inner, max_size=4)
    ),
    max_leaves=12,
)
# Pool-file-like objects: known fields with values of any JSON type.
_SETTINGS = [name for name in PoolConfig.__dataclass_fields__ if name != "pool_file"]
pool_objects = st.dictionaries(st.sampled_from(_SETTINGS) | st.text(max_size=10), json_values)


_CONNECTOR_KEYS = [name for name in ConnectorSettings.__dataclass_fields__]
connector_objects = st.dictionaries(
    st.sampled_from(_CONNECTOR_KEYS) | st.text(max_size=10), json_values, max_size=4
)


@MORE
@given(connector_objects)
@example({"run_dir": None})
@example({"shared_memory": 1})
@example({"layer_bands": {"0": 1}})
@example({"layer_bands": [3, 1]})
@example({"staging_bytes": True})
def test_connector_settings_are_taken_as_written_or_refused_with_one_line(
    extra: dict[str, Any],
) -> None:
    """parse_extra's contract: each known key's value is taken as documented (a
    string setting holds the very string given; bools, numbers and sizes parse by
    their one rule), or a ConfigError of one line names the key; never a
    traceback, never a value converted to something else."""
    try:
        settings, _ = parse_extra(extra)
    except ConfigError as exc:
        msg = str(exc)
        assert "\n" not in msg and any(str(k) in msg or repr(k) in msg for k in extra), msg
        return
    for name, value in extra.items():
        got = getattr(settings, name)
        if name in ("run_dir", "instance", "store", "load_mode"):
            assert got == value and isinstance(value, str)
        elif name == "shared_memory":
            assert got == {True: "on", False: "off"}.get(value, value)
        elif name in ("lookup_async", "save_decode", "zero_copy"):
            assert isinstance(got, bool) and got == config.parse_bool(value, name)
        elif name == "layer_bands":
            assert list(got) == sorted(set(got)) and all(isinstance(b, int) for b in got)
        else:  # numbers and sizes: finite, never a bool taken for one
            assert not isinstance(value, bool) and got >= 0


@pytest.fixture
def pool_dir(tmp_path: Path) -> Path:
    return tmp_path


@WITH_TMP
@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
@example(b"\xff\xfe garbage")  # not UTF-8
@example(b"[" * 100_000)  # past the JSON decoder's recursion limit
@example(b'{"master_address": 1e999}')
def test_read_pool_file_returns_an_object_or_names_the_file(pool_dir: Path, raw: bytes) -> None:
    path = pool_dir / "pool.json"
    path.write_bytes(raw)
    try:
        data = config.read_pool_file(path)
    except ConfigError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
        return
    assert isinstance(data, dict)


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        (".", "Is a directory"),
        ("a" * 5000, "File name too long"),
        ("a\0b", "NUL byte"),
    ],
)
def test_unreadable_pool_files_name_the_file(pool_dir: Path, name: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        config.read_pool_file(pool_dir / name)
    assert "cannot read pool file" in str(info.value) and str(pool_dir) in str(info.value)


_ENV_FIELDS = [config.ENV_PREFIX + name.upper() for name in _SETTINGS]


def _check_config(
    extra: dict[Any, Any], env: dict[str, str], accepted: set[str]
) -> PoolConfig | None:
    """load_config's contract: a valid PoolConfig, or a ConfigError naming what is wrong."""
    try:
        cfg = config.load_config(extra, env)
    except ConfigError as exc:
        msg = str(exc)
        assert "\n" not in msg
        assert any(name in msg for name in accepted | {"pool file"}), msg
        return None
    assert cfg.protocol in ("tcp", "rdma")
    assert 0 < cfg.setup_timeout_s < float("inf") and 0 < cfg.transfer_timeout_s < float("inf")
    assert 0 <= cfg.global_segment_size <= U63 and 0 <= cfg.local_buffer_size <= U63
    return cfg


@WITH_TMP
@given(
    st.dictionaries(st.sampled_from(_SETTINGS) | st.text(max_size=10), json_values, max_size=4)
    | st.dictionaries(st.integers() | st.none(), json_values, min_size=1, max_size=2),
    st.dictionaries(st.sampled_from(_ENV_FIELDS), st.text(max_size=12), max_size=3),
)
@example({"setup_timeout_s": 10**400}, {})
@example({"transfer_timeout_s": True}, {})
@example({}, {"KVPOOL_SETUP_TIMEOUT_S": "nan"})
@example({}, {"KVPOOL_TRANSFER_TIMEOUT_S": "inf"})
@example({"master_address": "h:²"}, {})
@example({1: 2, "a": 3}, {})
@example({"\n": None}, {})
@example({"global_segment_size": "1" * 400}, {})
def test_load_config_from_random_extra_and_env(
    pool_dir: Path, extra: dict[Any, Any], env: dict[str, str]
) -> None:
    env = {**env, "KVPOOL_HOME": str(pool_dir / "home")}  # never the user's own pool file
    named = {str(k) for k in extra} | {k.removeprefix(config.ENV_PREFIX).lower() for k in env}
    cfg = _check_config(extra, env, named | {"unknown pool setting"})
    if cfg is not None:
        assert not (set(extra) - set(_SETTINGS))


@WITH_TMP
@given(pool_objects | json_values, st.sampled_from(["extra", "env"]))
@example({"setup_timeout_s": 10**400}, "extra")
@example({"master_address": "h:²"}, "env")
def test_load_config_from_a_random_pool_file(pool_dir: Path, content: Any, how: str) -> None:
    path = pool_dir / "pool.json"
    path.write_text(json.dumps(content))
    env = {"KVPOOL_HOME": str(pool_dir / "home")}
    extra: dict[str, Any] = {}
    if how == "env":
        env["KVPOOL_POOL_FILE"] = str(path)
    else:
        extra["pool_file"] = str(path)
    named = {str(path)} | (set(content) if isinstance(content, dict) else set())
    cfg = _check_config(extra, env, named)
    if cfg is not None:
        assert cfg.pool_file == str(path)


@pytest.mark.parametrize(
    ("extra", "env", "needle"),
    [
        ({"pool_file": 5}, {}, "pool_file must be a path"),
        ({"pool_file": "a\0b"}, {}, "NUL"),
        ({"pool_file": "x" * 5000}, {}, "cannot read pool file"),
        ({}, {"KVPOOL_HOME": "x" * 5000}, "cannot read pool file"),
        ({}, {"KVPOOL_POOL_FILE": "/nonexistent/kvpool/pool.json"}, "no pool file at"),
    ],
)
def test_bad_pool_file_paths_are_config_errors(
    extra: dict[str, Any], env: dict[str, str], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        config.load_config(extra, env)


# --------------------------------------------------------------------------- cli


def _cli(argv: list[str], env: dict[str, str | None]) -> tuple[int, str, str]:
    """Run ``kvpool`` as its console script does; (exit status, stdout, stderr)."""
    with CliRunner().isolation(env=env) as (out, err, _):
        rc = main(argv)
        sys.stdout.flush()
        sys.stderr.flush()
    return rc, out.getvalue().decode(), err.getvalue().decode()


def _assert_one_line_error(rc: int, out: str, err: str, needle: str) -> None:
    assert rc != 0
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpool: error: "), err
    assert needle in lines[0], err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--tp", "0", "--group", "mla"], "--tp"),
        (["plan", "--tp", "-3", "--group", "mla"], "--tp"),
        (["plan", "--tp", "1e3", "--group", "mla"], "--tp"),
        (["plan", "--chunks", "0", "--group", "mla"], "--chunks"),
        (["plan", "--dp-index", "-1", "--group", "mla"], "--dp-index"),
        (["plan", "--tp", "4", "--dcp", "3", "--group", "mla"], "dcp=3"),
        (["plan", "--group", "gqa:²"], "gqa:²"),
        (["plan", "--group", "gqa:0"], "kv_heads"),
        (["plan", "--group", "gqa"], "gqa"),
        (["plan", "--group", "mla:4"], "mla"),
        (["plan", "--group", ""], "KV group"),
        (["plan", "--kv-heads", "0"], "--kv-heads"),
        (["plan", "--no-such-option"], "--no-such-option"),
        (["up", "--segment-size", "lots"], "segment_size"),
        (["up", "--segment-size", "0"], "--segment-size"),
        (["up", "--segment-size", "1" * 400], "segment_size"),  # overflowed a float
        (["up", "--client-ttl", "0"], "--client-ttl"),
        (["up", "--master", "nohost"], "HOST:PORT"),
        (["up", "--master", "h:70000"], "HOST:PORT"),
        (["up", "--master", "h:\u00b2"], "HOST:PORT"),
        (["up", "--host", "0.0.0.0"], "cannot reach it"),  # advertised to other hosts
        (["up", "--host", "localhost"], "is not an IPv4 address"),
        (["up", "--disk-size", "1GB"], "--disk-size goes with --disk"),
        (["up", "--master", "127.0.0.1:1", "--metrics-url", "127.0.0.1:9"], "http://HOST:PORT"),
        (
            ["up", "--master", "127.0.0.1:1", "--metrics-url", "http://127.0.0.1:9"],
            "does not answer",
        ),
        (
            [
                "up",
                "--master",
                "etcd://127.0.0.1:1",
                "--metrics-url",
                "http://127.0.0.1:9,http://127.0.0.1:10",
            ],
            "http://127.0.0.1:10 (",  # neither answers: both named
        ),
        (
            [
                "up",
                "--master",
                "etcd://127.0.0.1:1",
                "--metrics-url",
                "http://127.0.0.1:9,127.0.0.1:10",
            ],
            "both, comma-separated",
        ),
        (
            ["up", "--master", "127.0.0.1:1", "--metrics-url", "http://127.0.0.1:9,http://x:10"],
            "only with --master etcd://",
        ),
        (["bench", "vllm", "--extra", '{"lookup_timeout": 5}'], "did you mean lookup_timeout_ms?"),
        (["bench", "vllm", "--extra", '{"pool_file": "/x.json"}'], "its own private pool"),
        (["bench", "vllm", "--extra", '{"run_dir": null}'], "run_dir must be a string"),
        (["plan", "--tp", "100000", "--group", "mla"], "at most 4096"),
        (["nosuchcommand"], "nosuchcommand"),
    ],
)
def test_bad_arguments_exit_nonzero_with_one_line(
    pool_dir: Path, argv: list[str], needle: str
) -> None:
    # Every case fails while parsing options, before any pool would be started.
    rc, out, err = _cli(argv, {"KVPOOL_HOME": str(pool_dir), "KVPOOL_POOL_FILE": None})
    _assert_one_line_error(rc, out, err, needle)
    assert not (pool_dir / "pool.json").exists()


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (None, "does not exist"),
        (b"", "not valid JSON"),
        (b"\xff\xfe garbage", "not UTF-8"),
        (b"[" * 100_000, "nested too deeply"),
        (b"[1, 2]", "must hold a JSON object"),
        (b'{"master_address": 5}', "no master_address"),
        (b"{}", "no master_address"),
        (b'{"master_address": "nohost", "master_pid": 1}', "master_address must be host:port"),
    ],
)
def test_status_on_a_bad_pool_file_exits_nonzero_with_one_line(
    pool_dir: Path, raw: bytes | None, needle: str
) -> None:
    path = pool_dir / "pool.json"
    if raw is not None:
        path.write_bytes(raw)
    for argv in (["status"], ["status", "--json"], ["down"]):
        rc, out, err = _cli(argv, {"KVPOOL_POOL_FILE": str(path)})
        expected = "no pool" if argv == ["down"] and raw is None else needle
        _assert_one_line_error(rc, out, err, expected)
        assert str(path) in err


@WITH_TMP
@given(st.binary(max_size=120))
def test_status_on_a_pool_file_of_random_bytes(pool_dir: Path, raw: bytes) -> None:
    with contextlib.suppress(ValueError, AttributeError):  # a file naming a master would
        assume(not isinstance(json.loads(raw).get("master_address"), str))  # be contacted
    path = pool_dir / "pool.json"
    path.write_bytes(raw)
    rc, out, err = _cli(["status"], {"KVPOOL_POOL_FILE": str(path)})
    _assert_one_line_error(rc, out, err, str(path))

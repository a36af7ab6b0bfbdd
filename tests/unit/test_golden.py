"""Golden samples of what the pool stores: a key, a config fingerprint, an object
header and the chunk hashes of fixed tokens for one fixed config. A change to any
of them turns every object in every pool into a miss: if one of these fails, the
change must be a decision (bump ``SCHEMA_VERSION``, ``OBJECT_FORMAT`` or
``CHUNK_HASH`` and say why in the commit), never an accident of a refactoring."""

from __future__ import annotations

from kvpool import header
from kvpool.chunkhash import ChunkChain
from kvpool.keys import KeySpace
from kvpool.layout import GroupKind, GroupSpec, Layout

FINGERPRINT = "be3b97aea8b7c452"
KEY = (
    "kvpool/4/meta-llama/Llama-3.1-8B/be3b97aea8b7c452/g0.h5.d0.c0.b0/"
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
)
WRITTEN_MS = 1_796_169_600_000  # 2026-12-02 00:00 UTC
HEADER_WITH_CHECKSUM = (
    "4b56504c03000100be3b97aea8b7c452fb296e2b678a22d10000400000000000"
    "efcdab896745230100000000000000000000000000000000000c0d34a2010000"
)
HEADER_WITHOUT_CHECKSUM = (
    "4b56504c03000000be3b97aea8b7c452fb296e2b678a22d10000400000000000"
    "0000000000000000000000000000000000000000000000000000000000000000"
)


def _space() -> tuple[Layout, KeySpace]:
    layout = Layout.create(
        tp=2, pp=1, pcp=1, dcp=1, groups=[GroupSpec(GroupKind.GQA, 8)], layers=32
    )
    space = KeySpace.create(
        model="meta-llama/Llama-3.1-8B",
        layout=layout,
        kv_dtype="bfloat16",
        model_dtype="bfloat16",
        chunk_size=32,
        head_size=128,
        num_layers=32,
        extra={"device": "cpu"},
    )
    return layout, space


def test_the_fingerprint_of_a_fixed_config() -> None:
    assert _space()[1].fingerprint == FINGERPRINT


def test_the_key_of_a_fixed_chunk() -> None:
    layout, space = _space()
    assert space.key(layout.holdings(1, 0)[1], bytes(range(32))) == KEY


def test_the_header_of_a_fixed_object() -> None:
    fp = header.fingerprint_bytes(FINGERPRINT)
    stamped = header.pack(fp, KEY, 4 << 20, 0x0123456789ABCDEF, written_ms=WRITTEN_MS)
    assert stamped.hex() == HEADER_WITH_CHECKSUM
    assert header.pack(fp, KEY, 4 << 20).hex() == HEADER_WITHOUT_CHECKSUM


def test_the_stored_header_still_reads() -> None:
    got = header.unpack(bytes.fromhex(HEADER_WITH_CHECKSUM))
    assert got.payload_len == 4 << 20
    assert got.checksum == 0x0123456789ABCDEF
    assert got.written_ms == WRITTEN_MS
    assert header.check(got, header.fingerprint_bytes(FINGERPRINT), KEY, 4 << 20, None) is None


CHUNK_HASHES = [
    "7a8d431ac05dafd23dc76f184f7d6c8232748f49e09004b3b2757b1efa886835",
    "2370eeb3b0a7daf14de7817d9e97c5716ccd2195aab1e31eb4312958f3e02342",
]


def test_the_chunk_hashes_of_fixed_tokens() -> None:
    """Chunks named otherwise are other keys: a change here needs a new ``keys.CHUNK_HASH``."""
    chain = ChunkChain(4)
    lora = ("lora", "x", "/p")
    got = chain.advance(list(range(10)), 10, lambda a, b: lora if a == 0 else None)
    assert [h.hex() for h in got] == CHUNK_HASHES

"""Key schema: exact round trips, canonical form, and fingerprint sensitivity."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import keys
from kvpool.errors import KeyFormatError, LayoutError
from kvpool.keys import SCHEMA_VERSION, KeySpace, ParsedKey, parse_key
from kvpool.layout import ContentId, Layout

LAYOUT = Layout.create(tp=2, groups=["gqa:2"])


def make_space(model: str = "meta-llama/Llama-3.1-8B", **kw: object) -> KeySpace:
    args: dict[str, object] = dict(
        model=model,
        layout=LAYOUT,
        kv_dtype="bfloat16",
        model_dtype="bfloat16",
        chunk_size=32,
        head_size=128,
        num_layers=32,
    )
    args.update(kw)
    return KeySpace.create(**args)  # type: ignore[arg-type]


contents = st.builds(ContentId, *(st.integers(0, 10_000) for _ in range(5)))


@settings(max_examples=300)
@given(st.text(min_size=1), contents, st.binary(min_size=1, max_size=64))
def test_format_parse_round_trip(model: str, content: ContentId, h: bytes) -> None:
    space = make_space(model)
    key = space.key(content, h)
    parsed = parse_key(key)
    assert parsed == ParsedKey(model, space.fingerprint, content, h.hex(), SCHEMA_VERSION)
    assert str(parsed) == key
    assert key.startswith(space.prefix)


def test_key_is_human_readable() -> None:
    space = make_space()
    key = space.key(ContentId(1, 0, 0, 2, 0), bytes.fromhex("ab01"))
    assert key == f"kvpool/4/meta-llama/Llama-3.1-8B/{space.fingerprint}/g0.h1.d0.c0.b2/ab01"


def test_full_model_name_not_last_component() -> None:
    c = ContentId(0, 0, 0, 0, 0)
    assert make_space("org-a/llama").key(c, b"x") != make_space("org-b/llama").key(c, b"x")


@pytest.mark.parametrize(
    "change",
    [
        {"kv_dtype": "fp8"},
        {"model_dtype": "float32"},
        {"chunk_size": 64},
        {"head_size": 64},
        {"num_layers": 31},
        {"extra": {"revision": "abc"}},
        {"layout": Layout.create(tp=2, groups=["gqa:4"])},
        {"layout": Layout.create(tp=4, dcp=2, groups=["gqa:2"])},
        {"layout": Layout.create(tp=2, pp=2, groups=["gqa:2"])},
    ],
)
def test_every_byte_changing_field_changes_the_fingerprint(change: dict[str, Any]) -> None:
    assert make_space(**change).fingerprint != make_space().fingerprint


def test_the_tp_size_does_not_change_the_fingerprint() -> None:
    """Shards are named by global KV head, so TP1 and TP2 engines share keys."""
    assert make_space(layout=Layout.create(tp=1, groups=["gqa:2"])) == make_space()


def test_the_chunk_hash_changes_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another way of naming chunks is another key space, never a mix of two."""
    before = make_space().fingerprint
    monkeypatch.setattr(keys, "CHUNK_HASH", keys.CHUNK_HASH + "x")
    assert make_space().fingerprint != before


def test_the_object_format_changes_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines writing another object format use other keys: a miss, not a corrupt read."""
    from kvpool import header

    assert header.FORMAT_VERSION == keys.OBJECT_FORMAT
    before = make_space().fingerprint
    monkeypatch.setattr(keys, "OBJECT_FORMAT", keys.OBJECT_FORMAT + 1)
    assert make_space().fingerprint != before


def test_dp_index_does_not_change_the_fingerprint() -> None:
    other = Layout.create(tp=2, groups=["gqa:2"], dp_index=3)
    assert make_space(layout=other).fingerprint == make_space().fingerprint


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "vllm@tp_rank:0@abc",
        "kvpool/1/m/0123/g0.h0.d0.c0.b0/ab",
        "kvpool/x/m/0123456789abcdef/g0.h0.d0.c0.b0/ab",
        "kvpool/1/m/0123456789abcdef/g0.h0.d0.c0/ab",
        "kvpool/1/m/0123456789abcdef/g0.h0.d0.c0.b0/XY",
        "kvpool/1/m/0123456789abcdef/g00.h0.d0.c0.b0/ab",
        "kvpool/1//0123456789abcdef/g0.h0.d0.c0.b0/ab",
    ],
)
def test_parse_refuses_non_keys(bad: str) -> None:
    with pytest.raises(KeyFormatError):
        parse_key(bad)


def test_hash_must_be_hex_or_bytes() -> None:
    with pytest.raises(KeyFormatError):
        make_space().key(ContentId(0, 0, 0, 0, 0), "not-hex")
    with pytest.raises(KeyFormatError):
        make_space().key(ContentId(0, 0, 0, 0, 0), b"")


tenants = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", fullmatch=True)


@settings(max_examples=200)
@given(tenants, st.text(min_size=1), contents, st.binary(min_size=1, max_size=16))
def test_a_tenants_keys_round_trip_and_never_equal_a_key_of_no_tenant(
    tenant: str, model: str, content: ContentId, h: bytes
) -> None:
    space = make_space(model, tenant=tenant)
    key = space.key(content, h)
    parsed = parse_key(key)
    assert parsed.tenant == tenant and parsed.model == model and str(parsed) == key
    assert key.startswith(space.prefix) and key.startswith(f"kvpool/4/!{tenant}/")
    assert space.fingerprint == make_space(model).fingerprint  # not in the fingerprint
    # No model of no tenant, however named, has this key: a quoted model never starts '!'.
    assert make_space(f"!{tenant}/{model}").key(content, h) != key
    assert parse_key(make_space(f"!{tenant}/{model}").key(content, h)).tenant == ""


def test_two_tenants_name_one_prompt_of_one_model_apart() -> None:
    c = ContentId(0, 0, 0, 0, 0)
    a, b = make_space(tenant="team-a"), make_space(tenant="team-b")
    assert a.key(c, b"x") != b.key(c, b"x") != make_space().key(c, b"x")
    model = "meta-llama/Llama-3.1-8B"
    assert a.key(c, b"x") == f"kvpool/4/!team-a/{model}/{a.fingerprint}/g0.h0.d0.c0.b0/78"


@pytest.mark.parametrize("bad", ["", "_x", "-x", "a/b", "a b", "ü", "a" * 65, "a!b"])
def test_a_bad_tenant_name_says_what_a_name_may_hold(bad: str) -> None:
    with pytest.raises(LayoutError, match="1-64 letters, digits"):
        keys.check_tenant(bad)
    if bad:
        with pytest.raises(LayoutError):
            make_space(tenant=bad)


@pytest.mark.parametrize(
    "bad",
    [
        "kvpool/4/!/m/0123456789abcdef/g0.h0.d0.c0.b0/ab",
        "kvpool/4/!_t/m/0123456789abcdef/g0.h0.d0.c0.b0/ab",
    ],
)
def test_parse_refuses_a_bad_tenant_part(bad: str) -> None:
    with pytest.raises(KeyFormatError):
        parse_key(bad)


def test_engines_of_one_config_in_two_tenants_get_two_lookup_endpoints() -> None:
    none, a, b = make_space(), make_space(tenant="team-a"), make_space(tenant="team-b")
    names = {keys.default_instance(s) for s in (none, a, b)}
    assert len(names) == 3 and keys.default_instance(none) == none.fingerprint[:12]
    for name in names:  # each a valid endpoint name
        keys.lookup_endpoint("/tmp/k", name, 0)

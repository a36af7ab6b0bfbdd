"""SchedulerSide with fake requests: load and save plans, full-hit cut, suppression."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.keys import KeySpace
from kvpool.layout import Layout
from kvpool.vllm.identity import EngineIdentity
from kvpool.vllm.metadata import KVPoolWorkerMetadata
from kvpool.vllm.scheduler import SchedulerSide
from kvpool.vllm.settings import ConnectorSettings, parse_extra

B = 32


@dataclass
class FakeRequest:
    request_id: str
    num_tokens: int
    num_prompt_tokens: int
    block_hashes: list[bytes] = field(default_factory=list)

    @classmethod
    def make(cls, rid: str, tokens: int) -> FakeRequest:
        return cls(rid, tokens, tokens, [bytes([i]) * 8 for i in range(tokens // B)])


class FakeLookup:
    def __init__(self, hit: int) -> None:
        self.hit = hit
        self.calls: list[list[bytes]] = []
        self.pending: dict[str, int | None] = {}

    def lookup(self, req_id: str, chunk_hashes: list[bytes], num_tokens: int) -> int:
        self.calls.append(chunk_hashes)
        return min(self.hit, len(chunk_hashes) * B)

    def start(self, req_id: str, chunk_hashes: list[bytes], num_tokens: int) -> None:
        self.calls.append(chunk_hashes)
        self.pending[req_id] = None

    def poll(self, req_id: str) -> int | None:
        return self.pending.get(req_id)

    def cancel(self, req_id: str) -> None:
        self.pending.pop(req_id, None)


class FakeManager:
    def __init__(self) -> None:
        self.tables: dict[str, tuple[list[int], ...]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return self.tables[req_id]


def identity() -> EngineIdentity:
    layout = Layout.create(tp=1, groups=["gqa:2"])
    space = KeySpace.create(
        model="m",
        layout=layout,
        kv_dtype="f32",
        model_dtype="f32",
        chunk_size=B,
        head_size=32,
        num_layers=2,
    )
    return EngineIdentity(layout, space, B, B, 0)


def side(hit: int, **settings: Any) -> tuple[SchedulerSide, FakeLookup, FakeManager]:
    lookup, manager = FakeLookup(hit), FakeManager()
    s = SchedulerSide(identity(), ConnectorSettings(**settings), lookup, manager)
    return s, lookup, manager


def step(
    new: list[tuple[str, int]], scheduled: dict[str, int], finished: frozenset[str] = frozenset()
) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens=scheduled,
        finished_req_ids=finished,
    )


def test_partial_hit_loads_only_what_the_local_cache_lacks() -> None:
    s, _, manager = side(hit=5 * B)
    req = FakeRequest.make("r", 10 * B)
    assert s.matched_tokens(req, num_computed_tokens=2 * B) == (3 * B, True)
    s.after_alloc(req, 3 * B)
    manager.tables["r"] = (list(range(100, 110)),)
    meta = s.build_meta(step([], {}))
    (load,) = meta.loads
    assert [c.chunk for c in load.chunks] == [2, 3, 4]
    assert load.chunks[0].block_ids == ((102,),) and load.chunks[0].chunk_hash == bytes([2]) * 8
    assert meta.saves == []


def test_full_hit_leaves_the_last_token_to_compute() -> None:
    s, _, _ = side(hit=10 * B)
    req = FakeRequest.make("r", 10 * B)
    assert s.matched_tokens(req, 0) == (9 * B, True)


def test_no_hit_or_nothing_new_is_zero_and_not_async() -> None:
    s, _, _ = side(hit=2 * B)
    assert s.matched_tokens(FakeRequest.make("a", 10 * B), 0) == (2 * B, True)
    assert s.matched_tokens(FakeRequest.make("b", 10 * B), 2 * B) == (0, False)
    assert s.matched_tokens(FakeRequest.make("c", B - 1), 0) == (0, False)


def test_prefill_saves_each_completed_chunk_once_and_never_with_a_load() -> None:
    s, _, manager = side(hit=0)
    req = FakeRequest.make("r", 5 * B + 7)
    assert s.matched_tokens(req, 0) == (0, False)
    s.after_alloc(req, 0)
    manager.tables["r"] = (list(range(6)),)
    meta = s.build_meta(step([("r", 0)], {"r": 3 * B + 5}))  # chunked prefill, part 1
    assert [c.chunk for c in meta.saves[0].chunks] == [0, 1, 2]
    cached = SimpleNamespace(req_ids=["r"], num_computed_tokens=[3 * B + 5])
    out = step([], {"r": 2 * B + 2})
    out.scheduled_cached_reqs = cached
    meta = s.build_meta(out)
    assert [c.chunk for c in meta.saves[0].chunks] == [3, 4]
    # decode steps save nothing by default
    out.scheduled_cached_reqs = SimpleNamespace(req_ids=["r"], num_computed_tokens=[5 * B + 7])
    out.num_scheduled_tokens = {"r": 1}
    assert s.build_meta(out).saves == []


def test_failed_load_suppresses_chunks_so_lookups_do_not_loop() -> None:
    s, lookup, _ = side(hit=8 * B, failed_key_ttl_s=60)
    req = FakeRequest.make("r", 8 * B + 3)
    s.worker_output(KVPoolWorkerMetadata({req.block_hashes[3]}))
    assert s.matched_tokens(req, 0) == (3 * B, True)
    assert len(lookup.calls[-1]) == 3  # the lookup stops before the failed chunk


def test_async_lookup_returns_none_until_answered() -> None:
    s, lookup, _ = side(hit=4 * B, lookup_async=True)
    req = FakeRequest.make("r", 8 * B)
    assert s.matched_tokens(req, 0) == (None, False)
    lookup.pending["r"] = 4 * B
    assert s.matched_tokens(req, 0) == (4 * B, True)


def test_finished_request_is_forgotten() -> None:
    s, _, manager = side(hit=0)
    req = FakeRequest.make("r", 4 * B)
    s.matched_tokens(req, 0)
    s.after_alloc(req, 0)
    manager.tables["r"] = (list(range(4)),)
    s.build_meta(step([("r", 0)], {"r": 4 * B}, finished=frozenset({"r"})))
    assert s.build_meta(step([], {"r": 1})).saves == []


def test_extra_config_is_validated() -> None:
    settings, pool = parse_extra({"pool_file": "/x", "lookup_timeout_ms": "5", "save_decode": "on"})
    assert (
        settings.lookup_timeout_ms == 5.0 and settings.save_decode and pool == {"pool_file": "/x"}
    )
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key"):
        parse_extra({"lookup_timeout": 5})
    with pytest.raises(ValueError, match="load_mode"):
        parse_extra({"load_mode": "fast"})

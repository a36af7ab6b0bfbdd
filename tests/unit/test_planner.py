"""The scheduler half (``kvpool.connector.planner``) with fake requests, in the fast tier:
load and save plans, full-hit cut, suppression, roles, limits, pins, drains, events.
``tests/vllm/test_scheduler_side.py`` checks vLLM's parts (extra keys, ``BlockStored``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from tests.factories import key_space

from kvpool.chunkhash import ChunkChain
from kvpool.connector.identity import EngineIdentity
from kvpool.connector.planner import Planner
from kvpool.connector.steps import NULL_BLOCK, RequestOps, WorkerReport
from kvpool.errors import ConfigError
from kvpool.layout import Layout
from kvpool.settings import ConnectorSettings, parse_extra

B = 32


@dataclass
class FakeRequest:
    """What the scheduler and vLLM's ``generate_block_hash_extra_keys`` read."""

    request_id: str
    num_tokens: int
    num_prompt_tokens: int
    all_token_ids: list[int] = field(default_factory=list)
    mm_features: list[Any] = field(default_factory=list)
    lora_request: Any = None
    cache_salt: str | None = None
    prompt_embeds: Any = None
    kv_transfer_params: dict[str, Any] | None = None

    @classmethod
    def make(cls, rid: str, tokens: int) -> FakeRequest:
        return cls(rid, tokens, tokens, [1000 + t for t in range(tokens)])

    def names(self, chunk: int = B) -> list[bytes]:
        """Its chunk hashes, as kvpool's chain names them."""
        return ChunkChain(chunk).advance(self.all_token_ids, self.num_tokens)


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


def identity(tp: int = 1, blocks_per_chunk: int = 1, block: int = B) -> EngineIdentity:
    layout = Layout.create(tp=tp, groups=["gqa:2"])
    chunk = block * blocks_per_chunk
    space = key_space(layout, chunk_size=chunk, head_size=32)
    return EngineIdentity(layout, space, block, chunk, 0)


def grouped(groups: list[str]) -> EngineIdentity:
    """TP1 with these KV groups, a chunk per block."""
    layout = Layout.create(tp=1, groups=groups)
    space = key_space(layout, chunk_size=B, head_size=32)  # fmt: skip
    return EngineIdentity(layout, space, B, B, 0)


def side(
    hit: int,
    tp: int = 1,
    events: bool = False,
    blocks_per_chunk: int = 1,
    block: int = B,
    **settings: Any,
) -> tuple[Planner, FakeLookup, FakeManager]:
    lookup, manager = FakeLookup(hit), FakeManager()
    ident = identity(tp, blocks_per_chunk, block)
    s = Planner(ident, ConnectorSettings(**settings), lookup, manager, events, stored_event=event)
    return s, lookup, manager


def event(h: bytes, parent: bytes | None, tokens: list[int], size: int) -> Any:
    """A stored chunk's event, as the planner hands it to ``stored_event``."""
    return (h, parent, tokens, size)


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
    assert load.chunks[0].block_ids == ((102,),) and load.chunks[0].chunk_hash == req.names()[2]
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


def test_saves_say_where_the_pool_lacked_chunks_at_the_lookup() -> None:
    """A worker skips keys it put recently without asking the pool; chunks the
    lookup found missing (evicted since) are put again all the same."""
    s, _, manager = side(hit=2 * B)
    req = FakeRequest.make("r", 5 * B + 7)
    assert s.matched_tokens(req, num_computed_tokens=3 * B) == (0, False)  # local: more
    s.after_alloc(req, 0)
    manager.tables["r"] = (list(range(6)),)
    meta = s.build_meta(step([("r", 3 * B)], {"r": 2 * B + 7}))
    (save,) = meta.saves
    assert [c.chunk for c in save.chunks] == [0, 1, 2, 3, 4] and save.fresh_from == 2
    # No lookup (vLLM's local cache held the whole prompt): the workers decide.
    s2, _, manager2 = side(hit=0)
    short = FakeRequest.make("q", 2 * B)
    assert s2.matched_tokens(short, num_computed_tokens=2 * B) == (0, False)
    s2.after_alloc(short, 0)
    manager2.tables["q"] = (list(range(2)),)
    (save,) = s2.build_meta(step([("q", 0)], {"q": 2 * B})).saves
    assert save.fresh_from is None


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_a_producer_never_loads_and_a_consumer_never_saves(role: str) -> None:
    lookup, manager = FakeLookup(4 * B), FakeManager()
    s = Planner(identity(), ConnectorSettings(), lookup, manager, role=role)
    req = FakeRequest.make("r", 6 * B + 3)
    got = s.matched_tokens(req, 0)
    assert got == ((0, False) if role == "kv_producer" else (4 * B, True))
    assert bool(lookup.calls) is (role != "kv_producer")  # a producer never asks
    s.after_alloc(req, got[0])
    manager.tables["r"] = (list(range(7)),)
    first = s.build_meta(step([("r", 0)], {"r": 6 * B + 3} if not got[0] else {}))
    cached = SimpleNamespace(req_ids=["r"], num_computed_tokens=[got[0]])
    out = step([], {"r": 6 * B + 3 - got[0]})
    out.scheduled_cached_reqs = cached
    later = s.build_meta(out)
    saves = first.saves + later.saves
    assert bool(saves) is (role != "kv_consumer"), saves
    assert bool(first.loads) is (role != "kv_producer")
    s.loads_ended({"r"})
    assert s.finish("r") is (role != "kv_consumer")  # blocks kept only for saves


def planned_saves(chunks: int, **params: Any) -> list[RequestOps]:
    """The save plans of one step computing a whole prompt of ``chunks`` chunks
    (and 3 tokens), whose kv_transfer_params are ``params``."""
    s, _, m = side(hit=0)
    req = FakeRequest.make("r", chunks * B + 3)
    req.kv_transfer_params = params
    s.matched_tokens(req, 0)
    s.after_alloc(req, 0)
    m.tables["r"] = (list(range(chunks + 1)),)
    return s.build_meta(step([("r", 0)], {"r": chunks * B + 3})).saves


def test_a_request_can_limit_or_refuse_its_loads_and_saves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """kv_transfer_params, with the names of vLLM's offloading connector:
    max_load_tokens (0: no lookup), max_offload_tokens (0: no save)."""
    s, lookup, _ = side(hit=5 * B)

    def ask(rid: str, **params: Any) -> tuple[int | None, bool]:
        req = FakeRequest.make(rid, 6 * B + 3)
        req.kv_transfer_params = params
        return s.matched_tokens(req, num_computed_tokens=B)

    assert ask("a") == (4 * B, True)
    assert ask("b", max_load_tokens=2 * B + 7) == (2 * B, True)  # whole chunks
    calls = len(lookup.calls)
    assert ask("c", max_load_tokens=0) == (0, False) and len(lookup.calls) == calls
    caplog.set_level("WARNING", logger="kvpool")
    assert ask("d", max_load_tokens="lots") == (4 * B, True)  # ignored, said once
    assert ask("d", max_load_tokens="lots") == (4 * B, True)
    assert caplog.text.count("max_load_tokens must be a whole number >= 0, got 'lots'") == 1

    def saved(**params: Any) -> list[int]:
        return [c.chunk for ops in planned_saves(6, **params) for c in ops.chunks]

    assert saved() == [0, 1, 2, 3, 4, 5]
    assert saved(max_offload_tokens=2 * B + 5) == [0, 1]
    assert saved(max_offload_tokens=0) == []


def test_a_request_can_pin_what_its_saves_put() -> None:
    """kv_transfer_params.pin_seconds: the save plans carry the pin (at most a day,
    Mooncake's default limit); a bad value pins nothing."""
    from kvpool.connector.planner import MAX_PIN_S

    def pins(**params: Any) -> set[int]:
        saves = planned_saves(3, **params)
        assert [c.chunk for ops in saves for c in ops.chunks] == [0, 1, 2]
        return {ops.pin_ms for ops in saves}

    assert pins() == {0}
    assert pins(pin_seconds=600) == {600_000}
    assert pins(pin_seconds=10 * MAX_PIN_S) == {MAX_PIN_S * 1000}
    assert pins(pin_seconds=-1) == {0} and pins(pin_seconds="1h") == {0}


def test_an_unknown_role_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="kv_role must be one of"):
        Planner(identity(), ConnectorSettings(), FakeLookup(0), FakeManager(), role="x")


def test_failed_load_suppresses_chunks_so_lookups_do_not_loop() -> None:
    s, lookup, _ = side(hit=8 * B, failed_key_ttl_s=60)
    req = FakeRequest.make("r", 8 * B + 3)
    s.worker_output(WorkerReport({req.names()[3]}))
    assert s.matched_tokens(req, 0) == (3 * B, True)
    assert len(lookup.calls[-1]) == 3  # the lookup stops before the failed chunk


def test_suppression_expires_in_order_and_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from kvpool.connector import planner as scheduler

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(scheduler, "_MAX_SUPPRESSED", 3)
    s, lookup, _ = side(hit=8 * B, failed_key_ttl_s=60)
    req = FakeRequest.make("r", 8 * B + 3)
    h = req.names()
    s.worker_output(WorkerReport({h[5]}))
    clock[0] += 30
    s.worker_output(WorkerReport({h[2]}))
    assert s.matched_tokens(req, 0)[0] == 2 * B  # both live: cut at chunk 2
    clock[0] += 31  # chunk 5's suppression ended, chunk 2's has not
    assert s.matched_tokens(req, 0)[0] == 2 * B and list(s._suppressed) == [h[2]]
    clock[0] += 30
    assert s.matched_tokens(req, 0)[0] == 8 * B and not s._suppressed
    # At most _MAX_SUPPRESSED chunks are kept: the oldest go first.
    for k in (1, 3, 4, 6):
        s.worker_output(WorkerReport({h[k]}))
    assert list(s._suppressed) == [h[3], h[4], h[6]]
    assert s.matched_tokens(req, 0)[0] == 3 * B
    assert len(lookup.calls[-1]) == 3


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


def test_no_events_unless_vllm_asks_for_them() -> None:
    s, _, manager = side(hit=0)
    req = FakeRequest.make("r", 2 * B)
    s.matched_tokens(req, 0)
    s.after_alloc(req, 0)
    manager.tables["r"] = (list(range(2)),)
    s.build_meta(step([("r", 0)], {"r": 2 * B}))
    s.worker_output(WorkerReport(stored={req.names()[0]: 1}, fresh={req.names()[0]}))
    assert s.take_events() == []


def test_a_chunk_of_several_blocks_has_one_name_over_its_tokens() -> None:
    s, lookup, manager = side(hit=0, blocks_per_chunk=2)
    lookup.hit = 10**9  # FakeLookup counts hits in blocks of B; cap it below
    req = FakeRequest.make("r", 7 * B + 5)  # 7 full blocks: 3 full chunks of 2 blocks
    h = req.names(2 * B)
    need, _ = s.matched_tokens(req, 0)
    assert lookup.calls[-1] == h
    assert need == 2 * B  # FakeLookup answers len(hashes) * B tokens: 1.5 chunks -> 1
    s.after_alloc(req, need)
    manager.tables["r"] = (list(range(100, 108)),)
    (load,) = s.build_meta(step([], {})).loads
    assert [(c.chunk, c.chunk_hash, c.block_ids) for c in load.chunks] == [(0, h[0], ((100, 101),))]
    # Not aligned to a chunk (local cache has 3 blocks): nothing to load.
    assert s.matched_tokens(FakeRequest.make("q", 7 * B + 5), 3 * B) == (0, False)
    s2, _, manager2 = side(hit=0, blocks_per_chunk=2)
    req2 = FakeRequest.make("w", 5 * B)
    s2.matched_tokens(req2, 0)
    s2.after_alloc(req2, 0)
    manager2.tables["w"] = (list(range(5)),)
    (save,) = s2.build_meta(step([("w", 0)], {"w": 5 * B})).saves
    assert [(c.chunk, c.chunk_hash) for c in save.chunks] == list(enumerate(req2.names(2 * B)))


def test_a_step_with_no_tokens_scheduled_is_idle() -> None:
    s, _, manager = side(hit=4 * B)
    req = FakeRequest.make("r", 8 * B)
    assert s.matched_tokens(req, 0) == (4 * B, True)
    s.after_alloc(req, 4 * B)
    manager.tables["r"] = (list(range(8)),)
    meta = s.build_meta(step([], {}))  # the request waits for its load
    assert meta.loads and meta.idle
    assert not s.build_meta(step([("q", 0)], {"q": 5})).idle


def test_a_finished_request_with_saves_keeps_its_blocks_until_the_workers_release_it() -> None:
    s, _, manager = side(hit=0)
    for rid in ("r", "q"):
        s.matched_tokens(FakeRequest.make(rid, 6 * B), 0)
        s.after_alloc(FakeRequest.make(rid, 6 * B), 0)
        manager.tables[rid] = (list(range(6)),)
    meta = s.build_meta(step([("r", 0), ("q", 0)], {"r": 4 * B, "q": B // 2}))
    assert [c.chunk for c in meta.saves[0].chunks] == [0, 1, 2, 3] and len(meta.saves) == 1
    # "r" had saves handed to the workers, which retry refused ones while vLLM
    # keeps its blocks; "q" had none: freed at once.
    assert s.finish("r") is True
    assert s.finish("q") is False
    assert s.finish("never-seen") is False
    meta = s.build_meta(step([], {}, finished=frozenset({"r", "q"})))
    assert meta.finishing == {"r"} and meta.freed == {"q"}  # zero copy flushes only "q"
    assert meta.saves == [] and meta.loads == []  # its state is gone: nothing planned
    assert s.build_meta(step([], {})).finishing == frozenset()  # named once


def test_a_request_ending_while_its_load_runs_is_left_to_vllm() -> None:
    """vLLM keeps the blocks of a request aborted in WAITING_FOR_REMOTE_KVS and frees
    them when the load is reported; kvpool holding them too would free them twice."""
    s, _, manager = side(hit=4 * B)
    for rid in ("r", "q"):
        req = FakeRequest.make(rid, 8 * B)
        s.matched_tokens(req, 0)
        s.after_alloc(req, 4 * B)
        manager.tables[rid] = (list(range(8)),)
    assert len(s.build_meta(step([], {})).loads) == 2
    state = s._requests["r"]
    state.saved = 2  # saves handed over before (e.g. before a preemption)
    s._requests["q"].saved = 2
    assert s.finish("r") is False  # its load is still in flight
    s.loads_ended({"q"})
    assert s.finish("q") is True


@pytest.mark.parametrize("events, groups", [(True, ["gqa:2"]), (False, ["gqa:2", "gqa:2:w64"])])
def test_blocks_are_not_kept_where_workers_never_retry(events: bool, groups: list[str]) -> None:
    """KV events on, or a group that frees blocks early (a sliding window): no
    retries (``EngineIdentity.holds_for_saves``), so nothing to wait for."""
    manager = FakeManager()
    s = Planner(grouped(groups), ConnectorSettings(), FakeLookup(0), manager, events)
    req = FakeRequest.make("r", 4 * B)
    s.matched_tokens(req, 0)
    s.after_alloc(req, 0)
    manager.tables["r"] = tuple(list(range(4)) for _ in groups)
    assert s.build_meta(step([("r", 0)], {"r": 4 * B})).saves
    assert s.finish("r") is False


def test_engines_with_other_block_sizes_name_a_chunk_alike() -> None:
    """kvpool's own chain, not vLLM's block hashes (whose granularity is the block
    size, and under DCP block size x DCP): an engine at block 32 with chunks of
    two blocks and one at block 64 look up and save the same names. (Whether
    their bytes agree is the fingerprint's matter: on the CPU kernel they do not.)"""
    names = []
    for block, per in ((B, 2), (2 * B, 1)):
        s, lookup, manager = side(hit=0, blocks_per_chunk=per, block=block)
        req = FakeRequest.make("r", 6 * B + 3)
        s.matched_tokens(req, 0)
        s.after_alloc(req, 0)
        manager.tables["r"] = (list(range(6 // per)),)
        (save,) = s.build_meta(step([("r", 0)], {"r": 6 * B + 3})).saves
        names.append((lookup.calls[-1], [c.chunk_hash for c in save.chunks]))
    assert names[0] == names[1] and len(names[0][0]) == 3


def test_mamba_states_are_saved_from_vllms_hand_offs_never_by_position() -> None:
    """A Mamba group's block table holds states at positions vLLM chooses (and
    scratch blocks): kvpool saves a chunk's state only from the step's boundary
    -state hand-off ((group, block, tokens) ending that chunk); its other chunks
    carry the null block, which workers skip."""

    manager = FakeManager()
    s = Planner(grouped(["mamba", "gqa:2"]), ConnectorSettings(), FakeLookup(0), manager)
    req = FakeRequest.make("r", 5 * B)
    s.matched_tokens(req, 0)
    s.after_alloc(req, 0)
    manager.tables["r"] = ([0, 0, 9, 7, 8], [10, 11, 12, 13, 14])  # scratch at 2-4

    def out(scheduled: dict[str, int], done: int, offloads: dict[str, Any]) -> Any:
        o = step([], scheduled)
        o.scheduled_cached_reqs = SimpleNamespace(req_ids=["r"], num_computed_tokens=[done])
        o.kv_connector_block_state = SimpleNamespace(boundary_state_offloads=offloads)
        return o

    # 3 chunks computed; the state after 3 chunks is in block 7; a boundary inside
    # a chunk (B + 5) is no chunk's state.
    meta = s.build_meta(out({"r": 3 * B}, 0, {"r": [(0, 7, 3 * B), (0, 9, B + 5)]}))
    (save,) = meta.saves
    assert [(c.chunk, c.block_ids) for c in save.chunks] == [
        (0, ((NULL_BLOCK,), (10,))),
        (1, ((NULL_BLOCK,), (11,))),
        (2, ((7,), (12,))),
    ]
    # A hand-off for a chunk already saved (its attention went before): only its
    # state; one for a request kvpool does not track: nothing.
    meta = s.build_meta(out({"r": B // 2}, 3 * B, {"r": [(0, 9, 2 * B)], "other": [(0, 4, B)]}))
    (save,) = meta.saves
    assert [(c.chunk, c.block_ids) for c in save.chunks] == [(1, ((9,), (NULL_BLOCK,)))]
    assert save.chunks[0].chunk_hash == req.names()[1]
    # Nothing new: no save at all.
    assert s.build_meta(out({"r": 1}, 3 * B + B // 2, {})).saves == []
    assert s.finish("r") is False  # Mamba states move on: no retries, blocks freed at once


def test_a_chunk_is_a_stored_event_once_every_rank_stored_its_objects() -> None:
    """TP=4 with 2 KV heads: two distinct contents per chunk, written by two ranks."""
    s, _, manager = side(hit=0, tp=4, events=True)
    req = FakeRequest.make("r", 3 * B + 7)
    s.matched_tokens(req, 0)
    s.after_alloc(req, 0)
    manager.tables["r"] = (list(range(4)),)
    meta = s.build_meta(step([("r", 0)], {"r": 3 * B + 7}))
    assert [c.chunk for c in meta.saves[0].chunks] == [0, 1, 2]
    h = req.names()
    # One rank reports chunks 0 and 1; the other rank only chunk 0 so far.
    first = WorkerReport(stored={h[0]: 1, h[1]: 1}, fresh={h[0], h[1]})
    s.worker_output(first.merged(WorkerReport(stored={h[0]: 1})))
    assert s.take_events() == [(h[0], None, req.all_token_ids[:B], B)]
    assert s.take_events() == []
    s.worker_output(WorkerReport(stored={h[1]: 1, h[2]: 1}, fresh={h[2]}))
    # chunk 1 complete; chunk 2 still has one object of two
    assert s.take_events() == [(h[1], h[0], req.all_token_ids[B : 2 * B], B)]
    # A chunk whose objects were all found in the pool already is not announced again.
    s.build_meta(step([("r", 0)], {"r": 3 * B + 7}))
    s.worker_output(WorkerReport(stored={h[2]: 1}))
    assert [e[0] for e in s.take_events()] == [h[2]]
    req2 = FakeRequest.make("r2", 2 * B)
    s.matched_tokens(req2, 0)
    s.after_alloc(req2, 0)
    manager.tables["r2"] = (list(range(2)),)
    s.build_meta(step([("r2", 0)], {"r2": 2 * B}))
    s.worker_output(WorkerReport(stored={h[0]: 2}))  # found, not put
    assert s.take_events() == []


def test_extra_keys_name_chunks_with_their_tokens_and_bad_ones_stop_pooling() -> None:
    """The planner names a chunk by its tokens and ``extra_keys``' answer for them
    (vLLM's: LoRA, multimodal, cache salt); extras without canonical bytes end the
    request's pooling there (no lookup, no save)."""
    lookup, manager = FakeLookup(4 * B), FakeManager()
    s = Planner(identity(), ConnectorSettings(), lookup, manager,
                extra_keys=lambda r, a, b: r.cache_salt)  # fmt: skip
    plain, salted = FakeRequest.make("a", 4 * B), FakeRequest.make("b", 4 * B)
    salted.cache_salt = "tenant-1"
    s.matched_tokens(plain, 0)
    s.matched_tokens(salted, 0)
    a, b = lookup.calls
    assert len(a) == len(b) == 4 and all(x != y for x, y in zip(a, b, strict=True))
    bad = FakeRequest.make("c", 4 * B)
    bad.cache_salt = 1.5  # type: ignore[assignment]  # no canonical bytes
    assert s.matched_tokens(bad, 0) == (0, False) and len(lookup.calls) == 2
    s.after_alloc(bad, 0)
    manager.tables["c"] = (list(range(4)),)
    assert s.build_meta(step([("c", 0)], {"c": 4 * B})).saves == []


@pytest.mark.parametrize("zero_copy", [False, True])
def test_load_by_layer_loads_in_the_computing_step_and_saves_the_rest_after(
    zero_copy: bool,
) -> None:
    """vLLM's sync load, staged or zero copy: the hit is not asynchronous, the plan
    marks it by layer, the request is not waited for as a load in flight, and the
    prompt's new chunks are saved from the next step on (never in the step that
    loads)."""
    s, _, manager = side(hit=4 * B, load_by_layer=True, zero_copy=zero_copy)
    assert s.by_layer
    req = FakeRequest.make("r", 6 * B + 5)
    assert s.matched_tokens(req, 0) == (4 * B, False)
    s.after_alloc(req, 4 * B)
    manager.tables["r"] = (list(range(7)),)
    meta = s.build_meta(step([("r", 4 * B)], {"r": 2 * B + 5}))
    (load,) = meta.loads
    assert load.by_layer and [c.chunk for c in load.chunks] == [0, 1, 2, 3]
    assert meta.saves == []
    assert "r" not in s._loading  # never reported finished: nothing to wait for
    out = step([], {"r": 1})
    out.scheduled_cached_reqs = SimpleNamespace(req_ids=["r"], num_computed_tokens=[6 * B + 5])
    (save,) = s.build_meta(out).saves
    assert [c.chunk for c in save.chunks] == [0, 1, 2, 3, 4, 5]  # workers skip the loaded


@pytest.mark.parametrize(
    "settings, groups",
    [
        ({"load_mode": "direct"}, ["gqa:2"]),
        ({"load_mode": "direct", "zero_copy": True}, ["gqa:2"]),
        ({}, ["gqa:2", "gqa:2:w64"]),
        ({"zero_copy": True}, ["gqa:2", "gqa:2:w64"]),
    ],
)
def test_load_by_layer_stays_asynchronous_where_it_cannot_be_done_safely(
    settings: dict[str, Any], groups: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A direct load from another host into the KV cache cannot be given up at a
    deadline (zero copy waits for its holder on this host), and vLLM maps a sync
    load's failed blocks to requests only with one KV group: loads stay
    asynchronous, said."""
    s = Planner(
        grouped(groups),
        ConnectorSettings(load_by_layer=True, **settings),
        FakeLookup(4 * B),
        FakeManager(),
    )
    assert not s.by_layer
    assert "loads stay asynchronous" in caplog.text
    assert s.matched_tokens(FakeRequest.make("r", 6 * B), 0) == (4 * B, True)


def loads_taking(s: Planner, seconds: float, n: int = 3) -> None:
    """``n`` loads of 8 chunks planned and reported ``seconds`` later (the planner
    times each from ``after_alloc`` to ``loads_ended``)."""
    clock = [1000.0]
    real = time.monotonic
    time.monotonic = lambda: clock[0]
    try:
        for i in range(n):
            req = FakeRequest.make(f"load{i}", 9 * B)
            assert s.matched_tokens(req, 0) == (8 * B, True)
            s.after_alloc(req, 8 * B)
            clock[0] += seconds
            s.loads_ended({f"load{i}"})
            s.forget(f"load{i}")
    finally:
        time.monotonic = real


def test_a_hit_measured_slower_to_load_than_to_compute_is_computed_and_counted_once() -> None:
    """The costs' samples: the workers' forward times, and each load's wait from the
    step that planned it to its report. With loads measured slower than the forward
    computes the same tokens, a hit is answered 0 (vLLM computes it), counted once
    per request however often vLLM asks; forced to load, it loads."""
    for policy, loads in (("measured", False), ("load", True)):
        s, _, _ = side(hit=8 * B, load_decision=policy)
        req = FakeRequest.make("r", 9 * B)
        assert s.matched_tokens(req, 0) == (8 * B, True)  # no samples yet: load
        for _ in range(3):
            s.worker_output(WorkerReport(forward=(512, 0.01)))
            s.worker_output(WorkerReport(forward=(2, 0.001)))  # a decode step
        loads_taking(s, 0.5)
        for _ in range(3):  # vLLM asks again while it cannot schedule the request
            assert s.matched_tokens(req, 0) == ((8 * B, True) if loads else (0, False))
        assert s.recomputed == ((0, 0) if loads else (1, 8 * B))
        s.forget("r")
        s.matched_tokens(FakeRequest.make("r2", 9 * B), 0)
        assert s.recomputed == ((0, 0) if loads else (2, 16 * B))
    # Loads measured fast: hits load.
    s, _, _ = side(hit=8 * B)
    for _ in range(3):
        s.worker_output(WorkerReport(forward=(512, 0.5)))
    loads_taking(s, 0.001)
    d = s.costs.decide(8 * B)
    assert d.load and d.reason == "faster" and d.load_s == pytest.approx(0.001)
    assert s.matched_tokens(FakeRequest.make("r", 9 * B), 0) == (8 * B, True)
    assert s.recomputed == (0, 0)


def test_workers_reports_merge_to_the_slowest_workers_forward() -> None:
    a = WorkerReport(forward=(512, 0.02))
    b = WorkerReport(forward=(512, 0.03))
    merged = a.merged(b)
    assert merged.forward == (512, 0.03)
    assert WorkerReport().merged(a).forward == (512, 0.02)
    assert WorkerReport().merged(WorkerReport()).forward is None


def test_a_step_plan_carries_the_tokens_its_forward_computes() -> None:
    s, _, manager = side(hit=0)
    req = FakeRequest.make("r", 3 * B)
    s.matched_tokens(req, 0)
    manager.tables["r"] = ([1, 2, 3],)
    s.after_alloc(req, 0)
    assert s.build_meta(step([("r", 0)], {"r": 3 * B})).tokens == 3 * B


def test_a_recomputed_hit_saves_only_the_chunks_past_it() -> None:
    """The hit's chunks are in the pool: the request computes them, and saves from
    the end of its hit on."""
    s, _, manager = side(hit=4 * B, load_decision="recompute")
    req = FakeRequest.make("r", 7 * B)
    assert s.matched_tokens(req, 0) == (0, False)
    manager.tables["r"] = ([1, 2, 3, 4, 5, 6, 7],)
    s.after_alloc(req, 0)
    meta = s.build_meta(step([("r", 0)], {"r": 7 * B}))
    assert not meta.loads
    assert [c.chunk for c in meta.saves[0].chunks] == [4, 5, 6]
    assert s.recomputed == (1, 4 * B)

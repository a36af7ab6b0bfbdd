"""vLLM's parts of the scheduler half (``kvpool.vllm.scheduler.SchedulerSide``): its
chunk names take vLLM's extra keys, its stored chunks are ``BlockStored`` events, its
plans are ``KVPoolMetadata``. The rest of the planner: ``tests/unit/test_planner.py``."""

from __future__ import annotations

from types import SimpleNamespace

from tests.unit.test_planner import B, FakeLookup, FakeManager, FakeRequest, identity, step

from kvpool.settings import ConnectorSettings
from kvpool.vllm.metadata import KVPoolMetadata, KVPoolWorkerMetadata
from kvpool.vllm.scheduler import SchedulerSide


def side(
    hit: int, tp: int = 1, events: bool = False
) -> tuple[SchedulerSide, FakeLookup, FakeManager]:
    lookup, manager = FakeLookup(hit), FakeManager()
    return (
        SchedulerSide(identity(tp), ConnectorSettings(), lookup, manager, events),
        lookup,
        manager,
    )


def test_plans_are_vllms_metadata() -> None:
    s, _, manager = side(hit=0)
    req = FakeRequest.make("r", 2 * B)
    s.matched_tokens(req, 0)
    s.after_alloc(req, 0)
    manager.tables["r"] = (list(range(2)),)
    meta = s.build_meta(step([("r", 0)], {"r": 2 * B}))
    assert isinstance(meta, KVPoolMetadata) and [c.chunk for c in meta.saves[0].chunks] == [0, 1]


def test_a_stored_chunk_is_a_vllm_block_stored_event() -> None:
    """When events count a chunk stored (``tests/unit/test_planner.py``: every rank's
    objects, summed by ``aggregate``), the event is vLLM's ``BlockStored``."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext

    s, _, manager = side(hit=0, tp=4, events=True)
    req = FakeRequest.make("r", 2 * B + 7)
    s.matched_tokens(req, 0)
    s.after_alloc(req, 0)
    manager.tables["r"] = (list(range(3)),)
    s.build_meta(step([("r", 0)], {"r": 2 * B + 7}))
    h = req.names()
    one = KVPoolWorkerMetadata(stored={h[0]: 1, h[1]: 1}, fresh={h[0], h[1]})
    s.worker_output(one.aggregate(KVPoolWorkerMetadata(stored={h[0]: 1, h[1]: 1})))
    first, second = s.take_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes == [ext(h[0])] and first.parent_block_hash is None
    assert second.block_hashes == [ext(h[1])] and second.parent_block_hash == ext(h[0])
    assert first.token_ids == req.all_token_ids[:B] and first.block_size == B


def test_lora_and_cache_salt_give_other_names() -> None:
    s, lookup, _ = side(hit=0)
    plain = FakeRequest.make("a", 4 * B)
    salted = FakeRequest.make("b", 4 * B)
    salted.cache_salt = "tenant-1"
    lora = FakeRequest.make("c", 4 * B)
    lora.lora_request = SimpleNamespace(lora_name="l", lora_path="/adapters/l")
    for r in (plain, salted, lora):
        s.matched_tokens(r, 0)
    a, b, c = lookup.calls
    assert len(a) == len(b) == len(c) == 4
    assert all(x != y and x != z and y != z for x, y, z in zip(a, b, c, strict=True))


def test_a_request_whose_extras_cannot_be_hashed_is_never_pooled() -> None:
    s, lookup, manager = side(hit=4 * B)
    req = FakeRequest.make("r", 4 * B)
    req.lora_request = SimpleNamespace(lora_name="l", lora_path=1.5)  # no canonical bytes
    assert s.matched_tokens(req, 0) == (0, False) and lookup.calls == []
    s.after_alloc(req, 0)
    manager.tables["r"] = (list(range(4)),)
    assert s.build_meta(step([("r", 0)], {"r": 4 * B})).saves == []

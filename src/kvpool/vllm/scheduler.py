"""vLLM's scheduler half: ``kvpool.connector.planner.Planner`` with vLLM's parts.

SchedulerSide(identity, settings, lookup, kv_cache_manager, events, role)
    a ``Planner`` whose chunk names take vLLM's extra keys
    (``generate_block_hash_extra_keys``: LoRA, multimodal inputs, cache salt),
    whose stored chunks are vLLM ``BlockStored`` events, and whose step plans
    are ``KVPoolMetadata``. What it plans, and why: ``kvpool.connector.planner``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash

from kvpool.connector.identity import EngineIdentity
from kvpool.connector.planner import MAX_PIN_S, Lookup, Planner
from kvpool.settings import ConnectorSettings
from kvpool.vllm.metadata import KVPoolMetadata

__all__ = ["MAX_PIN_S", "Lookup", "SchedulerSide"]


def _extra_keys(request: Any, start: int, end: int) -> Any:
    return generate_block_hash_extra_keys(request, start, end, 0)[0]


def _block_stored(h: bytes, parent: bytes | None, tokens: list[int], size: int) -> BlockStored:
    return BlockStored(
        block_hashes=[maybe_convert_block_hash(h)],
        parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
        token_ids=tokens,
        block_size=size,
        lora_id=None,
        medium="cpu",  # the pool's host memory, as vLLM's other CPU tiers
        lora_name=None,
    )


class SchedulerSide(Planner):
    """A ``Planner`` with vLLM's extra keys, KV events and metadata."""

    def __init__(
        self,
        identity: EngineIdentity,
        settings: ConnectorSettings,
        lookup: Lookup,
        kv_cache_manager: Any = None,
        events: bool = False,
        role: str = "kv_both",
    ) -> None:
        super().__init__(
            identity,
            settings,
            lookup,
            kv_cache_manager,
            events,
            role,
            extra_keys=_extra_keys,
            stored_event=_block_stored,
            new_plan=KVPoolMetadata,
        )

"""What an engine is, in kvpool's terms: its layout, key space, block and chunk size.

    EngineIdentity(layout, space, block_size, chunk_size, dp_index)
    identity.blocks_per_chunk       vLLM blocks per pool object
    identity.frees_blocks_early(groups)
                                    the first KV group that frees a running
                                    request's blocks (a sliding window, a Mamba
                                    state moving on), or None: the one rule for
                                    drains (the scheduler) and zero copy (workers)
    identity.keeps_blocks           no group does
    identity.holds_for_saves(events)
                                    vLLM keeps a finished request's blocks until
                                    its saves are done: the one rule for drains
                                    (the scheduler), retries and saves copied off
                                    the forward's path (workers)

Pure; ``kvpool.vllm.identity.engine_identity`` reads one from vLLM's config.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvpool.keys import KeySpace
from kvpool.layout import GroupSpec, Layout

__all__ = ["EngineIdentity"]


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    layout: Layout
    space: KeySpace
    block_size: int  # tokens per vLLM block
    chunk_size: int  # tokens per pool object (a multiple of block_size)
    dp_index: int

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def keeps_blocks(self) -> bool:
        """Every KV group keeps a running request's blocks until it finishes or is
        preempted (no sliding window, no Mamba state moving on), on every rank."""
        return self.frees_blocks_early() is None

    def holds_for_saves(self, events: bool) -> bool:
        """vLLM keeps a finished request's blocks until its saves are done: with KV
        events off (a chunk's event waits for its save, never the blocks) and every
        group keeping a running request's blocks."""
        return not events and self.keeps_blocks

    def frees_blocks_early(self, groups: Iterable[int] | None = None) -> GroupSpec | None:
        """The first KV group (of vLLM's group indices ``groups``; all by default)
        that frees blocks of a running request before it ends (a sliding window, a
        Mamba state moving on), or None: the one rule for drains and zero copy."""
        indices = range(len(self.layout.groups)) if groups is None else groups
        return next((self.layout.groups[g] for g in indices
                     if not self.layout.groups[g].every_chunk), None)  # fmt: skip

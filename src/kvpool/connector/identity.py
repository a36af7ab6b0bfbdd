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

    chunk_tokens(chunk_size, block_size, groups)
                                    tokens per pool object: the setting, or one
                                    block; a whole number of blocks, and one block
                                    where a group frees blocks one by one
    settings_layout(shape, layer_bands, heads_per_object, token_classes)
                                    the engine's layout with the object-grid
                                    settings; ``ConfigError`` when they do not fit

Pure; ``kvpool.vllm.identity.engine_identity`` reads one from vLLM's config.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.errors import ConfigError, LayoutError
from kvpool.keys import KeySpace
from kvpool.layout import GroupSpec, Layout

__all__ = ["EngineIdentity", "chunk_tokens", "settings_layout"]


def chunk_tokens(chunk_size: int, block_size: int, groups: Sequence[GroupSpec]) -> int:
    """Tokens per pool object: ``chunk_size`` (the setting; 0 = one block of
    ``block_size`` tokens). ``ConfigError`` unless a whole number of blocks, and
    one block where a group frees blocks one by one (a sliding window) or keeps a
    state per block (Mamba)."""
    chunk = chunk_size or block_size
    if chunk != block_size and any(not g.every_chunk for g in groups):
        raise ConfigError(
            f"chunk_size={chunk} with sliding-window or Mamba layers: vLLM frees a "
            "window's blocks one by one and keeps a state per block, so a pool object "
            f"must be one block ({block_size} tokens); unset chunk_size"
        )
    if chunk % block_size:
        raise ConfigError(
            f"chunk_size={chunk} must be a multiple of the block size {block_size} "
            "(or unset: one block per pool object)"
        )
    return chunk


def settings_layout(
    shape: Mapping[str, Any],
    layer_bands: Sequence[int] = (),
    heads_per_object: int = 1,
    token_classes: int = 0,
) -> Layout:
    """The layout of an engine of ``shape`` (``Layout.create``'s arguments;
    ``LayoutError`` when kvpool cannot pool it) with the object-grid settings:
    ``layer_bands`` (empty: where each PP stage begins), ``heads_per_object``,
    ``token_classes`` (0: the DCP size). ``ConfigError`` when the settings do not
    fit the engine: the user fixes them."""
    layout = Layout.create(**shape)
    grid: dict[str, Any] = {
        "layer_bands": list(layer_bands) or None,
        "heads_per_object": heads_per_object,
        "token_classes": token_classes or None,
    }
    if grid == {"layer_bands": None, "heads_per_object": 1, "token_classes": None}:
        return layout
    try:
        return Layout.create(**shape, **grid)
    except LayoutError as exc:
        raise ConfigError(str(exc)) from exc


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

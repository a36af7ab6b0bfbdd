"""A paged KV cache in vLLM's CPU layout, for benchmarks: its shape, its blocks.

    KVShape(layers, block_size, kv_heads, head_size)   one KV group, float32
    kv_shape_for(size, layers)   a realistic shape whose one-block chunk object
                                 has exactly ``size`` bytes
    PagedKV(shape, num_blocks)   the blocks in one contiguous float32 allocation
                                 (or given ``memory``): per layer a view
                                 ``[num_blocks, 2, block_size, kv_heads*head_size]``;
                                 ``segments(block_ids)`` per object one segment
                                 per layer, ``equal`` compares blocks bit for bit

Used by ``bench.transfer`` and ``bench.hooks``; imports torch, not vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvpool.store.scatter import Segment

__all__ = ["KVShape", "KiB", "MiB", "PagedKV", "Progress", "kv_shape_for"]

KiB, MiB = 1 << 10, 1 << 20
_DTYPE_BYTES = 4  # float32, as vLLM's CPU backend runs the tiny models

Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass(frozen=True, slots=True)
class KVShape:
    """One KV cache group in vLLM's CPU layout, float32."""

    layers: int
    block_size: int  # tokens per block (= per chunk object)
    kv_heads: int
    head_size: int

    @property
    def row_elems(self) -> int:
        return self.kv_heads * self.head_size

    @property
    def layer_block_nbytes(self) -> int:
        """Bytes of one block of one layer (K and V): one segment of an object."""
        return 2 * self.block_size * self.row_elems * _DTYPE_BYTES

    @property
    def object_nbytes(self) -> int:
        """Bytes of one chunk object: one block over all layers."""
        return self.layers * self.layer_block_nbytes

    def __str__(self) -> str:
        return f"{self.layers}L x [2, {self.block_size}, {self.kv_heads}x{self.head_size}] f32"


def kv_shape_for(size: int, layers: int = 8) -> KVShape:
    """A realistic shape whose one-block object has exactly ``size`` bytes.

    Tries ``layers`` layers first (then fewer), block sizes 32, 64, 128, 16 and
    head sizes 64, 128, 32 (what vLLM's CPU attention supports), with 1..64 KV
    heads. Raises ``ValueError`` if nothing fits.
    """
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    tries = sorted({layers, *(n for n in (8, 4, 2, 1) if n < layers)}, reverse=True)
    for n in tries:
        for block_size in (32, 64, 128, 16):
            for head_size in (64, 128, 32):
                per_head = n * 2 * block_size * head_size * _DTYPE_BYTES
                if size % per_head == 0 and 1 <= size // per_head <= 64:
                    return KVShape(n, block_size, size // per_head, head_size)
    raise ValueError(
        f"no float32 KV shape with up to {layers} layers gives {size}-byte objects; "
        "pick a multiple of 16 KiB between 16 KiB and 64 MiB, e.g. 256KiB or 1MiB"
    )


class PagedKV:
    """``num_blocks`` blocks of ``shape`` in one contiguous allocation (or ``memory``)."""

    def __init__(self, shape: KVShape, num_blocks: int, memory: torch.Tensor | None = None) -> None:
        self.shape, self.num_blocks = shape, num_blocks
        per_layer = num_blocks * 2 * shape.block_size * shape.row_elems
        n = shape.layers * per_layer
        if memory is None:
            self.flat = torch.empty(n, dtype=torch.float32)
        else:
            self.flat = memory.view(torch.uint8)[: n * _DTYPE_BYTES].view(torch.float32)
        self.layers = [
            (
                f"model.layers.{i}.self_attn.attn",
                self.flat[i * per_layer : (i + 1) * per_layer].view(
                    num_blocks, 2, shape.block_size, shape.row_elems
                ),
            )
            for i in range(shape.layers)
        ]
        self.base = int(self.flat.data_ptr())
        self.nbytes = n * _DTYPE_BYTES
        self.layer_stride = per_layer * _DTYPE_BYTES

    @property
    def bytes(self) -> npt.NDArray[np.uint8]:
        return self.flat.view(torch.uint8).numpy()

    def segments(self, block_ids: npt.NDArray[np.int64]) -> list[list[Segment]]:
        """Per object (one block id each): one segment per layer, in layer order."""
        n = self.shape.layer_block_nbytes
        return [
            [(self.base + layer * self.layer_stride + int(b) * n, n)
             for layer in range(self.shape.layers)]
            for b in block_ids
        ]  # fmt: skip

    def equal(
        self, ids: npt.NDArray[np.int64], other: PagedKV, other_ids: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.bool_]:
        """Per object: do blocks ``ids`` here hold the bytes of ``other_ids`` there?"""
        same = torch.ones(len(ids), dtype=torch.bool)
        mine, theirs = torch.from_numpy(ids), torch.from_numpy(other_ids)
        for (_, a), (_, b) in zip(self.layers, other.layers, strict=True):
            x = a.view(torch.int32).index_select(0, mine).flatten(1)  # bits, not floats (NaN)
            y = b.view(torch.int32).index_select(0, theirs).flatten(1)
            same &= (x == y).all(dim=1)
        out: npt.NDArray[np.bool_] = same.numpy()
        return out

"""KV shapes of real models, for benchmarks and the demo at real sizes.

    SHAPES[name]            a ModelShape: layers, KV heads, head size, dtype
    ModelShape.kv_bytes_per_token   bytes of K and V per token over all layers
    ModelShape.kv_cache_gib(tokens) whole GiB of KV cache that hold that many tokens
    parse_shape(text)       a name from SHAPES, or ``LxHxD:dtype`` (e.g. 16x8x128:float32)
    ModelShape.flop_per_kv_byte(hidden, intermediate, heads=None)
                            a dense forward's FLOP per token over the KV bytes it
                            makes: what decides whether loading a prefix beats
                            computing it (``LLAMA3_8B_FLOP_PER_KV_BYTE`` for scale)

Only the KV cache is real: benchmarks build a random Llama with this many
layers, KV heads and head size and a tiny hidden size (``TINY_HIDDEN``), so
prefill stays cheap while every byte the pool moves is a real model's. The
query heads equal the KV heads (what kvpool moves does not depend on them).
MLA models (DeepSeek-V3's 70 KiB latent) are not here: vLLM's CPU build has no
MLA attention backend to run them on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["LLAMA3_8B_FLOP_PER_KV_BYTE", "SHAPES", "TINY_HIDDEN", "ModelShape", "parse_shape"]

TINY_HIDDEN = 128  # the random model's hidden size, whatever its KV shape

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"dtype must be one of {', '.join(_ITEMSIZE)}, got {self.dtype!r}")
        if self.head_dim < 32 or min(self.layers, self.kv_heads) < 1:
            raise ValueError(
                "a shape needs layers >= 1, KV heads >= 1 and head size >= 32 "
                f"(vLLM's CPU attention), got {self.layers}x{self.kv_heads}x{self.head_dim}"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * _ITEMSIZE[self.dtype]

    def kv_cache_gib(self, tokens: int) -> int:
        """Whole GiB of KV cache that hold ``tokens`` tokens of this shape (vLLM's
        ``VLLM_CPU_KVCACHE_SPACE``)."""
        return max(1, -(-tokens * self.kv_bytes_per_token // (1 << 30)))

    def flop_per_kv_byte(self, hidden: int, intermediate: int, heads: int | None = None) -> float:
        """FLOP of one token's dense forward (2 per weight of the attention
        projections and the gated MLP; attention scores left out) over the KV bytes
        it writes. ``heads``: query heads (the bench models have as many as KV heads)."""
        q = (heads or self.kv_heads) * self.head_dim
        kv = self.kv_heads * self.head_dim
        weights = 2 * hidden * q + 2 * hidden * kv + 3 * hidden * intermediate
        return 2 * weights / (2 * kv * _ITEMSIZE[self.dtype])

    def describe(self) -> str:
        kib = self.kv_bytes_per_token / 1024
        return (
            f"{self.name} ({self.layers} layers, {self.kv_heads} KV heads x {self.head_dim}, "
            f"{self.dtype}: {kib:g} KiB of KV per token)"
        )


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama3-8b", 32, 8, 128),  # also Mistral-7B: 128 KiB/token
        ModelShape("qwen2.5-7b", 28, 4, 128),  # 56 KiB/token
        ModelShape("llama3-70b-tp8", 80, 1, 128),  # one TP8 rank: 40 KiB/token
        ModelShape("llama3-8b-f32-half", 16, 8, 128, "float32"),  # 128 KiB/token, half the layers
        ModelShape("small", 8, 8, 64, "float32"),  # the old default: 32 KiB/token
        # bench trace's default: 4 KiB/token, so a hidden size of 1536 gives it
        # Llama-3-8B's compute per KV byte at a cost this machine can serve
        ModelShape("small-gqa", 8, 2, 64),
    )
}

# Llama-3-8B (hidden 4096, MLP 14336, 32 query heads), by ``flop_per_kv_byte``: 106k.
LLAMA3_8B_FLOP_PER_KV_BYTE = SHAPES["llama3-8b"].flop_per_kv_byte(4096, 14336, heads=32)

_CUSTOM = re.compile(r"(\d+)x(\d+)x(\d+)(?::(\w+))?")


def parse_shape(text: str) -> ModelShape:
    """A shape by name, or ``LAYERSxKV_HEADSxHEAD_DIM[:dtype]``."""
    if text in SHAPES:
        return SHAPES[text]
    m = _CUSTOM.fullmatch(text)
    if not m:
        raise ValueError(
            f"unknown shape {text!r}: use one of {', '.join(SHAPES)} or LxHxD[:dtype] "
            "(layers, KV heads, head size; e.g. 16x8x128:float32)"
        )
    layers, heads, dim = (int(m.group(i)) for i in (1, 2, 3))
    return ModelShape(text, layers, heads, dim, m.group(4) or "bfloat16")

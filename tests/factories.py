"""Recipes many tests share, in one place.

key_space(layout, model="m", dtype="f32", chunk_size=32, head_size=64, num_layers=2)
                                a ``KeySpace`` of a small model
wait_until(cond, timeout, step) poll a condition against a deadline (``kvpool.pool``'s)
"""

from __future__ import annotations

from kvpool.keys import KeySpace
from kvpool.layout import Layout
from kvpool.pool import wait_until

__all__ = ["key_space", "wait_until"]


def key_space(
    layout: Layout,
    model: str = "m",
    *,
    dtype: str = "f32",
    chunk_size: int = 32,
    head_size: int = 64,
    num_layers: int = 2,
    tenant: str = "",
) -> KeySpace:
    """The key space of a ``num_layers``-layer model ``model`` in ``layout``, KV and
    weights both ``dtype``."""
    return KeySpace.create(
        model=model,
        layout=layout,
        kv_dtype=dtype,
        model_dtype=dtype,
        chunk_size=chunk_size,
        head_size=head_size,
        num_layers=num_layers,
        tenant=tenant,
    )

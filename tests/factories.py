"""Recipes many tests share, in one place.

key_space(layout, model="m", dtype="f32", chunk_size=32, head_size=64, num_layers=2)
                                a ``KeySpace`` of a small model
wait_until(cond, timeout, step) poll a condition against a deadline (``kvpool.pool``'s)
same_outputs(run, base)         assert equal greedy tokens and logprobs, prompt by prompt
                                (two ``run_engine`` results)
base_and_two(run_engine, spec)  an engine without the connector, then engine A and
                                fresh engine B with it: ``spec(connector)`` is a run's
                                spec for "none" or "kvpool"
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.keys import KeySpace
from kvpool.layout import Layout
from kvpool.pool import wait_until

__all__ = ["base_and_two", "key_space", "same_outputs", "wait_until"]

Run = dict[str, Any]


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


def same_outputs(run: Run, base: Run) -> None:
    """Exactly the same greedy tokens and logprobs, prompt by prompt."""
    assert [r["tokens"] for r in run["results"]] == [r["tokens"] for r in base["results"]]
    assert [r["logprobs"] for r in run["results"]] == [r["logprobs"] for r in base["results"]]


def base_and_two(
    run_engine: Callable[[Run], Run], spec: Callable[[str], Run]
) -> tuple[Run, Run, Run]:
    """A run without the connector, then two engines with kvpool in turn (A saves,
    fresh B finds A's prefixes in the pool)."""
    base = run_engine(spec("none"))
    return base, run_engine(spec("kvpool")), run_engine(spec("kvpool"))

"""``kvpool.connector.shards``: a rank's KV tensors cut into the shards it holds,
as views of the engine's own memory (no vLLM needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvpool.connector.shards import shard_views
from kvpool.errors import UnsupportedEngine
from kvpool.layout import Layout

BLOCKS, BS, HEAD = 3, 32, 8


def _layers(n: int, heads: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"model.layers.{i}.attn", torch.randn(BLOCKS, heads, BS, 2 * HEAD)) for i in range(n)]


def _index(name: str) -> int:
    return int(name.split(".")[2])


def test_each_shard_is_its_heads_and_band_of_the_layers_as_views() -> None:
    layout = Layout.create(tp=2, groups=["gqa:8"], layers=4, layer_bands=[0, 2],
                           heads_per_object=2)  # fmt: skip
    layers = _layers(4, 4)  # rank 1 holds global KV heads 4-7
    views, shards = shard_views(layout, 1, {0: layers}, _index)
    held = layout.holdings(1, 0)
    assert [c for c, _ in shards[0]] == list(held) and len(views) == len(held) == 4
    for c, i in shards[0]:
        band = layout.band_layers(c.band)
        heads = layout.local_heads(1, c)
        assert [name for name, _ in views[i]] == [n for n, _ in layers if _index(n) in band]
        tensors = dict(layers)
        for name, view in views[i]:
            t = tensors[name]
            assert view.data_ptr() == t[:, heads.start].data_ptr()  # a view, not a copy
            assert torch.equal(view, t[:, heads.start : heads.stop])
    # every (layer, local head) of the rank is in exactly one shard
    seen = [(name, view.data_ptr()) for v in views for name, view in v]
    assert len(seen) == len(set(seen)) == 4 * 2


def test_a_tensor_without_the_ranks_heads_on_axis_1_is_refused_naming_it() -> None:
    layout = Layout.create(tp=1, groups=["gqa:4"], layers=1)
    bad = [("model.layers.0.attn", torch.randn(BLOCKS, BS, 3, 2 * HEAD))]
    with pytest.raises(UnsupportedEngine, match=r"model\.layers\.0\.attn"):
        shard_views(layout, 0, {0: bad}, _index)


def test_the_connector_core_imports_no_vllm() -> None:
    code = (
        "import sys, kvpool.connector.shards, kvpool.connector.drain, kvpool.chunks, "
        "kvpool.connector.planner, kvpool.connector.steps, kvpool.connector.identity\n"
        "print(sorted({'vllm', 'mooncake', 'zmq'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

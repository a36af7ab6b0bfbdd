"""A rank's KV tensors cut into the shards it holds: one list of views per shard.

    shard_views(layout, rank, groups, layer_index)
                          for each local group (``{group: [(layer name, tensor)]}``,
                          vLLM's per-layer views ``[blocks, heads, block_size,
                          2 * head_size]``, MLA ``[blocks, tokens, latent]``): per
                          shard this rank holds (``Layout.holdings``), its KV heads'
                          slice of the layers of its layer band, cut into its token
                          class. Returns (views, shards): ``views[i]`` the named
                          views of one shard (a transfer engine group),
                          ``shards[group]`` the (content, i) pairs of that group
    token_class(name, t, n, k, step)
                          the rows of every block of ``t`` in token class ``k`` of
                          ``n`` (runs of ``step`` tokens): a view, no copy
    layer_number(name)    the one number among a layer name's dotted parts
                          (``model.layers.12.attn``: 12), a ``layer_index`` for
                          engines without vLLM's rule

Views only: nothing is copied, so a shard's bytes are the engine's KV cache. A
tensor that cannot be cut as the layout says (heads not on axis 1, a block not
divisible into the token classes, a layer outside its stage's bands) raises
``UnsupportedEngine`` naming the tensor and what to change. ``layer_index`` maps
a layer name to the model's layer index (vLLM's rule, passed in: this package
imports no vLLM). Torch only, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from kvpool.errors import UnsupportedEngine
from kvpool.layout import ContentId, Layout

__all__ = ["NamedViews", "layer_number", "shard_views", "token_class"]

NamedViews = list[tuple[str, torch.Tensor]]


def token_class(name: str, t: torch.Tensor, n: int, k: int, step: int) -> torch.Tensor:
    """The rows of every block of ``t`` in token class ``k`` of ``n`` (runs of
    ``step`` tokens, ``Layout.local_tokens``): the third axis of vLLM's
    ``[blocks, heads, block_size, 2 * head_size]`` (MLA: ``[blocks, tokens, latent]``)
    viewed as ``[-1, n, step]``, index ``k`` of the middle axis. On a token-major
    layout (DCP's GPU kernels) these rows are tokens; vLLM's CPU kernel stores a
    block's K head_size-major, so there a class is a fixed set of its rows (it
    round-trips; the CPU build runs no DCP)."""
    dim = 2 if t.dim() == 4 else 1
    if t.dim() not in (3, 4) or t.shape[dim] % (n * step):
        raise UnsupportedEngine(
            f"KV tensor {name} has shape {tuple(t.shape)}: kvpool cannot cut its blocks' "
            f"tokens into {n} classes of runs of {step}; lower token_classes"
        )
    shape = [*t.shape[:dim], t.shape[dim] // (n * step), n, step, *t.shape[dim + 1 :]]
    return t.view(shape).select(dim + 1, k)


def shard_views(
    layout: Layout,
    rank: int,
    groups: Mapping[int, Sequence[tuple[str, torch.Tensor]]],
    layer_index: Callable[[str], int],
) -> tuple[list[NamedViews], dict[int, list[tuple[ContentId, int]]]]:
    """See the module docstring."""
    views: list[NamedViews] = []
    shards: dict[int, list[tuple[ContentId, int]]] = {}
    for g, layers in groups.items():
        held = layout.holdings(rank, g)
        # Each shard's run of the rank's local KV heads (heads_per_object of them).
        spans = {c.head: layout.local_heads(rank, c) for c in held}
        heads = max(r.stop for r in spans.values())
        if len(spans) > 1:
            for name, t in layers:
                if t.dim() != 4 or t.shape[1] != heads:
                    raise UnsupportedEngine(
                        f"KV tensor {name} has shape {tuple(t.shape)}, not vLLM's "
                        f"[blocks, heads, block_size, 2 * head_size] with this rank's {heads} "
                        "KV heads; kvpool cannot name its heads"
                    )
        banded = len({c.band for c in held}) > 1
        index = {name: layer_index(name) for name, _ in layers} if banded else {}
        shards[g] = []
        for c in held:
            mine = list(layers)
            if banded:
                band = layout.band_layers(c.band)
                mine = [(name, t) for name, t in layers if index[name] in band]
                if not mine:
                    raise UnsupportedEngine(
                        f"layer band {band.start}-{band.stop - 1} holds no layer of KV "
                        f"group {g}; choose layer_bands so that every band holds layers "
                        "of every group"
                    )
            if len(spans) > 1:
                r = spans[c.head]
                mine = [(name, t.narrow(1, r.start, len(r))) for name, t in mine]
            n, k, step = layout.local_tokens(rank, c)
            if n > 1:
                mine = [(name, token_class(name, t, n, k, step)) for name, t in mine]
            shards[g].append((c, len(views)))
            views.append(mine)
        if banded and not set(index.values()) <= {
            layer for c in held for layer in layout.band_layers(c.band)
        }:
            raise UnsupportedEngine(
                f"KV group {g}'s layers {sorted(index.values())} on this rank are not "
                f"all inside its PP stage's layer bands; kvpool cannot name them"
            )
    return views, shards


def layer_number(name: str) -> int:
    """The one number among a KV layer name's dotted parts (``model.layers.12.attn``:
    12); ``UnsupportedEngine`` when there is not exactly one."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise UnsupportedEngine(
            f"KV layer {name!r} has no layer index kvpool can read; layer bands need it"
        )
    return numbers[0]

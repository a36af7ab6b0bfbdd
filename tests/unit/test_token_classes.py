"""Token classes under DCP: the worker's views of a block's token rows
(``Layout.local_tokens`` and the ``connector.shards.token_class``) against vLLM's
placement of a block-table entry's tokens on DCP ranks. vLLM's CPU build runs
no DCP, so DCP ranks' tensors are built here by that placement rule."""

from __future__ import annotations

import pytest
import torch

from kvpool.connector.shards import token_class
from kvpool.layout import Layout


def _rank_blocks(virtual: torch.Tensor, dcp: int, rank: int, step: int) -> torch.Tensor:
    """DCP rank ``rank``'s physical blocks: vLLM puts virtual offset o of an entry on
    rank (o // step) % dcp, at local row (o // (dcp * step)) * step + o % step."""
    tokens = virtual.shape[2]
    rows = [o for o in range(tokens) if (o // step) % dcp == rank]
    local = sorted(rows, key=lambda o: (o // (dcp * step)) * step + o % step)
    return virtual[:, :, local, :].contiguous()


@pytest.mark.parametrize(("classes", "step"), [(2, 1), (4, 1), (4, 2), (8, 4)])
def test_each_token_class_holds_the_same_tokens_at_every_dcp_size(classes: int, step: int) -> None:
    """A block-table entry of 64 tokens, each token's content its virtual offset:
    for every DCP size dividing the grid, each rank's view of each class it holds
    lists exactly the tokens of that class, in order, the same at every size."""
    tokens, heads = 64, 2
    virtual = torch.arange(tokens).repeat(3, heads, 1).unsqueeze(-1).repeat(1, 1, 1, 4).float()
    want = {c: [o for o in range(tokens) if (o // step) % classes == c] for c in range(classes)}
    for dcp in (d for d in (1, 2, 4, 8) if classes % d == 0):
        layout = Layout.create(tp=dcp, dcp=dcp, groups=["mla"], token_classes=classes,
                               interleave=step)  # fmt: skip
        seen = set()
        for rank in layout.ranks:
            block = _rank_blocks(virtual, dcp, layout.coord(rank).dcp_rank, step)
            for content in layout.holdings(rank, 0):
                n, k, run = layout.local_tokens(rank, content)
                view = token_class("t", block, n, k, run) if n > 1 else block
                got = view[1, 0].reshape(-1, 4)[:, 0].tolist()
                assert got == want[content.dcp_rank], (dcp, rank, content)
                seen.add(content.dcp_rank)
        assert seen == set(range(classes))

"""Copy kernels between this rank's paged KV tensors and a staging buffer.

    KVCopier(groups, tensors, staging)  word views of every KV allocation
    gather(chunks, offsets)   KV blocks -> staging (a save), one indexed copy per
                              run of one group's objects and KV allocation
    scatter(chunks, offsets)  staging -> KV blocks (a staged load), likewise

``chunks`` are sorted by group and each group's objects lie back to back in
staging from the offset of its first chunk (``pieces.place``). Copies move the
widest integer word that divides a row: indexed copies of bytes are several
times slower than of 8-byte words. CPU tensors copy through numpy (its fancy
indexing releases the GIL and ran ~2x ``index_copy_``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvpool.kvcache import GroupKV
from kvpool.transfer.records import ChunkRef

__all__ = ["KVCopier", "word"]


def word(nbytes: int) -> torch.dtype:
    """The widest integer dtype whose size divides ``nbytes``."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if nbytes % size == 0:
            return dtype
    return torch.uint8


class KVCopier:
    """See the module docstring."""

    def __init__(
        self,
        groups: Sequence[GroupKV],
        tensors: Sequence[Sequence[tuple[str, torch.Tensor]]],
        staging: torch.Tensor,
    ) -> None:
        self.groups = groups
        self.staging = staging.view(-1)
        # Views of each distinct allocation as (rows, row_bytes / w) words.
        self.views: list[list[torch.Tensor]] = []
        for spec, layers in zip(groups, tensors, strict=True):
            by_base = {int(t.untyped_storage().data_ptr()): t for _, t in layers}
            views = []
            for region in spec.regions:
                t = by_base[region.base]
                flat = torch.empty(0, dtype=torch.uint8, device=t.device)
                flat.set_(t.untyped_storage(), 0, (region.nbytes,))  # type: ignore[call-overload]
                views.append(flat.view(word(region.row_bytes)).view(region.num_rows, -1))
            self.views.append(views)

    def _runs(
        self, chunks: Sequence[ChunkRef], offsets: Sequence[int]
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per (group, region) entry: (KV rows view, staging rows view, row indices)."""
        i = 0
        while i < len(chunks):
            g = chunks[i].group
            j = i
            while j < len(chunks) and chunks[j].group == g:
                j += 1
            spec = self.groups[g]
            ids = np.array([c.block_ids for c in chunks[i:j]], dtype=np.int64)
            pos = offsets[i]
            for region, rows in spec.rows(ids):
                row_bytes = spec.regions[region].row_bytes
                n = rows.size * row_bytes
                dst = self.staging[pos : pos + n].view(word(row_bytes)).view(rows.size, -1)
                yield self.views[g][region], dst, torch.from_numpy(rows)
                pos += n
            i = j

    def gather(self, chunks: Sequence[ChunkRef], offsets: Sequence[int]) -> None:
        for kv, staged, rows in self._runs(chunks, offsets):
            if kv.device.type == "cpu":
                _take(kv.numpy(), rows.numpy(), staged.numpy())
            else:
                torch.index_select(kv, 0, rows, out=staged)

    def scatter(self, chunks: Sequence[ChunkRef], offsets: Sequence[int]) -> None:
        for kv, staged, rows in self._runs(chunks, offsets):
            if kv.device.type == "cpu":
                kv.numpy()[rows.numpy()] = staged.numpy()
            else:
                kv.index_copy_(0, rows, staged)


def _take(src: npt.NDArray[Any], rows: npt.NDArray[np.int64], out: npt.NDArray[Any]) -> None:
    """``out[:] = src[rows]`` on the calling thread alone. Not torch's index_select:
    called from the stage thread, it ran an OpenMP team of its own whose workers
    spun on the forward's core after each copy (a 1,000-token request with 12
    tokens out took 1.34-1.48x as long as without a connector, 0.86-1.11x this
    way; ``kvpool bench vllm --shape llama3-8b --lengths 1000``). numpy's take
    with mode "raise" copies through a buffer, so the rows are checked here."""
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= src.shape[0]):
        raise IndexError(
            f"block rows {int(rows.min())}..{int(rows.max())} outside 0..{src.shape[0] - 1}"
        )
    np.take(src, rows, axis=0, out=out, mode="clip")

"""Paged KV tensors described as rows of bytes, and the rows of one chunk object.

    describe_group(tensors, num_blocks)  -> GroupKV for the layers of one KV group
    GroupKV.regions                      the distinct allocations to register once
    GroupKV.object_nbytes(n)             bytes of one object holding n blocks
    GroupKV.rows(block_ids)              where those bytes live, in object order

Every layer tensor has one dimension of size ``num_blocks``; the rest of a
block is a few contiguous *runs* (one for blocks-first layouts such as vLLM's
CPU ``[num_blocks, 2, block_size, heads*head]`` and MLA
``[num_blocks, block_size, latent]``; two, K and V, for the flash-attention
``[2, num_blocks, block_size, heads, head]``). Each distinct allocation is cut
into equal *rows* (the gcd of run lengths and offsets), so a chunk object is
a list of row indices: per layer (in the order given), per block (in the order
given), per run. Gathering those rows with one indexed copy per allocation is
a save; scattering them back is a load.

Pure: reads only ``data_ptr()``, ``shape``, ``stride()``, ``element_size()``
and the storage extent of each tensor; never touches their bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvpool.errors import LayoutError

__all__ = ["GroupKV", "Region", "TensorLike", "block_runs", "describe_group"]


class TensorLike(Protocol):
    """The little of a tensor that this module reads (torch.Tensor fits)."""

    @property
    def shape(self) -> Any: ...

    def stride(self) -> Any: ...

    def data_ptr(self) -> int: ...

    def element_size(self) -> int: ...

    def untyped_storage(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class Region:
    """One distinct allocation, seen as ``nbytes // row_bytes`` rows."""

    base: int  # address of the allocation's first byte
    nbytes: int
    row_bytes: int

    @property
    def num_rows(self) -> int:
        return self.nbytes // self.row_bytes


@dataclass(frozen=True, slots=True)
class _LayerRows:
    region: int  # index into GroupKV.regions
    first_row: int  # row of block 0, run 0
    block_rows: int  # rows between block b and b+1
    run_rows: tuple[int, ...]  # row offset of each run inside a block
    rows_per_run: int


def block_runs(
    shape: Sequence[int], strides: Sequence[int], itemsize: int, block_dim: int
) -> tuple[tuple[int, int], ...]:
    """Contiguous ``(byte offset, byte length)`` runs making up block 0, in logical order.

    Inner dimensions are merged while they are contiguous; the remaining outer
    dimensions are enumerated in C order.
    """
    dims = [(n, s) for i, (n, s) in enumerate(zip(shape, strides, strict=True)) if i != block_dim]
    dims = [(n, s) for n, s in dims if n != 1]
    run = 1  # elements in one contiguous run
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    offsets = [0]
    for n, s in dims:
        offsets = [o + i * s for o in offsets for i in range(n)]
    return tuple((o * itemsize, run * itemsize) for o in offsets)


def _block_dim(t: TensorLike, num_blocks: int, name: str) -> int:
    dims = [i for i, n in enumerate(t.shape) if n == num_blocks]
    if not dims:
        raise LayoutError(
            f"KV tensor {name} of shape {tuple(t.shape)} has no dimension of "
            f"num_blocks={num_blocks}"
        )
    # With several candidates, the block dimension is the one with the largest
    # stride below the outermost K/V split: prefer dim 0 unless it is the
    # size-2 K/V dimension of a flash-attention layout.
    if len(dims) > 1 and dims[0] == 0 and t.shape[0] == 2 and len(t.shape) >= 2:
        return dims[1]
    return dims[0]


def _storage_extent(t: TensorLike) -> tuple[int, int]:
    storage = t.untyped_storage()
    return int(storage.data_ptr()), int(storage.nbytes())


@dataclass(frozen=True, slots=True)
class GroupKV:
    """The KV bytes of one group on this rank: its regions and per-layer rows."""

    regions: tuple[Region, ...]
    layers: tuple[_LayerRows, ...]
    block_nbytes: int  # bytes of one block over all layers of the group
    # One-block objects (the default: a chunk is one engine block): segment j of
    # block b lies at starts[j] + b * strides[j] and has lengths[j] bytes.
    _one_block: tuple[np.ndarray, np.ndarray, list[int]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "_one_block", self._plan_one_block())

    def _plan_one_block(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The segments of one block as affine functions of its id: each layer's runs,
        merged where they touch for every block id (within a layer always; across
        layers when both step alike). Merging only where it holds for all ids keeps
        this exact: the bytes and their order are those of ``rows``."""
        segs: list[list[int]] = []  # [start byte at block 0, byte stride, length]
        for lay in self.layers:
            reg = self.regions[lay.region]
            stride = lay.block_rows * reg.row_bytes
            for run in lay.run_rows:
                start = reg.base + (lay.first_row + run) * reg.row_bytes
                length = lay.rows_per_run * reg.row_bytes
                if segs and segs[-1][1] == stride and segs[-1][0] + segs[-1][2] == start:
                    segs[-1][2] += length
                else:
                    segs.append([start, stride, length])
        table = np.array(segs, dtype=np.int64).reshape(-1, 3)
        return table[:, 0].copy(), table[:, 1].copy(), table[:, 2].tolist()

    def object_nbytes(self, num_blocks: int) -> int:
        """Bytes of the object for ``num_blocks`` blocks (payload, no header)."""
        return self.block_nbytes * num_blocks

    def rows(self, block_ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """``[(region, rows)]`` covering ``block_ids``' bytes in object order.

        ``block_ids`` is an int64 array of shape ``(objects, blocks_per_object)``;
        the rows of object i come before those of object i+1. Each entry's rows
        are int64 row indices into ``regions[region]``; consecutive entries with
        the same region are merged.
        """
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.ndim != 2:
            raise ValueError("block_ids must have shape (objects, blocks_per_object)")
        per_layer = []
        for lay in self.layers:
            runs = np.asarray(lay.run_rows, dtype=np.int64)
            within = np.arange(lay.rows_per_run, dtype=np.int64)
            r = (
                lay.first_row
                + ids[:, :, None, None] * lay.block_rows
                + runs[None, None, :, None]
                + within[None, None, None, :]
            )  # (objects, blocks, runs, rows_per_run)
            per_layer.append(r.reshape(ids.shape[0], -1))
        regions = [lay.region for lay in self.layers]
        if len(set(regions)) == 1:
            return [(regions[0], np.concatenate(per_layer, axis=1).reshape(-1))]
        out: list[tuple[int, np.ndarray]] = []
        for obj in range(ids.shape[0]):
            for region, r in zip(regions, per_layer, strict=True):
                if out and out[-1][0] == region:
                    out[-1] = (region, np.concatenate([out[-1][1], r[obj]]))
                else:
                    out.append((region, r[obj]))
        return out

    def segments(self, block_ids: np.ndarray) -> list[list[tuple[int, int]]]:
        """Scatter lists ``[(address, length)]`` per object, adjacent rows merged."""
        addrs, sizes = self.columns(block_ids)
        return [list(zip(a, n, strict=True)) for a, n in zip(addrs, sizes, strict=True)]

    def columns(self, block_ids: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
        """``segments`` as two columns: per object its addresses and its lengths
        (Python ints, no empty segment; what ``store.scatter.Scatter`` holds)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.ndim == 2 and ids.shape[1] == 1 and ids.size:  # no numpy work per row
            starts, strides, lengths = self._one_block
            at = starts[None, :] + ids * strides[None, :]
            return at.tolist(), [lengths] * ids.shape[0]  # lengths shared, never mutated
        if len(self.regions) == 1 and ids.ndim == 2 and ids.size:
            return self._columns_one_region(ids)
        all_addrs: list[list[int]] = []
        all_sizes: list[list[int]] = []
        for obj in range(ids.shape[0]):
            addrs: list[int] = []
            sizes: list[int] = []
            for region, rows in self.rows(ids[obj : obj + 1]):
                reg = self.regions[region]
                # Merge runs of consecutive rows into single segments.
                breaks = np.flatnonzero(np.diff(rows) != 1) + 1
                starts = np.concatenate([[0], breaks])
                ends = np.concatenate([breaks, [rows.size]])
                addrs += (reg.base + rows[starts] * reg.row_bytes).tolist()
                sizes += ((ends - starts) * reg.row_bytes).tolist()
            all_addrs.append(addrs)
            all_sizes.append(sizes)
        return all_addrs, all_sizes

    def _columns_one_region(self, ids: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
        """``columns`` for all objects at once (one allocation: the common case)."""
        ((region, flat),) = self.rows(ids)
        reg = self.regions[region]
        n = ids.shape[0]
        rows = flat.reshape(n, -1)
        start = np.ones(rows.shape, dtype=np.bool_)  # a segment starts here
        start[:, 1:] = np.diff(rows, axis=1) != 1  # every object's first row starts one
        first = np.flatnonzero(start)
        lengths = (np.append(first[1:], rows.size) - first) * reg.row_bytes
        addrs = reg.base + rows.reshape(-1)[first] * reg.row_bytes
        counts = start.sum(axis=1)
        if (counts == counts[0]).all():  # equal counts: one reshape, no loop per object
            k = int(counts[0])
            return addrs.reshape(n, k).tolist(), lengths.reshape(n, k).tolist()
        flat_addrs, flat_sizes = addrs.tolist(), lengths.tolist()
        bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
        spans = list(itertools.pairwise(bounds))
        return [flat_addrs[a:b] for a, b in spans], [flat_sizes[a:b] for a, b in spans]


def describe_group(tensors: Sequence[tuple[str, TensorLike]], num_blocks: int) -> GroupKV:
    """Describe the layers of one KV group (in this order) as rows of their allocations."""
    if not tensors:
        raise LayoutError("a KV group needs at least one layer tensor")
    found: list[tuple[int, int]] = []  # distinct (base, nbytes)
    layer_info = []
    for name, t in tensors:
        bdim = _block_dim(t, num_blocks, name)
        isz = t.element_size()
        strides = tuple(t.stride())
        runs = block_runs(tuple(t.shape), strides, isz, bdim)
        base, nbytes = _storage_extent(t)
        if (base, nbytes) not in found:
            found.append((base, nbytes))
        offset = t.data_ptr() - base
        layer_info.append((found.index((base, nbytes)), offset, strides[bdim] * isz, runs))
    # One row size for everything: the gcd of every length and offset.
    g = 0
    for _, offset, bstride, runs in layer_info:
        g = math.gcd(g, offset, bstride, *(x for run in runs for x in run))
    if g == 0:
        raise LayoutError("KV tensors have zero-sized blocks")
    regions = tuple(Region(base, nbytes, g) for base, nbytes in found)
    for r in regions:
        if r.nbytes % g:
            raise LayoutError("KV allocation size is not a multiple of its row size")
    layers = tuple(
        _LayerRows(
            region=ri,
            first_row=offset // g,
            block_rows=bstride // g,
            run_rows=tuple(o // g for o, _ in runs),
            rows_per_run=runs[0][1] // g,
        )
        for ri, offset, bstride, runs in layer_info
    )
    if any(length != runs[0][1] for *_, runs in layer_info for _, length in runs):
        raise LayoutError("the runs of one block have unequal lengths")
    block_nbytes = sum(sum(length for _, length in runs) for _, _, _, runs in layer_info)
    return GroupKV(regions, layers, block_nbytes)

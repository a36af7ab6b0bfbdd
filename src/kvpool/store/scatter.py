"""Scatter lists: an object's bytes as ``(address, size)`` segments in the caller's memory.

    Segment, Segments             ``(address, size)``; one object's list, in order
                                  (the object is the segments' concatenation)
    Scatter                       a batch's lists in two int columns, checked once
                                  when built (``from_arrays``, ``from_lists``)
    total_size(segments)          bytes in one scatter list
    totals(batch)                 bytes per object, of a ``Scatter`` or plain lists
    take(batch, indices)          the objects at ``indices``, in the batch's form
    malformed_segments(segments)  why a scatter list must not reach a store, or None

A valid scatter list is a non-empty sequence of ``(address, size)`` tuples of
Python ``int`` (numpy integers are not), address > 0, size >= 0, at least one
byte in all; a ``Scatter`` has no empty segments either. Pure: no store, no I/O.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any, TypeAlias, overload

import numpy as np
import numpy.typing as npt

__all__ = [
    "Scatter",
    "Segment",
    "Segments",
    "malformed_segments",
    "take",
    "total_size",
    "totals",
]

Segment: TypeAlias = tuple[int, int]  # (address, size in bytes) in this process
Segments: TypeAlias = Sequence[Segment]  # one object's scatter list, in order


class Scatter(Sequence[list[Segment]]):
    """The scatter lists of a whole batch in two columns, built once, checked once.

    ``addrs[i]`` and ``sizes[i]`` are object i's segment addresses and sizes as
    Python ints: what Mooncake's batch calls take, so the hot path neither
    validates per segment nor splits tuples (measured: about half the Python
    cost of a zero-copy transfer call). It is a ``Sequence`` of ordinary scatter
    lists too, so any store accepts it; stores that know it read the columns.

    Build it with ``from_arrays`` (numpy, checked vectorised) or ``from_lists``
    (checked per object); both raise ``ValueError`` naming what is wrong. It
    has no empty segments, and adjacent segments are not merged for it:
    builders merge them (``kvcache`` does).
    """

    __slots__ = ("addrs", "sizes")

    def __init__(self, addrs: list[list[int]], sizes: list[list[int]]) -> None:
        """Trusted: use ``from_arrays`` or ``from_lists`` for unchecked input."""
        self.addrs, self.sizes = addrs, sizes

    @classmethod
    def from_arrays(cls, addrs: npt.NDArray[np.integer], sizes: npt.NDArray[np.integer]) -> Scatter:
        """Objects of equal segment counts: two ``(objects, segments)`` int arrays."""
        a, n = np.asarray(addrs), np.asarray(sizes)
        if a.ndim != 2 or a.shape != n.shape or a.shape[1] == 0:
            raise ValueError(
                "Scatter.from_arrays needs two (objects, segments) arrays of one shape, "
                f"segments >= 1: got {a.shape} and {n.shape}"
            )
        if a.size and (int(a.min()) <= 0 or int(n.min()) <= 0):
            raise ValueError("a Scatter needs addresses > 0 and sizes > 0 (no empty segments)")
        return cls(a.tolist(), n.tolist())

    @classmethod
    def from_lists(cls, addrs: list[list[int]], sizes: list[list[int]]) -> Scatter:
        """Ragged objects: per object a list of addresses and one of sizes (ints)."""
        if len(addrs) != len(sizes):
            raise ValueError(f"{len(addrs)} address lists but {len(sizes)} size lists")
        for i, (a, n) in enumerate(zip(addrs, sizes, strict=True)):
            problem = malformed_segments(list(zip(a, n, strict=False))) if len(a) == len(n) else ""
            if problem is None and 0 in n:
                problem = "a Scatter has no empty segments"
            if problem is not None:
                raise ValueError(f"object {i}: {problem or 'addresses and sizes differ in count'}")
        return cls(addrs, sizes)

    def __len__(self) -> int:
        return len(self.addrs)

    @overload
    def __getitem__(self, i: int) -> list[Segment]: ...
    @overload
    def __getitem__(self, i: slice) -> Scatter: ...
    def __getitem__(self, i: int | slice) -> list[Segment] | Scatter:
        if isinstance(i, slice):
            return Scatter(self.addrs[i], self.sizes[i])
        return list(zip(self.addrs[i], self.sizes[i], strict=True))

    def __iter__(self) -> Iterator[list[Segment]]:
        return map(list, map(zip, self.addrs, self.sizes))

    def take(self, indices: Sequence[int]) -> Scatter:
        """The objects at ``indices``, in that order."""
        return Scatter([self.addrs[i] for i in indices], [self.sizes[i] for i in indices])

    def totals(self) -> list[int]:
        """Bytes per object."""
        return list(map(sum, self.sizes))

    def counts(self) -> list[int]:
        """Segments per object."""
        return list(map(len, self.sizes))


_size_of = operator.itemgetter(1)


def total_size(segments: Segments) -> int:
    """Bytes in a scatter list."""
    return sum(map(_size_of, segments))


_TUPLE, _INT, _PAIR = {tuple}, {int}, {2}


def totals(segments: Sequence[Segments]) -> list[int]:
    """Bytes per object of a batch (a ``Scatter`` or plain scatter lists)."""
    if isinstance(segments, Scatter):
        return segments.totals()
    return [total_size(p) for p in segments]


def take(segments: Sequence[Segments], indices: Sequence[int]) -> Sequence[Segments]:
    """The objects of a batch at ``indices``, in the form the batch came in."""
    if isinstance(segments, Scatter):
        return segments.take(indices)
    return [segments[i] for i in indices]


def _plainly_valid(segments: list[Any] | tuple[Any, ...]) -> bool:
    """True if ``segments`` is a valid scatter list of plain ``(int, int)`` tuples,
    checked with C-level ``map``/``set``/``min`` (the hot path: a transfer call
    validates every object, right after the caches were flushed by the last one).
    False means: let ``malformed_segments``'s loop find what is wrong, if anything."""
    if set(map(type, segments)) != _TUPLE or set(map(len, segments)) != _PAIR:
        return False
    addrs, sizes = zip(*segments, strict=True)
    return (
        set(map(type, addrs)) == _INT
        and set(map(type, sizes)) == _INT
        and min(addrs) > 0
        and min(sizes) >= 0
        and sum(sizes) > 0
    )


def malformed_segments(segments: object) -> str | None:
    """Why a scatter list must not reach a store, or None if it may."""
    if (type(segments) is list or type(segments) is tuple) and _plainly_valid(segments):
        return None
    if not isinstance(segments, list | tuple | Sequence) or not segments:
        return "a scatter list must be a non-empty sequence of (address, size): got none"
    total = 0
    for seg in segments:
        if not isinstance(seg, tuple) or len(seg) != 2:
            return f"a segment must be an (address, size) tuple: got {seg!r}"
        addr, size = seg
        if type(addr) is not int or type(size) is not int:
            return (
                "segment address and size must be Python ints: got "
                f"({type(addr).__name__}, {type(size).__name__})"
            )
        if addr <= 0 or size < 0:
            return f"a segment needs address > 0 and size >= 0: got {seg!r}"
        total += size
    return None if total else "an object must have at least one byte: got 0"

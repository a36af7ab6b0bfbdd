"""Pure planning of how a job's chunk objects move through bounded staging.

    cut(sizes, budget)            chunk ranges ``(lo, hi)`` of at most ``budget`` bytes
                                  (a range closes before the chunk that would overflow
                                  it; a chunk bigger than ``budget`` is a range of its
                                  own): the unit a save stages and puts, and a staged
                                  load gets and copies
    job_budget(total, budget)     a staged load's piece size: ``budget``, or less
                                  for a small job, which then moves in about
                                  ``LOAD_DEPTH`` pieces of at least ``MIN_LOAD_PIECE``
    place(groups, sizes)          offsets of a piece's objects inside its staging
                                  reservation, and the reservation's size
    split_staging(nbytes, loads)  bytes of staging for saves and for staged loads
    piece_budget(piece, arena, g) the piece size that lets two pieces of one
                                  direction be in flight at once
    check_fits(largest, arena)    ConfigError when one object cannot fit the arena
    last_first(chunks)            the order a store call lists a piece's objects in:
                                  last chunk first, a chunk's shards together
                                  (Mooncake evicts the objects of one call in that
                                  order, so a prompt loses its end, not its start)

A job of any size moves as a sequence of pieces, each reserving staging only for
itself and releasing it when it is done, so the staging size changes how many
bytes are in flight (speed), never whether a job can move. No torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.errors import ConfigError
from kvpool.transfer.records import ChunkRef

__all__ = [
    "ALIGN",
    "LOAD_DEPTH",
    "MIN_LOAD_PIECE",
    "check_fits",
    "cut",
    "job_budget",
    "last_first",
    "piece_budget",
    "place",
    "split_staging",
]

ALIGN = 64  # each group's objects start this aligned: word views of staging line up
# A load's first get and last copy overlap nothing else: a small job moves in this
# many pieces so both stay short (62 MiB in 128 KiB objects: 8 pieces loaded in
# 22-24 ms, 2 pieces of 32 MiB in 29-36, on the 2-core build machine), and pieces
# stay at least this big (Mooncake pays ~0.4 ms per call).
LOAD_DEPTH = 8
MIN_LOAD_PIECE = 4 << 20


def cut(sizes: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Ranges of consecutive items whose sizes add up to about ``budget``: a range
    ends with the item that reaches it, so each holds at least one item and at most
    ``budget`` + one item's size - 1 bytes."""
    if budget < 1:
        raise ValueError(f"piece budget must be >= 1 byte, got {budget}")
    out, lo, size = [], 0, 0
    for i, n in enumerate(sizes):
        if size and size + n > budget:  # would overflow: close the range before it
            out.append((lo, i))
            lo, size = i, 0
        size += n
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out


def job_budget(total: int, budget: int) -> int:
    """Bytes per piece for a staged load of ``total`` bytes: ``budget`` for a large
    job, ``total / LOAD_DEPTH`` (at least ``MIN_LOAD_PIECE``) for a smaller one."""
    return max(1, min(budget, max(MIN_LOAD_PIECE, -(-total // LOAD_DEPTH))))


def last_first(chunks: Sequence[ChunkRef]) -> list[int]:
    """Indices of ``chunks`` by chunk index descending, then shard view."""
    return sorted(range(len(chunks)), key=lambda i: (-chunks[i].chunk, chunks[i].group))


def place(groups: Sequence[int], sizes: Sequence[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Offsets of objects (sorted by group) inside one reservation, and its extent.

    A group's objects lie back to back (so they move with one indexed copy per
    KV allocation); each group starts ``align``-ed.
    """
    offsets, pos, group = [], 0, None
    for g, n in zip(groups, sizes, strict=True):
        if g != group:
            pos = -(-pos // align) * align
            group = g
        offsets.append(pos)
        pos += n
    return offsets, pos


def split_staging(nbytes: int, staged_loads: bool) -> tuple[int, int]:
    """Staging for saves and for staged loads: halves, or all of it for saves when
    loads do not stage. Apart, a slow put never delays a load (TTFT) and a hung
    get never stalls saves."""
    if not staged_loads:
        return nbytes, 0
    half = nbytes // 2 // ALIGN * ALIGN
    return (nbytes - half) // ALIGN * ALIGN, half  # the load half starts aligned


def piece_budget(piece_bytes: int, arena_bytes: int, groups: int = 1) -> int:
    """Pieces of at most ``piece_bytes``, and small enough that two fit the arena
    (one moving while the next is copied), with each group's alignment padding."""
    return max(1, min(piece_bytes, arena_bytes // 2 - ALIGN * groups))


def check_fits(largest_object: int, arena_bytes: int, what: str) -> None:
    """A piece holds at least one object: the arena must hold the largest."""
    need = -(-largest_object // ALIGN) * ALIGN
    if need > arena_bytes:
        raise ConfigError(
            f"staging for {what} is {arena_bytes} bytes, less than one chunk object "
            f"({largest_object} bytes); raise staging_bytes to at least {2 * need} bytes "
            "or lower chunk_size"
        )

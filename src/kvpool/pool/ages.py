"""When a pool's objects were written, read from their headers (``header.written_at``).

    written_times(read_heads, keys)   -> {key: write time in ms since the epoch, or
                                         None: gone, not a kvpool object of this
                                         format, or written without a time}
    oldest_written(read_heads, keys, sample)
                                      -> (the oldest write time among at most
                                         ``sample`` random keys, or None; keys read)
    written_before(times, cutoff_ms)  -> the keys written before ``cutoff_ms``
                                         (an unknown time never matches)

``read_heads(keys)`` answers the first ``HEADER_SIZE`` bytes of each key's object,
None where it is gone (``MooncakeStore.read_heads``). Reading a header is a read
of the object: Mooncake gives it its read lease (``kvpool up --lease-ttl-ms``),
as a lookup does, so an object read here is not evicted for that long. Times are
the writers' wall clocks: a host whose clock is off skews them, nothing else.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

from kvpool.errors import KeyFormatError
from kvpool.header import HEADER_SIZE, fingerprint_bytes, written_at
from kvpool.keys import parse_key

__all__ = ["HeadReader", "oldest_written", "written_before", "written_times"]

HeadReader = Callable[[Sequence[str]], list[bytes | None]]


def written_times(read_heads: HeadReader, keys: Sequence[str]) -> dict[str, int | None]:
    """Each kvpool key's write time (ms since the epoch), None where unknown; keys
    that are not kvpool keys are left out, never read."""
    fingerprints: dict[str, bytes] = {}
    for key in keys:
        try:
            fingerprints[key] = fingerprint_bytes(parse_key(key).fingerprint)
        except KeyFormatError:
            continue
    ours = list(fingerprints)
    heads = read_heads(ours)
    return {
        key: None if head is None or len(head) < HEADER_SIZE else
        written_at(head, fingerprints[key], key)
        for key, head in zip(ours, heads, strict=True)
    }  # fmt: skip


def oldest_written(
    read_heads: HeadReader, keys: Sequence[str], sample: int, rng: random.Random | None = None
) -> tuple[int | None, int]:
    """The oldest write time among ``sample`` keys drawn at random from ``keys`` (all
    of them when fewer), None if none said; and how many keys were read."""
    chosen = list(keys) if len(keys) <= sample else (rng or random).sample(list(keys), sample)
    times = written_times(read_heads, chosen)
    known = [t for t in times.values() if t is not None]
    return (min(known) if known else None), len(times)


def written_before(times: Mapping[str, int | None], cutoff_ms: int) -> list[str]:
    """The keys of ``times`` written before ``cutoff_ms``; unknown times never match."""
    return [key for key, t in times.items() if t is not None and t < cutoff_ms]

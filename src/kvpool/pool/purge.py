"""Remove a tenant's or a model's objects from a running pool: what ``kvpool purge`` does.

    select(keys, model=None, fingerprint=None, tenant=None, everything=False)
                              -> the kvpool keys that match (a model name, a
                                 fingerprint or its first characters, a tenant:
                                 all that are given; or every kvpool key)
    purge(store, keys, wait_s)   -> PurgeResult: removed, gone already, still in use

Safe while engines run: a remove is never forced, so an object an engine is
reading (it holds Mooncake's read lease, ``kvpool up --lease-ttl-ms``) is left
until its lease ends and removed on a later try, within ``wait_s``; a purged
object is a miss for the next lookup, and a load that finds it gone recomputes
its blocks, never reads other bytes. Keys of other users of the pool (not
kvpool keys of a known schema) are never selected.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvpool.errors import KeyFormatError
from kvpool.keys import ParsedKey, parse_key
from kvpool.store.base import KVStore, Status

__all__ = ["PurgeResult", "purge", "select"]

_BATCH = 512  # keys per remove call


@dataclass(frozen=True, slots=True)
class PurgeResult:
    removed: int
    gone: int  # evicted or removed by someone else meanwhile
    in_use: tuple[str, ...]  # still leased when the wait ended
    failed: int  # the store could not answer (down, ...)


def select(
    keys: Iterable[str],
    *,
    model: str | None = None,
    fingerprint: str | None = None,
    tenant: str | None = None,
    everything: bool = False,
) -> list[str]:
    """The kvpool keys among ``keys`` of ``model``, ``fingerprint`` (a prefix of at
    least 4 hex digits) and ``tenant``, those given; all of them with ``everything``.
    Without ``tenant``, a model's or fingerprint's keys of every tenant match."""
    out = []
    for key in keys:
        try:
            parsed: ParsedKey = parse_key(key)
        except KeyFormatError:
            continue
        if everything or (
            (model is None or parsed.model == model)
            and (fingerprint is None or parsed.fingerprint.startswith(fingerprint))
            and (tenant is None or parsed.tenant == tenant)
        ):
            out.append(key)
    return out


def purge(store: KVStore, keys: list[str], wait_s: float = 5.0) -> PurgeResult:
    """Remove ``keys`` without forcing; retry those in use until ``wait_s`` passed."""
    removed = gone = failed = 0
    todo = list(keys)
    deadline = time.monotonic() + wait_s
    pause = 0.05
    while todo:
        leased = []
        for i in range(0, len(todo), _BATCH):
            batch = todo[i : i + _BATCH]
            for key, status in zip(batch, store.batch_remove(batch), strict=True):
                if status is Status.OK:
                    removed += 1
                elif status is Status.MISSING:
                    gone += 1
                elif status is Status.LEASED:
                    leased.append(key)
                else:
                    failed += 1
        todo = leased
        if not todo or time.monotonic() + pause > deadline:
            break
        time.sleep(pause)  # a reader's lease runs out on the master's clock
        pause = min(1.0, pause * 2)
    return PurgeResult(removed, gone, tuple(todo), failed)

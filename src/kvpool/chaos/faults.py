"""Store backends with injected faults, for engines under test (the ``store`` setting).

    VanishingStore   every object is removed right before it is read: lookups hit,
                     then the load finds nothing (eviction between lookup and load)
    BrokenLoadStore  every get fails as a transfer failure while the pool still
                     lists the objects: each lookup hits, each load fails
    SlowExistsStore  every exists check waits ``KVPOOL_CHAOS_EXISTS_DELAY_S`` (default
                     0.5 s) first: lookups slower than their deadline
    SlowPutStore     every put waits ``KVPOOL_CHAOS_PUT_DELAY_S`` (default 5 s)
                     first, so saves sit queued (an engine killed meanwhile)

They wrap the real Mooncake adapter: only the named operation is changed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from kvpool.store.base import Status
from kvpool.store.mooncake import MooncakeStore
from kvpool.store.scatter import Segments

__all__ = ["BrokenLoadStore", "SlowExistsStore", "SlowPutStore", "VanishingStore"]


class VanishingStore(MooncakeStore):
    def _get(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        self.batch_remove(keys, force=True)
        return super()._get(keys, segments)


class BrokenLoadStore(MooncakeStore):
    def _get(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        return [Status.TRANSFER_FAILED] * len(keys)


class SlowPutStore(MooncakeStore):
    def _put(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        time.sleep(float(os.environ.get("KVPOOL_CHAOS_PUT_DELAY_S", "5")))  # the fault
        return super()._put(keys, segments)

    def _put_pinned(
        self, keys: Sequence[str], segments: Sequence[Segments], pin_ms: int
    ) -> list[Status]:
        time.sleep(float(os.environ.get("KVPOOL_CHAOS_PUT_DELAY_S", "5")))  # the fault
        return super()._put_pinned(keys, segments, pin_ms)


class SlowExistsStore(MooncakeStore):
    def _exists(self, keys: Sequence[str]) -> list[Status]:
        time.sleep(float(os.environ.get("KVPOOL_CHAOS_EXISTS_DELAY_S", "0.5")))  # the fault
        return super()._exists(keys)

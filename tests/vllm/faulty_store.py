"""Store backends with injected faults, for engines under test (``store`` setting).

VanishingStore   every object is removed right before it is read: lookups
                 hit, then the load finds nothing (eviction between lookup
                 and load)
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.store.base import Segments, Status
from kvpool.store.mooncake import MooncakeStore


class VanishingStore(MooncakeStore):
    def _get(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        self.batch_remove(keys, force=True)
        return super()._get(keys, segments)

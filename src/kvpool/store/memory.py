"""An in-process ``KVStore`` with Mooncake's semantics, for tests and demos.

    MemoryStore(capacity, lease_s)  objects live in this process's memory
    store.remove_prefix(p, force)   remove every object under a key prefix (the
                                    lookup server's reset); how many went

Semantics (the same as the Mooncake adapter, except where noted):

* Puts are immutable: a duplicate put keeps the old value and reports EXISTS
  (Mooncake cannot tell and reports OK; ``reports_duplicates`` is True here).
* Over ``capacity`` bytes, the oldest objects (by put time) whose lease has
  run out are evicted first; they then read MISSING. An object larger than the
  capacity, or one that cannot fit beside leased objects, is NO_SPACE.
* A put with ``pin_ms`` soft-pins its new objects that long: eviction takes
  unpinned objects first, pinned ones only when those do not free enough.
* With ``lease_s > 0``, a successful get or exists grants a lease; remove
  without ``force`` reports LEASED while it runs, and eviction skips it.
* Bytes are copied from and to the callers' addresses with ``ctypes.memmove``.

Test hooks: ``inject(key, status)`` makes gets and puts of a key answer a
status; ``tamper(key, offset)`` flips a stored byte; ``require_registration``
makes segments outside registered memory INVALID (as RDMA would).
Not the product: no cross-process sharing, no persistence.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.config import PoolConfig
from kvpool.store.base import KVStore, Status
from kvpool.store.scatter import Segments, total_size

__all__ = ["MemoryStore"]


@dataclass(slots=True)
class _Object:
    data: npt.NDArray[np.uint8]
    lease_until: float = 0.0  # clock time the read lease ends
    pin_until: float = 0.0  # clock time the soft pin ends


class MemoryStore(KVStore):
    """Objects in a dict, bounded by ``capacity`` bytes. See the module docstring."""

    def __init__(
        self,
        capacity: int = 1 << 30,
        *,
        lease_s: float = 0.0,
        require_registration: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0 bytes, got {capacity}")
        if lease_s < 0:
            raise ValueError(f"lease_s must be >= 0, got {lease_s}")
        self.capacity = capacity
        self.lease_s = lease_s
        self._require_registration = require_registration
        self._clock = clock
        self._lock = threading.Lock()
        self._objects: OrderedDict[str, _Object] = OrderedDict()  # oldest put first
        self._used = 0
        self._regions: dict[int, int] = {}  # addr -> size
        self._faults: dict[str, Status] = {}
        self.evictions = 0  # objects evicted so far

    @classmethod
    def from_config(cls, config: PoolConfig, **options: Any) -> MemoryStore:
        """Build from options alone; a memory store needs nothing from ``config``."""
        return cls(**options)

    # -- capabilities -----------------------------------------------------------

    @property
    def reports_duplicates(self) -> bool:
        return True

    @property
    def supports_leases(self) -> bool:
        return self.lease_s > 0

    @property
    def requires_registration(self) -> bool:
        return self._require_registration

    # -- introspection and test hooks -------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    def keys(self) -> list[str]:
        """Stored keys, oldest first."""
        with self._lock:
            return list(self._objects)

    def remove_prefix(self, prefix: str, force: bool = False) -> int:
        """Remove every object whose key starts with ``prefix``; how many were removed.

        Objects under a read lease are kept unless ``force``. The lookup server's
        reset uses this (``kvpool.lookup.server.SupportsRemovePrefix``).
        """
        self._check_open()
        with self._lock:
            now = self._clock()
            doomed = [
                k
                for k, obj in self._objects.items()
                if k.startswith(prefix) and (force or obj.lease_until <= now)
            ]
            for key in doomed:
                self._drop(key)
            return len(doomed)

    def inject(self, key: str, status: Status | None) -> None:
        """Make gets and puts of ``key`` answer ``status`` (None clears it)."""
        with self._lock:
            if status is None:
                self._faults.pop(key, None)
            else:
                self._faults[key] = status

    def tamper(self, key: str, offset: int, xor: int = 0xFF) -> None:
        """Flip bits of the stored byte at ``offset`` of ``key`` (KeyError if absent)."""
        with self._lock:
            self._objects[key].data[offset] ^= xor

    # -- KVStore ------------------------------------------------------------------

    def register_memory(self, addr: int, size: int) -> None:
        super().register_memory(addr, size)
        with self._lock:
            self._regions[addr] = size

    def unregister_memory(self, addr: int) -> None:
        with self._lock:
            self._regions.pop(addr, None)

    def close(self) -> None:
        with self._lock:
            self._objects.clear()
            self._used = 0
            super().close()

    def _exists(self, keys: Sequence[str]) -> list[Status]:
        with self._lock:
            now = self._clock()
            out = []
            for key in keys:
                obj = self._objects.get(key)
                if obj is None:
                    out.append(Status.MISSING)
                else:
                    self._lease(obj, now)
                    out.append(Status.OK)
            return out

    def _put(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        return self._put_pinned(keys, segments, 0)

    def _put_pinned(
        self, keys: Sequence[str], segments: Sequence[Segments], pin_ms: int
    ) -> list[Status]:
        with self._lock:
            return [self._put_one(k, s, pin_ms) for k, s in zip(keys, segments, strict=True)]

    def pinned(self, key: str) -> bool:
        """Whether ``key``'s object is soft-pinned now (a test hook)."""
        with self._lock:
            obj = self._objects.get(key)
            return obj is not None and obj.pin_until > self._clock()

    def _get(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        with self._lock:
            return [self._get_one(k, s) for k, s in zip(keys, segments, strict=True)]

    def _remove(self, keys: Sequence[str], force: bool) -> list[Status]:
        with self._lock:
            now = self._clock()
            out = []
            for key in keys:
                obj = self._objects.get(key)
                if obj is None:
                    out.append(Status.MISSING)
                elif not force and obj.lease_until > now:
                    out.append(Status.LEASED)
                else:
                    self._drop(key)
                    out.append(Status.OK)
            return out

    # -- internals (called with the lock held) ----------------------------------

    def _put_one(self, key: str, segments: Segments, pin_ms: int = 0) -> Status:
        if key in self._faults:
            return self._faults[key]
        if not self._registered(segments):
            return Status.INVALID
        if key in self._objects:
            return Status.EXISTS
        size = total_size(segments)
        if size > self.capacity or not self._make_room(size):
            return Status.NO_SPACE
        data = np.empty(size, dtype=np.uint8)
        dst = data.ctypes.data
        for addr, n in segments:
            ctypes.memmove(dst, addr, n)
            dst += n
        pin_until = self._clock() + pin_ms / 1000 if pin_ms > 0 else 0.0
        self._objects[key] = _Object(data, pin_until=pin_until)
        self._used += size
        return Status.OK

    def _get_one(self, key: str, segments: Segments) -> Status:
        if key in self._faults:
            return self._faults[key]
        if not self._registered(segments):
            return Status.INVALID
        obj = self._objects.get(key)
        if obj is None:
            return Status.MISSING
        if obj.data.nbytes != total_size(segments):
            return Status.CORRUPT
        src = obj.data.ctypes.data
        for addr, n in segments:
            ctypes.memmove(addr, src, n)
            src += n
        self._lease(obj, self._clock())
        return Status.OK

    def _lease(self, obj: _Object, now: float) -> None:
        if self.lease_s > 0:
            obj.lease_until = now + self.lease_s

    def _make_room(self, size: int) -> bool:
        """Evict the oldest unleased objects until ``size`` more bytes fit: the
        unpinned ones first, then the pinned ones."""
        if self._used + size <= self.capacity:
            return True
        now = self._clock()
        victims, freed = [], 0
        for pinned in (False, True):
            for key, obj in self._objects.items():
                if obj.lease_until <= now and (obj.pin_until > now) == pinned:
                    victims.append(key)
                    freed += obj.data.nbytes
                    if self._used - freed + size <= self.capacity:
                        break
            if self._used - freed + size <= self.capacity:
                break
        if self._used - freed + size > self.capacity:
            return False  # leased objects pin too much; evict nothing
        for key in victims:
            self._drop(key)
            self.evictions += 1
        return True

    def _drop(self, key: str) -> None:
        self._used -= self._objects.pop(key).data.nbytes

    def _registered(self, segments: Segments) -> bool:
        if not self._require_registration:
            return True
        return all(
            any(base <= addr and addr + n <= base + size for base, size in self._regions.items())
            for addr, n in segments
        )

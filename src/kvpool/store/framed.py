"""``FramedStore``: a ``KVStore`` that stores a checked header before every payload.

    FramedStore(inner, fingerprint, checksum=True)

It is itself a ``KVStore`` whose segments are *payloads*: callers never see
headers. It owns ``inner`` and closes it.

    batch_put(keys, payloads)   stores header + payload; the header (``kvpool.header``)
                                is the first segment of each scatter list, taken
                                from one registered arena, so payloads stay zero-copy
    batch_get(keys, payloads)   reads header + payload and checks the header against
                                the fingerprint, the key, the payload length and
                                (when the header has one and ``verify``) the checksum;
                                a mismatch is CORRUPT, so bad bytes are never OK
    batch_exists, batch_remove  passed through (an exists hit may still read CORRUPT)

Each CORRUPT is counted per cause in ``corrupt_counts`` and logged at WARNING
the first time its cause appears (later ones at DEBUG). A payload of another
size than the stored one reads CORRUPT too (cause ``LENGTH``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvpool.header import (
    HEADER_SIZE,
    CheckFailure,
    batch_checksums,
    check,
    fingerprint_bytes,
    pack_into,
    payload_checksum,
    unpack,
)
from kvpool.store.base import KVStore, Segment, Segments, Status, total_size

__all__ = ["FramedStore"]

logger = logging.getLogger(__name__)


class FramedStore(KVStore):
    """Adds and checks object headers around any ``KVStore``. See the module docstring.

    ``checksum`` writes an xxh3 checksum of each payload (``PoolConfig.checksum``);
    ``verify`` (default: ``checksum``) checks it on reads of objects that carry
    one. ``slots`` bounds the headers in flight at once; concurrent calls wait
    for free slots, and each backend sub-batch holds at most ``slots`` of them.
    """

    def __init__(
        self,
        inner: KVStore,
        fingerprint: str | bytes,
        *,
        checksum: bool = True,
        verify: bool | None = None,
        slots: int = 1024,
    ) -> None:
        super().__init__()
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.inner = inner
        self.fingerprint = fingerprint_bytes(fingerprint)
        self.checksum = checksum
        self.verify = checksum if verify is None else verify
        self.max_batch = min(inner.max_batch, slots)
        self.max_key_batch = inner.max_key_batch  # exists and remove pass straight through
        self._arena = inner.alloc_staging(slots * HEADER_SIZE)  # registered by inner
        self._view = self._arena.data
        self._base = self._arena.ctypes.data
        self._cond = threading.Condition()
        self._free = list(range(slots))
        self.corrupt_counts: Counter[CheckFailure] = Counter()

    # -- capabilities: those of the inner store -----------------------------------

    @property
    def reports_duplicates(self) -> bool:
        return self.inner.reports_duplicates

    @property
    def supports_leases(self) -> bool:
        return self.inner.supports_leases

    @property
    def requires_registration(self) -> bool:
        return self.inner.requires_registration

    @property
    def requires_staging(self) -> bool:
        return self.inner.requires_staging

    # -- pass-through ---------------------------------------------------------------

    def register_memory(self, addr: int, size: int) -> None:
        super().register_memory(addr, size)
        self.inner.register_memory(addr, size)

    def alloc_staging(self, nbytes: int) -> npt.NDArray[np.uint8]:
        self._check_open()
        return self.inner.alloc_staging(nbytes)

    def reaches(self, addr: int, nbytes: int) -> bool:
        return self.inner.reaches(addr, nbytes)

    def unregister_memory(self, addr: int) -> None:
        if not self.closed:
            self.inner.unregister_memory(addr)

    def health(self) -> bool:
        return not self.closed and self.inner.health()

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self.inner.close()  # frees the arena too

    def _exists(self, keys: Sequence[str]) -> list[Status]:
        return self.inner.batch_exists(keys)

    def _remove(self, keys: Sequence[str], force: bool) -> list[Status]:
        return self.inner.batch_remove(keys, force)

    # -- framing --------------------------------------------------------------------

    def _put(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        slots = self._acquire(len(keys))
        try:
            framed = []
            sums: list[int | None] = (
                list(batch_checksums(segments)) if self.checksum else [None] * len(keys)
            )
            for key, payload, slot, checksum in zip(keys, segments, slots, sums, strict=True):
                offset = slot * HEADER_SIZE
                pack_into(self._view, offset, self.fingerprint, key, total_size(payload), checksum)
                framed.append(self._frame(slot, payload))
            return self.inner.batch_put(keys, framed)
        finally:
            self._release(slots)

    def _get(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        slots = self._acquire(len(keys))
        try:
            framed = [self._frame(slot, p) for slot, p in zip(slots, segments, strict=True)]
            statuses = self.inner.batch_get(keys, framed)
            # Checksums of the whole batch at once (see header.batch_checksums).
            sums: list[int | None] = [None] * len(keys)
            if self.verify and any(s is Status.OK for s in statuses):
                sums = list(batch_checksums(segments))
            return [
                self._verify(key, payload, slot, status, checksum)
                for key, payload, slot, status, checksum in zip(
                    keys, segments, slots, statuses, sums, strict=True
                )
            ]
        finally:
            self._release(slots)

    def _verify(
        self, key: str, payload: Segments, slot: int, status: Status, checksum: int | None
    ) -> Status:
        if status is Status.CORRUPT:  # the inner store saw a size mismatch
            self._reject(key, CheckFailure.LENGTH)
        if status is not Status.OK:
            return status
        header = unpack(self._view, slot * HEADER_SIZE)
        n = total_size(payload)
        failure = check(header, self.fingerprint, key, n)
        if failure is None and self.verify and header.has_checksum:
            if checksum is None:
                checksum = payload_checksum(payload)
            failure = check(header, self.fingerprint, key, n, checksum)
        if failure is None:
            return Status.OK
        self._reject(key, failure)
        return Status.CORRUPT

    def _frame(self, slot: int, payload: Segments) -> list[Segment]:
        return [(self._base + slot * HEADER_SIZE, HEADER_SIZE), *payload]

    def _reject(self, key: str, failure: CheckFailure) -> None:
        with self._cond:
            first = failure not in self.corrupt_counts
            self.corrupt_counts[failure] += 1
        log = logger.warning if first else logger.debug
        log(
            "kvpool: object %r read as a miss: %s (%s); later %s rejections are counted, "
            "not logged",
            key,
            failure.value,
            failure.name,
            failure.name,
        )

    def _acquire(self, n: int) -> list[int]:
        with self._cond:
            self._cond.wait_for(lambda: len(self._free) >= n)
            taken, self._free[-n:] = self._free[-n:], []
            return taken

    def _release(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

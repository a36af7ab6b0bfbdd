"""``FramedStore``: a ``KVStore`` that stores a checked header before every payload.

    FramedStore(inner, fingerprint, checksum=True, secret=None, clock=time.time)

It is itself a ``KVStore`` whose segments are *payloads*: callers never see
headers. It owns ``inner`` and closes it.

    batch_put(keys, payloads)   stores header + payload; the header (``kvpool.header``,
                                stamped with the put's wall-clock time) is the first
                                segment of each scatter list, taken from one registered
                                arena, so payloads stay zero-copy
                                (a first payload segment of at most ``inline_bytes``
                                is copied next to its header instead: one transfer
                                slice less, see ``KVStore.merge_bytes``)
    batch_get(keys, payloads)   reads header + payload and checks the header against
                                the fingerprint, the key, the payload length and,
                                with ``verify``, the checksum, which the header must
                                then carry; damaged bytes are CORRUPT, an object of
                                a healthy writer with checksums off is MISMATCH
                                (left in place): never OK either way. With a
                                ``secret``, puts are signed and gets refuse
                                objects not signed with it (FORGED)
    batch_exists, batch_remove  passed through (an exists hit may still read CORRUPT)

Each rejection is counted per cause in ``corrupt_counts`` and logged at WARNING
the first time its cause appears (later ones at DEBUG). A payload of another
size than the stored one reads CORRUPT too (cause ``LENGTH``).
"""

from __future__ import annotations

import ctypes
import logging
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvpool.header import (
    HEADER_SIZE,
    CheckFailure,
    HeaderTable,
    batch_checksums,
    check,
    fingerprint_bytes,
    unpack,
)
from kvpool.store.base import DeferredCheck, KVStore, Status
from kvpool.store.scatter import Scatter, Segments, take, totals

__all__ = ["FramedStore"]

_first = operator.itemgetter(0)

logger = logging.getLogger(__name__)


def _status(failure: CheckFailure) -> Status:
    if failure.untrusted:
        return Status.FORGED
    return Status.CORRUPT if failure.damaged else Status.MISMATCH


class FramedStore(KVStore):
    """Adds and checks object headers around any ``KVStore``. See the module docstring.

    ``checksum`` writes an xxh3 checksum of each payload (``PoolConfig.checksum``);
    ``verify`` (default: ``checksum``) checks it on reads and refuses objects
    written without one (MISMATCH): verification is never skipped in silence.
    ``slots`` bounds the headers in flight at once; concurrent calls wait for free
    slots, and each backend sub-batch holds at most ``slots`` of them.
    ``inline_bytes`` (default: ``inner.merge_bytes``) is the largest first payload
    segment copied into the header's slot; slots then shrink to fit an arena of
    about ``INLINE_ARENA`` bytes. ``secret`` (``PoolConfig.pool_secret``) signs
    every put and is required of every get (``kvpool.header``, "Signatures").
    """

    INLINE_ARENA = 16 << 20

    def __init__(
        self,
        inner: KVStore,
        fingerprint: str | bytes,
        *,
        checksum: bool = True,
        verify: bool | None = None,
        slots: int = 1024,
        inline_bytes: int | None = None,
        secret: bytes | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self._clock = clock  # the wall clock stamped into headers (seconds)
        if secret is not None and not secret:
            raise ValueError("a pool secret must not be empty (None: unsigned objects)")
        self._secret = secret
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        inline = inner.merge_bytes if inline_bytes is None else inline_bytes
        if inline < 0:
            raise ValueError(f"inline_bytes must be >= 0, got {inline}")
        self.inline_bytes = inline
        self._slot_bytes = HEADER_SIZE + -(-inline // 64) * 64
        if inline:
            slots = min(slots, max(16, self.INLINE_ARENA // self._slot_bytes))
        self.inner = inner
        self.fingerprint = fingerprint_bytes(fingerprint)
        self.checksum = checksum
        self.verify = checksum if verify is None else verify
        self.max_batch = min(inner.max_batch, slots)
        self.max_key_batch = inner.max_key_batch  # exists and remove pass straight through
        self._arena = inner.alloc_staging(slots * self._slot_bytes)  # registered by inner
        self._view = self._arena.data
        self._table = HeaderTable(self._arena, self._slot_bytes)
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

    def prefault(self, addr: int, nbytes: int) -> bool:
        return not self.closed and self.inner.prefault(addr, nbytes)

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
        return self._framed_put(keys, segments, self.inner._put)

    def _put_pinned(
        self, keys: Sequence[str], segments: Sequence[Segments], pin_ms: int
    ) -> list[Status]:
        inner = self.inner
        return self._framed_put(keys, segments, lambda k, f: inner._put_pinned(k, f, pin_ms))

    def _framed_put(
        self,
        keys: Sequence[str],
        segments: Sequence[Segments],
        put: Callable[[Sequence[str], Sequence[Segments]], list[Status]],
    ) -> list[Status]:
        slots = self._acquire(len(keys))
        try:
            # Checksums and headers of the whole batch at once (header.batch_checksums,
            # header.HeaderTable).
            sums = batch_checksums(segments) if self.checksum else None
            now_ms = int(self._clock() * 1000)
            self._table.pack_rows(slots, self.fingerprint, keys, totals(segments), sums, now_ms)
            if self._secret is not None:
                self._table.sign_rows(slots, keys, segments, self._secret)
            return self._inner(put, keys, self._frames(slots, segments, copy_in=True))
        finally:
            self._release(slots)

    def batch_get_deferred(
        self, keys: Sequence[str], segments: Sequence[Segments]
    ) -> tuple[list[Status], DeferredCheck | None]:
        if not self.verify or self._secret is not None:  # a signature reads the payload
            return self.batch_get(keys, segments), None
        carried: dict[str, int] = {}
        out = self._run(
            keys,
            segments,
            self._problems(keys, segments),
            lambda ks, ss: self._get(ks, ss, carried),
        )
        got = [i for i, status in enumerate(out) if status is Status.OK]
        payloads = segments if len(got) == len(keys) else take(segments, got)
        expected = [carried[keys[i]] for i in got]
        return out, _PayloadCheck(self, [keys[i] for i in got], payloads, expected, got)

    def _get(
        self,
        keys: Sequence[str],
        segments: Sequence[Segments],
        deferred: dict[str, int] | None = None,
    ) -> list[Status]:
        """Get and check; with ``deferred``, every check but the payload checksum,
        whose expected value goes into ``deferred`` per OK key."""
        slots = self._acquire(len(keys))
        try:
            out = self._inner(self.inner._get, keys, self._frames(slots, segments))
            for key, status in zip(keys, out, strict=True):
                if status is Status.CORRUPT:  # the inner store saw a size mismatch
                    self._reject(key, CheckFailure.LENGTH)
            got = [i for i, status in enumerate(out) if status is Status.OK]
            if not got:
                return out
            if len(got) == len(keys):
                payloads, rows, got_keys = segments, slots, keys
            else:
                payloads = take(segments, got)
                rows, got_keys = [slots[i] for i in got], [keys[i] for i in got]
            if self.inline_bytes:
                self._copy_out(rows, payloads)
            if deferred is None:
                sums = batch_checksums(payloads) if self.verify else None
            else:  # the headers' own checksums stand in (0: none, NO_CHECKSUM), checked later
                sums = [cs or 0 for cs in self._table.checksums(rows)]
            sigs = None
            if self._secret is not None:
                sigs = self._table.signatures(rows, got_keys, payloads, self._secret)
            lengths = totals(payloads)
            valid = self._table.valid_rows(rows, self.fingerprint, got_keys, lengths, sums, sigs)
            if deferred is not None and sums is not None:
                deferred.update(
                    (k, cs) for k, cs, ok in zip(got_keys, sums, valid, strict=True) if ok
                )
            for j in (j for j, ok in enumerate(valid) if not ok):
                i = got[j]
                checksum = sums[j] if sums is not None else None
                sig = sigs[j] if sigs is not None else None
                failure = self._failure(keys[i], lengths[j], slots[i], checksum, sig)
                out[i] = _status(failure)
                self._reject(keys[i], failure)
            return out
        finally:
            self._release(slots)

    def _inner(
        self,
        op: Callable[[Sequence[str], Sequence[Segments]], list[Status]],
        keys: Sequence[str],
        framed: Sequence[Segments],
    ) -> list[Status]:
        """``op`` (the inner store's ``_put`` or ``_get``) without its per-key checks:
        keys and payloads were checked by this store's ``batch_*``, header segments are
        valid by construction, and batches fit ``inner.max_batch``."""
        if self.inner.closed:
            return [Status.UNAVAILABLE] * len(keys)
        return self.inner._call(op, keys, framed)

    def _failure(
        self, key: str, length: int, slot: int, checksum: int | None, signature: bytes | None
    ) -> CheckFailure:
        """Why the header in ``slot`` failed ``HeaderTable.valid_rows`` (the slow path)."""
        header = unpack(self._view, slot * self._slot_bytes)
        failure = check(header, self.fingerprint, key, length, checksum, signature)
        return failure or CheckFailure.CHECKSUM

    def _inlined(self, n: int) -> bool:
        """Whether a first payload segment of ``n`` bytes travels in the header's slot."""
        return 0 < n <= self.inline_bytes

    def _frames(
        self, slots: list[int], payloads: Sequence[Segments], copy_in: bool = False
    ) -> Sequence[Segments]:
        """The scatter lists of the whole objects: header (and an inlined first payload
        segment, copied into the slot first when ``copy_in``), then the payload."""
        if not isinstance(payloads, Scatter):  # plain lists: the inner store merges them
            return [self._frame(s, p, copy_in) for s, p in zip(slots, payloads, strict=True)]
        heads = [self._base + slot * self._slot_bytes for slot in slots]
        cols, hs = payloads, HEADER_SIZE
        if not self.inline_bytes or not any(map(self._inlined, map(_first, cols.sizes))):
            return Scatter(
                [[h, *a] for h, a in zip(heads, cols.addrs, strict=True)],
                [[hs, *n] for n in cols.sizes],
            )
        addrs, sizes = [], []
        for h, a, n in zip(heads, cols.addrs, cols.sizes, strict=True):
            if self._inlined(n[0]):
                if copy_in:
                    ctypes.memmove(h + hs, a[0], n[0])
                addrs.append([h, *a[1:]])
                sizes.append([hs + n[0], *n[1:]])
            else:
                addrs.append([h, *a])
                sizes.append([hs, *n])
        return Scatter(addrs, sizes)

    def _frame(self, slot: int, payload: Segments, copy_in: bool) -> list[tuple[int, int]]:
        """``_frames`` of one plain scatter list."""
        addr = self._base + slot * self._slot_bytes
        n = payload[0][1]
        if not self._inlined(n):
            return [(addr, HEADER_SIZE), *payload]
        if copy_in:
            ctypes.memmove(addr + HEADER_SIZE, payload[0][0], n)
        return [(addr, HEADER_SIZE + n), *payload[1:]]

    def _copy_out(self, slots: list[int], payloads: Sequence[Segments]) -> None:
        """After a get: move inlined first segments from their slots to their places."""
        if isinstance(payloads, Scatter):
            addrs, sizes = map(_first, payloads.addrs), map(_first, payloads.sizes)
            firsts = list(zip(addrs, sizes, strict=True))
        else:
            firsts = [p[0] for p in payloads]
        for slot, (a, n) in zip(slots, firsts, strict=True):
            if self._inlined(n):
                ctypes.memmove(a, self._base + slot * self._slot_bytes + HEADER_SIZE, n)

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


class _PayloadCheck(DeferredCheck):
    """The checksums a ``FramedStore.batch_get_deferred`` left to its caller."""

    def __init__(
        self,
        store: FramedStore,
        keys: list[str],
        payloads: Sequence[Segments],
        expected: list[int],
        index: list[int],
    ) -> None:
        self._store = store
        self._keys = keys
        self._payloads = payloads
        self._expected = expected
        self._index = index  # position of each in the get's keys

    def failed(self) -> list[int]:
        sums = batch_checksums(self._payloads)
        bad = [j for j, (a, b) in enumerate(zip(sums, self._expected, strict=True)) if a != b]
        for j in bad:
            self._store._reject(self._keys[j], CheckFailure.CHECKSUM)
        return [self._index[j] for j in bad]

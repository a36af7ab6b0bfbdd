"""The store interface: batched operations on string keys and scatter lists.

This is the cut between kvpool and a storage backend. It speaks plain
primitives only: string keys, and per key a *scatter list* of ``(address,
size)`` segments in the caller's memory (the object is their concatenation, in
order). No layout, tensor or Mooncake type crosses it. A batch's scatter lists
may also come as one ``Scatter`` (two columns of ints, checked when built): the
hot path's form, which stores that know it pass on without a step per segment.
Both forms and their helpers are ``kvpool.store.scatter``'s.

    batch_exists(keys)            OK or MISSING per key (a failure status when the
                                  store cannot answer)
    batch_put(keys, segments, pin_ms=0)  store each key's bytes; a key that already
                                  exists keeps its old value and reports OK or EXISTS
                                  (``reports_duplicates`` says which one to expect);
                                  ``pin_ms`` > 0 asks to keep the new objects that
                                  long before others are evicted (a soft pin: a
                                  store without pins stores them unpinned)
    batch_get(keys, segments)     fill the caller's segments; OK only when the
                                  object's size equals the segments' total;
                                  MISSING when absent or evicted
    batch_get_deferred(keys, segments)  ``batch_get``, where a store that verifies
                                  payloads (``FramedStore``) may leave that check
                                  to the ``DeferredCheck`` it returns: an OK
                                  payload is trusted only once the caller has run
                                  it (default: ``batch_get``, nothing left)
    batch_remove(keys, force)     OK, MISSING, or LEASED while a read lease runs
                                  (``force`` skips the lease)
    register_memory(addr, size)   make a region usable for zero-copy transfers
    unregister_memory(addr)       undo it
    alloc_staging(nbytes)         a buffer usable in any segment of this store, alive
                                  until ``close`` (required where ``requires_staging``)
    reaches(addr, nbytes)         whether segments there can be moved at all
    prefault(addr, nbytes)        have the backend touch its memory now, reading only,
                                  so the first transfers through it run as fast as
                                  later ones (default: nothing to do; False)
    health()                      True while the store can serve requests
    close()                       release everything; idempotent; afterwards every
                                  call reports UNAVAILABLE per key

Guarantees every implementation keeps:

* Each ``batch_*`` call returns exactly one ``Status`` per key, in input order.
* Per-key failures are values, never exceptions. A whole-store failure (closed
  store, master gone) is UNAVAILABLE for every key. ``StoreError`` is raised
  only by set-up calls: construction, ``register_memory``, ``alloc_staging``.
* A stored value is immutable: a put never replaces it (remove it first).
* Any stored object may vanish at any time (eviction); it then reads MISSING,
  never as other bytes.
* After a non-OK ``batch_get`` the destination bytes are unspecified.

Callers keep the destinations of one ``batch_get`` disjoint, and leave every
segment untouched until the call returns.

Implementers provide ``_exists``, ``_put``, ``_get`` and ``_remove`` (and
``_put_pinned`` where the backend pins; by default it is ``_put``); the public
calls around them validate input (a malformed entry is INVALID without reaching
the backend, each kind logged once; addresses and sizes must be Python ``int``,
not numpy integers), answer UNAVAILABLE after ``close()``, and split batches
larger than ``max_batch`` into sub-batches.
"""

from __future__ import annotations

import abc
import enum
import logging
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Self

import numpy as np
import numpy.typing as npt

from kvpool.errors import StoreUnavailable
from kvpool.store.scatter import Scatter, Segments, malformed_segments, take

__all__ = ["DeferredCheck", "KVStore", "Status"]

logger = logging.getLogger(__name__)


class Status(enum.Enum):
    """The outcome of one key of one batch call."""

    OK = "ok"
    MISSING = "missing"  # no such object (never stored, removed, or evicted)
    EXISTS = "exists"  # put: the key was stored already; its old value is kept
    NO_SPACE = "no_space"  # put: the pool cannot hold the object
    LEASED = "leased"  # remove: refused while a read lease runs
    TRANSFER_FAILED = "transfer_failed"  # the bytes could not be moved (e.g. dead holder)
    UNAVAILABLE = "unavailable"  # the store cannot serve requests (closed, master gone)
    INVALID = "invalid"  # the request itself is malformed (a caller bug)
    CORRUPT = "corrupt"  # get: header, checksum or size does not match the request
    # get: a whole object written by a healthy writer without the checksum this
    # reader requires: not damaged, so left in place
    MISMATCH = "mismatch"
    # get: not signed with this reader's pool secret (forged, or written by a
    # client without it): never trusted, removed like a corrupt object
    FORGED = "forged"
    TIMED_OUT = "timed_out"  # no answer within the caller's deadline (e.g. a frozen holder)
    # Not attempted: the caller refused it locally (its staging or queue was
    # busy) and never asked the store. Says nothing about the store's health.
    REFUSED = "refused"

    @property
    def ok(self) -> bool:
        """The operation did what was asked."""
        return self is Status.OK

    @property
    def stored(self) -> bool:
        """After a put: the key holds a value (this one or an earlier one)."""
        return self in (Status.OK, Status.EXISTS)

    @property
    def transient(self) -> bool:
        """Retrying later may succeed (the request itself was fine)."""
        return self in (
            Status.NO_SPACE,
            Status.LEASED,
            Status.TRANSFER_FAILED,
            Status.UNAVAILABLE,
            Status.TIMED_OUT,
            Status.REFUSED,
        )


def _plain_key(key: object) -> bool:
    return type(key) is str and bool(key)


def _malformed(key: object, segments: object = None, check_segments: bool = True) -> str | None:
    """Why a key or scatter list must not reach a backend, or None if it may."""
    if not isinstance(key, str) or not key:
        return f"a key must be a non-empty str: got {type(key).__name__}"
    if not check_segments:
        return None
    return malformed_segments(segments)


_reported: set[str] = set()


def _report(reason: str) -> None:
    """Log each kind of malformed request once (at DEBUG afterwards)."""
    kind = reason.partition(":")[0]
    first = kind not in _reported
    _reported.add(kind)
    (logger.warning if first else logger.debug)("kvpool: INVALID store request: %s", reason)


class DeferredCheck(abc.ABC):
    """The payload check a ``batch_get_deferred`` left to its caller, over the
    segments that call filled (untouched until it has run)."""

    @abc.abstractmethod
    def failed(self) -> list[int]:
        """Indices (into the get's keys) of the OK objects whose payload fails the
        check: read them CORRUPT. The store counts and logs them as its own."""


class KVStore(abc.ABC):
    """A batched key-value store of immutable byte objects. See the module docstring.

    Thread safety: implementations must accept concurrent calls from several
    threads (transfer threads and the lookup server share one store).
    """

    #: Largest batch handed to the backend at once; larger calls are split.
    max_batch: int = 1024
    #: Largest key-only batch (exists, remove): no buffers, so it can be larger.
    max_key_batch: int = 1024

    def __init__(self) -> None:
        self._closed = False
        self._staging: list[npt.NDArray[np.uint8]] = []  # kept alive until close

    # -- capabilities (override to advertise) ---------------------------------

    @property
    def reports_duplicates(self) -> bool:
        """True if a put of an existing key reports EXISTS rather than OK."""
        return False

    @property
    def supports_leases(self) -> bool:
        """True if reads grant leases during which ``remove`` reports LEASED."""
        return False

    @property
    def requires_registration(self) -> bool:
        """True if segments must lie in ``register_memory`` regions (e.g. RDMA)."""
        return False

    @property
    def requires_staging(self) -> bool:
        """True if every segment must lie in a buffer from ``alloc_staging``
        (e.g. Mooncake's same-host shared-memory mode)."""
        return False

    @property
    def merge_bytes(self) -> int:
        """Payload bytes worth copying to save the backend one transfer slice per
        object: ``FramedStore`` copies a first payload segment up to this size next
        to the object's header, so both move as one slice. 0: never copy."""
        return 0

    @property
    def closed(self) -> bool:
        return self._closed

    # -- public calls -----------------------------------------------------------

    def batch_exists(self, keys: Sequence[str]) -> list[Status]:
        """OK or MISSING per key; UNAVAILABLE when the store cannot answer.

        On stores with leases, a present key gets a read lease.
        """
        valid = [_malformed(k, check_segments=False) for k in keys]
        return self._run(keys, None, valid, lambda ks, _: self._exists(ks), self.max_key_batch)

    def batch_put(
        self, keys: Sequence[str], segments: Sequence[Segments], pin_ms: int = 0
    ) -> list[Status]:
        """Store ``keys[i]`` as the concatenation of ``segments[i]``.

        OK or EXISTS when the key holds a value afterwards (possibly an older
        one); NO_SPACE, TRANSFER_FAILED, UNAVAILABLE or INVALID otherwise.
        An object of zero bytes is INVALID. ``pin_ms`` > 0: new objects are
        soft-pinned that long (evicted only after unpinned ones); an object that
        existed keeps its old pin.
        """
        problems = self._problems(keys, segments)
        if pin_ms <= 0:
            return self._run(keys, segments, problems, self._put)
        return self._run(keys, segments, problems, lambda k, s: self._put_pinned(k, s, pin_ms))

    def batch_get(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        """Fill ``segments[i]`` with the bytes of ``keys[i]``.

        OK only when the object's size equals the segments' total; CORRUPT when
        it exists with another size; MISSING when absent. On stores with leases
        a successful read grants a lease.
        """
        return self._run(keys, segments, self._problems(keys, segments), self._get)

    def batch_get_deferred(
        self, keys: Sequence[str], segments: Sequence[Segments]
    ) -> tuple[list[Status], DeferredCheck | None]:
        """``batch_get``, leaving the payload check (where this store makes one) to
        the returned ``DeferredCheck``: until its ``failed()`` has run, an OK says
        only that the bytes arrived. None: every check was made (the default)."""
        return self.batch_get(keys, segments), None

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[Status]:
        """OK, MISSING, or LEASED while a read lease runs (unless ``force``)."""
        valid = [_malformed(k, check_segments=False) for k in keys]
        return self._run(
            keys, None, valid, lambda ks, _: self._remove(ks, force), self.max_key_batch
        )

    def register_memory(self, addr: int, size: int) -> None:
        """Make ``[addr, addr + size)`` usable for transfers.

        Raises ``StoreError`` if the backend refuses (a setup failure), and
        ``StoreUnavailable`` if the store is closed. The default only checks that.
        """
        self._check_open()

    def unregister_memory(self, addr: int) -> None:
        """Undo ``register_memory(addr, ...)``; unknown regions are ignored."""
        return None

    def alloc_staging(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A buffer of ``nbytes`` (contents unspecified) that any segment may use.

        Registered already and valid until ``close``; never use it afterwards.
        The default allocates numpy memory and registers it. Raises ``StoreError``
        if the backend cannot provide it.
        """
        self._check_open()
        buf = np.empty(nbytes, dtype=np.uint8)
        self.register_memory(buf.ctypes.data, nbytes)
        self._staging.append(buf)
        return buf

    def reaches(self, addr: int, nbytes: int) -> bool:
        """Can segments in ``[addr, addr + nbytes)`` be moved (once registered)? Where
        ``requires_staging``, only memory from this store's ``alloc_staging`` can."""
        if not self.requires_staging:
            return True
        return any(
            b.ctypes.data <= addr and addr + nbytes <= b.ctypes.data + b.nbytes
            for b in self._staging
        )

    def prefault(self, addr: int, nbytes: int) -> bool:
        """Have the backend touch ``[addr, addr + nbytes)`` (memory from
        ``alloc_staging``) before the first transfer through it, where that first
        transfer would otherwise pay for it; whether it did. It must only read: the
        memory's bytes stay as they are, so transfers (and the engine) may use it
        meanwhile. Blocks while it works; must not raise; ``close`` may be called
        meanwhile (from another thread), and it then returns soon. The default does
        nothing (False)."""
        return False

    def health(self) -> bool:
        """True while the store can serve requests. Must not raise."""
        return not self._closed

    def close(self) -> None:
        """Release the backend. Idempotent; later calls report UNAVAILABLE."""
        self._closed = True
        self._staging.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- for implementers ---------------------------------------------------------

    @abc.abstractmethod
    def _exists(self, keys: Sequence[str]) -> list[Status]:
        """One status per key for valid, non-empty ``keys`` (at most ``max_batch``)."""

    @abc.abstractmethod
    def _put(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        """One status per key; inputs are valid and at most ``max_batch`` long."""

    def _put_pinned(
        self, keys: Sequence[str], segments: Sequence[Segments], pin_ms: int
    ) -> list[Status]:
        """``_put`` with a soft pin of ``pin_ms`` > 0; a store without pins stores
        the objects unpinned (this default)."""
        return self._put(keys, segments)

    @abc.abstractmethod
    def _get(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        """One status per key; inputs are valid and at most ``max_batch`` long."""

    @abc.abstractmethod
    def _remove(self, keys: Sequence[str], force: bool) -> list[Status]:
        """One status per key for valid, non-empty ``keys`` (at most ``max_batch``)."""

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable(f"{type(self).__name__} is closed")

    # -- internals ------------------------------------------------------------

    @staticmethod
    def _problems(keys: Sequence[str], segments: Sequence[Segments]) -> list[str | None]:
        """Per key, why it must not reach the backend (None: it may). A ``Scatter``
        was checked when built, so only its keys are checked here."""
        if len(keys) != len(segments):
            raise TypeError(
                f"keys and segments must have equal lengths, got {len(keys)} and {len(segments)}"
            )
        if isinstance(segments, Scatter):
            if all(map(_plain_key, keys)):
                return [None] * len(keys)
            return [_malformed(k, check_segments=False) for k in keys]
        return [_malformed(k, s) for k, s in zip(keys, segments, strict=True)]

    def _run(
        self,
        keys: Sequence[str],
        segments: Sequence[Segments] | None,
        problems: list[str | None],
        op: Callable[[Sequence[str], Sequence[Segments]], list[Status]],
        batch: int | None = None,
    ) -> list[Status]:
        """Answer invalid entries and closed stores here; send the rest in sub-batches."""
        if self._closed:
            return [Status.UNAVAILABLE] * len(keys)
        n = batch or self.max_batch
        if not any(problems):  # the common case: slices, no copies per key
            out: list[Status] = []
            for start in range(0, len(keys), n):
                ss: Sequence[Segments] = () if segments is None else segments[start : start + n]
                out += self._call(op, keys[start : start + n], ss)
            return out
        out = [Status.INVALID] * len(keys)
        todo = []
        for i, problem in enumerate(problems):
            if problem is None:
                todo.append(i)
            else:
                _report(problem)
        for part in _chunks(todo, n):
            ss = () if segments is None else take(segments, part)
            results = self._call(op, [keys[i] for i in part], ss)
            for i, status in zip(part, results, strict=True):
                out[i] = status
        return out

    def _call(
        self,
        op: Callable[[Sequence[str], Sequence[Segments]], list[Status]],
        keys: Sequence[str],
        segments: Sequence[Segments],
    ) -> list[Status]:
        """``op`` on one sub-batch; a backend that miscounts its answers is a bug."""
        results = op(keys, segments)
        if len(results) != len(keys):
            raise RuntimeError(
                f"{type(self).__name__} returned {len(results)} results for {len(keys)} keys"
            )
        return results


def _chunks(items: list[int], n: int) -> Iterator[list[int]]:
    for start in range(0, len(items), n):
        yield items[start : start + n]

"""``MooncakeStore``: the ``KVStore`` on Mooncake Store. With ``mooncake_setup``, the only
module importing Mooncake; a little over 500 lines, every binding call in one place.

    MooncakeStore(config)        connect a client to the pool's master (``PoolConfig``)
    MooncakeStore(config, shared_memory=True)
                                 same-host mode: talk to the pool's holder
                                 (``holder_address``) over shared memory; falls back
                                 to TCP, with a warning, if that cannot be set up
    status_of(code)              Mooncake return code -> ``Status`` (with set-up
                                 helpers: ``kvpool.store.mooncake_setup``)
    store.prefault(addr, nbytes) shared memory: the holder maps every page of
                                 memory it reaches now (reads only: transient
                                 objects), not in the first loads
    store.read_heads(keys, n)    the first ``n`` bytes of each object (ranged reads;
                                 the payloads stay where they are): object headers,
                                 for ``kvpool status`` and ``kvpool purge``

Shared-memory mode (``requires_staging``): every segment must lie in a buffer
from ``alloc_staging`` (memfd memory the holder maps; Mooncake refuses any
other memory), and the holder copies between it and its segment, skipping
loopback TCP (several times faster for large objects). Objects are the same
objects a TCP client sees.

Tenants (``PoolConfig.mooncake_tenant``, on a pool with quotas): a TCP client
names its tenant at setup; a shared-memory client is its holder's tenant (each
quota tenant has its own holder, ``PoolConfig.for_tenant``).

Setup fails fast and says why: a missing wheel or ``libibverbs.so.1`` raises
``StoreMissingDependency`` naming what to install; a master that does not
accept a TCP connection within ``setup_timeout_s`` raises ``StoreUnavailable``
naming its address. Before setup the process environment gets bounds on
Mooncake's waits, each only if not set already: ``MC_STORE_CLIENT_SETUP_RETRIES``
and ``MC_RPC_TIMEOUT_MS`` (from ``setup_timeout_s``: it bounds every call to the
master, which otherwise waits 30 s on a hung one), ``MC_TCP_PROGRESS_TIMEOUT_SEC``
and ``MC_TCP_STATUS_TIMEOUT_SEC`` (from ``transfer_timeout_s``), and
``MC_TCP_BIND_ADDRESS`` when ``local_hostname`` is an IP address.

Calls use Mooncake's zero-copy multi-buffer batch API. Return codes map to
statuses (0 or a byte count: OK; -200 NO_SPACE; -600 INVALID; -704 MISSING;
-706 LEASED; -800 TRANSFER_FAILED; see ``status_of``); a get whose buffers do not
match the object's size is CORRUPT. Mooncake reports a duplicate put as OK
(the old value stays). No exception escapes a ``batch_*`` call: a failing
binding call is UNAVAILABLE for its keys, logged. ``close`` waits for calls in
flight, so no call ever reaches a closed Mooncake client (that crashes).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import operator
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvpool.config import PoolConfig
from kvpool.errors import StoreError, StoreUnavailable
from kvpool.store.base import KVStore, Status
from kvpool.store.mooncake_setup import (
    bound_waits,
    connect_error,
    load_mooncake,
    probe,
    status_of,
)
from kvpool.store.scatter import Scatter, Segments

__all__ = ["MooncakeStore", "status_of"]

logger = logging.getLogger(__name__)

SEGMENTS_IN_FLIGHT = 1024  # per TCP/RDMA transfer call; see MooncakeStore._by_segments
# Shared memory: the holder copies every segment itself, with no such queue (8000
# segments in one call measured fine); the bound only keeps calls finite.
SHM_SEGMENTS_IN_FLIGHT = 16384
# Over TCP every scatter segment is a transfer slice with its own round trip on one
# of four lanes (~40-50 us on the 2-core build machine, as long as copying ~400 KiB),
# so a small first segment is better copied next to the header (``merge_bytes``).
# On shared memory a slice costs ~4 us, about a copy of 8 KiB.
TCP_MERGE_BYTES = 64 << 10
SHM_MERGE_BYTES = 8 << 10
HEAD_BATCH = 512  # objects whose first bytes one read_heads call reads
# prefault: the holder reads this many bytes every stride (Linux maps the 16 pages
# around a read fault at once), 1000 touches (62.5 MiB) per transient object: a
# quota tenant's holder refused puts of over 2048 segments (measured: 2100 failed),
# and a put that the master places in another holder moves over TCP
# (``SEGMENTS_IN_FLIGHT``).
PREFAULT_STRIDE = 64 << 10
PREFAULT_TOUCH = 64
PREFAULT_BATCH = 1000
PREFAULT_PREFIX = "kvpool-prefault/"  # its key: never a kvpool key (status: "other")


class MooncakeStore(KVStore):
    """A Mooncake Store client. See the module docstring.

    With ``config.global_segment_size == 0`` it is a pure client: objects live
    in the pool's holder and outlive this process.
    """

    # One master RPC answers a lookup of a long prompt (16k keys in ~11 ms).
    max_key_batch = 65536

    def __init__(self, config: PoolConfig, *, shared_memory: bool = False) -> None:
        super().__init__()
        factory = load_mooncake()
        master = config.require_master()
        probe(master, config.setup_timeout_s)
        bound_waits(config, os.environ)
        self.config = config
        self._cond = threading.Condition()
        self._transfer_lock = threading.Lock()
        self._inflight = 0
        self._heads: npt.NDArray[np.uint8] | None = None  # read_heads' shared memory
        self.shared_memory = False
        if shared_memory:
            self._store = factory()
            self.shared_memory = self._setup_shared(config)
        if not self.shared_memory:
            self._store = factory()
            self._setup_tcp(config, master)
        logger.info(
            "kvpool: Mooncake client connected to %s (%s)",
            master,
            f"shared memory via {config.holder_address}" if self.shared_memory else config.protocol,
        )

    def _setup_tcp(self, config: PoolConfig, master: str) -> None:
        rc = self._store.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            master,
            tenant_id=config.mooncake_tenant or "default",  # Mooncake's own default
        )
        if rc != 0:
            raise StoreUnavailable(
                f"Mooncake client setup against mooncake_master at {master} failed "
                f"(code {rc}); see Mooncake's log above"
            )

    def _setup_shared(self, config: PoolConfig) -> bool:
        """Connect to the holder as a same-host "dummy client"; False (logged) if not."""
        holder = config.holder_address
        why = "no holder_address is configured" if not holder else None
        if why is None:
            why = connect_error(holder, config.setup_timeout_s)
        if why is None:
            rc = self._guarded(
                "setup_dummy", self._store.setup_dummy, 0, config.local_buffer_size, holder
            )
            why = None if rc == 0 else f"setup_dummy returned {rc}"
        if why is not None:
            logger.warning(
                "kvpool: shared memory with the holder %s is not available (%s); using %s",
                holder or "(none)",
                why,
                config.protocol,
            )
        return why is None

    @classmethod
    def from_config(cls, config: PoolConfig, **options: Any) -> MooncakeStore:
        return cls(config, **options)

    # -- capabilities -----------------------------------------------------------

    @property
    def supports_leases(self) -> bool:
        return True

    @property
    def requires_registration(self) -> bool:
        return self.shared_memory or self.config.protocol == "rdma"

    @property
    def requires_staging(self) -> bool:
        return self.shared_memory

    @property
    def merge_bytes(self) -> int:
        if self.shared_memory:
            return SHM_MERGE_BYTES
        return TCP_MERGE_BYTES if self.config.protocol == "tcp" else 0

    @property
    def raw(self) -> Any:
        """The underlying ``MooncakeDistributedStore``, for benchmarks and diagnostics.

        Calls on it bypass every guard of this class; never use it after ``close``.
        """
        return self._store

    # -- lifecycle ----------------------------------------------------------------

    def register_memory(self, addr: int, size: int) -> None:
        with self._using() as store:
            if store is None:
                raise StoreUnavailable("MooncakeStore is closed")
            rc = store.register_buffer(addr, size)
        if rc != 0:
            raise StoreError(f"Mooncake refused to register {size} bytes at {addr:#x} (code {rc})")

    def alloc_staging(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """In shared-memory mode, memory from the holder's pool, registered whole."""
        if not self.shared_memory:
            return super().alloc_staging(nbytes)
        with self._using() as store:
            if store is None:
                raise StoreUnavailable("MooncakeStore is closed")
            addr = self._guarded("alloc_from_mem_pool", store.alloc_from_mem_pool, nbytes)
            if not addr:
                raise StoreError(f"Mooncake could not allocate {nbytes} bytes of shared memory")
            rc = store.register_buffer(addr, nbytes)
        if rc != 0:
            raise StoreError(f"Mooncake refused to register its own shared memory (code {rc})")
        buf = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
        self._staging.append(buf)  # what ``reaches`` answers from
        return buf

    def unregister_memory(self, addr: int) -> None:
        with self._using() as store:
            rc = store.unregister_buffer(addr) if store is not None else 0
        if rc != 0:
            logger.warning("kvpool: Mooncake unregister_buffer(%#x) returned %d", addr, rc)

    def health(self) -> bool:
        """Mooncake's own check, and the master accepts a connection (the former
        alone stays healthy for seconds after the master is gone)."""
        with self._using() as store:
            if store is None or self._guarded("health_check", store.health_check) != 0:
                return False
        timeout = min(1.0, self.config.setup_timeout_s)
        return connect_error(self.config.master_address, timeout) is None

    def close(self) -> None:
        with self._cond:
            if self.closed:
                return
            super().close()  # new calls now report UNAVAILABLE
            self._cond.wait_for(lambda: self._inflight == 0)
        rc = self._guarded("close", self._store.close)
        logger.info("kvpool: Mooncake client closed (code %s)", rc)

    # -- KVStore ------------------------------------------------------------------

    def _exists(self, keys: Sequence[str]) -> list[Status]:
        with self._using() as store:
            if store is None:
                return [Status.UNAVAILABLE] * len(keys)
            codes = self._guarded("batch_is_exist", store.batch_is_exist, list(keys))
        if codes is None:
            return [Status.UNAVAILABLE] * len(keys)
        # 1 present, 0 absent, -1 could not ask
        return [
            Status.OK if c == 1 else Status.MISSING if c == 0 else Status.UNAVAILABLE for c in codes
        ]

    def _put(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        return self._by_segments(keys, segments, self._put_some)

    def _put_pinned(
        self, keys: Sequence[str], segments: Sequence[Segments], pin_ms: int
    ) -> list[Status]:
        return self._by_segments(keys, segments, lambda k, s: self._put_some(k, s, pin_ms))

    def _get(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        return self._by_segments(keys, segments, self._get_some)

    def _by_segments(
        self,
        keys: Sequence[str],
        segments: Sequence[Segments],
        call: Callable[[Sequence[str], Sequence[Segments]], list[Status]],
    ) -> list[Status]:
        """Run ``call`` on sub-batches of bounded segment counts, one at a time.

        Mooncake's TCP transport keeps about 2048 segments in flight; past that a
        batch fails with -800 or blocks for 60 s, and the holder may refuse puts
        for a while after (measured). Sub-batches, and one transfer at a time per
        client (saves and loads run on two threads), keep every call under the
        limit. The shared-memory path has no such limit (SHM_SEGMENTS_IN_FLIGHT).
        """
        out: list[Status] = []
        start = 0
        bound = SHM_SEGMENTS_IN_FLIGHT if self.shared_memory else SEGMENTS_IN_FLIGHT
        counts = segments.counts() if isinstance(segments, Scatter) else list(map(len, segments))
        if sum(counts) <= bound:  # one call (the common case)
            with self._transfer_lock:
                return call(keys, segments)
        while start < len(keys):
            end, count = start, 0
            while end < len(keys) and (end == start or count + counts[end] <= bound):
                count += counts[end]
                end += 1
            with self._transfer_lock:
                out += call(keys[start:end], segments[start:end])
            start = end
        return out

    def _put_some(
        self, keys: Sequence[str], segments: Sequence[Segments], pin_ms: int = 0
    ) -> list[Status]:
        ptrs, sizes = _columns(segments)
        with self._using() as store:
            if store is None:
                return [Status.UNAVAILABLE] * len(keys)
            codes = self._guarded(
                "batch_put_from_multi_buffers",
                store.batch_put_from_multi_buffers,
                list(keys),
                ptrs,
                sizes,
                _put_options(pin_ms),
            )
        return self._statuses("put", keys, codes)

    def _get_some(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        ptrs, sizes = _columns(segments)
        with self._using() as store:
            if store is None:
                return [Status.UNAVAILABLE] * len(keys)
            codes = self._guarded(
                "batch_get_into_multi_buffers",
                store.batch_get_into_multi_buffers,
                list(keys),
                ptrs,
                sizes,
            )
            if codes is None:
                return [Status.UNAVAILABLE] * len(keys)
            out = []
            for key, expected, code in zip(keys, map(sum, sizes), codes, strict=True):
                if code >= 0:
                    out.append(Status.OK if code == expected else Status.CORRUPT)
                elif code in (-600, -800) and self._size_differs(store, key, expected):
                    out.append(Status.CORRUPT)  # Mooncake's answer to a size mismatch
                else:
                    out.append(self._status("get", key, code))
            return out

    def _remove(self, keys: Sequence[str], force: bool) -> list[Status]:
        with self._using() as store:
            if store is None:
                return [Status.UNAVAILABLE] * len(keys)
            codes = self._guarded("batch_remove", store.batch_remove, list(keys), force)
        return self._statuses("remove", keys, codes)

    def remove_prefix(self, prefix: str, force: bool = False) -> int:
        """Remove every key starting with ``prefix``; the number removed.

        Leased objects are kept unless ``force``. Raises ``StoreError`` if the
        store refuses (Mooncake matches the regex anywhere, hence the anchor).
        """
        with self._using() as store:
            if store is None:
                raise StoreUnavailable("the Mooncake client is closed")
            rc = self._guarded("remove_by_regex", store.remove_by_regex,
                               "^" + re.escape(prefix), force)  # fmt: skip
        if rc is None or rc < 0:
            raise StoreError(f"removing keys under {prefix!r} failed (code {rc})")
        return int(rc)

    def prefault(self, addr: int, nbytes: int) -> bool:
        """Shared memory: the holder maps a client's memory (staging, a zero-copy KV
        cache) but takes a page fault on its first touch of each page, so a fresh
        engine's first loads ran at a third of later speed (a get of 1 GiB into
        fresh memory: 422 ms; into used memory: 149 ms; the client touching its own
        pages first does not help, the faults are the holder's). Here the holder
        reads ``PREFAULT_TOUCH`` bytes every ``PREFAULT_STRIDE`` (transient objects
        under ``PREFAULT_PREFIX``, each put from ``PREFAULT_BATCH`` touches, then
        removed): a read fault maps the 16 pages around it at once (Linux's
        fault-around, 64 KiB), writable, as shared memory is not write-tracked.
        Measured, 1 GiB: 56 ms, then a first get of 164 ms. It only reads: the
        memory's bytes stay as they are, so it may run while the memory is in use.
        Over TCP: nothing to do (False)."""
        if not self.shared_memory or nbytes < PREFAULT_STRIDE:
            return False
        # Every stride and the buffer's last bytes (its tail window), never past it.
        offsets = range(0, nbytes - PREFAULT_TOUCH + 1, PREFAULT_STRIDE)
        tail = nbytes - PREFAULT_TOUCH
        for i in range(0, len(offsets), PREFAULT_BATCH):
            touches = [addr + off for off in offsets[i : i + PREFAULT_BATCH]]
            if i + PREFAULT_BATCH >= len(offsets) and offsets[-1] != tail:
                touches.append(addr + tail)
            key = f"{PREFAULT_PREFIX}{uuid.uuid4().hex}"  # a put of a key left over reads nothing
            segments = [[(a, PREFAULT_TOUCH) for a in touches]]
            with self._using() as store, self._transfer_lock:
                if store is None:
                    return False
                # Put as every kvpool put is (``_put_some``: this host's holder
                # first), so the holder itself reads the memory.
                (put,) = self._put_some([key], segments)
                if put is not Status.OK:
                    logger.debug("kvpool: prefault put: %s; memory not prefaulted", put.name)
                    return False
                self._guarded("remove", store.remove, key, True)
        return True

    def read_heads(self, keys: Sequence[str], nbytes: int = 64) -> list[bytes | None]:
        """The first ``nbytes`` of each object of ``keys``: None where it is gone,
        shorter, or the pool did not answer. Ranged reads into one buffer,
        ``HEAD_BATCH`` keys a call. Like any read, each takes the object's read
        lease (``kvpool up --lease-ttl-ms``), as a lookup does."""
        out: list[bytes | None] = []
        if not keys:
            return out
        rows = min(len(keys), HEAD_BATCH)
        registered = not self.shared_memory
        if registered:  # a buffer of this call, registered for it
            buf = np.zeros(rows * nbytes, np.uint8)
            self.register_memory(buf.ctypes.data, buf.nbytes)
        else:  # the holder's shared memory, registered already; kept for later calls
            if self._heads is None or self._heads.nbytes < rows * nbytes:
                self._heads = self.alloc_staging(HEAD_BATCH * nbytes)
            buf = self._heads
        ptr = buf.ctypes.data
        try:
            for i in range(0, len(keys), rows):
                batch = list(keys[i : i + rows])
                with self._using() as store:
                    codes = None if store is None else self._guarded(
                        "get_into_ranges", store.get_into_ranges, [ptr], [batch],
                        [[[j * nbytes] for j in range(len(batch))]],
                        [[[0]] * len(batch)], [[[nbytes]] * len(batch)],
                    )  # fmt: skip
                got = codes[0] if codes else [[-1]] * len(batch)
                for j, ranges in enumerate(got):
                    whole = ranges and ranges[0] == nbytes
                    out.append(bytes(buf[j * nbytes : (j + 1) * nbytes]) if whole else None)
        finally:
            if registered:
                self.unregister_memory(ptr)
        return out

    # -- internals ----------------------------------------------------------------

    @contextlib.contextmanager
    def _using(self) -> Iterator[Any]:
        """The Mooncake client, held open for the block; None once closed."""
        with self._cond:
            if self.closed:
                yield None
                return
            self._inflight += 1
        try:
            yield self._store
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    @staticmethod
    def _guarded(op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a binding; a raised error is logged and returned as None (UNAVAILABLE)."""
        try:
            return fn(*args)
        except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
            logger.error("kvpool: Mooncake %s raised %s: %s", op, type(exc).__name__, exc)
            return None

    def _size_differs(self, store: Any, key: str, expected: int) -> bool:
        size = self._guarded("get_size", store.get_size, key)
        return isinstance(size, int) and size >= 0 and size != expected

    def _statuses(self, op: str, keys: Sequence[str], codes: list[int] | None) -> list[Status]:
        if codes is None:
            return [Status.UNAVAILABLE] * len(keys)
        ok = Status.OK  # 0, the common answer, without a call per key
        return [ok if c == 0 else self._status(op, k, c) for k, c in zip(keys, codes, strict=True)]

    @staticmethod
    def _status(op: str, key: str, code: int) -> Status:
        status = status_of(code)
        if status is not Status.OK and status is not Status.MISSING:
            logger.debug("kvpool: Mooncake %s of %r returned %d (%s)", op, key, code, status.name)
        return status


@functools.lru_cache(maxsize=64)
def _put_options(pin_ms: int = 0) -> Any:
    """Mooncake's put options asking the master for a segment on this client's node
    first (another node's when it has none: checked on the hosts tier; when the
    local one is full: the master's rule, not checked here): a host's saves stay in
    its own holder. Without it the master spread a host's saves over every holder
    (measured on the hosts tier: 14 of 22 objects local, 22 of 22 with it).
    ``pin_ms`` > 0: a soft pin that long (the master evicts unpinned objects first;
    a TTL over its ``--max_kv_soft_pin_ttl``, 24 h by default, fails the put). Made
    once per pin: puts pass the same options."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    config = ReplicateConfig()
    config.prefer_alloc_in_same_node = True
    if pin_ms > 0:
        config.soft_pin_action = SoftPinAction.ENABLE
        config.soft_pin_ttl_ms = pin_ms
    return config


def _columns(segments: Sequence[Segments]) -> tuple[list[list[int]], list[list[int]]]:
    """Addresses and sizes per object: a ``Scatter``'s own columns, else ``_split``."""
    if isinstance(segments, Scatter):
        return segments.addrs, segments.sizes
    return _split(segments)


def _split(segments: Sequence[Segments]) -> tuple[list[list[int]], list[list[int]]]:
    """Per object: addresses and sizes, empty segments dropped, adjacent ones merged.

    Mooncake moves every buffer as a transfer slice of its own, and the cost per
    slice dominates below a few hundred KiB, so ``[(a, n), (a + n, m)]`` goes as
    ``[(a, n + m)]``: the same bytes in the same order. (``map`` over C functions:
    this runs per object on the hot path.)
    """
    all_ptrs, all_sizes = [], []
    for segs in segments:
        ptrs, sizes = [a for a, _ in segs], [n for _, n in segs]
        if 0 in sizes:
            ptrs = [a for a, n in segs if n]
            sizes = [n for n in sizes if n]
        if len(ptrs) > 1 and any(map(operator.eq, map(operator.add, ptrs, sizes), ptrs[1:])):
            merged_p: list[int] = []
            merged_s: list[int] = []
            for addr, size in zip(ptrs, sizes, strict=True):
                if merged_p and merged_p[-1] + merged_s[-1] == addr:
                    merged_s[-1] += size
                else:
                    merged_p.append(addr)
                    merged_s.append(size)
            ptrs, sizes = merged_p, merged_s
        all_ptrs.append(ptrs)
        all_sizes.append(sizes)
    return all_ptrs, all_sizes

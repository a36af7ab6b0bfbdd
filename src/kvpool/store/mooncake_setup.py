"""Mooncake's return codes, and what a client needs before it connects.

    status_of(code)               Mooncake return code -> ``Status`` (unknown codes:
                                  UNAVAILABLE in the RPC range, else INVALID, logged once)
    load_mooncake()               the client class, or ``StoreMissingDependency``
                                  naming what to install (the wheel, libibverbs)
    connect_error(address, t)     why ``host:port`` refuses a TCP connection, or None
                                  (HA masters, ``etcd://A;B``: why every etcd does)
    probe(address, t)             ``StoreUnavailable`` unless the master (or etcd)
                                  accepts one
    bound_waits(config, env)      Mooncake's retry and timeout variables from
                                  ``config``, each only if not set already
    raw_client(master)            a plain Mooncake client (bytes in, bytes out, no
                                  kvpool framing), closed afterwards: for faults
                                  that ``kvpool chaos`` injects

Used by ``kvpool.store.mooncake`` (the client itself); imports Mooncake only
inside ``load_mooncake``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

from kvpool.config import PoolConfig, is_ha, master_endpoints
from kvpool.errors import StoreMissingDependency, StoreUnavailable
from kvpool.store.base import Status

__all__ = ["bound_waits", "connect_error", "load_mooncake", "probe", "status_of"]

logger = logging.getLogger(__name__)

_INSTALL_WHEEL = (
    "the Mooncake wheel is not installed: run `pip install 'kvpool[mooncake-cpu]'` "
    "(or `pip install 'kvpool[mooncake]'` on CUDA hosts)"
)
_INSTALL_VERBS = (
    "Mooncake needs the system library libibverbs.so.1 (even for TCP): "
    "run `apt-get install -y libibverbs1` as root"
)

# Mooncake ErrorCode values (mooncake-store/include/types.h) and what they mean here.
_CODES: dict[int, Status] = {
    -200: Status.NO_SPACE,  # NO_AVAILABLE_HANDLE
    -10: Status.INVALID,  # BUFFER_OVERFLOW
    -400: Status.INVALID,  # INVALID_KEY
    -600: Status.INVALID,  # INVALID_PARAMS (also: destination buffer too small)
    -601: Status.INVALID,  # ILLEGAL_CLIENT
    -500: Status.TRANSFER_FAILED,  # WRITE_FAIL
    -703: Status.MISSING,  # REPLICA_IS_NOT_READY: being written, not readable yet
    -704: Status.MISSING,  # OBJECT_NOT_FOUND
    -705: Status.EXISTS,  # OBJECT_ALREADY_EXISTS
    -706: Status.LEASED,  # OBJECT_HAS_LEASE
    -707: Status.TRANSFER_FAILED,  # LEASE_EXPIRED during the transfer
    -708: Status.LEASED,  # OBJECT_HAS_REPLICATION_TASK: busy, like a lease
    -710: Status.MISSING,  # REPLICA_NOT_FOUND
    -712: Status.MISSING,  # REPLICA_IS_GONE
    -800: Status.TRANSFER_FAILED,  # TRANSFER_FAIL (e.g. a dead holder's segment)
    -801: Status.CORRUPT,  # CHECKSUM_MISMATCH
    -900: Status.UNAVAILABLE,  # RPC_FAIL (e.g. the master is gone)
    -901: Status.UNAVAILABLE,  # RPC_TIMEOUT
    -1: Status.UNAVAILABLE,  # INTERNAL_ERROR
    # A tenant past its quota (``kvpool up --quota``): the master evicts that tenant's
    # own objects; the put, tried again 0.1 s later, landed (measured): a full pool.
    -1700: Status.NO_SPACE,
}
_unknown_logged: set[int] = set()


def status_of(code: int) -> Status:
    """The ``Status`` of a Mooncake return code (>= 0 is OK).

    Codes of the RPC (-900s) and high-availability (-1000s) ranges are
    UNAVAILABLE; any other unknown code is INVALID and logged once.
    """
    if code >= 0:
        return Status.OK
    known = _CODES.get(code)
    if known is not None:
        return known
    if code not in _unknown_logged:
        _unknown_logged.add(code)
        logger.warning("kvpool: unexpected Mooncake return code %d", code)
    return Status.UNAVAILABLE if -1099 <= code <= -900 else Status.INVALID


def load_mooncake() -> Callable[[], Any]:
    """``MooncakeDistributedStore``, or ``StoreMissingDependency`` saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise StoreMissingDependency(_INSTALL_VERBS) from exc
        raise StoreMissingDependency(_INSTALL_WHEEL) from exc
    factory: Callable[[], Any] = MooncakeDistributedStore
    return factory


@contextlib.contextmanager
def raw_client(master: str, host: str = "127.0.0.1", buffer: int = 64 << 20) -> Iterator[Any]:
    """A plain Mooncake client of the master at ``master`` over TCP, from ``host``,
    with a local buffer of ``buffer`` bytes; closed when the block ends.
    ``StoreUnavailable`` when it cannot connect."""
    store = load_mooncake()()
    rc = store.setup(host, "P2PHANDSHAKE", 0, buffer, "tcp", "", master)
    if rc != 0:
        raise StoreUnavailable(f"cannot connect a plain Mooncake client to {master} (rc {rc})")
    try:
        yield store
    finally:
        store.close()


def connect_error(address: str, timeout: float) -> str | None:
    """None if ``host:port`` accepts a TCP connection within ``timeout``, else why not.
    For HA masters (``etcd://A;B``): None if one of the etcd servers does."""
    error = "no address"
    for endpoint in master_endpoints(address):
        host, _, port = endpoint.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                return None
        except OSError as exc:
            error = exc.strerror or str(exc) or type(exc).__name__
    return error


def probe(address: str, timeout: float) -> None:
    """Raise ``StoreUnavailable`` unless the master (or an etcd server naming the
    leader of HA masters) accepts a TCP connection."""
    error = connect_error(address, timeout)
    if error is not None:
        what = "the etcd of the pool's masters" if is_ha(address) else "mooncake_master"
        raise StoreUnavailable(
            f"cannot reach {what} at {address} ({error}); "
            "is the pool running? Start one with `kvpool up` or fix master_address"
        )


def bound_waits(config: PoolConfig, env: dict[str, str] | os._Environ[str]) -> None:
    """Set Mooncake's retry and timeout variables from ``config``, unless set already."""
    # One setup retry costs about 4.5 s (measured), so this keeps within setup_timeout_s.
    env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(max(1, int(config.setup_timeout_s // 5))))
    env.setdefault("MC_RPC_TIMEOUT_MS", str(max(1, round(config.setup_timeout_s * 1000))))
    seconds = str(max(1, round(config.transfer_timeout_s)))
    env.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", seconds)
    env.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", seconds)
    with contextlib.suppress(ValueError):  # an address, not a name: bind where we advertise
        ipaddress.ip_address(config.local_hostname)
        env.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)

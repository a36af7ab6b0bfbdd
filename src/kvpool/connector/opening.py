"""Opening a connector's halves on a pool: kvpool's choices, made once at start.

pool_for_tenant(pool, tenant)    the pool as an engine of ``tenant`` uses it:
                                 its quota's holder and Mooncake tenant where
                                 the pool has a quota for it; said in the log
worker_store(identity, settings) how a worker opens its store, given the pool
                                 (the worker opens it again after a loss):
                                 over shared memory when ``shared_memory`` is
                                 "on", or "auto" with a holder on this host;
                                 framed with the engine's fingerprint, the
                                 pool's checksum rule and secret
start_lookups(identity, settings, pool, exact)
                                 the scheduler's ``Lookups``: a lookup server
                                 on the first free endpoint of this engine's
                                 instance and DP index (another server of the
                                 same config on this host may hold the first),
                                 its store, and a client with the lookup
                                 deadline; ``exact`` (failure policy "fail":
                                 a failed load fails the request) takes no
                                 chunk as present unprobed
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.config import PoolConfig
from kvpool.connector.identity import EngineIdentity
from kvpool.keys import default_instance, lookup_endpoints
from kvpool.lookup.client import LookupClient
from kvpool.lookup.endpoint import private_dir
from kvpool.lookup.server import LookupServer, start_first_free
from kvpool.settings import ConnectorSettings
from kvpool.store import open_store
from kvpool.store.base import KVStore
from kvpool.store.framed import FramedStore

__all__ = ["Lookups", "pool_for_tenant", "start_lookups", "worker_store"]

logger = logging.getLogger(__name__)


def pool_for_tenant(pool: PoolConfig, tenant: str) -> PoolConfig:
    """``pool`` for an engine of ``tenant`` (``PoolConfig.for_tenant``); said once."""
    mine = pool.for_tenant(tenant)
    if mine.mooncake_tenant:
        logger.info("kvpool: tenant %s puts within its quota, through %s", tenant,
                    mine.holder_address)  # fmt: skip
    elif pool.tenant_holders:
        logger.info(
            "kvpool: the pool has quotas for %s; %s shares the rest of its memory",
            ", ".join(pool.holders_by_tenant()),
            f"tenant {tenant}" if tenant else "this engine (no tenant)",
        )
    return mine


def _holder_is_local(pool: PoolConfig) -> bool:
    host = pool.holder_address.rpartition(":")[0]
    return bool(host) and (host in ("127.0.0.1", "localhost", "::1") or host == pool.local_hostname)


def worker_store(
    identity: EngineIdentity, settings: ConnectorSettings
) -> Callable[[PoolConfig], KVStore]:
    """The function a worker opens its store with (see the module docstring)."""

    def open_framed(pool: PoolConfig) -> KVStore:
        shm = settings.shared_memory == "on" or (
            settings.shared_memory == "auto" and _holder_is_local(pool)
        )
        inner = open_store(settings.store, pool, shared_memory=shm)
        path = "shared memory" if getattr(inner, "shared_memory", False) else pool.protocol
        tenant = identity.space.tenant
        logger.info(
            "kvpool: worker moves KV to the pool at %s over %s%s",
            pool.master_address,
            path,
            f" (tenant {tenant})" if tenant else "",
        )
        return FramedStore(
            inner, identity.space.fingerprint, checksum=pool.checksum, secret=pool.secret
        )

    return open_framed


@dataclass
class Lookups:
    """The scheduler's lookup server, its store, and the scheduler's client of it."""

    server: LookupServer
    client: LookupClient
    store: KVStore

    def close(self) -> None:
        """The client, the server, then the store; each closed though another fails."""
        for close in (self.client.close, self.server.close, self.store.close):
            try:
                close()
            except Exception:  # shutting down: log and go on closing the rest
                logger.exception("kvpool: error while closing the lookups")


def start_lookups(
    identity: EngineIdentity, settings: ConnectorSettings, pool: PoolConfig, exact: bool
) -> Lookups:
    """Start the scheduler's ``Lookups`` (see the module docstring)."""
    run_dir = settings.run_dir or os.path.join(tempfile.gettempdir(), f"kvpool-{os.getuid()}")
    private_dir(run_dir)
    instance = settings.instance or default_instance(identity.space)
    store = open_store(settings.store, pool)
    try:
        server = start_first_free(
            lookup_endpoints(run_dir, instance, identity.dp_index),
            lambda url: LookupServer(
                url, store, identity.layout, identity.space, identity.chunk_size, exact=exact
            ),
        )
    except BaseException:
        with contextlib.suppress(Exception):
            store.close()
        raise
    client = LookupClient(server.endpoint.url, timeout_ms=settings.lookup_timeout_ms)
    logger.info(
        "kvpool: scheduler lookups at %s (pool %s%s)",
        server.endpoint.url,
        pool.master_address,
        f", tenant {settings.tenant}" if settings.tenant else "",
    )
    return Lookups(server, client, store)

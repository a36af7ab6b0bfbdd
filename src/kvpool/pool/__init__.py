"""A local pool: ``mooncake_master`` and a holder on loopback, started, stopped, inspected.

    binaries     find_binary: the Mooncake executables, or what to install
    master_api   the master's HTTP API: metrics, health, keys, wait_until
    processes    children and PIDs from pool files, verified before every signal
    local        LocalPool: start / attach, stop, pool files
    faults       the faults tests inject into its processes (a mixin of LocalPool)
    quotas       tenant quotas: shares of the pool's memory, the master's policy
    status       pool_status and namespace_counts for ``kvpool status``

Everything listens on 127.0.0.1. Nothing here imports a Mooncake module: the
pool is its executables and their HTTP API. The names below are the package's
API; import them from ``kvpool.pool``.
"""

from kvpool.pool.binaries import HOLDER_BINARY, MASTER_BINARY, find_binary
from kvpool.pool.local import GiB, LocalPool
from kvpool.pool.master_api import (
    completed_puts,
    key_hosts,
    master_keys,
    master_metrics,
    parse_metrics,
    segment_capacities,
    wait_until,
)
from kvpool.pool.processes import free_ports, is_mooncake_process
from kvpool.pool.status import (
    NamespaceCount,
    NamespaceSummary,
    PoolStatus,
    namespace_counts,
    pool_status,
)

__all__ = [
    "HOLDER_BINARY",
    "MASTER_BINARY",
    "GiB",
    "LocalPool",
    "NamespaceCount",
    "NamespaceSummary",
    "PoolStatus",
    "completed_puts",
    "find_binary",
    "free_ports",
    "is_mooncake_process",
    "key_hosts",
    "master_keys",
    "master_metrics",
    "namespace_counts",
    "parse_metrics",
    "pool_status",
    "segment_capacities",
    "wait_until",
]

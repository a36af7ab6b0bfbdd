"""Start, stop and inspect a local pool: ``mooncake_master`` and a holder on loopback.
(One class, the life cycle of a pool's processes; its pool file is ``pool_file``, HA
masters' start-up ``ha``, the faults tests inject ``faults``: mixins of it.)

    LocalPool.start(home, ...)   start ``mooncake_master`` and (``with_holder``) a
                                 standalone holder (``mooncake_client``) on free
                                 127.0.0.1 ports; returns once both are healthy,
                                 else stops what it started and raises
                                 ``StoreUnavailable`` with the tail of the log
    LocalPool.attach(pool_file)  a handle on the processes a pool file names (for
                                 ``kvpool down`` / ``status``); never starts anything
    pool.stop()                  SIGTERM, wait, SIGKILL fallback; reaps its children.
                                 Idempotent; PIDs from a file are signalled only while
                                 verified (``processes``)
    pool.kill_holder(), ...      the faults tests inject (``kvpool.pool.faults``)
    pool.config(**overrides)     a ``PoolConfig`` for a pure client of this pool
                                 (``global_segment_size`` 0); ``command_config`` for
                                 a command's short-lived one (HA: the leader itself)
    pool.write_pool_file(path)   the JSON pool file that ``kvpool up`` leaves behind

Disk (``disk_dir``): the holder keeps what the master evicts from memory in files
under ``disk_dir`` (Mooncake's offload, written at eviction: ``--offload_on_evict``
on the master, ``--enable_offload`` and its ``MOONCAKE_OFFLOAD_*`` settings on the
holder; ``disk_bytes`` bounds them, oldest dropped first). Such an object reads
back from disk, at 2.5-4x the time of a memory read when not in the page cache
(measured here), and survives a restart of the holder (and of the master) on the
same folder. Mooncake's defaults write nothing (buckets of 500 keys or 256 MiB,
more than a small pool holds, and objects waiting for a bucket stay pinned in
memory), and writing at put time lost objects: hence the settings in
``_DISK_ENV``. The holder's offload server listens on every address.

Health is polled against a deadline, never slept for: the master is up when its
process lives, its RPC port accepts and ``/health`` says ``service_ready``; a
holder is up when its port accepts and (master metrics known) a new segment is
mounted on the master. Every address is ``host`` (127.0.0.1 unless given: another
host's engines and holders reach the pool there). Logs go to
``<home>/master.log`` and ``<home>/holder.log`` (appended). Start pools from a
long-lived thread unless ``detach=True`` (what ``kvpool up`` uses): see
``processes`` for the children's lifetime.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from kvpool.config import PoolConfig, is_ha, master_endpoints, read_pool_file
from kvpool.errors import ConfigError, StoreUnavailable
from kvpool.pool.binaries import ETCD_BINARY, HOLDER_BINARY, MASTER_BINARY, find_binary
from kvpool.pool.faults import PoolFaults
from kvpool.pool.ha import HaStart
from kvpool.pool.master_api import master_metrics, master_serving, segment_capacities
from kvpool.pool.pool_file import PoolFile, _holders_text, _int, _sizes
from kvpool.pool.processes import (
    _POLL_S,
    LOOPBACK,
    _port_accepts,
    _port_free,
    _Process,
    _spawn,
    _split_address,
    check_local_address,
    free_ports,
)
from kvpool.pool.quotas import Shares

__all__ = ["HA_MIN_CLIENT_TTL", "LEASE_TTL_MS", "MIN_SEGMENT", "GiB", "LocalPool"]

log = logging.getLogger(__name__)

GiB = 1 << 30
MIN_SEGMENT = 16 << 20  # mooncake_client aborts on a smaller global segment
QUOTA_FILE = "tenant-quotas.yaml"  # the master's tenant policy, in the pool's home
_START_ATTEMPTS = 3  # a port taken between picking and binding makes the master exit
# The master's read lease (``--default_kv_lease_ttl``): an object read, or looked
# up, is never evicted for this long, and counts as used this long in the future.
# Long enough for any load (500 MiB in 0.13 s through shared memory here); Mooncake's
# 10 s kept everything read in the last 10 s, so a small or busy pool evicted what
# it was given last (``kvpool bench capacity``: 36% of the newest prefixes kept at a
# working set 8x the pool, 75% with 2 s; hit rate 32% against 45% at 4x).
LEASE_TTL_MS = 2000
# HA masters: a holder is silent while the masters fail over (~10 s measured); a new
# leader whose client TTL ran out first dropped the holder's objects (18 of 40 kept
# at 2 s, all at 10 s).
HA_MIN_CLIENT_TTL = 10
# The holder's offload settings (see the module docstring): small buckets, so that
# objects evicted from a small pool reach the disk; a 64 MiB offload buffer (the
# default allocates 1.25 GiB); the master's offload tasks polled every second.
_DISK_ENV = {
    "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
    "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": "32",
    "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(8 << 20),
    "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
    "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(64 << 20),
}


@dataclass
class LocalPool(HaStart, PoolFile, PoolFaults):
    """A master and/or holder on ``host``; build it with ``start`` or ``attach``."""

    home: Path
    master_address: str
    metrics_url: str  # "" when the master is not ours and its metrics are unknown
    holder_address: str = ""
    segment_size: int = 0  # bytes the holder contributes
    client_ttl: int = 10
    lease_ttl_ms: int = LEASE_TTL_MS
    detach: bool = False
    created: str = ""
    pool_file: Path | None = None
    host: str = LOOPBACK  # the address the master and holder bind and advertise
    secret: str = field(default="", repr=False)  # PoolConfig.pool_secret; "" = unsigned
    disk_dir: str = ""  # the holder keeps evicted objects here ("" = memory only)
    disk_bytes: int = 0  # at most this much on disk (0 = Mooncake's default)
    # Tenant quotas (``quotas``): each tenant's share of ``segment_size`` and its holder
    quotas: dict[str, int] = field(default_factory=dict)
    tenant_holders: dict[str, str] = field(default_factory=dict)
    # HA masters (``kvpool.pool.ha``): the rpc address of each (the leader changes)
    ha_masters: tuple[str, ...] = ()
    etcd_peer_port: int = field(default=0, repr=False)  # of an etcd this handle started
    _master: _Process | None = field(default=None, init=False, repr=False)
    _master2: _Process | None = field(default=None, init=False, repr=False)  # HA: the second
    _etcd: _Process | None = field(default=None, init=False, repr=False)
    _holder: _Process | None = field(default=None, init=False, repr=False)
    _tenant_procs: dict[str, _Process] = field(default_factory=dict, init=False, repr=False)

    # ----------------------------------------------------------------- start / attach

    @classmethod
    def start(
        cls,
        home: str | Path,
        segment_size: int = GiB,
        with_holder: bool = True,
        client_ttl: int = 10,
        lease_ttl_ms: int = LEASE_TTL_MS,
        *,
        master_address: str | None = None,
        metrics_url: str = "",
        detach: bool = False,
        timeout_s: float = 20.0,
        host: str = LOOPBACK,
        secret: str = "",
        disk_dir: str | Path = "",
        disk_bytes: int = 0,
        quotas: Mapping[str, int] | None = None,
        ha: bool = False,
    ) -> LocalPool:
        """Start a pool under ``home`` and return once it is healthy.

        With ``master_address``, start only a holder against that existing master
        (``metrics_url`` optional, used for the health check and ``status``).
        ``host`` is the address the processes bind and advertise (an address of
        this machine; loopback by default): other hosts reach the pool there.
        ``secret`` is the pool secret its pool file hands engines (``PoolConfig``
        checks it). ``disk_dir`` (made if missing) keeps evicted objects on disk,
        ``disk_bytes`` of them at most (module docstring). ``quotas`` ({tenant:
        bytes}) split ``segment_size`` between tenants (``kvpool.pool.quotas``):
        the master enforces them, and each tenant gets a holder of its share
        (``holder-TENANT.log``). ``ha`` starts etcd and two masters in Mooncake's
        HA mode instead of one master (``kvpool.pool.ha``): the pool's master
        address is then ``etcd://HOST:PORT``, its ``metrics_url`` both masters'.
        Raises
        ``StoreMissingDependency`` if a binary or libibverbs is missing and
        ``StoreUnavailable`` (with the log tail) if a process exits or is not
        healthy within ``timeout_s``; whatever was started is stopped first.
        """
        home = Path(home)
        home.mkdir(parents=True, exist_ok=True)
        if with_holder and segment_size < MIN_SEGMENT:
            raise ConfigError(
                f"a holder's segment must be at least 16 MiB (Mooncake's minimum), "
                f"got {segment_size} bytes"
            )
        if master_address is not None and not with_holder:
            raise ConfigError("with an existing master, there is nothing to start but a holder")
        if ha and master_address is not None:
            raise ConfigError(
                "--ha starts the pool's own masters; to add a holder to an HA pool, give "
                "--master etcd://HOST:PORT (its etcd) without --ha"
            )
        if ha and client_ttl < HA_MIN_CLIENT_TTL:
            raise ConfigError(
                f"--ha needs --client-ttl {HA_MIN_CLIENT_TTL} or more (got {client_ttl}): a "
                "failover takes ~10 s, and the new leader drops the objects of a holder "
                "silent for longer than the client TTL"
            )
        if ha:
            find_binary(ETCD_BINARY)
        quotas = dict(quotas or {})
        if quotas and (master_address is not None or not with_holder):
            raise ConfigError("quotas need a pool of its own: a master and its holders")
        if quotas and disk_dir:  # each holder would offload into one folder
            raise ConfigError("quotas and a disk do not go together yet: leave out one of them")
        shares = Shares.plan(segment_size, quotas) if quotas else None
        find_binary(MASTER_BINARY if master_address is None else HOLDER_BINARY)
        check_local_address(host)
        PoolConfig(pool_secret=secret)  # a malformed secret fails before anything starts
        if disk_dir:
            disk_dir = Path(disk_dir).resolve()
            try:
                disk_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"cannot use {disk_dir} for the pool's disk: {exc}") from None
        pool = cls(
            home=home,
            master_address=master_address or "",
            metrics_url=metrics_url,
            segment_size=segment_size if with_holder else 0,
            client_ttl=client_ttl,
            lease_ttl_ms=lease_ttl_ms,
            detach=detach,
            created=datetime.now(UTC).isoformat(timespec="seconds"),
            host=host,
            secret=secret,
            disk_dir=str(disk_dir),
            disk_bytes=disk_bytes,
            quotas=quotas,
        )
        try:
            if shares is not None:
                (home / QUOTA_FILE).write_text(shares.policy_yaml())
            if ha:
                pool._start_ha(timeout_s)
            elif master_address is None:
                pool._start_master(timeout_s)
            if with_holder:
                pool._start_holder(timeout_s)
            for tenant in quotas:
                pool._start_holder(timeout_s, tenant)
        except BaseException:
            pool.stop()
            raise
        return pool

    @classmethod
    def attach(cls, pool_file: str | Path) -> LocalPool:
        """A handle on the pool a pool file describes; starts nothing.

        Raises ``ConfigError`` if the file is unreadable or lacks a master address.
        PIDs in the file are only ever signalled after ``is_mooncake_process``.
        """
        path = Path(pool_file)
        data = read_pool_file(path)
        master = data.get("master_address")
        if not isinstance(master, str) or not master:
            raise ConfigError(f"pool file {path} has no master_address")
        try:
            master_endpoints(master)
        except ConfigError as exc:
            raise ConfigError(f"pool file {path}: {exc}") from None
        masters = tuple(a for a in str(data.get("ha_masters") or "").split(",") if a)
        if masters and not is_ha(master):  # (a holder joining an HA pool names none)
            raise ConfigError(f"pool file {path}: ha_masters goes with an etcd:// master_address")
        holder = str(data.get("holder_address") or "")
        pool = cls(
            home=path.parent,
            master_address=master,
            metrics_url=str(data.get("metrics_url") or ""),
            holder_address=holder,
            segment_size=_int(data.get("segment_size")),
            client_ttl=_int(data.get("client_ttl"), 10),
            lease_ttl_ms=_int(data.get("lease_ttl_ms"), LEASE_TTL_MS),
            detach=True,
            created=str(data.get("created") or ""),
            pool_file=path,
            host=str(data.get("host") or LOOPBACK),
            secret=str(data.get("pool_secret") or ""),
            disk_dir=str(data.get("disk_dir") or ""),
            disk_bytes=_int(data.get("disk_bytes")),
            quotas=_sizes(data.get("quotas")),
            ha_masters=masters,
        )
        with contextlib.suppress(ConfigError):  # malformed: no tenant holders to name
            pool.tenant_holders = PoolConfig(
                tenant_holders=str(data.get("tenant_holders") or "")
            ).holders_by_tenant()
        pool._adopt_processes(data, path)
        return pool

    def _master_args(self, rpc_port: int, metrics_port: int) -> list[str]:
        return [
            f"--rpc_address={self.host}",
            f"--rpc_port={rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={metrics_port}",
            f"--client_ttl={self.client_ttl}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            "--logtostderr",
            *(["--enable_offload=true", "--offload_on_evict=true"] if self.disk_dir else []),
            *(self._quota_args() if self.quotas else []),
        ]

    def _start_master(self, timeout_s: float, ports: tuple[int, int] | None = None) -> None:
        for attempt in range(1, _START_ATTEMPTS + 1):
            rpc_port, metrics_port = ports or free_ports(2, self.host)
            args = self._master_args(rpc_port, metrics_port)
            proc = _spawn(
                "master",
                MASTER_BINARY,
                args,
                f"--rpc_port={rpc_port}",
                self.home / "master.log",
                self.detach,
                self.host,
            )
            self._master = proc
            self.master_address = f"{self.host}:{rpc_port}"
            self.metrics_url = f"http://{self.host}:{metrics_port}"
            if self._wait(proc, timeout_s, self._master_ready):
                return
            proc.stop(2.0)
            if ports is not None:
                break  # a restart keeps its address or fails
            if attempt < _START_ATTEMPTS:
                log.info("master exited early (port clash?); retrying on new ports")
        raise self._failure(proc, "exited during start-up")

    def _quota_args(self) -> list[str]:
        """The master's tenant flags: quotas from the policy file ``start`` wrote."""
        policy = self.home / QUOTA_FILE
        return ["--enable_multi_tenants=true", f"--tenant_quota_connector_uri={policy}"]

    def _master_ready(self) -> bool:
        """The master (HA: the one that leads) answers and serves."""
        if not is_ha(self.master_address):
            host, port = _split_address(self.master_address)
            if not _port_accepts(host, port):
                return False
        if not master_serving(self.metrics_url):
            return False
        try:
            return bool(master_metrics(self.metrics_url, timeout=0.5))
        except StoreUnavailable:
            return False

    def _start_holder(self, timeout_s: float, tenant: str = "") -> None:
        """Start the holder, or (``tenant``) that quota tenant's holder."""
        before = set(self._segments())
        address = self.tenant_holders.get(tenant, "") if tenant else self.holder_address
        port = _split_address(address)[1] if address else 0
        segment = self.quotas[tenant] if tenant else self.shared_segment
        role = f"holder-{tenant}" if tenant else "holder"
        for attempt in range(1, _START_ATTEMPTS + 1):
            if not port or not _port_free(port, self.host):
                port = free_ports(1, self.host)[0]
            args = [
                f"--host={self.host}",
                f"--port={port}",
                f"--global_segment_size={segment}",
                "--metadata_server=P2PHANDSHAKE",
                f"--master_server_address={self.master_address}",
                "--protocol=tcp",
                "--logtostderr",
                *(["--enable_offload=true"] if self.disk_dir else []),
                *([f"--tenant_id={tenant}"] if tenant else []),
            ]
            proc = _spawn(
                role,
                HOLDER_BINARY,
                args,
                f"--port={port}",
                self.home / f"{role}.log",
                self.detach,
                self.host,
                self._disk_env(),
            )
            if tenant:
                self._tenant_procs[tenant] = proc
                self.tenant_holders[tenant] = f"{self.host}:{port}"
            else:
                self._holder = proc
                self.holder_address = f"{self.host}:{port}"

            def ready(port: int = port) -> bool:
                if not _port_accepts(self.host, port):
                    return False
                # without the master's metrics, the service port (opened after the
                # segment is mounted) is all we can see
                return not self.metrics_url or bool(set(self._segments()) - before)

            if self._wait(proc, timeout_s, ready):
                return
            proc.stop(2.0)
            port = 0
            if attempt < _START_ATTEMPTS:
                log.info("holder exited early (port clash?); retrying on a new port")
        raise self._failure(proc, "exited during start-up")

    def _disk_env(self) -> dict[str, str]:
        if not self.disk_dir:
            return {}
        limit = {"MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(self.disk_bytes)}
        return {
            **_DISK_ENV,
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": self.disk_dir,
            **(limit if self.disk_bytes else {}),
        }

    def _segments(self) -> dict[str, float]:
        if not self.metrics_url:
            return {}
        try:
            return segment_capacities(master_metrics(self.metrics_url, timeout=0.5))
        except StoreUnavailable:
            return {}

    def _wait(self, proc: _Process, timeout_s: float, ready: Callable[[], bool]) -> bool:
        """True once ``ready()``; False if ``proc`` exits; raises on the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not proc.running():
                return False
            if ready():
                return proc.running()
            if time.monotonic() >= deadline:
                raise self._failure(proc, f"not healthy after {timeout_s:.0f} s")
            time.sleep(_POLL_S)

    def _failure(self, proc: _Process, what: str) -> StoreUnavailable:
        code = proc.exit_code()
        status = f" (exit code {code})" if code is not None else ""
        return StoreUnavailable(
            f"{proc.binary} {what}{status}; last lines of {proc.log_path}:\n{proc.log_tail()}"
        )

    # ----------------------------------------------------------------- lifecycle

    def master_running(self) -> bool:
        """Whether this handle's master process lives (False if the master is not ours)."""
        return self._master is not None and self._master.running()

    def holder_running(self) -> bool:
        """Whether this handle's holder process lives."""
        return self._holder is not None and self._holder.running()

    def is_alive(self) -> bool:
        """Whether every process this handle names still runs (as that mooncake process)."""
        procs = [p for p in self._procs() if p is not None]
        return bool(procs) and all(p.running() for p in procs)

    def _procs(self) -> list[_Process | None]:
        """Every process of this handle: etcd and the second master (HA), the master,
        its holder, the tenants' holders; ``stop`` stops them in reverse."""
        return [self._etcd, self._master, self._master2, self._holder, *self._tenant_procs.values()]

    @property
    def shared_segment(self) -> int:
        """Bytes the holder of no tenant gives: what the quotas leave of ``segment_size``."""
        return self.segment_size - sum(self.quotas.values())

    def stop(self, timeout_s: float = 5.0, *, kill: bool = False) -> None:
        """Stop the holders, then the master: SIGTERM, wait, SIGKILL. Idempotent.

        ``kill``: SIGKILL at once (tests: the master spends ~0.9 s on a SIGTERM,
        and a throwaway pool has nothing to shut down cleanly).
        Children are reaped; PIDs from a pool file are signalled only while verified.
        """
        sig = signal.SIGKILL if kill else signal.SIGTERM
        for proc in reversed(self._procs()):  # the holders first, the master last
            if proc is not None:
                proc.stop(timeout_s, sig)
                log.info("stopped %s (pid %d)", proc.role, proc.pid)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ----------------------------------------------------------------- clients, files

    def config(self, **overrides: Any) -> PoolConfig:
        """A ``PoolConfig`` for a pure client of this pool, with ``overrides`` applied."""
        base = PoolConfig(
            master_address=self.master_address,
            holder_address=self.holder_address,
            metrics_url=self.metrics_url,
            global_segment_size=0,
            pool_file=str(self.pool_file or ""),
            pool_secret=self.secret,
            tenant_holders=_holders_text(self.tenant_holders),
        )
        return replace(base, **overrides)

    def command_config(self, **overrides: Any) -> PoolConfig:
        """``config`` for a command's short-lived client: of HA masters, the leader's
        own address (a client through etcd takes ~30 s to close or to exit, waiting
        on Mooncake's etcd watch; and a process has one etcd client at most). Such a
        client does not follow a failover."""
        if is_ha(self.master_address):
            with contextlib.suppress(StoreUnavailable):  # none leads now: through etcd
                overrides = {"master_address": self.leader_address(), **overrides}
        return self.config(**overrides)

    def metrics(self, timeout: float = 2.0) -> dict[str, float]:
        """``master_metrics`` of this pool's master (``StoreUnavailable`` if unknown/down)."""
        if not self.metrics_url:
            raise StoreUnavailable(
                f"the metrics address of master {self.master_address} is unknown"
            )
        return master_metrics(self.metrics_url, timeout)

    def processes(self) -> Iterator[tuple[str, int, bool]]:
        """(role, pid, running) for each process this handle names."""
        for proc in self._procs():
            if proc is not None:
                yield proc.role, proc.pid, proc.running()

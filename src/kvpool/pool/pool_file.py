"""A pool's pool file: what ``kvpool up`` writes, and the process handles read back.

    pool.pool_file_data()        ``PoolConfig`` fields plus process facts (PIDs, sizes,
                                 quotas, HA masters and etcd)
    pool.write_pool_file(path)   write it atomically (0600 when it holds a secret)
    pool._adopt_processes(data, path)  handles on the PIDs a pool file names (for
                                 ``LocalPool.attach``; each signalled only while it is
                                 still that process, ``processes``)

A mixin of ``LocalPool``, which supplies the state.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpool.config import master_endpoints
from kvpool.pool.binaries import ETCD_BINARY, HOLDER_BINARY, MASTER_BINARY
from kvpool.pool.ha import etcd_marker
from kvpool.pool.processes import LOOPBACK, _Process, _split_address

__all__ = ["PoolFile"]


class PoolFile:
    """See the module docstring."""

    master_address: str
    holder_address: str
    metrics_url: str
    host: str
    segment_size: int
    client_ttl: int
    lease_ttl_ms: int
    created: str
    secret: str
    disk_dir: str
    disk_bytes: int
    quotas: dict[str, int]
    tenant_holders: dict[str, str]
    ha_masters: tuple[str, ...]
    pool_file: Path | None
    _master: _Process | None
    _master2: _Process | None
    _etcd: _Process | None
    _holder: _Process | None
    _tenant_procs: dict[str, _Process]

    @property
    def master_pid(self) -> int | None:
        return self._master.pid if self._master is not None else None

    @property
    def holder_pid(self) -> int | None:
        return self._holder.pid if self._holder is not None else None

    def pool_file_data(self) -> dict[str, Any]:
        """What ``write_pool_file`` writes: ``PoolConfig`` fields plus process facts.

        ``global_segment_size`` is left out on purpose: ``load_config`` reads the
        file, and a reader must stay a pure client. A ``secret`` makes the file
        readable by its owner only (``write_pool_file``).
        """
        secret = {"pool_secret": self.secret} if self.secret else {}
        return {
            "master_address": self.master_address,
            "holder_address": self.holder_address,
            "metrics_url": self.metrics_url,
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            # Clients on this host advertise it; on other hosts "auto" resolves
            # to their own address on the route to the master (config.load_config).
            "local_hostname": LOOPBACK if self.host == LOOPBACK else "auto",
            "host": self.host,
            "master_pid": self.master_pid,
            "holder_pid": self.holder_pid,
            "segment_size": self.segment_size,
            "client_ttl": self.client_ttl,
            "lease_ttl_ms": self.lease_ttl_ms,
            "created": self.created,
            **({"disk_dir": self.disk_dir, "disk_bytes": self.disk_bytes} if self.disk_dir else {}),
            **secret,
            **(self._quota_data() if self.quotas else {}),
            **(self._ha_data() if self.ha_masters else {}),
        }

    def _ha_data(self) -> dict[str, Any]:
        return {
            "ha_masters": ",".join(self.ha_masters),
            "master2_pid": self._master2.pid if self._master2 is not None else None,
            "etcd_pid": self._etcd.pid if self._etcd is not None else None,
        }

    def _quota_data(self) -> dict[str, Any]:
        pids = {t: p.pid for t, p in self._tenant_procs.items()}
        return {
            "tenant_holders": _holders_text(self.tenant_holders),
            "quotas": dict(self.quotas),
            "tenant_holder_pids": pids,
        }

    def write_pool_file(self, path: str | Path) -> Path:
        """Write the pool file atomically (temporary file, then rename); return its path.
        Mode 0600 when it holds a pool secret (it is created so: never readable by
        others, not even for a moment), else 0644."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        data = (json.dumps(self.pool_file_data(), indent=2) + "\n").encode()
        # A new file only: never through a link (or a file) someone put at that name.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        mode = 0o600 if self.secret else 0o644
        try:
            fd = os.open(tmp, flags, mode)
        except FileExistsError:
            tmp.unlink()  # a leftover of ours (same pid) or a planted link: removed, not followed
            fd = os.open(tmp, flags, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        self.pool_file = path
        return path

    def _adopt_processes(self, data: Mapping[str, Any], path: Path) -> None:
        """Handles on the processes a pool file names (``LocalPool.attach``)."""
        master = self.master_address
        masters = self.ha_masters
        holder = self.holder_address
        pids = (_int(data.get("master_pid")), _int(data.get("master2_pid")))
        roles = ("master", "master-2")
        procs: list[_Process | None] = [None, None]
        for i, address in enumerate(masters or (master,)):
            if i < 2 and pids[i] > 0:
                marker = f"--rpc_port={_split_address(address)[1]}"
                log_path = path.parent / f"{roles[i]}.log"
                procs[i] = _Process(roles[i], MASTER_BINARY, pids[i], marker, log_path)
        self._master, self._master2 = procs
        etcd_pid = _int(data.get("etcd_pid"))
        if masters and etcd_pid > 0:
            endpoint = master_endpoints(master)[0]
            self._etcd = _Process(
                "etcd", ETCD_BINARY, etcd_pid, etcd_marker(endpoint), path.parent / "etcd.log"
            )
        holder_pid = data.get("holder_pid")
        if isinstance(holder_pid, int) and holder_pid > 0 and holder:
            port = _split_address(holder)[1]
            self._holder = _Process(
                "holder", HOLDER_BINARY, holder_pid, f"--port={port}", path.parent / "holder.log"
            )
        for tenant, pid in _sizes(data.get("tenant_holder_pids")).items():
            if pid > 0 and tenant in self.tenant_holders:
                port = _split_address(self.tenant_holders[tenant])[1]
                log_path = path.parent / f"holder-{tenant}.log"
                self._tenant_procs[tenant] = _Process(
                    f"holder-{tenant}", HOLDER_BINARY, pid, f"--port={port}", log_path
                )


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _sizes(value: object) -> dict[str, int]:
    """{name: int} of a pool file's JSON object (other entries left out)."""
    items = value.items() if isinstance(value, dict) else ()
    return {str(k): v for k, v in items if _int(v, -1) >= 0}


def _holders_text(holders: Mapping[str, str]) -> str:
    """``PoolConfig.tenant_holders`` of {tenant: host:port}."""
    return ",".join(f"{t}={a}" for t, a in holders.items())

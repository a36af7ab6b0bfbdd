"""The faults tests inject into a ``LocalPool``'s processes (a mixin of it).

    pool.kill_holder()           SIGKILL the holder: its segment stays mounted on the
                                 master until ``client_ttl`` expires
    pool.restart_holder()        start a fresh holder (same port if free); the old
                                 holder's objects are gone
    pool.kill_master() / restart_master()  SIGKILL the master / start an empty one
                                 on the same ports
    pool.freeze_holder() / thaw_holder()   SIGSTOP / SIGCONT the holder: a host cut
                                 off from the network, and back

HA masters (``LocalPool.start(ha=True)``):

    pool.master_roles()          {"master": "leader", "master-2": "standby"} (or "down")
    pool.leader_address()        the leader's rpc host:port (a client may connect there
                                 directly: a process has one etcd client at most)
    pool.kill_leader() / kill_standby()    SIGKILL the master in that role; its name
    pool.kill_ha_master(name)    SIGKILL "master" or "master-2", whatever its role
    pool.restart_ha_master(name) start that master again on its ports: it stands
                                 by, or leads if none does
    pool.kill_etcd() / restart_etcd()      SIGKILL etcd / start it again on its
                                 ports and data (the masters' view is kept there)

They act on the pool's own holder (of no tenant) and master; a handle that did
not start them (``attach``) has none to act on and raises ``ConfigError``.
"""

from __future__ import annotations

import signal
import time

from kvpool.errors import ConfigError, StoreUnavailable
from kvpool.pool.ha import master_roles
from kvpool.pool.master_api import master_health
from kvpool.pool.processes import _POLL_S, _Process, _split_address

__all__ = ["PoolFaults"]


class PoolFaults:
    """See the module docstring; ``LocalPool`` supplies the state and start-up."""

    master_address: str
    metrics_url: str
    segment_size: int
    _master: _Process | None
    _master2: _Process | None
    _etcd: _Process | None
    _holder: _Process | None
    ha_masters: tuple[str, ...]
    etcd_peer_port: int

    @property
    def etcd_endpoint(self) -> str:
        raise NotImplementedError

    def _start_holder(self, timeout_s: float, tenant: str = "") -> None:
        raise NotImplementedError

    def _start_master(self, timeout_s: float, ports: tuple[int, int] | None = None) -> None:
        raise NotImplementedError

    def _start_ha_master(self, index: int) -> _Process:
        raise NotImplementedError

    def _start_etcd(self, timeout_s: float, ports: tuple[int, int]) -> None:
        raise NotImplementedError

    def kill_holder(self) -> None:
        """SIGKILL the holder and reap it; the master keeps its segment for ``client_ttl``."""
        if self._holder is None:
            raise ConfigError("this pool has no holder to kill")
        self._holder.stop(5.0, signal.SIGKILL)

    def restart_holder(self, timeout_s: float = 20.0) -> None:
        """Stop the holder if it runs, then start a fresh one (same port if still free)."""
        if self.master_address == "" or self.segment_size <= 0:
            raise ConfigError("this pool has no holder to restart")
        if self._holder is not None:
            self._holder.stop(5.0)
        try:
            self._start_holder(timeout_s)
        except BaseException:
            if self._holder is not None:
                self._holder.stop(2.0)
            raise

    def kill_master(self) -> None:
        """SIGKILL the master and reap it (fault tests); every object's metadata is lost."""
        if self._master is None:
            raise ConfigError("this pool did not start its master; there is none to kill")
        self._master.stop(5.0, signal.SIGKILL)

    def restart_master(self, timeout_s: float = 20.0) -> None:
        """Start the master again on its old ports (an empty one: metadata is not kept)."""
        if self._master is None:
            raise ConfigError("this pool did not start its master; there is none to restart")
        self._master.stop(5.0)
        rpc = _split_address(self.master_address)[1]
        metrics = _split_address(self.metrics_url.removeprefix("http://"))[1]
        self._start_master(timeout_s, ports=(rpc, metrics))

    def freeze_holder(self) -> None:
        """SIGSTOP the holder: to its peers it is a host cut off from the network
        (connections stay open, nothing answers)."""
        if self._holder is None:
            raise ConfigError("this pool has no holder to freeze")
        self._holder.send(signal.SIGSTOP)

    def thaw_holder(self) -> None:
        """SIGCONT a frozen holder."""
        if self._holder is None:
            raise ConfigError("this pool has no holder to thaw")
        self._holder.send(signal.SIGCONT)

    # -- HA masters ------------------------------------------------------------------

    def _ha(self) -> list[_Process]:
        if not self.ha_masters or self._master is None or self._master2 is None:
            raise ConfigError("this pool did not start HA masters (LocalPool.start(ha=True))")
        return [self._master, self._master2]

    def master_roles(self, timeout: float = 1.0) -> dict[str, str]:
        """Each master's role by name: "leader", "standby", "down", ..."""
        masters = self._ha()
        roles = master_roles(self.metrics_url, timeout)
        return {p.role: roles.get(url, "down") for p, url in zip(masters, roles, strict=True)}

    def leader_address(self) -> str:
        """The rpc host:port of the master that leads now (``StoreUnavailable`` if
        none): a client that connects there directly, not through etcd (Mooncake
        keeps one etcd client per process: a process is a client of one HA pool's
        etcd at most), until the next failover."""
        leader = master_health(self.metrics_url).get("leader_address")  # the leader's
        if not isinstance(leader, str) or not leader:
            raise StoreUnavailable(f"no master leads now ({master_roles(self.metrics_url)})")
        return leader

    def kill_leader(self) -> str:
        """SIGKILL the master that leads; its name. ``StoreUnavailable`` if none leads."""
        return self._kill_role("leader")

    def kill_standby(self) -> str:
        """SIGKILL the master that stands by; its name."""
        return self._kill_role("standby")

    def kill_ha_master(self, name: str) -> None:
        """SIGKILL master ``name`` ("master" or "master-2"), whatever its role."""
        {p.role: p for p in self._ha()}[name].stop(5.0, signal.SIGKILL)

    def _kill_role(self, role: str) -> str:
        masters = {p.role: p for p in self._ha()}
        for name, now in self.master_roles().items():
            if now == role:
                masters[name].stop(5.0, signal.SIGKILL)
                return name
        raise StoreUnavailable(f"no master is {role} now ({self.master_roles()})")

    def restart_ha_master(self, name: str, timeout_s: float = 20.0) -> None:
        """Start master ``name`` ("master" or "master-2") again on its ports, once
        the old process is gone; returns when its ``/health`` answers."""
        index = [p.role for p in self._ha()].index(name)
        self._ha()[index].stop(5.0)
        proc = self._start_ha_master(index)
        deadline = time.monotonic() + timeout_s
        while self.master_roles().get(name, "down") == "down":
            if not proc.running() or time.monotonic() > deadline:
                raise StoreUnavailable(f"{name} did not come back; see {proc.log_path}")
            time.sleep(_POLL_S)

    def kill_etcd(self) -> None:
        """SIGKILL the pool's etcd (HA masters)."""
        self._ha()
        assert self._etcd is not None
        self._etcd.stop(5.0, signal.SIGKILL)

    def restart_etcd(self, timeout_s: float = 20.0) -> None:
        """Start etcd again on its ports and data folder; returns once healthy."""
        self._ha()
        if self._etcd is not None:
            self._etcd.stop(5.0)
        if not self.etcd_peer_port:
            raise ConfigError("this handle did not start the pool's etcd")
        port = _split_address(self.etcd_endpoint)[1]
        self._start_etcd(timeout_s, (port, self.etcd_peer_port))

"""The faults tests inject into a ``LocalPool``'s processes (a mixin of it).

    pool.kill_holder()           SIGKILL the holder: its segment stays mounted on the
                                 master until ``client_ttl`` expires
    pool.restart_holder()        start a fresh holder (same port if free); the old
                                 holder's objects are gone
    pool.kill_master() / restart_master()  SIGKILL the master / start an empty one
                                 on the same ports
    pool.freeze_holder() / thaw_holder()   SIGSTOP / SIGCONT the holder: a host cut
                                 off from the network, and back

They act on the pool's own holder (of no tenant) and master; a handle that did
not start them (``attach``) has none to act on and raises ``ConfigError``.
"""

from __future__ import annotations

import signal

from kvpool.errors import ConfigError
from kvpool.pool.processes import _Process, _split_address

__all__ = ["PoolFaults"]


class PoolFaults:
    """See the module docstring; ``LocalPool`` supplies the state and start-up."""

    master_address: str
    metrics_url: str
    segment_size: int
    _master: _Process | None
    _holder: _Process | None

    def _start_holder(self, timeout_s: float, tenant: str = "") -> None:
        raise NotImplementedError

    def _start_master(self, timeout_s: float, ports: tuple[int, int] | None = None) -> None:
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

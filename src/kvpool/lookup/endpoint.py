"""Lookup endpoints: parse and check them, and own an IPC socket path safely. No sockets.

    Endpoint.parse(url)        ``ipc:///abs/path`` or ``tcp://IP:PORT``; ConfigError
                               saying what is wrong otherwise (a relative or too
                               long path, a host name, a bad port)
    Endpoint.bind_url          what a server binds (port 0 -> any free port)
    PathLock.acquire(ep)       hold ``<socket path>.lock`` (``fcntl.flock``) for as
                               long as a server serves ``ep``; unlink a stale
                               socket file found there. Raises
                               ``LookupEndpointInUse`` if another live process
                               holds the lock
    PathLock.release()         unlink the socket file, then drop the lock

The endpoint of a DP engine is ``kvpool.keys.lookup_endpoint(...)`` (IPC, one per
global DP index). ``tcp://`` is for a scheduler that is not on the lookup
server's host; only IP literals are accepted, and ``127.0.0.1`` is the default
everywhere in kvpool.

Why a lock file: ZMQ's IPC bind silently unlinks whatever socket file is at the
path, so a second server would steal a live server's endpoint. A socket file
whose lock can be taken belongs to no live server (the kernel drops a flock
when its holder dies), so it is stale and may go. The lock file itself is never
unlinked: unlinking it would let two servers lock different inodes of one path.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import stat
from dataclasses import dataclass
from typing import Literal

from kvpool.errors import ConfigError, KVPoolError

__all__ = ["Endpoint", "LookupEndpointInUse", "PathLock"]

logger = logging.getLogger(__name__)

_MAX_IPC_PATH = 107  # sun_path is 108 bytes on Linux, with its NUL


class LookupEndpointInUse(KVPoolError):
    """Another live lookup server serves this endpoint (or the port is taken)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed lookup endpoint. Build with ``parse``."""

    url: str
    kind: Literal["ipc", "tcp"]
    path: str = ""  # ipc: the socket file
    host: str = ""  # tcp: an IP literal
    port: int = 0  # tcp: 0 = any free port (servers only)

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        if url.startswith("ipc://"):
            path = url[len("ipc://") :]
            if not path.startswith("/"):
                raise ConfigError(f"lookup endpoint {url!r}: the IPC path must be absolute")
            if len(os.fsencode(path)) > _MAX_IPC_PATH:
                raise ConfigError(
                    f"lookup endpoint {url!r}: IPC paths are limited to {_MAX_IPC_PATH} bytes; "
                    "choose a shorter run_dir"
                )
            return cls(url, "ipc", path=path)
        if url.startswith("tcp://"):
            host, sep, port = url[len("tcp://") :].rpartition(":")
            if not sep or not port.isdigit() or int(port) > 65535:
                raise ConfigError(f"lookup endpoint {url!r}: give a port in 0..65535")
            host = host.strip("[]")
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ConfigError(
                    f"lookup endpoint {url!r}: give an IP address, e.g. tcp://127.0.0.1:5599"
                ) from None
            return cls(url, "tcp", host=host, port=int(port))
        raise ConfigError(f"lookup endpoint {url!r} must be ipc:///absolute/path or tcp://IP:PORT")

    @property
    def bind_url(self) -> str:
        if self.kind == "ipc":
            return self.url
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port or '*'}"

    @property
    def lock_path(self) -> str:
        return self.path + ".lock"


class PathLock:
    """The lock a server holds on its IPC socket path. See the module docstring."""

    def __init__(self, endpoint: Endpoint, fd: int) -> None:
        self.endpoint = endpoint
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, endpoint: Endpoint) -> PathLock:
        """Lock ``endpoint``'s path; remove a stale socket file there.

        Raises ``LookupEndpointInUse`` if a live server holds the lock, and
        ``ConfigError`` if the folder is missing or something other than a
        socket sits at the path (never deleted).
        """
        try:
            fd = os.open(endpoint.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(
                f"cannot create lock file {endpoint.lock_path}: {exc.strerror}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LookupEndpointInUse(
                f"another live lookup server holds {endpoint.url} (lock {endpoint.lock_path}); "
                "each DP engine needs its own endpoint: check the instance name and "
                "data_parallel_index"
            ) from None
        try:
            mode = os.lstat(endpoint.path).st_mode
        except FileNotFoundError:
            return cls(endpoint, fd)
        if not stat.S_ISSOCK(mode):
            os.close(fd)
            raise ConfigError(
                f"{endpoint.path} exists and is not a socket; remove it or move run_dir"
            )
        os.unlink(endpoint.path)
        logger.info("kvpool: removed stale lookup socket %s", endpoint.path)
        return cls(endpoint, fd)

    def release(self) -> None:
        """Unlink the socket file (it is ours while locked), then drop the lock. Idempotent."""
        if self._fd is None:
            return
        try:
            os.unlink(self.endpoint.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None

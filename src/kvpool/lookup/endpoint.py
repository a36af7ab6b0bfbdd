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
    PathLock.release()         unlink the socket file and the lock file, then
                               drop the lock
    private_dir(path)          make or check a folder only this user can enter
                               (0700, owned by us, not a link); ConfigError if
                               another user owns it

The endpoint of a DP engine is ``kvpool.keys.lookup_endpoint(...)`` (IPC, one per
global DP index). ``tcp://`` is for a scheduler that is not on the lookup
server's host; only IP literals are accepted, and ``127.0.0.1`` is the default
everywhere in kvpool.

Why a lock file: ZMQ's IPC bind silently unlinks whatever socket file is at the
path, so a second server would steal a live server's endpoint. A socket file
whose lock can be taken belongs to no live server (the kernel drops a flock
when its holder dies), so it is stale and may go. A server unlinks its lock
file while it still holds the lock; a server that locked an inode no longer at
the path (it opened the file just before that unlink) lets go and tries again,
so two servers never hold locks on different inodes of one path. The lock file
is opened without following links, and the socket is made 0600.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import stat
from dataclasses import dataclass
from typing import Literal

from kvpool.errors import ConfigError, KVPoolError

__all__ = ["Endpoint", "LookupEndpointInUse", "PathLock", "private_dir"]

logger = logging.getLogger(__name__)

_MAX_IPC_PATH = 107  # sun_path is 108 bytes on Linux, with its NUL
_LOCK_TRIES = 8


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
        for _ in range(_LOCK_TRIES):
            fd = cls._open_lock(endpoint)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise LookupEndpointInUse(
                    f"another live lookup server holds {endpoint.url} (lock "
                    f"{endpoint.lock_path}); each DP engine needs its own endpoint: check "
                    "the instance name and data_parallel_index"
                ) from None
            try:
                if os.lstat(endpoint.lock_path).st_ino == os.fstat(fd).st_ino:
                    break  # the inode at the path: the lock is ours
            except FileNotFoundError:
                pass
            os.close(fd)  # its holder unlinked it as we opened it: try the new one
        else:
            raise LookupEndpointInUse(f"{endpoint.lock_path} keeps changing; is a server looping?")
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

    @staticmethod
    def _open_lock(endpoint: Endpoint) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            return os.open(endpoint.lock_path, flags, 0o600)
        except OSError as exc:
            raise ConfigError(
                f"cannot create lock file {endpoint.lock_path}: {exc.strerror} "
                "(a link there is never followed)"
            ) from None

    def release(self) -> None:
        """Unlink the socket file and the lock file (ours while locked), then drop
        the lock. Idempotent."""
        if self._fd is None:
            return
        try:
            for path in (self.endpoint.path, self.endpoint.lock_path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        finally:
            os.close(self._fd)
            self._fd = None


def private_dir(path: str) -> str:
    """``path`` as a folder only this user can enter: made 0700 if missing, its mode
    tightened if it is ours, ``ConfigError`` if it is a link, not a folder, or
    another user's (who could swap sockets or send resets there)."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)  # parents as before; only the last is private
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create run_dir {path}: {exc.strerror}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"run_dir {path} is not a folder (a link is never followed)")
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"run_dir {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): "
            "another user could take the lookup sockets there; set run_dir to a folder of yours"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path

"""The pool's child processes and loopback ports (package-internal but for the first two).

    is_mooncake_process(pid, binary, marker)  whether ``pid`` is still that mooncake
                                 process (``/proc/<pid>/cmdline``)
    free_ports(n, host)          ``n`` distinct free ports (of 127.0.0.1 by default),
                                 outside the kernel's ephemeral range
    check_local_address(host)    ConfigError unless ``host`` is an address of this machine
    _spawn(role, binary, ...)    start a child, its output appended to its log
    _Process                     one child, or one PID read from a pool file:
                                 ``running``, ``send``, ``stop`` (SIGTERM, wait,
                                 SIGKILL fallback; reaps children), ``log_tail``

A PID read from a file is signalled only while ``/proc/<pid>/cmdline`` still
shows that mooncake process, so a stale file kills nothing else. Children get
``MC_TCP_BIND_ADDRESS`` = the pool's host (127.0.0.1 by default) and, by
default, ``PR_SET_PDEATHSIG`` (SIGTERM when the thread that started them exits:
no orphans after a crashed test run); ``detach`` starts them in a new session
instead, to outlive the caller.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvpool.errors import ConfigError, KVPoolError
from kvpool.pool.binaries import find_binary

__all__ = ["LOOPBACK", "check_local_address", "free_ports", "is_mooncake_process"]

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_POLL_S = 0.02
_LOG_TAIL_LINES = 15


def is_mooncake_process(pid: int, binary: str, marker: str) -> bool:
    """Whether ``pid`` is a live ``binary`` process whose arguments include ``marker``.

    Reads ``/proc/<pid>/cmdline``; the binary may appear as the exec'd ELF
    (argv[0]) or as the Python console-script wrapper (argv[1]) before it execs.
    A zombie has an empty cmdline and is not one.
    """
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    words = [a.decode("utf-8", "replace") for a in argv if a]
    return any(Path(a).name == binary for a in words[:2]) and marker in words


_PR_SET_PDEATHSIG = 1
_libc: ctypes.CDLL | None = None


def _pdeathsig_hook() -> Callable[[], None]:
    """A ``preexec_fn`` that asks for SIGTERM when the parent thread exits.

    libc is loaded here, in the parent: the hook itself only makes one call.
    """
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    libc = _libc

    def hook() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))

    return hook


@dataclass
class _Process:
    """One child or one PID from a pool file, and what proves it is still ours."""

    role: str  # "master" or "holder"
    binary: str
    pid: int
    marker: str  # an argument only this process has, e.g. "--rpc_port=50051"
    log_path: Path | None = None
    popen: subprocess.Popen[bytes] | None = None
    log_offset: int = 0  # where this run's output starts in log_path

    def running(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return is_mooncake_process(self.pid, self.binary, self.marker)

    def exit_code(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def send(self, sig: signal.Signals) -> None:
        if not self.running():  # for file PIDs: re-verified right before signalling
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            raise KVPoolError(
                f"cannot stop the pool's {self.role} (pid {self.pid}): it belongs to another "
                "user; stop it as that user"
            ) from None

    def wait_gone(self, timeout: float) -> bool:
        if self.popen is not None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + timeout
        while self.running():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def stop(self, timeout: float, sig: signal.Signals = signal.SIGTERM) -> None:
        self.send(sig)
        if sig is not signal.SIGKILL:
            self.send(signal.SIGCONT)  # a frozen (SIGSTOPped) process must see it
        if not self.wait_gone(timeout):
            log.warning("%s (pid %d) ignored %s; killing it", self.role, self.pid, sig.name)
            self.send(signal.SIGKILL)
            if not self.wait_gone(timeout):
                log.error("%s (pid %d) survived SIGKILL", self.role, self.pid)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        if self.log_path is None:
            return "(no log)"
        try:
            with self.log_path.open("rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return f"(cannot read {self.log_path})"
        tail = [ln[:400] for ln in text.splitlines()[-lines:]]
        return "\n".join(tail) if tail else "(log is empty)"


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # below: services, and Mooncake's own random listeners (12000-17000 seen)
_TRIES = 64


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in _EPHEMERAL.read_text().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _outside_ephemeral(rng: random.Random) -> int:
    """A random port outside the ephemeral range (and above ``_LOWEST``); 0 when
    the range leaves none."""
    lo, hi = _ephemeral_range()
    below = range(_LOWEST, max(_LOWEST, lo))
    above = range(max(_LOWEST, hi + 1), 65536)
    total = len(below) + len(above)
    if not total:
        return 0
    i = rng.randrange(total)
    return below[i] if i < len(below) else above[i - len(below)]


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """``n`` distinct free ports of ``host`` (all held open together while picking).

    Picked outside the kernel's ephemeral range (``ip_local_port_range``): a port
    the kernel hands out for bind(0) may meanwhile become the local port of some
    process's outgoing connection, and the server started on it then fails with
    "Address already in use" (seen in CI: a `vllm serve` beside engines talking to
    Mooncake). The kernel never gives ports outside that range to outgoing
    connections, and a random pick makes two callers' collisions unlikely. After
    ``_TRIES`` taken ports in a row, bind(0) picks one."""
    rng = random.Random()
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            for attempt in range(_TRIES + 1):
                port = _outside_ephemeral(rng) if attempt < _TRIES else 0
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind((host, port))
                except OSError:
                    s.close()
                    if port == 0:
                        raise
                    continue
                socks.append(s)
                break
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def check_local_address(host: str) -> None:
    """``ConfigError`` unless ``host`` is an IPv4 address of this machine (one a
    process here can bind) that others can reach it at: not a host name (bind
    would resolve it to some address) and not a wildcard (the pool would advertise
    0.0.0.0, which no other host can use)."""
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise ConfigError(
            f"--host {host!r} is not an IPv4 address: give this machine's address that other "
            "hosts reach it at, e.g. 10.0.0.1 (see `ip -4 addr`), or leave it out for loopback"
        ) from None
    if address.is_unspecified or address.is_multicast:
        raise ConfigError(
            f"--host {host} would be advertised to engines and holders, who cannot reach it: "
            "give this machine's address on the pool network, e.g. 10.0.0.1 (see `ip -4 addr`)"
        )
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"--host {host!r} is not an IPv4 address of this machine ({reason}); give "
            "the address other hosts reach this one at (see `ip -4 addr`), or leave "
            "it out for loopback"
        ) from None


def _port_accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not (host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"{address!r} is not HOST:PORT")
    return host, int(port)


def _spawn(
    role: str,
    binary: str,
    args: list[str],
    marker: str,
    log_path: Path,
    detach: bool,
    host: str = LOOPBACK,
    env_extra: dict[str, str] | None = None,
) -> _Process:
    env = dict(os.environ, MC_TCP_BIND_ADDRESS=host, **(env_extra or {}))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        offset = out.tell()
        popen = subprocess.Popen(
            [find_binary(binary), *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=detach,
            preexec_fn=None if detach else _pdeathsig_hook(),
        )
    log.info("started %s (pid %d): %s", role, popen.pid, " ".join(args))
    return _Process(role, binary, popen.pid, marker, log_path, popen, offset)


def _port_free(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True

"""Start, stop and inspect a local pool: ``mooncake_master`` and a holder on loopback.

    LocalPool.start(home, ...)   start ``mooncake_master`` and (``with_holder``) a
                                 standalone holder (``mooncake_client``) on free
                                 127.0.0.1 ports; returns once both are healthy,
                                 else stops what it started and raises
                                 ``StoreUnavailable`` with the tail of the log
    LocalPool.attach(pool_file)  a handle on the processes a pool file names (for
                                 ``kvpool down`` / ``status``); never starts anything
    pool.stop()                  SIGTERM, wait, SIGKILL fallback; reaps its children.
                                 Idempotent. PIDs read from a file are signalled only
                                 while ``/proc/<pid>/cmdline`` still shows that
                                 mooncake process, so a stale file kills nothing else
    pool.kill_holder()           SIGKILL the holder (fault tests): its segment stays
                                 mounted on the master until ``client_ttl`` expires
    pool.restart_holder()        start a fresh holder (same port if free); the old
                                 holder's objects are gone
    pool.kill_master() / restart_master()  SIGKILL the master / start an empty one
                                 on the same ports (fault tests)
    pool.freeze_holder() / thaw_holder()   SIGSTOP / SIGCONT the holder: a host cut
                                 off from the network, and back
    pool.config(**overrides)     a ``PoolConfig`` for a pure client of this pool
                                 (``global_segment_size`` 0)
    pool.write_pool_file(path)   the JSON pool file that ``kvpool up`` leaves behind
    master_metrics(url)          the master's Prometheus ``/metrics`` as {sample: value}
                                 (``parse_metrics(text)`` is the pure parser)
    master_keys(url)             every key the master knows (``/get_all_keys``)
    wait_until(cond, timeout)    poll a condition on the pool (e.g. its key count)
                                 against a deadline
    namespace_counts(keys)       keys grouped by kvpool namespace; others counted apart
    pool_status(pool)            one ``PoolStatus`` record for ``kvpool status``: processes,
                                 key count, bytes, clients, segments, namespaces;
                                 an unreachable master is a field, not an exception
    find_binary(name)            a Mooncake executable, or ``StoreMissingDependency``

Health is polled against a deadline, never slept for: the master is up when its
process lives, its RPC port accepts and ``/health`` says ``service_ready``; a
holder is up when its port accepts and (master metrics known) a new segment is
mounted on the master. Every address is 127.0.0.1; children get
``MC_TCP_BIND_ADDRESS=127.0.0.1``. Logs go to ``<home>/master.log`` and
``<home>/holder.log`` (appended).

Lifetime: by default children get ``PR_SET_PDEATHSIG`` (SIGTERM when the thread
that started them exits), so a crashed test run leaves no orphans; start pools
from a long-lived thread. ``detach=True`` (what ``kvpool up`` uses) starts them
in a new session instead, to outlive the caller.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from kvpool.config import PoolConfig, read_pool_file
from kvpool.errors import (
    ConfigError,
    KeyFormatError,
    KVPoolError,
    StoreMissingDependency,
    StoreUnavailable,
)
from kvpool.keys import parse_key

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
    "master_keys",
    "master_metrics",
    "namespace_counts",
    "parse_metrics",
    "pool_status",
    "segment_capacities",
]

log = logging.getLogger(__name__)

GiB = 1 << 30
MASTER_BINARY = "mooncake_master"
HOLDER_BINARY = "mooncake_client"
LOOPBACK = "127.0.0.1"
_INSTALL_MOONCAKE = "pip install 'kvpool[mooncake-cpu]' (or mooncake-transfer-engine on GPU hosts)"
_POLL_S = 0.02
_LOG_TAIL_LINES = 15
_START_ATTEMPTS = 3  # a port taken between picking and binding makes the master exit


# --------------------------------------------------------------------------- binaries


def find_binary(name: str) -> str:
    """The path of Mooncake executable ``name``: next to ``sys.executable``, else on PATH.

    Raises ``StoreMissingDependency`` (one line: what to install) if it is absent or
    if ``libibverbs.so.1``, which every Mooncake binary links even for TCP, is missing.
    """
    beside = Path(sys.executable).parent / name
    path = str(beside) if os.access(beside, os.X_OK) else shutil.which(name)
    if path is None:
        raise StoreMissingDependency(
            f"{name} not found next to {sys.executable} or on PATH; install it: {_INSTALL_MOONCAKE}"
        )
    _check_ibverbs()
    return path


def _check_ibverbs() -> None:
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        raise StoreMissingDependency(
            "libibverbs.so.1 is missing (Mooncake links it even for TCP); "
            "install it: apt-get install libibverbs1"
        ) from None


# --------------------------------------------------------------------------- master HTTP


def _http_get(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body: bytes = resp.read()
            return body
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StoreUnavailable(f"cannot read {url}: {reason}") from None


def wait_until(cond: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    """Poll ``cond`` until it is true or ``timeout`` seconds passed; whether it became
    true. A pool that does not answer yet (``KVPoolError``, ``OSError``) is "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(KVPoolError, OSError):
            if cond():
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


def master_metrics(metrics_url: str, timeout: float = 2.0) -> dict[str, float]:
    """The master's ``/metrics`` as {sample name with labels: value}.

    ``metrics_url`` is ``http://host:port`` (a trailing ``/metrics`` is accepted).
    A sample keeps its labels in its name, e.g.
    ``segment_total_capacity_bytes{segment="127.0.0.1:13047"}``.
    Raises ``StoreUnavailable`` if the master does not answer within ``timeout``.
    """
    text = _http_get(_endpoint(metrics_url, "/metrics"), timeout).decode("utf-8", "replace")
    return parse_metrics(text)


def completed_puts(metrics: Mapping[str, float]) -> float:
    """Objects whose put finished (PutEnd succeeded), from ``master_metrics``.

    ``master_key_count`` also counts objects whose put has only started: a
    client that exits before PutEnd leaves keys that no reader ever finds.
    """
    return (
        metrics.get("master_put_end_requests_total", 0.0)
        - metrics.get("master_put_end_failures_total", 0.0)
        + metrics.get("master_batch_put_end_items_total", 0.0)
        - metrics.get("master_batch_put_end_failed_items_total", 0.0)
    )


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of Prometheus text format as {name with labels: value}; comments skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        # name{labels} value [timestamp]; label values may hold spaces
        cut = line.rfind("}") + 1 or line.find(" ")
        name, fields = line[:cut].strip(), line[cut:].split()
        try:
            out[name] = float(fields[0])
        except (IndexError, ValueError):
            continue  # not a sample line
    return out


def master_health(metrics_url: str, timeout: float = 2.0) -> dict[str, Any]:
    """The JSON of the master's ``/health`` (``service_ready``, ``role``, ...)."""
    body = _http_get(_endpoint(metrics_url, "/health"), timeout)
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        raise StoreUnavailable(f"{metrics_url}/health did not answer JSON") from None
    if not isinstance(data, dict):
        raise StoreUnavailable(f"{metrics_url}/health did not answer a JSON object")
    return data


def master_keys(metrics_url: str, timeout: float = 10.0) -> list[str]:
    """Every key on the master, from its admin endpoint ``/get_all_keys``.

    One request, the whole list in memory: fine for ``kvpool status``, not for a hot
    path. Raises ``StoreUnavailable`` if the master does not answer.
    """
    body = _http_get(_endpoint(metrics_url, "/get_all_keys"), timeout)
    return [k for k in body.decode("utf-8", "replace").split("\n") if k]


def segment_capacities(metrics: Mapping[str, float]) -> dict[str, float]:
    """Mounted segments by name -> capacity in bytes, from ``master_metrics``."""
    prefix = 'segment_total_capacity_bytes{segment="'
    return {
        name[len(prefix) : -2]: value
        for name, value in metrics.items()
        if name.startswith(prefix) and name.endswith('"}')
    }


def _endpoint(metrics_url: str, path: str) -> str:
    return metrics_url.rstrip("/").removesuffix("/metrics") + path


# --------------------------------------------------------------------------- namespaces


@dataclass(frozen=True, slots=True)
class NamespaceCount:
    """Keys of one KV group of one kvpool namespace (model + config fingerprint)."""

    model: str
    fingerprint: str
    group: int
    keys: int
    contents: int  # distinct content ids (head slot, dcp, pcp, pp) among those keys


@dataclass(frozen=True, slots=True)
class NamespaceSummary:
    """``namespace_counts``'s answer: kvpool namespaces sorted, other keys counted."""

    rows: tuple[NamespaceCount, ...]
    other: int  # keys that are not kvpool keys of a known schema


def namespace_counts(keys: Iterable[str]) -> NamespaceSummary:
    """Group ``keys`` by (model, fingerprint, KV group) with ``keys.parse_key``."""
    counts: Counter[tuple[str, str, int]] = Counter()
    contents: dict[tuple[str, str, int], set[tuple[int, int, int, int]]] = {}
    other = 0
    for key in keys:
        try:
            k = parse_key(key)
        except KeyFormatError:
            other += 1
            continue
        c = k.content
        ns = (k.model, k.fingerprint, c.group)
        counts[ns] += 1
        contents.setdefault(ns, set()).add((c.head_slot, c.dcp_rank, c.pcp_rank, c.pp_rank))
    rows = tuple(NamespaceCount(*ns, counts[ns], len(contents[ns])) for ns in sorted(counts))
    return NamespaceSummary(rows, other)


# --------------------------------------------------------------------------- processes


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


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all held open together while picking)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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
    role: str, binary: str, args: list[str], marker: str, log_path: Path, detach: bool
) -> _Process:
    env = dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK)
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


# --------------------------------------------------------------------------- LocalPool


MIN_SEGMENT = 16 << 20  # mooncake_client aborts on a smaller global segment


@dataclass
class LocalPool:
    """A master and/or holder on loopback; build it with ``start`` or ``attach``."""

    home: Path
    master_address: str
    metrics_url: str  # "" when the master is not ours and its metrics are unknown
    holder_address: str = ""
    segment_size: int = 0  # bytes the holder contributes
    client_ttl: int = 10
    lease_ttl_ms: int = 10000
    detach: bool = False
    created: str = ""
    pool_file: Path | None = None
    _master: _Process | None = field(default=None, init=False, repr=False)
    _holder: _Process | None = field(default=None, init=False, repr=False)

    # ----------------------------------------------------------------- start / attach

    @classmethod
    def start(
        cls,
        home: str | Path,
        segment_size: int = GiB,
        with_holder: bool = True,
        client_ttl: int = 10,
        lease_ttl_ms: int = 10000,
        *,
        master_address: str | None = None,
        metrics_url: str = "",
        detach: bool = False,
        timeout_s: float = 20.0,
    ) -> LocalPool:
        """Start a pool under ``home`` and return once it is healthy.

        With ``master_address``, start only a holder against that existing master
        (``metrics_url`` optional, used for the health check and ``status``).
        Raises ``StoreMissingDependency`` if a binary or libibverbs is missing and
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
        find_binary(MASTER_BINARY if master_address is None else HOLDER_BINARY)
        pool = cls(
            home=home,
            master_address=master_address or "",
            metrics_url=metrics_url,
            segment_size=segment_size if with_holder else 0,
            client_ttl=client_ttl,
            lease_ttl_ms=lease_ttl_ms,
            detach=detach,
            created=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        try:
            if master_address is None:
                pool._start_master(timeout_s)
            if with_holder:
                pool._start_holder(timeout_s)
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
            _split_address(master)
        except ConfigError as exc:
            raise ConfigError(f"pool file {path}: master_address {exc}") from None
        holder = str(data.get("holder_address") or "")
        pool = cls(
            home=path.parent,
            master_address=master,
            metrics_url=str(data.get("metrics_url") or ""),
            holder_address=holder,
            segment_size=_int(data.get("segment_size")),
            client_ttl=_int(data.get("client_ttl"), 10),
            lease_ttl_ms=_int(data.get("lease_ttl_ms"), 10000),
            detach=True,
            created=str(data.get("created") or ""),
            pool_file=path,
        )
        master_pid = data.get("master_pid")
        if isinstance(master_pid, int) and master_pid > 0:
            port = _split_address(master)[1]
            pool._master = _Process(
                "master",
                MASTER_BINARY,
                master_pid,
                f"--rpc_port={port}",
                path.parent / "master.log",
            )
        holder_pid = data.get("holder_pid")
        if isinstance(holder_pid, int) and holder_pid > 0 and holder:
            port = _split_address(holder)[1]
            pool._holder = _Process(
                "holder", HOLDER_BINARY, holder_pid, f"--port={port}", path.parent / "holder.log"
            )
        return pool

    def _start_master(self, timeout_s: float, ports: tuple[int, int] | None = None) -> None:
        for attempt in range(1, _START_ATTEMPTS + 1):
            rpc_port, metrics_port = ports or free_ports(2)
            args = [
                f"--rpc_address={LOOPBACK}",
                f"--rpc_port={rpc_port}",
                f"--metrics_host={LOOPBACK}",
                f"--metrics_port={metrics_port}",
                f"--client_ttl={self.client_ttl}",
                f"--default_kv_lease_ttl={self.lease_ttl_ms}",
                "--logtostderr",
            ]
            proc = _spawn(
                "master",
                MASTER_BINARY,
                args,
                f"--rpc_port={rpc_port}",
                self.home / "master.log",
                self.detach,
            )
            self._master = proc
            self.master_address = f"{LOOPBACK}:{rpc_port}"
            self.metrics_url = f"http://{LOOPBACK}:{metrics_port}"
            if self._wait(proc, timeout_s, self._master_ready):
                return
            proc.stop(2.0)
            if ports is not None:
                break  # a restart keeps its address or fails
            if attempt < _START_ATTEMPTS:
                log.info("master exited early (port clash?); retrying on new ports")
        raise self._failure(proc, "exited during start-up")

    def _master_ready(self) -> bool:
        host, port = _split_address(self.master_address)
        if not _port_accepts(host, port):
            return False
        try:
            ready = master_health(self.metrics_url, timeout=0.5).get("service_ready") is True
            return ready and bool(master_metrics(self.metrics_url, timeout=0.5))
        except StoreUnavailable:
            return False

    def _start_holder(self, timeout_s: float) -> None:
        before = set(self._segments())
        port = _split_address(self.holder_address)[1] if self.holder_address else 0
        for attempt in range(1, _START_ATTEMPTS + 1):
            if not port or not _port_free(port):
                port = free_ports(1)[0]
            args = [
                f"--host={LOOPBACK}",
                f"--port={port}",
                f"--global_segment_size={self.segment_size}",
                "--metadata_server=P2PHANDSHAKE",
                f"--master_server_address={self.master_address}",
                "--protocol=tcp",
                "--logtostderr",
            ]
            proc = _spawn(
                "holder",
                HOLDER_BINARY,
                args,
                f"--port={port}",
                self.home / "holder.log",
                self.detach,
            )
            self._holder = proc
            self.holder_address = f"{LOOPBACK}:{port}"

            def ready(port: int = port) -> bool:
                if not _port_accepts(LOOPBACK, port):
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

    @property
    def master_pid(self) -> int | None:
        return self._master.pid if self._master is not None else None

    @property
    def holder_pid(self) -> int | None:
        return self._holder.pid if self._holder is not None else None

    def master_running(self) -> bool:
        """Whether this handle's master process lives (False if the master is not ours)."""
        return self._master is not None and self._master.running()

    def holder_running(self) -> bool:
        """Whether this handle's holder process lives."""
        return self._holder is not None and self._holder.running()

    def is_alive(self) -> bool:
        """Whether every process this handle names still runs (as that mooncake process)."""
        procs = [p for p in (self._master, self._holder) if p is not None]
        return bool(procs) and all(p.running() for p in procs)

    def stop(self, timeout_s: float = 5.0, *, kill: bool = False) -> None:
        """Stop the holder, then the master: SIGTERM, wait, SIGKILL. Idempotent.

        ``kill``: SIGKILL at once (tests: the master spends ~0.9 s on a SIGTERM,
        and a throwaway pool has nothing to shut down cleanly).
        Children are reaped; PIDs from a pool file are signalled only while verified.
        """
        sig = signal.SIGKILL if kill else signal.SIGTERM
        for proc in (self._holder, self._master):
            if proc is not None:
                proc.stop(timeout_s, sig)
                log.info("stopped %s (pid %d)", proc.role, proc.pid)

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
        )
        return replace(base, **overrides)

    def pool_file_data(self) -> dict[str, Any]:
        """What ``write_pool_file`` writes: ``PoolConfig`` fields plus process facts.

        ``global_segment_size`` is left out on purpose: ``load_config`` reads the
        file, and a reader must stay a pure client.
        """
        return {
            "master_address": self.master_address,
            "holder_address": self.holder_address,
            "metrics_url": self.metrics_url,
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "local_hostname": LOOPBACK,
            "master_pid": self.master_pid,
            "holder_pid": self.holder_pid,
            "segment_size": self.segment_size,
            "client_ttl": self.client_ttl,
            "lease_ttl_ms": self.lease_ttl_ms,
            "created": self.created,
        }

    def write_pool_file(self, path: str | Path) -> Path:
        """Write the pool file atomically (temporary file, then rename); return its path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        data = (json.dumps(self.pool_file_data(), indent=2) + "\n").encode()
        # A new file only: never through a link (or a file) someone put at that name.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileExistsError:
            tmp.unlink()  # a leftover of ours (same pid) or a planted link: removed, not followed
            fd = os.open(tmp, flags, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        self.pool_file = path
        return path

    def metrics(self, timeout: float = 2.0) -> dict[str, float]:
        """``master_metrics`` of this pool's master (``StoreUnavailable`` if unknown/down)."""
        if not self.metrics_url:
            raise StoreUnavailable(
                f"the metrics address of master {self.master_address} is unknown"
            )
        return master_metrics(self.metrics_url, timeout)

    def processes(self) -> Iterator[tuple[str, int, bool]]:
        """(role, pid, running) for each process this handle names."""
        for proc in (self._master, self._holder):
            if proc is not None:
                yield proc.role, proc.pid, proc.running()


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


# --------------------------------------------------------------------------- status


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """What ``kvpool status`` shows. Counts are None when the master did not say."""

    master_address: str
    holder_address: str
    metrics_url: str
    processes: tuple[tuple[str, int, bool], ...]  # (role, pid, running) named by the handle
    reachable: bool  # the master's metrics answered
    error: str = ""  # why not, when not
    keys: int | None = None
    used_bytes: int | None = None
    capacity_bytes: int | None = None
    clients: int | None = None
    segments: Mapping[str, int] = field(default_factory=dict)  # name -> capacity, bytes
    namespaces: NamespaceSummary | None = None  # None if the master cannot list keys


def pool_status(pool: LocalPool, timeout: float = 2.0, list_keys: bool = True) -> PoolStatus:
    """Ask ``pool``'s master for its state; never raises for an unreachable master."""
    base = PoolStatus(
        master_address=pool.master_address,
        holder_address=pool.holder_address,
        metrics_url=pool.metrics_url,
        processes=tuple(pool.processes()),
        reachable=False,
    )
    try:
        metrics = pool.metrics(timeout)
    except StoreUnavailable as exc:
        return replace(base, error=str(exc))
    namespaces = None
    if list_keys:
        try:
            namespaces = namespace_counts(master_keys(pool.metrics_url, timeout=5 * timeout))
        except StoreUnavailable as exc:
            log.info("cannot list keys: %s", exc)

    def gauge(name: str) -> int | None:
        value = metrics.get(name)
        return None if value is None else int(value)

    return replace(
        base,
        reachable=True,
        keys=gauge("master_key_count"),
        used_bytes=gauge("master_allocated_bytes"),
        capacity_bytes=gauge("master_total_capacity_bytes"),
        clients=gauge("master_active_clients"),
        segments={name: int(cap) for name, cap in segment_capacities(metrics).items()},
        namespaces=namespaces,
    )

"""HA masters: etcd and two ``mooncake_master`` in Mooncake's high-availability mode.

    etcd_args(home, host, client_port, peer_port)   etcd's command line: one member
                                 on ``host``, data under ``<home>/etcd``
    etcd_marker(endpoint)        the argument that names that etcd's process
    etcd_health(endpoint)        "" when etcd's ``/health`` says true, else why not
    ha_master_args(endpoint)     the flags that make a master one of the HA pair
    master_roles(metrics_url)    {metrics url: "leader", "standby", "down", ...}
    log_durable_seq(endpoint)    the last sequence number of the leader's log that
                                 is in etcd (``parse_durable_prefix``: its parser)
    elections(endpoint)          each leader the pool has had, from etcd's history
                                 of the master view (``parse_elections``: its parser)
    HaStart                      ``LocalPool``'s start-up of etcd and the two masters
                                 (a mixin: the pool supplies addresses and helpers)

How it works (Mooncake 0.3.13): masters started with ``--enable_ha`` elect a leader
through a lease in etcd and write its address there (key
``mooncake-store/mooncake_cluster/master_view``); the other stands by and, with
``--enable_oplog``, replays the leader's log of object metadata (without it a new
leader starts empty). Clients and holders whose master address is
``etcd://HOST:PORT`` read the leader from etcd and follow a change by themselves;
``kvpool.pool.master_api`` asks the leader's metrics server. A new leader serves
after a warm-up of about 5 s; a leader killed with SIGKILL is replaced in about
10 s (its lease runs out first), every object kept whose entry was in the log.

The log is written after the put is answered: the leader appends one entry per
object put (and per segment mounted) and a writer of its own commits them to etcd
in batches, under ``/oplog/<cluster>/batches/``, then moves
``/oplog/<cluster>/durable_prefix`` (``{"batch_id", "last_seq", ...}``). A leader
killed before that loses the objects whose entries were still in its memory (a
leader killed here within milliseconds of its last puts left a new leader with 1 of
32 objects).
``log_durable_seq`` reads that prefix, so a caller can wait for its puts to be
logged (``kvpool bench ha`` does before each kill, and reports how long it took).

Mooncake counts no failovers. etcd keeps every version of the master-view key
(etcd's history; nothing here compacts it): each election creates the key anew
(version 1, under the lease of the new leader), so ``elections`` replays that
history with a watch from revision 1 and a pool's failovers are its elections
less one. The revision of each creation is the view number the masters report.

Clients have no setting for the cluster id, so the masters keep Mooncake's default
one and each pool has an etcd of its own (``kvpool up --ha`` starts it).
"""

from __future__ import annotations

import base64
import http.client
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.config import is_ha, master_endpoints
from kvpool.errors import StoreUnavailable
from kvpool.pool.binaries import ETCD_BINARY, MASTER_BINARY
from kvpool.pool.master_api import masters_health
from kvpool.pool.processes import _Process, _spawn, _split_address, free_ports

__all__ = [
    "Election",
    "HaStart",
    "elections",
    "etcd_args",
    "etcd_health",
    "etcd_marker",
    "ha_master_args",
    "log_durable_seq",
    "master_roles",
    "parse_durable_prefix",
    "parse_elections",
]

ETCD_NAME = "kvpool"  # the one member's name
DURABLE_PREFIX_KEY = "/oplog/mooncake_cluster/durable_prefix"  # Mooncake 0.3.13's
MASTER_VIEW_KEY = "mooncake-store/mooncake_cluster/master_view"  # the leader's address


def etcd_args(home: Path, host: str, client_port: int, peer_port: int) -> list[str]:
    """etcd's command line: one member, clients at ``host:client_port``; its first
    argument (``--listen-client-urls=...``) names the process (``processes``)."""
    client, peer = f"http://{host}:{client_port}", f"http://{host}:{peer_port}"
    return [
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--name={ETCD_NAME}",
        f"--data-dir={home / 'etcd'}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster={ETCD_NAME}={peer}",
        "--log-level=warn",
    ]


def etcd_marker(endpoint: str) -> str:
    """The argument that names the etcd serving ``endpoint`` (host:port)."""
    return f"--listen-client-urls=http://{endpoint}"


def etcd_health(endpoint: str, timeout: float = 1.0) -> str:
    """ "" when the etcd at ``endpoint`` (host:port) says it is healthy, else why not."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=timeout) as resp:
            body = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"not answering ({getattr(exc, 'reason', exc)})"
    if isinstance(body, dict) and body.get("health") == "true":
        return ""
    return f"unhealthy ({body})"


def parse_durable_prefix(value: bytes) -> int:
    """The ``last_seq`` of Mooncake's durable-prefix record (JSON); ``ValueError``
    if it is not one."""
    record = json.loads(value)
    if not isinstance(record, dict) or not isinstance(record.get("last_seq"), int):
        raise ValueError(f"not a durable-prefix record: {value[:100]!r}")
    return int(record["last_seq"])


def _etcd(endpoint: str, timeout: float) -> http.client.HTTPConnection:
    """A connection to etcd's JSON gateway at ``endpoint`` (host:port)."""
    host, _, port = endpoint.rpartition(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def _etcd_range(conn: http.client.HTTPConnection, key: str) -> list[dict[str, Any]]:
    """The ``kvs`` etcd holds for ``key`` (one, or none) through its JSON gateway,
    values base64 as etcd gives them."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode()})
    conn.request("POST", "/v3/kv/range", body)
    return list(json.loads(conn.getresponse().read()).get("kvs") or [])


def log_durable_seq(endpoint: str, timeout: float = 1.0) -> int:
    """The last sequence number of the HA leader's log that is in the etcd at
    ``endpoint`` (host:port); 0 before the first entry. ``StoreUnavailable`` when
    etcd does not answer or the record is not Mooncake's (another version)."""
    conn = _etcd(endpoint, timeout)
    try:
        kvs = _etcd_range(conn, DURABLE_PREFIX_KEY)
        return parse_durable_prefix(base64.b64decode(kvs[0]["value"])) if kvs else 0
    except (OSError, http.client.HTTPException) as exc:  # a timeout too
        raise StoreUnavailable(f"etcd at {endpoint} did not answer: {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreUnavailable(
            f"etcd at {endpoint} holds no durable-prefix record that kvpool reads "
            f"({exc}); is the pool's Mooncake the version setup.sh installs?"
        ) from None
    finally:
        conn.close()


@dataclass(frozen=True, slots=True)
class Election:
    """One leader of an HA pool: the view (etcd revision) that named it, its address."""

    view: int
    leader: str


def parse_elections(events: Iterable[dict[str, object]]) -> tuple[Election, ...]:
    """The elections among etcd watch events (JSON gateway form) of the master-view
    key: each creation of the key (a PUT of version 1) names a new leader; updates
    and deletions (a lease run out) do not. ``ValueError`` for a malformed event."""
    out = []
    for event in events:
        kv = event.get("kv")
        if not isinstance(kv, dict):
            raise ValueError(f"not a watch event: {str(event)[:100]}")
        if event.get("type", "PUT") != "PUT" or str(kv.get("version")) != "1":
            continue
        leader = base64.b64decode(str(kv.get("value", ""))).decode(errors="replace")
        out.append(Election(int(str(kv["create_revision"])), leader))
    return tuple(out)


def _mod_revision(event: dict[str, object]) -> int:
    kv = event.get("kv")
    return int(str(kv["mod_revision"])) if isinstance(kv, dict) else 0


def elections(endpoint: str, timeout: float = 1.0) -> tuple[Election, ...]:
    """Every leader the HA pool whose etcd is at ``endpoint`` (host:port) has had,
    oldest first: etcd's history of the master view, replayed by a watch from
    revision 1 through etcd's JSON gateway. ``StoreUnavailable`` when etcd does not
    answer, no master leads now (the count would stop short of the next leader),
    or its history was compacted (it cannot say how many came before)."""
    key = base64.b64encode(MASTER_VIEW_KEY.encode()).decode()
    watch = {"create_request": {"key": key, "start_revision": 1}}
    conn = _etcd(endpoint, timeout)
    try:
        # The current revision first: with no election in the history, the watch
        # sends nothing but its creation, and only the revision says it is all.
        current = _etcd_range(conn, MASTER_VIEW_KEY)
        if not current:  # between a lease running out and the next election
            raise StoreUnavailable(f"no master leads now (a failover?); etcd at {endpoint}")
        last = int(current[0]["mod_revision"])
        conn.request("POST", "/v3/watch", json.dumps(watch))
        resp = conn.getresponse()
        events: list[dict[str, object]] = []
        while not events or _mod_revision(events[-1]) < last:
            line = resp.readline()
            if not line:
                raise ValueError("the watch ended before the history did")
            result = json.loads(line).get("result") or {}
            if result.get("compact_revision") or result.get("canceled"):
                raise StoreUnavailable(
                    f"etcd at {endpoint} has compacted the history of the master view "
                    f"(from revision {result.get('compact_revision')}): failovers unknown"
                )
            events.extend(result.get("events") or [])
        return parse_elections(events)
    except (OSError, http.client.HTTPException) as exc:  # a timeout too
        raise StoreUnavailable(f"etcd at {endpoint} did not answer: {exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreUnavailable(
            f"etcd at {endpoint} gave a history of the master view that kvpool does "
            f"not read ({exc}); is the pool's Mooncake the version setup.sh installs?"
        ) from None
    finally:
        conn.close()


def ha_master_args(endpoint: str) -> list[str]:
    """A master's flags for the HA pair whose etcd is at ``endpoint`` (host:port)."""
    return ["--enable_ha=true", "--enable_oplog=true", f"--etcd_endpoints={endpoint}"]


def master_roles(metrics_url: str, timeout: float = 1.0) -> dict[str, str]:
    """Each master's role by its metrics URL (``metrics_url``: comma-separated):
    "leader", "standby", or "down" when it does not answer."""
    return {
        url: str(health.get("role") or health.get("status") or "unknown")
        for url, health in masters_health(metrics_url, timeout)
    }


class HaStart:
    """Starting etcd and HA masters; ``LocalPool`` supplies the state and helpers."""

    home: Path
    host: str
    detach: bool
    master_address: str
    metrics_url: str
    ha_masters: tuple[str, ...]
    etcd_peer_port: int
    _etcd: _Process | None
    _master: _Process | None
    _master2: _Process | None

    def _master_args(self, rpc_port: int, metrics_port: int) -> list[str]:
        raise NotImplementedError

    def _master_ready(self) -> bool:
        raise NotImplementedError

    def _wait(self, proc: _Process, timeout_s: float, ready: Callable[[], bool]) -> bool:
        raise NotImplementedError

    def _failure(self, proc: _Process, what: str) -> StoreUnavailable:
        raise NotImplementedError

    def _start_ha(self, timeout_s: float) -> None:
        """etcd, then two masters in HA mode; returns once one of them leads and serves."""
        client, peer = free_ports(2, self.host)
        data_dir = self.home / "etcd"
        if data_dir.exists():  # a former pool's member, on other ports: never reused
            shutil.rmtree(data_dir)
        self._start_etcd(timeout_s, (client, peer))
        self.master_address = f"etcd://{self.host}:{client}"
        ports = [free_ports(2, self.host) for _ in range(2)]
        self.ha_masters = tuple(f"{self.host}:{rpc}" for rpc, _ in ports)
        self.metrics_url = ",".join(f"http://{self.host}:{m}" for _, m in ports)
        for i in range(2):
            self._start_ha_master(i)
        first = self._master
        assert first is not None
        if not self._wait(first, timeout_s, self._master_ready):
            raise self._failure(first, "exited during start-up")

    def _start_etcd(self, timeout_s: float, ports: tuple[int, int]) -> None:
        """etcd on ``ports`` (client, peer), its data under ``home``; returns once healthy."""
        endpoint = f"{self.host}:{ports[0]}"
        self.etcd_peer_port = ports[1]
        self._etcd = etcd = _spawn(
            "etcd",
            ETCD_BINARY,
            etcd_args(self.home, self.host, *ports),
            etcd_marker(endpoint),
            self.home / "etcd.log",
            self.detach,
            self.host,
        )
        if not self._wait(etcd, timeout_s, lambda: not etcd_health(endpoint, 0.5)):
            raise self._failure(etcd, "exited during start-up")

    def _start_ha_master(self, index: int) -> _Process:
        """HA master ``index`` (0 or 1) on its ports; returns at once (it elects or
        stands by on its own)."""
        role = ("master", "master-2")[index]
        rpc = _split_address(self.ha_masters[index])[1]
        metrics = _split_address(self.metrics_url.split(",")[index].removeprefix("http://"))[1]
        proc = _spawn(
            role,
            MASTER_BINARY,
            self._master_args(rpc, metrics) + ha_master_args(self.etcd_endpoint),
            f"--rpc_port={rpc}",
            self.home / f"{role}.log",
            self.detach,
            self.host,
        )
        if index == 0:
            self._master = proc
        else:
            self._master2 = proc
        return proc

    @property
    def etcd_endpoint(self) -> str:
        """host:port of the pool's etcd (HA masters), else ""."""
        return master_endpoints(self.master_address)[0] if is_ha(self.master_address) else ""

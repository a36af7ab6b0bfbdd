"""What ``kvpool status`` shows: one record of a pool's state, and its keys by namespace.

    pool_status(pool)            one ``PoolStatus`` record: processes, key count,
                                 bytes, clients, segments, namespaces, evictions
                                 and puts refused for lack of space since start;
                                 ``hosts()`` its memory per host, and keys per
                                 host when it spans hosts (``KEY_SAMPLE`` keys
                                 asked at most: beyond, the counts are estimates)
    pool_status(pool, read_heads=store.read_heads)
                                 the same, with the oldest write time among
                                 ``AGE_SAMPLE`` random objects' headers (``ages``)
                                 and, with tenant quotas, each tenant's bytes
    PoolStatus.masters / .etcd   HA masters: each one's role and state, the leader's
                                 view (Mooncake bumps it at each election), and
                                 etcd's health; ``.elections`` every leader so far
                                 and ``.failovers`` (from etcd's history)
    namespace_counts(keys)       keys grouped by tenant, kvpool namespace and KV
                                 group (``NamespaceSummary``); other keys counted
                                 apart; ``pool_status`` adds each group's bytes

``pool_status`` never raises for an unreachable master: that is a field
(``reachable``, ``error``); a master that cannot list its keys leaves
``namespaces`` None. Counts the master did not report are None.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.errors import KeyFormatError, StoreUnavailable
from kvpool.keys import parse_key
from kvpool.pool.ages import HeadReader, oldest_written
from kvpool.pool.ha import Election, elections, etcd_health
from kvpool.pool.local import LocalPool
from kvpool.pool.master_api import (
    key_bytes,
    key_hosts,
    master_keys,
    master_metrics,
    masters_health,
    segment_capacities,
    segment_usage,
)
from kvpool.pool.quotas import tenant_usage

__all__ = [
    "MasterState",
    "NamespaceCount",
    "NamespaceSummary",
    "PoolStatus",
    "namespace_counts",
    "pool_status",
]

log = logging.getLogger(__name__)

KEY_SAMPLE = 1000  # keys whose host status asks, at most (one HTTP request each)
SIZE_SAMPLE = 64  # content ids per namespace row whose object size status asks, at most
AGE_SAMPLE = 256  # objects whose header status reads for the oldest write time, at most


@dataclass(frozen=True, slots=True)
class NamespaceCount:
    """Keys of one KV group of one kvpool namespace (tenant + model + config
    fingerprint); ``tenant`` is empty for keys of no tenant."""

    tenant: str
    model: str
    fingerprint: str
    group: int
    keys: int
    contents: int  # distinct content ids (head slot, dcp, pcp, pp) among those keys
    # (a key, how many keys) per content id: objects of one content are one size
    samples: tuple[tuple[str, int], ...] = ()
    bytes: int | None = None  # from the samples' sizes; None when the master did not say


@dataclass(frozen=True, slots=True)
class NamespaceSummary:
    """``namespace_counts``'s answer: kvpool namespaces sorted, other keys counted."""

    rows: tuple[NamespaceCount, ...]
    other: int  # keys that are not kvpool keys of a known schema


def namespace_counts(keys: Iterable[str]) -> NamespaceSummary:
    """Group ``keys`` by (tenant, model, fingerprint, KV group) with ``keys.parse_key``."""
    counts: Counter[tuple[str, str, str, int]] = Counter()
    contents: dict[tuple[str, str, str, int], set[tuple[int, int, int, int]]] = {}
    samples: dict[tuple[str, str, str, int], dict[tuple[int, int, int, int], list[Any]]] = {}
    other = 0
    for key in keys:
        try:
            k = parse_key(key)
        except KeyFormatError:
            other += 1
            continue
        c = k.content
        ns = (k.tenant, k.model, k.fingerprint, c.group)
        counts[ns] += 1
        content = (c.head, c.dcp_rank, c.pcp_rank, c.band)
        contents.setdefault(ns, set()).add(content)
        samples.setdefault(ns, {}).setdefault(content, [key, 0])[1] += 1
    rows = tuple(
        NamespaceCount(
            *ns, counts[ns], len(contents[ns]), tuple((k, n) for k, n in samples[ns].values())
        )
        for ns in sorted(counts)
    )
    return NamespaceSummary(rows, other)


@dataclass(frozen=True, slots=True)
class MasterState:
    """One of a pool's HA masters, as its ``/health`` says."""

    name: str  # "master", "master-2"
    address: str  # its rpc host:port
    metrics_url: str
    role: str  # "leader", "standby" or "down"
    state: str = ""  # Mooncake's ha_state: "serving", "leader_warmup", "standby", ...
    view: int | None = None  # the master view it knows (bumped at each election)
    error: str = ""  # why it does not answer


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
    segments_used: Mapping[str, int] = field(default_factory=dict)  # name -> bytes in use
    host_keys: Mapping[str, int] = field(default_factory=dict)  # host -> keys with a replica
    host_keys_sampled: int = 0  # keys asked for host_keys; < keys: the counts are scaled
    # Pressure since the master started: objects and bytes it evicted, and puts that
    # found no free memory (kvpool's writers put those again once it has evicted).
    evicted_objects: int | None = None
    evicted_bytes: int | None = None
    refused_puts: int | None = None
    # The oldest write time (ms since the epoch, writers' clocks) among the headers of
    # ``ages_sampled`` random kvpool objects; None when none was read or said one.
    oldest_written_ms: int | None = None
    ages_sampled: int = 0
    # Tenant quotas (``kvpool.pool.quotas``): Mooncake tenant -> (bytes charged, quota).
    # The master lists the keys of its ``default`` tenant only: ``keys`` and
    # ``namespaces`` leave out those of tenants with a quota.
    tenants: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    # HA masters: each one's state, and etcd's health ("" healthy, else why not);
    # empty for a pool of one master
    masters: tuple[MasterState, ...] = ()
    etcd: str = ""
    # HA: every leader so far, oldest first (``kvpool.pool.ha.elections``); the
    # failovers are one fewer. ``elections_error``: why etcd could not say.
    elections: tuple[Election, ...] = ()
    elections_error: str = ""

    @property
    def failovers(self) -> int | None:
        """Leaders replaced since the pool started; None when unknown (not HA, or
        etcd could not say)."""
        if not self.masters or self.elections_error:
            return None
        return max(len(self.elections) - 1, 0)

    def hosts(self) -> dict[str, tuple[int, int, int]]:
        """Per host (a segment name's address part): (segments, bytes used, capacity)."""
        out: dict[str, tuple[int, int, int]] = {}
        for name, cap in self.segments.items():
            host = _host(name)
            n, used, total = out.get(host, (0, 0, 0))
            out[host] = (n + 1, used + self.segments_used.get(name, 0), total + cap)
        return dict(sorted(out.items()))


def _host(segment: str) -> str:
    """The host of a segment named ``host:port``."""
    return segment.rpartition(":")[0] or segment


def pool_status(
    pool: LocalPool,
    timeout: float = 2.0,
    list_keys: bool = True,
    read_heads: HeadReader | None = None,
) -> PoolStatus:
    """Ask ``pool``'s master for its state; never raises for an unreachable master.
    With ``read_heads`` (and ``list_keys``), also the oldest write time of a sample."""
    base = PoolStatus(
        master_address=pool.master_address,
        holder_address=pool.holder_address,
        metrics_url=pool.metrics_url,
        processes=tuple(pool.processes()),
        reachable=False,
    )
    metrics_url = pool.metrics_url
    if pool.ha_masters:
        base = replace(base, masters=_masters(pool, timeout), etcd=etcd_health(pool.etcd_endpoint))
        try:
            base = replace(base, elections=elections(pool.etcd_endpoint, timeout))
        except StoreUnavailable as exc:
            base = replace(base, elections_error=str(exc))
        leaders = [m.metrics_url for m in base.masters if m.role == "leader"]
        if not leaders:
            return replace(base, error="no master leads now (a failover takes ~10 s)")
        metrics_url = leaders[0]  # asked once: every call below goes to it
    try:
        metrics = master_metrics(metrics_url, timeout) if metrics_url else pool.metrics(timeout)
    except StoreUnavailable as exc:
        return replace(base, error=str(exc))
    namespaces, keys = None, None
    if list_keys:
        try:
            keys = master_keys(metrics_url, timeout=5 * timeout)
            namespaces = _with_bytes(namespace_counts(keys), metrics_url, timeout)
        except StoreUnavailable as exc:
            log.info("cannot list keys: %s", exc)

    def gauge(name: str) -> int | None:
        value = metrics.get(name)
        return None if value is None else int(value)

    segments = {name: int(cap) for name, cap in segment_capacities(metrics).items()}
    host_keys: dict[str, int] = {}
    sampled = 0
    if keys is not None and len(set(map(_host, segments))) > 1:
        host_keys, sampled = _keys_per_host(metrics_url, keys, timeout)
    oldest, aged = None, 0
    if keys is not None and read_heads is not None:
        oldest, aged = oldest_written(read_heads, keys, AGE_SAMPLE)

    return replace(
        base,
        reachable=True,
        keys=gauge("master_key_count"),
        used_bytes=gauge("master_allocated_bytes"),
        capacity_bytes=gauge("master_total_capacity_bytes"),
        clients=gauge("master_active_clients"),
        segments=segments,
        segments_used={name: int(n) for name, n in segment_usage(metrics).items()},
        namespaces=namespaces,
        host_keys=host_keys,
        host_keys_sampled=sampled,
        evicted_objects=gauge("master_evicted_key_count"),
        evicted_bytes=gauge("master_evicted_size_bytes"),
        refused_puts=gauge("master_put_start_alloc_failures_total"),
        oldest_written_ms=oldest,
        ages_sampled=aged,
        tenants=tenant_usage(metrics),
    )


def _masters(pool: LocalPool, timeout: float) -> tuple[MasterState, ...]:
    out = []
    names = ("master", "master-2")
    for i, (url, health) in enumerate(masters_health(pool.metrics_url, timeout)):
        view = health.get("view_version")
        out.append(
            MasterState(
                names[i] if i < len(names) else f"master-{i + 1}",
                pool.ha_masters[i] if i < len(pool.ha_masters) else "?",
                url,
                str(health.get("role") or "down"),
                str(health.get("ha_state") or ""),
                view if isinstance(view, int) else None,
                str(health.get("error") or ""),
            )
        )
    return tuple(out)


def _with_bytes(summary: NamespaceSummary, metrics_url: str, timeout: float) -> NamespaceSummary:
    """Each row's bytes: per content id, its keys x one key's size (a content's
    objects are one size; layer bands or head groups may differ). One master
    request per content, ``SIZE_SAMPLE`` at most per row: beyond, scaled."""
    rows = []
    for row in summary.rows:
        sampled = row.samples[:SIZE_SAMPLE]
        try:
            sizes = [key_bytes(metrics_url, [key], timeout) for key, _ in sampled]
        except StoreUnavailable as exc:
            log.info("cannot size the objects of %s: %s", row.model, exc)
            sizes = []
        if not sizes or not all(sizes):  # gone meanwhile, or no answer: unknown
            rows.append(row)
            continue
        total = sum(size * n for size, (_, n) in zip(sizes, sampled, strict=True))
        keys = sum(n for _, n in sampled)
        rows.append(replace(row, bytes=total * row.keys // keys))
    return replace(summary, rows=tuple(rows))


def _keys_per_host(metrics_url: str, keys: list[str], timeout: float) -> tuple[dict[str, int], int]:
    """Keys per host of the pool's ``keys``: exact for up to ``KEY_SAMPLE`` keys,
    else those of a random sample scaled to the total; and how many keys were
    asked. Empty if the master cannot say."""
    try:
        sample = keys if len(keys) <= KEY_SAMPLE else random.sample(keys, KEY_SAMPLE)
        counts = key_hosts(metrics_url, sample, timeout)
    except StoreUnavailable as exc:
        log.info("cannot count keys per host: %s", exc)
        return {}, 0
    scale = len(keys) / len(sample) if sample else 0.0
    return {h: round(n * scale) for h, n in sorted(counts.items())}, len(sample)

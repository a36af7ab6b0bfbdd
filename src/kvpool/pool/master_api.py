"""The master's HTTP API (its metrics port): metrics, health and keys.

    master_metrics(url)          the master's Prometheus ``/metrics`` as {sample: value}
                                 (``parse_metrics(text)`` is the pure parser)
    master_health(url)           the JSON object of ``/health`` (``service_ready``, ...)
    master_serving(url)          whether ``/health`` answers ``service_ready`` (False
                                 when it does not answer)
    masters_health(url)          (url, ``/health``) of each master (HA: several)
    leader_url(url)              the metrics URL of the master that leads
    master_keys(url)             every key the master knows (``/get_all_keys``)
    key_hosts(url, keys)         per host, how many of ``keys`` have a replica there
                                 (``/query_key``, one request per key, in parallel)
    key_bytes(url, keys)         bytes the objects of ``keys`` take (``/query_key``)
    completed_puts(metrics)      objects whose put finished, from ``master_metrics``
    segment_capacities(metrics)  mounted segments -> capacity in bytes
    segment_usage(metrics)       mounted segments -> bytes allocated to objects
    wait_until(cond, timeout)    poll a condition on the pool (e.g. its key count)
                                 against a deadline

``url`` is the master's ``http://host:port`` (a trailing ``/metrics`` is
accepted); for HA masters, each master's, comma-separated: every call then asks
the one that leads. A master that does not answer in time, or answers something else
than asked, is ``StoreUnavailable``; the pure helpers never raise.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool.errors import KVPoolError, StoreUnavailable

__all__ = [
    "completed_puts",
    "key_bytes",
    "key_hosts",
    "leader_url",
    "master_health",
    "master_keys",
    "master_metrics",
    "masters_health",
    "parse_metrics",
    "segment_capacities",
    "segment_usage",
    "wait_until",
]


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


def master_serving(metrics_url: str, timeout: float = 0.5) -> bool:
    """Whether the master answers ``/health`` with ``service_ready`` true; False when
    it says otherwise or does not answer in ``timeout`` seconds."""
    try:
        return master_health(metrics_url, timeout).get("service_ready") is True
    except StoreUnavailable:
        return False


def master_keys(metrics_url: str, timeout: float = 10.0) -> list[str]:
    """Every key on the master, from its admin endpoint ``/get_all_keys``.

    One request, the whole list in memory: fine for ``kvpool status``, not for a hot
    path. Raises ``StoreUnavailable`` if the master does not answer.
    """
    body = _http_get(_endpoint(metrics_url, "/get_all_keys"), timeout)
    return [k for k in body.decode("utf-8", "replace").split("\n") if k]


# The master reads /query_key's key as sent, not percent-decoded: a kvpool key (ASCII,
# its model already percent-quoted) goes out as it is; other characters are quoted,
# and a key that needs them counts nowhere.
_AS_IS = "/%:@=+,!"  # "!": the mark of a tenant part (keys)


def _replicas(
    metrics_url: str, keys: Sequence[str], timeout: float
) -> list[list[dict[str, Any]] | None]:
    """Per key, the replicas ``/query_key`` lists ([] when the key is gone), or None
    when the master did not answer for it. Raises ``StoreUnavailable`` only if it
    answered for none."""
    base = _endpoint(metrics_url, "/query_key?key=")

    def replicas_of(key: str) -> list[dict[str, Any]] | None:
        try:
            body = _http_get(base + urllib.parse.quote(key, safe=_AS_IS), timeout)
            data = json.loads(body.decode())
        except (StoreUnavailable, ValueError):
            return None
        replicas = data.get("data") if isinstance(data, dict) else None
        if not isinstance(replicas, list):
            return []  # no such key (any more)
        return [r for r in replicas if isinstance(r, dict)]

    if not keys:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(keys))) as pool:
        answers = list(pool.map(replicas_of, keys))
    if all(a is None for a in answers):
        raise StoreUnavailable(f"{metrics_url} answered no /query_key request")
    return answers


def key_hosts(metrics_url: str, keys: Sequence[str], timeout: float = 2.0) -> Counter[str]:
    """Per host (the address part of a replica's transport endpoint), how many of
    ``keys`` have a replica there; a key on two hosts counts on both. A key gone
    since it was listed, or one the master does not answer for, counts nowhere.
    Raises ``StoreUnavailable`` only if no key could be asked at all."""
    counts: Counter[str] = Counter()
    for replicas in _replicas(metrics_url, keys, timeout):
        counts.update(
            {
                str(r.get("transport_endpoint_", "")).rpartition(":")[0]
                for r in replicas or ()
                if r.get("transport_endpoint_")
            }
        )
    return counts


def key_bytes(metrics_url: str, keys: Sequence[str], timeout: float = 2.0) -> int:
    """Bytes the objects of ``keys`` take (one replica each; headers included), of
    those the master answers for. Raises ``StoreUnavailable`` as ``key_hosts``."""
    total = 0
    for replicas in _replicas(metrics_url, keys, timeout):
        if replicas:
            size = replicas[0].get("size_", 0)
            total += size if isinstance(size, int) else 0
    return total


def segment_capacities(metrics: Mapping[str, float]) -> dict[str, float]:
    """Mounted segments by name -> capacity in bytes, from ``master_metrics``."""
    return _by_segment(metrics, "segment_total_capacity_bytes")


def segment_usage(metrics: Mapping[str, float]) -> dict[str, float]:
    """Mounted segments by name -> bytes allocated to objects, from ``master_metrics``."""
    return _by_segment(metrics, "segment_allocated_bytes")


def _by_segment(metrics: Mapping[str, float], metric: str) -> dict[str, float]:
    prefix = metric + '{segment="'
    return {
        name[len(prefix) : -2]: value
        for name, value in metrics.items()
        if name.startswith(prefix) and name.endswith('"}')
    }


def masters_health(metrics_url: str, timeout: float = 2.0) -> list[tuple[str, dict[str, Any]]]:
    """(url, ``/health``) of each master ``metrics_url`` names (HA masters: a
    comma-separated list); a master that does not answer has ``{"status": "down",
    "error": ...}``."""
    out: list[tuple[str, dict[str, Any]]] = []
    for url in _urls(metrics_url):
        try:
            out.append((url, master_health(url, timeout)))
        except StoreUnavailable as exc:
            out.append((url, {"status": "down", "error": str(exc)}))
    return out


def leader_url(metrics_url: str, timeout: float = 2.0) -> str:
    """The metrics URL of the master that serves: ``metrics_url`` itself, or of a
    comma-separated list (HA masters) the one whose ``/health`` says it leads;
    ``StoreUnavailable`` while none does (a failover: the standby takes ~10 s)."""
    urls = _urls(metrics_url)
    if len(urls) == 1:
        return urls[0]
    for url, health in masters_health(metrics_url, timeout):
        if health.get("role") == "leader":
            return url
    raise StoreUnavailable(f"no master of {metrics_url} leads now (a failover?)")


def _urls(metrics_url: str) -> list[str]:
    return [u.strip() for u in metrics_url.split(",") if u.strip()] or [metrics_url]


def _endpoint(metrics_url: str, path: str) -> str:
    url = leader_url(metrics_url) if "," in metrics_url else metrics_url
    return url.rstrip("/").removesuffix("/metrics") + path

"""Connector settings from vLLM's ``kv_connector_extra_config``, parsed in one place.

    parse_extra(extra) -> (ConnectorSettings, pool settings dict)

Keys that are ``PoolConfig`` fields (``pool_file``, ``master_address``, ...)
go to ``kvpool.config.load_config``; the keys below configure the connector.
An unknown key is an error that lists the known ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from kvpool.config import PoolConfig, parse_size
from kvpool.errors import ConfigError

__all__ = ["ConnectorSettings", "parse_extra"]


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """How the connector behaves; every field has a default that works after `kvpool up`."""

    chunk_size: int = 0  # tokens per pool object; 0 = the engine's block size
    lookup_timeout_ms: float = 50.0  # deadline of one scheduler-side lookup (then a miss)
    lookup_async: bool = False  # answer "ask again later" instead of waiting
    save_decode: bool = False  # also save chunks completed during decode
    instance: str = ""  # names the lookup endpoint; "" = from the config fingerprint
    # "auto" = staged: loads land in staging, are verified, then copied into the
    # KV cache; "direct" gets into the KV cache (zero-copy, per-layer segments).
    load_mode: Literal["auto", "direct", "staged"] = "auto"
    # Same-host fast path to the pool's holder: "auto" uses it when the holder
    # is on this host, falling back to TCP if it cannot be set up.
    shared_memory: Literal["auto", "on", "off"] = "auto"
    # Per worker: half for saves, half for staged loads (all for saves when loads
    # are direct). Any prompt moves through it piece by piece; a bigger one
    # moves more at once. It must hold one chunk object (checked at start).
    staging_bytes: int = 256 << 20
    # Place the KV cache in the pool's shared memory (same-host holder) and move
    # blocks with no staging copy. Loads are then direct (no load_timeout_s), a
    # step waits for the saves of requests that finished or were preempted
    # before their blocks can be reused, and a holder restart is not recovered
    # (the pool misses until the engine restarts). Over TCP: saves put straight
    # from the KV tensors.
    zero_copy: bool = False
    # A staged load with no answer this long is reported failed (its blocks are
    # recomputed) and its late bytes are dropped: a holder that stops answering
    # blocks a Mooncake get ~30 s. 0 = wait as long as the store does.
    load_timeout_s: float = 5.0
    failed_key_ttl_s: float = 60.0  # a chunk that failed to load reads as a miss this long
    run_dir: str = ""  # folder of the lookup socket; "" = a per-user temp folder
    store: str = "mooncake"  # the store backend: a registered name or module:Class


_CONNECTOR = {f.name: f for f in fields(ConnectorSettings)}
_POOL = {f.name for f in fields(PoolConfig)}


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"kv_connector_extra_config.{name} must be true or false, got {v!r}")


def _number(name: str, v: Any, kind: type[int] | type[float]) -> int | float:
    try:
        out = kind(v)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config.{name} must be a number, got {v!r}") from None
    if out < 0:
        raise ConfigError(f"kv_connector_extra_config.{name} must be >= 0, got {v!r}")
    return out


def parse_extra(extra: Mapping[str, Any] | None) -> tuple[ConnectorSettings, dict[str, Any]]:
    """Split and validate ``kv_connector_extra_config``."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_CONNECTOR) - _POOL)
    if unknown:
        known = ", ".join(sorted(set(_CONNECTOR) | _POOL))
        raise ConfigError(
            f"unknown kv_connector_extra_config key(s) {', '.join(unknown)}; known: {known}"
        )
    pool = {k: v for k, v in extra.items() if k in _POOL}
    values: dict[str, Any] = {}
    for name, v in extra.items():
        if name not in _CONNECTOR:
            continue
        if name in ("lookup_async", "save_decode", "zero_copy"):
            values[name] = _bool(name, v)
        elif name == "chunk_size":
            values[name] = int(_number(name, v, int))
        elif name == "staging_bytes":
            values[name] = parse_size(v, f"kv_connector_extra_config.{name}")
        elif name in ("lookup_timeout_ms", "failed_key_ttl_s", "load_timeout_s"):
            values[name] = float(_number(name, v, float))
        elif name == "shared_memory":
            if v in (True, False):
                v = "on" if v else "off"
            if v not in ("auto", "on", "off"):
                raise ConfigError(
                    f"kv_connector_extra_config.shared_memory must be auto, on or off, got {v!r}"
                )
            values[name] = v
        elif name == "load_mode":
            if v not in ("auto", "direct", "staged"):
                raise ConfigError(
                    f"kv_connector_extra_config.load_mode must be auto, direct or staged, got {v!r}"
                )
            values[name] = v
        else:
            values[name] = str(v)
    return ConnectorSettings(**values), pool

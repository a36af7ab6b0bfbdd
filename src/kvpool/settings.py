"""Connector settings from vLLM's ``kv_connector_extra_config``, parsed in one place.

    parse_extra(extra, env) -> (ConnectorSettings, pool settings dict); ``tenant``
                          falls back to ``$KVPOOL_TENANT``
    settings_table()   -> the README's settings table (Markdown), made from the
                          fields of ``ConnectorSettings`` and ``PoolConfig``

Keys that are ``PoolConfig`` fields (``pool_file``, ``master_address``, ...)
go to ``kvpool.config.load_config``; the keys below configure the connector.
An unknown key is an error that names the closest known one and lists them all;
a value of the wrong type (``null`` for a folder, ``1`` for ``"on"``, a dict for a
list) is an error naming the key and what it takes, never a converted default.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Literal

from kvpool.config import (
    ENV_PREFIX,
    PoolConfig,
    did_you_mean,
    documented,
    parse_bool,
    parse_number,
    parse_size,
)
from kvpool.errors import ConfigError, LayoutError
from kvpool.keys import check_tenant

__all__ = ["TENANT_ENV", "ConnectorSettings", "parse_extra", "parse_layer_bands", "settings_table"]

TENANT_ENV = "KVPOOL_TENANT"


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """How the connector behaves; every field has a default that works after `kvpool up`."""

    chunk_size: int = documented(
        0,
        "Tokens per pool object, a multiple of the block size (x DCP); 0 = one block. "
        "Engines share objects at equal chunk and block sizes (x DCP).",
    )
    layer_bands: tuple[int, ...] = documented(
        (),
        "The layers where a layer band begins (a pool object holds one band); engines "
        "of one model at different PP sizes share objects when their bands are equal, "
        "e.g. [0, 16] for PP1 and PP2 of 32 layers. Empty: where each PP stage begins.",
    )
    heads_per_object: int = documented(
        1,
        "KV heads per pool object: fewer, larger objects. Engines share objects only "
        "at equal values, and each TP rank must hold whole groups (TP <= KV heads / "
        "this value).",
    )
    token_classes: int = documented(
        0,
        "Token classes per block under DCP (a multiple of the DCP size; 0 = the DCP "
        "size): engines at different DCP sizes share objects when it and block_size x "
        "DCP are equal.",
    )
    lookup_timeout_ms: float = documented(
        50.0, "Deadline of one scheduler-side lookup; past it the request misses."
    )
    lookup_async: bool = documented(
        False, "Answer vLLM 'ask again later' instead of waiting for the lookup."
    )
    load_by_layer: bool = documented(
        False,
        "Load a hit in the step that computes the rest of the prompt, each layer band "
        "waited for at its first layer (vLLM's wait_for_layer_load): the load overlaps "
        "the forward; set layer_bands for more than one band. Staged or same-host "
        "zero-copy loads (a frozen holder then stalls the forward) of models with one "
        "KV group; others load asynchronously.",
    )
    load_decision: Literal["measured", "load", "recompute"] = documented(
        "measured",
        "measured: load a pool hit only when this engine's measured load time for it is "
        "below its measured time to compute those tokens (each learned as the engine "
        "runs; hits load until both are known); load: always load a hit; recompute: "
        "never load (the pool is written, not read).",
    )
    save_decode: bool = documented(False, "Also save chunks completed during decode.")
    save_priority: Literal["idle", "normal"] = documented(
        "normal",
        "normal: a worker's save threads (the copy into staging, the puts) run as any "
        "thread. idle: under Linux's SCHED_IDLE, on CPU time the engine's steps leave, "
        "raised to normal while saves wait 0.5 s with no piece moved; for hosts with idle "
        "CPU (on a host with none, a starved save thread holding Python's GIL stalls the "
        "engine's thread up to a second). idle needs CAP_SYS_NICE (root has it), else normal.",
    )
    tenant: str = documented(
        "",
        "The engine's tenant: its objects are named in that tenant's space, and engines "
        "of other tenants never read them (vLLM's per-request cache_salt still splits "
        "inside one). Empty: $KVPOOL_TENANT, else no tenant (every process of the engine "
        "must see the same: on other nodes set it there too).",
    )
    instance: str = documented(
        "",
        "Names the lookup endpoint; empty = from the engine's config fingerprint and tenant. "
        "Several servers of one config on a host each take the first free endpoint.",
    )
    load_mode: Literal["auto", "direct", "staged"] = documented(
        "auto",
        "staged: loads land in staging, are verified, then copied into the KV cache; "
        "direct: straight into the KV cache; auto: staged (zero_copy loads are always "
        "direct).",
    )
    shared_memory: Literal["auto", "on", "off"] = documented(
        "auto",
        "Mooncake's same-host path to the holder; auto: when the holder is on this host, else TCP.",
    )
    staging_bytes: int = documented(
        256 << 20,
        "Staging per worker (half for saves, half for staged loads); any prompt moves "
        "through it piece by piece. Must hold one chunk object (checked at start).",
    )
    zero_copy: bool = documented(
        False,
        "Place the KV cache in the holder's shared memory: no staging copy; loads are "
        "direct, with no load_timeout_s, and a holder restart needs an engine restart.",
    )
    load_timeout_s: float = documented(
        5.0,
        "A staged load with no answer this long fails (its blocks are recomputed) and its "
        "late bytes are dropped; 0 = wait as long as the store does.",
    )
    failed_key_ttl_s: float = documented(
        60.0, "A chunk that failed to load is a miss in lookups for this long."
    )
    run_dir: str = documented(
        "", "Folder of the lookup sockets; empty = a per-user temp folder (paths <= 107 bytes)."
    )
    store: str = documented("mooncake", "The store backend: a registered name or module:Class.")


_CONNECTOR = {f.name: f for f in fields(ConnectorSettings)}
_POOL = {f.name for f in fields(PoolConfig)}


def parse_extra(
    extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> tuple[ConnectorSettings, dict[str, Any]]:
    """Split and validate ``kv_connector_extra_config``; ``env`` (default: the
    process environment) gives ``tenant`` where ``extra`` leaves it empty."""
    env = os.environ if env is None else env
    extra = dict(extra or {})
    unknown = sorted(
        k if isinstance(k, str) and k.isidentifier() else repr(k)
        for k in set(extra) - set(_CONNECTOR) - _POOL
    )
    if unknown:
        known = sorted(set(_CONNECTOR) | _POOL)
        raise ConfigError(
            f"unknown kv_connector_extra_config key(s) {', '.join(unknown)}"
            f"{did_you_mean(unknown[0], known)}; known: {', '.join(known)}"
        )
    pool = {k: v for k, v in extra.items() if k in _POOL}
    values: dict[str, Any] = {}
    for name, v in extra.items():
        if name not in _CONNECTOR:
            continue
        if name in ("lookup_async", "save_decode", "zero_copy", "load_by_layer"):
            values[name] = parse_bool(v, f"kv_connector_extra_config.{name}")
        elif name == "heads_per_object":
            values[name] = int(
                parse_number(v, f"kv_connector_extra_config.{name}", integer=True, minimum=1)
            )
        elif name in ("chunk_size", "token_classes"):
            values[name] = int(parse_number(v, f"kv_connector_extra_config.{name}", integer=True))
        elif name == "layer_bands":
            values[name] = parse_layer_bands(v, f"kv_connector_extra_config.{name}")
        elif name == "staging_bytes":
            values[name] = parse_size(v, f"kv_connector_extra_config.{name}")
        elif name in ("lookup_timeout_ms", "failed_key_ttl_s", "load_timeout_s"):
            values[name] = parse_number(v, f"kv_connector_extra_config.{name}")
        elif name == "shared_memory":
            if v is True or v is False:
                v = "on" if v else "off"
            if not isinstance(v, str) or v not in ("auto", "on", "off"):
                raise ConfigError(
                    f"kv_connector_extra_config.shared_memory must be auto, on or off "
                    f"(or true/false), got {v!r}"
                )
            values[name] = v
        elif name == "load_decision":
            if not isinstance(v, str) or v not in ("measured", "load", "recompute"):
                raise ConfigError(
                    f"kv_connector_extra_config.load_decision must be measured, load or "
                    f"recompute, got {v!r}"
                )
            values[name] = v
        elif name == "save_priority":
            if not isinstance(v, str) or v not in ("idle", "normal"):
                raise ConfigError(
                    f"kv_connector_extra_config.save_priority must be idle or normal, got {v!r}"
                )
            values[name] = v
        elif name == "load_mode":
            if not isinstance(v, str) or v not in ("auto", "direct", "staged"):
                raise ConfigError(
                    f"kv_connector_extra_config.load_mode must be auto, direct or staged, got {v!r}"
                )
            values[name] = v
        elif name == "tenant":
            values[name] = _tenant(v, f"kv_connector_extra_config.{name}")
        else:  # run_dir, instance, store: text
            if not isinstance(v, str):
                raise ConfigError(
                    f"kv_connector_extra_config.{name} must be a string (empty for the "
                    f"default), got {v!r}"
                )
            values[name] = v
    if not values.get("tenant") and env.get(TENANT_ENV):
        values["tenant"] = _tenant(env[TENANT_ENV], TENANT_ENV)
    return ConnectorSettings(**values), pool


def _tenant(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string (empty for no tenant), got {value!r}")
    if not value:
        return ""
    try:
        return check_tenant(value)
    except LayoutError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def parse_layer_bands(value: Any, name: str) -> tuple[int, ...]:
    """``[0, 16]``, ``(0, 16)`` or ``"0,16"`` as a tuple of layer indices, in
    increasing order and each once; a ``ConfigError`` naming ``name`` otherwise (a
    dict, or bands out of order, are refused, not read as keys or sorted)."""
    example = 'e.g. [0, 16] or "0,16"'
    if not isinstance(value, str | list | tuple):
        raise ConfigError(f"{name} lists the layers where a band begins, {example}; got {value!r}")
    items = value.split(",") if isinstance(value, str) else value
    try:
        out = tuple(
            int(parse_number(v, name, integer=True))
            for v in items
            if not (isinstance(v, str) and not v.strip())
        )
    except (TypeError, ConfigError):
        raise ConfigError(
            f"{name} lists the layers where a band begins, {example}; got {value!r}"
        ) from None
    if any(b <= a for a, b in itertools.pairwise(out)):
        raise ConfigError(
            f"{name} must list each band's first layer once, in increasing order "
            f"(e.g. {list(sorted(set(out)))}); got {value!r}"
        )
    return out


def _default(f: Any) -> str:
    value = f.default if f.default is not MISSING else None
    if isinstance(value, bool):
        return "true" if value else "false"
    if f.name in ("staging_bytes", "local_buffer_size", "global_segment_size") and value:
        return f"{value >> 20} MiB"
    if value in ("", ()):
        return "(empty)"
    return f"`{value}`" if isinstance(value, str) else f"{value:g}"


def settings_table() -> str:
    """Every setting of ``kv_connector_extra_config``, as a Markdown table."""
    rows = [
        "| setting | default | override | what it does |",
        "|---|---|---|---|",
    ]
    for f in fields(ConnectorSettings):
        env = f" `{TENANT_ENV}` (when unset) " if f.name == "tenant" else " "
        rows.append(f"| `{f.name}` | {_default(f)} |{env}| {f.metadata['doc']} |")
    for f in fields(PoolConfig):
        env = f"`{ENV_PREFIX}{f.name.upper()}`"
        rows.append(f"| `{f.name}` | {_default(f)} | {env} | {f.metadata['doc']} |")
    return "\n".join(rows) + "\n"

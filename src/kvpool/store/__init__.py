"""Stores of KV objects, chosen by name. ``import kvpool.store`` imports no backend.

    KVStore, Status               the interface (``kvpool.store.base``)
    Segment, Segments, total_size scatter lists (``kvpool.store.scatter``)
    open_store(name, config, **o) build the store registered as ``name``
                                  (``"memory"`` or ``"mooncake"``) or named
                                  ``module:Class``, importing its module only now
    register_store(name, m, cls)  add a backend; a name is registered once
    store_names()                 the registered names

A backend class provides ``from_config(config, **options) -> KVStore``.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from kvpool.config import PoolConfig
from kvpool.errors import ConfigError
from kvpool.store.base import KVStore, Status
from kvpool.store.scatter import Segment, Segments, total_size

__all__ = [
    "KVStore",
    "Segment",
    "Segments",
    "Status",
    "open_store",
    "register_store",
    "store_names",
    "total_size",
]


class _StoreClass(Protocol):
    def from_config(self, config: PoolConfig, **options: Any) -> KVStore: ...


_REGISTRY: dict[str, tuple[str, str]] = {}


def register_store(name: str, module: str, class_name: str) -> None:
    """Register a backend by module path; refuses a name registered already."""
    if name in _REGISTRY:
        raise ValueError(f"a store named {name!r} is registered already")
    _REGISTRY[name] = (module, class_name)


def store_names() -> list[str]:
    return sorted(_REGISTRY)


def open_store(name: str, config: PoolConfig | None = None, **options: Any) -> KVStore:
    """Import the backend registered as ``name`` (or given as ``module:Class``)
    and build it from ``config``.

    Raises ``ConfigError`` for an unknown name, and whatever the backend raises
    while setting up (``StoreUnavailable``, ``StoreMissingDependency``).
    """
    if name in _REGISTRY:
        module, class_name = _REGISTRY[name]
    elif name.count(":") == 1:
        module, class_name = name.split(":")
    else:
        raise ConfigError(
            f"unknown store {name!r}; choose one of {', '.join(store_names())} or give module:Class"
        )
    try:
        cls: _StoreClass = getattr(importlib.import_module(module), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load store backend {name!r}: {exc}") from None
    return cls.from_config(config if config is not None else PoolConfig(), **options)


register_store("memory", "kvpool.store.memory", "MemoryStore")
register_store("mooncake", "kvpool.store.mooncake", "MooncakeStore")

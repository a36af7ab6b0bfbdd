"""kvpool's exception tree, in one place.

    KVPoolError                 base of every error kvpool raises on purpose
    ├── LayoutError             a parallel layout or KV-group spec that cannot work;
    │                           the message says which field to change
    ├── KeyFormatError          a string that is not a kvpool key of this schema
    ├── ConfigError             bad or missing configuration (file, extra config, env)
    │   └── PoolNotFound        no pool configured, or its pool file is missing or
    │                           unreadable: the pool is absent, not misconfigured
    ├── HeaderError             an object header that does not describe this object
    ├── UnsupportedEngine       the engine uses something kvpool cannot pool yet;
    │                           the connector stays idle
    └── StoreError              the pool cannot be used right now; callers above
        │                       the store treat it as a cache miss, never a crash
        ├── StoreUnavailable    no master / setup failed / store closed
        └── StoreMissingDependency  the Mooncake wheel or libibverbs is missing

Per-key failures of store calls are *values* (``store.base.Status``), not
exceptions; only whole-store failures raise ``StoreError``.
"""

from __future__ import annotations


class KVPoolError(Exception):
    """Base class of every error raised by kvpool."""


class LayoutError(KVPoolError, ValueError):
    """A layout or KV-group spec is invalid; the message names what to change."""


class KeyFormatError(KVPoolError, ValueError):
    """A string could not be parsed as a kvpool key."""


class ConfigError(KVPoolError, ValueError):
    """Configuration is missing or invalid; the message says what to fix."""


class PoolNotFound(ConfigError):
    """No pool is configured, or the pool file is missing, unreadable or not JSON.

    An engine serves without the pool then (the pool may come up later); any
    other ``ConfigError`` in a connector setting stops the engine at start."""


class HeaderError(KVPoolError):
    """An object header does not match the object it was read for."""


class StoreError(KVPoolError):
    """The store cannot serve requests; treat as a cache miss."""


class StoreUnavailable(StoreError):
    """The store could not be reached, set up, or has been closed."""


class StoreMissingDependency(StoreError):
    """A package or system library that the store adapter needs is missing."""


class UnsupportedEngine(KVPoolError):
    """The engine uses something kvpool cannot pool yet; the connector stays idle."""

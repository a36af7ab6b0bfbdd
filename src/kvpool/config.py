"""One validated ``PoolConfig``: where the pool is and how to talk to it.

    PoolConfig                 frozen, validated settings of a pool client
    load_config(extra, env)    build it from (lowest to highest precedence):
                               defaults < the pool file < ``extra`` (vLLM's
                               kv_connector_extra_config, or CLI options) <
                               environment overrides (KVPOOL_*)
    pool_file_path(env)        where ``kvpool up`` writes the pool file and
                               everything else looks for it by default
    read_pool_file(path)       parse a pool file: ``PoolNotFound`` if there is none,
                               ``ConfigError`` if it is there but unreadable,
                               malformed or holds an unknown key
    did_you_mean(word, known)  "; did you mean X?" for the closest known name, or ""
    master_endpoints(address)  host:port of the master, or of the etcd servers that
                               name the leader of HA masters (``etcd://A;B``)

One rule for a pool file: absent (no file where one is looked for) means no
pool (``PoolNotFound``: an engine serves without one, saying so once); present
but unreadable or invalid means a setting to fix (``ConfigError``: an engine
stops at start with one line naming the file and the key).

Pure: reads only the file it is pointed at (and warns if a secret in it is
readable by others); no sockets, no Mooncake.
A bad value raises ``ConfigError`` naming the field and what it accepts.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError, PoolNotFound

__all__ = [
    "ENV_PREFIX",
    "ETCD_SCHEME",
    "POOL_FILE_FACTS",
    "PoolConfig",
    "did_you_mean",
    "documented",
    "is_ha",
    "load_config",
    "master_endpoints",
    "parse_bool",
    "parse_number",
    "parse_size",
    "pool_file_path",
    "read_pool_file",
    "route_address",
]

ENV_PREFIX = "KVPOOL_"
logger = logging.getLogger(__name__)
_SECRET_HEX = 32  # 128 bits
_SECRET_RE = re.compile(rf"(?:[0-9a-fA-F]{{2}}){{{_SECRET_HEX // 2},}}")
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_MAX_SIZE = (1 << 63) - 1  # what Mooncake's signed 64-bit sizes hold


def parse_size(value: int | str, name: str = "size") -> int:
    """Bytes from an int or a string like ``512MB``, ``4 GiB``, ``65536``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a byte size like 512MB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
        size: int | Decimal = value
    else:
        m = _SIZE_RE.fullmatch(str(value))
        if not m:
            raise ConfigError(f"{name} must be a byte size like 512MB or 1GiB, got {value!r}")
        unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
        size = Decimal(m.group(1)) * _UNITS[unit]  # exact, unlike a float past 2**53
    if not size <= _MAX_SIZE:
        raise ConfigError(f"{name} must be at most {_MAX_SIZE} bytes (8 EiB), got {value!r}")
    return int(size)


def parse_number(value: Any, name: str, integer: bool = False, minimum: float = 0.0) -> float:
    """A finite number >= ``minimum`` from a number or its text; with ``integer``, a
    whole one (``2.5`` is refused, not cut to 2). Bools, NaN and infinities are
    refused: every setting that takes a number parses it here."""
    try:
        number = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number) or (integer and not number.is_integer()):
        what = "a whole number" if integer else "a finite number"
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    if number < minimum:
        raise ConfigError(f"{name} must be >= {minimum:g}, got {value!r}")
    return number


def documented(default: Any, doc: str, *, secret: bool = False) -> Any:
    """A dataclass field with its README description (``settings.settings_table``);
    a ``secret`` one is left out of the config's repr (and so of every log)."""
    return field(default=default, metadata={"doc": doc}, repr=not secret)


def parse_bool(value: Any, name: str) -> bool:
    """A bool, or one of 1/true/yes/on and 0/false/no/off (any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Settings of one pool client (an engine worker, the lookup server or the CLI).

    Sizes are in bytes. ``holder_address`` is the standalone holder
    (``mooncake_client``) of a local pool; when set and on this host, clients
    may use Mooncake's shared-memory path to it.
    """

    master_address: str = documented(
        "",
        "host:port of mooncake_master, or etcd://HOST:PORT[;HOST:PORT...] for HA masters "
        "(`kvpool up --ha`): clients find the leader through etcd.",
    )
    metadata_server: str = documented("P2PHANDSHAKE", "Mooncake's metadata server.")
    protocol: str = documented("tcp", "tcp or rdma.")
    device_name: str = documented("", "RDMA devices; empty for tcp.")
    local_hostname: str = documented("127.0.0.1", "The address this client advertises.")
    global_segment_size: int = documented(
        0, "Memory this client contributes to the pool; 0 = a pure client."
    )
    local_buffer_size: int = documented(64 << 20, "Mooncake's client transfer buffer.")
    holder_address: str = documented(
        "", "host:port of the standalone holder, if known (its host enables shared memory)."
    )
    metrics_url: str = documented("", "http://host:port of the master's metrics server.")
    checksum: bool = documented(True, "xxh3-64 over each object's payload, written and verified.")
    pool_secret: str = documented(
        "",
        "Hex key (at least 32 digits) that signs every object; objects not signed with it "
        "are refused. `kvpool up --secret` makes one; empty = unsigned.",
        secret=True,
    )
    setup_timeout_s: float = documented(10.0, "Bound on connecting to the master.")
    transfer_timeout_s: float = documented(5.0, "Bound on one blocked transfer.")
    pool_file: str = documented(
        "",
        "The pool file `kvpool up` writes (default: $KVPOOL_HOME/pool.json); its values "
        "come under the settings here.",
    )
    tenant_holders: str = documented(
        "",
        "TENANT=HOST:PORT,... : the holder of each tenant with a quota (`kvpool up --quota` "
        "writes it); an engine of such a tenant puts through its own.",
    )
    mooncake_tenant: str = documented(
        "",
        "The Mooncake tenant this client's objects are charged to (empty: `default`); the "
        "connector sets it from `tenant` where the pool has a quota for it.",
    )

    def __post_init__(self) -> None:
        if self.master_address:
            master_endpoints(self.master_address)  # raises on a malformed value
        if self.holder_address and not _is_host_port(self.holder_address):
            raise ConfigError(f"holder_address must be host:port, got {self.holder_address!r}")
        self.holders_by_tenant()  # raises on a malformed value
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        for name in ("setup_timeout_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.pool_secret and not _SECRET_RE.fullmatch(self.pool_secret):
            # The value itself is never echoed: it may be a real secret mistyped.
            raise ConfigError(
                f"pool_secret must be an even number of hex digits, at least {_SECRET_HEX} "
                f"(got {len(self.pool_secret)} characters); `kvpool up --secret` makes one, "
                "or use e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`"
            )

    @property
    def secret(self) -> bytes | None:
        """The pool secret as bytes, or None when objects are not signed."""
        return bytes.fromhex(self.pool_secret) if self.pool_secret else None

    def holders_by_tenant(self) -> dict[str, str]:
        """{tenant: holder host:port} of the tenants with a quota (``tenant_holders``)."""
        out: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in self.tenant_holders.split(","))):
            tenant, _, address = item.partition("=")
            if not tenant or not _is_host_port(address):
                raise ConfigError(
                    f"tenant_holders must be TENANT=HOST:PORT,..., got {self.tenant_holders!r}"
                )
            out[tenant] = address
        return out

    def for_tenant(self, tenant: str) -> PoolConfig:
        """The config of a client of ``tenant`` (empty: none): where the pool has a
        quota for it, its objects are charged to it and go through its holder;
        else this config (the pool's shared rest)."""
        holder = self.holders_by_tenant().get(tenant) if tenant else None
        if holder is None:
            return self
        return replace(self, mooncake_tenant=tenant, holder_address=holder)

    def require_master(self) -> str:
        """The master address, or ``PoolNotFound`` saying how to get a pool."""
        if not self.master_address:
            raise PoolNotFound(
                "no kvpool pool is configured and no pool file was found; "
                "start one with `kvpool up`, or set master_address in "
                "kv_connector_extra_config (or KVPOOL_MASTER_ADDRESS)"
            )
        return self.master_address


_FIELDS = {f.name: f for f in fields(PoolConfig)}
_SIZES = {"global_segment_size", "local_buffer_size"}
# What a pool file of ``kvpool up`` holds beside PoolConfig fields: facts about its
# processes (``LocalPool.pool_file_data``), read by ``kvpool status`` and ``down``.
POOL_FILE_FACTS = frozenset(
    {"host", "master_pid", "holder_pid", "segment_size", "client_ttl", "lease_ttl_ms",
     "created", "disk_dir", "disk_bytes", "quotas", "tenant_holder_pids", "ha_masters",
     "master2_pid", "etcd_pid"}
)  # fmt: skip


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the known name closest to ``word``, or ``""``."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


ETCD_SCHEME = "etcd://"


def master_endpoints(master_address: str) -> list[str]:
    """The host:port endpoints a client of ``master_address`` connects to first: the
    master itself, or (``etcd://A;B``, HA masters) the etcd servers that name the
    leader. ``ConfigError`` for anything else."""
    if master_address.startswith(ETCD_SCHEME):
        parts = master_address.removeprefix(ETCD_SCHEME).split(";")
        if all(_is_host_port(p) for p in parts):
            return parts
    elif _is_host_port(master_address):
        return [master_address]
    raise ConfigError(
        f"master_address must be host:port or etcd://HOST:PORT[;HOST:PORT...], "
        f"got {master_address!r}"
    )


def is_ha(master_address: str) -> bool:
    """Whether clients find the master through etcd (HA masters)."""
    return master_address.startswith(ETCD_SCHEME)


def _is_host_port(s: str) -> bool:
    host, sep, port = s.rpartition(":")
    return bool(sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536)


def _coerce(name: str, value: Any) -> Any:
    if name in _SIZES:
        return parse_size(value, name)
    kind = _FIELDS[name].type
    if kind == "bool":
        return parse_bool(value, name)
    if kind == "float":
        return parse_number(value, name, minimum=-math.inf)
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


def pool_file_path(env: Mapping[str, str] | None = None) -> Path:
    """``$KVPOOL_POOL_FILE``, else ``$KVPOOL_HOME/pool.json``, else ``~/.kvpool/pool.json``."""
    env = os.environ if env is None else env
    if env.get("KVPOOL_POOL_FILE"):
        return Path(env["KVPOOL_POOL_FILE"])
    home = env.get("KVPOOL_HOME") or str(Path.home() / ".kvpool")
    return Path(home) / "pool.json"


def read_pool_file(path: str | Path) -> dict[str, Any]:
    """The JSON object in a pool file. ``PoolNotFound`` when there is no file there;
    ``ConfigError`` when it is there but unreadable, not a JSON object, or holds a
    key that is neither a pool setting nor a fact ``kvpool up`` writes."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise PoolNotFound(f"no pool file at {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read pool file {path}: {exc.strerror or exc}") from None
    except ValueError:  # a NUL in the path
        raise ConfigError(
            f"cannot read pool file {str(path)!r}: its name holds a NUL byte"
        ) from None
    try:
        data = json.loads(raw.decode())
    except UnicodeDecodeError as exc:
        raise ConfigError(f"pool file {path} is not UTF-8 text: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"pool file {path} is not valid JSON ({exc}); fix it, or remove it and run "
            "`kvpool up` to write a new one"
        ) from None
    except RecursionError:
        raise ConfigError(f"pool file {path} is not a pool file: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"pool file {path} must hold a JSON object, got {type(data).__name__}")
    unknown = sorted(str(k) for k in set(data) - set(_FIELDS) - POOL_FILE_FACTS)
    if unknown:
        raise ConfigError(
            f"pool file {path}: unknown key(s) {', '.join(map(repr, unknown))}"
            f"{did_you_mean(unknown[0], _FIELDS)}; pool settings: {', '.join(sorted(_FIELDS))}"
        )
    return data


def load_config(
    extra: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> PoolConfig:
    """Defaults < pool file < ``extra`` < ``KVPOOL_<FIELD>`` environment overrides.

    The pool file is ``extra["pool_file"]`` if given, else ``pool_file_path(env)``
    when it exists. Unknown keys in ``extra`` are refused (typos would be silent).
    Keys of ``extra`` that belong to other layers are passed in ``ignore``-free:
    callers strip their own keys first.
    """
    env = os.environ if env is None else env
    extra = dict(extra or {})
    unknown = sorted(
        k if isinstance(k, str) and k.isidentifier() else repr(k) for k in set(extra) - set(_FIELDS)
    )
    if unknown:
        raise ConfigError(
            f"unknown pool setting(s) {', '.join(unknown)}{did_you_mean(unknown[0], _FIELDS)}; "
            f"known: {', '.join(sorted(_FIELDS))}"
        )
    values: dict[str, Any] = {}
    path = extra.get("pool_file") or env.get("KVPOOL_POOL_FILE") or ""
    if not isinstance(path, str | os.PathLike):
        raise ConfigError(f"pool_file must be a path, got {path!r}")
    file = Path(path) if path else pool_file_path(env)
    try:
        present = bool(path) or file.exists()
    except OSError as exc:  # e.g. a name too long, or a directory it may not search
        raise ConfigError(f"cannot read pool file {file}: {exc.strerror or exc}") from None
    if present:
        data = read_pool_file(file)
        if data.get("pool_secret"):
            _warn_if_readable(file)
        values.update({k: v for k, v in data.items() if k in _FIELDS})
        values["pool_file"] = str(file)
    values.update(extra)
    for name in _FIELDS:
        if (ENV_PREFIX + name.upper()) in env:
            values[name] = env[ENV_PREFIX + name.upper()]
    config = PoolConfig(**{k: _coerce(k, v) for k, v in values.items()})
    if config.local_hostname == "auto":
        config = replace(config, local_hostname=route_address(config.master_address))
    return config


def _warn_if_readable(file: Path) -> None:
    """A pool file holding a secret should be its owner's alone (``kvpool up`` makes
    it 0600); say so once per file when others may read it."""
    try:
        mode = file.stat().st_mode
    except OSError:
        return
    if mode & 0o077 and str(file) not in _WARNED:
        _WARNED.add(str(file))
        logger.warning(
            "kvpool: pool file %s holds the pool secret but others may read it (mode %o); "
            "chmod 600 it",
            file,
            mode & 0o777,
        )


_WARNED: set[str] = set()


def route_address(master_address: str) -> str:
    """This machine's address on the route to ``master_address`` (HOST:PORT): what a
    client here advertises to the pool's other hosts (``local_hostname: auto``, as
    a pool file of ``kvpool up --host`` says). Sends no packet."""
    host = master_endpoints(master_address)[0].rpartition(":")[0] if master_address else ""
    if not host:
        raise ConfigError("local_hostname 'auto' needs a master_address to find the route to")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # a UDP connect only picks the route
            return str(s.getsockname()[0])
    except OSError as exc:
        raise ConfigError(
            f"no route from this host to the master at {master_address} ({exc.strerror}); "
            "set KVPOOL_LOCAL_HOSTNAME to this host's address"
        ) from None

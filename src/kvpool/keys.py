"""Key schema: names of pool objects, the config fingerprint, and DP endpoints.

    KeySpace.create(...)      model identity + config fingerprint for one engine
                              configuration (everything that changes KV bytes
                              or the hash chain goes into the fingerprint), in
                              one tenant's space (``tenant``; empty: none)
    check_tenant(name)        a tenant name as given, or ``LayoutError`` saying
                              what a name may hold
    KeySpace.key(c, h)        the key of shard ``c`` (a layout.ContentId) for
                              chunk hash ``h``
    KeySpace.template(c)      that key without the hash: ``key(c, h)`` is
                              ``template(c) + h.hex()``
    parse_key(s)              the inverse of ``key``; ``format(parse_key(s)) == s``
    KeySpace.prefix           the prefix every key of this space starts with
    dp_index_of(cfg)          an engine's DP identity from vLLM's parallel config
    default_instance(space)   the lookup endpoint's name where the setting leaves it
                              empty: the fingerprint's start, and the tenant's
    lookup_endpoint(...)      the lookup socket of one DP engine of one server
    lookup_endpoints(...)     every socket such an engine may take, first choice
                              first (several servers of one config on one host)

A key reads, left to right (``/`` separated)::

    kvpool/<schema>/<model>/<fingerprint>/g<group>.h<head>.d<dcp>.c<pcp>.b<band>/<hash hex>

and in a tenant's space ``kvpool/<schema>/!<tenant>/<model>/...``: engines of
different tenants never name one object alike, whatever their prompts and models.
(A quoted model never begins with ``!``, so the two forms cannot collide.)

The model is its full name or path (percent-quoted where needed, ``/`` kept),
so ``org-a/llama`` and ``org-b/llama`` never collide. Two configurations that
differ in any byte-changing field have different fingerprints, hence disjoint
keys: a bf16 and an fp32 engine of one model sharing a pool just miss.

The TP size is not in the fingerprint: a shard is named by its global KV head
(``layout``), so engines at TP1, TP2 and TP8 of one model read each other's
objects. The exception is a model with a mamba group, whose state slices depend
on tp: its fingerprint keeps tp. Neither is the PP size: a shard holds one
layer band, and the fingerprint holds the band grid, so engines at PP1 and PP2
with one grid share objects. Nor is the DCP size: a shard holds one token class
of a grid of ``token_classes`` (``layout``), which the fingerprint holds with the
interleave, so engines at DCP1 and DCP2 with one grid share objects. Nor is the PCP
size (PCP ranks hold replicas), but for mamba groups. ``heads_per_object`` (how
many KV heads a shard holds) is in it. Nor are vLLM's hash settings: a chunk
is named by kvpool's own hash chain over its tokens (``chunkhash``), whose name
and the chunk size are in it. (The vLLM identity adds the block size and the
attention kernel's layout: an object holds whole blocks in the kernel's byte
order.) Schemas 1 (rank slots), 2 (one object per PP stage) and 3 (chunks named
by vLLM's block hashes) are never probed (a miss), so old pools are harmless.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote, unquote

from kvpool.errors import KeyFormatError, LayoutError
from kvpool.layout import ContentId, GroupKind, Layout

__all__ = [
    "CHUNK_HASH",
    "OBJECT_FORMAT",
    "ROOT_PREFIX",
    "SCHEMA_VERSION",
    "KeySpace",
    "ParsedKey",
    "check_tenant",
    "default_instance",
    "dp_index_of",
    "lookup_endpoint",
    "lookup_endpoints",
    "parse_key",
]

# 2: shards named by global KV head, tp left out of the fingerprint; 3: a shard
# holds one layer band (``.b``), the band grid in the fingerprint instead of pp;
# 4: chunks named by kvpool's own hash chain (``chunkhash``), not vLLM's block hashes
SCHEMA_VERSION = 4
# How chunks are named (``kvpool.chunkhash``), in every fingerprint.
CHUNK_HASH = "kvpool-sha256-1"
# The format of stored objects (``kvpool.header.FORMAT_VERSION``). It is part of
# every fingerprint, so engines of different formats use different keys: an object
# of another format is a miss, never read (and removed) as corrupt. 3: the header
# carries the time the object was written (``kvpool status``, ``purge --older-than``).
OBJECT_FORMAT = 3
_ROOT = "kvpool"
ROOT_PREFIX = _ROOT + "/"  # every kvpool key starts so, whatever its schema
_FP_HEX = 16  # 64 bits of sha256 over the canonical config
_SAFE = "/:@._-+=~,"
_NUM = r"([0-9]{1,18})"  # bounded: int() refuses strings of over 4300 digits
_NUM_RE = re.compile(_NUM)
_CONTENT_RE = re.compile(rf"g{_NUM}\.h{_NUM}\.d{_NUM}\.c{_NUM}\.b{_NUM}")
_HEX_RE = re.compile(r"[0-9a-f]+")
_FP_RE = re.compile(rf"[0-9a-f]{{{_FP_HEX}}}")
# Also a valid Mooncake tenant name (no leading '_'), so one name can serve both.
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_TENANT_MARK = "!"  # quote() escapes '!' in a model name: only a tenant part starts so


def check_tenant(name: str) -> str:
    """``name`` if it may name a tenant, else ``LayoutError`` saying what may."""
    if not isinstance(name, str) or not _TENANT_RE.fullmatch(name):
        raise LayoutError(
            f"tenant name {name!r} must be 1-64 letters, digits, '_', '.' or '-', "
            "beginning with a letter or digit"
        )
    return name


def _tenant_part(tenant: str) -> str:
    return f"{_TENANT_MARK}{tenant}/" if tenant else ""


def _hash_hex(chunk_hash: bytes | str) -> str:
    if isinstance(chunk_hash, bytes | bytearray):
        if not chunk_hash:
            raise KeyFormatError("chunk hash is empty")
        return bytes(chunk_hash).hex()
    h = chunk_hash.lower()
    if not _HEX_RE.fullmatch(h):
        raise KeyFormatError(f"chunk hash must be bytes or lowercase hex, got {chunk_hash!r}")
    return h


def _content_part(c: ContentId) -> str:
    return f"g{c.group}.h{c.head}.d{c.dcp_rank}.c{c.pcp_rank}.b{c.band}"


@dataclass(frozen=True, slots=True)
class ParsedKey:
    """The parts of one key. ``str(k)`` formats it back exactly."""

    model: str
    fingerprint: str
    content: ContentId
    chunk_hash: str  # lowercase hex
    schema: int = SCHEMA_VERSION
    tenant: str = ""  # empty: no tenant

    def __str__(self) -> str:
        return (
            f"{_ROOT}/{self.schema}/{_tenant_part(self.tenant)}"
            f"{quote(self.model, safe=_SAFE)}/{self.fingerprint}/"
            f"{_content_part(self.content)}/{self.chunk_hash}"
        )


def parse_key(key: str) -> ParsedKey:
    """Parse a key made by ``KeySpace.key``; raise ``KeyFormatError`` otherwise."""
    if not key.isascii():  # a key percent-quotes its model, so it is always ASCII
        raise KeyFormatError(f"kvpool keys are ASCII; not a kvpool key: {key!r}")
    head = key.split("/", 2)
    if len(head) != 3 or head[0] != _ROOT:
        raise KeyFormatError(f"not a kvpool key (must start with '{_ROOT}/'): {key!r}")
    if not _NUM_RE.fullmatch(head[1]):
        raise KeyFormatError(f"bad schema version {head[1]!r} in {key!r}")
    rest, tenant = head[2], ""
    if rest.startswith(_TENANT_MARK):
        tenant, _, rest = rest[1:].partition("/")
        if not _TENANT_RE.fullmatch(tenant):
            raise KeyFormatError(f"bad tenant {tenant!r} in {key!r}")
    tail = rest.rsplit("/", 3)
    if len(tail) != 4 or not tail[0]:
        raise KeyFormatError(f"kvpool key has too few parts: {key!r}")
    model_q, fp, content_s, h = tail
    m = _CONTENT_RE.fullmatch(content_s)
    if not _FP_RE.fullmatch(fp) or m is None or not _HEX_RE.fullmatch(h):
        raise KeyFormatError(f"malformed fingerprint, content or hash in {key!r}")
    g, slot, d, c, b = (int(x) for x in m.groups())
    content = ContentId(slot, d, c, b, g)
    parsed = ParsedKey(unquote(model_q), fp, content, h, int(head[1]), tenant)
    if str(parsed) != key:  # non-canonical spellings (e.g. leading zeros) are refused
        raise KeyFormatError(f"kvpool key is not in canonical form: {key!r}")
    return parsed


@dataclass(frozen=True, slots=True)
class KeySpace:
    """The model identity and config fingerprint shared by all keys of one config.

    ``config`` holds the canonical, JSON-able fields the fingerprint was taken of,
    so logs and ``kvpool status`` can say what a namespace is.
    """

    model: str
    fingerprint: str
    config: Mapping[str, Any] = field(compare=False, hash=False, default_factory=dict)
    tenant: str = ""  # empty: no tenant

    @classmethod
    def create(
        cls,
        *,
        model: str,
        layout: Layout,
        kv_dtype: str,
        model_dtype: str,
        chunk_size: int,
        head_size: int,
        num_layers: int,
        extra: Mapping[str, str | int] | None = None,
        tenant: str = "",
    ) -> KeySpace:
        """Fingerprint everything that changes KV bytes or the hash chain.

        ``extra`` takes further byte-changing fields (a weights revision, a
        quantisation scheme); each changes the fingerprint. ``tenant`` is not in
        the fingerprint: it is a part of every key of its own (``check_tenant``).
        """
        if tenant:
            check_tenant(tenant)
        if not model:
            raise LayoutError("model name must not be empty")
        try:
            model.encode()
        except UnicodeEncodeError:  # e.g. a path's undecodable bytes (surrogates)
            raise LayoutError(f"model name {model!r} is not valid Unicode text") from None
        for name, v in (("chunk_size", chunk_size), ("head_size", head_size)):
            if not isinstance(v, int) or v < 1:
                raise LayoutError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(num_layers, int) or num_layers < 0:
            raise LayoutError(f"num_layers must be a non-negative integer, got {num_layers!r}")
        config: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "object_format": OBJECT_FORMAT,
            "model": model,
            "kv_dtype": str(kv_dtype),
            "model_dtype": str(model_dtype),
            "chunk_size": chunk_size,
            "head_size": head_size,
            "num_layers": num_layers,
            "layer_bands": list(layout.bands),  # edges, 0 .. layers
            "heads_per_object": layout.heads_per_object,
            "token_classes": layout.token_classes,  # DCP's token grid, not its size
            "interleave": layout.interleave,
            "groups": [str(g) for g in layout.groups],
            "chunk_hash": CHUNK_HASH,
            "extra": {k: extra[k] for k in sorted(extra)} if extra else {},
        }
        if any(g.kind is GroupKind.MAMBA for g in layout.groups):
            config["tp"] = layout.tp  # a state slice's bytes depend on tp
            config["dcp"] = layout.dcp  # and its shards (one per DCP rank) on dcp
            config["pcp"] = layout.pcp  # and on pcp
        blob = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
        return cls(model, hashlib.sha256(blob).hexdigest()[:_FP_HEX], config, tenant)

    @property
    def prefix(self) -> str:
        """Every key of this space starts with this string."""
        return (
            f"{_ROOT}/{SCHEMA_VERSION}/{_tenant_part(self.tenant)}"
            f"{quote(self.model, safe=_SAFE)}/{self.fingerprint}/"
        )

    def key(self, content: ContentId, chunk_hash: bytes | str) -> str:
        """The key of ``content``'s object for the chunk whose hash is ``chunk_hash``."""
        return self.template(content) + _hash_hex(chunk_hash)

    def template(self, content: ContentId) -> str:
        """``content``'s keys without the chunk hash: ``key(content, h)`` is this
        followed by ``h``'s lowercase hex (what a lookup of thousands of keys
        appends, instead of formatting each key whole)."""
        return f"{self.prefix}{_content_part(content)}/"


class _ParallelConfig(Protocol):
    data_parallel_index: int


def dp_index_of(parallel_config: _ParallelConfig | Any) -> int:
    """The engine's DP identity: vLLM's global ``data_parallel_index``.

    Not ``data_parallel_rank_local``: launch paths such as headless wide-TP
    followers never fill it, and it is node-relative (0 on the head node, N on
    a follower of replica N). Not ``data_parallel_rank``: dense-model DP resets
    it to 0. ``data_parallel_index`` is filled on every launch path and equal on
    all nodes of one replica.
    """
    index = getattr(parallel_config, "data_parallel_index", None)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise LayoutError(
            f"parallel_config.data_parallel_index must be a non-negative integer, got {index!r}; "
            "kvpool needs vLLM's global DP index to name the engine"
        )
    return index


_INSTANCE_RE = re.compile(r"[A-Za-z0-9_.-]{1,40}")


def default_instance(space: KeySpace) -> str:
    """The lookup endpoint's name of an engine whose ``instance`` setting is empty:
    the fingerprint's first 12 digits, and a digest of the tenant, so engines of one
    model and config in two tenants on one host get two endpoints."""
    name = space.fingerprint[:12]
    if space.tenant:
        name += "-" + hashlib.sha256(space.tenant.encode()).hexdigest()[:8]
    return name


# Servers of one model and config on one host: each DP engine takes the first of
# this many endpoints that no live server holds (``lookup_endpoints``).
SERVERS_PER_HOST = 64


def lookup_endpoint(run_dir: str, instance: str, dp_index: int, server: int = 0) -> str:
    """The IPC endpoint of DP engine ``dp_index``'s lookup server, in the
    ``server``-th server of this config on this host (0: the first to start).

    Derived from the global DP index, so it is distinct for every DP engine of a
    server and the same on every node of one replica. The host name is not part
    of it: an IPC socket is local to its host already. ``server`` tells apart
    several ``vllm serve`` processes of one config on one host (one per GPU, a
    blue/green restart): none of them is named by a setting.
    """
    if not _INSTANCE_RE.fullmatch(instance):
        raise LayoutError(
            f"instance name {instance!r} must be 1-40 characters of letters, digits, '_', '.', '-'"
        )
    if isinstance(dp_index, bool) or not isinstance(dp_index, int) or dp_index < 0:
        raise LayoutError(f"dp_index must be a non-negative integer, got {dp_index!r}")
    if (
        isinstance(server, bool)
        or not isinstance(server, int)
        or not 0 <= server < SERVERS_PER_HOST
    ):
        raise LayoutError(f"server must be an integer in 0..{SERVERS_PER_HOST - 1}, got {server!r}")
    slot = f"-s{server}" if server else ""
    return f"ipc://{run_dir.rstrip('/')}/kvpool-lookup-{instance}-dp{dp_index}{slot}.sock"


def lookup_endpoints(run_dir: str, instance: str, dp_index: int) -> list[str]:
    """Every endpoint DP engine ``dp_index`` of a server may take, in the order it
    tries them: it serves on the first that no live server holds."""
    return [lookup_endpoint(run_dir, instance, dp_index, n) for n in range(SERVERS_PER_HOST)]

"""KV-cache group kinds of a model, and what each needs of a cache hit.

    GroupKind                 mha, gqa, mla or mamba: how a group's bytes are
                              spread over TP ranks
    GroupSpec.parse(text)     ``gqa:8``, ``mla``, ``gqa:8:w4096`` (a sliding
                              window), ``mamba``; ``str()`` is the inverse
    GroupSpec.heads(tp, r)    the shards TP rank r holds (KV heads, the latent,
                              or its state slice)
    GroupSpec.replication(tp) how many TP ranks hold each of them
    GroupSpec.needed_chunks   the chunks a hit needs (a window: only its own; a
                              Mamba state: the hit's last chunk)
    GroupSpec.every_chunk     whether a hit needs every chunk (full attention)

Pure. ``kvpool.layout`` builds a whole engine's layout from these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpool.errors import LayoutError

__all__ = ["HEADED", "GroupKind", "GroupSpec"]


class GroupKind(enum.StrEnum):
    """How a KV-cache group's bytes are spread over TP ranks."""

    MHA = "mha"  # one KV head per attention head; kv_heads = attention heads
    GQA = "gqa"  # kv_heads shared by groups of attention heads
    MLA = "mla"  # one compressed latent, replicated on every TP rank
    MAMBA = "mamba"  # recurrent state sharded by TP, never replicated


HEADED = (GroupKind.MHA, GroupKind.GQA)  # kinds whose shards are KV heads


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV-cache group of the model.

    ``kv_heads`` is the model's total number of KV heads (all TP ranks together)
    for mha/gqa, and 0 for mla and mamba, where it has no meaning. ``window`` is
    a sliding-window group's window in tokens (0: full attention); it changes
    which chunks a hit needs (``needed_chunks``), never who holds or writes what.
    """

    kind: GroupKind
    kv_heads: int = 0
    window: int = 0

    @classmethod
    def parse(cls, text: str) -> GroupSpec:
        """Parse ``mla``, ``mamba``, ``gqa:8`` or ``mha:32``, each attention kind
        optionally with a sliding window: ``gqa:8:w4096``, ``mla:w128``."""
        parts = text.strip().lower().split(":")
        window = 0
        if len(parts) > 1 and parts[-1].startswith("w"):
            try:
                window = int(parts[-1][1:])
            except ValueError:
                raise LayoutError(
                    f"a sliding window in {text!r} is 'w' and a token count, e.g. 'gqa:8:w4096'"
                ) from None
            if window < 1:
                raise LayoutError(f"a sliding window must be >= 1 token, got {text!r}")
            parts.pop()
        name, heads = parts[0], ":".join(parts[1:])
        try:
            kind = GroupKind(name)
        except ValueError:
            kinds = ", ".join(k.value for k in GroupKind)
            raise LayoutError(
                f"unknown KV group kind {name!r} in {text!r}; use one of {kinds}"
            ) from None
        if window and kind is GroupKind.MAMBA:
            raise LayoutError(f"mamba has no sliding window; write 'mamba', not {text!r}")
        if kind in HEADED:
            if not heads:
                raise LayoutError(f"{kind.value} needs its total KV heads, e.g. '{kind.value}:8'")
            try:
                n = int(heads)
            except ValueError:
                raise LayoutError(
                    f"KV heads in {text!r} must be an integer, e.g. 'gqa:8'"
                ) from None
            return cls(kind, n, window)
        if heads:
            raise LayoutError(f"{kind.value} takes no head count; write '{kind.value}'")
        return cls(kind, 0, window)

    def __str__(self) -> str:
        base = f"{self.kind.value}:{self.kv_heads}" if self.kind in HEADED else self.kind.value
        return f"{base}:w{self.window}" if self.window else base

    @property
    def every_chunk(self) -> bool:
        """Whether a hit needs every chunk before it of this group (full attention),
        not only a few (``needed_chunks``)."""
        return not self.window and self.kind is not GroupKind.MAMBA

    def needed_chunks(self, hit_chunks: int, chunk_size: int) -> range:
        """The chunks a hit of ``hit_chunks`` chunks needs of this group: all of them
        for full attention; for a sliding window, those holding the last
        ``window - 1`` tokens before the hit (what the next token attends to); for
        Mamba, the last chunk's object: the recurrent state after the hit's tokens
        (the state after any token holds all that came before it)."""
        if self.kind is GroupKind.MAMBA:
            return range(hit_chunks - 1, hit_chunks) if hit_chunks else range(0)
        if not self.window or hit_chunks == 0:
            return range(hit_chunks)
        first_token = max(0, hit_chunks * chunk_size - (self.window - 1))
        return range(first_token // chunk_size, hit_chunks)

    def replication(self, tp: int) -> int:
        """How many TP ranks hold each distinct slice of this group (1 = none)."""
        if self.kind is GroupKind.MLA:
            return tp
        if self.kind is GroupKind.MAMBA:
            return 1
        return max(1, tp // self.kv_heads)

    def heads(self, tp: int, tp_rank: int) -> range:
        """The shards TP rank ``tp_rank`` holds of this group, in its local order:
        global KV-head indices for mha/gqa, ``0`` (the latent) for mla and the
        rank's own state slice for mamba."""
        if self.kind is GroupKind.MLA:
            return range(1)
        if self.kind is GroupKind.MAMBA:
            return range(tp_rank, tp_rank + 1)
        if self.kv_heads >= tp:
            per = self.kv_heads // tp
            return range(tp_rank * per, (tp_rank + 1) * per)
        first = tp_rank // self.replication(tp)
        return range(first, first + 1)

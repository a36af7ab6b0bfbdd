"""Which objects make a chunk, which must be present for a hit, and where a hit may end.

    ChunkObjects.of(layout, space)  the objects of one chunk of this layout: one per
                                    distinct content of every group, in probe order
    objects.contents / templates    those contents and their keys without the hash
    objects.keys(h)                 the keys of the chunk whose hash is ``h``
    objects.full                    templates of groups a hit needs at every chunk
    objects.windowed                (template, group) of sliding-window groups: only
                                    the chunks of their window before the hit
    objects.states                  templates of Mamba groups: only the hit's last chunk
    objects.classes                 the full-attention templates by slice class
                                    (group, token class, PCP rank, band), heads in order
    countable_chunks(num_tokens, chunk_size, chunks)
                                    how many chunks of a prompt a hit may span: whole
                                    chunks only, never the prompt's last token

A hit of ``k`` chunks needs, of every group, the objects of
``GroupSpec.needed_chunks(k, chunk_size)``; every rank reads exactly the
contents here (``Layout.holdings``). The lookup server, ``kvpool plan`` and the
scheduler take these rules from here. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.groups import GroupKind, GroupSpec
from kvpool.keys import KeySpace
from kvpool.layout import ContentId, Layout

__all__ = ["ChunkObjects", "countable_chunks"]


def countable_chunks(num_tokens: int, chunk_size: int, chunks: int) -> int:
    """The chunks of a ``num_tokens`` prompt (``chunks`` hashed) a hit may span:
    whole chunks, and never the last token, which vLLM must compute."""
    return max(0, min(chunks, max(num_tokens - 1, 0) // chunk_size))


@dataclass(frozen=True, slots=True)
class ChunkObjects:
    """See the module docstring."""

    contents: tuple[ContentId, ...]
    templates: tuple[str, ...]
    specs: tuple[GroupSpec, ...]  # each content's group

    @classmethod
    def of(cls, layout: Layout, space: KeySpace) -> ChunkObjects:
        contents = tuple(c for g in range(len(layout.groups)) for c in layout.contents(g))
        return cls(
            contents,
            tuple(space.template(c) for c in contents),
            tuple(layout.groups[c.group] for c in contents),
        )

    def keys(self, chunk_hash: bytes) -> tuple[str, ...]:
        h = chunk_hash.hex()
        return tuple(t + h for t in self.templates)

    @property
    def full(self) -> tuple[str, ...]:
        return tuple(t for t, s in zip(self.templates, self.specs, strict=True) if s.every_chunk)

    @property
    def windowed(self) -> tuple[tuple[str, GroupSpec], ...]:
        return tuple((t, s) for t, s in zip(self.templates, self.specs, strict=True) if s.window)

    @property
    def states(self) -> tuple[str, ...]:
        return tuple(
            t for t, s in zip(self.templates, self.specs, strict=True) if s.kind is GroupKind.MAMBA
        )

    @property
    def classes(self) -> tuple[tuple[str, ...], ...]:
        by_class: dict[tuple[int, int, int, int], list[str]] = {}
        for t, c, s in zip(self.templates, self.contents, self.specs, strict=True):
            if s.every_chunk:
                by_class.setdefault((c.group, c.dcp_rank, c.pcp_rank, c.band), []).append(t)
        return tuple(tuple(ts) for ts in by_class.values())

"""Moves KV tensors into memory that the store can reach, for zero-copy transfers.

    place_kv(groups, alloc) -> bytes moved

Mooncake's same-host shared-memory client moves bytes only between the holder
and memory it handed out itself (``KVStore.alloc_staging``). KV tensors placed
in such memory can be put and got without a staging copy (see
``TransferEngine(zero_copy=True)``).

``place_kv`` gives every distinct storage under ``groups`` a new home from
``alloc(nbytes)`` (a uint8 array), copies the bytes over, and re-points every
tensor on it with ``Tensor.set_``: the tensor objects stay the same, so every
holder of a reference (vLLM's attention layers, the runner's list) sees the new
memory. Views of a storage that are not passed in keep the old memory: pass
every tensor that shares it. Call it before the tensors are used, once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["place_kv"]

logger = logging.getLogger(__name__)


def place_kv(
    groups: Sequence[Sequence[tuple[str, torch.Tensor]]],
    alloc: Callable[[int], npt.NDArray[np.uint8]],
) -> int:
    """Re-home the storages of ``groups``' tensors in ``alloc``'d memory; bytes moved.

    Raises ``ValueError`` for a tensor that is not on the CPU (nothing is moved then).
    """
    by_storage: dict[int, list[torch.Tensor]] = {}
    for layers in groups:
        for name, t in layers:
            if t.device.type != "cpu":
                raise ValueError(f"KV tensor {name} is on {t.device}; only CPU tensors can move")
            by_storage.setdefault(int(t.untyped_storage().data_ptr()), []).append(t)
    moved = 0
    for tensors in by_storage.values():
        old = tensors[0].untyped_storage()
        nbytes = old.nbytes()
        home = torch.from_numpy(alloc(nbytes))
        was = torch.empty(0, dtype=torch.uint8)
        was.set_(old, 0, (nbytes,))  # type: ignore[call-overload]
        home.copy_(was)
        new = home.untyped_storage()
        for t in {id(t): t for t in tensors}.values():
            with torch.no_grad():
                t.set_(new, t.storage_offset(), t.size(), t.stride())
        moved += nbytes
    logger.info("kvpool: KV cache placed in pool memory (%.1f MiB)", moved / 2**20)
    return moved

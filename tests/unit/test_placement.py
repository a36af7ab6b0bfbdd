"""place_kv: KV tensors re-homed in store memory keep their bytes and identity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.placement import place_kv


def test_views_of_one_storage_move_together_and_keep_their_bytes() -> None:
    base = torch.arange(96, dtype=torch.float32)
    a, b = base[:48].view(2, 24), base[48:].view(4, 12)
    other = torch.arange(10, dtype=torch.int16)
    before = [a.clone(), b.clone(), other.clone()]
    homes: list[np.ndarray] = []

    def alloc(n: int) -> np.ndarray:
        homes.append(np.zeros(n, dtype=np.uint8))
        return homes[-1]

    ids = [id(a), id(b), id(other)]
    assert place_kv([[("a", a), ("b", b)], [("o", other)]], alloc) == 96 * 4 + 10 * 2
    assert [id(a), id(b), id(other)] == ids  # the same tensor objects, re-pointed
    assert len(homes) == 2  # one new home per distinct storage
    assert a.data_ptr() == homes[0].ctypes.data and b.data_ptr() == a.data_ptr() + 48 * 4
    assert other.data_ptr() == homes[1].ctypes.data
    for t, old in zip((a, b, other), before, strict=True):
        assert torch.equal(t, old)
    a.fill_(1.0)  # writes land in the new home, the old storage is left behind
    assert np.frombuffer(homes[0][: 48 * 4].tobytes(), dtype=np.float32).tolist() == [1.0] * 48
    assert base[0].item() == 0.0


def test_tensors_off_the_cpu_are_refused_before_anything_moves() -> None:
    cpu = torch.zeros(4)
    meta = torch.empty(4, device="meta")
    ptr = cpu.data_ptr()
    with pytest.raises(ValueError, match="KV tensor m is on meta"):
        place_kv([[("c", cpu), ("m", meta)]], lambda n: np.zeros(n, dtype=np.uint8))
    assert cpu.data_ptr() == ptr

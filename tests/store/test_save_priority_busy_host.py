"""Saves on a host with no idle CPU: SCHED_IDLE save threads are raised, and land.

Every core runs a spinning process at normal priority, so a save thread under
SCHED_IDLE gets almost no CPU time. The save must still land, because the
watchdog raises the save threads once the save has been queued for ``STARVE_S``
with none finished; and it must have done so (``raised``), which is what a
machine with idle time would never show.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from kvpool.store.memory import MemoryStore
from kvpool.transfer import ChunkRef, TransferEngine

BLOCKS, TOKENS, WIDTH = 256, 32, 1024  # 32 MiB per layer of float32, K and V


@pytest.fixture
def busy_host() -> Iterator[None]:
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_save_on_a_host_with_no_idle_cpu_lands_once_its_threads_are_raised(
    busy_host: None,
) -> None:
    per = BLOCKS * 2 * TOKENS * WIDTH
    cache = torch.rand(2 * per, dtype=torch.float32)
    layers = [(f"l{i}", cache[i * per : (i + 1) * per].view(BLOCKS, 2, TOKENS, WIDTH))
              for i in range(2)]  # fmt: skip
    store = MemoryStore(capacity=1 << 30)
    engine = TransferEngine(store, [layers], BLOCKS, staging_bytes=64 << 20,
                            deferred_saves=True, save_priority="idle")  # fmt: skip
    try:
        chunks = [ChunkRef(f"k{b}", 0, b, (b,)) for b in range(BLOCKS)]
        engine.submit_save("busy", chunks)
        (result,) = engine.wait(["busy"], timeout=120)
        assert result.ok, result
        assert len(store.keys()) == BLOCKS
        assert engine._save_threads.raised >= 1
    finally:
        engine.close()
        store.close()

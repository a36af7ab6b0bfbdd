"""What save_priority costs on a host with no idle CPU (the figure in README.md).

    .venv/bin/python scripts/save_priority_stall.py [idle|normal ...]

A spinning process runs on every core at normal priority. Beside them, a transfer
engine over a memory store saves 64 MiB three times (deferred saves, as a worker's)
while this process's main thread loops over a little Python work, as an engine's
steps do. It prints, per mode, how long the saves took and the gaps between the
main thread's loops (median, p99, max): a save thread under SCHED_IDLE that is
starved while it holds Python's GIL stalls the main thread until the kernel gives
it a slice.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from kvpool.store.memory import MemoryStore
from kvpool.transfer import ChunkRef, TransferEngine

BLOCKS, TOKENS, WIDTH = 256, 32, 1024  # 32 MiB per layer of float32, K and V


def run(mode: str) -> str:
    per = BLOCKS * 2 * TOKENS * WIDTH
    cache = torch.rand(2 * per, dtype=torch.float32)
    layers = [(f"l{i}", cache[i * per : (i + 1) * per].view(BLOCKS, 2, TOKENS, WIDTH))
              for i in range(2)]  # fmt: skip
    store = MemoryStore(capacity=4 << 30)
    engine = TransferEngine(store, [layers], BLOCKS, staging_bytes=64 << 20,
                            deferred_saves=True, save_priority=mode)  # type: ignore[arg-type]
    gaps: list[float] = []
    t0 = time.monotonic()
    for r in range(3):
        engine.submit_save(f"j{r}", [ChunkRef(f"k{r}-{b}", 0, b, (b,)) for b in range(BLOCKS)])
        last = time.perf_counter()
        while True:
            sum(range(2000))  # a little Python work, as in an engine step
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            if engine.wait([f"j{r}"], timeout=0.001):
                break
    took = time.monotonic() - t0
    raised = engine._save_threads.raised
    engine.close()
    store.close()
    gaps.sort()
    return (f"{mode:6}  saves {took:5.2f} s  main-thread gaps: p50 {gaps[len(gaps) // 2] * 1e3:.1f} ms"
            f"  p99 {gaps[int(len(gaps) * 0.99)] * 1e3:.1f} ms  max {gaps[-1] * 1e3:.0f} ms"
            f"  (save threads raised {raised} times)")  # fmt: skip


def main() -> None:
    modes = sys.argv[1:] or ["normal", "idle"]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)]  # fmt: skip
    try:
        for mode in modes:
            print(run(mode), flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


if __name__ == "__main__":
    main()

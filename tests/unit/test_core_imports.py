"""The core imports nothing heavy: no torch, zmq, mooncake, vllm, click or rich."""

from __future__ import annotations

import subprocess
import sys


def test_core_modules_import_no_heavy_packages() -> None:
    code = (
        "import sys, kvpool, kvpool.layout, kvpool.keys, kvpool.plan, kvpool.chunks, "
        "kvpool.chunkhash, kvpool.header, kvpool.config, kvpool.errors, kvpool.lookup.search, "
        "kvpool.pool.ages\n"
        "heavy = {'torch', 'zmq', 'mooncake', 'vllm', 'click', 'rich'} & set(sys.modules)\n"
        "print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

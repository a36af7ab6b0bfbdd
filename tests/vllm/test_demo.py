"""``kvpool demo``, the main job, at a small size: it passes only when every request
of the fresh engine hit the pool and answered exactly like a local hit."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.demo.run import run_demo
from kvpool.demo.shapes import parse_shape


@pytest.mark.parametrize("shape", [None, "4x4x64:bfloat16"], ids=["float32", "bfloat16"])
def test_the_demo_passes_on_pool_hits_that_answer_like_local_hits(
    tmp_path: Path, shape: str | None
) -> None:
    report = run_demo(
        tmp_path,
        conversations=2,
        turns=2,
        system_tokens=64,
        document_tokens=256,
        user_tokens=40,
        shape=parse_shape(shape) if shape else None,
    )
    assert report.passed, report.rows
    for row in report.rows:  # every measured request: a pool hit of whole chunks
        assert row.warm_cached == (row.prompt_tokens - 1) // 32 * 32, row
        assert row.identical and row.local_ttft_s > 0
    assert report.warm.get("hit_tokens") == report.warm_hit_tokens
    assert "error" not in report.warm and "error" not in report.cold

"""``kvpool bench vllm`` end to end on a small shape: both connectors, fair cold runs."""

from __future__ import annotations

from pathlib import Path


def test_both_connectors_save_everything_and_warm_engines_hit_it(tmp_path: Path) -> None:
    from kvpool.bench.engines import run_engine_bench
    from kvpool.demo.shapes import parse_shape

    shape = parse_shape("2x2x64:float32")
    result = run_engine_bench(tmp_path, shape=shape, lengths=(300, 340))
    assert [r.name for r in result.runs] == ["kvpool", "mooncake"]
    assert all(p > 0 for p in result.prefill_s) and all(h > 0 for h in result.local_hit_s)
    # The prompts, chunk by chunk (the warm-up prompt, shorter than a block, is not).
    chunks = 300 // 32 + 340 // 32
    for run in result.runs:
        # Each cold engine stayed up until its saves were in the pool, so each warm
        # engine can find every full chunk but the last token's (never loaded).
        # kvpool stores one object per KV head (2 here), the in-tree connector one
        # per rank.
        assert run.keys_stored == chunks * (2 if run.name == "kvpool" else 1), run
        assert run.identical, run
        assert run.saves_complete and run.saves_landed >= run.saves_expected == run.keys_stored
        assert all(r.warm_ttft_s > 0 and r.cold_ttft_s > 0 for r in run.rows)
        if run.name == "kvpool":
            assert [r.hit_tokens for r in run.rows] == [288, 320], run
            assert all(r.hit_rate == 1.0 for r in run.rows)
            assert all(result.verdict(run, i).endswith("x") for i in range(2))
        else:
            # vLLM's in-tree connector at times finds nothing for one of the two
            # prompts although every key is stored (CI, twice: 320 of 608 tokens);
            # the bench reports what it finds: "no hits" there, never a speed-up.
            assert run.warm_hit_tokens > 0, run
            for i, row in enumerate(run.rows):
                if row.hit_tokens == 0:
                    assert result.verdict(run, i) == "no hits"

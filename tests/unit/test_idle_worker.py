"""The worker half that could not start, and a step's results for vLLM
(``kvpool.connector.results``)."""

from __future__ import annotations

from tests.unit.test_worker import ops

from kvpool.connector.results import IdleWorker, StepResults, step_results
from kvpool.connector.steps import StepPlan


def test_an_idle_worker_fails_each_planned_load_and_its_blocks_and_releases_at_once() -> None:
    idle = IdleWorker(groups=1)
    plan = StepPlan(loads=[ops("a", [4, 5]), ops("b", [9])], finishing=frozenset({"f"}))
    assert idle.results(plan) == StepResults({"f"}, {"a", "b"}, {"a", "b"})
    assert idle.load_errors() == {4, 5, 9}
    assert idle.load_errors() == set()  # each block reported once
    assert idle.results(None) == StepResults(set(), set(), set())
    assert idle.saves_in_flight == 0 and idle.engine is None and idle.worker_meta() is None


def test_with_several_kv_groups_failures_go_by_request_only() -> None:
    idle = IdleWorker(groups=2)
    assert idle.results(StepPlan(loads=[ops("a", [4])])) == StepResults(set(), {"a"}, {"a"})
    assert idle.load_errors() == set()


class _Finishes:
    """A worker's two calls that ``step_results`` makes, recorded."""

    def __init__(self) -> None:
        self.idle: list[bool] = []

    def finished(self, idle: bool = False) -> tuple[set[str], set[str]]:
        self.idle.append(idle)
        return {"a", "b"}, {"b"}

    def released(self) -> set[str]:
        return {"f"}


def test_a_workers_step_results_wait_only_in_an_idle_step_and_fail_by_request_with_groups() -> None:
    w = _Finishes()
    assert step_results(w, StepPlan(idle=True), groups=1) == StepResults({"f"}, {"a", "b"}, set())
    assert step_results(w, StepPlan(), groups=2) == StepResults({"f"}, {"a", "b"}, {"b"})
    assert step_results(w, None, groups=1).recving == {"a", "b"}
    assert w.idle == [True, False, False]

"""What a worker tells vLLM at the end of each step, and the worker that could not start.

    StepResults              (finished sending, finished receiving, failed receiving)
                             request ids of one step, as vLLM's transfer results
    step_results(worker, plan, groups)
                             a ``Worker``'s: its finished loads and released requests
    IdleWorker(groups)       the worker half of a connector whose set-up failed on
                             this rank where the scheduler's did not (the pool not
                             reachable from here, ...): it moves nothing, yet answers
                             for what the scheduler planned: each planned load ends
                             failed (by request; with one KV group its blocks too,
                             reported once), each
                             finishing request is released at once, so no request
                             waits on this rank for ever

Several KV groups (a hybrid model): a block id does not say which group's block
failed, so failures are reported per request (``failed``) and no block ids;
with one group, by block id only (``load_errors``), as vLLM recomputes just those.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from kvpool.connector.steps import StepPlan, WorkerReport
from kvpool.transfer import TransferStats

__all__ = ["IdleWorker", "StepResults", "step_results"]


class StepResults(NamedTuple):
    sending: set[str]  # finished requests whose saves are done: vLLM frees their blocks
    recving: set[str]  # requests whose load ended, failed or not
    failed: set[str]  # of those, failed (only with several KV groups, see above)


class _Finishing(Protocol):
    def finished(self, idle: bool = False) -> tuple[set[str], set[str]]: ...

    def released(self) -> set[str]: ...


def step_results(worker: _Finishing, plan: StepPlan | None, groups: int) -> StepResults:
    """``worker``'s results of the step that ran ``plan`` (None: no plan bound);
    ``groups``: the engine's KV groups."""
    done, failed = worker.finished(idle=plan is not None and plan.idle)
    return StepResults(worker.released(), done, failed if groups > 1 else set())


class IdleWorker:
    """See the module docstring. The same calls as ``Worker`` where a connector
    makes them; each does nothing but ``results`` and ``load_errors``."""

    engine = None  # no transfer engine: nothing in flight
    saves_in_flight = 0

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self._errors: set[int] = set()

    def results(self, plan: StepPlan | None) -> StepResults:
        """Every load of ``plan`` failed (by request), every finishing request released."""
        if plan is None:
            return StepResults(set(), set(), set())
        loads = {ops.req_id for ops in plan.loads}
        if self.groups == 1:
            self._errors.update(
                b for ops in plan.loads for c in ops.chunks for ids in c.block_ids for b in ids
            )
        # Failed by request as well (with one group too): vLLM then recomputes each
        # such request from its start, as the connector did before this class.
        return StepResults(set(plan.finishing), loads, loads)

    def load_errors(self) -> set[int]:
        """The blocks of the loads ``results`` failed, each once (one KV group)."""
        out, self._errors = self._errors, set()
        return out

    def register(self, kv_caches: dict[str, Any]) -> None:
        return None

    def step_began(self) -> None:
        return None

    def start_loads(self, meta: StepPlan) -> None:
        return None

    def wait_layer(self, layer_name: str) -> None:
        return None

    def start_saves(self, meta: StepPlan) -> None:
        return None

    def flush_saves(self, freed: frozenset[str]) -> None:
        return None

    def interval_stats(self) -> dict[str, Any] | None:
        return None

    def stats(self) -> TransferStats | None:
        return None

    def worker_meta(self) -> WorkerReport | None:
        return None

    def close(self) -> None:
        return None

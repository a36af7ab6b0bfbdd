"""vLLM's parts of the worker half (``kvpool.vllm.worker.WorkerSide``): it reports
``KVPoolWorkerMetadata`` and reads layer indices by vLLM's rule; and the connector
ends what the scheduler planned on a rank whose worker never started. The rest of
the worker: ``tests/unit/test_worker.py``."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tests.unit.test_worker import NB, identity, kv_caches, ops

from kvpool.config import PoolConfig
from kvpool.settings import ConnectorSettings
from kvpool.store.memory import MemoryStore
from kvpool.vllm.identity import layer_index
from kvpool.vllm.metadata import KVPoolMetadata, KVPoolWorkerMetadata
from kvpool.vllm.worker import WorkerSide


def test_the_worker_reports_vllms_metadata_and_reads_layers_by_vllms_rule() -> None:
    kv_config = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )
    store = MemoryStore(capacity=1 << 28)
    worker = WorkerSide(
        identity(), 0, ConnectorSettings(), PoolConfig(), kv_config, lambda _: store
    )
    worker.register(kv_caches())
    assert worker._layer_index is layer_index
    assert layer_index("model.layers.12.self_attn.attn") == 12
    worker.start_loads(KVPoolMetadata(loads=[ops("b", [5, 6])]))  # nothing stored: fails
    deadline = time.monotonic() + 10
    meta = None
    while meta is None and time.monotonic() < deadline:
        worker.finished(idle=True)  # waits up to IDLE_WAIT_S for the load
        meta = worker.worker_meta()
    assert isinstance(meta, KVPoolWorkerMetadata) and meta.failed_hashes
    worker.close()


def test_a_worker_whose_connector_stayed_idle_still_ends_what_the_scheduler_planned() -> None:
    """The scheduler's set-up succeeded, this worker's did not (its half stays an
    ``IdleWorker``): its loads finish failed (blocks recomputed) and finishing
    requests are released, or vLLM would wait on this rank for ever."""
    from kvpool.connector.results import IdleWorker
    from kvpool.vllm.connector import KVPoolConnector

    connector = object.__new__(KVPoolConnector)  # only the worker-role state below is read
    connector._worker = IdleWorker(groups=1)
    connector._sched, connector.lookup_server, connector._lookup_client = None, None, None
    connector._connector_metadata = KVPoolMetadata(
        loads=[ops("l", [4, 5])], finishing=frozenset({"f"})
    )
    assert connector.worker is None  # no worker side to reach into
    got = connector.get_transfer_results(set())
    assert got.finished_sending == {"f"}
    assert got.finished_recving == {"l"} and got.failed_recving == {"l"}
    assert connector.get_block_ids_with_load_errors() == {4, 5}
    assert connector.get_block_ids_with_load_errors() == set()  # reported once
    assert connector.get_finished(set()) == ({"f"}, {"l"})
    assert connector.counters() == {} and connector.get_kv_connector_stats() is None

"""WorkerSide over in-memory stores: a store client that dies is replaced by itself."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from types import SimpleNamespace

import torch

from kvpool.config import PoolConfig
from kvpool.keys import KeySpace
from kvpool.layout import Layout
from kvpool.store.base import KVStore, Segments, Status
from kvpool.store.memory import MemoryStore
from kvpool.vllm.identity import EngineIdentity
from kvpool.vllm.metadata import ChunkOp, KVPoolMetadata, RequestOps
from kvpool.vllm.settings import ConnectorSettings
from kvpool.vllm.worker import WorkerSide

B, NB = 32, 16  # tokens per block, blocks


def identity() -> EngineIdentity:
    layout = Layout.create(tp=1, groups=["gqa:2"])
    space = KeySpace.create(
        model="m",
        layout=layout,
        kv_dtype="f32",
        model_dtype="f32",
        chunk_size=B,
        head_size=32,
        num_layers=2,
    )
    return EngineIdentity(layout, space, B, B, 0)


def kv_caches() -> dict[str, torch.Tensor]:
    """Two layers in the CPU backend's layout: [blocks, 2, block_size, heads * head]."""
    return {f"l{i}": torch.randn(NB, 2, B, 64) for i in range(2)}


def ops(req: str, blocks: list[int]) -> RequestOps:
    chunks = tuple(ChunkOp(i, bytes([i + 1]) * 8, ((b,),)) for i, b in enumerate(blocks))
    return RequestOps(req, chunks)


def finished_within(worker: WorkerSide, req: str, timeout: float = 10.0) -> tuple[bool, bool]:
    """Poll like vLLM's step loop until ``req`` is reported; (done, failed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = worker.finished()
        if req in done:
            return True, req in failed
        time.sleep(0.01)
    return False, False


def test_a_dead_store_client_is_replaced_and_service_resumes() -> None:
    shared = MemoryStore(capacity=1 << 30)  # the pool; each client below is a view of it
    opened: list[KVStore] = []

    class Client(MemoryStore):
        """A client of ``shared`` that can die (then every call is UNAVAILABLE)."""

        def __init__(self) -> None:
            super().__init__(capacity=1 << 30)
            self._objects = shared._objects
            self.dead = False

        def _get(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
            return [Status.UNAVAILABLE] * len(keys) if self.dead else super()._get(keys, segments)

        def close(self) -> None:  # closing a client keeps the pool's objects
            self._objects = OrderedDict()
            super().close()

    def open_store(_: PoolConfig) -> KVStore:
        opened.append(Client())
        return opened[-1]

    kv_config = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )
    caches = kv_caches()
    worker = WorkerSide(identity(), 0, ConnectorSettings(), PoolConfig(), kv_config, open_store)
    worker.register(caches)
    worker.start_saves(KVPoolMetadata(saves=[ops("a", [1, 2])]))
    assert worker.engine is not None
    worker.engine.wait([("save", 0)], timeout=10)

    first = opened[0]
    assert isinstance(first, Client)
    first.dead = True  # e.g. a same-host client whose holder was killed
    worker.start_loads(KVPoolMetadata(loads=[ops("b", [5, 6])]))
    assert finished_within(worker, "b") == (True, True)
    assert worker.load_errors() == {5, 6}
    # A new client is opened in the background and adopted at a later step.
    deadline = time.monotonic() + 10
    while not (len(opened) == 2 and worker.engine is not None) and time.monotonic() < deadline:
        worker.finished()
        time.sleep(0.01)
    assert len(opened) == 2 and worker.engine is not None and worker.store is opened[1]
    worker.start_loads(KVPoolMetadata(loads=[ops("c", [9, 10])]))
    assert finished_within(worker, "c") == (True, False)
    for src, dst in ((1, 9), (2, 10)):
        for t in caches.values():
            assert torch.equal(t[src], t[dst])
    stats = worker.stats()
    assert stats is not None and stats.chunks_loaded == 2 and stats.chunks_put == 2
    worker.close()

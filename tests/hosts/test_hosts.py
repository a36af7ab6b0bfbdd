"""One pool across simulated hosts: a master and holder on host 1, a holder of host
2 joined to it; the engine on host 2 uses its own holder through shared memory,
the one on host 3 (no holder) reaches the pool over TCP."""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

Host = Any  # tests/hosts/conftest.py's Host: name, address, wrap, env(), run()

SRC = Path(__file__).resolve().parents[2] / "src"
_KVPOOL = "import sys; from kvpool.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _kvpool(host: Host, home: Path, *args: str) -> str:
    env = host.env(KVPOOL_HOME=str(home), PYTHONPATH=str(SRC))
    r = host.run([sys.executable, "-c", _KVPOOL, *args], env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return str(r.stdout)


@pytest.fixture
def pool_files(hosts: list[Host], tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """``kvpool up --host`` on host 1 (master and holder), and host 2 joining it with
    a holder of its own (``--master``); both pool files (on a shared disk, as NFS)."""
    one, two = tmp_path / "host1-pool", tmp_path / "host2-pool"
    _kvpool(hosts[0], one, "up", "--host", hosts[0].address, "--segment-size", "256MB",
            "--client-ttl", "2")  # fmt: skip
    try:
        first = json.loads((one / "pool.json").read_text())
        join = ["--master", first["master_address"], "--metrics-url", first["metrics_url"]]
        _kvpool(hosts[1], two, "up", "--host", hosts[1].address, "--segment-size", "256MB", *join)
        try:
            yield one / "pool.json", two / "pool.json"
        finally:
            _kvpool(hosts[1], two, "down")
    finally:
        _kvpool(hosts[0], one, "down")


def _engine(
    host: Host | None, model: Path, tmp: Path, name: str, pool_file: str = "", **extra: Any
) -> Any:
    from kvpool.demo.session import EngineSession

    rng = random.Random(3)
    shared = [rng.randrange(10, 1000) for _ in range(256)]
    spec: dict[str, Any] = {
        "model": str(model),
        "prompts": [
            shared + [rng.randrange(10, 1000) for _ in range(40 + 7 * i)] for i in range(3)
        ],
        "max_tokens": 8,
        "connector": "kvpool" if pool_file else "none",
        "block_size": 32,
    }
    if pool_file:
        # These tests assert hits, not lookup latency: a loaded machine must not turn a
        # slow lookup into a miss.
        spec["extra"] = {"pool_file": pool_file, "lookup_timeout_ms": 2000, **extra}
        spec["log_level"] = "INFO"  # the worker says which path it moves KV over
    pythonpath = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    if host is None:
        return EngineSession.run(spec, tmp, name, env={"PYTHONPATH": pythonpath})
    env = {"PYTHONPATH": pythonpath, "MC_TCP_BIND_ADDRESS": host.address}
    return EngineSession.run(spec, tmp, name, env=env, wrap=host.wrap)


def test_an_engine_on_another_host_loads_a_prefix_saved_on_a_third(
    hosts: list[Host], pool_files: tuple[Path, Path], tiny_model: Path, tmp_path: Path
) -> None:
    host1_file, host2_file = pool_files
    pool = json.loads(host1_file.read_text())
    assert pool["master_address"].startswith(hosts[0].address + ":")
    assert pool["local_hostname"] == "auto"  # each engine advertises its own address
    base = _engine(None, tiny_model, tmp_path, "base")
    # Host 2 has a holder: its engine uses it through shared memory. Host 3 has
    # none: its engine reaches the pool over TCP.
    a = _engine(hosts[1], tiny_model, tmp_path, "host2", str(host2_file))
    b = _engine(hosts[2], tiny_model, tmp_path, "host3", str(host1_file))
    for run in (a, b):
        assert [r["tokens"] for r in run["results"]] == [r["tokens"] for r in base["results"]]
        assert [r["logprobs"] for r in run["results"]] == [r["logprobs"] for r in base["results"]]
    master = pool["master_address"]
    assert f"to the pool at {master} over shared memory" in a["log"]
    assert f"to the pool at {master} over tcp" in b["log"]
    assert a["connector"]["bytes_saved"] > 0
    # `kvpool status` on host 1 shows the pool's memory per host: both holders.
    status = json.loads(_kvpool(hosts[0], host1_file.parent, "status", "--json"))
    assert sorted(status["hosts"]) == [hosts[0].address, hosts[1].address]
    assert sum(h["used_bytes"] for h in status["hosts"].values()) > 0
    assert b["results"][0]["cached_tokens"] >= 256  # host 3's prefix came from the pool
    assert b["connector"]["chunks_loaded"] > 0 and not b["connector"]["failures"]


def test_a_host_cut_off_costs_misses_never_a_stall_or_a_wrong_answer(
    hosts: list[Host], pool_files: tuple[Path, Path], tiny_model: Path, tmp_path: Path
) -> None:
    """Host 2 (a holder of the pool) loses its link after its engine saved: host 3's
    engine still answers like an engine without kvpool, every request within the
    load deadline and Mooncake's transfer timeout of a hit it cannot load, and its
    saves go to the holder that remains. Link back: a fresh engine on host 3 hits
    the prefix again."""
    import subprocess

    host1_file, host2_file = pool_files
    base = _engine(None, tiny_model, tmp_path, "base")
    saved = _engine(hosts[1], tiny_model, tmp_path, "host2", str(host2_file))
    assert saved["connector"]["bytes_saved"] > 0
    cut = ["ip", "-n", hosts[1].name, "link", "set", "eth0"]
    subprocess.run([*cut, "down"], check=True)
    try:
        c = _engine(hosts[2], tiny_model, tmp_path, "host3", str(host1_file), load_timeout_s=2)
    finally:
        subprocess.run([*cut, "up"], check=True)
    assert [r["tokens"] for r in c["results"]] == [r["tokens"] for r in base["results"]]
    slowest = max(r["total_s"] for r in c["results"])
    assert slowest < 2 + 5 + 10, f"a request took {slowest:.1f} s"  # deadline + transfer bound
    assert c["connector"]["bytes_saved"] > 0  # to host 1's holder, while host 2 was away
    d = _engine(hosts[2], tiny_model, tmp_path, "host3-again", str(host1_file))
    assert [r["tokens"] for r in d["results"]] == [r["tokens"] for r in base["results"]]
    assert d["results"][0]["cached_tokens"] >= 256


def test_a_host_whose_holder_is_killed_costs_misses_then_hits_again(
    hosts: list[Host], pool_files: tuple[Path, Path], tiny_model: Path, tmp_path: Path
) -> None:
    """Host 2's holder is killed (SIGKILL) after its engine saved there: host 3's
    engine answers like an engine without kvpool, within the load deadline and
    Mooncake's transfer timeout, saving to host 1's holder; a fresh engine on
    host 3 then hits the prefix."""
    import signal

    host1_file, host2_file = pool_files
    base = _engine(None, tiny_model, tmp_path, "base")
    saved = _engine(hosts[1], tiny_model, tmp_path, "host2", str(host2_file))
    assert saved["connector"]["bytes_saved"] > 0
    holder = json.loads(host2_file.read_text())["holder_pid"]
    assert isinstance(holder, int) and holder > 0
    os.kill(holder, signal.SIGKILL)
    c = _engine(hosts[2], tiny_model, tmp_path, "host3", str(host1_file), load_timeout_s=2)
    assert [r["tokens"] for r in c["results"]] == [r["tokens"] for r in base["results"]]
    slowest = max(r["total_s"] for r in c["results"])
    assert slowest < 2 + 5 + 10, f"a request took {slowest:.1f} s"  # deadline + transfer bound
    assert c["connector"]["bytes_saved"] > 0
    d = _engine(hosts[2], tiny_model, tmp_path, "host3-again", str(host1_file))
    assert [r["tokens"] for r in d["results"]] == [r["tokens"] for r in base["results"]]
    assert d["results"][0]["cached_tokens"] >= 256


def test_the_masters_host_cut_off_costs_misses_and_the_pool_serves_again_after(
    hosts: list[Host], pool_files: tuple[Path, Path], tiny_model: Path, tmp_path: Path
) -> None:
    """Host 1 (the master and a holder) is cut off when an engine on host 3 starts:
    the connector says it cannot reach the master and stays idle, the engine answers
    like one without kvpool, no request stalls. Link back: a fresh engine on host 3
    uses the pool again (it saves)."""
    import subprocess

    host1_file = pool_files[0]
    base = _engine(None, tiny_model, tmp_path, "base")
    cut = ["ip", "-n", hosts[0].name, "link", "set", "eth0"]
    subprocess.run([*cut, "down"], check=True)
    try:
        c = _engine(hosts[2], tiny_model, tmp_path, "host3", str(host1_file), load_timeout_s=2,
                    lookup_timeout_ms=200)  # fmt: skip
    finally:
        subprocess.run([*cut, "up"], check=True)
    assert [r["tokens"] for r in c["results"]] == [r["tokens"] for r in base["results"]]
    assert "cannot reach mooncake_master" in c["log"]
    slowest = max(r["total_s"] for r in c["results"])
    assert slowest < 2 + 5 + 10, f"a request took {slowest:.1f} s"
    d = _engine(hosts[2], tiny_model, tmp_path, "host3-again", str(host1_file))
    assert [r["tokens"] for r in d["results"]] == [r["tokens"] for r in base["results"]]
    assert d["connector"]["bytes_saved"] > 0

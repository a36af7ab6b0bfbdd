"""One pool across simulated hosts: a master and holder on host 1, a holder of host
2 joined to it; the engine on host 2 uses its own holder through shared memory,
the one on host 3 (no holder) reaches the pool over TCP."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

Host = Any  # tests/hosts/conftest.py's Host: name, address, wrap, env(), run()

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_BACKOFF_S = 1.0  # kvpool.lookup.client.LookupClient's default max_backoff_s
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


@contextlib.contextmanager
def _cut_off(host: Host) -> Iterator[None]:
    """``host``'s link down for the block, up again after it, whatever happened."""
    link = ["ip", "-n", host.name, "link", "set", "eth0"]
    subprocess.run([*link, "down"], check=True)
    try:
        yield
    finally:
        subprocess.run([*link, "up"], check=True)


def _status(host: Host, pool_file: Path) -> dict[str, Any]:
    """``kvpool status --json`` on ``host`` for the pool of ``pool_file``."""
    env = host.env(KVPOOL_POOL_FILE=str(pool_file), PYTHONPATH=str(SRC))
    r = host.run([sys.executable, "-c", _KVPOOL, "status", "--json"], env=env, timeout=60)
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _master_reachable(host: Host, pool_file: Path) -> bool:
    """Does ``kvpool status`` on ``host`` reach the master of ``pool_file``?"""
    try:
        return bool(_status(host, pool_file)["reachable"])
    except ValueError:  # not even JSON: not yet
        return False


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

    spec, env, wrap = _spec(host, model, pool_file, prompts=_family(3), **extra)
    return EngineSession.run(spec, tmp, name, env=env, wrap=wrap)


def _family(seed: int) -> list[list[int]]:
    """Three prompts sharing a 256-token prefix, with distinct tails."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 1000) for _ in range(256)]
    return [shared + [rng.randrange(10, 1000) for _ in range(40 + 7 * i)] for i in range(3)]


def _spec(
    host: Host | None, model: Path, pool_file: str, **spec_extra: Any
) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """An engine spec (``prompts`` or ``phases`` in ``spec_extra``; other keys go to
    the connector), its environment and the command prefix of its host."""
    names: tuple[str, ...] = ("prompts", "phases", "hold")
    work: dict[str, Any] = {k: spec_extra.pop(k) for k in names if k in spec_extra}
    spec: dict[str, Any] = {
        "model": str(model),
        "max_tokens": 8,
        "connector": "kvpool" if pool_file else "none",
        "block_size": 32,
        **work,
    }
    if pool_file:
        # These tests assert hits, not lookup latency: a loaded machine must not turn a
        # slow lookup into a miss.
        # Nor a tiny model's cheap forward a hit into a recompute (load_decision).
        spec["extra"] = {"pool_file": pool_file, "lookup_timeout_ms": 2000,
                         "load_decision": "load", **spec_extra}  # fmt: skip
        spec["log_level"] = "INFO"  # the worker says which path it moves KV over
    env = {"PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    if host is None:
        return spec, env, []
    return spec, {**env, "MC_TCP_BIND_ADDRESS": host.address}, list(host.wrap)


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
    # Host 2's saves went to its own holder, every one (puts ask for a local segment).
    local = _status(hosts[0], host1_file)
    assert {h: v["keys"] for h, v in local["hosts"].items()} == {
        hosts[0].address: 0,
        hosts[1].address: local["keys"],
    }
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
    # ... and which host holds each key: every key on one host at least, host 2's
    # engine's saves on host 2's holder (shared memory to its own holder).
    assert status["host_keys_sampled"] == status["keys"] > 0
    per_host = {h: v["keys"] for h, v in status["hosts"].items()}
    assert sum(per_host.values()) >= status["keys"] and per_host[hosts[1].address] > 0
    assert b["results"][0]["cached_tokens"] >= 256  # host 3's prefix came from the pool
    assert b["connector"]["chunks_loaded"] > 0 and not b["connector"]["failures"]


def test_a_host_cut_off_costs_misses_never_a_stall_or_a_wrong_answer(
    hosts: list[Host], pool_files: tuple[Path, Path], tiny_model: Path, tmp_path: Path
) -> None:
    """Host 2 (a holder of the pool) loses its link after its engine saved: host 3's
    engine still answers like an engine without kvpool, every request within the
    load deadline and Mooncake's transfer timeout of a hit it cannot load, and its
    saves go to the holder that remains. Link back: host 2's holder mounts its
    memory again, and a fresh engine on host 3 hits the prefix again."""
    from kvpool.pool import wait_until

    host1_file, host2_file = pool_files
    base = _engine(None, tiny_model, tmp_path, "base")
    saved = _engine(hosts[1], tiny_model, tmp_path, "host2", str(host2_file))
    assert saved["connector"]["bytes_saved"] > 0
    with _cut_off(hosts[1]):
        c = _engine(hosts[2], tiny_model, tmp_path, "host3", str(host1_file), load_timeout_s=2)
    assert [r["tokens"] for r in c["results"]] == [r["tokens"] for r in base["results"]]
    slowest = max(r["total_s"] for r in c["results"])
    assert slowest < 2 + 5 + 10, f"a request took {slowest:.1f} s"  # deadline + transfer bound
    assert c["connector"]["bytes_saved"] > 0  # to host 1's holder, while host 2 was away
    # The master dropped host 2's holder while it was away (client TTL 2 s); with the
    # link back, the holder mounts its memory in the pool again by itself.
    assert wait_until(lambda: len(_status(hosts[0], host1_file)["segments"]) == 2, timeout=30)
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
    host1_file = pool_files[0]
    base = _engine(None, tiny_model, tmp_path, "base")
    with _cut_off(hosts[0]):
        c = _engine(hosts[2], tiny_model, tmp_path, "host3", str(host1_file), load_timeout_s=2,
                    lookup_timeout_ms=200)  # fmt: skip
    assert [r["tokens"] for r in c["results"]] == [r["tokens"] for r in base["results"]]
    assert "cannot reach mooncake_master" in c["log"]
    slowest = max(r["total_s"] for r in c["results"])
    assert slowest < 2 + 5 + 10, f"a request took {slowest:.1f} s"
    d = _engine(hosts[2], tiny_model, tmp_path, "host3-again", str(host1_file))
    assert [r["tokens"] for r in d["results"]] == [r["tokens"] for r in base["results"]]
    assert d["connector"]["bytes_saved"] > 0


def _three_batches(
    hosts: list[Host],
    pool_file: Path,
    model: Path,
    tmp_path: Path,
    families: list[list[list[int]]],
    second: Callable[[Any], dict[str, Any]],
    between: Callable[[], None] = lambda: None,
    **extra: Any,
) -> list[dict[str, Any]]:
    """One engine on host 3, not restarted, runs one batch per family: the first,
    then ``second(engine)`` (the fault is staged there), ``between()`` and the
    third. Every batch answers like an engine without kvpool; the first hits the
    pool. Returns the three batches' outputs."""
    from kvpool.demo.session import EngineSession

    every = [p for f in families for p in f]
    spec, env, _ = _spec(None, model, "", prompts=every)
    base = EngineSession.run(spec, tmp_path, "base", env=env)["results"]
    spec, env, wrap = _spec(hosts[2], model, str(pool_file), phases=families, hold=True, **extra)
    with EngineSession.start(spec, tmp_path, "host3", env=env, wrap=wrap) as engine:
        engine.ready()
        phases = [engine.next_phase()]
        phases.append(second(engine))
        between()
        phases.append(engine.next_phase(timeout=120))
        engine.finish()
    for i, phase in enumerate(phases):
        want = base[3 * i : 3 * i + 3]
        assert [r["tokens"] for r in phase["results"]] == [r["tokens"] for r in want], i
    assert phases[0]["results"][0]["cached_tokens"] >= 256  # from the pool
    slowest = max(r["total_s"] for r in phases[1]["results"])
    assert slowest < 2 + 5 + 10, f"a request took {slowest:.1f} s during the fault"
    return phases


def _save(host: Host, pool_file: Path, model: Path, tmp: Path, name: str, prompts: Any) -> None:
    """An engine on ``host`` runs ``prompts``, saving their KV to the pool."""
    from kvpool.demo.session import EngineSession

    spec, env, wrap = _spec(host, model, str(pool_file), prompts=prompts)
    saved = EngineSession.run(spec, tmp, name, env=env, wrap=wrap)
    assert saved["connector"]["bytes_saved"] > 0


def test_the_masters_host_cut_off_while_an_engine_runs_costs_misses_then_it_hits_again(
    hosts: list[Host], pool_files: tuple[Path, Path], tiny_model: Path, tmp_path: Path
) -> None:
    """An engine on host 3 runs three batches of prompts whose prefixes an engine on
    host 1 saved (to the holder beside the master). Between the first and second,
    host 1 is cut off: the second batch's lookups miss within their deadline and
    its answers equal an engine's without kvpool, no request stalls. Link back:
    the same engine, not restarted, loads the third batch's prefix from the pool."""
    import time

    from kvpool.pool import wait_until

    host1_file = pool_files[0]
    families = [_family(seed) for seed in (11, 12, 13)]
    _save(hosts[0], host1_file, tiny_model, tmp_path, "host1", [p for f in families for p in f])

    def second(engine: Any) -> dict[str, Any]:
        with _cut_off(hosts[0]):
            return dict(engine.next_phase(timeout=120))

    linked: list[float] = []

    def between() -> None:
        linked.append(time.monotonic())
        # The link is back once host 3 reaches the master again (a fresh client).
        # The engine's lookup client then sends again after its backoff, which
        # grows to at most MAX_BACKOFF_S and is a timer, not an event: waited out.
        assert wait_until(lambda: _master_reachable(hosts[2], host1_file), timeout=30)
        time.sleep(MAX_BACKOFF_S)

    _, during, after = _three_batches(hosts, host1_file, tiny_model, tmp_path, families, second,
                                      between, lookup_timeout_ms=500, load_timeout_s=2)  # fmt: skip
    assert during["results"][0]["cached_tokens"] == 0  # the master unreachable: a miss
    back_s = time.monotonic() - linked[0]
    assert after["results"][0]["cached_tokens"] >= 256, f"no hit {back_s:.1f} s after link back"


def _sent_bytes(host: Host) -> int:
    """Bytes ``host`` has sent on its link so far."""
    r = subprocess.run([*host.wrap, "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                       capture_output=True, text=True, check=True)  # fmt: skip
    return int(r.stdout)


@contextlib.contextmanager
def _throttled(host: Host, rate: str) -> Iterator[None]:
    """``host``'s sending limited to ``rate`` (tc's token bucket) for the block."""
    qdisc = ["tc", "-n", host.name, "qdisc"]
    subprocess.run([*qdisc, "add", "dev", "eth0", "root", "tbf", "rate", rate,
                    "burst", "16kb", "limit", "4mb"], check=True)  # fmt: skip
    try:
        yield
    finally:
        subprocess.run([*qdisc, "del", "dev", "eth0", "root"], capture_output=True)


def test_a_holders_host_cut_off_in_the_middle_of_a_load_from_it_costs_misses_only(
    hosts: list[Host], pool_files: tuple[Path, Path], tiny_model: Path, tmp_path: Path
) -> None:
    """An engine on host 3 runs three batches whose prefixes engines on hosts 2 and 1
    saved, each to its own holder. Host 2's link is slowed to 1 Mbit/s for the
    second batch and cut once host 2 has sent part of that batch's objects, so
    the cut falls in the middle of a transfer: the load is abandoned at the load
    deadline, answers equal an engine's without kvpool, no request stalls beyond
    the deadline and Mooncake's transfer bound. With the link back, the same
    engine loads the third batch (saved on host 1) from the pool."""
    from kvpool.pool import wait_until

    host1_file, host2_file = pool_files
    families = [_family(seed) for seed in (21, 22, 23)]
    every = [p for f in families for p in f]
    _save(hosts[1], host2_file, tiny_model, tmp_path, "saver2", every[:6])
    _save(hosts[0], host1_file, tiny_model, tmp_path, "saver1", every[6:])
    # A 256-token prefix of this model is 256 KiB of KV: 2 s at 1 Mbit/s.
    at_cut: list[int] = []

    def second(engine: Any) -> dict[str, Any]:
        with _throttled(hosts[1], "1mbit"), contextlib.ExitStack() as link:
            sent = _sent_bytes(hosts[1])

            def cut_mid_transfer() -> None:
                assert wait_until(lambda: _sent_bytes(hosts[1]) - sent >= 32 << 10, timeout=60)
                at_cut.append(_sent_bytes(hosts[1]) - sent)
                link.enter_context(_cut_off(hosts[1]))  # up again when the batch is done

            return dict(engine.next_phase(timeout=120, during=cut_mid_transfer))

    def get_returned() -> None:
        """A load given up at its deadline (2 s) leaves its get running until
        Mooncake's own transfer bound (5 s without progress); the client moves one
        transfer at a time, so loads meanwhile queue behind it and miss. The third
        batch tests the pool after the fault: it starts once that get returned."""
        log = tmp_path / "host3.log"
        if "had no answer after" in log.read_text():
            returned = "a get of a load given up returned"
            assert wait_until(lambda: returned in log.read_text(), timeout=60)

    before, during, after = _three_batches(hosts, host1_file, tiny_model, tmp_path, families,
                                           second, get_returned, load_timeout_s=2)  # fmt: skip
    assert 32 << 10 <= at_cut[0] < 256 << 10, at_cut  # the cut fell inside the transfer
    c0, c1 = before["connector"], during["connector"]
    abandoned = c1["loads_timed_out"] - c0["loads_timed_out"]
    failed = sum(c1["failures"].values()) - sum(c0["failures"].values())
    assert abandoned + failed >= 1, c1  # the load from host 2 was given up
    # The third batch was saved on host 1 (saves go to the saver's own holder):
    # the same engine loads it from the pool, within the bound.
    assert after["results"][0]["cached_tokens"] >= 256
    assert max(r["total_s"] for r in after["results"]) < 2 + 5 + 10


@pytest.mark.vllm  # an engine tier's length: runs beside the vllm tier in CI
def test_a_slow_pool_and_a_cheap_model_recompute_instead_of_waiting_for_loads(
    hosts: list[Host], tiny_model: Path, tmp_path: Path
) -> None:
    """The pool's host sends at 4 Mbit/s; an engine on another host reaches it over
    TCP and runs a tiny model (its forward computes a prompt in milliseconds, a load
    of it takes about a second). With the default ``load_decision`` (measured) its
    first hits load while it learns both rates, then it computes the rest of its
    hits instead of waiting for them, counts them, takes less time for them than
    for a load, and answers like an engine without kvpool."""
    from kvpool.demo.session import EngineSession

    home = tmp_path / "host1-pool"
    _kvpool(hosts[0], home, "up", "--host", hosts[0].address, "--segment-size", "256MB",
            "--client-ttl", "2")  # fmt: skip
    try:
        pool_file = str(home / "pool.json")
        rng = random.Random(11)
        fresh = [[rng.randrange(10, 1000) for _ in range(500)] for _ in range(3)]
        saved = [[rng.randrange(10, 1000) for _ in range(500)] for _ in range(8)]
        spec, env, wrap = _spec(hosts[0], tiny_model, pool_file, prompts=saved)
        spec["settle_saves"] = True
        writer = EngineSession.run(spec, tmp_path, "writer", env=env, wrap=wrap)
        assert writer["connector"]["chunks_saved"] >= 8 * 15
        spec, env, _ = _spec(None, tiny_model, "", prompts=fresh + saved)
        base = EngineSession.run(spec, tmp_path, "base", env=env)["results"]
        with _throttled(hosts[0], "4mbit"):
            spec, env, wrap = _spec(hosts[2], tiny_model, pool_file, prompts=fresh + saved,
                                    load_decision="measured")  # fmt: skip
            spec["warmup"] = True  # a prefill the length of the prompts: a compute sample
            reader = EngineSession.run(spec, tmp_path, "reader", env=env, wrap=wrap)
    finally:
        _kvpool(hosts[0], home, "down")
    results = reader["results"]
    assert [r["tokens"] for r in results] == [r["tokens"] for r in base]
    for r, b in zip(results, base, strict=True):
        assert r["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)
    hits = results[3:]  # every one of them is in the pool
    loaded = [r for r in hits if r["cached_tokens"] >= 480]
    computed = [r for r in hits if r["cached_tokens"] == 0]
    assert len(loaded) + len(computed) == len(hits)
    assert len(loaded) >= 3, "the first hits load: the decision has no load rate yet"
    assert len(computed) >= 3, [r["cached_tokens"] for r in hits]
    stats = reader["connector"]
    assert stats["hits_recomputed"] == len(computed)
    assert stats["tokens_recomputed"] == 480 * len(computed)
    assert max(r["ttft_s"] for r in computed) < min(r["ttft_s"] for r in loaded)

"""HA masters: ``kvpool up --ha`` (etcd and two masters), status, a failover, down.

Clients run in subprocesses: Mooncake keeps one etcd client per process, and this
pytest process may start other HA pools (the chaos rows).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.store.conftest import Home

from kvpool.pool import LocalPool, wait_until
from kvpool.pool.binaries import ETCD_BINARY, MASTER_BINARY
from kvpool.pool.ha import log_durable_seq, master_roles
from kvpool.pool.master_api import master_serving
from kvpool.pool.processes import is_mooncake_process

_CLIENT = """
import os
import sys
import numpy as np
from kvpool.config import load_config
from kvpool.store.base import Status
from kvpool.store.mooncake import MooncakeStore
pool_file, op, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
keys = [f"ha-test/{i}" for i in range(n)]
with MooncakeStore(load_config({"pool_file": pool_file})) as store:
    if op == "put":
        data = np.full(65536, 7, dtype=np.uint8)
        segs = [[(data.ctypes.data, data.nbytes)]] * n
        print(sum(s is Status.OK for s in store.batch_put(keys, segs)), flush=True)
    else:
        print(sum(s is Status.OK for s in store.batch_exists(keys)), flush=True)
    os._exit(0)  # a client of etcd takes ~30 s to close (Mooncake's watch): not waited for
"""


def client(pool_file: Path, op: str, n: int) -> int:
    """Objects put (``op`` "put") or found ("exists") by a client of the pool file."""
    out = subprocess.run(
        [sys.executable, "-c", _CLIENT, str(pool_file), op, str(n)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def status(home: Home) -> dict[str, Any]:
    r = home.kvpool("status", "--json")
    assert r.returncode in (0, 1), r.stderr
    data: dict[str, Any] = json.loads(r.stdout)
    return data


def roles(home: Home) -> dict[str, str]:
    return {m["name"]: m["role"] for m in status(home).get("masters", [])}


def after_view(s: dict[str, Any], name: str) -> int:
    """The master view that master ``name`` reports in status ``s``."""
    return int(next(m["view"] for m in s["masters"] if m["name"] == name))


def test_up_ha_fails_over_keeping_the_objects_and_down_stops_everything(home: Home) -> None:
    r = home.up("--ha", "--client-ttl", "10")
    assert "engines and holders find the leader at etcd://" in r.stdout
    data = json.loads(home.pool_file.read_text())
    assert data["master_address"].startswith("etcd://127.0.0.1:")
    assert len(data["ha_masters"].split(",")) == 2 and len(data["metrics_url"].split(",")) == 2
    procs = list(LocalPool.attach(home.pool_file).processes())
    assert [(role, ok) for role, _, ok in procs] == [
        ("etcd", True), ("master", True), ("master-2", True), ("holder", True)
    ]  # fmt: skip
    first = roles(home)
    assert sorted(first.values()) == ["leader", "standby"], first
    s = home.kvpool("status")
    assert "healthy" in s.stdout and "leader (serving" in s.stdout, s.stdout
    before = status(home)
    assert before["failovers"] == 0 and len(before["leaders"]) == 1, before

    etcd = data["master_address"].removeprefix("etcd://")
    logged = log_durable_seq(etcd)
    assert client(home.pool_file, "put", 50) == 50
    # The leader answers a put before its log entry is in etcd: a kill before that
    # loses the object (kvpool.pool.ha). Wait for the 50 entries, as bench ha does.
    assert wait_until(lambda: log_durable_seq(etcd) >= logged + 50, 10, step=0.01)
    leader = next(name for name, role in first.items() if role == "leader")
    pids = {role: pid for role, pid, _ in procs}
    urls = data["metrics_url"].split(",")
    other_url = urls[1] if leader == "master" else urls[0]

    t0 = time.monotonic()
    os.kill(pids[leader], signal.SIGKILL)
    # Asked over HTTP: no client that waits for a leader.
    assert wait_until(lambda: master_serving(other_url), 30, step=0.1), master_roles(
        data["metrics_url"]
    )
    took = time.monotonic() - t0
    assert took < 20, took  # Mooncake: the dead leader's lease runs out, the standby warms up
    after = status(home)
    other = "master-2" if leader == "master" else "master"
    assert after["reachable"] and roles(home) == {leader: "down", other: "leader"}, after
    # etcd's history names both leaders, the first one as before the kill
    assert after["failovers"] == 1 and after["leaders"][0] == before["leaders"][0], after
    address = dict(zip(("master", "master-2"), data["ha_masters"].split(","), strict=True))
    assert [e["leader"] for e in after["leaders"]] == [address[leader], address[other]]
    assert after["leaders"][1]["view"] == after_view(after, other)
    assert client(home.pool_file, "exists", 50) == 50  # the standby replayed the log
    assert client(home.pool_file, "put", 60) == 60  # and takes new objects

    d = home.kvpool("down")
    assert d.returncode == 0, d.stderr
    assert "etcd" in d.stdout and not home.pool_file.exists()
    etcd_port = data["master_address"].rsplit(":", 1)[1]
    marker = f"--listen-client-urls=http://127.0.0.1:{etcd_port}"
    assert not is_mooncake_process(pids["etcd"], ETCD_BINARY, marker)
    for role, address in zip(("master", "master-2"), data["ha_masters"].split(","), strict=True):
        port = address.rsplit(":", 1)[1]
        assert not is_mooncake_process(pids[role], MASTER_BINARY, f"--rpc_port={port}")


def test_a_holder_joins_an_ha_pool_through_its_etcd(home: Home, tmp_path: Path) -> None:
    short = home.kvpool("up", "--ha", "--client-ttl", "2")
    assert short.returncode != 0 and "--client-ttl 10 or more" in short.stderr, short.stderr
    assert not home.pool_file.exists()
    home.up("--ha", "--client-ttl", "10")
    data = json.loads(home.pool_file.read_text())
    etcd = data["master_address"]
    second = Home(tmp_path / "second-host")
    try:
        # Both masters' metrics servers: the joined host's status asks the leader.
        r = second.up("--master", etcd, "--metrics-url", data["metrics_url"])
        assert "kvpool pool is up" in r.stdout
        segments = status(home)["segments"]
        assert len(segments) == 2, segments  # both holders mounted on the leader
        joined = status(second)
        assert joined["reachable"] and joined["segments"] == segments, joined
    finally:
        if second.pool_file.exists():
            LocalPool.attach(second.pool_file).stop()
    bad = home.kvpool("up", "--ha", "--master", etcd)
    assert bad.returncode != 0 and "without --ha" in bad.stderr


def test_bench_ha_measures_puts_on_both_pools_and_a_failover_that_keeps_everything(
    home: Home,
) -> None:
    r = home.kvpool(
        "bench", "ha", "--objects", "8", "--batches", "3", "--failovers", "1", "--json",
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(result["single_put_s"]) == len(result["ha_put_s"]) == 3  # warm-up left out
    assert len(result["log_lag_s"]) == 3 and all(0 <= s < 10 for s in result["log_lag_s"])
    (failover,) = result["failovers"]
    assert failover["kept"] == failover["objects"] == 4 * 8, failover  # 3 batches + warm-up
    assert failover["put_after"] and 0 < failover["first_get_s"] < 30, failover

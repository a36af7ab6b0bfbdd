"""LocalPool against real mooncake_master / mooncake_client processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.factories import wait_until

from kvpool.config import load_config
from kvpool.errors import ConfigError, KVPoolError, StoreMissingDependency, StoreUnavailable
from kvpool.pool import (
    HOLDER_BINARY,
    MASTER_BINARY,
    LocalPool,
    find_binary,
    is_mooncake_process,
    key_hosts,
    master_keys,
    pool_status,
    segment_capacities,
)

MiB = 1 << 20
PoolFactory = Callable[..., LocalPool]  # the conftest fixture's type


def _gone(pid: int) -> bool:
    """The process no longer exists (or is a zombie someone else must reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_pool_starts_healthy_and_stops_reaped(pool_factory: PoolFactory) -> None:
    pool = pool_factory(segment_size=128 * MiB)
    assert pool.master_pid and pool.holder_pid
    assert pool.is_alive()
    assert pool.master_address.startswith("127.0.0.1:")
    assert pool.holder_address.startswith("127.0.0.1:")
    assert pool.metrics_url.startswith("http://127.0.0.1:")
    assert list(segment_capacities(pool.metrics()).values()) == [128 * MiB]
    assert (pool.home / "master.log").stat().st_size > 0
    assert (pool.home / "holder.log").stat().st_size > 0

    master_pid, holder_pid = pool.master_pid, pool.holder_pid
    pool.stop()
    assert _gone(master_pid) and _gone(holder_pid)  # reaped, not zombies
    assert not pool.is_alive()
    pool.stop()  # idempotent


def test_a_killed_pool_is_reaped_and_its_ports_are_free_again(pool_factory: PoolFactory) -> None:
    pool = pool_factory(segment_size=64 * MiB)
    master_pid, holder_pid = pool.master_pid, pool.holder_pid
    assert master_pid and holder_pid
    pool.stop(kill=True)
    assert _gone(master_pid) and _gone(holder_pid)
    assert not pool.is_alive()
    for address in (pool.master_address, pool.holder_address):
        host, port = address.rsplit(":", 1)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, int(port)))  # nothing listens there any more


def test_master_only_pool(pool_factory: PoolFactory) -> None:
    pool = pool_factory(with_holder=False)
    assert pool.holder_pid is None and pool.holder_address == ""
    status = pool_status(pool)
    assert status.reachable and status.segments == {} and status.keys == 0


def test_context_manager_stops(tmp_path: Path) -> None:
    with LocalPool.start(tmp_path, segment_size=64 * MiB, client_ttl=2, lease_ttl_ms=500) as pool:
        pids = [pool.master_pid, pool.holder_pid]
    assert all(p is not None and _gone(p) for p in pids)


def test_config_is_a_pure_client(local_pool: LocalPool) -> None:
    cfg = local_pool.config(checksum=False)
    assert cfg.master_address == local_pool.master_address
    assert cfg.holder_address == local_pool.holder_address
    assert cfg.metrics_url == local_pool.metrics_url
    assert cfg.global_segment_size == 0
    assert cfg.checksum is False


def test_kill_and_restart_holder(local_pool: LocalPool) -> None:
    old_pid = local_pool.holder_pid
    assert old_pid is not None
    old_segments = set(segment_capacities(local_pool.metrics()))
    local_pool.kill_holder()
    assert not local_pool.holder_running() and _gone(old_pid)
    assert local_pool.master_running()

    local_pool.restart_holder()
    assert local_pool.holder_running() and local_pool.holder_pid != old_pid
    assert set(segment_capacities(local_pool.metrics())) - old_segments
    # the killed holder's segment is dropped once client_ttl (2 s) has passed
    assert wait_until(
        lambda: not old_segments & set(segment_capacities(local_pool.metrics())), 10.0
    )


def test_pool_file_round_trip(local_pool: LocalPool, tmp_path: Path) -> None:
    path = local_pool.write_pool_file(tmp_path / "pool.json")
    data = json.loads(path.read_text())
    assert data["master_pid"] == local_pool.master_pid
    assert data["holder_pid"] == local_pool.holder_pid
    assert data["segment_size"] == 256 * MiB
    assert "created" in data and "global_segment_size" not in data

    cfg = load_config(
        {"pool_file": str(path)}, env={"KVPOOL_HOME": "/nonexistent/kvpool-test-home"}
    )
    assert cfg.master_address == local_pool.master_address
    assert cfg.holder_address == local_pool.holder_address
    assert cfg.metrics_url == local_pool.metrics_url
    assert cfg.global_segment_size == 0 and cfg.pool_file == str(path)

    attached = LocalPool.attach(path)
    assert attached.is_alive()
    assert (attached.master_pid, attached.holder_pid) == (
        local_pool.master_pid,
        local_pool.holder_pid,
    )
    status = pool_status(attached)
    assert status.reachable and status.capacity_bytes == 256 * MiB
    assert len(status.segments) == 1

    attached.stop()  # signals the verified PIDs; the fixture then reaps them
    assert wait_until(lambda: not local_pool.is_alive(), 10.0)


def test_the_pool_file_is_never_written_through_a_planted_link(
    local_pool: LocalPool, tmp_path: Path
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    path = tmp_path / "pool.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.symlink_to(victim)  # planted where the temporary file goes
    local_pool.write_pool_file(path)
    assert victim.read_text() == "keep me"
    assert json.loads(path.read_text())["master_pid"] == local_pool.master_pid
    assert not path.is_symlink() and not tmp.exists()


def test_stopping_another_users_pool_says_so_in_one_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvpool.pool import processes as pool_module

    def refuse(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    proc = subprocess.Popen(["sleep", "30"])
    try:
        handle = pool_module._Process("holder", "sleep", proc.pid, "", popen=proc)
        monkeypatch.setattr(os, "kill", refuse)
        with pytest.raises(KVPoolError, match="belongs to another user"):
            handle.send(signal.SIGTERM)
    finally:
        monkeypatch.undo()
        proc.kill()
        proc.wait()


def test_stale_pool_file(tmp_path: Path) -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    path = tmp_path / "pool.json"
    path.write_text(
        json.dumps(
            {
                "master_address": "127.0.0.1:1",
                "metrics_url": "http://127.0.0.1:1",
                "holder_address": "127.0.0.1:2",
                "master_pid": proc.pid,
                "holder_pid": proc.pid,
            }
        )
    )
    pool = LocalPool.attach(path)
    assert not pool.is_alive()
    pool.stop()  # nothing to do, no error
    status = pool_status(pool)
    assert not status.reachable and "cannot read" in status.error


def test_never_kills_an_unrelated_pid(tmp_path: Path, local_pool: LocalPool) -> None:
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        path = tmp_path / "pool.json"
        data = local_pool.pool_file_data()
        data["master_pid"] = bystander.pid  # a reused PID: not mooncake at all
        data["holder_pid"] = local_pool.master_pid  # mooncake, but not this holder
        path.write_text(json.dumps(data))
        pool = LocalPool.attach(path)
        assert not pool.is_alive()
        pool.stop(timeout_s=1.0)
        assert bystander.poll() is None
        assert local_pool.is_alive()
    finally:
        bystander.kill()
        bystander.wait()


def test_is_mooncake_process(local_pool: LocalPool) -> None:
    port = local_pool.master_address.rsplit(":", 1)[1]
    assert local_pool.master_pid is not None
    assert is_mooncake_process(local_pool.master_pid, MASTER_BINARY, f"--rpc_port={port}")
    assert not is_mooncake_process(local_pool.master_pid, MASTER_BINARY, "--rpc_port=1")
    assert not is_mooncake_process(local_pool.master_pid, HOLDER_BINARY, f"--rpc_port={port}")
    assert not is_mooncake_process(os.getpid(), MASTER_BINARY, f"--rpc_port={port}")


def test_keys_are_listed(local_pool: LocalPool) -> None:
    script = (
        "import sys\n"
        "from mooncake.store import MooncakeDistributedStore as S\n"
        "s = S()\n"
        "assert s.setup('127.0.0.1', 'P2PHANDSHAKE', 0, 16 << 20, 'tcp', '', sys.argv[1]) == 0\n"
        "key = 'kvpool/1/org/m/0123456789abcdef/g0.h0.d0.c0.b0/ab'\n"
        "assert s.put(key, b'x') == 0 and s.put('not-kvpool', b'y') == 0\n"
        "s.close()\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, local_pool.master_address], check=True, timeout=60
    )
    # the writer was a pure client: its objects live on in the holder
    assert sorted(master_keys(local_pool.metrics_url)) == [
        "kvpool/1/org/m/0123456789abcdef/g0.h0.d0.c0.b0/ab",
        "not-kvpool",
    ]
    status = pool_status(local_pool)
    assert status.keys == 2 and status.namespaces is not None
    assert status.namespaces.other == 1
    (row,) = status.namespaces.rows
    assert (row.model, row.group, row.keys, row.contents) == ("org/m", 0, 1, 1)
    # Which host holds each key: the holder's, on loopback; a key gone counts nowhere.
    keys = [*master_keys(local_pool.metrics_url), "no-such-key"]
    assert key_hosts(local_pool.metrics_url, keys) == {"127.0.0.1": 2}
    assert status.host_keys == {} and status.host_keys_sampled == 0  # one host: not asked


def test_unhealthy_start_reports_log_tail(pool_factory: PoolFactory, tmp_path: Path) -> None:
    # a holder against a master that is not there never comes up
    with pytest.raises(StoreUnavailable, match=r"mooncake_client .*holder\.log"):
        pool_factory(master_address="127.0.0.1:1", timeout_s=1.0)


def test_missing_binary_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(StoreMissingDependency, match="pip install"):
        find_binary(MASTER_BINARY)


def test_a_segment_below_mooncakes_minimum_is_refused_before_starting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 16 MiB"):
        LocalPool.start(tmp_path, segment_size=MiB)
    assert not (tmp_path / "master.log").exists()  # nothing was started

"""What a restarted single master keeps with Mooncake's snapshots (no HA).

``mooncake_master --enable_snapshot --enable_snapshot_restore`` writes its object
metadata to files every few seconds and reads the last snapshot back at start. But
the restore then erases every object whose read lease has run out, which in a
kvpool pool is every object not being loaded at that moment (leases last
``--lease-ttl-ms``, 2 s by default): the restarted master keeps nothing. Only
Mooncake's test switch ``MOONCAKE_MASTER_SERVICE_SNAPSHOT_TEST_SKIP_CLEANUP``
keeps them (the holder's bytes are still there), and kvpool does not offer a test
switch to users. This test holds both facts, so a Mooncake that changes either
shows here.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.store.conftest import Home
from tests.store.test_ha import client

from kvpool.pool import wait_until
from kvpool.pool.binaries import MASTER_BINARY, find_binary
from kvpool.pool.master_api import master_metrics, master_serving
from kvpool.pool.processes import free_ports

SKIP_CLEANUP = "MOONCAKE_MASTER_SERVICE_SNAPSHOT_TEST_SKIP_CLEANUP"


class SnapshotMaster:
    """One ``mooncake_master`` that snapshots every second into ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.rpc, self.metrics = free_ports(2)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics}"

    def start(self, **env: str) -> None:
        args = [
            find_binary(MASTER_BINARY),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics}",
            "--client_ttl=10",
            "--default_kv_lease_ttl=2000",
            "--enable_snapshot=true",
            "--enable_snapshot_restore=true",
            "--snapshot_object_store_type=local",
            "--snapshot_interval_seconds=1",
        ]
        environ = {**os.environ, "MOONCAKE_SNAPSHOT_LOCAL_PATH": str(self.folder), **env}
        with open(self.folder / "master.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, env=environ)
        assert wait_until(lambda: master_serving(self.metrics_url), 30, step=0.1), (
            "the master did not start"
        )

    def snapshots(self) -> int:
        return int(master_metrics(self.metrics_url, 2.0).get("master_snapshot_success", 0))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[SnapshotMaster]:
    folder = tmp_path / "snapshots"
    folder.mkdir()
    m = SnapshotMaster(folder)
    try:
        yield m
    finally:
        m.kill()


def test_a_master_restored_from_its_snapshot_keeps_no_object_whose_lease_ran_out(
    home: Home, master: SnapshotMaster
) -> None:
    master.start()
    home.up("--master", master.address, "--metrics-url", master.metrics_url)  # a holder

    def snapshot_after_now() -> None:  # one begun after this call, so it holds all so far
        done = master.snapshots()
        assert wait_until(lambda: master.snapshots() >= done + 2, 30, step=0.2)

    assert client(home.pool_file, "put", 20) == 20
    snapshot_after_now()
    # With Mooncake's test switch the restart keeps every object (the holder's bytes
    # are where they were): the snapshot has them.
    master.kill()
    assert not master_serving(master.metrics_url)  # a dead master is not serving
    master.start(**{SKIP_CLEANUP: "1"})
    assert client(home.pool_file, "exists", 20) == 20
    snapshot_after_now()
    # As a user would run it, the restore erases every object whose read lease ran
    # out (2 s here): all of them.
    master.kill()
    master.start()
    log = (master.folder / "master.log").read_text()
    assert log.count("Successfully restored state from snapshot") == 2  # both restarts
    assert client(home.pool_file, "exists", 20) == 0

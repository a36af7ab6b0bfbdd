"""``kvpool up`` / ``status`` / ``down`` as separate processes, with KVPOOL_HOME in tmp."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.factories import key_space
from tests.store.conftest import Home

from kvpool.config import PoolConfig
from kvpool.pool import HOLDER_BINARY, MASTER_BINARY, LocalPool, is_mooncake_process
from kvpool.store.base import Status

PoolFactory = Callable[..., LocalPool]  # the conftest fixture's type


def _running(pool_file: Path) -> list[tuple[str, int, bool]]:
    return list(LocalPool.attach(pool_file).processes())


def test_up_status_down(home: Home) -> None:
    r = home.up()
    assert "kvpool pool is up" in r.stdout
    flag = next(ln for ln in r.stdout.splitlines() if "--kv-transfer-config" in ln)
    config = json.loads(flag.split("'")[1])
    assert config["kv_connector"] == "KVPoolConnector"
    assert config["kv_connector_module_path"] == "kvpool.vllm"
    assert config["kv_connector_extra_config"] == {"pool_file": str(home.pool_file)}

    data = json.loads(home.pool_file.read_text())
    assert data["master_address"].startswith("127.0.0.1:")
    assert data["segment_size"] == 128 << 20
    assert [ok for _, _, ok in _running(home.pool_file)] == [True, True]
    assert data["master_address"] in r.stdout and data["holder_address"] in r.stdout

    s = home.kvpool("status")
    assert s.returncode == 0, s.stderr
    assert data["master_address"] in s.stdout and "128.0 MiB" in s.stdout
    js = json.loads(home.kvpool("status", "--json").stdout)
    assert js["reachable"] and js["capacity_bytes"] == 128 << 20 and len(js["segments"]) == 1

    d = home.kvpool("down")
    assert d.returncode == 0, d.stderr
    assert "stopped" in d.stdout
    assert not home.pool_file.exists()
    port = data["master_address"].rsplit(":", 1)[1]
    assert not is_mooncake_process(data["master_pid"], MASTER_BINARY, f"--rpc_port={port}")
    hport = data["holder_address"].rsplit(":", 1)[1]
    assert not is_mooncake_process(data["holder_pid"], HOLDER_BINARY, f"--port={hport}")


def test_up_twice_is_refused(home: Home) -> None:
    home.up()
    before = home.pool_file.read_text()
    r = home.kvpool("up")
    assert r.returncode == 1
    assert "already running" in r.stderr and len(r.stderr.splitlines()) == 1
    assert home.pool_file.read_text() == before


def test_down_and_status_without_pool(home: Home) -> None:
    for command in ("down", "status"):
        r = home.kvpool(command)
        assert r.returncode == 1
        assert r.stderr.startswith("kvpool: error: no pool") and len(r.stderr.splitlines()) == 1


def test_up_replaces_a_stale_pool_file(home: Home) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    home.path.mkdir(parents=True)
    home.pool_file.write_text(
        json.dumps({"master_address": "127.0.0.1:1", "master_pid": dead.pid, "holder_pid": 0})
    )
    r = home.up()
    assert "replacing stale pool file" in r.stderr
    assert json.loads(home.pool_file.read_text())["master_pid"] != dead.pid


def test_status_of_a_dead_master_exits_1(home: Home) -> None:
    home.up()
    data = json.loads(home.pool_file.read_text())
    os.kill(data["master_pid"], signal.SIGKILL)
    pool = LocalPool.attach(home.pool_file)
    assert pool.holder_running()
    r = home.kvpool("status")
    assert r.returncode == 1
    assert "not answering" in r.stdout and "not answering" in r.stderr
    assert home.kvpool("down").returncode == 0  # still stops the holder


_WRITER = """
import sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", sys.argv[1]) == 0
assert store.put("kvpool-cli-test/object", bytes(range(256)) * 4096) == 0
store.close()
"""

_READER = """
import sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", sys.argv[1]) == 0
data = store.get("kvpool-cli-test/object")
store.close()
sys.exit(0 if data == bytes(range(256)) * 4096 else 3)
"""


def test_object_outlives_its_writer_process(home: Home) -> None:
    home.up()
    master = json.loads(home.pool_file.read_text())["master_address"]
    for script in (_WRITER, _READER):
        r = subprocess.run(
            [sys.executable, "-c", script, master],
            env=home.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr[-2000:]
    js = json.loads(home.kvpool("status", "--json").stdout)
    assert js["keys"] == 1 and js["used_bytes"] >= 1 << 20
    assert js["namespaces"] == {"rows": [], "other": 1}


def test_up_with_master_starts_only_a_holder(home: Home, pool_factory: PoolFactory) -> None:
    master = pool_factory(with_holder=False)
    home.up("--master", master.master_address, "--metrics-url", master.metrics_url)
    data = json.loads(home.pool_file.read_text())
    assert data["master_pid"] is None and data["master_address"] == master.master_address
    assert [role for role, _, ok in _running(home.pool_file) if ok] == ["holder"]
    js = json.loads(home.kvpool("status", "--json").stdout)
    assert js["reachable"] and js["capacity_bytes"] == 128 << 20

    assert home.kvpool("down").returncode == 0
    assert master.master_running()  # not ours to stop


def test_a_second_up_while_one_is_starting_is_refused_and_starts_nothing(home: Home) -> None:
    """Two `kvpool up` at once must not both start a pool (one would be orphaned):
    the one that finds the start lock held says so and starts nothing."""
    import fcntl

    home.path.mkdir(parents=True, exist_ok=True)
    lock = home.path / "pool.json.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a first `up` between its check and its file
        r = home.kvpool("up", "--segment-size", "128MB")
    assert r.returncode == 1
    assert "another `kvpool up` is starting" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not home.pool_file.exists()
    home.up()  # the lock is free again: a pool starts
    assert home.pool_file.exists()


def test_up_on_an_address_this_machine_lacks_says_which_and_starts_nothing(home: Home) -> None:
    r = home.kvpool("up", "--host", "192.0.2.1", "--segment-size", "128MB")  # TEST-NET-1
    assert r.returncode == 2  # bad input
    assert "--host '192.0.2.1' is not an IPv4 address of this machine" in r.stderr
    assert len(r.stderr.splitlines()) == 1 and not home.pool_file.exists()


def test_a_pool_file_of_another_host_makes_clients_advertise_their_own_address(
    tmp_path: Path,
) -> None:
    from kvpool.config import load_config, route_address

    pool_file = tmp_path / "pool.json"
    data = {"master_address": "127.0.0.1:50051", "local_hostname": "auto"}
    pool_file.write_text(json.dumps(data))
    assert (
        load_config(
            {"pool_file": str(pool_file)}, env={"KVPOOL_HOME": "/nonexistent/kvpool-test-home"}
        ).local_hostname
        == "127.0.0.1"
    )
    assert route_address("127.0.0.1:1") == "127.0.0.1"


def test_up_with_a_secret_keeps_it_in_an_owner_only_pool_file(
    home: Home, pool_factory: PoolFactory
) -> None:
    """``--secret`` makes a secret (never printed) into a 0600 pool file; a holder
    joining with ``--master`` takes the first host's from $KVPOOL_POOL_SECRET, so
    engines reading either pool file sign alike."""
    from kvpool.config import load_config

    r = home.up("--secret")
    data = json.loads(home.pool_file.read_text())
    secret = data["pool_secret"]
    assert len(secret) == 64 and bytes.fromhex(secret)
    assert home.pool_file.stat().st_mode & 0o777 == 0o600
    assert secret not in r.stdout + r.stderr and "signed" in r.stdout
    assert (
        load_config(
            {"pool_file": str(home.pool_file)}, env={"KVPOOL_HOME": "/nonexistent/kvpool-test-home"}
        ).pool_secret
        == secret
    )
    assert home.kvpool("down").returncode == 0

    master = pool_factory(with_holder=False)
    joining = Home(home.path.parent / "second-host")
    joining.env["KVPOOL_POOL_SECRET"] = secret
    joining.up("--secret", "--master", master.master_address)
    assert json.loads(joining.pool_file.read_text())["pool_secret"] == secret
    assert joining.kvpool("down").returncode == 0

    joining.env["KVPOOL_POOL_SECRET"] = "not-hex"
    bad = joining.kvpool("up", "--secret", "--master", master.master_address)
    assert bad.returncode != 0 and "pool_secret must be" in bad.stderr
    assert "not-hex" not in bad.stderr and not joining.pool_file.exists()


def test_status_shows_the_oldest_objects_age_and_purge_removes_objects_older_than(
    home: Home,
) -> None:
    """Objects written through the real writer (``FramedStore`` on Mooncake) carry
    their write time: ``kvpool status`` shows the oldest object's age, and ``kvpool
    purge --older-than`` removes those written before the cutoff and nothing else
    (newer objects, a key that is not kvpool's)."""
    import time

    from kvpool.layout import Layout
    from kvpool.pool import LocalPool, master_keys
    from kvpool.store.framed import FramedStore
    from kvpool.store.mooncake import MooncakeStore

    home.up()
    pool = LocalPool.attach(home.pool_file)
    layout = Layout.create(groups=["gqa:2"])
    space = key_space(layout, "org/a")  # fmt: skip
    old = [space.key(c, bytes([n]) * 8) for c in layout.holdings(0, 0) for n in range(3)]
    new = [space.key(c, bytes([n]) * 8) for c in layout.holdings(0, 0) for n in range(3, 6)]
    buf = bytearray(4096)
    seg = [(ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)), len(buf))]
    two_hours_ago = time.time() - 7200
    with MooncakeStore(pool.config()) as store:
        then = FramedStore(store, space.fingerprint, clock=lambda: two_hours_ago)
        assert then.batch_put(old, [seg] * len(old)) == [Status.OK] * len(old)
        now = FramedStore(store, space.fingerprint)
        assert now.batch_put(new, [seg] * len(new)) == [Status.OK] * len(new)
        assert store.batch_put(["someone-else/object"], [seg]) == [Status.OK]
    js = json.loads(home.kvpool("status", "--json").stdout)
    assert js["ages_sampled"] == len(old) + len(new)
    assert 7200 <= js["oldest_object_age_s"] < 7200 + 60
    shown = home.kvpool("status")
    assert "oldest" in shown.stdout and "written 2.0 h ago" in shown.stdout, shown.stdout

    dry = home.kvpool("purge", "--older-than", "1h", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"would remove {len(old)} objects of any tenant or model written over" in dry.stdout
    r = home.kvpool("purge", "--older-than", "1h")
    assert r.returncode == 0, r.stderr
    assert f"removed {len(old)} objects" in r.stdout
    assert set(master_keys(pool.metrics_url)) == {*new, "someone-else/object"}
    r = home.kvpool("purge", "--model", "org/a", "--older-than", "1h")
    assert r.returncode == 0 and "no object of model org/a written over 1.0 h ago" in r.stdout
    bad = home.kvpool("purge", "--older-than", "2 weeks")
    assert bad.returncode == 2 and "a duration is a number and a unit" in bad.stderr


def test_purge_removes_one_models_or_one_tenants_objects_and_nothing_else(home: Home) -> None:
    """kvpool purge: a dry run counts, a real one removes the model's objects only
    (another model's, another tenant's, and keys that are not kvpool's, stay), while
    an engine-like reader holds a lease on one of them (removed once the lease
    ends); ``--tenant`` then removes one tenant's objects only."""
    from kvpool.layout import Layout
    from kvpool.pool import LocalPool, master_keys
    from kvpool.store.mooncake import MooncakeStore

    home.up("--lease-ttl-ms", "500")
    pool = LocalPool.attach(home.pool_file)
    layout = Layout.create(groups=["gqa:2"])
    spaces = {
        name: key_space(layout, m, tenant=t)
        for name, m, t in (("org/a", "org/a", ""), ("org/b", "org/b", ""),
                           ("team-t", "org/b", "team-t"))
    }  # fmt: skip
    keys = {
        m: [s.key(c, bytes([n]) * 8) for c in layout.holdings(0, 0) for n in range(5)]
        for m, s in spaces.items()
    }
    buf = bytearray(4096)
    addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    with MooncakeStore(pool.config()) as store:
        everything = [*keys["org/a"], *keys["org/b"], *keys["team-t"], "someone-else/object"]
        assert store.batch_put(everything, [[(addr, len(buf))]] * len(everything)) == [
            Status.OK
        ] * len(everything)
        dry = home.kvpool("purge", "--model", "org/a", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "would remove 10 objects of model org/a" in dry.stdout
        assert len(master_keys(pool.metrics_url)) == 31  # nothing removed
        # A reader's lease on one object: the purge waits for it, never forces.
        store.batch_get(keys["org/a"][:1], [[(addr, len(buf))]])
        r = home.kvpool("purge", "--model", "org/a", "--wait", "10")
        assert r.returncode == 0, r.stderr
        assert "removed 10 objects of model org/a" in r.stdout
    assert set(master_keys(pool.metrics_url)) == {
        *keys["org/b"],
        *keys["team-t"],
        "someone-else/object",
    }
    status = home.kvpool("status", "--json")
    rows = json.loads(status.stdout)["namespaces"]["rows"]
    assert sorted((r["tenant"], r["model"], r["keys"], r["bytes"]) for r in rows) == [
        ("", "org/b", 10, 10 * len(buf)),
        ("team-t", "org/b", 10, 10 * len(buf)),
    ]
    r = home.kvpool("purge", "--tenant", "team-t")
    assert r.returncode == 0, r.stderr
    assert "removed 10 objects of tenant team-t" in r.stdout
    assert set(master_keys(pool.metrics_url)) == {*keys["org/b"], "someone-else/object"}
    bad = home.kvpool("purge")
    assert bad.returncode == 2 and "--fingerprint and/or --older-than, or --all" in bad.stderr
    bad = home.kvpool("purge", "--tenant", "_t")
    assert bad.returncode == 2 and "tenant name '_t' must be 1-64 letters" in bad.stderr


def test_up_with_quotas_starts_a_holder_per_tenant_and_status_shows_each_share(
    home: Home,
) -> None:
    r = home.up("--quota", "teamA=32MB", "--quota", "teamB=48MB")
    assert "tenant teamA" in r.stdout and "tenant teamB" in r.stdout
    data = json.loads(home.pool_file.read_text())
    assert data["quotas"] == {"teamA": 32 << 20, "teamB": 48 << 20}
    assert sorted(data["tenant_holder_pids"]) == ["teamA", "teamB"]
    roles = sorted(role for role, _, ok in _running(home.pool_file) if ok)
    assert roles == ["holder", "holder-teamA", "holder-teamB", "master"]
    js = json.loads(home.kvpool("status", "--json").stdout)
    assert js["capacity_bytes"] == 128 << 20 and len(js["segments"]) == 3  # one pool's memory
    assert js["quotas"]["teamA"] == {"used_bytes": 0, "quota_bytes": int((32 << 20) * 0.85)}
    assert js["quotas"]["default"]["quota_bytes"] == int((48 << 20) * 0.85)  # the rest
    s = home.kvpool("status")
    assert "quota teamB" in s.stdout and "quota (no tenant)" in s.stdout, s.stdout
    # purge --tenant: the master lists no key of a quota tenant; a client of it removes
    from kvpool.store.mooncake import MooncakeStore

    pool = LocalPool.attach(home.pool_file)
    buf = bytearray(1 << 20)
    addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    keys = [f"kvpool/4/!x/m/{i}" for i in range(4)]
    stores = {t: MooncakeStore(pool.config().for_tenant(t)) for t in ("teamA", "teamB")}
    try:
        for store in stores.values():
            assert store.batch_put(keys, [[(addr, len(buf))]] * 4) == [Status.OK] * 4
        dry = home.kvpool("purge", "--tenant", "teamA", "--dry-run")
        assert "would remove every kvpool object of tenant teamA (4.0 MiB" in dry.stdout, dry
        assert stores["teamA"].batch_exists(keys) == [Status.OK] * 4
        r = home.kvpool("purge", "--tenant", "teamA")
        assert r.returncode == 0 and "removed 4 objects of tenant teamA" in r.stdout, r
        assert stores["teamA"].batch_exists(keys) == [Status.MISSING] * 4
        assert stores["teamB"].batch_exists(keys) == [Status.OK] * 4  # another tenant's stay
        mixed = home.kvpool("purge", "--tenant", "teamB", "--model", "m")
        assert mixed.returncode != 0 and "only all of its objects" in mixed.stderr
    finally:
        for store in stores.values():
            store.close()
    d = home.kvpool("down")
    assert d.returncode == 0, d.stderr
    assert "holder-teamA" in d.stdout and not home.pool_file.exists()
    for tenant, address in (
        PoolConfig(tenant_holders=data["tenant_holders"]).holders_by_tenant().items()
    ):
        port = address.rsplit(":", 1)[1]
        pid = data["tenant_holder_pids"][tenant]
        assert not is_mooncake_process(pid, HOLDER_BINARY, f"--port={port}"), tenant


@pytest.mark.parametrize(
    ("quotas", "says"),
    [
        (["teamA"], "TENANT=SIZE"),
        (["teamA=1MB"], "at least 16MiB"),
        (["teamA=64MB", "teamB=64MB"], "leave at least 16MiB"),
        (["teamA=32MB", "teamA=48MB"], "two quotas"),
        (["default=32MB"], "engines of no tenant"),
        (["_x=32MB"], "tenant name"),
        (["teamA=32MB", "--disk", "/tmp/kvpool-disk-never-made"], "disk do not go together"),
    ],
)
def test_quotas_that_do_not_fit_are_refused_saying_what_to_change(
    home: Home, quotas: list[str], says: str
) -> None:
    args = [a if a.startswith("-") or "/" in a else f"--quota={a}" for a in quotas]
    r = home.kvpool("up", "--segment-size", "128MB", *args)
    assert r.returncode != 0 and says in r.stderr, r.stderr
    assert not home.pool_file.exists()

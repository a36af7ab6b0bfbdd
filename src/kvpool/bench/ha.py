"""What HA masters cost and what a failover takes, measured on pools this bench starts.

    run_ha_bench(workdir, objects, size, batches, failovers) -> HaBench
        starts a pool of one master and an HA pool (etcd, two masters with the
        oplog; ``kvpool up --ha``), each with a holder of the same size, and:
        - puts: ``batches`` batches of ``objects`` objects of ``size`` bytes to
          each pool, alternating, through kvpool's Mooncake client; the median
          time of a batch on each (the HA master writes each object's metadata to
          its log in etcd as well); and how long after each HA batch's put
          returned its entries were in etcd (the log is written after the put
          answers: ``kvpool.pool.ha``)
        - failovers: ``failovers`` times, once every put so far is in the log,
          SIGKILL the leader and time, from the kill, the first get of a stored
          object that returns its bytes; then how many of the objects put so far
          the new leader still has (exists), and whether it takes new puts; the
          killed master is started again (standby)

Pure client work on loopback: no engine. The HA client connects through etcd (a
process is a client of one HA pool's etcd at most: one HA pool per run).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.errors import StoreError
from kvpool.pool.ha import log_durable_seq
from kvpool.pool.local import HA_MIN_CLIENT_TTL, LocalPool
from kvpool.store.base import Status
from kvpool.store.mooncake import MooncakeStore

__all__ = ["Failover", "HaBench", "run_ha_bench"]

GET_EVERY_S = 0.05  # how often a get is tried during a failover
FAILOVER_LIMIT_S = 60.0  # a failover not done by then is reported as such
LOG_EVERY_S = 0.002  # how often etcd is asked whether the log has the puts
LOG_LIMIT_S = 10.0  # puts whose entries are not in etcd by then fail the bench


@dataclass(frozen=True, slots=True)
class Failover:
    killed: str  # the master killed ("master" or "master-2")
    first_get_s: float | None  # from the kill to the first get that returned the bytes
    kept: int  # objects put before the kill that the new leader has
    objects: int  # objects put before the kill
    put_after: bool  # a put after the failover stored its object


@dataclass(frozen=True, slots=True)
class HaBench:
    objects: int  # per batch
    size: int  # bytes per object
    batches: int
    single_put_s: list[float] = field(default_factory=list)  # per batch, one master
    ha_put_s: list[float] = field(default_factory=list)  # per batch, HA masters
    log_lag_s: list[float] = field(default_factory=list)  # per HA batch: put to logged
    failovers: list[Failover] = field(default_factory=list)

    @property
    def put_ratio(self) -> float:
        """Median HA batch time over median single-master batch time (1.0: no cost)."""
        return statistics.median(self.ha_put_s) / statistics.median(self.single_put_s)


def run_ha_bench(
    workdir: Path | None = None,
    objects: int = 64,
    size: int = 64 << 10,
    batches: int = 20,
    failovers: int = 2,
) -> HaBench:
    """See the module docstring."""
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-ha-") as tmp:
        home = Path(workdir or tmp)
        segment = max(256 << 20, 2 * objects * size * (batches + failovers + 1))
        ttl = HA_MIN_CLIENT_TTL  # both pools alike
        single = LocalPool.start(home / "single", segment_size=segment, client_ttl=ttl)
        try:
            ha = LocalPool.start(home / "ha", segment_size=segment, client_ttl=ttl, ha=True)
        except BaseException:
            single.stop()
            raise
        try:
            return _run(single, ha, objects, size, batches, failovers)
        finally:
            ha.stop(kill=True)
            single.stop(kill=True)


def _run(
    single: LocalPool, ha: LocalPool, objects: int, size: int, batches: int, failovers: int
) -> HaBench:
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    segs = [[(data.ctypes.data, data.nbytes)]] * objects
    result = HaBench(objects, size, batches)
    stored: list[str] = []
    with MooncakeStore(single.config()) as one, MooncakeStore(ha.config()) as two:
        for b in range(batches + 1):  # batch 0 warms both up: not counted
            for store, times, name in ((one, result.single_put_s, "single"),
                                       (two, result.ha_put_s, "ha")):  # fmt: skip
                keys = [f"bench-ha/{name}/{b}/{i}" for i in range(objects)]
                logged = log_durable_seq(ha.etcd_endpoint) if name == "ha" else 0
                t0 = time.perf_counter()
                got = store.batch_put(keys, segs)
                took = time.perf_counter() - t0
                if any(s is not Status.OK for s in got):
                    raise StoreError(
                        f"a put to the {name} pool failed: {sorted({s.value for s in got})}"
                    )
                if name == "ha":
                    lag = _until_logged(ha, logged + objects)
                    stored += keys
                if b:
                    times.append(took)
                    if name == "ha":
                        result.log_lag_s.append(lag)
        for _ in range(failovers):
            result.failovers.append(_failover(ha, two, stored, data, segs[:1]))
    return result


def _until_logged(pool: LocalPool, seq: int) -> float:
    """Seconds until the HA pool's log in etcd reaches entry ``seq`` (polled: etcd
    is asked, nothing tells); ``StoreError`` past ``LOG_LIMIT_S``."""
    t0 = time.perf_counter()
    while (now := log_durable_seq(pool.etcd_endpoint)) < seq:
        if time.perf_counter() - t0 > LOG_LIMIT_S:
            raise StoreError(
                f"the HA leader's log in etcd stopped at entry {now}, short of {seq}, "
                f"{LOG_LIMIT_S:.0f} s after the puts; see {pool.home}/master*.log"
            )
        time.sleep(LOG_EVERY_S)
    return time.perf_counter() - t0


def _failover(
    pool: LocalPool, store: MooncakeStore, stored: list[str], data: np.ndarray, seg: list[Any]
) -> Failover:
    out = np.zeros_like(data)
    probe = stored[len(stored) // 2]
    killed = pool.kill_leader()
    t0 = time.monotonic()
    first: float | None = None
    while first is None and time.monotonic() - t0 < FAILOVER_LIMIT_S:
        out[:] = 0
        got = store.batch_get([probe], [[(out.ctypes.data, out.nbytes)]])
        if got == [Status.OK] and np.array_equal(out, data):
            first = time.monotonic() - t0
        else:
            time.sleep(GET_EVERY_S)  # a poll interval: no event says the leader is back
    kept = 0
    for i in range(0, len(stored), 4096):
        kept += store.batch_exists(stored[i : i + 4096]).count(Status.OK)
    key = f"bench-ha/after-{killed}-{len(stored)}"
    logged = log_durable_seq(pool.etcd_endpoint)
    put_after = store.batch_put([key], seg) == [Status.OK]
    if put_after:
        stored.append(key)
        _until_logged(pool, logged + 1)  # in the log before the next kill
    pool.restart_ha_master(killed)  # back as the standby for the next failover
    return Failover(killed, first, kept, len(stored) - put_after, put_after)

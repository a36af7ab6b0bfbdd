"""Fault rows of HA masters (``kvpool up --ha``): the leader, the standby, both, etcd.

Each row serves one seeded prompt phase after phase from an engine whose local
prefix cache is off, so that every phase asks the pool: a phase that loads the
seeded prefix is a hit, one that recomputes it a miss. Outputs are checked against
the baseline in every phase. Measured: seconds from the fault to the first hit,
and the share of the pool's keys before the fault that the (new) leader still
lists. Mooncake keeps the leader's log of object metadata in etcd, so a standby,
and even a master restarted after both died, comes back with the objects.
"""

from __future__ import annotations

import time
from typing import Any

from kvpool.chaos.harness import (
    PREFIX,
    ChaosContext,
    RowEnv,
    RowFailed,
    cause_counts,
    pool_keys,
)
from kvpool.pool.local import HA_MIN_CLIENT_TTL

__all__ = [
    "FAILOVER_S",
    "etcd_killed",
    "leader_killed",
    "masters_killed",
    "standby_killed",
]

FAILOVER_S = 15.0  # a killed leader's standby serves within this (measured: ~10 s)
ETCD_DOWN_S = 8.0  # how long etcd stays dead in its row (the leader steps down at ~5 s)
PHASES = 200  # phases an engine may run; a row stops at its first hit after the fault
PHASE_EVERY_S = 0.5  # phases start at most this often: 100 s of phases at least


class _Phases:
    """An engine serving the seeded prompt phase after phase, each output checked.
    Phases start at most every ``PHASE_EVERY_S``: a miss that fails fast takes a
    few ms, and the engine's phases would run out before the pool comes back."""

    def __init__(self, ctx: ChaosContext, env: RowEnv, name: str) -> None:
        self.ctx = ctx
        self.pool = env.pool(ha=True, client_ttl=HA_MIN_CLIENT_TTL)
        ctx.seed_pool(self.pool)
        spec = ctx.spec(self.pool, [[ctx.families[0][0]]] * PHASES)
        spec["prefix_caching"] = False  # every phase asks the pool
        self.session = ctx.session(spec, name)
        self._last = 0.0
        self.stats: dict[str, Any] = {}  # the connector's counters after the last phase

    def __enter__(self) -> _Phases:
        self.session.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.__exit__(*exc)

    def hit(self) -> bool:
        """Run one phase; whether it loaded the seeded prefix from the pool."""
        wait = self._last + PHASE_EVERY_S - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # a sampling interval, not a wait for an event
        self._last = time.monotonic()
        out = self.session.next_phase()
        self.stats = out["connector"]
        self.ctx.check_outputs(out["results"], [self.ctx.families[0][0]])
        return int(out["results"][0]["cached_tokens"]) >= PREFIX

    def until_hit(self, since: float, limit_s: float) -> float:
        """Phases until one hits; seconds from ``since`` to that phase's start (its
        lookup, the first that found the prefix, is asked as it starts).
        ``RowFailed`` past ``limit_s``."""
        while True:
            sent = time.monotonic() - since
            if sent > limit_s:
                raise RowFailed(
                    f"no hit within {limit_s:.0f} s of the fault ({sent:.1f} s); the "
                    f"engine's counters: {_counters(self.stats)}; the pool lists "
                    f"{len(pool_keys(self.pool))} keys, masters {self.pool.master_roles()}"
                )
            if self.hit():
                return sent

    def first_hit(self) -> set[str]:
        """The seeded prefix loads before the fault; the pool's keys then."""
        if not self.hit():
            raise RowFailed("the seeded prefix was not loaded before the fault")
        return set(pool_keys(self.pool))

    def finish(self) -> dict[str, Any]:
        """The engine's connector counters at its end."""
        stats: dict[str, Any] = self.session.finish()["connector"]
        return stats

    def kept(self, before: set[str]) -> tuple[int, float]:
        """How many of ``before`` the leader lists now, and as a share."""
        kept = len(before & set(pool_keys(self.pool)))
        return kept, kept / max(1, len(before))


def _counters(stats: dict[str, Any]) -> str:
    """The connector counters that tell a miss's cause."""
    names = ("lookups", "hit_tokens", "chunks_saved", "chunks_loaded", "saves_refused")
    out = [f"{n} {stats.get(n)}" for n in names if n in stats]
    for n in ("lookup_failures", "lookup_server_errors", "failures"):
        if stats.get(n):
            out.append(f"{n} {cause_counts(stats[n])}")
    return ", ".join(out)


def leader_killed(ctx: ChaosContext, env: RowEnv) -> str:
    with _Phases(ctx, env, "leader-killed") as run:
        before = run.first_hit()
        t0 = time.monotonic()
        name = run.pool.kill_leader()
        took = run.until_hit(t0, FAILOVER_S)
        stats = run.finish()
    kept, share = run.kept(before)
    if share < 0.99:
        raise RowFailed(f"the new leader lists {kept} of the {len(before)} keys before the kill")
    failed = cause_counts(stats.get("lookup_failures"))
    return (
        f"{name} (leader) killed: first hit {took:.1f} s later, outputs equal, lookups "
        f"failed meanwhile: {failed}; {kept}/{len(before)} keys kept ({share:.0%})"
    )


def standby_killed(ctx: ChaosContext, env: RowEnv) -> str:
    with _Phases(ctx, env, "standby-killed") as run:
        before = run.first_hit()
        name = run.pool.kill_standby()
        hits = sum(run.hit() for _ in range(3))
        stats = run.finish()
    if hits < 3:
        raise RowFailed(f"{3 - hits} of 3 phases missed with only the standby gone")
    if stats.get("lookup_failures"):
        raise RowFailed(f"lookups failed: {cause_counts(stats['lookup_failures'])}")
    kept, _ = run.kept(before)
    return f"{name} (standby) killed: 3 of 3 phases hit, no lookup failed, {kept} keys kept"


def etcd_killed(ctx: ChaosContext, env: RowEnv) -> str:
    with _Phases(ctx, env, "etcd-killed") as run:
        before = run.first_hit()
        t0 = time.monotonic()
        run.pool.kill_etcd()
        down = [run.hit()]
        while time.monotonic() - t0 < ETCD_DOWN_S:
            down.append(run.hit())
        roles = run.pool.master_roles()
        t1 = time.monotonic()
        run.pool.restart_etcd()
        took = run.until_hit(t1, 2 * FAILOVER_S)
        run.finish()
    kept, share = run.kept(before)
    if share < 0.99:
        raise RowFailed(f"{kept} of the {len(before)} keys listed after etcd came back")
    return (
        f"etcd dead {ETCD_DOWN_S:.0f} s: {sum(down)} of {len(down)} phases hit, outputs "
        f"equal, masters then {sorted(roles.values())}; etcd back: first hit {took:.1f} s "
        f"later, {kept}/{len(before)} keys kept"
    )


def masters_killed(ctx: ChaosContext, env: RowEnv) -> str:
    with _Phases(ctx, env, "masters-killed") as run:
        before = run.first_hit()
        run.pool.kill_ha_master("master")
        run.pool.kill_ha_master("master-2")
        missed = not run.hit()
        t0 = time.monotonic()
        run.pool.restart_ha_master("master")
        took = run.until_hit(t0, 2 * FAILOVER_S)
        run.finish()
    kept, share = run.kept(before)
    if not missed:
        raise RowFailed("a phase hit with both masters dead")
    return (
        f"both masters killed: the phase missed, outputs equal; one restarted: first hit "
        f"{took:.1f} s later, {kept}/{len(before)} keys kept ({share:.0%}: the log in etcd)"
    )

"""The fault matrix: one row per fault, each against a fresh real pool.

    ROWS                         every row, in run order: name, fault, promise
    ChaosContext(workdir)        what the rows share, made once: a tiny random Llama,
                                 prompt families, the outputs of a run *without* the
                                 connector (the baseline), and the objects a clean
                                 engine saved (seeded into each row's pool)
    run_row(ctx, row) -> Outcome one row on its own pool, stopped afterwards
    run_matrix(workdir, names=None, progress=None) -> list[Outcome]

The harness (context, row records, helpers) is ``kvpool.chaos.harness``; the rows
are ``pool_rows`` (the pool's processes, memory and bytes), ``engine_rows``
(the engine's lookup socket, config and process) and ``ha_rows`` (HA masters:
the leader, the standby, both, etcd).

The promise every engine row checks: the engine process stays up, every request
completes, its greedy tokens and logprobs equal the baseline's, the fault shows
in the connector's counters or log with its cause, and, where the fault ends,
service recovers (new saves land in the pool, or a fresh engine hits again).
A failed check raises ``RowFailed``; ``run_row`` turns it into a failed Outcome.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvpool.chaos import engine_rows, ha_rows, pool_rows
from kvpool.chaos.harness import ChaosContext, Outcome, Progress, Row, RowFailed, run_row
from kvpool.errors import ConfigError

__all__ = ["ROWS", "ChaosContext", "Outcome", "Row", "RowFailed", "run_matrix", "run_row"]

ROWS: list[Row] = [
    Row(
        "master-restart",
        "master killed mid-workload, then restarted",
        "misses while down; saves land again after restart",
        pool_rows.master_restart,
        1,
    ),
    Row(
        "holder-killed",
        "holder (mooncake_client) killed before loads",
        "failed loads recomputed; saves land on a new holder",
        pool_rows.holder_killed,
        1,
    ),
    Row(
        "holder-frozen-zero-copy",
        "holder cut off (SIGSTOP), zero_copy on",
        "loads fail at Mooncake's RPC timeout (~30 s), recomputed",
        pool_rows.holder_frozen_zero_copy,
        1,
    ),
    Row(
        "holder-frozen",
        "holder host cut off (SIGSTOP): gets hang",
        "loads abandoned at the deadline, recomputed",
        pool_rows.holder_frozen,
        1,
    ),
    Row(
        "pool-full",
        "pool filled to its high watermark by other tenants",
        "eviction/back-off, never a wrong byte",
        pool_rows.pool_full,
        2,
    ),
    Row(
        "lease",
        "read lease blocks removal",
        "leased reported; forced remove works",
        pool_rows.lease,
        0,
    ),
    Row(
        "evicted-before-load",
        "objects vanish between lookup and load",
        "recomputed once, saved again",
        pool_rows.evicted_before_load,
        1,
    ),
    Row(
        "aliased-object",
        "another key's valid object under a live key",
        "rejected (key digest), removed once leases end",
        pool_rows.aliased,
        1,
    ),
    Row(
        "flipped-byte",
        "one payload byte flipped in every object",
        "rejected (checksum), removed once leases end",
        pool_rows.flipped,
        1,
    ),
    Row(
        "two-configs",
        "bfloat16 and float32 engines share one pool",
        "no cross hits, no failed loads",
        pool_rows.two_configs,
        2,
    ),
    Row(
        "lookup-stopped",
        "lookup server stopped, then restarted",
        "miss within the deadline; hits again",
        engine_rows.lookup_stopped,
        0,
    ),
    Row(
        "lookup-slow",
        "lookup answers slower than the deadline",
        "misses at the deadline",
        engine_rows.lookup_slow,
        1,
    ),
    Row(
        "lookup-garbage",
        "random bytes on the engine's lookup socket",
        "server keeps serving; next lookup hits",
        engine_rows.lookup_garbage,
        1,
    ),
    Row(
        "load-fails-always",
        "pool lists objects that never load",
        "each chunk tried once, no loop",
        pool_rows.load_fails_always,
        1,
    ),
    Row(
        "bad-config",
        "pool file missing (serve without it) or malformed (stop at start)",
        "one clear line each; a missing file serves without the pool",
        engine_rows.bad_config,
        2,
    ),
    Row(
        "engine-killed",
        "engine killed with saves queued",
        "restarted engine recomputes and saves",
        engine_rows.engine_killed,
        2,
    ),
    Row(
        "ha-leader-killed",
        "HA masters: the leader killed while the engine serves",
        f"misses until the standby leads (< {ha_rows.FAILOVER_S:.0f} s), >= 99% objects kept",
        ha_rows.leader_killed,
        1,
    ),
    Row(
        "ha-standby-killed",
        "HA masters: the standby killed",
        "nothing: every phase hits, no lookup fails",
        ha_rows.standby_killed,
        1,
    ),
    Row(
        "ha-etcd-killed",
        f"HA masters: etcd killed for {ha_rows.ETCD_DOWN_S:.0f} s while the leader lives",
        "the leader steps down (misses); etcd back: hits, >= 99% objects kept",
        ha_rows.etcd_killed,
        1,
    ),
    Row(
        "ha-masters-killed",
        "HA masters: both killed, one restarted",
        "misses while none runs; the restarted one replays etcd's log: hits again",
        ha_rows.masters_killed,
        1,
    ),
]


def run_matrix(
    workdir: Path, names: Sequence[str] | None = None, progress: Progress | None = None
) -> list[Outcome]:
    """Run the named rows (all by default) in ``ROWS`` order."""
    by_name = {r.name: r for r in ROWS}
    unknown = sorted(set(names or ()) - set(by_name))
    if unknown:
        raise ConfigError(f"unknown row(s) {', '.join(unknown)}; rows: {', '.join(by_name)}")
    rows = [r for r in ROWS if names is None or r.name in names]
    report = progress or (lambda *_: None)
    ctx = ChaosContext(workdir, report)
    report("set-up", 0, 1)
    ctx.prepare()
    report("set-up", 1, 1)
    out = []
    for i, row in enumerate(rows):
        report("rows", i, len(rows))
        out.append(run_row(ctx, row))
    report("rows", len(rows), len(rows))
    return out

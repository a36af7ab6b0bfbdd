"""Fault rows of the pool: its processes, its memory, and the bytes it holds.

Master restarted, holder killed or frozen, a full pool, objects evicted between
lookup and load or that never load, objects rewritten under live keys (another
key's object, a flipped byte), two configs in one pool, a read lease that blocks
a remove. Each row takes the shared ``ChaosContext`` and its own ``RowEnv`` and
returns what it observed, or raises ``RowFailed`` (``kvpool.chaos.harness``).
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from kvpool.chaos.harness import (
    FAULTS,
    PREFIX,
    ChaosContext,
    RowEnv,
    RowFailed,
    cause_counts,
    count_lines,
    failure_counts,
    pool_keys,
    raw_client,
    run_until_saved,
)
from kvpool.demo.run import outputs_match
from kvpool.demo.session import EngineSession
from kvpool.keys import parse_key
from kvpool.pool import LocalPool, master_metrics, wait_until


def master_restart(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    ctx.seed_pool(pool)
    f = ctx.families
    spec = ctx.spec(pool, [f[0], f[2], f[3], f[4], f[5]])
    with ctx.session(spec, "master-restart") as s:
        p0 = s.next_phase()
        ctx.check_outputs(p0["results"], f[0])
        hit = p0["results"][0]["cached_tokens"]
        pool.kill_master()
        p1 = s.next_phase()
        ctx.check_outputs(p1["results"], f[2])
        misses = p1["connector"].get("lookup_failures") or {}
        pool.restart_master()
        new, secs = run_until_saved(s, pool, 3, set())
        log = s.log()
        s.finish()
    if hit < PREFIX:
        raise RowFailed(f"the seeded prefix was not loaded before the fault ({hit} tokens)")
    if not misses:  # the fault must show where an operator looks: lookups failed
        raise RowFailed("the master was down, yet no lookup was counted as failed")
    if not new:
        raise RowFailed("no save reached the restarted master")
    causes = cause_counts(misses)
    return (
        f"before: {hit} tokens from the pool; master down: outputs equal, lookups that "
        f"failed: {causes}, {count_lines(log, 'pool put failed')} put back-offs; restarted: "
        f"{new} objects saved within {secs:.1f} s"
    )


def holder_killed(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    ctx.seed_pool(pool)
    f = ctx.families
    spec = ctx.spec(pool, [f[0], f[2], f[3], f[4]], hold=True)
    with ctx.session(spec, "holder-killed") as s:
        s.ready()
        pool.kill_holder()
        p0 = s.next_phase()
        ctx.check_outputs(p0["results"], f[0])
        stats = p0["connector"]
        pool.restart_holder()
        new, secs = run_until_saved(s, pool, 3, set(pool_keys(pool)))
        s.finish()
    if not stats.get("failures"):  # its objects were on the dead holder: loads failed
        raise RowFailed(f"the holder was dead, yet no load failure was counted: {stats}")
    if not new:
        raise RowFailed("no save landed after the holder came back")
    return (
        f"holder gone: outputs equal, store failures: {failure_counts(stats)}, "
        f"{stats.get('hit_tokens', 0)} hit tokens looked up; new holder: {new} objects "
        f"saved within {secs:.1f} s"
    )


ZERO_COPY_STALL_S = 30.0  # Mooncake's RPC timeout to a same-host holder (measured)


@contextlib.contextmanager
def frozen_phase(
    ctx: ChaosContext, env: RowEnv, name: str, **extra: Any
) -> Iterator[tuple[LocalPool, EngineSession, dict[str, Any]]]:
    """An engine's first phase run while the holder is stopped (SIGSTOP), outputs
    checked: (pool, the engine session, the phase's result)."""
    # A long client TTL keeps the frozen holder's segment listed, as a master that
    # has not noticed a cut-off host yet: lookups hit, and the loads hang.
    pool = env.pool(client_ttl=60)
    ctx.seed_pool(pool)
    f = ctx.families
    spec = ctx.spec(pool, [f[0], f[2], f[3], f[4]], hold=True, **extra)
    with ctx.session(spec, name) as s:
        s.ready()
        pool.freeze_holder()
        try:
            p0 = s.next_phase()
        finally:
            pool.thaw_holder()
        ctx.check_outputs(p0["results"], f[0])
        yield pool, s, p0


def holder_frozen(ctx: ChaosContext, env: RowEnv) -> str:
    timeout_s = 2.0
    with frozen_phase(ctx, env, "holder-frozen", load_timeout_s=timeout_s) as (pool, s, p0):
        stats = p0["connector"]
        slowest = max(r["total_s"] for r in p0["results"])
        new, secs = run_until_saved(s, pool, 3, set(pool_keys(pool)))
        s.finish()
    if not stats.get("loads_timed_out"):
        raise RowFailed(f"no load timed out (failures: {failure_counts(stats)})")
    if slowest > timeout_s + 10:
        raise RowFailed(f"a request took {slowest:.1f} s: the load deadline did not bound it")
    if not new:
        raise RowFailed("no save landed after the holder thawed")
    return (
        f"holder frozen: {stats['loads_timed_out']} load(s) abandoned at {timeout_s:.0f} s, "
        f"slowest request {slowest:.1f} s, outputs equal; thawed: {new} objects saved "
        f"within {secs:.1f} s"
    )


def holder_frozen_zero_copy(ctx: ChaosContext, env: RowEnv) -> str:
    # Zero copy: the holder itself copies between its segment and the KV cache (in
    # its shared memory), so a load cannot be abandoned early (late bytes would land
    # in reused blocks): Mooncake's own RPC timeout to the holder bounds it.
    with frozen_phase(ctx, env, "holder-frozen-zero-copy", zero_copy=True) as (_, s, p0):
        stats = p0["connector"]
        slowest = max(r["total_s"] for r in p0["results"])
        s.finish()
    failed = sum((stats.get("failures") or {}).values())
    if not failed:
        raise RowFailed(f"no load failed while the holder was frozen ({failure_counts(stats)})")
    if slowest > ZERO_COPY_STALL_S + 15:
        raise RowFailed(f"a request took {slowest:.1f} s: no bound on zero-copy loads")
    return (
        f"zero copy, holder frozen: {failed} chunk load(s) failed after Mooncake's RPC "
        f"timeout ({failure_counts(stats)}), slowest request {slowest:.1f} s, outputs equal"
    )


def pool_full(ctx: ChaosContext, env: RowEnv) -> str:
    # The smallest holder Mooncake takes (16 MiB), filled to ~94 % by another
    # tenant's objects first: the engines' saves run into the high watermark.
    pool = env.pool(segment_size=16 << 20)
    filler = bytes(256 << 10)
    with raw_client(pool) as raw:
        placed = sum(raw.put(f"chaos/filler/{i}", filler) == 0 for i in range(60))
    prompts = [p for fam in ctx.families for p in fam]
    a = ctx.run_engine(ctx.spec(pool, [prompts]), "pool-full-a")
    ctx.check_outputs(a["results"], prompts)
    with raw_client(pool) as raw:  # a second wave: the pool must evict to take it
        placed += sum(raw.put(f"chaos/filler2/{i}", filler) == 0 for i in range(60))
    kept = len(pool_keys(pool))
    b = ctx.run_engine(ctx.spec(pool, [prompts]), "pool-full-b")
    ctx.check_outputs(b["results"], prompts)
    m = master_metrics(pool.metrics_url)
    ca, cb = a["connector"], b["connector"]
    evicted = int(m.get("master_evicted_key_count", 0))
    refused = sum((ca.get("saves_refused") or {}).values())
    put_fail = count_lines(a["log"], "pool put failed")
    if not (evicted or refused or put_fail):
        raise RowFailed("the pool never filled up: the row tested nothing")
    return (
        f"{placed} x 256 KiB filler in two waves around engine A; A saved "
        f"{ca.get('chunks_saved', 0)} objects, {put_fail} put back-offs, {refused} saves "
        f"refused; {evicted} keys evicted, {kept} of A's objects left; B loaded "
        f"{cb.get('chunks_loaded', 0)} objects (failed: {failure_counts(cb)}); all outputs equal"
    )


def evicted_before_load(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    ctx.seed_pool(pool)
    prompts = ctx.families[0]
    b = ctx.run_engine(ctx.spec(pool, [prompts], store=f"{FAULTS}:VanishingStore"), "vanishing")
    ctx.check_outputs(b["results"], prompts)
    failed = count_lines(b["log"], "failed (missing)")
    if not 1 <= failed <= len(prompts):
        raise RowFailed(f"{failed} failed loads for {len(prompts)} prompts")
    # B saved what it recomputed: the keys are back.
    if not wait_until(lambda: set(ctx.seed) <= set(pool_keys(pool)), 10.0):
        raise RowFailed("the recomputed chunks were not saved again")
    return f"{failed} load(s) found nothing and were recomputed; the chunks were saved again"


def load_fails_always(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    ctx.seed_pool(pool)
    prompts = ctx.families[0] + ctx.families[1]
    t0 = time.monotonic()
    b = ctx.run_engine(ctx.spec(pool, [prompts], store=f"{FAULTS}:BrokenLoadStore"), "broken")
    secs = time.monotonic() - t0
    ctx.check_outputs(b["results"], prompts)
    failed = count_lines(b["log"], "failed (transfer_failed)")
    if not 1 <= failed <= len(prompts):
        raise RowFailed(f"{failed} failed load jobs for {len(prompts)} prompts: a retry loop?")
    return (
        f"{failed} failed load job(s) for {len(prompts)} prompts (each chunk tried once, then "
        f"read as a miss), engine done in {secs:.0f} s"
    )


def rewritten_objects(
    ctx: ChaosContext, env: RowEnv, name: str, alter: Callable[[str, bytes], bytes]
) -> str:
    pool = env.pool()
    ctx.seed_pool(pool, alter)
    bad = {k: alter(k, v) for k, v in ctx.seed.items()}
    prompts = ctx.families[0] + ctx.families[1]
    b = ctx.run_engine(ctx.spec(pool, [prompts]), name)
    ctx.check_outputs(b["results"], prompts)
    failed = count_lines(b["log"], "failed (corrupt)")
    if not 1 <= failed <= len(prompts):
        raise RowFailed(f"{failed} failed loads for {len(prompts)} prompts")

    # Bad objects a load read are removed, never forced: once the reader's own
    # lease (and any other reader's) ended. A key removed before a later save of
    # its chunk holds good bytes again; one removed after it is simply gone.
    discarded = int(b["connector"].get("chunks_discarded", 0))
    if discarded < 1:
        raise RowFailed("no damaged object was removed (a removal retried past the run?)")
    with raw_client(pool) as raw:
        good = sum(raw.get(k) == ctx.seed[k] for k in bad)
        left = sum(raw.get(k) == v for k, v in bad.items())
    if left > len(bad) - discarded:
        raise RowFailed(f"{left} bad objects left though {discarded} were removed")
    return (
        f"{failed} load(s) rejected as corrupt and recomputed; {discarded} of {len(bad)} bad "
        f"objects removed once their leases ended ({good} hold good bytes again), {left} "
        "never read (their prefix is suppressed)"
    )


def aliased(ctx: ChaosContext, env: RowEnv) -> str:
    keys = sorted(ctx.seed)
    by_size: dict[int, list[str]] = {}
    for k in keys:
        by_size.setdefault(len(ctx.seed[k]), []).append(k)
    other = {}
    for group in by_size.values():  # each key gets another key's object of its size
        for i, k in enumerate(group):
            other[k] = group[(i + 1) % len(group)]

    def alias(key: str, value: bytes) -> bytes:
        return ctx.seed[other[key]] if other[key] != key else value[:-1] + bytes([value[-1] ^ 1])

    return rewritten_objects(ctx, env, "aliased", alias)


def flipped(ctx: ChaosContext, env: RowEnv) -> str:
    def flip(key: str, value: bytes) -> bytes:
        i = 64 + zlib.crc32(key.encode()) % (len(value) - 64)  # a payload byte
        return value[:i] + bytes([value[i] ^ 0x10]) + value[i + 1 :]

    return rewritten_objects(ctx, env, "flipped", flip)


def two_configs(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    ctx.seed_pool(pool)  # float32 objects
    prompts = ctx.families[0]
    base = ctx.run_engine(
        ctx.spec(None, [prompts], connector="none", dtype="bfloat16"), "bf16-base"
    )
    b = ctx.run_engine(ctx.spec(pool, [prompts], dtype="bfloat16"), "bf16")
    for r, want in zip(b["results"], base["results"], strict=True):
        if not outputs_match(r, want):
            raise RowFailed("the bfloat16 engine's outputs differ from its own baseline")
    stats = b["connector"]
    if stats.get("failures") or stats.get("hit_tokens"):
        raise RowFailed(f"the bfloat16 engine hit float32 keys: {stats}")
    spaces = {parse_key(k).fingerprint for k in pool_keys(pool)}
    return (
        f"bfloat16 engine on a float32 pool: 0 hits, 0 failed loads, outputs equal its own "
        f"baseline; {len(spaces)} config fingerprints now share the pool"
    )


def lease(ctx: ChaosContext, env: RowEnv) -> str:
    """A read lease blocks a plain remove, never a forced one; it ends by itself."""
    import numpy as np

    from kvpool.store.base import Status
    from kvpool.store.mooncake import MooncakeStore

    pool = env.pool(lease_ttl_ms=1000)
    buf = np.arange(4096, dtype=np.uint8)
    out = np.zeros_like(buf)
    seg = [(buf.ctypes.data, buf.nbytes)]
    with MooncakeStore(pool.config()) as store:
        store.batch_put(["chaos/a", "chaos/b"], [seg, seg])
        store.batch_get(["chaos/a", "chaos/b"], [[(out.ctypes.data, out.nbytes)]] * 2)
        (plain,) = store.batch_remove(["chaos/a"])
        (forced,) = store.batch_remove(["chaos/b"], force=True)
        t0 = time.monotonic()
        ok = wait_until(lambda: store.batch_remove(["chaos/a"])[0] is Status.OK, 10.0)
        waited = time.monotonic() - t0
    if plain is not Status.LEASED or forced is not Status.OK or not ok:
        raise RowFailed(f"remove under lease: {plain}, forced: {forced}, later: {ok}")
    return f"remove under a read lease: leased; forced: ok; plain remove ok {waited:.1f} s later"

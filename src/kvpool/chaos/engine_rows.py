"""Fault rows of the engine side: its lookup socket, its config, its process.

Garbage on the lookup socket, a slow or stopped lookup server, a missing or
malformed pool file, an engine killed with saves queued. Each row takes the
shared ``ChaosContext`` and its own ``RowEnv`` and returns what it observed, or
raises ``RowFailed`` (``kvpool.chaos.harness``).
"""

from __future__ import annotations

import random
import time

from kvpool.chaos.harness import (
    FAULTS,
    PREFIX,
    ChaosContext,
    RowEnv,
    RowFailed,
    cause_counts,
    pool_keys,
)
from kvpool.demo.run import distinct_chunks
from kvpool.demo.session import EngineFailed
from kvpool.keys import lookup_endpoint
from kvpool.pool import wait_until


def lookup_garbage(ctx: ChaosContext, env: RowEnv) -> str:
    import zmq

    pool = env.pool()
    ctx.seed_pool(pool)
    run_dir = ctx.workdir / env.name / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    prompts = ctx.families[0]
    spec = ctx.spec(pool, [prompts], hold=True, run_dir=str(run_dir), instance="chaos")
    rng = random.Random(3)
    sent = 0
    with ctx.session(spec, "lookup-garbage") as s:
        s.ready()
        endpoint = lookup_endpoint(str(run_dir), "chaos", 0)
        zctx = zmq.Context()
        sock = zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        answered = 0
        try:
            for _ in range(300):
                frames = [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 4))]
                sock.send_multipart(frames)
                sent += 1
            # Each frame is answered (an error reply): read the answers, so the
            # garbage surely reached the server (a socket closed at once drops what
            # it has not sent yet).
            deadline = time.monotonic() + 20
            while answered < sent and time.monotonic() < deadline:
                if sock.poll(200):
                    sock.recv_multipart()
                    answered += 1
        finally:
            sock.close()
            zctx.term()
        p0 = s.next_phase()
        s.finish()
    ctx.check_outputs(p0["results"], prompts)
    hit = p0["results"][0]["cached_tokens"]
    if hit < PREFIX:
        raise RowFailed(f"after the garbage the lookup no longer hits ({hit} tokens)")
    refused = sum(p0["connector"].get("lookup_server_errors", {}).values())
    if answered < sent or refused < sent:  # every garbage frame reached the server
        raise RowFailed(f"{sent} frames sent, {answered} answered, {refused} counted as errors")
    return (
        f"{sent} random frames sent to the engine's lookup socket, each answered as an "
        f"error ({refused} counted); next lookup hit {hit} tokens"
    )


def lookup_slow(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    ctx.seed_pool(pool)
    prompts = ctx.families[0]
    spec = ctx.spec(pool, [prompts], store=f"{FAULTS}:SlowExistsStore", lookup_timeout_ms=50)
    b = ctx.run_engine(spec, "lookup-slow", KVPOOL_CHAOS_EXISTS_DELAY_S="0.5")
    ctx.check_outputs(b["results"], prompts)
    misses = b["connector"].get("lookup_failures") or {}
    if not misses:
        raise RowFailed("no lookup ran into its deadline")
    causes = cause_counts(misses)
    return f"lookups answered as misses at their 50 ms deadline ({causes}); outputs equal"


def lookup_stopped(ctx: ChaosContext, env: RowEnv) -> str:
    """The lookup service alone (no engine): stop the server, then start a new one."""
    from kvpool.keys import KeySpace
    from kvpool.layout import Layout
    from kvpool.lookup.client import LookupClient
    from kvpool.lookup.server import LookupServer
    from kvpool.store.mooncake import MooncakeStore

    pool = env.pool()
    layout = Layout.create(tp=1, groups=["gqa:2"])
    space = KeySpace.create(
        model="chaos/lookup",
        layout=layout,
        kv_dtype="float32",
        model_dtype="float32",
        chunk_size=32,
        head_size=32,
        num_layers=2,
    )
    run_dir = ctx.workdir / env.name / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    endpoint = lookup_endpoint(str(run_dir), "stopped", 0)
    hashes = [bytes([i]) * 16 for i in range(1, 9)]
    import numpy as np

    one = np.ones(64, dtype=np.uint8)
    with MooncakeStore(pool.config()) as store:
        keys = [space.key(c, h) for h in hashes for c in layout.holdings(0, 0)]
        store.batch_put(keys, [[(one.ctypes.data, one.nbytes)]] * len(keys))
        server = LookupServer(endpoint, store, layout, space, 32)
        server.start()
        with LookupClient(endpoint, timeout_ms=50.0) as client:
            before = client.lookup("r0", hashes, 32 * 9)
            server.close()
            t0 = time.monotonic()
            during = client.lookup("r1", hashes, 32 * 9)
            waited = time.monotonic() - t0
            server = LookupServer(endpoint, store, layout, space, 32)
            server.start()
            after = 0
            if not wait_until(lambda: client.lookup("r2", hashes, 32 * 9) > 0, 10.0):
                raise RowFailed("the client never found the restarted server")
            after = client.lookup("r3", hashes, 32 * 9)
            server.close()
    if before != 256 or during != 0 or after != 256:
        raise RowFailed(f"hits before/during/after: {before}/{during}/{after}")
    if waited > 1.0:
        raise RowFailed(f"a lookup against a stopped server took {waited:.2f} s")
    return (
        f"hit {before} tokens; server stopped: miss in {waited * 1e3:.0f} ms; "
        f"restarted: hit {after}"
    )


def bad_config(ctx: ChaosContext, env: RowEnv) -> str:
    """One rule for a pool file: absent, the engine serves without the pool and says
    so; there but malformed, the engine stops at start with one line naming it."""
    prompts = ctx.families[0]
    folder = ctx.workdir / env.name
    folder.mkdir(parents=True, exist_ok=True)
    absent, bad = folder / "absent.json", folder / "pool.json"
    bad.write_text('{"master_address": "127.0.0.1:1", ')  # cut short
    r = ctx.run_engine(ctx.spec(None, [prompts], pool_file=str(absent)), "config-missing")
    ctx.check_outputs(r["results"], prompts)
    lines = [ln for ln in r["log"].splitlines() if "connector stays idle" in ln]
    if not lines or str(absent) not in lines[0]:
        raise RowFailed(f"no clear line naming {absent} for the missing pool file")
    try:
        ctx.run_engine(ctx.spec(None, [prompts], pool_file=str(bad)), "config-malformed")
    except EngineFailed as exc:
        if str(bad) not in str(exc) or "not valid JSON" not in str(exc):
            raise RowFailed(f"the malformed pool file's error does not name it: {exc}") from None
        stopped = str(exc).split(": ", 2)[-1][:90]
    else:
        raise RowFailed("an engine started on a malformed pool file")
    return f"missing: served without the pool ({lines[0].split('kvpool: ', 1)[-1][:60]}); " + (
        f"malformed: stopped at start ({stopped})"
    )


def engine_killed(ctx: ChaosContext, env: RowEnv) -> str:
    pool = env.pool()
    prompts = ctx.families[2]
    spec = ctx.spec(pool, [prompts, prompts], store=f"{FAULTS}:SlowPutStore")
    with ctx.session(spec, "killed", KVPOOL_CHAOS_PUT_DELAY_S="30") as a:
        a.next_phase()
        a.kill()  # its saves are still queued behind the slow put
    left = len(pool_keys(pool))
    # The kill must have cut saves short (build_tiny_llama: 2 KV heads, an object each).
    objects = 2 * distinct_chunks(prompts)
    if left >= objects:
        raise RowFailed(f"every object ({left}) had landed before the kill: nothing was queued")
    b = ctx.run_engine(ctx.spec(pool, [prompts]), "after-kill")
    ctx.check_outputs(b["results"], prompts)
    if b["connector"].get("failures"):
        raise RowFailed(f"the restarted engine failed loads: {b['connector']['failures']}")
    # Every object of the prompts, so the restarted engine saved the ones the kill cut.
    if not wait_until(lambda: len(pool_keys(pool)) >= objects, 10.0):
        have = len(pool_keys(pool))
        raise RowFailed(f"the restarted engine's saves did not land: {have} of {objects} objects")
    return (
        f"killed with saves queued ({left} objects had landed); the restarted engine "
        f"recomputed, outputs equal, saved {len(pool_keys(pool))} objects"
    )

"""The lookup service against a real mooncake_master (a local pool on loopback).

Round trips are read from the master's own counter of batch-exist requests.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from tests.factories import key_space

from kvpool.keys import KeySpace, lookup_endpoint
from kvpool.layout import Layout
from kvpool.lookup import wire
from kvpool.lookup.client import LookupClient
from kvpool.lookup.server import LookupServer, SupportsRemovePrefix
from kvpool.plan import chunk_hashes
from kvpool.pool import LocalPool, master_metrics
from kvpool.store.mooncake import MooncakeStore

CHUNK = 16
LAYOUTS = {
    "tp4-mla-dcp2": Layout.create(tp=4, dcp=2, groups=("mla",)),
    "tp4-dcp2-gqa2+mla": Layout.create(tp=4, dcp=2, groups=("gqa:2", "mla")),
}
_ONE = np.ones(64, dtype=np.uint8)
_EXISTS_RPCS = "master_batch_exist_key_requests_total"


def space_of(layout: Layout) -> KeySpace:
    return key_space(layout, "org/lookup-store-test", dtype="bfloat16", chunk_size=CHUNK)


def read_keys(layout: Layout, space: KeySpace, chunk_hash: bytes) -> list[str]:
    """Every key some rank reads for this chunk."""
    return sorted(
        {
            space.key(c, chunk_hash)
            for r in layout.ranks
            for g in range(len(layout.groups))
            for c in layout.holdings(r, g)
        }
    )


def put(store: MooncakeStore, keys: Sequence[str]) -> None:
    statuses = store.batch_put(list(keys), [[(_ONE.ctypes.data, _ONE.nbytes)]] * len(keys))
    assert all(s.stored for s in statuses), statuses


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvl-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_lookups_against_a_real_master(local_pool: LocalPool, run_dir: str, name: str) -> None:
    layout = LAYOUTS[name]
    space = space_of(layout)
    endpoint = lookup_endpoint(run_dir, "store", 0)
    with MooncakeStore(local_pool.config()) as store:
        server = LookupServer(endpoint, store, layout, space, CHUNK)
        server.start()
        client = LookupClient(endpoint, timeout_ms=5000.0)
        try:
            hashes = chunk_hashes(6, seed=name.encode())
            tokens = 6 * CHUNK + 1
            keys = [read_keys(layout, space, h) for h in hashes]
            before = master_metrics(local_pool.config().metrics_url)[_EXISTS_RPCS]
            assert client.lookup("r", hashes, tokens) == 0
            put(store, [k for ks in keys[:2] for k in ks])
            put(store, keys[2][:-1])  # chunk 2 lacks one namespace
            put(store, [k for ks in keys[3:] for k in ks])
            assert client.lookup("r", hashes, tokens) == 2 * CHUNK
            put(store, keys[2][-1:])
            assert client.lookup("r", hashes, tokens) == 6 * CHUNK
            assert client.lookup("r", hashes, 6 * CHUNK) == 5 * CHUNK  # the last token stays
            after = master_metrics(local_pool.config().metrics_url)[_EXISTS_RPCS]
            assert after - before == 4  # one round trip per lookup
            assert server.stats.store_calls == 4
            assert client.stats.misses == {}

            assert isinstance(store, SupportsRemovePrefix)
            reply = client.reset(force=True)
            assert isinstance(reply, wire.ResetReply) and reply.ok
            assert reply.removed == sum(len(ks) for ks in keys)
            assert client.lookup("r", hashes, tokens) == 0
        finally:
            client.close()
            server.close()
            store.batch_remove([k for ks in keys for k in ks], force=True)


def test_a_master_killed_mid_run_is_a_miss_within_the_deadline(
    local_pool: LocalPool, run_dir: str
) -> None:
    layout = LAYOUTS["tp4-mla-dcp2"]
    space = space_of(layout)
    endpoint = lookup_endpoint(run_dir, "store", 1)
    store = MooncakeStore(local_pool.config())
    server = LookupServer(endpoint, store, layout, space, CHUNK)
    server.start()
    client = LookupClient(endpoint, timeout_ms=100.0)
    try:
        hashes = chunk_hashes(3)
        put(store, [k for h in hashes for k in read_keys(layout, space, h)])
        assert client.lookup("r", hashes, 3 * CHUNK + 1) == 3 * CHUNK
        local_pool.stop()
        began = time.monotonic()
        assert client.lookup("r", hashes, 3 * CHUNK + 1) == 0
        assert time.monotonic() - began < 0.1 + 0.5
        assert set(client.stats.misses) <= {"store_unavailable", "timeout"}
        assert sum(client.stats.misses.values()) == 1
    finally:
        client.close()
        server.close()
        store.close()

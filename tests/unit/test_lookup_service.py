"""Lookup server and client over real ZMQ sockets, against the memory store.

Hits are checked against the keys the ranks read (``Layout.content`` of every
rank and group), computed here without the server's help.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.factories import key_space, wait_until

from kvpool.errors import ConfigError
from kvpool.keys import KeySpace, lookup_endpoint, lookup_endpoints
from kvpool.layout import ContentId, Layout
from kvpool.lookup import wire
from kvpool.lookup.client import LookupClient
from kvpool.lookup.endpoint import Endpoint, LookupEndpointInUse, private_dir
from kvpool.lookup.server import LookupServer, SupportsRemovePrefix, start_first_free
from kvpool.plan import chunk_hashes, probe_keys
from kvpool.store.base import KVStore, Status
from kvpool.store.memory import MemoryStore
from kvpool.store.scatter import Segments

CHUNK = 16
MLA_DCP = Layout.create(tp=4, dcp=2, groups=("mla",))  # 2 namespaces
HYBRID = Layout.create(tp=4, dcp=2, groups=("gqa:2", "mla"))  # 4 + 2 namespaces
LAYOUTS = {"tp4-mla-dcp2": MLA_DCP, "tp4-dcp2-gqa2+mla": HYBRID}

_ONE = np.ones(8, dtype=np.uint8)


# A lookup against a dead or stuck server must return a miss, not hang (Mooncake's
# RPC timeout is 30 s): a bound far above its deadline catches a hang without
# timing the deadline itself on a loaded machine (that is a bench's job).
HANG_S = 5.0


def space_of(layout: Layout, model: str = "org/lookup-test") -> KeySpace:
    return key_space(layout, model, dtype="bfloat16", chunk_size=CHUNK)


def read_keys(layout: Layout, space: KeySpace, chunk_hash: bytes) -> list[str]:
    """Every key some rank reads for this chunk (the reference for a hit)."""
    keys = {
        space.key(c, chunk_hash)
        for r in layout.ranks
        for g in range(len(layout.groups))
        for c in layout.holdings(r, g)
    }
    return sorted(keys)


def put(store: KVStore, keys: Sequence[str]) -> None:
    statuses = store.batch_put(list(keys), [[(_ONE.ctypes.data, _ONE.nbytes)]] * len(keys))
    assert all(s.stored for s in statuses)


def put_chunks(store: KVStore, layout: Layout, space: KeySpace, hashes: Sequence[bytes]) -> None:
    put(store, [k for h in hashes for k in read_keys(layout, space, h)])


class CountingStore(MemoryStore):
    """Counts public ``batch_exists`` calls; splits them into tiny backend batches."""

    max_batch = 4

    def __init__(self) -> None:
        super().__init__()
        self.exists_calls = 0

    def batch_exists(self, keys: Sequence[str]) -> list[Status]:
        self.exists_calls += 1
        return super().batch_exists(keys)


class GatedStore(MemoryStore):
    """``batch_exists`` waits for ``gate`` (set ``entered`` first)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def batch_exists(self, keys: Sequence[str]) -> list[Status]:
        self.entered.set()
        assert self.gate.wait(10), "test never opened the gate"
        return super().batch_exists(keys)


class PlainStore(KVStore):
    """A store without ``remove_prefix``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = MemoryStore()

    def _exists(self, keys: Sequence[str]) -> list[Status]:
        return self.inner.batch_exists(keys)

    def _put(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        return self.inner.batch_put(keys, segments)

    def _get(self, keys: Sequence[str], segments: Sequence[Segments]) -> list[Status]:
        return self.inner.batch_get(keys, segments)

    def _remove(self, keys: Sequence[str], force: bool) -> list[Status]:
        return self.inner.batch_remove(keys, force)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def run_dir() -> Iterator[str]:
    """A short folder for IPC sockets (paths are limited to 107 bytes)."""
    path = tempfile.mkdtemp(prefix="kvl-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def endpoint(run_dir: str) -> str:
    return lookup_endpoint(run_dir, "test", 0)


class Service:
    """Starts servers and clients for one test; closes them all at teardown."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.servers: list[LookupServer] = []
        self.clients: list[LookupClient] = []

    def server(
        self,
        store: KVStore,
        layout: Layout = MLA_DCP,
        space: KeySpace | None = None,
        endpoint: str | None = None,
        **kwargs: object,
    ) -> LookupServer:
        server = LookupServer(
            endpoint or self.endpoint,
            store,
            layout,
            space or space_of(layout),
            CHUNK,
            **kwargs,  # type: ignore[arg-type]
        )
        self.servers.append(server)
        server.start()
        return server

    def client(self, endpoint: str | None = None, **kwargs: object) -> LookupClient:
        kwargs.setdefault("timeout_ms", 2000.0)
        client = LookupClient(endpoint or self.endpoint, **kwargs)  # type: ignore[arg-type]
        self.clients.append(client)
        return client

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for s in self.servers:
            s.close()


@pytest.fixture
def service(endpoint: str) -> Iterator[Service]:
    svc = Service(endpoint)
    try:
        yield svc
    finally:
        svc.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvpool-lookup")]


# ---------------------------------------------------------------------------- hits


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_hits_of_nothing_a_prefix_and_everything(service: Service, name: str) -> None:
    layout = LAYOUTS[name]
    space = space_of(layout)
    store = MemoryStore()
    service.server(store, layout, space)
    client = service.client()
    hashes = chunk_hashes(6, seed=name.encode())
    tokens = 6 * CHUNK + 1  # one token past the last chunk: every chunk may count
    assert client.lookup("r0", hashes, tokens) == 0
    put_chunks(store, layout, space, hashes[:3])
    assert client.lookup("r1", hashes, tokens) == 3 * CHUNK
    put_chunks(store, layout, space, hashes[3:])
    assert client.lookup("r2", hashes, tokens) == 6 * CHUNK
    assert client.stats.misses == {}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_chunk_counts_only_if_every_namespace_of_every_group_has_it(
    service: Service, name: str
) -> None:
    """An exact server (``kv_load_failure_policy: fail``) finds every hole."""
    layout = LAYOUTS[name]
    space = space_of(layout)
    store = MemoryStore()
    server = service.server(store, layout, space, exact=True)
    client = service.client()
    n = 4
    namespaces = len(read_keys(layout, space, b"\x00"))
    assert namespaces == sum(len(layout.contents(g)) for g in range(len(layout.groups)))
    for chunk in range(n):
        for hole in range(namespaces):
            hashes = chunk_hashes(n, seed=f"{name}/{chunk}/{hole}".encode())
            keys = [k for h in hashes for k in read_keys(layout, space, h)]
            del keys[chunk * namespaces + hole]
            put(store, keys)
            assert client.lookup("r", hashes, n * CHUNK + 1) == chunk * CHUNK, (chunk, hole)
    assert server.stats.store_calls == n * namespaces


def test_the_search_asks_one_head_per_chunk_rotating_and_never_answers_short(
    service: Service,
) -> None:
    """TP1 with 4 KV heads: a search round asks for head ``chunk % 4`` of each chunk
    (4x fewer keys). A hole in that head is found; a hole in another head is left to
    the load, which fails for those blocks: the answer is never below the prefix."""
    layout = Layout.create(tp=1, groups=["gqa:4"])
    space = space_of(layout)
    store = MemoryStore()
    server = service.server(store, layout, space)
    client = service.client()
    n = 4
    for chunk in range(n):
        for head in range(4):
            hashes = chunk_hashes(n, seed=f"rotate/{chunk}/{head}".encode())
            keys = [k for h in hashes for k in read_keys(layout, space, h)]
            del keys[chunk * 4 + head]
            put(store, keys)
            before = server.stats.keys_probed
            hit = client.lookup("r", hashes, n * CHUNK + 1)
            assert hit == (chunk if head == chunk % 4 else n) * CHUNK, (chunk, head)
            # one key per chunk (a short prompt: one round over every chunk)
            assert server.stats.keys_probed - before == n


def test_objects_of_the_old_schema_are_misses_not_errors(service: Service) -> None:
    """Schema 1 named objects by rank slot (h<slot>) under a fingerprint holding tp;
    schema 2 one object per head and PP stage (``.p<pp_rank>``). A pool still
    holding them answers a miss for the same prompt, with no error: the new keys
    are other keys, so an old object is never read. Schema 3 had today's content
    names but chunks named by vLLM's block hashes: its keys under the same hash
    (and fingerprint) are misses too."""
    from kvpool.keys import SCHEMA_VERSION, ParsedKey

    layout = Layout.create(tp=2, groups=["gqa:4"])
    space = space_of(layout)
    store = MemoryStore()
    service.server(store, layout, space)
    client = service.client()
    hashes = chunk_hashes(3, seed=b"schema-1")
    old = [str(ParsedKey(space.model, space.fingerprint, ContentId(slot, 0, 0, 0, 0), h.hex(),
                         schema=1))
           for h in hashes for slot in range(2)]  # fmt: skip
    prefix = space.prefix.replace(f"kvpool/{SCHEMA_VERSION}/", "kvpool/2/")
    old += [f"{prefix}g0.h{head}.d0.c0.p0/{h.hex()}" for h in hashes for head in range(4)]
    now = [space.key(c, h) for h in hashes for c in layout.contents(0)]
    old += [k.replace(f"kvpool/{SCHEMA_VERSION}/", "kvpool/3/", 1) for k in now]
    put(store, old)
    assert client.lookup("r", hashes, 3 * CHUNK + 1) == 0
    assert client.stats.misses == {}  # a plain miss: no error, no timeout
    put_chunks(store, layout, space, hashes)
    assert client.lookup("r", hashes, 3 * CHUNK + 1) == 3 * CHUNK


def test_a_full_prompt_hit_leaves_the_last_token_to_compute(service: Service) -> None:
    space = space_of(MLA_DCP)
    store = CountingStore()
    server = service.server(store, MLA_DCP, space)
    client = service.client()
    hashes = chunk_hashes(6)
    put_chunks(store, MLA_DCP, space, hashes)
    assert client.lookup("r", hashes, 6 * CHUNK) == 5 * CHUNK  # exact fit: last chunk dropped
    assert client.lookup("r", hashes, 6 * CHUNK + 1) == 6 * CHUNK
    assert client.lookup("r", hashes, 6 * CHUNK + 9) == 6 * CHUNK  # a partial chunk never counts
    assert client.lookup("r", hashes, 3 * CHUNK + 5) == 3 * CHUNK  # hashes past the prompt
    assert server.stats.keys_probed == (5 + 6 + 6 + 3) * 2
    # Nothing could count: the store is not asked at all.
    calls = store.exists_calls
    assert client.lookup("r", hashes, CHUNK) == 0
    assert client.lookup("r", hashes, 1) == 0
    assert client.lookup("r", [], 100) == 0
    assert store.exists_calls == calls


def test_a_short_prompt_is_one_batch_exists(service: Service) -> None:
    space = space_of(HYBRID)
    store = CountingStore()  # its backend batches hold 4 keys; the call is still one
    service.server(store, HYBRID, space)
    client = service.client()
    hashes = chunk_hashes(20)
    put_chunks(store, HYBRID, space, hashes[:11])
    for i in range(5):
        assert client.lookup(f"r{i}", hashes, 20 * CHUNK + 1) == 11 * CHUNK
    assert store.exists_calls == 5


class HoleyStore(MemoryStore):
    """Reads ``holes`` as MISSING and ``down`` as UNAVAILABLE; counts calls."""

    def __init__(self) -> None:
        super().__init__()
        self.holes: set[str] = set()
        self.down: set[str] = set()
        self.calls: list[int] = []

    def batch_exists(self, keys: Sequence[str]) -> list[Status]:
        self.calls.append(len(keys))
        out = super().batch_exists(keys)
        return [
            Status.UNAVAILABLE if k in self.down else Status.MISSING if k in self.holes else s
            for k, s in zip(keys, out, strict=True)
        ]


def test_a_long_prompt_is_searched_in_a_few_small_rounds(service: Service) -> None:
    n = 2047  # 32k tokens in 16-token chunks
    space = space_of(HYBRID)
    per_chunk = len(read_keys(HYBRID, space, b"\x00"))
    store = HoleyStore()
    server = service.server(store, HYBRID, space)
    client = service.client()
    hashes = chunk_hashes(n)
    put_chunks(store, HYBRID, space, hashes[:1500])
    for prompt, expected in [(n, 1500), (1500, 1499), (1501, 1500), (n + 1, 1500)]:
        store.calls.clear()
        assert client.lookup("r", hashes[:prompt], prompt * CHUNK) == expected * CHUNK
        assert len(store.calls) <= 4
        assert sum(store.calls) <= 4 * 40 * per_chunk  # a full probe is n * per_chunk keys
    assert server.stats.keys_probed < n * per_chunk
    # A miss at the first chunk costs one round.
    store.calls.clear()
    assert client.lookup("r", chunk_hashes(n, seed=b"other"), n * CHUNK) == 0
    assert len(store.calls) == 1


def test_a_long_prompt_stops_at_a_probed_hole_and_reports_an_unreadable_bound(
    service: Service,
) -> None:
    n = 2047
    space = space_of(MLA_DCP)
    store = HoleyStore()
    service.server(store, MLA_DCP, space)
    client = service.client()
    hashes = chunk_hashes(n)
    put_chunks(store, MLA_DCP, space, hashes)
    # Chunk 900 loses one namespace: the search narrows to it (prefix-closed from there).
    store.holes = {k for h in hashes[900:] for k in read_keys(MLA_DCP, space, h)[1:]}
    assert client.lookup("r", hashes, n * CHUNK + 1) == 900 * CHUNK
    # The store cannot answer from chunk 900 on: the bound is unreadable, not missing.
    store.holes, store.down = set(), store.holes
    assert client.lookup("r", hashes, n * CHUNK + 1) == 0
    assert client.stats.misses == {"store_unavailable": 1}


def test_an_exact_server_probes_every_chunk_of_a_long_prompt_at_once(service: Service) -> None:
    n = 2047
    space = space_of(MLA_DCP)
    store = HoleyStore()
    service.server(store, MLA_DCP, space, exact=True)
    client = service.client()
    hashes = chunk_hashes(n)
    put_chunks(store, MLA_DCP, space, hashes)
    store.holes = set(read_keys(MLA_DCP, space, hashes[1001]))  # one hole, between probes
    assert client.lookup("r", hashes, n * CHUNK + 1) == 1001 * CHUNK
    assert store.calls == [n * 2]  # one call, every key


class ShortStore(MemoryStore):
    def batch_exists(self, keys: Sequence[str]) -> list[Status]:
        return super().batch_exists(keys)[:-1]  # a store bug: one answer short


def test_a_store_that_answers_short_is_an_internal_error(service: Service) -> None:
    store = ShortStore()
    space = space_of(MLA_DCP)
    service.server(store, MLA_DCP, space)
    put_chunks(store, MLA_DCP, space, chunk_hashes(4))
    client = service.client()
    assert client.lookup("r", chunk_hashes(4), 4 * CHUNK + 1) == 0
    assert client.stats.misses == {"internal": 1}


# ---------------------------------------------------------------------------- reset


def test_reset_removes_this_key_space_and_reports_it(service: Service) -> None:
    clock = Clock()
    store = MemoryStore(lease_s=5.0, clock=clock)
    assert isinstance(store, SupportsRemovePrefix)
    space, other = space_of(MLA_DCP), space_of(MLA_DCP, model="org/another-model")
    service.server(store, MLA_DCP, space)
    client = service.client()
    hashes = chunk_hashes(3)
    put_chunks(store, MLA_DCP, space, hashes)
    put_chunks(store, MLA_DCP, other, hashes)
    leased = read_keys(MLA_DCP, space, hashes[0])[0]
    assert store.batch_exists([leased]) == [Status.OK]  # a read lease on one object
    reply = client.reset()
    assert isinstance(reply, wire.ResetReply)
    assert (reply.ok, reply.removed) == (True, 5)
    assert "lease" in reply.message
    reply = client.reset(force=True)
    assert isinstance(reply, wire.ResetReply) and (reply.ok, reply.removed) == (True, 1)
    assert client.lookup("r", hashes, 3 * CHUNK + 1) == 0
    assert len(store.keys()) == 6  # the other key space is untouched
    assert all(key.startswith(other.prefix) for key in store.keys())  # noqa: SIM118


def test_reset_on_a_store_without_remove_prefix_is_unsupported(service: Service) -> None:
    store = PlainStore()
    assert not isinstance(store, SupportsRemovePrefix)
    space = space_of(MLA_DCP)
    server = service.server(store, MLA_DCP, space)
    client = service.client()
    put_chunks(store, MLA_DCP, space, chunk_hashes(2))
    reply = client.reset()
    assert isinstance(reply, wire.ErrorReply)
    assert reply.code == wire.ErrorCode.UNSUPPORTED and "remove_prefix" in reply.message
    assert len(store.inner.keys()) == 4
    assert server.stats.errors == {"unsupported": 1}


# ---------------------------------------------------------------------------- failures


def test_a_store_that_cannot_answer_is_a_miss_with_its_reason(service: Service) -> None:
    store = MemoryStore()
    service.server(store)
    client = service.client()
    store.close()  # every key now reads UNAVAILABLE
    assert client.lookup("r", chunk_hashes(3), 3 * CHUNK + 1) == 0
    assert client.stats.misses == {"store_unavailable": 1}


class BrokenStore(MemoryStore):
    def batch_exists(self, keys: Sequence[str]) -> list[Status]:
        raise RuntimeError("a bug in a store")


def test_a_bug_below_the_server_is_an_internal_error_and_it_keeps_serving(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    server = service.server(BrokenStore())
    client = service.client()
    for _ in range(2):
        assert client.lookup("r", chunk_hashes(2), 3 * CHUNK) == 0
    assert client.stats.misses == {"internal": 2}
    assert server.stats.errors == {"internal": 2}
    assert "a bug in a store" in caplog.text


@pytest.mark.parametrize(
    "layout",
    [
        Layout.create(tp=1, groups=("gqa:8",)),
        Layout.create(tp=8, groups=("gqa:2",)),
        Layout.create(tp=8, pp=2, pcp=2, dcp=4, groups=("mla", "mamba")),
        Layout.create(tp=16, groups=("gqa:4", "mha:32", "mla")),
    ],
    ids=str,
)
def test_an_exact_server_probes_the_keys_of_probe_keys(endpoint: str, layout: Layout) -> None:
    space = space_of(layout)
    """An exact server probes, chunk by chunk, probe_keys' keys of the groups a hit
    needs at every chunk: all of them where every group is full attention."""
    server = LookupServer(endpoint, MemoryStore(), layout, space, CHUNK, exact=True)
    hashes = [*chunk_hashes(5), b"\x00", b"\xff" * 64]
    got = server._probe_keys(range(len(hashes)), hashes.__getitem__)
    per_chunk = len(got) // len(hashes)
    wanted = probe_keys(layout, space, hashes)
    for i, keys in enumerate(wanted):
        probed = got[i * per_chunk : (i + 1) * per_chunk]
        assert set(probed) <= set(keys) and len(set(probed)) == per_chunk
        if all(g.every_chunk for g in layout.groups):
            assert probed == list(keys)
            assert sorted(probed) == read_keys(layout, space, hashes[i])


def _raw_peer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    return sock


def _error_of(sock: zmq.Socket[bytes]) -> wire.ErrorReply:
    reply = wire.decode_reply(sock.recv())
    assert isinstance(reply, wire.ErrorReply)
    return reply


def test_garbage_frames_get_error_replies_and_the_server_keeps_serving(
    service: Service,
) -> None:
    space = space_of(MLA_DCP)
    store = MemoryStore()
    server = service.server(store, MLA_DCP, space, max_frame_bytes=4096)
    hashes = chunk_hashes(2)
    put_chunks(store, MLA_DCP, space, hashes)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _raw_peer(ctx, service.endpoint)
    try:
        cases: list[tuple[list[bytes], str]] = [
            ([os.urandom(100)], "malformed"),
            ([b""], "malformed"),
            ([b"\x00" * 5000], "too_large"),
            ([msgspec.msgpack.encode({"type": "flush", "seq": 3})], "unsupported"),
            ([b"one", b"two", b"three"], "malformed"),
        ]
        reply = wire.LookupReply(seq=1, hit_tokens=1, keys_probed=1)
        cases.append(([wire.encode_reply(reply)], "unsupported"))  # a reply is no request
        for frames, code in cases:
            sock.send_multipart(frames)
            assert _error_of(sock).code == code, frames[0][:20]
        good = wire.LookupRequest(seq=99, req_id="r", chunk_hashes=hashes, num_tokens=33)
        sock.send(wire.encode_request(good))
        assert wire.decode_reply(sock.recv()) == wire.LookupReply(
            seq=99, hit_tokens=2 * CHUNK, keys_probed=4
        )
    finally:
        sock.close()
        ctx.term()
    assert sum(server.stats.errors.values()) == len(cases)


def test_random_frames_over_the_socket_never_kill_the_server(service: Service) -> None:
    space = space_of(MLA_DCP)
    store = MemoryStore()
    service.server(store, MLA_DCP, space)
    hashes = chunk_hashes(1)
    put_chunks(store, MLA_DCP, space, hashes)
    client = service.client()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _raw_peer(ctx, service.endpoint)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.binary(max_size=300), min_size=1, max_size=3))
    def one(frames: list[bytes]) -> None:
        sock.send_multipart(frames)
        reply = wire.decode_reply(sock.recv())
        assert isinstance(reply, wire.ErrorReply | wire.LookupReply | wire.ResetReply)

    try:
        one()
    finally:
        sock.close()
        ctx.term()
    assert client.lookup("r", hashes, 2 * CHUNK) == CHUNK


_SERVER_SCRIPT = """
import sys
import numpy as np
from kvpool.keys import KeySpace
from kvpool.layout import Layout
from kvpool.lookup.server import LookupServer
from kvpool.plan import chunk_hashes, probe_keys
from kvpool.store.memory import MemoryStore

layout = Layout.create(tp=4, dcp=2, groups=("mla",))
space = KeySpace.create(model="org/lookup-test", layout=layout, kv_dtype="bfloat16",
                        model_dtype="bfloat16", chunk_size=16, head_size=64, num_layers=2)
store = MemoryStore()
one = np.ones(8, dtype=np.uint8)
keys = [k for ks in probe_keys(layout, space, chunk_hashes(int(sys.argv[2]))) for k in ks]
store.batch_put(keys, [[(one.ctypes.data, 8)]] * len(keys))
server = LookupServer(sys.argv[1], store, layout, space, 16)
server.start()
print("ready", flush=True)
sys.stdin.read()
server.close()
"""


def _spawn_server(endpoint: str, chunks: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER_SCRIPT, endpoint, str(chunks)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    if not ready or proc.stdout.readline().strip() != "ready":
        proc.kill()
        proc.wait()
        pytest.fail("the lookup server process did not start")
    return proc


def test_a_killed_server_is_a_miss_within_the_deadline_and_a_new_one_is_found(
    service: Service,
) -> None:
    hashes = chunk_hashes(4)
    client = service.client(timeout_ms=50.0, max_backoff_s=0.05)
    first = _spawn_server(service.endpoint, chunks=2)
    second = None
    try:
        # The client was made first: it connects at its next reconnect attempt.
        assert wait_until(
            lambda: client.lookup("r", hashes, 4 * CHUNK + 1) == 2 * CHUNK, 10.0, 0.005
        )
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert Path(Endpoint.parse(service.endpoint).path).exists()  # left behind, stale
        for _ in range(3):
            began = time.monotonic()
            assert client.lookup("r", hashes, 4 * CHUNK + 1) == 0
            assert time.monotonic() - began < HANG_S
        assert set(client.stats.misses) <= {"unreachable", "timeout", "backoff", "rebuilt"}
        second = _spawn_server(service.endpoint, chunks=4)  # takes over the stale socket
        assert wait_until(
            lambda: client.lookup("r", hashes, 4 * CHUNK + 1) == 4 * CHUNK, 10.0, 0.005
        )
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait()
                for pipe in (proc.stdin, proc.stdout):
                    if pipe is not None:
                        pipe.close()


def test_a_closed_server_is_a_miss_and_a_restarted_one_answers(service: Service) -> None:
    space = space_of(MLA_DCP)
    store = MemoryStore()
    hashes = chunk_hashes(3)
    put_chunks(store, MLA_DCP, space, hashes)
    first = service.server(store, MLA_DCP, space)
    client = service.client(timeout_ms=50.0, max_backoff_s=0.05)
    assert client.lookup("r", hashes, 3 * CHUNK + 1) == 3 * CHUNK
    first.close()
    assert not Path(Endpoint.parse(service.endpoint).path).exists()
    began = time.monotonic()
    assert client.lookup("r", hashes, 3 * CHUNK + 1) == 0
    assert time.monotonic() - began < HANG_S
    service.server(store, MLA_DCP, space)
    assert wait_until(lambda: client.lookup("r", hashes, 3 * CHUNK + 1) == 3 * CHUNK, 10.0, 0.005)


def test_a_stuck_server_times_out_rebuilds_backs_off_and_drops_the_late_reply(
    service: Service,
) -> None:
    store = GatedStore()
    service.server(store)
    client = service.client(timeout_ms=30.0, max_backoff_s=60.0)
    hashes = chunk_hashes(2)
    began = time.monotonic()
    assert client.lookup("r", hashes, 3 * CHUNK) == 0
    assert time.monotonic() - began < HANG_S
    assert store.entered.is_set()
    assert client.stats.misses == {"timeout": 1} and client.stats.rebuilds == 1
    assert client.lookup("r", hashes, 3 * CHUNK) == 0  # not sent while backing off
    assert client.stats.misses == {"timeout": 1, "backoff": 1}
    store.gate.set()  # the late reply goes to the old socket, which is gone


# ---------------------------------------------------------------------------- async


def test_async_lookups_answer_none_until_replied_then_the_hit_once(service: Service) -> None:
    store = GatedStore()
    space = space_of(MLA_DCP)
    put_chunks(store, MLA_DCP, space, chunk_hashes(3))
    service.server(store, MLA_DCP, space)
    client = service.client(timeout_ms=10_000.0)
    client.start("a", chunk_hashes(3), 3 * CHUNK + 1)
    # Sent by start() if connected already, else by a later poll().
    assert wait_until(lambda: client.poll("a") is None and store.entered.is_set(), 10.0, 0.005)
    store.gate.set()
    assert wait_until(lambda: client.poll("a") is not None, 10.0, 0.005)
    assert client.stats.hit_tokens == 3 * CHUNK
    assert client.poll("a") == 0  # answered once; now unknown
    assert client.poll("never-started") == 0


def test_async_cancel_drops_the_late_reply(service: Service) -> None:
    store = GatedStore()
    service.server(store)
    client = service.client(timeout_ms=10_000.0)
    client.start("a", chunk_hashes(2), 3 * CHUNK)
    assert wait_until(lambda: client.poll("a") is None and store.entered.is_set(), 10.0, 0.005)
    client.cancel("a")
    store.gate.set()
    # Replies come in order on one connection: "a"'s arrives first and is dropped.
    assert client.lookup("b", chunk_hashes(1), 2 * CHUNK) == 0
    assert client.stats.stale_replies == 1
    assert client.stats.misses == {}
    assert client.poll("a") == 0


def test_async_lookup_past_its_deadline_is_a_miss(service: Service) -> None:
    clock = Clock()
    store = GatedStore()
    service.server(store)
    client = service.client(timeout_ms=20.0, clock=clock)
    client.start("a", chunk_hashes(2), 3 * CHUNK)
    assert wait_until(lambda: client.poll("a") is None and store.entered.is_set(), 10.0, 0.005)
    clock.now += 0.021
    assert client.poll("a") == 0
    assert client.stats.misses == {"timeout": 1}
    store.gate.set()


# ---------------------------------------------------------------------------- endpoints


def test_two_dp_engines_on_one_host_get_distinct_endpoints(service: Service, run_dir: str) -> None:
    ends = [lookup_endpoint(run_dir, "test", dp) for dp in (0, 1)]
    assert ends[0] != ends[1]
    stores = [MemoryStore(), MemoryStore()]
    space = space_of(MLA_DCP)
    hashes = chunk_hashes(4)
    for dp, store in enumerate(stores):
        put_chunks(store, MLA_DCP, space, hashes[: dp + 1])
        service.server(store, Layout.create(tp=4, dcp=2, dp_index=dp), space, endpoint=ends[dp])
    answers = [service.client(ends[dp]).lookup("r", hashes, 4 * CHUNK + 1) for dp in (0, 1)]
    assert answers == [CHUNK, 2 * CHUNK]


def test_a_stale_socket_file_is_removed(service: Service) -> None:
    path = Endpoint.parse(service.endpoint).path
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, as after a crash
    assert Path(path).is_socket()
    store = MemoryStore()
    service.server(store)
    assert service.client().lookup("r", chunk_hashes(1), 2 * CHUNK) == 0
    assert service.clients[0].stats.misses == {}


def test_a_file_that_is_not_a_socket_is_never_deleted(service: Service) -> None:
    path = Path(Endpoint.parse(service.endpoint).path)
    path.write_text("not mine")
    with pytest.raises(ConfigError, match="not a socket"):
        service.server(MemoryStore())
    assert path.read_text() == "not mine"


def test_the_socket_is_private_and_a_stopped_server_leaves_no_file(service: Service) -> None:
    ep = Endpoint.parse(service.endpoint)
    server = service.server(MemoryStore())
    assert Path(ep.path).is_socket()
    assert Path(ep.path).stat().st_mode & 0o777 == 0o600
    assert Path(ep.lock_path).stat().st_mode & 0o777 == 0o600
    server.close()
    assert not Path(ep.path).exists() and not Path(ep.lock_path).exists()
    service.server(MemoryStore())  # the endpoint is free again
    assert service.client().lookup("r", chunk_hashes(1), 2 * CHUNK) == 0


def test_a_link_at_the_lock_path_is_never_followed(service: Service, tmp_path: Path) -> None:
    ep = Endpoint.parse(service.endpoint)
    target = tmp_path / "elsewhere"
    os.symlink(target, ep.lock_path)
    with pytest.raises(ConfigError, match="link there is never followed"):
        service.server(MemoryStore())
    assert not target.exists()


def test_the_run_dir_is_private_to_its_user(tmp_path: Path) -> None:
    fresh = tmp_path / "new" / "fresh"  # its parent is made too
    private_dir(str(fresh))
    assert fresh.stat().st_mode & 0o777 == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o777)
    private_dir(str(loose))  # ours: tightened
    assert loose.stat().st_mode & 0o777 == 0o700
    link = tmp_path / "link"
    link.symlink_to(fresh)
    with pytest.raises(ConfigError, match="not a folder"):
        private_dir(str(link))
    if os.getuid() == 0:  # only root can give a folder away to test this
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 12345, 12345)
        with pytest.raises(ConfigError, match="belongs to uid 12345"):
            private_dir(str(theirs))


def test_a_live_server_keeps_its_endpoint(service: Service) -> None:
    space = space_of(MLA_DCP)
    store = MemoryStore()
    put_chunks(store, MLA_DCP, space, chunk_hashes(1))
    service.server(store, MLA_DCP, space)
    with pytest.raises(LookupEndpointInUse, match="another live lookup server"):
        service.server(MemoryStore())
    assert service.client().lookup("r", chunk_hashes(1), 2 * CHUNK) == CHUNK


def test_servers_of_one_config_on_one_host_each_take_the_first_free_endpoint(
    run_dir: str,
) -> None:
    """Two ``vllm serve`` of one model and config on one host: the second server's
    engine serves on the next endpoint (no setting), each answers from its own
    store, and the first endpoint freed is taken again by the next server."""
    space = space_of(MLA_DCP)
    stores = [MemoryStore() for _ in range(3)]
    put_chunks(stores[1], MLA_DCP, space, chunk_hashes(2))
    ends = lookup_endpoints(run_dir, "m", 0)
    assert len(set(ends)) == len(ends) and ends[0] == lookup_endpoint(run_dir, "m", 0)

    def make(store: MemoryStore) -> Callable[[str], LookupServer]:
        return lambda url: LookupServer(url, store, MLA_DCP, space, CHUNK)

    first = start_first_free(ends, make(stores[0]))
    second = start_first_free(ends, make(stores[1]))
    clients: list[LookupClient] = []
    try:
        assert (first.endpoint.url, second.endpoint.url) == (ends[0], ends[1])
        clients.append(LookupClient(ends[1], timeout_ms=2000.0))
        assert clients[0].lookup("r", chunk_hashes(2), 3 * CHUNK) == 2 * CHUNK
        first.close()
        third = start_first_free(ends, make(stores[2]))
        assert third.endpoint.url == ends[0]
        third.close()
        with pytest.raises(LookupEndpointInUse, match="hold all 1 endpoints"):
            start_first_free(ends[1:2], make(stores[0]))
    finally:
        for c in clients:
            c.close()
        first.close()
        second.close()


def test_tcp_endpoints_on_loopback(service: Service) -> None:
    space = space_of(MLA_DCP)
    store = MemoryStore()
    put_chunks(store, MLA_DCP, space, chunk_hashes(2))
    server = service.server(store, MLA_DCP, space, endpoint="tcp://127.0.0.1:0")
    assert server.bound_url.startswith("tcp://127.0.0.1:")
    client = service.client(server.bound_url)
    assert client.lookup("r", chunk_hashes(2), 3 * CHUNK) == 2 * CHUNK
    with pytest.raises(LookupEndpointInUse):
        service.server(MemoryStore(), endpoint=server.bound_url)


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("ipc://relative.sock", "absolute"),
        ("ipc:///" + "x" * 120, "107 bytes"),
        ("tcp://localhost:5555", "IP address"),
        ("tcp://127.0.0.1:99999", "port"),
        ("tcp://127.0.0.1", "port"),
        ("http://127.0.0.1:80", "ipc:///absolute/path or tcp://IP:PORT"),
    ],
)
def test_bad_endpoints_are_refused(url: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Endpoint.parse(url)


def test_a_client_needs_a_port_and_a_positive_deadline() -> None:
    with pytest.raises(ConfigError, match="port"):
        LookupClient("tcp://127.0.0.1:0")
    with pytest.raises(ConfigError, match="timeout_ms"):
        LookupClient("tcp://127.0.0.1:5555", timeout_ms=0)


# ---------------------------------------------------------------------------- lifecycle


def test_the_constructor_starts_nothing_and_close_is_idempotent(endpoint: str) -> None:
    server = LookupServer(endpoint, MemoryStore(), MLA_DCP, space_of(MLA_DCP), CHUNK)
    assert not Path(Endpoint.parse(endpoint).path).exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvpool-lookup")]
    server.close()
    server.start()
    with pytest.raises(RuntimeError, match="twice"):
        server.start()
    server.close()
    server.close()
    assert not Path(Endpoint.parse(endpoint).path).exists()
    client = LookupClient(endpoint)
    client.close()
    client.close()
    assert client.lookup("r", chunk_hashes(1), 2 * CHUNK) == 0
    assert client.stats.misses == {"closed": 1}


def test_chunk_size_must_be_positive(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="chunk_size"):
        LookupServer(endpoint, MemoryStore(), MLA_DCP, space_of(MLA_DCP), 0)


# A sliding-window group (64 tokens: 4 chunks of 16 hold the last 63 tokens
# before a hit) beside a full-attention group.
WINDOWED = Layout.create(tp=2, groups=("gqa:2:w64", "gqa:2"))


def _group_keys(layout: Layout, space: KeySpace, group: int, hashes: Sequence[bytes]) -> list[str]:
    return [space.key(c, h) for h in hashes for c in layout.contents(group)]


def filled(
    service: Service, layout: Layout, chunks: int
) -> tuple[KeySpace, HoleyStore, LookupClient, list[bytes]]:
    """A lookup server over a ``HoleyStore`` holding every object of ``chunks``
    chunks: (key space, store, client, chunk hashes)."""
    space = space_of(layout)
    store = HoleyStore()
    service.server(store, layout, space)
    hashes = chunk_hashes(chunks)
    put_chunks(store, layout, space, hashes)
    return space, store, service.client(), hashes


def test_a_sliding_window_group_needs_only_its_window_before_the_hit(service: Service) -> None:
    space, store, client, hashes = filled(service, WINDOWED, 20)
    tokens = 20 * CHUNK + 1
    assert client.lookup("r", hashes, tokens) == 20 * CHUNK
    # The window's group lost its old chunks (as an engine whose sliding window
    # had dropped them saves): the hit stays whole.
    store.holes = set(_group_keys(WINDOWED, space, 0, hashes[:16]))
    assert client.lookup("r", hashes, tokens) == 20 * CHUNK
    # A hole inside the window of the whole hit: the longest hit whose window
    # lies before the hole is the hole itself only if the 4 chunks before it are
    # present; here they are not (0-15 gone), so nothing counts.
    store.holes |= set(_group_keys(WINDOWED, space, 0, hashes[17:18]))
    assert client.lookup("r", hashes, tokens) == 0
    # With chunks 13-16 back, a hit of 17 chunks has its whole window.
    store.holes -= set(_group_keys(WINDOWED, space, 0, hashes[13:17]))
    assert client.lookup("r", hashes, tokens) == 17 * CHUNK
    # The full-attention group still needs every chunk: a hole at 5 bounds it.
    store.holes = set(_group_keys(WINDOWED, space, 1, hashes[5:6]))
    assert client.lookup("r", hashes, tokens) == 5 * CHUNK


def test_an_unreadable_window_chunk_is_reported_not_guessed(service: Service) -> None:
    space, store, client, hashes = filled(service, WINDOWED, 8)
    store.down = set(_group_keys(WINDOWED, space, 0, hashes[7:8]))
    assert client.lookup("r", hashes, 8 * CHUNK + 1) == 0  # an error reply reads as a miss


# Mamba layers (one KV group each in vLLM) beside full attention and a window.
MAMBA_MIX = Layout.create(tp=2, groups=("mamba", "gqa:2", "mamba", "gqa:2:w32"))


def test_a_mamba_group_needs_only_the_state_after_the_hit(service: Service) -> None:
    """States exist only where an engine step ended (vLLM's hand-offs): the hit
    ends at the last chunk whose every Mamba group has its state, inside the
    attention prefix and with the window's chunks before it."""
    space, store, client, hashes = filled(service, MAMBA_MIX, 20)
    tokens = 20 * CHUNK + 1
    assert client.lookup("r", hashes, tokens) == 20 * CHUNK
    states = set(_group_keys(MAMBA_MIX, space, 0, hashes)) | set(
        _group_keys(MAMBA_MIX, space, 2, hashes)
    )
    kept = set(_group_keys(MAMBA_MIX, space, 0, [hashes[7], hashes[15]])) | set(
        _group_keys(MAMBA_MIX, space, 2, [hashes[7], hashes[15]])
    )
    store.holes = states - kept  # states after chunks 7 and 15 only
    assert client.lookup("r", hashes, tokens) == 16 * CHUNK
    # One Mamba group lacks chunk 15's state: the hit falls back to chunk 7's.
    store.holes |= set(_group_keys(MAMBA_MIX, space, 2, hashes[15:16]))
    assert client.lookup("r", hashes, tokens) == 8 * CHUNK
    # The full-attention prefix ends at 5: no state at or below it, no hit.
    store.holes |= set(_group_keys(MAMBA_MIX, space, 1, hashes[5:6]))
    assert client.lookup("r", hashes, tokens) == 0
    # The window (2 chunks) lacks chunk 6: chunk 7's state is of no use either.
    store.holes = (states - kept) | set(_group_keys(MAMBA_MIX, space, 3, hashes[6:7]))
    store.holes |= set(_group_keys(MAMBA_MIX, space, 2, hashes[15:16]))
    assert client.lookup("r", hashes, tokens) == 0
    # An unreadable state at the end of the hit is reported, not guessed.
    store.holes = states - kept
    store.down = set(_group_keys(MAMBA_MIX, space, 0, hashes[15:16]))
    assert client.lookup("r", hashes, tokens) == 0  # an error reply reads as a miss

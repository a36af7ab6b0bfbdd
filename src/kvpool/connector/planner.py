"""The scheduler half of the connector: lookups, load plans and save plans per step.

    Planner(identity, settings, lookup, kv_cache_manager, events, role,
            extra_keys=..., stored_event=..., new_plan=StepPlan)
        ``extra_keys(request, start, end)``: the request's extra keys for tokens
        [start, end) that name a chunk with its tokens (vLLM's LoRA, multimodal
        and cache-salt keys); ``stored_event(hash, parent, tokens, size)``: the KV
        event of a chunk stored (with ``events``); ``new_plan``: the record each
        step's plan is built in. ``kvpool.vllm.scheduler`` gives vLLM's.

    Planner.matched_tokens(request, computed)  (tokens to load beyond
        ``computed``: whole chunks, never the prompt's last token, or None while
        an async lookup is pending; whether the load is asynchronous: not with
        ``by_layer``). It caches the plan, and with ``lookup_async`` starts a
        lookup (asked again next step) instead of waiting for one. A hit is
        loaded only if ``costs`` (``kvpool.connector.costs``, setting
        ``load_decision``) says loading it is faster than computing it; else
        0 (counted in ``recomputed``, the reason in the DEBUG log).
    Planner.recomputed  (requests, tokens) whose hit was computed instead
    Planner.by_layer  loads happen in the step that computes the rest of the
        prompt, waited for layer band by layer band (setting ``load_by_layer``,
        staged loads, one KV group); such a load is never reported finished, and
        the request saves from the next step on
    Planner.after_alloc(request, num_external)  keep the load plan if vLLM
        allocated blocks for it, drop it otherwise
    Planner.build_meta(scheduler_output)  this step's loads (planned since
        the last step) and saves (chunks completed by this step's compute); a
        request is never in both
    Planner.finish(req_id)  drop a finished request's state; True when
        vLLM must keep its blocks until the workers report its saves done (it
        had saves handed over, no load of it is in flight, and workers retry
        refused saves: no KV events, every group keeps its blocks); the next
        step's ``finishing`` names it
    Planner.loads_ended(req_ids)  loads reported finished (vLLM's
        ``finished_recving``)
    Planner.forget(req_id)  drop a request's state (and cancel its async
        lookup)
    Planner.worker_output(meta)  chunk hashes whose load failed are
        suppressed for ``failed_key_ttl_s``: lookups stop before them, so a
        failed load never loops; with ``events``, a chunk whose every object
        (the layout's objects per chunk, over all ranks) reached the pool
        becomes an event (``stored_event``); the forward's time goes to ``costs``
        (times the pipeline stages: they run in turn). A load's time is taken
        here, from ``after_alloc`` to ``loads_ended``.
    Planner.take_events()  the KV events since the last call

Chunks are named by kvpool's own hash chain (``kvpool.chunkhash``) over each
request's tokens and vLLM's extra keys for them, kept per request and extended as
tokens arrive; never by vLLM's block hashes (their values depend on vLLM's hash
settings and exist only with prefix caching on). Block ids come from vLLM's KV
cache manager at the step they are used (never from a mirror of the block
tables). The lookup itself is the lookup service (``kvpool.lookup``), served in
this process with a deadline on every call.

Roles (vLLM's ``kv_role``): ``kv_producer`` (the prefill side of a prefill/decode
pair) saves and never looks up (every lookup answers 0); ``kv_consumer`` (the
decode side) loads and plans no save; ``kv_both`` does both.

Per request (``kv_transfer_params``, the names of vLLM's offloading connector):
``max_load_tokens`` N loads at most N tokens beyond what vLLM has locally (0: no
lookup at all), ``max_offload_tokens`` N saves at most the first N prompt tokens
(0: nothing), ``pin_seconds`` T soft-pins the objects its saves put for T
seconds (at most ``MAX_PIN_S``: an agent's context between tool calls; the pool
evicts unpinned objects first). A value that is not a whole number >= 0 is
ignored for that request, with one warning naming it (vLLM gives a connector no
way to fail one request).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.chunkhash import ChunkChain
from kvpool.chunks import countable_chunks
from kvpool.connector.costs import LoadCosts
from kvpool.connector.identity import EngineIdentity
from kvpool.connector.steps import NULL_BLOCK, ChunkOp, RequestOps, StepPlan, WorkerReport
from kvpool.errors import ConfigError
from kvpool.groups import GroupKind
from kvpool.settings import ConnectorSettings

__all__ = ["MAX_PIN_S", "ROLES", "ExtraKeys", "Lookup", "Planner", "StoredEvent"]

logger = logging.getLogger(__name__)

_MAX_UNSTORED = 65536  # chunks awaiting their stored report (older ones are dropped)
# The longest pin a request gets: Mooncake's default --max_kv_soft_pin_ttl (a
# master refuses a put pinned longer than its own).
MAX_PIN_S = 24 * 3600
_MAX_SUPPRESSED = 65536  # chunks kept out of lookups after a failed load (oldest dropped)


class Lookup(Protocol):
    """The lookup client as the scheduler uses it."""

    def lookup(self, req_id: str, chunk_hashes: list[bytes], num_tokens: int) -> int: ...

    def start(self, req_id: str, chunk_hashes: list[bytes], num_tokens: int) -> None: ...

    def poll(self, req_id: str) -> int | None: ...

    def cancel(self, req_id: str) -> None: ...


ROLES = ("kv_both", "kv_producer", "kv_consumer")

# (request, start token, end token) -> the extra keys naming those tokens' chunk
ExtraKeys = Callable[[Any, int, int], Any]
# (chunk hash, parent chunk hash, token ids, chunk size) -> a KV event
StoredEvent = Callable[[bytes, bytes | None, list[int], int], Any]


def no_extra_keys(request: Any, start: int, end: int) -> None:
    """Requests whose chunks are named by their tokens alone."""
    return None


_WARNED: OrderedDict[tuple[str, str], None] = OrderedDict()


def _limit(request: Any, name: str) -> int | None:
    """``kv_transfer_params[name]`` of a request: a whole number >= 0, or None
    (absent, or not such a number: ignored, with a warning naming it)."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or name not in params:
        return None
    value = params[name]
    if type(value) is int and value >= 0:
        return value
    key = (getattr(request, "request_id", "?"), name)
    if key in _WARNED:  # each bad field once per request (this runs every step)
        return None
    _WARNED[key] = None
    while len(_WARNED) > 1024:
        _WARNED.popitem(last=False)
    logger.warning(
        "kvpool: request %s: kv_transfer_params.%s must be a whole number >= 0, got %r; ignored",
        getattr(request, "request_id", "?"),
        name,
        value,
    )
    return None


@dataclass
class _Request:
    request: Any  # vllm.v1.request.Request
    saved: int = 0  # chunks [0, saved) were handed to the workers' saves
    load: tuple[int, int] | None = None  # chunks [a, b) to load, not yet sent
    pool_end: int | None = None  # the pool's prefix at the lookup, in chunks


class Planner:
    """See the module docstring."""

    def __init__(
        self,
        identity: EngineIdentity,
        settings: ConnectorSettings,
        lookup: Lookup,
        kv_cache_manager: Any = None,
        events: bool = False,
        role: str = "kv_both",
        *,
        extra_keys: ExtraKeys = no_extra_keys,
        stored_event: StoredEvent | None = None,
        new_plan: Callable[[], StepPlan] = StepPlan,
    ) -> None:
        if role not in ROLES:
            raise ConfigError(f"kv_role must be one of {', '.join(ROLES)}, got {role!r}")
        self.identity = identity
        self.settings = settings
        # vLLM's kv_role: a producer (the prefill side) saves and never loads, a
        # consumer (the decode side) loads and never saves; kv_both does both.
        self.loads = role != "kv_producer"
        self.saves = role != "kv_consumer"
        self.lookup = lookup
        self.kv_cache_manager = kv_cache_manager
        self._extra_keys = extra_keys
        self._stored_event = stored_event
        self._new_plan = new_plan
        self._requests: dict[str, _Request] = {}
        self._planned: dict[str, tuple[int, int]] = {}  # req -> chunks [a, b) to load
        self._pool_end: dict[str, int] = {}  # req -> the pool's prefix at its lookup, chunks
        # chunk hash -> until (monotonic), oldest first; at most _MAX_SUPPRESSED
        self._suppressed: OrderedDict[bytes, float] = OrderedDict()
        self._async_started: set[str] = set()
        self._chains: dict[str, ChunkChain] = {}  # req -> its chunk hashes so far
        self.lookups = 0
        self.hit_tokens = 0
        self.costs = LoadCosts(settings.load_decision, small_step=identity.chunk_size)
        # request -> the end (chunks) of its hit, computed instead of loaded: in the
        # pool already, so its saves start there
        self._recomputing: dict[str, int] = {}
        self._recomputed_requests = 0
        # request -> (tokens, monotonic time) of its load planned, until reported
        self._load_began: dict[str, tuple[int, float]] = {}
        self._recomputed_tokens = 0
        self.events = events
        layout = identity.layout
        self._objects_per_chunk = sum(len(layout.contents(g)) for g in range(len(layout.groups)))
        # chunk hash -> [objects stored so far, token ids, parent chunk hash, fresh]
        self._unstored: OrderedDict[bytes, list[Any]] = OrderedDict()
        self._events: list[Any] = []
        # Workers retry a refused save while vLLM keeps the request's blocks (the one
        # rule, ``EngineIdentity.holds_for_saves``): a finished request's blocks are
        # then kept until its saves are done.
        self._drains = identity.holds_for_saves(events) and self.saves
        # Mamba groups: a chunk's state is saved from vLLM's boundary-state hand-off
        # (the block holding the state after exactly that chunk), never by position.
        self._states = frozenset(
            g for g, spec in enumerate(layout.groups) if spec.kind is GroupKind.MAMBA
        )
        self._finishing: set[str] = set()  # finished, blocks kept: for the next step
        self._loading: set[str] = set()  # loads sent, not yet reported finished
        # Loads inside the step that computes the rest (vLLM's sync load): asked for,
        # not direct (a direct get from another host cannot be given up at a deadline;
        # the worker keeps zero copy only for its own host's holder then), and one KV
        # group (vLLM maps a sync load's failed blocks back to requests only then).
        self.by_layer = (
            settings.load_by_layer and settings.load_mode != "direct" and len(layout.groups) == 1
        )
        if settings.load_by_layer and not self.by_layer:
            logger.warning(
                "kvpool: load_by_layer needs load_mode auto or staged (staged or same-host "
                "zero-copy loads) and a model with one KV group; loads stay asynchronous"
            )

    # -- lookups ---------------------------------------------------------------

    def _chain(self, request: Any) -> list[bytes]:
        """The hashes of the request's full chunks so far (``kvpool.chunkhash``:
        kvpool's own chain, not vLLM's block hashes, so engines with other block
        sizes, DCP sizes or hash settings name a chunk alike)."""
        req_id = request.request_id
        chain = self._chains.get(req_id)
        if chain is None:
            chain = self._chains[req_id] = ChunkChain(self.identity.chunk_size)
        fresh = chain.broken is None
        hashes = chain.advance(  # returns at once once the chain stopped
            request.all_token_ids,
            request.num_tokens,
            lambda a, b: self._extra_keys(request, a, b),
        )
        if fresh and chain.broken is not None:
            logger.warning(
                "kvpool: request %s is not pooled past token %d: %s",
                req_id,
                len(hashes) * chain.chunk_size,
                chain.broken,
            )
        return chain.hashes

    def _hashed_chunks(self, request: Any) -> int:
        """Chunks whose every token is known (and hashed) so far."""
        return len(self._chain(request))

    def _hashes(self, request: Any) -> list[bytes]:
        """Chunk hashes of the request's known tokens, cut at the first suppressed one."""
        hashes = list(self._chain(request))
        if self._suppressed:
            now = time.monotonic()
            while self._suppressed and next(iter(self._suppressed.values())) <= now:
                self._suppressed.popitem(last=False)  # expired: one TTL, so oldest first
            for i, h in enumerate(hashes):
                if h in self._suppressed:
                    return hashes[:i]
        return hashes

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.loads:  # a kv_producer: the pool is written, never read
            return 0, False
        most = _limit(request, "max_load_tokens")
        if most == 0:  # this request asked for no load
            return 0, False
        chunk = self.identity.chunk_size
        req_id = request.request_id
        hashes = self._hashes(request)
        if not hashes or len(hashes) * chunk <= num_computed_tokens:
            return 0, False
        if self.settings.lookup_async:
            if req_id not in self._async_started:
                self.lookup.start(req_id, hashes, request.num_tokens)
                self._async_started.add(req_id)
            answer = self.lookup.poll(req_id)
            if answer is None:
                return None, False
            self._async_started.discard(req_id)
            hit = answer
        else:
            hit = self.lookup.lookup(req_id, hashes, request.num_tokens)
        self.lookups += 1
        # Whole chunks only, and never the last prompt token (vLLM must compute it).
        self._pool_end[req_id] = min(hit // chunk, len(hashes))
        hit = min(hit // chunk, countable_chunks(request.num_tokens, chunk, len(hashes))) * chunk
        if most is not None:  # at most this many tokens loaded, whole chunks
            hit = min(hit, (num_computed_tokens + most) // chunk * chunk)
        need = hit - num_computed_tokens
        if need <= 0 or num_computed_tokens % chunk:
            return 0, False
        decision = self.costs.decide(need)
        if decision.reason != "forced" and logger.isEnabledFor(logging.DEBUG):
            logger.debug("kvpool: request %s: a hit of %d tokens: %s",
                         req_id, need, decision.describe())  # fmt: skip
        if not decision.load:
            if req_id not in self._recomputing:  # vLLM may ask again in later steps
                self._recomputing[req_id] = hit // chunk
                self._recomputed_requests += 1
                self._recomputed_tokens += need
            return 0, False
        self._recomputing.pop(req_id, None)  # asked again and loaded after all (counted)
        self._planned[req_id] = (num_computed_tokens // chunk, hit // chunk)
        return need, not self.by_layer

    @property
    def recomputed(self) -> tuple[int, int]:
        """(requests, tokens) whose pool hit was computed instead of loaded, so far
        (the requests still running and those ended: a running total)."""
        return self._recomputed_requests, self._recomputed_tokens

    def totals(self) -> dict[str, Any]:
        """The scheduler's counters since it started, by name: lookups, tokens the
        pool supplied, hits recomputed, and lookups answered as a miss by cause."""
        out: dict[str, Any] = {"lookups": self.lookups, "hit_tokens": self.hit_tokens}
        out["hits_recomputed"], out["tokens_recomputed"] = self.recomputed
        lookup_stats = getattr(self.lookup, "stats", None)
        if lookup_stats is not None:  # a lookup client's: misses by cause
            out["lookup_failures"] = dict(lookup_stats.misses)
        return out

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        state = self._requests.setdefault(request.request_id, _Request(request))
        state.pool_end = self._pool_end.pop(request.request_id, state.pool_end)
        plan = self._planned.pop(request.request_id, None)
        if request.request_id in self._recomputing:  # its hit's chunks: in the pool
            state.saved = max(state.saved, self._recomputing[request.request_id])
        if num_external_tokens > 0 and plan is not None:
            state.load = plan
            self.hit_tokens += num_external_tokens
            if not self.by_layer:  # its wait, from now to its report, is a cost sample
                self._load_began[request.request_id] = (num_external_tokens, time.monotonic())

    # -- per step ------------------------------------------------------------------

    def build_meta(self, out: Any) -> StepPlan:
        meta = self._new_plan()
        meta.finishing, self._finishing = frozenset(self._finishing), set()
        meta.freed = (
            frozenset(out.finished_req_ids)
            | frozenset(getattr(out, "preempted_req_ids", None) or ())
        ) - meta.finishing
        loading: set[str] = set()
        for req_id, state in self._requests.items():
            if state.load is None:
                continue
            a, b = state.load
            state.load = None
            chunks = self._chunk_ops(state, a, b)
            meta.loads.append(RequestOps(req_id, chunks, by_layer=self.by_layer))
            if not self.by_layer:  # a load by layer ends in this step's forward
                self._loading.add(req_id)
            # Loaded chunks stay in the save plan: the workers skip keys they just
            # loaded without a store call, and a chunk whose load failed is saved
            # again once vLLM has recomputed it.
            loading.add(req_id)
        handoffs = self._handoffs(out)
        before: dict[str, int] = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, n in out.num_scheduled_tokens.items():
            current = self._requests.get(req_id)
            if current is None or req_id in loading or not self.saves:
                continue
            state = current
            req = state.request
            limit = req.num_tokens if self.settings.save_decode else req.num_prompt_tokens
            most = _limit(req, "max_offload_tokens")
            if most is not None:  # this request saves at most its first ``most`` tokens
                limit = min(limit, most)
            done = min(before.get(req_id, 0) + n, limit)
            end = min(done // self.identity.chunk_size, self._hashed_chunks(req))
            states = handoffs.get(req_id, {})
            if end > state.saved or states:
                chunks = self._chunk_ops(state, state.saved, end, states, limit)
                if chunks:
                    pin_s = min(_limit(req, "pin_seconds") or 0, MAX_PIN_S)
                    ops = RequestOps(req_id, chunks, state.pool_end, pin_ms=pin_s * 1000)
                    meta.saves.append(ops)
                    if self.events:
                        self._expect_stored(req, chunks)
                state.saved = max(state.saved, end)
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        meta.idle = not out.num_scheduled_tokens
        meta.tokens = sum(out.num_scheduled_tokens.values())
        return meta

    def _chunk_ops(
        self,
        state: _Request,
        a: int,
        b: int,
        states: dict[tuple[int, int], int] | None = None,
        limit: int = 0,
    ) -> tuple[ChunkOp, ...]:
        """Chunks ``[a, b)`` with their blocks in every group, by position. A save
        passes ``states``, this step's Mamba hand-offs ((group, chunk) -> block):
        a Mamba group's block is then that hand-off or none (``NULL_BLOCK``), and
        a hand-off's chunk outside ``[a, b)`` (below ``limit`` tokens) is added
        with only its state."""
        ids = self.kv_cache_manager.get_block_ids(state.request.request_id)
        m = self.identity.blocks_per_chunk
        names = self._chain(state.request)
        extra = {k for _, k in states or () if not a <= k < b and (k + 1) * self.identity.chunk_size
                 <= limit and k < len(names)}  # fmt: skip
        ops = []
        for k in sorted(set(range(a, b)) | extra):
            blocks: list[tuple[int, ...]] = []
            for g, table in enumerate(ids):
                if states is not None and g in self._states:
                    blocks.append((states.get((g, k), NULL_BLOCK),))
                elif a <= k < b:
                    blocks.append(tuple(table[k * m : (k + 1) * m]))
                else:
                    blocks.append((NULL_BLOCK,) * m)
            ops.append(ChunkOp(k, names[k], tuple(blocks)))
        return tuple(ops)

    def _handoffs(self, out: Any) -> dict[str, dict[tuple[int, int], int]]:
        """This step's Mamba boundary-state hand-offs that end a chunk, per request:
        (group, chunk) -> the block holding the state after that chunk (written
        by this step's forward, read by the workers' saves after it)."""
        if not self._states:
            return {}
        block_state = getattr(out, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None) or {}
        chunk = self.identity.chunk_size
        got: dict[str, dict[tuple[int, int], int]] = {}
        for req_id, items in offloads.items():
            for g, block, boundary in items:
                if g in self._states and boundary > 0 and boundary % chunk == 0:
                    got.setdefault(req_id, {})[(g, boundary // chunk - 1)] = block
        return got

    # -- KV events --------------------------------------------------------------------

    def _expect_stored(self, req: Any, chunks: tuple[ChunkOp, ...]) -> None:
        n = self.identity.chunk_size
        names = self._chain(req)
        for c in chunks:
            parent = names[c.chunk - 1] if c.chunk > 0 else None
            tokens = list(req.all_token_ids[c.chunk * n : (c.chunk + 1) * n])
            self._unstored.setdefault(c.chunk_hash, [0, tokens, parent, False])
            self._unstored.move_to_end(c.chunk_hash)
        while len(self._unstored) > _MAX_UNSTORED:  # saves that never completed
            self._unstored.popitem(last=False)

    def _stored(self, stored: dict[bytes, int], fresh: set[bytes]) -> None:
        """Count reported objects; a chunk complete with at least one object put by
        this engine (not only found there) becomes one event."""
        for h, count in stored.items():
            entry = self._unstored.get(h)
            if entry is None:
                continue
            entry[0] += count
            entry[3] = entry[3] or h in fresh
            if entry[0] < self._objects_per_chunk:
                continue
            del self._unstored[h]
            _, tokens, parent, new = entry
            if not new:  # already in the pool before: announced when it was put
                continue
            if self._stored_event is not None:
                self._events.append(self._stored_event(h, parent, tokens, self.identity.chunk_size))

    def take_events(self) -> list[Any]:
        out, self._events = self._events, []
        return out

    # -- lifecycle -------------------------------------------------------------------

    def finish(self, req_id: str) -> bool:
        """Drop a finished request; whether vLLM must keep its blocks until every
        worker lists it as finished sending (see the module docstring)."""
        state = self._requests.get(req_id)
        self.forget(req_id)
        if req_id in self._loading:
            # vLLM itself keeps the blocks of a request aborted while its load runs,
            # and frees them when the load is reported: a second hold would free
            # them twice.
            self._loading.discard(req_id)
            return False
        if not self._drains or state is None or state.saved == 0:
            return False
        self._finishing.add(req_id)
        return True

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._chains.pop(req_id, None)
        self._planned.pop(req_id, None)
        self._pool_end.pop(req_id, None)
        self._recomputing.pop(req_id, None)
        self._load_began.pop(req_id, None)
        if req_id in self._async_started:
            self._async_started.discard(req_id)
            self.lookup.cancel(req_id)

    def loads_ended(self, req_ids: Any) -> None:
        """Requests whose load the workers reported finished (or failed): how long
        each waited, from the step that planned it to this report (the steps it sat
        out, the transfer, the report), is what loading cost it."""
        self._loading.difference_update(req_ids or ())
        now = time.monotonic()
        for req_id in req_ids or ():
            began = self._load_began.pop(req_id, None)
            if began is not None:
                self.costs.loaded(began[0], now - began[1])

    def worker_output(self, meta: Any) -> None:
        if isinstance(meta, WorkerReport) and meta.forward is not None:
            tokens, seconds = meta.forward
            self.costs.stepped(tokens, seconds * self.identity.layout.pp)
        if isinstance(meta, WorkerReport) and meta.stored and self.events:
            self._stored(meta.stored, meta.fresh)
        if isinstance(meta, WorkerReport) and meta.failed_hashes:
            until = time.monotonic() + self.settings.failed_key_ttl_s
            for h in meta.failed_hashes:
                self._suppressed.pop(h, None)  # renewed: to the end of the order
                self._suppressed[h] = until
            while len(self._suppressed) > _MAX_SUPPRESSED:
                self._suppressed.popitem(last=False)
            logger.info(
                "kvpool: %d chunk(s) failed to load; lookups skip them for %.0f s",
                len(meta.failed_hashes),
                self.settings.failed_key_ttl_s,
            )

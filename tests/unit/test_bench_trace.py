"""``kvpool bench trace``'s pure parts: the trace parser, sessions, prompts, the ideal
and LRU references, the router, the replay's pacing, the table. Hand-checked traces."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from kvpool.bench.fleet import Check, ConfigRun, Fleet, TraceBench, percentile
from kvpool.bench.replay import Answer, Pacing, Router, replay
from kvpool.bench.trace import (
    Sample,
    TraceError,
    TraceRequest,
    Turn,
    link_sessions,
    parse_trace,
    read_trace,
    reuse,
    reuse_after,
    select,
)
from kvpool.cli.bench_trace_cmd import trace_chart, trace_table
from kvpool.demo.shapes import SHAPES

TRACE = Path(__file__).resolve().parents[2] / "traces" / "conversation_trace.jsonl.gz"


def line(ts: int, ids: list[int], length: int = 2048, out: int = 10) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids}
    )


def req(ids: list[int], ts: int = 0, length: int = 2048) -> TraceRequest:
    return TraceRequest(ts, length, 10, tuple(ids))


def test_the_parser_reads_mooncakes_format_and_skips_blank_lines() -> None:
    reqs = parse_trace([line(0, [0, 1]), "", line(1500, [0, 1, 2], 1100, 7) + "\n"])
    assert reqs == [TraceRequest(0, 2048, 10, (0, 1)), TraceRequest(1500, 1100, 7, (0, 1, 2))]
    no_output = parse_trace(['{"timestamp": 3, "input_length": 9, "hash_ids": [4]}'])
    assert no_output[0].output_length == 0


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{not json", "line 2: not JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ('{"timestamp": 0, "hash_ids": [1]}', "line 2: missing input_length"),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": []}', "non-empty list of integers"),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": [1, "a"]}', "list of integers"),
        ('{"timestamp": -1, "input_length": 5, "hash_ids": [1]}', "timestamp must be"),
        ('{"timestamp": true, "input_length": 5, "hash_ids": [1]}', "timestamp must be"),
        ('{"timestamp": 0, "input_length": 0, "hash_ids": [1]}', "input_length must be"),
    ],
)
def test_a_bad_line_is_named_with_what_to_fix(text: str, needle: str) -> None:
    with pytest.raises(TraceError, match=needle):
        parse_trace([line(0, [0]), text], "t.jsonl")


def test_an_empty_or_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(empty)
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "missing.jsonl")


def test_a_turn_continues_the_longest_earlier_prompt_it_extends() -> None:
    reqs = [
        req([0, 1, 2, 3]),  # 0
        req([0, 1, 2, 3, 4]),  # 1: 0's prompt but its last block (0, 1, 2), then more
        req([0, 5, 6]),  # 2: shares only block 0 (a system prompt): a session of its own
        req([0, 1, 2, 3, 4, 7]),  # 3: extends 1 (0, 1, 2, 3), longer than 0's
        req([0, 5]),  # 4: its body is one block, too short to be continued
        req([0, 5, 6, 8]),  # 5: extends 2 (0, 5)
        req([0, 5, 9]),  # 6: another turn after 2 (0, 5)
        req([0, 1, 2, 3, 4]),  # 7: 1's prompt again (a retry): extends 1's body too
    ]
    assert link_sessions(reqs) == [None, 0, None, 1, None, 2, 2, 1]


def test_select_scales_cuts_and_keeps_whole_sessions() -> None:
    reqs = [
        req([0, 1, 2], ts=0, length=1000),  # session A
        req([0, 7, 8], ts=1000, length=1536),  # session B (one turn)
        req([0, 1, 2, 3], ts=5000, length=1800),  # A's second turn
        req([0, 9, 10], ts=70_000, length=1536),  # session C, starts after 60 s
    ]
    turns = select(reqs, Sample(block_tokens=4, min_turns=1))
    assert [t.trace_index for t in turns] == [0, 1, 2, 3]
    # 1000 tokens at 512 per block -> 7.8 blocks of 4: 8 tokens (whole ids allow 12).
    assert [t.prompt_tokens for t in turns] == [8, 12, 14, 12]
    assert [t.parent for t in turns] == [None, None, 0, None]
    assert [t.session for t in turns] == [0, 1, 0, 3]
    assert [t.arrival_s for t in turns] == [0.0, 1.0, 5.0, 70.0]
    two = select(reqs, Sample(block_tokens=4, min_turns=2))
    assert [t.trace_index for t in two] == [0, 2]
    window = select(reqs, Sample(block_tokens=4, duration_s=60.0, min_turns=1))
    assert [t.trace_index for t in window] == [0, 1, 2]
    late = select(reqs, Sample(block_tokens=4, start_s=1.0, min_turns=1))
    assert [t.trace_index for t in late] == [1, 3]  # A started before: left out whole
    assert [t.arrival_s for t in late] == [0.0, 69.0]
    short = select(reqs, Sample(block_tokens=4, min_turns=1, max_prompt=12))
    assert [t.trace_index for t in short] == [1, 3]  # A's second turn is 14 tokens long
    one = select(reqs, Sample(block_tokens=4, min_turns=1, sessions=1, seed=1))
    assert one == select(reqs, Sample(block_tokens=4, min_turns=1, sessions=1, seed=1))
    assert len({t.session for t in one}) == 1
    with pytest.raises(TraceError, match="no session"):
        select(reqs, Sample(min_turns=3))


def test_prompts_share_exactly_the_blocks_their_hash_ids_share() -> None:
    a = Turn(0, 0, 0.0, 0, None, (0, 1, 2), 10, 1)
    b = Turn(1, 1, 0.0, 1, None, (0, 1, 5), 12, 1)
    ta, tb = a.token_ids(4), b.token_ids(4)
    assert len(ta) == 10 and len(tb) == 12
    assert ta[:8] == tb[:8] and ta[8:10] != tb[8:10]
    assert ta == a.token_ids(4)  # deterministic
    assert all(10 <= t < 1000 for t in ta + tb)


def turn(i: int, ids: tuple[int, ...], tokens: int, parent: int | None = None) -> Turn:
    return Turn(i, i, 0.0, i if parent is None else parent, parent, ids, tokens, 1)


def test_the_ideal_and_lru_references_count_whole_blocks_as_vllm_does() -> None:
    turns = [
        turn(0, (1, 2, 3), 12),  # nothing earlier
        turn(1, (1, 2, 4), 12),  # (1), (1, 2) cached; never its last token's block
        turn(2, (1, 2, 3), 10),  # 2 whole blocks, both cached
        turn(3, (1, 2, 3), 8),  # 2 whole blocks, but vLLM computes the 8th token: 1 block
        turn(4, (6, 2, 3), 12),  # block 2 was seen, but after another first block
    ]
    assert reuse(turns, 4) == [0, 8, 8, 4, 0]
    # An LRU cache of 2 blocks keeps the prefix's first blocks (used last).
    assert reuse(turns, 4, capacity_blocks=2) == [0, 8, 8, 4, 0]
    assert reuse(turns, 4, capacity_blocks=1) == [0, 4, 4, 4, 0]
    assert reuse(turns[:1] + turns[4:] + turns[1:2], 4, capacity_blocks=3) == [0, 0, 0]


def test_reuse_after_counts_only_turns_answered_before_a_turn_was_sent() -> None:
    turns = [turn(0, (1, 2, 3), 12), turn(1, (1, 2, 4), 12), turn(2, (1, 2, 5), 12)]
    # 1 was sent while 0 ran; 2 after 0 answered; 1 never answered.
    assert reuse_after(turns, 4, sent=[0.0, 1.0, 6.0], finished=[5.0, None, 9.0]) == [0, 0, 8]


def test_the_routers_spread_stick_and_balance() -> None:
    turns = [turn(i, (i,), 4, parent=None if i < 2 else i % 2) for i in range(5)]
    rr = Router("round-robin", 2)
    assert [rr.pick(t, [0, 0]) for t in turns] == [0, 1, 0, 1, 0]
    sticky = Router("session", 3)
    # sessions 0, 1, 0, 1, 0 (turns 2-4 continue 0 or 1): dealt to servers 0 and 1
    assert [sticky.pick(t, [0, 0, 0]) for t in turns] == [0, 1, 0, 1, 0]
    least = Router("least-loaded", 3)
    assert least.pick(turns[0], [2, 1, 1]) == 1 and least.pick(turns[0], [0, 1, 0]) == 0
    with pytest.raises(ValueError, match="router must be one of"):
        Router("random", 2)


class _FakeServer(http.server.ThreadingHTTPServer):
    """Streams a fixed answer after ``delay_s``, recording when each request ran."""

    daemon_threads = True

    def __init__(self, delay_s: float) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.delay_s = delay_s
        self.spans: list[tuple[int, float, float]] = []  # (first token id, start, end)
        self.lock = threading.Lock()
        self.active = 0
        self.most_active = 0


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _FakeServer

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.active += 1
            self.server.most_active = max(self.server.most_active, self.server.active)
        start = time.monotonic()
        time.sleep(self.server.delay_s)  # a request that takes time, as a prefill does
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            choice = {"text": "x", "logprobs": {"token_logprobs": [-0.5 * i]}}
            self.wfile.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
        self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        with self.server.lock:  # done before the client can see the end of the answer
            self.server.active -= 1
            self.server.spans.append((body["prompt"][0], start, time.monotonic()))
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_servers() -> Iterator[list[_FakeServer]]:
    servers = [_FakeServer(0.05), _FakeServer(0.05)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        yield servers
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_a_sessions_next_turn_waits_for_its_answer_and_concurrency_holds(
    fake_servers: list[_FakeServer],
) -> None:
    # Sessions 0 -> 2 -> 4 and 1 -> 3; turn 5 alone. Each turn's first block differs,
    # so the fake server's first prompt token names the turn.
    ids = [(100 + i,) for i in range(6)]
    parents = [None, None, 0, 1, 2, None]
    turns = [turn(i, ids[i], 8, parents[i]) for i in range(6)]
    firsts = {t.token_ids(4)[0]: t.index for t in turns}
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in fake_servers]
    answers = replay(turns, urls, "m", Pacing(block_tokens=4, output_tokens=3, concurrency=2))
    assert [a.turn for a in answers] == list(range(6))
    assert all(a.error is None and a.output_tokens == 3 and a.cached_tokens == 4 for a in answers)
    assert all(a.text == "xxx" and a.logprobs == (0.0, -0.5, -1.0) for a in answers)
    assert all(0 < (a.ttft_s or 0) <= (a.e2e_s or 0) for a in answers)
    in_send_order = sorted(answers, key=lambda a: (a.sent_s, a.turn))
    assert [a.server for a in in_send_order] == [0, 1, 0, 1, 0, 1]  # round-robin
    spans = {firsts[f]: (start, end) for s in fake_servers for f, start, end in s.spans}
    for child, parent in enumerate(parents):
        if parent is not None:
            assert spans[child][0] >= spans[parent][1], (child, parent)
    assert max(s.most_active for s in fake_servers) <= 2
    events = sorted([(s, 1) for s, _ in spans.values()] + [(e, -1) for _, e in spans.values()])
    running = [sum(d for _, d in events[: k + 1]) for k in range(len(events))]
    assert max(running) <= 2


def test_a_failed_request_is_an_answer_and_its_session_goes_on() -> None:
    turns = [turn(0, (1,), 8), turn(1, (1, 2), 8, parent=0)]
    answers = replay(turns, ["http://127.0.0.1:9"], "m", Pacing(block_tokens=4, timeout_s=5))
    assert [a.turn for a in answers] == [0, 1]
    assert all(a.error and a.e2e_s is None for a in answers)


def test_arrival_times_pace_the_turns(fake_servers: list[_FakeServer]) -> None:
    turns = [Turn(i, i, 1.0 * i, i, None, (200 + i,), 8, 1) for i in range(3)]
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in fake_servers]
    answers = replay(turns, urls, "m", Pacing(block_tokens=4, output_tokens=1, speedup=2.0))
    # Arrivals 0, 1 and 2 s at twice the speed: sent at 0, 0.5 and 1 s (never before;
    # the slack after is for a loaded machine's late wake-up).
    for a, due in zip(answers, (0.0, 0.5, 1.0), strict=True):
        assert due <= a.sent_s < due + 0.4, (a.sent_s, due)


def _run(name: str, ttfts: list[float], tokens: tuple[int, int, int]) -> ConfigRun:
    answers = tuple(Answer(i, i % 2, 0.1 * i, t, t + 0.05, 100, 0, 8) for i, t in enumerate(ttfts))
    local, pool, computed = tokens
    by_source = {"local_cache_hit": local, "external_kv_transfer": pool, "local_compute": computed}
    checks = (Check(1, (1, 0), 64, True, 2e-6), Check(3, (1, 0), 32, True, 1e-5))
    moved = {"bytes_saved": 4 << 20, "bytes_loaded": 3 << 20} if name == "kvpool" else {}
    return ConfigRun(name, answers, 10.0, by_source, 3, 0, 250, checks, 96, **moved)


def test_the_table_fits_80_columns_and_shows_each_fleet_beside_the_references() -> None:
    result = TraceBench(
        trace="t.jsonl",
        fleet=Fleet(SHAPES["small-gqa"]),
        pacing=Pacing(concurrency=2),
        turns=4,
        sessions=2,
        prompt_tokens=1000,
        ideal_tokens=600,
        lru_tokens=500,
        pool_blocks=1234,
        runs=(
            _run("none", [0.4, 0.5, 0.6, 2.0], (300, 0, 700)),
            _run("kvpool", [0.1, 0.2, 0.3, 1.0], (300, 200, 500)),
        ),
    )
    console = Console(width=80, record=True)
    console.print(trace_table(result))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    rows = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.strip()}
    assert rows["kvpool"][1:5] == ["200", "1000", "1000", "250"]  # p50 p90 p99, e2e p50
    assert rows["kvpool"][5:] == ["0.40", "100", "30%", "20%", "50%", "25%", "0"]
    assert rows["none"][8:10] == ["0%", "30%"]
    caption = " ".join(text.split())
    assert "kvpool: 3 objects evicted, 0 puts refused, 2 of 2 answers asked again" in caption
    assert "(logprobs within 1e-05)" in caption
    # kvpool's load decision and its write efficiency: bytes read per byte written
    assert "96 tokens of pool hits computed instead of loaded, 4 MiB written and 3 read" in caption
    assert "(0.75 read per byte written)" in caption and "load_decision measured" in caption
    assert rows["ideal"][1:] == ["60%"] and rows["LRU"][1:] == ["50%"]
    import xml.etree.ElementTree as ET

    root = ET.fromstring(trace_chart(result))
    names = [p.findtext("{http://www.w3.org/2000/svg}title") for p in root.iter()
             if p.tag.endswith("polyline")]  # fmt: skip
    assert names == ["none", "kvpool"]


def test_percentiles_take_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (
        50.0,
        99.0,
        100.0,
    )
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_the_conversation_traces_ideal_reuse_is_the_published_one() -> None:
    """37.4% of its prompt tokens at whole 512-token blocks (the trace's README); at
    32-token blocks, whole sessions, every request kept."""
    turns = select(read_trace(TRACE), Sample(min_turns=1))
    assert len(turns) == 12_031
    share = sum(reuse(turns, 32)) / sum(t.prompt_tokens for t in turns)
    assert 0.36 < share < 0.38

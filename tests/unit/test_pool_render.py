"""Pool helpers that need no processes: metrics parsing, namespaces, CLI tables."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from tests.factories import key_space

from kvpool.cli.app import run
from kvpool.cli.pool_render import (
    format_bytes,
    kv_transfer_config,
    namespace_table,
    status_json,
    status_view,
    up_summary,
)
from kvpool.pool import (
    LocalPool,
    PoolStatus,
    completed_puts,
    namespace_counts,
    parse_metrics,
    segment_capacities,
)

METRICS = """\
# HELP master_key_count keys
# TYPE master_key_count gauge
master_allocated_bytes 6
master_total_capacity_bytes 268435456
segment_total_capacity_bytes{segment="127.0.0.1:13047"} 268435456
segment_total_capacity_bytes{segment="127.0.0.1:14000"} 1.073741824e+09
master_key_count 2
weird{label="a b"} 3 1700000000
not a sample
"""

KEY = "kvpool/1/org/llama/0123456789abcdef/g{g}.h{h}.d0.c0.b0/{n:02x}"


def _render(renderable: object) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


def test_parse_metrics() -> None:
    m = parse_metrics(METRICS)
    assert m["master_key_count"] == 2
    assert m['weird{label="a b"}'] == 3
    assert "not" not in m and not any(k.startswith("#") for k in m)
    assert segment_capacities(m) == {"127.0.0.1:13047": 268435456, "127.0.0.1:14000": 1 << 30}


def test_completed_puts_count_finished_puts_not_started_ones() -> None:
    m = {
        "master_key_count": 9,  # 2 of them still between PutStart and PutEnd
        "master_put_end_requests_total": 3,
        "master_put_end_failures_total": 1,
        "master_batch_put_end_items_total": 6,
        "master_batch_put_end_failed_items_total": 1,
    }
    assert completed_puts(m) == 7
    assert completed_puts({}) == 0


def test_namespace_counts() -> None:
    keys = [KEY.format(g=g, h=h, n=n) for g in (0, 1) for h in (0, 1) for n in range(3)]
    keys += ["foreign", "kvpool/1/bad"]
    summary = namespace_counts(keys)
    assert summary.other == 2
    assert [(r.model, r.group, r.contents, r.keys) for r in summary.rows] == [
        ("org/llama", 0, 2, 6),
        ("org/llama", 1, 2, 6),
    ]
    text = _render(namespace_table(summary))
    assert "org/llama" in text and "(other)" in text and "tenant" not in text


def test_namespace_counts_per_tenant_and_purge_selects_one_tenant() -> None:
    from kvpool.pool.purge import select

    mine = [KEY.format(g=0, h=h, n=n) for h in (0, 1) for n in range(3)]
    theirs = [k.replace("kvpool/1/", "kvpool/1/!team-b/") for k in mine]
    summary = namespace_counts(mine + theirs[:4])
    assert [(r.tenant, r.model, r.keys) for r in summary.rows] == [
        ("", "org/llama", 6),
        ("team-b", "org/llama", 4),
    ]
    text = _render(namespace_table(summary))
    assert "tenant" in text and "team-b" in text
    assert select(mine + theirs, tenant="team-b") == theirs
    assert select(mine + theirs, model="org/llama") == mine + theirs  # every tenant
    assert select(mine + theirs, model="org/llama", tenant="team-b") == theirs
    assert select(mine + theirs, model="org/other", tenant="team-b") == []


def _status(**kw: object) -> PoolStatus:
    base: dict[str, object] = {
        "master_address": "127.0.0.1:5000",
        "holder_address": "127.0.0.1:5001",
        "metrics_url": "http://127.0.0.1:5002",
        "processes": (("master", 10, True), ("holder", 11, False)),
        "reachable": True,
        "keys": 7,
        "used_bytes": 1 << 20,
        "capacity_bytes": 1 << 30,
        "clients": 2,
        "segments": {"127.0.0.1:13000": 1 << 30},
        "namespaces": namespace_counts([KEY.format(g=0, h=0, n=1)]),
    }
    base.update(kw)
    return PoolStatus(**base)  # type: ignore[arg-type]


def test_an_ha_status_counts_failovers_and_names_the_last_leaders() -> None:
    from kvpool.pool.ha import Election
    from kvpool.pool.status import MasterState

    masters = (
        MasterState("master", "127.0.0.1:6001", "http://127.0.0.1:7001", "down"),
        MasterState("master-2", "127.0.0.1:6002", "http://127.0.0.1:7002", "leader",
                    "serving", 9),
    )  # fmt: skip
    ha = [Election(2, "127.0.0.1:6001"), Election(5, "127.0.0.1:6002")]
    ha += [Election(7, "127.0.0.1:6001"), Election(9, "127.0.0.1:6002")]
    s = _status(masters=masters, elections=tuple(ha))
    assert s.failovers == 3
    text = _render(status_view(s, Path("/p")))
    assert "failovers │ 3 (leaders: ..., 127.0.0.1:6002 from view 5, then" in text
    js = json.loads(json.dumps(status_json(s, Path("/p"))))
    assert js["failovers"] == 3 and js["leaders"][0] == {"view": 2, "leader": "127.0.0.1:6001"}
    unknown = _status(masters=masters, elections_error="etcd at x did not answer")
    assert unknown.failovers is None
    assert "failovers │ unknown (etcd at x did not answer)" in _render(
        status_view(unknown, Path("/p"))
    )
    assert _status().failovers is None  # one master: no failover to count


def test_status_view_and_json() -> None:
    text = _render(status_view(_status(), Path("/p/pool.json")))
    assert "127.0.0.1:5000  (pid 10)" in text and "(pid 11, not running)" in text
    assert "1.0 MiB used of 1.0 GiB (0.1%)" in text and "org/llama" in text
    js = status_json(_status(), Path("/p/pool.json"))
    assert json.loads(json.dumps(js))["namespaces"]["rows"][0]["keys"] == 1

    bad = _status(reachable=False, error="cannot read x", namespaces=None)
    down = _render(status_view(bad, Path("/p")))
    assert "master not answering" in down and "keys" not in down


def test_a_pool_across_hosts_shows_memory_per_host() -> None:
    two = _status(
        segments={"10.0.0.1:13000": 1 << 30, "10.0.0.2:13000": 1 << 30, "10.0.0.2:13001": 1 << 30},
        segments_used={"10.0.0.1:13000": 1 << 20, "10.0.0.2:13000": 2 << 20},
    )
    assert two.hosts() == {"10.0.0.1": (1, 1 << 20, 1 << 30), "10.0.0.2": (2, 2 << 20, 2 << 30)}
    text = _render(status_view(two, Path("/p/pool.json")))
    assert "10.0.0.1: 1.0 MiB used of 1.0 GiB (1 segment)" in text
    assert "10.0.0.2: 2.0 MiB used of 2.0 GiB (2 segments)" in text
    js = json.loads(json.dumps(status_json(two, Path("/p"))))
    assert js["hosts"]["10.0.0.2"] == {
        "segments": 2,
        "used_bytes": 2 << 20,
        "capacity_bytes": 2 << 30,
    }
    assert "hosts" not in _render(status_view(_status(), Path("/p")))  # one host: no row

    # Keys per host, exact when every key was asked, "~" when a sample was scaled.
    for sampled, mark in ((7, ""), (3, "~")):
        counted = _status(
            segments=two.segments,
            segments_used=two.segments_used,
            host_keys={"10.0.0.1": 2, "10.0.0.2": 5},
            host_keys_sampled=sampled,
        )
        text = _render(status_view(counted, Path("/p")))
        assert f"10.0.0.2: 2.0 MiB used of 2.0 GiB (2 segments), {mark}5 keys" in text
        js = json.loads(json.dumps(status_json(counted, Path("/p"))))
        assert js["hosts"]["10.0.0.1"]["keys"] == 2 and js["host_keys_sampled"] == sampled


def test_up_summary_and_flag(tmp_path: Path) -> None:
    pool = LocalPool(
        home=tmp_path,
        master_address="127.0.0.1:5000",
        metrics_url="http://127.0.0.1:5002",
        holder_address="127.0.0.1:5001",
        segment_size=1 << 30,
    )
    text = _render(up_summary(pool, tmp_path / "pool.json"))
    assert "127.0.0.1:5000" in text and "1.0 GiB" in text and "pool.json" in text
    flag = json.loads(kv_transfer_config("/x/pool.json"))
    assert flag["kv_role"] == "kv_both" and flag["kv_load_failure_policy"] == "recompute"
    assert flag["kv_connector_extra_config"] == {"pool_file": "/x/pool.json"}


@pytest.mark.parametrize(
    ("n", "text"), [(None, "?"), (0, "0 B"), (1536, "1.5 KiB"), (5 << 40, "5.0 TiB")]
)
def test_format_bytes(n: int | None, text: str) -> None:
    assert format_bytes(n) == text


def test_bad_options_exit_2_before_starting_anything(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPOOL_HOME", str(tmp_path))
    assert run(["up", "--segment-size", "lots"]) == 2
    assert run(["up", "--master", "nohost"]) == 2
    assert run(["up", "--metrics-url", "http://127.0.0.1:1"]) == 2
    assert "segment" in capsys.readouterr().err
    assert not (tmp_path / "pool.json").exists()


def test_keys_per_host_are_counted_exactly_or_scaled_from_a_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from collections import Counter

    from kvpool.pool import status as status_mod

    keys = [f"k{i}" for i in range(3000)]
    asked: list[int] = []

    def hosts(url: str, sample: list[str], timeout: float) -> Counter[str]:
        asked.append(len(sample))
        return Counter({"10.0.0.1": sum(k < "k2" for k in sample), "10.0.0.2": len(sample)})

    monkeypatch.setattr(status_mod, "key_hosts", hosts)
    counts, sampled = status_mod._keys_per_host("http://x", keys, 1.0)
    assert sampled == status_mod.KEY_SAMPLE == asked[0]
    assert counts["10.0.0.2"] == 3000  # every key has a replica there
    assert 700 < counts["10.0.0.1"] < 1500  # ~1111 of 3000 sort below "k2"
    counts, sampled = status_mod._keys_per_host("http://x", keys[:10], 1.0)
    assert sampled == 10 and counts == {"10.0.0.1": 2, "10.0.0.2": 10}  # "k0", "k1": exact


def test_namespace_bytes_add_each_content_ids_keys_times_its_objects_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer bands of unequal size: each content id is sized on its own."""
    from kvpool.pool import status

    band = "kvpool/1/org/llama/0123456789abcdef/g0.h0.d0.c0.b{b}/{n:02x}"
    keys = [band.format(b=0, n=n) for n in range(3)] + [band.format(b=1, n=n) for n in range(5)]
    sizes = {0: 1000, 1: 700}  # band 1 holds fewer layers
    monkeypatch.setattr(
        status, "key_bytes", lambda url, ks, timeout: sizes[int(ks[0].split(".b")[1][0])]
    )
    summary = status._with_bytes(namespace_counts(keys), "http://127.0.0.1:1", 1.0)
    assert [(r.keys, r.bytes) for r in summary.rows] == [(8, 3 * 1000 + 5 * 700)]


def test_durations_and_ages_read_and_print_as_an_operator_writes_them() -> None:
    from kvpool.cli.pool_render import format_age, parse_duration

    assert [parse_duration(v) for v in ("90s", "10m", "2.5h", "7d", " 1 h ")] == [
        90, 600, 9000, 604800, 3600,
    ]  # fmt: skip
    for bad in ("", "10", "h", "1w", "-1h", "2 weeks"):
        with pytest.raises(ValueError, match="a duration is a number and a unit"):
            parse_duration(bad)
    assert [format_age(s) for s in (-3, 45, 600, 7200, 3 * 86400)] == [
        "0 s", "45 s", "10 min", "2.0 h", "3.0 d",
    ]  # fmt: skip


def test_ages_read_kvpool_headers_only_and_unknown_times_never_match() -> None:
    import random
    from collections.abc import Sequence

    from kvpool import header
    from kvpool.layout import Layout
    from kvpool.pool.ages import oldest_written, written_before, written_times

    layout = Layout.create(groups=["gqa:2"])
    space = key_space(layout)  # fmt: skip
    fp = header.fingerprint_bytes(space.fingerprint)
    keys = [space.key(layout.holdings(0, 0)[0], bytes([n]) * 8) for n in range(4)]
    heads: dict[str, bytes | None] = {
        keys[0]: header.pack(fp, keys[0], 8, written_ms=1000),
        keys[1]: header.pack(fp, keys[1], 8, written_ms=5000),
        keys[2]: header.pack(fp, keys[0], 8, written_ms=10),  # another key's header
        keys[3]: None,  # gone
    }
    asked: list[str] = []

    def read(ks: Sequence[str]) -> list[bytes | None]:
        asked.extend(ks)
        return [heads[k] for k in ks]

    times = written_times(read, [*keys, "not-kvpool"])
    assert "not-kvpool" not in asked
    assert times == {keys[0]: 1000, keys[1]: 5000, keys[2]: None, keys[3]: None}
    assert written_before(times, 5000) == [keys[0]]
    assert oldest_written(read, keys, 10) == (1000, 4)
    oldest, read_n = oldest_written(read, keys, 2, random.Random(1))
    assert read_n == 2 and (oldest is None or oldest in (1000, 5000))

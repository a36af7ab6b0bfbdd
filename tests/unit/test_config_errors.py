"""Which configuration errors mean "no pool here" and which mean "fix a setting"."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvpool.config import load_config
from kvpool.errors import ConfigError, PoolNotFound

# The tests' own environment for load_config: a home without a pool file, never the
# user's own ~/.kvpool (where a real pool file would change what they read).
NO_HOME = {"KVPOOL_HOME": "/nonexistent/kvpool-test-home"}


def test_a_missing_pool_file_is_pool_not_found(tmp_path: Path) -> None:
    path = tmp_path / "pool.json"
    with pytest.raises(PoolNotFound, match=f"no pool file at {path}"):
        load_config({"pool_file": str(path)}, env=NO_HOME)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"master_address": "127.0.0.1:1", ', "not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        (b"\xff\xfe", "not UTF-8"),
        ('{"master_adress": "127.0.0.1:1"}', "'master_adress'; did you mean master_address?"),
    ],
)
def test_a_pool_file_that_is_there_but_invalid_is_a_setting_to_fix(
    tmp_path: Path, content: str | bytes, needle: str
) -> None:
    """One rule: absent = no pool (the engine serves without it); present but
    invalid = stop at start, naming the file and what is wrong (a typo once read
    as "no pool file was found", and the engine ran without the pool)."""
    path = tmp_path / "pool.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(needle)) as raised:
        load_config({"pool_file": str(path)}, env=NO_HOME)
    assert not isinstance(raised.value, PoolNotFound) and str(path) in str(raised.value)


def test_a_pool_file_of_kvpool_up_holds_only_keys_a_reader_knows(tmp_path: Path) -> None:
    from kvpool.pool import LocalPool

    pool = LocalPool(tmp_path, "127.0.0.1:1", "http://127.0.0.1:2", disk_dir="/d", secret="")
    path = pool.write_pool_file(tmp_path / "pool.json")
    assert load_config({"pool_file": str(path)}, env=NO_HOME).master_address == "127.0.0.1:1"


def test_no_pool_at_all_is_pool_not_found(tmp_path: Path) -> None:
    config = load_config({}, env={"KVPOOL_HOME": str(tmp_path)})
    with pytest.raises(PoolNotFound, match="kvpool up"):
        config.require_master()


@pytest.mark.parametrize(
    ("extra", "env", "needle"),
    [
        ({"protocol": "udp"}, {}, "protocol must be"),
        ({"checksum": "maybe"}, {}, "checksum must be true or false"),
        ({"master_adress": "127.0.0.1:1"}, {}, "unknown pool setting(s) master_adress"),
        ({}, {"KVPOOL_MASTER_ADDRESS": "nohost"}, "master_address must be host:port"),
        ({"master_address": "etcd://nohost"}, {}, "or etcd://HOST:PORT[;HOST:PORT...]"),
        ({"master_address": "etcd://127.0.0.1:2379;x"}, {}, "master_address must be"),
    ],
)
def test_a_bad_setting_is_a_config_error_not_an_absent_pool(
    tmp_path: Path, extra: dict[str, str], env: dict[str, str], needle: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(extra, env={"KVPOOL_HOME": str(tmp_path), **env})
    assert not isinstance(raised.value, PoolNotFound)
    assert needle in str(raised.value)


def test_an_ha_pool_is_named_by_its_etcd_endpoints(tmp_path: Path) -> None:
    from kvpool.config import is_ha, master_endpoints, route_address

    config = load_config({"master_address": "etcd://127.0.0.1:2379;127.0.0.2:2379"}, env=NO_HOME)
    assert is_ha(config.master_address) and config.require_master().startswith("etcd://")
    assert master_endpoints(config.master_address) == ["127.0.0.1:2379", "127.0.0.2:2379"]
    assert master_endpoints("127.0.0.1:50051") == ["127.0.0.1:50051"]
    assert route_address(config.master_address) == "127.0.0.1"  # the route to the first


def test_a_pool_file_naming_ha_masters_needs_an_etcd_address(tmp_path: Path) -> None:
    from kvpool.pool import LocalPool

    path = tmp_path / "pool.json"
    path.write_text('{"master_address": "127.0.0.1:1", "ha_masters": "127.0.0.1:2,127.0.0.1:3"}')
    with pytest.raises(ConfigError, match="ha_masters goes with an etcd:// master_address"):
        LocalPool.attach(path)
    path.write_text('{"master_address": "etcd://127.0.0.1:1"}')  # a holder that joined one
    assert LocalPool.attach(path).etcd_endpoint == "127.0.0.1:1"


@pytest.mark.parametrize("bad", ["nan", float("nan"), "inf", float("-inf"), True, "ten", None])
def test_numbers_are_parsed_by_one_rule_in_pool_and_connector_settings(bad: object) -> None:
    """NaN, infinities and bools are refused alike by the pool config and the
    connector settings (they once disagreed: the connector took NaN)."""
    from kvpool.config import PoolConfig
    from kvpool.settings import parse_extra

    with pytest.raises(ConfigError, match="load_timeout_s"):
        parse_extra({"load_timeout_s": bad})
    with pytest.raises(ConfigError, match="transfer_timeout_s"):
        load_config({"transfer_timeout_s": bad}, env=NO_HOME)
    assert PoolConfig().transfer_timeout_s > 0


@pytest.mark.parametrize("bad", [2.5, "3.5", -32, "-1"])
def test_a_whole_number_setting_is_never_cut(bad: object) -> None:
    from kvpool.settings import parse_extra

    with pytest.raises(ConfigError, match="chunk_size"):
        parse_extra({"chunk_size": bad})


def test_good_numbers_still_parse() -> None:
    from kvpool.settings import parse_extra

    settings, _ = parse_extra({"chunk_size": "64", "load_timeout_s": "2.5"})
    assert (settings.chunk_size, settings.load_timeout_s) == (64, 2.5)


@pytest.mark.parametrize("bad", ["ab" * 15, "zz" * 16, "abc" * 11, " " + "ab" * 16])
def test_a_malformed_pool_secret_is_refused_without_echoing_it(bad: str) -> None:
    with pytest.raises(ConfigError, match="pool_secret must be") as info:
        load_config({"pool_secret": bad}, env=NO_HOME)
    assert bad.strip() not in str(info.value)


def test_the_pool_secret_stays_out_of_the_config_repr() -> None:
    secret = "0123456789abcdef" * 4
    config = load_config({}, env={**NO_HOME, "KVPOOL_POOL_SECRET": secret})
    assert config.secret == bytes.fromhex(secret)
    assert secret not in repr(config) and secret not in str(config)
    assert load_config({}, env=NO_HOME).secret is None


def test_a_pool_file_with_a_secret_is_its_owners_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvpool.pool import LocalPool

    secret = "fe" * 32
    pool = LocalPool(tmp_path, "127.0.0.1:5", "", secret=secret)
    path = pool.write_pool_file(tmp_path / "pool.json")
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_config({"pool_file": str(path)}, env=NO_HOME).secret == bytes.fromhex(secret)
    assert LocalPool.attach(path).config().pool_secret == secret
    assert secret not in repr(LocalPool.attach(path))
    plain = LocalPool(tmp_path, "127.0.0.1:5", "").write_pool_file(tmp_path / "plain.json")
    assert plain.stat().st_mode & 0o077  # no secret: readable as before
    assert "pool_secret" not in plain.read_text()
    # Made readable by others later: loading it says so, once.
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="kvpool.config"):
        load_config({"pool_file": str(path)}, env=NO_HOME)
        load_config({"pool_file": str(path)}, env=NO_HOME)
    warnings = [r for r in caplog.records if "others may read it" in r.getMessage()]
    assert len(warnings) == 1 and secret not in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"run_dir": None}, "run_dir must be a string"),  # was a folder named "None"
        ({"instance": 7}, "instance must be a string"),
        ({"store": ["mooncake"]}, "store must be a string"),
        ({"shared_memory": 1}, "shared_memory must be auto, on or off"),  # was "on"
        ({"load_mode": True}, "load_mode must be auto, direct or staged"),
        ({"layer_bands": {"0": 1, "16": 2}}, "lists the layers where a band begins"),
        ({"layer_bands": [16, 0]}, "in increasing order"),  # was quietly sorted
        ({"layer_bands": "0,16,16"}, "once, in increasing order"),
        ({"lookup_timout_ms": 5}, "did you mean lookup_timeout_ms?"),
        ({"tenant": 7}, "tenant must be a string"),
        ({"tenant": "team a"}, "tenant: tenant name 'team a' must be 1-64 letters"),
    ],
)
def test_a_connector_setting_of_the_wrong_kind_is_refused_never_converted(
    extra: dict[str, object], needle: str
) -> None:
    from kvpool.settings import parse_extra

    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse_extra(extra)


def test_settings_of_the_right_kind_still_parse() -> None:
    from kvpool.settings import parse_extra

    settings, _ = parse_extra(
        {"shared_memory": True, "layer_bands": "0,16", "run_dir": "/tmp/k", "load_mode": "staged"}
    )
    assert settings.shared_memory == "on" and settings.layer_bands == (0, 16)
    assert settings.run_dir == "/tmp/k" and settings.load_mode == "staged"


def test_the_tenant_comes_from_the_settings_else_from_kvpool_tenant() -> None:
    from kvpool.settings import parse_extra

    assert parse_extra({}, env={})[0].tenant == ""
    assert parse_extra({}, env={"KVPOOL_TENANT": "team-b"})[0].tenant == "team-b"
    assert parse_extra({"tenant": "team-a"}, env={"KVPOOL_TENANT": "team-b"})[0].tenant == "team-a"
    with pytest.raises(ConfigError, match="KVPOOL_TENANT: tenant name '_x'"):
        parse_extra({}, env={"KVPOOL_TENANT": "_x"})

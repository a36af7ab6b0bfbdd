"""Which configuration errors mean "no pool here" and which mean "fix a setting"."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.config import load_config
from kvpool.errors import ConfigError, PoolNotFound


@pytest.mark.parametrize(
    "content", [None, '{"master_address": "127.0.0.1:1", ', "[1, 2]", b"\xff\xfe"]
)
def test_a_missing_or_unreadable_pool_file_is_pool_not_found(
    tmp_path: Path, content: str | bytes | None
) -> None:
    path = tmp_path / "pool.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(PoolNotFound, match="pool file"):
        load_config({"pool_file": str(path)}, env={})


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
    ],
)
def test_a_bad_setting_is_a_config_error_not_an_absent_pool(
    tmp_path: Path, extra: dict[str, str], env: dict[str, str], needle: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(extra, env={"KVPOOL_HOME": str(tmp_path), **env})
    assert not isinstance(raised.value, PoolNotFound)
    assert needle in str(raised.value)


@pytest.mark.parametrize("bad", ["nan", float("nan"), "inf", float("-inf"), True, "ten", None])
def test_numbers_are_parsed_by_one_rule_in_pool_and_connector_settings(bad: object) -> None:
    """NaN, infinities and bools are refused alike by the pool config and the
    connector settings (they once disagreed: the connector took NaN)."""
    from kvpool.config import PoolConfig
    from kvpool.settings import parse_extra

    with pytest.raises(ConfigError, match="load_timeout_s"):
        parse_extra({"load_timeout_s": bad})
    with pytest.raises(ConfigError, match="transfer_timeout_s"):
        load_config({"transfer_timeout_s": bad}, env={})
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
